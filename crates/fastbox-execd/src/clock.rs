//! Wall-clock helpers: Unix milliseconds for stream events and RFC 3339 strings for JSON.
//!
//! Written by hand (a few lines of civil-calendar arithmetic) so the static binary carries no
//! time-zone database or date crate; everything execd reports is UTC.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, as every stream event's `timestamp` requires.
pub fn now_ms() -> u64 {
    millis_since_epoch(SystemTime::now())
}

pub fn millis_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// `t` as RFC 3339 in UTC with millisecond precision, e.g. `2025-11-16T14:30:45.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_millis()),
        Err(e) => (-(e.duration().as_secs() as i64), 0),
    };
    rfc3339_from_parts(secs, millis)
}

/// Seconds (possibly negative) plus milliseconds since the epoch as RFC 3339 UTC.
pub fn rfc3339_from_parts(secs: i64, millis: u32) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Howard Hinnant's days-since-epoch to (year, month, day) conversion.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_epoch_and_known_dates() {
        assert_eq!(rfc3339_from_parts(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_from_parts(1_700_000_000, 42),
            "2023-11-14T22:13:20.042Z"
        );
        assert_eq!(
            rfc3339_from_parts(951_782_400, 0),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(rfc3339_from_parts(-86_400, 0), "1969-12-31T00:00:00.000Z");
    }
}
