//! Argument shapes the client commands share.

/// `KEY=VALUE` (the value may be empty and may contain `=`).
pub fn parse_key_value(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {arg:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_values_split_at_the_first_equals() {
        assert_eq!(
            parse_key_value("A=b=c").unwrap(),
            ("A".to_string(), "b=c".to_string())
        );
        assert_eq!(
            parse_key_value("A=").unwrap(),
            ("A".to_string(), String::new())
        );
        assert!(parse_key_value("A").is_err());
        assert!(parse_key_value("=v").is_err());
    }
}
