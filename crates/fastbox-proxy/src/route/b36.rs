//! Base 36 as OSEP-0011 writes expiry times: digits `0-9a-z`, lowercase, no leading zeros.
//!
//! The encoding is canonical (one string per number) because the string itself is signed:
//! accepting `"0a"` or `"A"` for 10 would let two routes share one signature.

/// The 36 digits, in value order.
const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// The longest encoding of a `u64` (`u64::MAX` is `"3w5e11264sgsf"`).
pub(crate) const MAX_LEN: usize = 13;

/// Encodes `n` in base 36, lowercase, without leading zeros (`0` is `"0"`).
pub fn to_b36(mut n: u64) -> String {
    let mut out = Vec::with_capacity(MAX_LEN);
    loop {
        // The remainder is below 36, so the index is in range.
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    // Every byte comes from `DIGITS`, which is ASCII.
    out.into_iter().map(char::from).collect()
}

/// Decodes the canonical base-36 form written by [`to_b36`].
///
/// Returns `None` for an empty string, any character outside `0-9a-z` (uppercase included), a
/// leading zero (except `"0"` itself) and values that overflow a `u64`.
pub fn from_b36(s: &str) -> Option<u64> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.bytes().try_fold(0u64, |acc, b| {
        let digit = digit_value(b)?;
        acc.checked_mul(36)?.checked_add(digit)
    })
}

/// Whether `s` has the shape of a canonical base-36 `u64`, without decoding it.
pub(crate) fn has_shape(s: &str) -> bool {
    (1..=MAX_LEN).contains(&s.len())
        && !(s.len() > 1 && s.starts_with('0'))
        && s.bytes().all(|b| digit_value(b).is_some())
}

/// The value of one lowercase base-36 digit.
fn digit_value(b: u8) -> Option<u64> {
    match b {
        b'0'..=b'9' => Some(u64::from(b - b'0')),
        b'a'..=b'z' => Some(u64::from(b - b'a') + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_known_values() {
        assert_eq!(to_b36(0), "0");
        assert_eq!(to_b36(35), "z");
        assert_eq!(to_b36(36), "10");
        assert_eq!(to_b36(1_700_000_000), "s44we8");
        assert_eq!(to_b36(u64::MAX), "3w5e11264sgsf");
    }

    #[test]
    fn round_trips() {
        for n in [
            0,
            1,
            35,
            36,
            1295,
            1296,
            1_700_000_000,
            u64::MAX - 1,
            u64::MAX,
        ] {
            assert_eq!(from_b36(&to_b36(n)), Some(n), "{n}");
        }
    }

    #[test]
    fn rejects_non_canonical_input() {
        for bad in [
            "", "00", "0a", "A", "s44wE8", "-1", "+1", " 1", "1 ", "1_0", "é",
        ] {
            assert_eq!(from_b36(bad), None, "{bad:?}");
            assert!(!has_shape(bad), "{bad:?}");
        }
    }

    #[test]
    fn rejects_overflow() {
        // u64::MAX + 1 and a 14-digit value.
        assert_eq!(from_b36("3w5e11264sgsg"), None);
        assert_eq!(from_b36("10000000000000"), None);
        assert!(!has_shape("10000000000000"));
    }
}
