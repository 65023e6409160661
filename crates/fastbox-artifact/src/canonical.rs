//! Canonical JSON: the one byte sequence a manifest's digest is computed over.
//!
//! Object keys are sorted by their UTF-8 bytes at every depth, there is no whitespace, and
//! strings and numbers are written the way `serde_json` writes them. Sorting is done here
//! rather than left to `serde_json::Map`, whose order changes when any crate in the build
//! enables its `preserve_order` feature.

use serde::Serialize;
use serde_json::Value;

/// The canonical JSON bytes of `value`.
pub fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::new();
    write_value(&value, &mut out)?;
    Ok(out)
}

fn write_value(value: &Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    match value {
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write_value(item, out)?;
            }
            out.push(b'}');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sorts_keys_at_every_depth_without_whitespace() {
        let value = json!({"b": 1, "a": {"z": [3, {"y": "q\"", "x": null}], "c": 1.5}});
        let bytes = to_vec(&value).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"a":{"c":1.5,"z":[3,{"x":null,"y":"q\""}]},"b":1}"#
        );
    }

    #[test]
    fn canonical_bytes_read_back_write_the_same_bytes() {
        // Found by the artifact_manifest fuzz target: serde_json's default float parsing may
        // miss by one unit in the last place, so a float written canonically could read back
        // as its neighbour and write other bytes (the `float_roundtrip` feature parses exactly).
        let value = json!({"ttl": f64::from_bits(0x4c1c_5256_9aaf_68f4), "n": 1e-7, "m": 0.1});
        let bytes = to_vec(&value).unwrap();
        let again: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(again, value);
        assert_eq!(to_vec(&again).unwrap(), bytes);
    }
}
