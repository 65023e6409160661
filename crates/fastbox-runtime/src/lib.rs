//! fastbox-runtime: the synchronous sandbox runtime.
//!
//! A sandbox is a process tree in its own pid, mount, network, ipc, uts, cgroup and time
//! namespaces, rooted in an overlay that fastbox mounts outside the sandbox, limited by a
//! cgroup and hardened (capabilities, `no_new_privs`, seccomp, masked kernel interfaces).
//! Everything here is blocking code; callers run it on dedicated threads.

pub mod cgroup;
pub mod checkpoint;
pub mod confine;
pub mod criu;
pub mod criu_stats;
pub mod exec_file;
pub mod execd_binary;
pub mod image_stream;
pub mod init;
pub mod lazy;
pub mod loopdev;
pub mod net;
pub mod post_dump;
pub mod rootfs;
pub mod sandbox;
pub use fastbox_seccomp as seccomp;
pub mod spec;
pub mod tree_copy;
pub mod volume;
