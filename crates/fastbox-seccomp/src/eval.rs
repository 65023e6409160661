//! A classic-BPF interpreter for the instructions the compiler emits, so tests can ask what
//! the filter answers for a call without installing it.

use seccompiler::sock_filter;

use super::program::{BPF_JMP_JA, BPF_JMP_JEQ_K, BPF_JMP_JGE_K, BPF_LD_W_ABS, BPF_RET_K};

/// Opcodes only `seccompiler`'s argument conditions emit.
const BPF_ALU_AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K
const BPF_JMP_JGT_K: u16 = 0x25; // BPF_JMP | BPF_JGT | BPF_K

/// `struct seccomp_data` as the kernel hands it to the filter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeccompData {
    pub nr: i32,
    pub arch: u32,
    pub instruction_pointer: u64,
    pub args: [u64; 6],
}

impl SeccompData {
    fn bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&self.nr.to_le_bytes());
        b[4..8].copy_from_slice(&self.arch.to_le_bytes());
        b[8..16].copy_from_slice(&self.instruction_pointer.to_le_bytes());
        for (i, a) in self.args.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        b
    }
}

/// Runs `program` on `data` and returns the filter's verdict (`SECCOMP_RET_*`).
pub(crate) fn run(program: &[sock_filter], data: &SeccompData) -> u32 {
    let bytes = data.bytes();
    let mut acc: u32 = 0;
    let mut pc = 0usize;
    loop {
        let insn = program
            .get(pc)
            .unwrap_or_else(|| panic!("fell off the end of the program at {pc}"));
        pc += 1;
        let branch = |taken: bool| usize::from(if taken { insn.jt } else { insn.jf });
        match insn.code {
            BPF_LD_W_ABS => {
                let off = insn.k as usize;
                acc = u32::from_le_bytes(bytes[off..off + 4].try_into().expect("4 bytes"));
            }
            BPF_ALU_AND_K => acc &= insn.k,
            BPF_JMP_JA => pc += insn.k as usize,
            BPF_JMP_JEQ_K => pc += branch(acc == insn.k),
            BPF_JMP_JGT_K => pc += branch(acc > insn.k),
            BPF_JMP_JGE_K => pc += branch(acc >= insn.k),
            BPF_RET_K => return insn.k,
            other => panic!("instruction {other:#x} at {} not interpreted", pc - 1),
        }
    }
}
