//! Cgroup limits (v1 and v2): cpu, memory, pids.
