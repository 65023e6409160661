//! File modes as the API writes them: an integer whose *decimal* digits are the octal bits,
//! so `755` means `0o755` (the reference execd converts with `ParseUint(Itoa(mode), 8, 32)`).

/// `755` -> `0o755`. Every digit must be 0-7 and there may be at most four.
pub fn parse_mode(decimal: u32) -> Option<u32> {
    let digits = decimal.to_string();
    if digits.len() > 4 {
        return None;
    }
    u32::from_str_radix(&digits, 8).ok()
}

/// `0o755` -> `755`, permission bits only.
pub fn format_mode(bits: u32) -> u32 {
    format!("{:o}", bits & 0o777).parse().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_digits_are_octal_bits() {
        assert_eq!(parse_mode(755), Some(0o755));
        assert_eq!(parse_mode(644), Some(0o644));
        assert_eq!(parse_mode(7), Some(0o7));
        assert_eq!(parse_mode(4755), Some(0o4755));
        assert_eq!(parse_mode(0), Some(0));
        assert_eq!(parse_mode(758), None);
        assert_eq!(parse_mode(17777), None);
    }

    #[test]
    fn formats_permission_bits_as_decimal() {
        assert_eq!(format_mode(0o100755), 755);
        assert_eq!(format_mode(0o40700), 700);
        assert_eq!(format_mode(0o4), 4);
    }
}
