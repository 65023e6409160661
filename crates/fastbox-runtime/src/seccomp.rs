//! The seccomp policy: reviewed data compiled to a BPF filter.
