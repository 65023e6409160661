//! Host-wide names: every one carries the instance prefix.
//!
//! Grammar (see `docs/networking.md`):
//! - the prefix is 1..=8 bytes of `[a-z0-9]`, starting with a letter (`fb1a2b`);
//! - the nft table is named exactly the prefix (`table inet fb1a2b`);
//! - a slot's netns and the host end of its veth are both `{prefix}-{index in base 36}`
//!   (`fb1a2b-0`, `fb1a2b-rs`); `-` after the prefix is reserved for slots, so the nft
//!   wildcard `"{prefix}-*"` matches exactly the instance's slot interfaces;
//! - any other object an instance (or a test) owns is `{prefix}_{anything}`.
//!
//! Since a prefix never contains `-` or `_`, no name of one instance starts with another
//! instance's `{prefix}-` or `{prefix}_`, even when one prefix is a prefix of the other
//! (`fb1` and `fb12`). The longest slot name is 8 + 1 + 5 = 14 bytes, within the kernel's
//! 15-byte interface-name limit, because pools are at most 2^23 slots (see
//! [`fastbox_api::net::MIN_POOL_PREFIX_LEN`]).

use super::NetError;

/// Longest accepted instance prefix.
pub const MAX_PREFIX_LEN: usize = 8;

/// Longest interface name the kernel accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// Name of the sandbox end of every veth, inside the slot's netns.
pub const SANDBOX_IFNAME: &str = "eth0";

/// Checks the prefix grammar.
pub fn validate_prefix(prefix: &str) -> Result<(), NetError> {
    let ok = !prefix.is_empty()
        && prefix.len() <= MAX_PREFIX_LEN
        && prefix.starts_with(|c: char| c.is_ascii_lowercase())
        && prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(NetError::InvalidConfig(format!(
            "prefix {prefix:?} must be 1..={MAX_PREFIX_LEN} bytes of [a-z0-9] starting with a letter"
        )))
    }
}

/// `index` in base 36, lower case (`0`, `z`, `10`, ...).
pub fn base36(mut index: u32) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(index % 36) as usize]);
        index /= 36;
        if index == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).expect("base-36 digits are ASCII")
}

/// Name of slot `index`: its netns name and the host end of its veth.
pub fn slot_name(prefix: &str, index: u32) -> String {
    format!("{prefix}-{}", base36(index))
}

/// The index of a slot name of instance `prefix` (`{prefix}-{base 36}`), if it is one.
pub fn slot_index(prefix: &str, name: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?.strip_prefix('-')?;
    (!digits.is_empty() && base36(u32::from_str_radix(digits, 36).ok()?) == digits)
        .then(|| u32::from_str_radix(digits, 36).ok())
        .flatten()
}

/// The nft interface wildcard matching every slot veth of the instance.
pub fn slot_ifname_glob(prefix: &str) -> String {
    format!("{prefix}-*")
}

/// Whether `name` belongs to the instance `prefix`: the table itself, a slot
/// (`{prefix}-...`) or another owned object (`{prefix}_...`).
pub fn owned_by(prefix: &str, name: &str) -> bool {
    match name.strip_prefix(prefix) {
        Some("") => true,
        Some(rest) => rest.starts_with(['-', '_']),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_parse_back() {
        for i in [0, 9, 35, 36, 1295, 70000] {
            assert_eq!(slot_index("fb", &slot_name("fb", i)), Some(i));
        }
        assert_eq!(slot_index("fb", "fb-"), None);
        assert_eq!(slot_index("fb", "fb-0a"), None);
        assert_eq!(slot_index("fb", "fbx-1"), None);
        assert_eq!(slot_index("fb", "fb_1"), None);
    }

    #[test]
    fn base36_encodes_indexes() {
        assert_eq!(base36(0), "0");
        assert_eq!(base36(9), "9");
        assert_eq!(base36(10), "a");
        assert_eq!(base36(35), "z");
        assert_eq!(base36(36), "10");
        assert_eq!(base36(32767), "pa7");
        assert_eq!(base36((1 << 23) - 1), "4zsov");
        assert_eq!(base36(u32::MAX), "1z141z3");
    }

    #[test]
    fn slot_names_fit_the_interface_name_limit() {
        let longest = slot_name("abcdefgh", (1 << 23) - 1);
        assert!(longest.len() <= MAX_IFNAME_LEN, "{longest}");
        assert_eq!(slot_name("fb1a2b", 0), "fb1a2b-0");
        assert_eq!(slot_name("fb1a2b", 1000), "fb1a2b-rs");
    }

    #[test]
    fn prefix_grammar_is_enforced() {
        for good in ["f", "fb1a2b", "abcdefgh", "fbt0000"] {
            assert!(validate_prefix(good).is_ok(), "{good} rejected");
        }
        for bad in ["", "1fb", "Fb", "fb-1", "fb_1", "abcdefghi", "fb.1", "fb*"] {
            assert!(validate_prefix(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn ownership_respects_the_prefix_boundary() {
        assert!(owned_by("fb1", "fb1"));
        assert!(owned_by("fb1", "fb1-0"));
        assert!(owned_by("fb1", "fb1_inet"));
        assert!(!owned_by("fb1", "fb12"));
        assert!(!owned_by("fb1", "fb12-0"));
        assert!(!owned_by("fb1", "fb"));
        assert!(!owned_by("fb1", "eth0"));
    }

    #[test]
    fn slot_glob_does_not_cover_other_owned_objects() {
        // nft wildcards match on the text before `*`.
        let glob = slot_ifname_glob("fb1");
        let stem = glob.trim_end_matches('*');
        assert!(slot_name("fb1", 5).starts_with(stem));
        assert!(!"fb1_inet".starts_with(stem));
        assert!(!slot_name("fb12", 5).starts_with(stem));
    }
}
