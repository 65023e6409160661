//! Kubernetes-style resource quantities (`500m`, `2Gi`), as OpenSandbox's `resourceLimits` uses
//! them.
//!
//! The grammar is Kubernetes' (`k8s.io/apimachinery/pkg/api/resource`):
//!
//! ```text
//! quantity  ::= [+] number suffix
//! number    ::= digits | digits "." digits | digits "." | "." digits
//! suffix    ::= ""                                   (units)
//!             | "m"                                  (1e-3)
//!             | "k" | "K" | "M" | "G" | "T" | "P" | "E"  (1e3 .. 1e18)
//!             | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"  (2^10 .. 2^60)
//!             | ("e" | "E") [+|-] digits             (decimal exponent, |exp| <= 60)
//! ```
//!
//! Deviations from Kubernetes, on purpose: `K` is accepted as well as `k`; negative and zero
//! quantities are rejected, because every use here is a limit (a zero cpu or memory limit is
//! a sandbox that cannot run, and "no limit" is expressed by leaving the field out).
//!
//! Arithmetic is exact (integers, no floating point) and overflow is an error. A result that
//! is not a whole number of the target unit is rounded **up**, like Kubernetes'
//! `Quantity::Value()` / `MilliValue()`: `"0.1Ki"` is 103 bytes, `"0.0001"` cpu is 1 millicore.

use std::fmt;

/// Why a quantity string was rejected. Messages quote the whole input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("invalid quantity {input:?}: empty")]
    Empty { input: String },
    #[error("invalid quantity {input:?}: expected a number")]
    InvalidNumber { input: String },
    #[error("invalid quantity {input:?}: unknown suffix {suffix:?}")]
    UnknownSuffix { input: String, suffix: String },
    #[error("invalid quantity {input:?}: exponent out of range (at most 60 either way)")]
    ExponentOutOfRange { input: String },
    #[error("invalid quantity {input:?}: negative")]
    Negative { input: String },
    #[error("invalid quantity {input:?}: must be greater than zero")]
    Zero { input: String },
    #[error("invalid quantity {input:?}: too large")]
    Overflow { input: String },
}

/// Parses a cpu quantity into millicores: `"500m"` -> 500, `"2"` -> 2000, `"0.5"` -> 500.
///
/// Fractions of a millicore round up. Zero and negative values are errors.
pub fn parse_cpu_millis(s: &str) -> Result<u64, QuantityError> {
    parse_scaled(s, 3)
}

/// Parses a byte quantity: `"512Mi"`, `"2Gi"`, `"1G"`, `"100M"`, `"1024"`, `"1.5Gi"`, `"1e9"`.
///
/// Fractions of a byte round up. Zero and negative values are errors.
pub fn parse_bytes(s: &str) -> Result<u64, QuantityError> {
    parse_scaled(s, 0)
}

/// The largest decimal exponent accepted after `e`/`E`.
const MAX_EXPONENT: i32 = 60;

/// The parsed pieces of a quantity: `mantissa * 10^exp10 * 2^exp2`.
struct Parsed {
    negative: bool,
    mantissa: u128,
    exp10: i32,
    exp2: u32,
}

/// Parses `s` and returns its value in units of `10^-unit_exp10` (0: units, 3: thousandths).
fn parse_scaled(s: &str, unit_exp10: i32) -> Result<u64, QuantityError> {
    let p = parse(s)?;
    if p.mantissa == 0 {
        return Err(QuantityError::Zero { input: s.into() });
    }
    if p.negative {
        return Err(QuantityError::Negative { input: s.into() });
    }
    let overflow = || QuantityError::Overflow { input: s.into() };
    let mut value = p.mantissa;
    value = value.checked_mul(1u128 << p.exp2).ok_or_else(overflow)?;
    let exp10 = p.exp10 + unit_exp10;
    if exp10 >= 0 {
        let factor = 10u128
            .checked_pow(exp10.unsigned_abs())
            .ok_or_else(overflow)?;
        value = value.checked_mul(factor).ok_or_else(overflow)?;
    } else {
        // ceil(ceil(x / 10) / 10) == ceil(x / 100) for positive x, so dividing one digit at a
        // time is exact; once the value is 1 it stays 1.
        for _ in 0..exp10.unsigned_abs() {
            if value <= 1 {
                break;
            }
            value = value.div_ceil(10);
        }
    }
    u64::try_from(value).map_err(|_| overflow())
}

fn parse(s: &str) -> Result<Parsed, QuantityError> {
    if s.is_empty() {
        return Err(QuantityError::Empty { input: s.into() });
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let negative = match bytes[0] {
        b'-' => {
            i += 1;
            true
        }
        b'+' => {
            i += 1;
            false
        }
        _ => false,
    };

    // The number: digits, optionally one '.', at least one digit overall.
    let mut mantissa: u128 = 0;
    let mut digits = 0usize;
    let mut frac_digits: i32 = 0;
    let mut seen_dot = false;
    // Digits past what a u128 holds only matter if they are significant; we refuse them
    // rather than silently dropping precision (a limit with 39 significant digits is a typo).
    while i < bytes.len() {
        match bytes[i] {
            b'0'..=b'9' => {
                let d = u128::from(bytes[i] - b'0');
                mantissa = mantissa
                    .checked_mul(10)
                    .and_then(|m| m.checked_add(d))
                    .ok_or_else(|| QuantityError::Overflow { input: s.into() })?;
                digits += 1;
                if seen_dot {
                    frac_digits += 1;
                }
            }
            b'.' if !seen_dot => seen_dot = true,
            _ => break,
        }
        i += 1;
    }
    if digits == 0 {
        return Err(QuantityError::InvalidNumber { input: s.into() });
    }

    let suffix = &s[i..];
    let (exp10, exp2) = parse_suffix(s, suffix)?;
    Ok(Parsed {
        negative,
        mantissa,
        exp10: exp10 - frac_digits,
        exp2,
    })
}

/// Returns `(decimal exponent, binary exponent)` of a suffix.
fn parse_suffix(input: &str, suffix: &str) -> Result<(i32, u32), QuantityError> {
    let known = match suffix {
        "" => Some((0, 0)),
        "m" => Some((-3, 0)),
        "k" | "K" => Some((3, 0)),
        "M" => Some((6, 0)),
        "G" => Some((9, 0)),
        "T" => Some((12, 0)),
        "P" => Some((15, 0)),
        "E" => Some((18, 0)),
        "Ki" => Some((0, 10)),
        "Mi" => Some((0, 20)),
        "Gi" => Some((0, 30)),
        "Ti" => Some((0, 40)),
        "Pi" => Some((0, 50)),
        "Ei" => Some((0, 60)),
        _ => None,
    };
    if let Some(k) = known {
        return Ok(k);
    }
    if let Some(exp) = suffix.strip_prefix(['e', 'E']) {
        let (neg, digits) = match exp.as_bytes().first() {
            Some(b'-') => (true, &exp[1..]),
            Some(b'+') => (false, &exp[1..]),
            _ => (false, exp),
        };
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            let out_of_range = || QuantityError::ExponentOutOfRange {
                input: input.into(),
            };
            let magnitude: i32 = digits.parse().map_err(|_| out_of_range())?;
            if magnitude > MAX_EXPONENT {
                return Err(out_of_range());
            }
            return Ok((if neg { -magnitude } else { magnitude }, 0));
        }
    }
    Err(QuantityError::UnknownSuffix {
        input: input.into(),
        suffix: suffix.into(),
    })
}

/// A cpu limit in millicores that deserializes from a quantity string (`"500m"`, `"2"`) and
/// serializes back to the canonical `"{n}m"` form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CpuMillis(pub u64);

/// A byte count that deserializes from a quantity string (`"512Mi"`) or a plain integer and
/// serializes as a plain byte count string (`"536870912"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(pub u64);

impl fmt::Display for CpuMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}m", self.0)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for CpuMillis {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_cpu_millis(s).map(CpuMillis)
    }
}

impl std::str::FromStr for Bytes {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_bytes(s).map(Bytes)
    }
}

impl serde::Serialize for CpuMillis {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl serde::Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Accepts a quantity string or a JSON number (a bare number means units, as in Kubernetes).
struct QuantityVisitor<T> {
    parse: fn(&str) -> Result<T, QuantityError>,
}

impl<T> serde::de::Visitor<'_> for QuantityVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a quantity such as \"500m\", \"2\" or \"512Mi\"")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        (self.parse)(v).map_err(E::custom)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
        (self.parse)(&v.to_string()).map_err(E::custom)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<T, E> {
        (self.parse)(&v.to_string()).map_err(E::custom)
    }
}

impl<'de> serde::Deserialize<'de> for CpuMillis {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(QuantityVisitor {
            parse: |s| parse_cpu_millis(s).map(CpuMillis),
        })
    }
}

impl<'de> serde::Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(QuantityVisitor {
            parse: |s| parse_bytes(s).map(Bytes),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KI: u64 = 1 << 10;
    const MI: u64 = 1 << 20;
    const GI: u64 = 1 << 30;

    #[test]
    fn cpu_table() {
        let table: &[(&str, u64)] = &[
            ("500m", 500),
            ("1m", 1),
            ("2", 2000),
            ("0.5", 500),
            (".5", 500),
            ("5.", 5000),
            ("+1", 1000),
            ("1.5", 1500),
            ("0.0001", 1), // a tenth of a millicore rounds up
            ("1500m", 1500),
            ("2000000m", 2_000_000),
            ("1e3", 1_000_000),
            ("1E-3", 1),
            ("250e-3", 250),
            ("1k", 1_000_000),
            ("64", 64_000),
        ];
        for (input, want) in table {
            assert_eq!(parse_cpu_millis(input), Ok(*want), "input {input:?}");
        }
    }

    #[test]
    fn bytes_table() {
        let table: &[(&str, u64)] = &[
            ("512Mi", 512 * MI),
            ("2Gi", 2 * GI),
            ("1.5Gi", 3 * GI / 2),
            ("1G", 1_000_000_000),
            ("100M", 100_000_000),
            ("1024", 1024),
            ("1Ki", KI),
            ("1k", 1000),
            ("1K", 1000),
            ("1Ti", 1 << 40),
            ("1Pi", 1 << 50),
            ("1Ei", 1 << 60),
            ("15Ei", 15 << 60),
            ("1T", 1_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("18E", 18_000_000_000_000_000_000),
            ("1e9", 1_000_000_000),
            ("1E9", 1_000_000_000),
            ("1e+3", 1000),
            ("12e-1", 2), // 1.2 bytes round up
            ("0.1Ki", 103),
            ("128974848000m", 128_974_848),
            ("1m", 1),
            ("0.5", 1),
            ("00064Mi", 64 * MI),
            ("18446744073709551615", u64::MAX),
        ];
        for (input, want) in table {
            assert_eq!(parse_bytes(input), Ok(*want), "input {input:?}");
        }
    }

    #[test]
    fn rejects_with_clear_errors() {
        let cases: &[(&str, &str)] = &[
            ("", r#"invalid quantity "": empty"#),
            ("Gi", r#"invalid quantity "Gi": expected a number"#),
            (".", r#"invalid quantity ".": expected a number"#),
            ("-", r#"invalid quantity "-": expected a number"#),
            ("2Gx", r#"invalid quantity "2Gx": unknown suffix "Gx""#),
            ("2gi", r#"invalid quantity "2gi": unknown suffix "gi""#),
            ("1 Gi", r#"invalid quantity "1 Gi": unknown suffix " Gi""#),
            (" 1", r#"invalid quantity " 1": expected a number"#),
            ("1.2.3", r#"invalid quantity "1.2.3": unknown suffix ".3""#),
            ("1e", r#"invalid quantity "1e": unknown suffix "e""#),
            ("1e+", r#"invalid quantity "1e+": unknown suffix "e+""#),
            ("1Ki2", r#"invalid quantity "1Ki2": unknown suffix "Ki2""#),
            (
                "1e61",
                r#"invalid quantity "1e61": exponent out of range (at most 60 either way)"#,
            ),
            (
                "1e99999999999",
                r#"invalid quantity "1e99999999999": exponent out of range (at most 60 either way)"#,
            ),
            ("-1", r#"invalid quantity "-1": negative"#),
            ("-512Mi", r#"invalid quantity "-512Mi": negative"#),
            ("0", r#"invalid quantity "0": must be greater than zero"#),
            ("-0", r#"invalid quantity "-0": must be greater than zero"#),
            (
                "0Gi",
                r#"invalid quantity "0Gi": must be greater than zero"#,
            ),
            (
                "0.000",
                r#"invalid quantity "0.000": must be greater than zero"#,
            ),
            ("16Ei", r#"invalid quantity "16Ei": too large"#),
            ("19E", r#"invalid quantity "19E": too large"#),
            (
                "18446744073709551616",
                r#"invalid quantity "18446744073709551616": too large"#,
            ),
            ("1e60", r#"invalid quantity "1e60": too large"#),
            (
                "9999999999999999999999999999999999999999999",
                r#"invalid quantity "9999999999999999999999999999999999999999999": too large"#,
            ),
        ];
        for (input, want) in cases {
            let err = parse_bytes(input).expect_err(input);
            assert_eq!(err.to_string(), *want, "input {input:?}");
        }
    }

    #[test]
    fn cpu_overflow_counts_the_milli_scale() {
        // 2^64 / 1000 cores fit in u64 bytes but not in u64 millicores.
        assert!(matches!(
            parse_cpu_millis("18446744073709552"),
            Err(QuantityError::Overflow { .. })
        ));
        assert_eq!(
            parse_cpu_millis("18446744073709551"),
            Ok(18_446_744_073_709_551_000)
        );
    }

    #[test]
    fn tiny_values_round_up_to_one() {
        assert_eq!(parse_bytes("1e-60"), Ok(1));
        assert_eq!(parse_cpu_millis("1e-60"), Ok(1));
    }

    #[test]
    fn serde_accepts_strings_and_numbers() {
        #[derive(serde::Deserialize, serde::Serialize, Debug, PartialEq)]
        struct Limits {
            cpu: CpuMillis,
            memory: Bytes,
        }
        let l: Limits = serde_json::from_str(r#"{"cpu":"500m","memory":"512Mi"}"#).unwrap();
        assert_eq!(
            l,
            Limits {
                cpu: CpuMillis(500),
                memory: Bytes(512 * MI)
            }
        );
        let l: Limits = serde_json::from_str(r#"{"cpu":2,"memory":1024}"#).unwrap();
        assert_eq!(l.cpu, CpuMillis(2000));
        assert_eq!(l.memory, Bytes(1024));
        assert_eq!(
            serde_json::to_string(&l).unwrap(),
            r#"{"cpu":"2000m","memory":"1024"}"#
        );
        let err = serde_json::from_str::<Limits>(r#"{"cpu":"2Gx","memory":"1"}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains(r#"invalid quantity "2Gx": unknown suffix "Gx""#),
            "{err}"
        );
        let err = serde_json::from_str::<Limits>(r#"{"cpu":"0","memory":"1"}"#).unwrap_err();
        assert!(
            err.to_string().contains("must be greater than zero"),
            "{err}"
        );
    }
}
