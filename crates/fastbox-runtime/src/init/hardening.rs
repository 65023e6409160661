//! The last steps before exec: capabilities cut to Docker's default set minus `NET_RAW`,
//! `no_new_privs`, and the seccomp filter (installed last); execd's OOM score is set before.

use caps::{CapSet, Capability, CapsHashSet};

/// Docker's default capability set, minus `CAP_NET_RAW` (no raw sockets, no ping spoofing).
pub const SANDBOX_CAPABILITIES: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_MKNOD,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// Compile the seccomp filter (before the fork: compiling allocates).
pub(super) fn seccomp_program(isolation: bool) -> Result<seccompiler::BpfProgram, String> {
    match isolation {
        true => crate::seccomp::compile_isolation(),
        false => crate::seccomp::compile_default(),
    }
    .map_err(|e| format!("seccomp policy: {e}"))
}

/// execd is the last process the OOM killer picks (its children reset this to 0). Set in the
/// helper, before the fork: the value is inherited. Lowering the score needs
/// `CAP_SYS_RESOURCE`; a host that withholds it from fastbox (some container hosts do) keeps
/// the default score, which is reported on stderr rather than failing the start.
pub(super) fn protect_from_oom() -> Result<(), String> {
    match std::fs::write("/proc/self/oom_score_adj", "-1000") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("fastbox: cannot lower execd's oom_score_adj (no CAP_SYS_RESOURCE): {e}");
            Ok(())
        }
        Err(e) => Err(format!("oom_score_adj: {e}")),
    }
}

pub(super) fn apply(seccomp: &seccompiler::BpfProgram, keep_mknod: bool) -> Result<(), String> {
    let keep: CapsHashSet = SANDBOX_CAPABILITIES
        .iter()
        .copied()
        .filter(|c| keep_mknod || *c != Capability::CAP_MKNOD)
        .collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap)
                .map_err(|e| format!("drop {cap} from the bounding set: {e}"))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| format!("clear ambient caps: {e}"))?;
    for set in [CapSet::Inheritable, CapSet::Effective, CapSet::Permitted] {
        caps::set(None, set, &keep).map_err(|e| format!("set {set:?} caps: {e}"))?;
    }

    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) has no memory-safety preconditions.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(format!("no_new_privs: {}", std::io::Error::last_os_error()));
    }
    crate::seccomp::install(seccomp).map_err(|e| format!("seccomp: {e}"))
}
