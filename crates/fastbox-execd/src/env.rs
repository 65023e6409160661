//! Environments for child processes and `$VAR` expansion in working directories.
//!
//! A child's environment is layered: the daemon's own (minus the access token), then the
//! `EXECD_ENVS` file that `commands.set_env` appends to, then the request's `envs`. The file is
//! read at every spawn so a variable set by one command is seen by the next. Its format is what
//! the SDK writes: `KEY='literal'` (possibly spanning lines), `KEY="escaped \n and $VARS"`, or a
//! bare `KEY=value`; `export` prefixes and `#` comments are tolerated.

use std::path::Path;

/// An ordered environment with unique keys.
pub type EnvList = Vec<(String, String)>;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvError {
    #[error("undefined variable ${0} in path")]
    Undefined(String),
    #[error("unterminated ${{ in path")]
    Unterminated,
}

/// Looks `key` up in an environment list.
pub fn get<'a>(env: &'a EnvList, key: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Sets `key`, replacing an existing value in place.
pub fn set(env: &mut EnvList, key: &str, value: &str) {
    match env.iter_mut().find(|(k, _)| k == key) {
        Some(entry) => entry.1 = value.to_string(),
        None => env.push((key.to_string(), value.to_string())),
    }
}

/// Applies `overrides` on top of `env`.
pub fn overlay<'a>(
    env: &mut EnvList,
    overrides: impl IntoIterator<Item = (&'a String, &'a String)>,
) {
    for (k, v) in overrides {
        set(env, k, v);
    }
}

/// Reads and parses the `EXECD_ENVS` file; a missing or unreadable file adds nothing.
pub fn load_env_file(path: &Path, context: &EnvList) -> EnvList {
    std::fs::read_to_string(path)
        .map(|text| parse_env_file(&text, context))
        .unwrap_or_default()
}

/// Parses env-file text. Variables in double-quoted and bare values expand against `context`
/// and the entries parsed before them; undefined ones expand to nothing.
pub fn parse_env_file(text: &str, context: &EnvList) -> EnvList {
    let mut out = EnvList::new();
    let mut chars = text.chars().peekable();
    loop {
        // Skip blank space and comment lines.
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() {
                chars.next();
            } else if c == '#' {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            } else {
                break;
            }
        }
        if chars.peek().is_none() {
            return out;
        }
        let mut key: String =
            std::iter::from_fn(|| chars.next_if(|&c| c != '=' && c != '\n')).collect();
        if chars.next_if_eq(&'=').is_none() {
            continue; // a line without '=' is ignored
        }
        if let Some(rest) = key.trim().strip_prefix("export ") {
            key = rest.to_string();
        }
        let key = key.trim().to_string();
        let lookup = |name: &str| -> Option<String> {
            get(&out, name)
                .or_else(|| get(context, name))
                .map(str::to_string)
        };
        let value = match chars.peek() {
            Some('\'') => {
                chars.next();
                let v: String = std::iter::from_fn(|| chars.next_if(|&c| c != '\'')).collect();
                chars.next();
                skip_rest_of_line(&mut chars);
                v
            }
            Some('"') => {
                chars.next();
                let mut raw = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => match chars.next() {
                            Some('n') => raw.push('\n'),
                            Some('r') => raw.push('\r'),
                            Some('t') => raw.push('\t'),
                            Some('$') => raw.push('\u{0}'), // escaped dollar, restored below
                            Some(other) => raw.push(other),
                            None => {}
                        },
                        c => raw.push(c),
                    }
                }
                skip_rest_of_line(&mut chars);
                expand_vars(&raw, &lookup).replace('\u{0}', "$")
            }
            _ => {
                let line: String = std::iter::from_fn(|| chars.next_if(|&c| c != '\n')).collect();
                let line = match line.find(" #") {
                    Some(i) => &line[..i],
                    None => &line,
                };
                expand_vars(line.trim(), &lookup)
            }
        };
        if is_valid_key(&key) {
            set(&mut out, &key, &value);
        }
    }
}

fn skip_rest_of_line(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    for c in chars.by_ref() {
        if c == '\n' {
            break;
        }
    }
}

fn is_valid_key(key: &str) -> bool {
    let mut chars = key.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Expands `$NAME` and `${NAME}`; names `lookup` does not know become empty.
fn expand_vars(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    expand(s, &|name| Ok(lookup(name).unwrap_or_default())).unwrap_or_else(|_| s.to_string())
}

/// Expands a working directory: `$NAME` and `${NAME}` from `env` (undefined is an error) and a
/// leading `~` to `home`.
pub fn expand_path(raw: &str, env: &EnvList, home: &str) -> Result<String, EnvError> {
    let expanded = expand(raw, &|name| {
        get(env, name)
            .map(str::to_string)
            .ok_or_else(|| EnvError::Undefined(name.to_string()))
    })?;
    Ok(if expanded == "~" {
        home.to_string()
    } else if let Some(rest) = expanded.strip_prefix("~/") {
        format!("{}/{}", home.trim_end_matches('/'), rest)
    } else {
        expanded
    })
}

fn expand(
    s: &str,
    value_of: &dyn Fn(&str) -> Result<String, EnvError>,
) -> Result<String, EnvError> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        if chars.next_if_eq(&'{').is_some() {
            let name: String = std::iter::from_fn(|| chars.next_if(|&c| c != '}')).collect();
            if chars.next_if_eq(&'}').is_none() {
                return Err(EnvError::Unterminated);
            }
            out.push_str(&value_of(&name)?);
        } else {
            let name: String =
                std::iter::from_fn(|| chars.next_if(|&c| c == '_' || c.is_ascii_alphanumeric()))
                    .collect();
            if name.is_empty() {
                out.push('$');
            } else {
                out.push_str(&value_of(&name)?);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> EnvList {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn expands_cwd_variables_and_home() {
        let e = env(&[("W", "/work"), ("SUB", "x")]);
        assert_eq!(
            expand_path("$W/${SUB}/y", &e, "/root").unwrap(),
            "/work/x/y"
        );
        assert_eq!(expand_path("~", &e, "/root").unwrap(), "/root");
        assert_eq!(expand_path("~/a", &e, "/home/u/").unwrap(), "/home/u/a");
        assert_eq!(expand_path("/a/~", &e, "/root").unwrap(), "/a/~");
        assert_eq!(expand_path("cost$", &e, "/").unwrap(), "cost$");
    }

    #[test]
    fn undefined_cwd_variable_is_an_error() {
        let e = env(&[]);
        assert_eq!(
            expand_path("$NOPE/x", &e, "/"),
            Err(EnvError::Undefined("NOPE".into()))
        );
        assert_eq!(expand_path("${A", &e, "/"), Err(EnvError::Unterminated));
    }

    #[test]
    fn parses_the_forms_the_sdk_writes() {
        let ctx = env(&[("HOME", "/root")]);
        let text = "A='x y'\nB=\"q\\\"uote\\n$HOME \\$L\"\n# note\nexport C=plain # c\nM='two\nlines'\nbad key=1\nD=${A}-$B2\n";
        let parsed = parse_env_file(text, &ctx);
        assert_eq!(get(&parsed, "A"), Some("x y"));
        assert_eq!(get(&parsed, "B"), Some("q\"uote\n/root $L"));
        assert_eq!(get(&parsed, "C"), Some("plain"));
        assert_eq!(get(&parsed, "M"), Some("two\nlines"));
        assert_eq!(get(&parsed, "D"), Some("x y-"));
        assert_eq!(get(&parsed, "bad key"), None);
    }

    #[test]
    fn later_entries_override_earlier_ones() {
        let parsed = parse_env_file("A=1\nA=2\n", &EnvList::new());
        assert_eq!(parsed, env(&[("A", "2")]));
    }
}
