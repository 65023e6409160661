//! Names to numbers for the system calls the policy may name, for the build target.
//!
//! Numbers come from `libc` (the kernel's own tables); the three obsolete module calls that
//! `libc` no longer lists, and `open_tree_attr` (Linux 6.15, newer than `libc`), are written
//! out. Calls that do not exist on an architecture are listed as absent there, so a policy
//! that names them still compiles (there is nothing to deny). A name that is neither known
//! nor absent is an error: a typo in the policy must not silently allow a call.
//!
//! To let the policy name a new system call, add it here.

use libc::c_long;

/// How a system call name resolves on the build target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    Number(c_long),
    /// The call does not exist on this architecture.
    Absent,
}

/// Resolves `name` for the build target; `None` for a name this table does not know.
pub(crate) fn resolve(name: &str) -> Option<Resolved> {
    if let Some((_, nr)) = COMMON.iter().chain(ARCH_ONLY).find(|(n, _)| *n == name) {
        return Some(Resolved::Number(*nr));
    }
    ABSENT.contains(&name).then_some(Resolved::Absent)
}

/// Every name this table knows (for tests and docs).
#[cfg(test)]
pub(crate) fn known_names() -> impl Iterator<Item = &'static str> {
    COMMON
        .iter()
        .chain(ARCH_ONLY)
        .map(|(n, _)| *n)
        .chain(ABSENT.iter().copied())
}

/// `open_tree_attr` has number 467 on every architecture (unified numbering since Linux 5.1).
const SYS_OPEN_TREE_ATTR: c_long = 467;

/// System calls present on both x86_64 and aarch64.
const COMMON: &[(&str, c_long)] = &[
    ("acct", libc::SYS_acct),
    ("add_key", libc::SYS_add_key),
    ("adjtimex", libc::SYS_adjtimex),
    ("bpf", libc::SYS_bpf),
    ("chroot", libc::SYS_chroot),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("clock_settime", libc::SYS_clock_settime),
    ("clone", libc::SYS_clone),
    ("clone3", libc::SYS_clone3),
    ("delete_module", libc::SYS_delete_module),
    ("fanotify_init", libc::SYS_fanotify_init),
    ("finit_module", libc::SYS_finit_module),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fsopen", libc::SYS_fsopen),
    ("fspick", libc::SYS_fspick),
    ("get_mempolicy", libc::SYS_get_mempolicy),
    ("init_module", libc::SYS_init_module),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("kcmp", libc::SYS_kcmp),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("kexec_load", libc::SYS_kexec_load),
    ("keyctl", libc::SYS_keyctl),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("mbind", libc::SYS_mbind),
    ("migrate_pages", libc::SYS_migrate_pages),
    ("mknodat", libc::SYS_mknodat),
    ("mount", libc::SYS_mount),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("move_mount", libc::SYS_move_mount),
    ("move_pages", libc::SYS_move_pages),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("nfsservctl", libc::SYS_nfsservctl),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("open_tree", libc::SYS_open_tree),
    ("open_tree_attr", SYS_OPEN_TREE_ATTR),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("personality", libc::SYS_personality),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("pivot_root", libc::SYS_pivot_root),
    ("process_madvise", libc::SYS_process_madvise),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("ptrace", libc::SYS_ptrace),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("reboot", libc::SYS_reboot),
    ("request_key", libc::SYS_request_key),
    ("seccomp", libc::SYS_seccomp),
    ("set_mempolicy", libc::SYS_set_mempolicy),
    ("set_mempolicy_home_node", libc::SYS_set_mempolicy_home_node),
    ("setdomainname", libc::SYS_setdomainname),
    ("sethostname", libc::SYS_sethostname),
    ("setns", libc::SYS_setns),
    ("settimeofday", libc::SYS_settimeofday),
    ("socket", libc::SYS_socket),
    ("swapoff", libc::SYS_swapoff),
    ("swapon", libc::SYS_swapon),
    ("syslog", libc::SYS_syslog),
    ("umount2", libc::SYS_umount2),
    ("unshare", libc::SYS_unshare),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("vhangup", libc::SYS_vhangup),
];

#[cfg(target_arch = "x86_64")]
const ARCH_ONLY: &[(&str, c_long)] = &[
    ("_sysctl", libc::SYS__sysctl),
    // Not in `libc` any more; numbers from arch/x86/entry/syscalls/syscall_64.tbl.
    ("create_module", 174),
    ("get_kernel_syms", 177),
    ("query_module", 178),
    ("ioperm", libc::SYS_ioperm),
    ("iopl", libc::SYS_iopl),
    ("mknod", libc::SYS_mknod),
    ("sysfs", libc::SYS_sysfs),
    ("uselib", libc::SYS_uselib),
    ("ustat", libc::SYS_ustat),
];

#[cfg(target_arch = "x86_64")]
const ABSENT: &[&str] = &[];

#[cfg(target_arch = "aarch64")]
const ARCH_ONLY: &[(&str, c_long)] = &[];

/// The generic syscall table (aarch64) never had these.
#[cfg(target_arch = "aarch64")]
const ABSENT: &[&str] = &[
    "_sysctl",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "ioperm",
    "iopl",
    "mknod",
    "sysfs",
    "uselib",
    "ustat",
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("fastbox's seccomp syscall table covers x86_64 and aarch64 only");
