//! The seccomp policy: reviewed data compiled to a BPF filter; and the kernel interfaces every
//! sandbox masks ([`masks`]), the other half of what a sandbox may not reach.
//!
//! The policy lives in `seccomp/default.json` (embedded at build time): allow by default,
//! deny a reviewed list of calls, each rule with its reason. `docs/seccomp.md` is the table a
//! reviewer reads and says how to change it. Why a deny list and not Docker's allow list: the
//! sandbox runs arbitrary Linux software, a denied call the workload needs is a support case,
//! and the dangerous calls are few and known; capabilities, namespaces and cgroups do the
//! rest.
//!
//! Use: [`compile`] (or [`compile_default`]) **before** forking, since compiling allocates;
//! then in the child, after `PR_SET_NO_NEW_PRIVS`, [`install`], which only makes the
//! `seccomp(2)` call and is safe between `fork` and `exec`. The filter is installed last,
//! right before `exec`, so the runtime's own set-up calls (mounts, `unshare`) are not
//! filtered.
//!
//! What the compiled filter does beyond the rules: a call through a foreign ABI (i386
//! `int 0x80` on x86_64) kills the process, because its numbers mean other calls; an x32
//! call (bit 30 of the number) gets ENOSYS.
//!
//! CRIU: a checkpoint records the filter (`PTRACE_SECCOMP_GET_FILTER`) and a restore
//! reinstalls it as the last step; CRIU suspends the filter while it works on a task
//! (`PTRACE_O_SUSPEND_SECCOMP`), so the policy does not constrain CRIU's parasite code.

pub mod masks;
mod policy;
mod program;
mod syscalls;

#[cfg(test)]
mod eval;

pub use policy::{
    ArgCondition, ArgMatch, ArgWidth, CmpOp, DefaultAction, Errno, Note, Policy, Rule, Word,
};
pub use seccompiler::{BpfProgram, TargetArch};

/// The reviewed policy, as shipped.
pub const DEFAULT_POLICY_JSON: &str = include_str!("../seccomp/default.json");

/// The architecture this crate was built for: the only one [`compile`] accepts, because the
/// syscall numbers come from `libc` for the build target.
#[cfg(target_arch = "x86_64")]
pub const NATIVE_ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
pub const NATIVE_ARCH: TargetArch = TargetArch::aarch64;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("parse seccomp policy: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("invalid seccomp policy: {0}")]
    Invalid(String),
    #[error("seccomp policy names unknown system call {name:?} (add it to seccomp/syscalls.rs)")]
    UnknownSyscall { name: String },
    #[error(
        "cannot compile seccomp policy for {arch:?}: syscall numbers are known only for {native:?}"
    )]
    ForeignArch {
        arch: TargetArch,
        native: TargetArch,
    },
    #[error("compile seccomp filter: {0}")]
    Backend(#[from] seccompiler::BackendError),
    #[error("seccomp filter has {len} instructions; the kernel accepts at most {max}")]
    TooLarge { len: usize, max: usize },
    #[error("refusing to install an empty seccomp filter")]
    Empty,
    #[error("install seccomp filter: {0}")]
    Install(#[source] std::io::Error),
}

/// Parses and validates a policy document.
pub fn parse_policy(json: &str) -> Result<Policy, SeccompError> {
    let policy: Policy = serde_json::from_str(json)?;
    policy.validate()?;
    Ok(policy)
}

/// The shipped policy. The embedded document is checked by this module's tests, so a failure
/// here is a build defect, not a runtime condition.
pub fn default_policy() -> Policy {
    parse_policy(DEFAULT_POLICY_JSON).expect("the embedded seccomp/default.json is valid")
}

/// Calls the isolation variant ([`isolation_policy`]) allows that the default denies: what
/// execd needs to build an isolated session (`unshare` of a user namespace owning fresh
/// mount, pid, ipc, uts and network namespaces; its mounts and its root). Everything else
/// stays denied: `setns`, namespace flags on `clone`, the new mount API (`fsopen`,
/// `open_tree`, `move_mount`...).
pub const ISOLATION_ALLOWS: &[&str] =
    &["mount", "umount2", "mount_setattr", "pivot_root", "unshare"];

/// The policy of a sandbox created with isolated sessions: the default less the rules for
/// [`ISOLATION_ALLOWS`]. Only execd holds it: it stacks the default filter on every process
/// it starts, so a workload in such a sandbox is filtered exactly as anywhere else.
pub fn isolation_policy() -> Policy {
    let mut policy = default_policy();
    policy.description = format!(
        "{} Isolation variant: also allows {}.",
        policy.description,
        ISOLATION_ALLOWS.join(", ")
    );
    for rule in &mut policy.rules {
        rule.syscalls
            .retain(|name| !ISOLATION_ALLOWS.contains(&name.as_str()));
    }
    policy.rules.retain(|rule| !rule.syscalls.is_empty());
    policy
}

/// Compiles `policy` to a BPF program for `arch`, which must be [`NATIVE_ARCH`].
pub fn compile(policy: &Policy, arch: TargetArch) -> Result<BpfProgram, SeccompError> {
    if arch != NATIVE_ARCH {
        return Err(SeccompError::ForeignArch {
            arch,
            native: NATIVE_ARCH,
        });
    }
    program::build(policy, arch)
}

/// [`compile`] of [`default_policy`] for [`NATIVE_ARCH`].
pub fn compile_default() -> Result<BpfProgram, SeccompError> {
    compile(&default_policy(), NATIVE_ARCH)
}

/// [`compile`] of [`isolation_policy`] for [`NATIVE_ARCH`].
pub fn compile_isolation() -> Result<BpfProgram, SeccompError> {
    compile(&isolation_policy(), NATIVE_ARCH)
}

/// Installs `program` as a seccomp filter of the calling thread (and of everything it execs
/// or forks afterwards).
///
/// The caller must have set `PR_SET_NO_NEW_PRIVS` (or hold `CAP_SYS_ADMIN`); the kernel
/// answers EACCES otherwise. No `TSYNC`: call it from a single-threaded process (the
/// sandbox's helper before `exec`, or a `pre_exec` hook).
///
/// Async-signal-safe: no allocation, no locks, one system call; fit for `pre_exec`.
pub fn install(program: &BpfProgram) -> Result<(), SeccompError> {
    if program.is_empty() {
        return Err(SeccompError::Empty);
    }
    if program.len() > program::MAX_INSTRUCTIONS {
        return Err(SeccompError::TooLarge {
            len: program.len(),
            max: program::MAX_INSTRUCTIONS,
        });
    }
    let fprog = libc::sock_fprog {
        // Fits: checked against MAX_INSTRUCTIONS (4096) above.
        len: program.len() as libc::c_ushort,
        // seccompiler's `sock_filter` is `#[repr(C)]` with the kernel's layout (u16, u8, u8,
        // u32), the same as libc's; the kernel only reads through this pointer.
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `program`, which outlives the call; the kernel copies the
    // filter before returning and writes nothing through the pointer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0 as libc::c_ulong,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(SeccompError::Install(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Output, Stdio};

    use super::eval::{SeccompData, run};
    use super::program::{AUDIT_ARCH_AARCH64, AUDIT_ARCH_X86_64};
    use super::syscalls::{Resolved, resolve};
    use super::*;

    const DOCS: &str = include_str!("../../../docs/seccomp.md");

    fn ret_errno(errno: i32) -> u32 {
        libc::SECCOMP_RET_ERRNO | errno as u32
    }

    #[test]
    fn default_policy_parses_and_validates() {
        let policy = default_policy();
        assert_eq!(policy.default_action, DefaultAction::Allow);
        assert!(policy.rules.len() >= 20, "{} rules", policy.rules.len());
    }

    #[test]
    fn every_rule_and_note_has_a_reason() {
        let policy = default_policy();
        let notes = policy.allowed.iter().chain(&policy.not_applicable);
        for (syscalls, reason) in policy
            .rules
            .iter()
            .map(|r| (&r.syscalls, &r.reason))
            .chain(notes.map(|n| (&n.syscalls, &n.reason)))
        {
            assert!(
                reason.split_whitespace().count() >= 8,
                "{syscalls:?}: reason too thin: {reason:?}"
            );
        }
    }

    #[test]
    fn every_named_syscall_resolves_on_the_native_arch() {
        let policy = default_policy();
        let named = policy
            .rules
            .iter()
            .flat_map(|r| &r.syscalls)
            .chain(policy.allowed.iter().flat_map(|n| &n.syscalls));
        for name in named {
            let resolved = resolve(name);
            assert!(resolved.is_some(), "{name} does not resolve");
            #[cfg(target_arch = "x86_64")]
            assert!(
                matches!(resolved, Some(Resolved::Number(_))),
                "{name} is not a system call on x86_64"
            );
        }
        for name in policy.not_applicable.iter().flat_map(|n| &n.syscalls) {
            assert_eq!(resolve(name), None, "{name} is listed as not applicable");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn syscall_table_spot_checks_on_x86_64() {
        // From arch/x86/entry/syscalls/syscall_64.tbl.
        for (name, nr) in [
            ("clone", 56),
            ("clone3", 435),
            ("unshare", 272),
            ("setns", 308),
            ("mount", 165),
            ("keyctl", 250),
            ("bpf", 321),
            ("io_uring_setup", 425),
            ("create_module", 174),
            ("get_kernel_syms", 177),
            ("query_module", 178),
            ("open_tree_attr", 467),
            ("mount_setattr", 442),
        ] {
            assert_eq!(resolve(name), Some(Resolved::Number(nr)), "{name}");
        }
        assert_eq!(resolve("not_a_syscall"), None);
        assert!(super::syscalls::known_names().count() >= 75);
    }

    #[test]
    fn default_policy_compiles_within_the_kernel_limit() {
        let program = compile_default().unwrap();
        assert!(program.len() < 1024, "{} instructions", program.len());
    }

    #[test]
    fn compile_refuses_a_foreign_arch() {
        let other = if NATIVE_ARCH == TargetArch::x86_64 {
            TargetArch::aarch64
        } else {
            TargetArch::x86_64
        };
        let err = compile(&default_policy(), other).unwrap_err();
        assert!(matches!(err, SeccompError::ForeignArch { .. }), "{err}");
    }

    #[test]
    fn docs_list_every_syscall_of_the_policy() {
        let policy = default_policy();
        let all = policy
            .rules
            .iter()
            .flat_map(|r| &r.syscalls)
            .chain(policy.allowed.iter().flat_map(|n| &n.syscalls))
            .chain(policy.not_applicable.iter().flat_map(|n| &n.syscalls));
        for name in all {
            assert!(
                DOCS.contains(&format!("`{name}`")),
                "docs/seccomp.md does not mention `{name}`"
            );
        }
    }

    /// The isolation variant differs from the default in exactly [`ISOLATION_ALLOWS`]: those
    /// are allowed (namespace flags on `clone` too), every other verdict is the default's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn isolation_variant_allows_only_what_sessions_need() {
        let (default, variant) = (compile_default().unwrap(), compile_isolation().unwrap());
        let verdict = |program: &BpfProgram, nr: libc::c_long, args: [u64; 6]| {
            run(
                program,
                &SeccompData {
                    nr: nr as i32,
                    arch: AUDIT_ARCH_X86_64,
                    instruction_pointer: 0,
                    args,
                },
            )
        };
        let z = [0u64; 6];
        let allow = libc::SECCOMP_RET_ALLOW;
        let newuser_ns = (libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID) as u64;
        for (nr, args) in [
            (libc::SYS_mount, z),
            (libc::SYS_umount2, z),
            (libc::SYS_mount_setattr, z),
            (libc::SYS_pivot_root, z),
            (libc::SYS_unshare, [newuser_ns, 0, 0, 0, 0, 0]),
        ] {
            assert_ne!(verdict(&default, nr, args), allow, "default allows {nr}");
            assert_eq!(verdict(&variant, nr, args), allow, "variant denies {nr}");
        }
        let allowed: Vec<i64> = ISOLATION_ALLOWS
            .iter()
            .map(|name| match resolve(name) {
                Some(Resolved::Number(nr)) => nr,
                other => panic!("{name}: {other:?}"),
            })
            .collect();
        // Every other call keeps the default's verdict, with and without arguments that
        // match the conditional rules.
        let probes = [
            z,
            [u64::MAX; 6],
            [libc::AF_VSOCK as u64, 0, 0, 0, 0, 0],
            [libc::AF_NETLINK as u64, libc::SOCK_RAW as u64, 9, 0, 0, 0],
            [0x0040000, 0, 0, 0, 0, 0],
        ];
        for nr in 0..460i64 {
            if allowed.contains(&nr) {
                continue;
            }
            for args in probes {
                assert_eq!(
                    verdict(&variant, nr, args),
                    verdict(&default, nr, args),
                    "syscall {nr} {args:?}"
                );
            }
        }
        assert_eq!(
            verdict(&variant, libc::SYS_clone3, z),
            ret_errno(libc::ENOSYS),
            "clone3 stays ENOSYS"
        );
    }

    /// Verdicts of the compiled default filter, computed by interpreting the BPF.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn default_filter_verdicts() {
        let program = compile_default().unwrap();
        let verdict = |nr: libc::c_long, args: [u64; 6]| {
            run(
                &program,
                &SeccompData {
                    nr: nr as i32,
                    arch: AUDIT_ARCH_X86_64,
                    instruction_pointer: 0,
                    args,
                },
            )
        };
        let allow = libc::SECCOMP_RET_ALLOW;
        let eperm = ret_errno(libc::EPERM);
        let z = [0u64; 6];
        let thread_flags = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        let cases: &[(&str, libc::c_long, [u64; 6], u32)] = &[
            ("getpid", libc::SYS_getpid, z, allow),
            ("read", libc::SYS_read, z, allow),
            ("execve", libc::SYS_execve, z, allow),
            ("ptrace", libc::SYS_ptrace, z, allow),
            ("sethostname", libc::SYS_sethostname, z, allow),
            ("kexec_load", libc::SYS_kexec_load, z, eperm),
            ("init_module", libc::SYS_init_module, z, eperm),
            ("bpf", libc::SYS_bpf, z, eperm),
            ("keyctl", libc::SYS_keyctl, z, eperm),
            ("mount", libc::SYS_mount, z, eperm),
            ("umount2", libc::SYS_umount2, z, eperm),
            ("fsopen", libc::SYS_fsopen, z, eperm),
            ("open_tree_attr", 467, z, eperm),
            ("unshare(0)", libc::SYS_unshare, z, eperm),
            ("setns", libc::SYS_setns, z, eperm),
            ("userfaultfd", libc::SYS_userfaultfd, z, eperm),
            ("io_uring_setup", libc::SYS_io_uring_setup, z, eperm),
            ("clone3", libc::SYS_clone3, z, ret_errno(libc::ENOSYS)),
            (
                "fork-like clone",
                libc::SYS_clone,
                [libc::SIGCHLD as u64, 0, 0, 0, 0, 0],
                allow,
            ),
            (
                "thread clone",
                libc::SYS_clone,
                [thread_flags, 0, 0, 0, 0, 0],
                allow,
            ),
            (
                "clone NEWUSER",
                libc::SYS_clone,
                [(libc::CLONE_NEWUSER | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWNET",
                libc::SYS_clone,
                [libc::CLONE_NEWNET as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWNS",
                libc::SYS_clone,
                [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWPID",
                libc::SYS_clone,
                [libc::CLONE_NEWPID as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWIPC",
                libc::SYS_clone,
                [libc::CLONE_NEWIPC as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWUTS",
                libc::SYS_clone,
                [libc::CLONE_NEWUTS as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone NEWCGROUP",
                libc::SYS_clone,
                [libc::CLONE_NEWCGROUP as u64, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "clone, flag bits only in the upper half",
                libc::SYS_clone,
                [0x7E02_0000u64 << 32, 0, 0, 0, 0, 0],
                allow,
            ),
            ("personality(PER_LINUX)", libc::SYS_personality, z, allow),
            (
                "personality(query)",
                libc::SYS_personality,
                [0xffff_ffff, 0, 0, 0, 0, 0],
                allow,
            ),
            (
                "personality(UNAME26)",
                libc::SYS_personality,
                [0x20000, 0, 0, 0, 0, 0],
                allow,
            ),
            (
                "personality(ADDR_NO_RANDOMIZE)",
                libc::SYS_personality,
                [0x0040000, 0, 0, 0, 0, 0],
                eperm,
            ),
            (
                "personality(PER_LINUX) with garbage in the upper half",
                libc::SYS_personality,
                [0xdead_beef_0000_0000, 0, 0, 0, 0, 0],
                allow,
            ),
            (
                "socket(AF_INET)",
                libc::SYS_socket,
                [libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0, 0, 0, 0],
                allow,
            ),
            (
                "socket(AF_VSOCK)",
                libc::SYS_socket,
                [libc::AF_VSOCK as u64, libc::SOCK_STREAM as u64, 0, 0, 0, 0],
                ret_errno(libc::EAFNOSUPPORT),
            ),
            (
                "socket(AF_NETLINK, NETLINK_ROUTE)",
                libc::SYS_socket,
                [libc::AF_NETLINK as u64, libc::SOCK_RAW as u64, 0, 0, 0, 0],
                allow,
            ),
            (
                "socket(AF_NETLINK, NETLINK_AUDIT)",
                libc::SYS_socket,
                [libc::AF_NETLINK as u64, libc::SOCK_RAW as u64, 9, 0, 0, 0],
                ret_errno(libc::EPROTONOSUPPORT),
            ),
            (
                "socket(AF_INET, protocol 9)",
                libc::SYS_socket,
                [libc::AF_INET as u64, libc::SOCK_RAW as u64, 9, 0, 0, 0],
                allow,
            ),
            (
                "x32 getpid",
                0x4000_0000 | libc::SYS_getpid,
                z,
                ret_errno(libc::ENOSYS),
            ),
        ];
        for (what, nr, args, want) in cases {
            assert_eq!(verdict(*nr, *args), *want, "{what}");
        }
        // Every unconditional rule answers with its errno.
        for rule in default_policy()
            .rules
            .iter()
            .filter(|r| r.match_any.is_empty())
        {
            for name in &rule.syscalls {
                let Some(Resolved::Number(nr)) = resolve(name) else {
                    panic!("{name}")
                };
                assert_eq!(verdict(nr, z), ret_errno(rule.errno.raw()), "{name}");
            }
        }
        // Everything else in the number range is allowed.
        let denied: Vec<libc::c_long> = default_policy()
            .denied_syscalls()
            .iter()
            .filter_map(|n| match resolve(n) {
                Some(Resolved::Number(nr)) => Some(nr),
                _ => None,
            })
            .collect();
        for nr in (0..500).filter(|nr| !denied.contains(nr)) {
            assert_eq!(verdict(nr, z), allow, "syscall {nr}");
        }
        // i386 calls kill the process.
        let i386 = SeccompData {
            nr: 1,
            arch: 3 | 0x4000_0000, // AUDIT_ARCH_I386: EM_386 | __AUDIT_ARCH_LE
            instruction_pointer: 0,
            args: z,
        };
        assert_eq!(run(&program, &i386), libc::SECCOMP_RET_KILL_PROCESS);
    }

    fn invalid(json: &str) -> String {
        match parse_policy(json) {
            Err(e) => e.to_string(),
            Ok(p) => match compile(&p, NATIVE_ARCH) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("accepted: {json}"),
            },
        }
    }

    #[test]
    fn malformed_policies_are_rejected_with_the_reason() {
        let wrap = |rules: &str| {
            format!(r#"{{"version": 1, "default_action": "allow", "rules": [{rules}]}}"#)
        };
        let cases = [
            (
                wrap(r#"{"syscalls": ["bpf"], "errno": "EPERM", "reason": " "}"#),
                "rule 0 (bpf) has no reason",
            ),
            (
                wrap(r#"{"syscalls": ["bfp"], "errno": "EPERM", "reason": "typo"}"#),
                "unknown system call \"bfp\"",
            ),
            (
                wrap(r#"{"syscalls": ["bpf"], "errno": "EPRM", "reason": "x"}"#),
                "unknown variant `EPRM`",
            ),
            (
                wrap(
                    r#"{"syscalls": ["bpf"], "errno": "EPERM", "reason": "x"},
                       {"syscalls": ["bpf"], "errno": "EPERM", "reason": "y"}"#,
                ),
                "bpf: rule 0 denies it unconditionally, so rule 1 never applies",
            ),
            (
                wrap(
                    r#"{"syscalls": ["clone"], "errno": "EPERM", "reason": "x",
                        "match_any": [{"args": [{"index": 0, "op": "masked_eq", "value": 1}]}]}"#,
                ),
                "masked_eq needs a mask",
            ),
            (
                wrap(
                    r#"{"syscalls": ["socket"], "errno": "EPERM", "reason": "x",
                        "match_any": [{"args": [{"index": 0, "width": 32, "op": "eq",
                                                 "value": "0x100000000"}]}]}"#,
                ),
                "wider than 32 bits",
            ),
            (
                wrap(
                    r#"{"syscalls": ["socket"], "errno": "EPERM", "reason": "x",
                        "match_any": [{"args": [{"index": 6, "op": "eq", "value": 1}]}]}"#,
                ),
                "argument index 6",
            ),
            (
                wrap(r#"{"syscalls": ["bpf"], "errno": "EPERM", "reason": "x", "extra": 1}"#),
                "unknown field `extra`",
            ),
            (
                r#"{"version": 2, "default_action": "allow", "rules": []}"#.to_string(),
                "version 2",
            ),
            (
                r#"{"version": 1, "default_action": "allow", "rules": [
                    {"syscalls": ["bpf"], "errno": "EPERM", "reason": "x"}],
                    "allowed": [{"syscalls": ["bpf"], "reason": "y"}]}"#
                    .to_string(),
                "bpf is in allowed and also in rule 0",
            ),
        ];
        for (json, want) in cases {
            let got = invalid(&json);
            assert!(got.contains(want), "want {want:?} in {got:?}");
        }
    }

    #[test]
    fn a_conditional_rule_before_an_unconditional_one_keeps_its_own_errno() {
        let policy = parse_policy(
            r#"{"version": 1, "default_action": "allow", "rules": [
                {"syscalls": ["socket"], "errno": "EAFNOSUPPORT", "reason": "vsock",
                 "match_any": [{"args": [{"index": 0, "width": 32, "op": "eq", "value": 40}]}]},
                {"syscalls": ["socket"], "errno": "EPERM", "reason": "all other sockets"}]}"#,
        )
        .unwrap();
        let program = compile(&policy, NATIVE_ARCH).unwrap();
        let arch = if NATIVE_ARCH == TargetArch::x86_64 {
            AUDIT_ARCH_X86_64
        } else {
            AUDIT_ARCH_AARCH64
        };
        let socket = |domain: u64| SeccompData {
            nr: libc::SYS_socket as i32,
            arch,
            instruction_pointer: 0,
            args: [domain, 1, 0, 0, 0, 0],
        };
        assert_eq!(run(&program, &socket(40)), ret_errno(libc::EAFNOSUPPORT));
        assert_eq!(run(&program, &socket(2)), ret_errno(libc::EPERM));
    }

    #[test]
    fn policy_round_trips_through_serde() {
        let policy = default_policy();
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(parse_policy(&json).unwrap(), policy);
    }

    // ---- The filter installed for real, in child processes. Needs no privilege: seccomp
    // with no_new_privs is available to every process.

    /// Spawns `cmd` with the default filter installed between fork and exec.
    fn run_filtered(mut cmd: Command) -> Output {
        let program = compile_default().unwrap();
        // SAFETY: the hook only makes the prctl and seccomp system calls on memory moved
        // into the closure before the fork; no allocation, no locks.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                match install(&program) {
                    Ok(()) => Ok(()),
                    Err(SeccompError::Install(e)) => Err(e),
                    Err(_) => Err(io::Error::from_raw_os_error(libc::EINVAL)),
                }
            });
        }
        cmd.stdin(Stdio::null()).output().expect("spawn")
    }

    fn sh(script: &str) -> Output {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(script);
        run_filtered(cmd)
    }

    #[test]
    fn ordinary_commands_work_under_the_filter() {
        let out = sh("true");
        assert!(out.status.success(), "{out:?}");
        let out = sh("ls / >/dev/null && echo listed");
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "listed");
        let out = sh("bash -c 'echo $((1+1))'");
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "2");
        // Pipelines and subshells fork through clone (after clone3's ENOSYS).
        let out = sh("echo a | (cat; echo b) | wc -l");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "2", "{out:?}");
    }

    #[test]
    fn unshare_and_mount_commands_fail_with_eperm() {
        let out = sh("unshare -n true");
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Operation not permitted"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let out = sh(&format!("mount -t tmpfs fbtest {}", dir.path().display()));
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(
            err.contains("permission denied") || err.contains("not permitted"),
            "{err}"
        );
    }

    const PROBE_ENV: &str = "FASTBOX_SECCOMP_PROBE";

    /// Runs this test binary again with the filter installed, in probe mode: the child runs
    /// `probe` and prints `PROBE ok` or `PROBE errno=N`.
    fn probe(name: &str) -> Result<(), i32> {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "tests::probe_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PROBE_ENV, name);
        let out = run_filtered(cmd);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("PROBE ").map(|(_, r)| r.trim()))
            .unwrap_or_else(|| panic!("probe {name}: no result: {out:?}"));
        match line.strip_prefix("errno=") {
            None if line == "ok" => Ok(()),
            Some(n) => Err(n.parse().unwrap()),
            None => panic!("probe {name}: {line}"),
        }
    }

    /// The child side of [`probe`]; does nothing in a normal test run.
    #[test]
    fn probe_child() {
        let Ok(name) = std::env::var(PROBE_ENV) else {
            return;
        };
        let result = probe_syscall(&name);
        match result {
            Ok(()) => println!("\nPROBE ok"),
            Err(e) => println!("\nPROBE errno={e}"),
        }
    }

    fn check(rc: libc::c_long) -> Result<(), i32> {
        if rc < 0 {
            Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(())
        }
    }

    fn probe_syscall(name: &str) -> Result<(), i32> {
        // SAFETY: (all arms) raw system calls with scalar arguments or pointers to live
        // locals; a clone that unexpectedly succeeds exits the child at once.
        unsafe {
            match name {
                "getpid" => check(libc::syscall(libc::SYS_getpid)),
                "thread" => std::thread::spawn(|| 42)
                    .join()
                    .map_err(|_| 0)
                    .and_then(|v| if v == 42 { Ok(()) } else { Err(0) }),
                "fork" => {
                    let pid = libc::fork();
                    if pid == 0 {
                        libc::_exit(0);
                    }
                    if pid > 0 {
                        libc::waitpid(pid, std::ptr::null_mut(), 0);
                    }
                    check(pid.into())
                }
                "clone3" => {
                    #[repr(C)]
                    struct CloneArgs([u64; 11]);
                    let mut args = CloneArgs([0; 11]);
                    args.0[4] = libc::SIGCHLD as u64; // exit_signal
                    let rc = libc::syscall(
                        libc::SYS_clone3,
                        &mut args as *mut CloneArgs,
                        std::mem::size_of::<CloneArgs>(),
                    );
                    if rc == 0 {
                        libc::_exit(0);
                    }
                    check(rc)
                }
                "clone_newuser" => {
                    let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong;
                    let rc = libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0);
                    if rc == 0 {
                        libc::_exit(0);
                    }
                    check(rc)
                }
                "unshare_net" => check(libc::unshare(libc::CLONE_NEWNET).into()),
                "keyctl" => check(libc::syscall(
                    libc::SYS_keyctl,
                    0 as libc::c_long,  // KEYCTL_GET_KEYRING_ID
                    -4 as libc::c_long, // KEY_SPEC_USER_KEYRING
                    0 as libc::c_long,
                )),
                "mount_tmpfs" => {
                    let dir = tempfile::tempdir().unwrap();
                    let target =
                        std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
                    let rc = libc::mount(
                        c"fbtest".as_ptr(),
                        target.as_ptr(),
                        c"tmpfs".as_ptr(),
                        0,
                        std::ptr::null(),
                    );
                    if rc == 0 {
                        libc::umount2(target.as_ptr(), libc::MNT_DETACH);
                    }
                    check(rc.into())
                }
                "bpf" => check(libc::syscall(libc::SYS_bpf, 0, 0, 0)),
                "io_uring_setup" => check(libc::syscall(libc::SYS_io_uring_setup, 1, 0)),
                "userfaultfd" => check(libc::syscall(libc::SYS_userfaultfd, 0)),
                "vsock" => {
                    let fd = libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0);
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    check(fd.into())
                }
                "netlink_audit" => {
                    let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, 9);
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    check(fd.into())
                }
                "unix_socket" => {
                    let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    if fd >= 0 {
                        libc::close(fd);
                    }
                    check(fd.into())
                }
                "personality_query" => check(libc::personality(0xffff_ffff).into()),
                "personality_no_aslr" => check(libc::personality(0x0040000).into()),
                #[cfg(target_arch = "x86_64")]
                "x32_getpid" => check(libc::syscall(0x4000_0000 | libc::SYS_getpid)),
                other => panic!("unknown probe {other}"),
            }
        }
    }

    #[test]
    fn installed_filter_answers_as_the_policy_says() {
        let cases: &[(&str, Result<(), i32>)] = &[
            ("getpid", Ok(())),
            ("thread", Ok(())),
            ("fork", Ok(())),
            ("unix_socket", Ok(())),
            ("personality_query", Ok(())),
            ("clone3", Err(libc::ENOSYS)),
            ("clone_newuser", Err(libc::EPERM)),
            ("unshare_net", Err(libc::EPERM)),
            ("keyctl", Err(libc::EPERM)),
            ("mount_tmpfs", Err(libc::EPERM)),
            ("bpf", Err(libc::EPERM)),
            ("io_uring_setup", Err(libc::EPERM)),
            ("userfaultfd", Err(libc::EPERM)),
            ("vsock", Err(libc::EAFNOSUPPORT)),
            ("netlink_audit", Err(libc::EPROTONOSUPPORT)),
            ("personality_no_aslr", Err(libc::EPERM)),
            #[cfg(target_arch = "x86_64")]
            ("x32_getpid", Err(libc::ENOSYS)),
        ];
        for (name, want) in cases {
            assert_eq!(probe(name), *want, "probe {name}");
        }
    }
}
