//! The policy file's types (`seccomp/default.json`) and their validation.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::SeccompError;

/// A seccomp policy: allow by default, deny what the rules match. Rules are evaluated in
/// order; the first rule whose syscall and argument conditions match decides the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Format version; only 1 exists.
    pub version: u32,
    #[serde(default)]
    pub description: String,
    pub default_action: DefaultAction,
    pub rules: Vec<Rule>,
    /// Calls a reviewer might expect to be denied, allowed on purpose (documentation; the
    /// compiler only checks that they are known and not also denied unconditionally).
    #[serde(default)]
    pub allowed: Vec<Note>,
    /// Calls that cannot reach the filter on a supported ABI (documentation only).
    #[serde(default)]
    pub not_applicable: Vec<Note>,
}

/// What happens to a call no rule matches. Only `allow` exists: this is a deny list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DefaultAction {
    Allow,
}

/// Deny `syscalls` with `errno`, always or when one of `match_any` matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub syscalls: Vec<String>,
    pub errno: Errno,
    /// Empty: deny unconditionally. Otherwise deny when any entry matches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_any: Vec<ArgMatch>,
    pub reason: String,
}

/// Argument conditions that must all hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgMatch {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub comment: String,
    pub args: Vec<ArgCondition>,
}

/// One comparison of a system call argument: `(arg[index] & mask) op value`, the mask only
/// for `masked_eq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgCondition {
    /// Argument index, 0..=5.
    pub index: u8,
    /// 32 compares only the low half (for `int`/`unsigned int` arguments, whose upper half
    /// the kernel ignores); 64 (the default) compares the whole register.
    #[serde(default)]
    pub width: ArgWidth,
    pub op: CmpOp,
    pub value: Word,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<Word>,
}

/// How many bits of an argument a condition compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum ArgWidth {
    Bits32,
    #[default]
    Bits64,
}

impl TryFrom<u8> for ArgWidth {
    type Error = String;
    fn try_from(v: u8) -> Result<Self, String> {
        match v {
            32 => Ok(Self::Bits32),
            64 => Ok(Self::Bits64),
            other => Err(format!("width must be 32 or 64, not {other}")),
        }
    }
}

impl From<ArgWidth> for u8 {
    fn from(w: ArgWidth) -> u8 {
        match w {
            ArgWidth::Bits32 => 32,
            ArgWidth::Bits64 => 64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    MaskedEq,
}

/// The error a denied call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Errno {
    Eperm,
    Enosys,
    Eafnosupport,
    Eprotonosupport,
}

impl Errno {
    pub fn raw(self) -> i32 {
        match self {
            Errno::Eperm => libc::EPERM,
            Errno::Enosys => libc::ENOSYS,
            Errno::Eafnosupport => libc::EAFNOSUPPORT,
            Errno::Eprotonosupport => libc::EPROTONOSUPPORT,
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Errno::Eperm => "EPERM",
            Errno::Enosys => "ENOSYS",
            Errno::Eafnosupport => "EAFNOSUPPORT",
            Errno::Eprotonosupport => "EPROTONOSUPPORT",
        })
    }
}

/// A group of system calls with the reason they are listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Note {
    pub syscalls: Vec<String>,
    pub reason: String,
}

/// A 64-bit value written in JSON as a number, a decimal string or a `0x` hex string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word(pub u64);

impl Serialize for Word {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{:#x}", self.0))
    }
}

impl<'de> Deserialize<'de> for Word {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(Word(n)),
            Raw::Text(t) => {
                let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
                    Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
                    None => t.replace('_', "").parse(),
                };
                parsed.map(Word).map_err(|_| {
                    serde::de::Error::custom(format!("{t:?} is not a number (decimal or 0x hex)"))
                })
            }
        }
    }
}

impl Policy {
    /// Checks what serde cannot: reasons present, conditions well formed, no contradictions.
    /// Syscall names are checked when compiling (they depend on the architecture).
    pub fn validate(&self) -> Result<(), SeccompError> {
        let invalid = |msg: String| Err(SeccompError::Invalid(msg));
        if self.version != 1 {
            return invalid(format!("version {} (only 1 is known)", self.version));
        }
        // syscall -> index of the rule that denies it unconditionally
        let mut unconditional: BTreeMap<&str, usize> = BTreeMap::new();
        let mut conditional: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let what = format!("rule {i} ({})", rule.syscalls.join(", "));
            if rule.syscalls.is_empty() {
                return invalid(format!("rule {i} names no system call"));
            }
            if rule.reason.trim().is_empty() {
                return invalid(format!("{what} has no reason"));
            }
            for m in &rule.match_any {
                if m.args.is_empty() {
                    return invalid(format!("{what}: a match_any entry has no conditions"));
                }
                for c in &m.args {
                    validate_condition(c).or_else(|msg| invalid(format!("{what}: {msg}")))?;
                }
            }
            for name in &rule.syscalls {
                if rule.syscalls.iter().filter(|n| *n == name).count() > 1 {
                    return invalid(format!("{what} names {name} twice"));
                }
                if let Some(j) = unconditional.get(name.as_str()) {
                    return invalid(format!(
                        "{name}: rule {j} denies it unconditionally, so rule {i} never applies"
                    ));
                }
                if rule.match_any.is_empty() {
                    unconditional.insert(name, i);
                } else {
                    conditional.entry(name).or_insert(i);
                }
            }
        }
        for (list, notes) in [
            ("allowed", &self.allowed),
            ("not_applicable", &self.not_applicable),
        ] {
            for (i, note) in notes.iter().enumerate() {
                if note.syscalls.is_empty() {
                    return invalid(format!("{list} entry {i} names no system call"));
                }
                if note.reason.trim().is_empty() {
                    return invalid(format!(
                        "{list} entry {i} ({}) has no reason",
                        note.syscalls.join(", ")
                    ));
                }
                for name in &note.syscalls {
                    let denied = unconditional
                        .get(name.as_str())
                        .or(conditional.get(name.as_str()));
                    if let Some(r) = denied {
                        return invalid(format!("{name} is in {list} and also in rule {r}"));
                    }
                }
            }
        }
        Ok(())
    }

    /// Every system call the rules deny (some only for certain arguments), in rule order.
    pub fn denied_syscalls(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for name in self.rules.iter().flat_map(|r| &r.syscalls) {
            if !out.contains(&name.as_str()) {
                out.push(name);
            }
        }
        out
    }
}

fn validate_condition(c: &ArgCondition) -> Result<(), String> {
    if c.index > 5 {
        return Err(format!("argument index {} (at most 5)", c.index));
    }
    match (c.op, c.mask) {
        (CmpOp::MaskedEq, None) => return Err("masked_eq needs a mask".into()),
        (CmpOp::MaskedEq, Some(_)) => {}
        (op, Some(_)) => return Err(format!("{op:?} takes no mask")),
        (_, None) => {}
    }
    if c.width == ArgWidth::Bits32 {
        let too_wide = |w: Word| w.0 > u64::from(u32::MAX);
        if too_wide(c.value) || c.mask.is_some_and(too_wide) {
            return Err(format!(
                "argument {}: value or mask wider than 32 bits",
                c.index
            ));
        }
    }
    if let Some(mask) = c.mask
        && c.value.0 & !mask.0 != 0
    {
        return Err(format!(
            "argument {}: value {:#x} has bits outside mask {:#x}",
            c.index, c.value.0, mask.0
        ));
    }
    Ok(())
}
