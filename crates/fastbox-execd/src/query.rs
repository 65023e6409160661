//! Query-string parsing that keeps repeated keys (`?path=a&path=b`), which axum's `Query`
//! (serde_urlencoded) cannot express and the files API relies on.

use axum::http::Uri;

/// Decoded `(key, value)` pairs in request order.
pub struct QueryPairs(Vec<(String, String)>);

impl QueryPairs {
    pub fn from_uri(uri: &Uri) -> Self {
        Self::parse(uri.query().unwrap_or(""))
    }

    pub fn parse(raw: &str) -> Self {
        let pairs = raw
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('=') {
                Some((k, v)) => (decode(k), decode(v)),
                None => (decode(p), String::new()),
            })
            .collect();
        QueryPairs(pairs)
    }

    /// The first value for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every value for `key`, in order.
    pub fn all(&self, key: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// application/x-www-form-urlencoded decoding: `+` is a space, `%XX` a byte; invalid escapes
/// are kept literally and invalid UTF-8 is replaced.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match (hex_val(bytes.get(i + 1)), hex_val(bytes.get(i + 2))) {
                    (Some(h), Some(l)) => {
                        out.push(h << 4 | l);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(b: Option<&u8>) -> Option<u8> {
    match b? {
        b @ b'0'..=b'9' => Some(b - b'0'),
        b @ b'a'..=b'f' => Some(b - b'a' + 10),
        b @ b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_repeated_keys_and_decodes() {
        let q = QueryPairs::parse("path=%2Ftmp%2Fa&path=%2Fb+c&x&bad=%zz%4");
        assert_eq!(q.all("path"), vec!["/tmp/a", "/b c"]);
        assert_eq!(q.get("x"), Some(""));
        assert_eq!(q.get("bad"), Some("%zz%4"));
        assert_eq!(q.get("none"), None);
    }
}
