//! The device allow-list ([`super::DEVICE_RULES`]) as a cgroup v2 device program.
//!
//! cgroup v2 has no `devices.allow`: the kernel asks the BPF programs of type
//! `BPF_PROG_TYPE_CGROUP_DEVICE` attached to a task's cgroup and its ancestors whether the task
//! may create (`mknod`), read or write a device node; a refusal is `EPERM`. Such a program
//! reads `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }` (`access_type`
//! is `access << 16 | type`) and returns 1 to allow, 0 to deny. [`compile`] turns the rules
//! into one block per rule, as runc's `devicefilter.go` does:
//!
//! ```text
//!     r2 = type; r3 = access; r4 = major; r5 = minor
//! rule:
//!     if r2 != TYPE goto next_rule
//!     r1 = r3; r1 &= ACCESS; if r1 != r3 goto next_rule   (the access asked is a subset)
//!     if r4 != MAJOR goto next_rule
//!     if r5 != MINOR goto next_rule
//!     r0 = 1; exit
//! next_rule: ...
//!     r0 = 0; exit
//! ```
//!
//! A wildcard (type `a`, major or minor `*`, access `rwm`) leaves its comparison out.
//!
//! [`attach`] loads the program once per process (`BPF_PROG_LOAD`; a refusal carries the
//! verifier's log) and attaches it to a cgroup directory with `BPF_F_ALLOW_MULTI`, then
//! detaches every other program attached to that cgroup itself, so attaching again (a cgroup
//! adopted after a restart) leaves exactly one. The cgroup holds the program: it stays
//! attached when the fd closes, until the cgroup is removed.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::OnceLock;

use super::CgroupError;

// ---- linux/bpf.h

/// `BPF_DEVCG_DEV_BLOCK`, `BPF_DEVCG_DEV_CHAR`.
const DEV_BLOCK: i32 = 1;
const DEV_CHAR: i32 = 2;
/// `BPF_DEVCG_ACC_MKNOD`, `_READ`, `_WRITE`.
const ACC_MKNOD: i32 = 1;
const ACC_READ: i32 = 2;
const ACC_WRITE: i32 = 4;
const ACC_ALL: i32 = ACC_MKNOD | ACC_READ | ACC_WRITE;

// Instruction classes, sizes, modes, operations and sources.
const BPF_LDX: u8 = 0x01;
const BPF_ALU: u8 = 0x04;
const BPF_JMP: u8 = 0x05;
const BPF_W: u8 = 0x00;
const BPF_MEM: u8 = 0x60;
const BPF_K: u8 = 0x00;
const BPF_X: u8 = 0x08;
const BPF_AND: u8 = 0x50;
const BPF_RSH: u8 = 0x70;
const BPF_MOV: u8 = 0xb0;
const BPF_JNE: u8 = 0x50;
const BPF_EXIT: u8 = 0x90;

// Registers: r0 the return value, r1 the context on entry.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;

// bpf(2) commands, the program and attach types, attach flags.
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_PROG_DETACH: libc::c_int = 9;
const BPF_PROG_GET_FD_BY_ID: libc::c_int = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_int = 15;
const BPF_PROG_QUERY: libc::c_int = 16;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 1 << 1;

/// The program's name as `bpftool prog` shows it (at most 15 bytes).
const PROG_NAME: &[u8] = b"fastbox_devices";
/// The license the kernel records (any string; this program calls no GPL-only helper).
const LICENSE: &CStr = c"Apache-2.0";
/// The verifier log's size: the program is short, its log a few KiB at most.
const LOG_SIZE: usize = 64 * 1024;

/// One `struct bpf_insn`: opcode, `dst_reg:4 src_reg:4`, `s16 off`, `s32 imm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(super) struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        // The bit-field order follows the byte order (the kernel's `__LITTLE_ENDIAN_BITFIELD`).
        #[cfg(target_endian = "little")]
        let regs = dst | (src << 4);
        #[cfg(target_endian = "big")]
        let regs = (dst << 4) | src;
        Insn {
            code,
            regs,
            off,
            imm,
        }
    }

    /// The 8 bytes the kernel reads.
    #[cfg(test)]
    pub(super) fn to_bytes(self) -> [u8; 8] {
        let [o0, o1] = self.off.to_ne_bytes();
        let [i0, i1, i2, i3] = self.imm.to_ne_bytes();
        [self.code, self.regs, o0, o1, i0, i1, i2, i3]
    }
}

/// `dst = *(u32 *)(src + off)`
const fn ldx_w(dst: u8, src: u8, off: i16) -> Insn {
    Insn::new(BPF_LDX | BPF_MEM | BPF_W, dst, src, off, 0)
}

/// `dst op= imm` on the low 32 bits (the upper half is zeroed).
const fn alu32_imm(op: u8, dst: u8, imm: i32) -> Insn {
    Insn::new(BPF_ALU | op | BPF_K, dst, 0, 0, imm)
}

/// `dst = src` (32 bits).
const fn mov32_reg(dst: u8, src: u8) -> Insn {
    Insn::new(BPF_ALU | BPF_MOV | BPF_X, dst, src, 0, 0)
}

/// `if dst != imm goto +off`
const fn jne_imm(dst: u8, imm: i32, off: i16) -> Insn {
    Insn::new(BPF_JMP | BPF_JNE | BPF_K, dst, 0, off, imm)
}

/// `if dst != src goto +off`
const fn jne_reg(dst: u8, src: u8, off: i16) -> Insn {
    Insn::new(BPF_JMP | BPF_JNE | BPF_X, dst, src, off, 0)
}

const fn exit() -> Insn {
    Insn::new(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)
}

/// One allow rule in the v1 `devices.allow` syntax: `TYPE MAJOR:MINOR ACCESS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DeviceRule {
    /// `BPF_DEVCG_DEV_*`; `None` for `a` (any).
    pub kind: Option<i32>,
    /// `None` for `*`.
    pub major: Option<u32>,
    pub minor: Option<u32>,
    /// `BPF_DEVCG_ACC_*` bits.
    pub access: i32,
}

impl DeviceRule {
    /// Parses `c 1:3 rwm`, `b *:* m`, `c 136:* rwm`; `a` alone is `a *:* rwm`, as in v1.
    pub(super) fn parse(rule: &str) -> Result<DeviceRule, CgroupError> {
        let invalid = |reason| CgroupError::InvalidDeviceRule {
            rule: rule.to_string(),
            reason,
        };
        let fields: Vec<&str> = rule.split_whitespace().collect();
        let kind = match fields.first().copied() {
            Some("a") => None,
            Some("b") => Some(DEV_BLOCK),
            Some("c") => Some(DEV_CHAR),
            _ => return Err(invalid("the type is not `a`, `b` or `c`")),
        };
        if fields == ["a"] {
            return Ok(DeviceRule {
                kind,
                major: None,
                minor: None,
                access: ACC_ALL,
            });
        }
        let [_, numbers, access] = fields[..] else {
            return Err(invalid("not `TYPE MAJOR:MINOR ACCESS`"));
        };
        let (major, minor) = numbers
            .split_once(':')
            .ok_or_else(|| invalid("not `MAJOR:MINOR`"))?;
        let number = |s: &str| match s {
            "*" => Ok(None),
            // Compared with a sign-extended 32-bit immediate: stay below 2^31 (device
            // numbers are 12 + 20 bits).
            _ => s
                .parse::<u32>()
                .ok()
                .filter(|n| *n <= i32::MAX as u32)
                .map(Some)
                .ok_or_else(|| invalid("a device number is not `*` or a number below 2^31")),
        };
        let mut bits = 0;
        for c in access.chars() {
            bits |= match c {
                'r' => ACC_READ,
                'w' => ACC_WRITE,
                'm' => ACC_MKNOD,
                _ => return Err(invalid("the access is not made of `r`, `w` and `m`")),
            };
        }
        Ok(DeviceRule {
            kind,
            major: number(major)?,
            minor: number(minor)?,
            access: bits,
        })
    }
}

/// The device program allowing what `rules` allow and denying everything else.
pub(super) fn compile(rules: &[&str]) -> Result<Vec<Insn>, CgroupError> {
    let mut insns = vec![
        // r2 = type (low 16 bits of access_type), r3 = access (high 16 bits).
        ldx_w(R2, R1, 0),
        alu32_imm(BPF_AND, R2, 0xffff),
        ldx_w(R3, R1, 0),
        alu32_imm(BPF_RSH, R3, 16),
        ldx_w(R4, R1, 4),
        ldx_w(R5, R1, 8),
    ];
    for rule in rules {
        let rule = DeviceRule::parse(rule)?;
        let mut block = Vec::new();
        if let Some(kind) = rule.kind {
            block.push(jne_imm(R2, kind, 0));
        }
        if rule.access != ACC_ALL {
            block.extend([
                mov32_reg(R1, R3),
                alu32_imm(BPF_AND, R1, rule.access),
                jne_reg(R1, R3, 0),
            ]);
        }
        if let Some(major) = rule.major {
            block.push(jne_imm(R4, major as i32, 0));
        }
        if let Some(minor) = rule.minor {
            block.push(jne_imm(R5, minor as i32, 0));
        }
        block.extend([alu32_imm(BPF_MOV, R0, 1), exit()]);
        // Every jump of the block goes to the instruction after it: the next rule.
        let len = block.len();
        for (i, insn) in block.iter_mut().enumerate() {
            if insn.code & 0x07 == BPF_JMP && insn.code & 0xf0 == BPF_JNE {
                insn.off = (len - i - 1) as i16;
            }
        }
        insns.extend(block);
    }
    insns.extend([alu32_imm(BPF_MOV, R0, 0), exit()]);
    Ok(insns)
}

/// Attaches the program for [`super::DEVICE_RULES`] to the cgroup directory `dir`, replacing
/// any other device program attached to it (not to its ancestors). Idempotent.
pub(super) fn attach(dir: &Path) -> Result<(), CgroupError> {
    let program = program()?;
    let err = |op| {
        move |source| CgroupError::DeviceProgram {
            op,
            path: dir.to_path_buf(),
            source,
            log: String::new(),
        }
    };
    let cgroup = open_dir(dir).map_err(|e| CgroupError::Io {
        op: "open",
        path: dir.to_path_buf(),
        source: e,
    })?;
    let (flags, attached) = query(cgroup.as_fd()).map_err(err("query"))?;
    if attached == [program.id] {
        return Ok(());
    }
    if !attached.is_empty() && flags & BPF_F_ALLOW_MULTI == 0 {
        // Attached without ALLOW_MULTI (not by fastbox): attaching with the same flags
        // replaces that single program.
        return prog_attach(cgroup.as_fd(), program.fd.as_fd(), flags).map_err(err("attach"));
    }
    if !attached.contains(&program.id) {
        prog_attach(cgroup.as_fd(), program.fd.as_fd(), BPF_F_ALLOW_MULTI)
            .map_err(err("attach"))?;
    }
    // Ours is in place: the others go (while both are attached, both must allow).
    for id in attached.into_iter().filter(|id| *id != program.id) {
        let old = match prog_fd_by_id(id) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(err("find an old")(e)),
        };
        match prog_detach(cgroup.as_fd(), old.as_fd()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(err("detach an old")(e)),
        }
    }
    tracing::debug!(cgroup = %dir.display(), id = program.id, "device program attached");
    Ok(())
}

/// The ids of the device programs attached to the cgroup directory `dir` itself.
pub(super) fn attached(dir: &Path) -> Result<Vec<u32>, CgroupError> {
    let cgroup = open_dir(dir).map_err(|e| CgroupError::Io {
        op: "open",
        path: dir.to_path_buf(),
        source: e,
    })?;
    query(cgroup.as_fd())
        .map(|(_, ids)| ids)
        .map_err(|source| CgroupError::DeviceProgram {
            op: "query",
            path: dir.to_path_buf(),
            source,
            log: String::new(),
        })
}

/// The loaded program for [`super::DEVICE_RULES`] and its kernel id.
struct Program {
    fd: OwnedFd,
    id: u32,
}

/// Loads the program on first use; later calls share it (close-on-exec, like every bpf fd).
fn program() -> Result<&'static Program, CgroupError> {
    static PROGRAM: OnceLock<Program> = OnceLock::new();
    if let Some(p) = PROGRAM.get() {
        return Ok(p);
    }
    let insns = compile(super::DEVICE_RULES)?;
    let fd = load(&insns).map_err(|(source, log)| CgroupError::DeviceProgram {
        op: "load",
        path: "bpf(BPF_PROG_LOAD)".into(),
        source,
        log,
    })?;
    let id = prog_id(fd.as_fd()).map_err(|source| CgroupError::DeviceProgram {
        op: "identify",
        path: "bpf(BPF_OBJ_GET_INFO_BY_FD)".into(),
        source,
        log: String::new(),
    })?;
    // A concurrent first use may have won: its program is kept, this one closed.
    Ok(PROGRAM.get_or_init(|| Program { fd, id }))
}

fn open_dir(dir: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
}

// ---- bpf(2)

/// A `union bpf_attr`, zeroed, larger than any the kernel defines today: the kernel reads
/// the fields of one command and may write some back (a query's count and flags). Fields are
/// set at their uapi offsets.
#[repr(C, align(8))]
struct Attr([u8; 256]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 256])
    }

    fn set_u32(&mut self, offset: usize, value: u32) {
        self.0[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
    }

    fn set_u64(&mut self, offset: usize, value: u64) {
        self.0[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }

    fn get_u32(&self, offset: usize) -> u32 {
        u32::from_ne_bytes(self.0[offset..offset + 4].try_into().expect("4 bytes"))
    }
}

/// `bpf(cmd, attr, sizeof attr)`: the new fd or 0.
fn sys_bpf(cmd: libc::c_int, attr: &mut Attr) -> io::Result<libc::c_int> {
    loop {
        // SAFETY: `attr` is a live, writable buffer of the size passed; every pointer stored
        // in it by the callers points to a buffer that outlives this call and is as long as
        // the size stored beside it.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr.0.as_mut_ptr(),
                attr.0.len() as libc::c_uint,
            )
        };
        if ret >= 0 {
            return Ok(ret as libc::c_int);
        }
        let err = io::Error::last_os_error();
        // The verifier may give up transiently; libbpf retries too.
        if !matches!(err.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) {
            return Err(err);
        }
    }
}

/// Takes ownership of an fd a `bpf` command returned.
fn owned(fd: libc::c_int) -> OwnedFd {
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `BPF_PROG_LOAD`; on failure the error and the verifier's log.
fn load(insns: &[Insn]) -> Result<OwnedFd, (io::Error, String)> {
    let mut log = vec![0u8; LOG_SIZE];
    let mut attr = Attr::new();
    attr.set_u32(0, BPF_PROG_TYPE_CGROUP_DEVICE); // prog_type
    attr.set_u32(4, insns.len() as u32); // insn_cnt
    attr.set_u64(8, insns.as_ptr() as u64); // insns
    attr.set_u64(16, LICENSE.as_ptr() as u64); // license
    attr.set_u32(24, 1); // log_level
    attr.set_u32(28, log.len() as u32); // log_size
    attr.set_u64(32, log.as_mut_ptr() as u64); // log_buf
    attr.0[48..48 + PROG_NAME.len()].copy_from_slice(PROG_NAME); // prog_name
    match sys_bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(owned(fd)),
        Err(e) => {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            Err((e, String::from_utf8_lossy(&log[..end]).trim().to_string()))
        }
    }
}

/// The kernel's id of a loaded program (`bpf_prog_info.id`).
fn prog_id(prog: BorrowedFd) -> io::Result<u32> {
    // struct bpf_prog_info starts with `__u32 type; __u32 id;`.
    let mut info = [0u32; 2];
    let mut attr = Attr::new();
    attr.set_u32(0, prog.as_raw_fd() as u32); // info.bpf_fd
    attr.set_u32(4, size_of_val(&info) as u32); // info.info_len
    attr.set_u64(8, info.as_mut_ptr() as u64); // info.info
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info[1])
}

/// `BPF_PROG_QUERY` of the device programs attached to the cgroup itself: its attach flags
/// and the programs' ids.
fn query(cgroup: BorrowedFd) -> io::Result<(u32, Vec<u32>)> {
    let mut ids = vec![0u32; 16];
    loop {
        let mut attr = Attr::new();
        attr.set_u32(0, cgroup.as_raw_fd() as u32); // query.target_fd
        attr.set_u32(4, BPF_CGROUP_DEVICE); // query.attach_type
        attr.set_u64(16, ids.as_mut_ptr() as u64); // query.prog_ids
        attr.set_u32(24, ids.len() as u32); // query.prog_cnt
        match sys_bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {
                ids.truncate(attr.get_u32(24) as usize);
                return Ok((attr.get_u32(12), ids)); // query.attach_flags
            }
            // More than fit: prog_cnt says how many there are.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                let count = attr.get_u32(24) as usize;
                ids = vec![0; count.max(ids.len() * 2)];
            }
            Err(e) => return Err(e),
        }
    }
}

fn prog_attach(cgroup: BorrowedFd, prog: BorrowedFd, flags: u32) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.set_u32(0, cgroup.as_raw_fd() as u32); // target_fd
    attr.set_u32(4, prog.as_raw_fd() as u32); // attach_bpf_fd
    attr.set_u32(8, BPF_CGROUP_DEVICE); // attach_type
    attr.set_u32(12, flags); // attach_flags
    sys_bpf(BPF_PROG_ATTACH, &mut attr).map(drop)
}

fn prog_detach(cgroup: BorrowedFd, prog: BorrowedFd) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.set_u32(0, cgroup.as_raw_fd() as u32); // target_fd
    attr.set_u32(4, prog.as_raw_fd() as u32); // attach_bpf_fd
    attr.set_u32(8, BPF_CGROUP_DEVICE); // attach_type
    sys_bpf(BPF_PROG_DETACH, &mut attr).map(drop)
}

fn prog_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.set_u32(0, id); // prog_id
    sys_bpf(BPF_PROG_GET_FD_BY_ID, &mut attr).map(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel does with the program: a small interpreter of the instructions
    /// [`compile`] emits, run on one `bpf_cgroup_dev_ctx`.
    fn run(insns: &[Insn], kind: i32, access: i32, major: u32, minor: u32) -> u64 {
        let ctx = [((access as u32) << 16) | kind as u32, major, minor];
        let mut r = [0u64; 11];
        let mut pc = 0usize;
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 10_000, "no exit");
            let insn = insns[pc];
            #[cfg(target_endian = "little")]
            let (dst, src) = ((insn.regs & 0xf) as usize, (insn.regs >> 4) as usize);
            #[cfg(target_endian = "big")]
            let (dst, src) = ((insn.regs >> 4) as usize, (insn.regs & 0xf) as usize);
            pc += 1;
            match insn.code {
                0x61 => {
                    assert_eq!(src, 1, "loads only from the context");
                    r[dst] = u64::from(ctx[insn.off as usize / 4]);
                }
                0x54 => r[dst] = u64::from(r[dst] as u32 & insn.imm as u32),
                0x74 => r[dst] = u64::from((r[dst] as u32) >> insn.imm),
                0xb4 => r[dst] = u64::from(insn.imm as u32),
                0xbc => r[dst] = u64::from(r[src] as u32),
                0x55 if r[dst] != insn.imm as i64 as u64 => pc += insn.off as usize,
                0x5d if r[dst] != r[src] => pc += insn.off as usize,
                0x55 | 0x5d => {}
                0x95 => return r[0],
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    /// The v1 meaning of the rules: some rule covers the type, the numbers and every bit of
    /// the access asked.
    fn allowed(rules: &[&str], kind: i32, access: i32, major: u32, minor: u32) -> bool {
        rules
            .iter()
            .map(|r| DeviceRule::parse(r).unwrap())
            .any(|r| {
                r.kind.is_none_or(|k| k == kind)
                    && r.major.is_none_or(|m| m == major)
                    && r.minor.is_none_or(|m| m == minor)
                    && access & r.access == access
            })
    }

    #[test]
    fn instructions_have_the_kernels_byte_layout() {
        // As `llvm-objdump -d` prints them for the same instructions.
        assert_eq!(ldx_w(R2, R1, 4).to_bytes(), [0x61, 0x12, 4, 0, 0, 0, 0, 0]);
        assert_eq!(
            alu32_imm(BPF_MOV, R0, 1).to_bytes(),
            [0xb4, 0x00, 0, 0, 1, 0, 0, 0]
        );
        assert_eq!(exit().to_bytes(), [0x95, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            jne_imm(R4, 136, 3).to_bytes(),
            [0x55, 0x04, 3, 0, 136, 0, 0, 0]
        );
        assert_eq!(
            jne_reg(R1, R3, 2).to_bytes(),
            [0x5d, 0x31, 2, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            alu32_imm(BPF_AND, R2, 0xffff).to_bytes(),
            [0x54, 0x02, 0, 0, 0xff, 0xff, 0, 0]
        );
        assert_eq!(size_of::<Insn>(), 8);
    }

    const PROLOGUE: [Insn; 6] = [
        ldx_w(R2, R1, 0),
        alu32_imm(BPF_AND, R2, 0xffff),
        ldx_w(R3, R1, 0),
        alu32_imm(BPF_RSH, R3, 16),
        ldx_w(R4, R1, 4),
        ldx_w(R5, R1, 8),
    ];

    #[test]
    fn one_full_access_rule_compares_type_major_and_minor() {
        let mut want = PROLOGUE.to_vec();
        want.extend([
            jne_imm(R2, DEV_CHAR, 4),
            jne_imm(R4, 1, 3),
            jne_imm(R5, 3, 2),
            alu32_imm(BPF_MOV, R0, 1),
            exit(),
            alu32_imm(BPF_MOV, R0, 0),
            exit(),
        ]);
        assert_eq!(compile(&["c 1:3 rwm"]).unwrap(), want);
    }

    #[test]
    fn wildcards_leave_their_comparisons_out_and_access_is_a_subset_check() {
        let mut want = PROLOGUE.to_vec();
        want.extend([
            // c *:* m
            jne_imm(R2, DEV_CHAR, 5),
            mov32_reg(R1, R3),
            alu32_imm(BPF_AND, R1, ACC_MKNOD),
            jne_reg(R1, R3, 2),
            alu32_imm(BPF_MOV, R0, 1),
            exit(),
            // c 136:* rwm
            jne_imm(R2, DEV_CHAR, 3),
            jne_imm(R4, 136, 2),
            alu32_imm(BPF_MOV, R0, 1),
            exit(),
            // a
            alu32_imm(BPF_MOV, R0, 1),
            exit(),
            // the deny
            alu32_imm(BPF_MOV, R0, 0),
            exit(),
        ]);
        assert_eq!(compile(&["c *:* m", "c 136:* rwm", "a"]).unwrap(), want);
    }

    #[test]
    fn the_default_rules_program_ends_with_the_deny_and_means_what_v1_means() {
        let rules = crate::cgroup::DEVICE_RULES;
        let insns = compile(rules).unwrap();
        assert_eq!(insns[..6], PROLOGUE);
        assert_eq!(
            insns[insns.len() - 2..],
            [alu32_imm(BPF_MOV, R0, 0), exit()]
        );
        // Every jump lands inside the program, forwards.
        for (i, insn) in insns.iter().enumerate() {
            if insn.code & 0x07 == BPF_JMP && insn.code != 0x95 {
                assert!(insn.off > 0 && i + 1 + (insn.off as usize) < insns.len());
            }
        }
        let numbers = [0, 1, 2, 3, 5, 7, 8, 9, 10, 11, 136, 137, 237, 4095];
        let mut allowed_count = 0;
        for kind in [DEV_BLOCK, DEV_CHAR] {
            for access in 1..=ACC_ALL {
                for major in numbers {
                    for minor in numbers {
                        let want = allowed(rules, kind, access, major, minor);
                        let got = run(&insns, kind, access, major, minor);
                        assert_eq!(
                            got,
                            u64::from(want),
                            "type {kind} access {access} {major}:{minor}"
                        );
                        allowed_count += usize::from(want);
                    }
                }
            }
        }
        assert!(allowed_count > 0);
        // The pseudo-devices, read and write; nothing else but mknod.
        let rw = ACC_READ | ACC_WRITE;
        for (major, minor) in [
            (1, 3),
            (1, 5),
            (1, 7),
            (1, 8),
            (1, 9),
            (5, 0),
            (5, 2),
            (136, 7),
        ] {
            assert_eq!(
                run(&insns, DEV_CHAR, rw, major, minor),
                1,
                "{major}:{minor}"
            );
        }
        for (kind, major, minor) in [(DEV_CHAR, 1, 1), (DEV_CHAR, 1, 11), (DEV_CHAR, 10, 237)]
            .into_iter()
            .chain([(DEV_BLOCK, 7, 0), (DEV_BLOCK, 8, 0)])
        {
            assert_eq!(run(&insns, kind, ACC_READ, major, minor), 0);
            assert_eq!(run(&insns, kind, ACC_WRITE, major, minor), 0);
            assert_eq!(run(&insns, kind, ACC_MKNOD, major, minor), 1);
        }
    }

    #[test]
    fn rules_are_parsed_like_v1_and_bad_ones_refused() {
        assert_eq!(
            DeviceRule::parse("c 136:* rwm").unwrap(),
            DeviceRule {
                kind: Some(DEV_CHAR),
                major: Some(136),
                minor: None,
                access: ACC_ALL
            }
        );
        assert_eq!(
            DeviceRule::parse("b *:* m").unwrap(),
            DeviceRule {
                kind: Some(DEV_BLOCK),
                major: None,
                minor: None,
                access: ACC_MKNOD
            }
        );
        assert_eq!(DeviceRule::parse("a").unwrap().access, ACC_ALL);
        for bad in [
            "",
            "x 1:3 rwm",
            "c 1:3",
            "c 1-3 rwm",
            "c 1:3 rwx",
            "c -1:3 r",
            "c 4294967295:0 r",
            "c 1:3 rwm extra",
        ] {
            let err = DeviceRule::parse(bad).unwrap_err();
            assert!(
                err.to_string().starts_with("invalid device rule"),
                "{bad:?}: {err}"
            );
        }
        assert!(compile(&["c 1:3 rwm", "q"]).is_err());
    }
}
