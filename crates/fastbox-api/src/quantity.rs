//! Kubernetes-style resource quantities (`500m`, `2Gi`).
