//! Policy -> BPF.
//!
//! Each rule becomes one `seccompiler` filter (allow on mismatch, the rule's errno on match),
//! and the filters are chained in rule order: every `RET ALLOW` of a filter becomes a jump to
//! the next filter, and the chain ends in `RET ALLOW`. This keeps "first matching rule
//! decides" exact while letting each rule have its own errno (a `seccompiler` filter has one
//! match action). A prologue in front admits only the native ABI.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use super::SeccompError;
use super::policy::{ArgCondition, ArgWidth, CmpOp, Policy, Rule};
use super::syscalls::{self, Resolved};

/// The kernel's limit on a classic BPF program (`BPF_MAXINSNS`).
pub(crate) const MAX_INSTRUCTIONS: usize = 4096;

// Classic BPF opcodes (linux/bpf_common.h).
pub(crate) const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
pub(crate) const BPF_JMP_JA: u16 = 0x05; // BPF_JMP | BPF_JA
pub(crate) const BPF_JMP_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
pub(crate) const BPF_JMP_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
pub(crate) const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

/// `AUDIT_ARCH_X86_64` and `AUDIT_ARCH_AARCH64` (linux/audit.h).
pub(crate) const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
pub(crate) const AUDIT_ARCH_AARCH64: u32 = 183 | 0x8000_0000 | 0x4000_0000;
/// Bit 30 of the syscall number marks the x32 ABI on x86_64.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

pub(crate) fn build(policy: &Policy, arch: TargetArch) -> Result<BpfProgram, SeccompError> {
    policy.validate()?;
    let mut program = prologue(arch);
    for rule in &policy.rules {
        if let Some(mut filter) = rule_filter(rule, arch)? {
            chain_allows(&mut filter);
            program.append(&mut filter);
        }
    }
    program.push(stmt(BPF_RET_K, libc::SECCOMP_RET_ALLOW));
    if program.len() > MAX_INSTRUCTIONS {
        return Err(SeccompError::TooLarge {
            len: program.len(),
            max: MAX_INSTRUCTIONS,
        });
    }
    Ok(program)
}

/// Kill a process calling through a foreign ABI (i386 `int 0x80`: its numbers mean other
/// calls); answer x32 calls (bit 30) with ENOSYS, as a kernel without x32 support does.
fn prologue(arch: TargetArch) -> BpfProgram {
    match arch {
        TargetArch::x86_64 => vec![
            stmt(BPF_LD_W_ABS, DATA_ARCH),
            jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
            stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
            stmt(BPF_LD_W_ABS, DATA_NR),
            jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
            stmt(BPF_RET_K, errno_action(libc::ENOSYS)),
        ],
        TargetArch::aarch64 => vec![
            stmt(BPF_LD_W_ABS, DATA_ARCH),
            jump(BPF_JMP_JEQ_K, AUDIT_ARCH_AARCH64, 1, 0),
            stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        ],
        // Not reachable: `compile` refuses foreign architectures and the syscall table
        // covers x86_64 and aarch64 only. seccompiler's per-rule check still guards it.
        _ => Vec::new(),
    }
}

fn errno_action(errno: i32) -> u32 {
    libc::SECCOMP_RET_ERRNO | (errno as u32 & libc::SECCOMP_RET_DATA)
}

/// One rule as a stand-alone filter, or `None` when none of its calls exist on `arch`.
fn rule_filter(rule: &Rule, arch: TargetArch) -> Result<Option<BpfProgram>, SeccompError> {
    let conditions = rule
        .match_any
        .iter()
        .map(|m| {
            let conds = m
                .args
                .iter()
                .map(condition)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(SeccompRule::new(conds)?)
        })
        .collect::<Result<Vec<_>, SeccompError>>()?;
    let mut chains: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for name in &rule.syscalls {
        match syscalls::resolve(name) {
            Some(Resolved::Number(nr)) => {
                chains.insert(nr, conditions.clone());
            }
            Some(Resolved::Absent) => {}
            None => return Err(SeccompError::UnknownSyscall { name: name.clone() }),
        }
    }
    if chains.is_empty() {
        return Ok(None);
    }
    let filter = SeccompFilter::new(
        chains,
        SeccompAction::Allow,
        SeccompAction::Errno(rule.errno.raw() as u32),
        arch,
    )?;
    Ok(Some(filter.try_into()?))
}

fn condition(c: &ArgCondition) -> Result<SeccompCondition, SeccompError> {
    let len = match c.width {
        ArgWidth::Bits32 => SeccompCmpArgLen::Dword,
        ArgWidth::Bits64 => SeccompCmpArgLen::Qword,
    };
    let op = match c.op {
        CmpOp::Eq => SeccompCmpOp::Eq,
        CmpOp::Ne => SeccompCmpOp::Ne,
        CmpOp::Lt => SeccompCmpOp::Lt,
        CmpOp::Le => SeccompCmpOp::Le,
        CmpOp::Gt => SeccompCmpOp::Gt,
        CmpOp::Ge => SeccompCmpOp::Ge,
        CmpOp::MaskedEq => SeccompCmpOp::MaskedEq(c.mask.map_or(0, |m| m.0)),
    };
    Ok(SeccompCondition::new(c.index, len, op, c.value.0)?)
}

/// Turns every `RET ALLOW` of `filter` into a jump just past its end, so that a call this
/// rule lets through goes on to the next rule. Instruction count and all other jumps are
/// unchanged.
fn chain_allows(filter: &mut BpfProgram) {
    let len = filter.len();
    for (i, insn) in filter.iter_mut().enumerate() {
        if insn.code == BPF_RET_K && insn.k == libc::SECCOMP_RET_ALLOW {
            *insn = stmt(BPF_JMP_JA, (len - i - 1) as u32);
        }
    }
}
