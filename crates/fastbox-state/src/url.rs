//! `--state` values: where the records are.
//!
//! - a path, or `redb:PATH`: the embedded redb file;
//! - `etcd://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...][/PREFIX]`: etcd over plain HTTP;
//! - `etcds://...`: the same over TLS.
//!
//! The key prefix defaults to `/fastbox`: several fastbox clusters can share one etcd under
//! different prefixes. A password is better given in `FASTBOX_STATE_PASSWORD` than in the
//! URL, which shows in process listings.

use std::fmt;
use std::path::PathBuf;

/// The default key prefix in etcd.
pub const DEFAULT_PREFIX: &str = "/fastbox";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateUrl {
    Redb(PathBuf),
    Etcd(EtcdTarget),
}

/// An etcd cluster and where in it the records are.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTarget {
    /// `host:port` of each member.
    pub members: Vec<String>,
    pub tls: bool,
    pub user: Option<String>,
    pub password: Option<String>,
    /// Key prefix, starting with `/`, no trailing `/`.
    pub prefix: String,
}

impl fmt::Debug for EtcdTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTarget")
            .field("members", &self.members)
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl fmt::Display for EtcdTarget {
    /// The URL without its password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "etcds" } else { "etcd" };
        let user = self
            .user
            .as_ref()
            .map(|u| format!("{u}@"))
            .unwrap_or_default();
        write!(
            f,
            "{scheme}://{user}{}{}",
            self.members.join(","),
            self.prefix
        )
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--state {value:?}: {reason}")]
pub struct StateUrlError {
    value: String,
    reason: String,
}

impl StateUrl {
    /// Parses a `--state` value.
    pub fn parse(value: &str) -> Result<Self, StateUrlError> {
        let fail = |reason: &str| StateUrlError {
            value: redact(value),
            reason: reason.to_string(),
        };
        let (tls, rest) = if let Some(rest) = value.strip_prefix("etcd://") {
            (false, rest)
        } else if let Some(rest) = value.strip_prefix("etcds://") {
            (true, rest)
        } else if let Some(path) = value.strip_prefix("redb:") {
            return Ok(Self::Redb(PathBuf::from(path)));
        } else if value.contains("://") {
            return Err(fail(
                "unknown scheme (etcd://, etcds:// or a redb file path)",
            ));
        } else if value.is_empty() {
            return Err(fail("empty"));
        } else {
            return Ok(Self::Redb(PathBuf::from(value)));
        };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, DEFAULT_PREFIX),
        };
        let prefix = if prefix.is_empty() {
            DEFAULT_PREFIX
        } else {
            prefix
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            None => (None, None),
            Some(info) => match info.split_once(':') {
                Some((user, password)) => (Some(user.to_string()), Some(password.to_string())),
                None => (Some(info.to_string()), None),
            },
        };
        if user.as_deref() == Some("") {
            return Err(fail("empty user name"));
        }
        let mut members = Vec::new();
        for member in hosts.split(',') {
            let Some((host, port)) = member.rsplit_once(':') else {
                return Err(fail("each member is HOST:PORT"));
            };
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(fail("each member is HOST:PORT"));
            }
            members.push(member.to_string());
        }
        if prefix.contains("//") || prefix.chars().any(|c| c.is_control()) {
            return Err(fail("bad key prefix"));
        }
        Ok(Self::Etcd(EtcdTarget {
            members,
            tls,
            user,
            password,
            prefix: prefix.to_string(),
        }))
    }
}

impl fmt::Display for StateUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Redb(path) => write!(f, "{}", path.display()),
            Self::Etcd(target) => target.fmt(f),
        }
    }
}

/// `value` with the password of its userinfo hidden.
fn redact(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else {
        return value.to_string();
    };
    match rest.rsplit_once('@') {
        Some((info, hosts)) => match info.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:<hidden>@{hosts}"),
            None => value.to_string(),
        },
        None => value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(value: &str) -> EtcdTarget {
        match StateUrl::parse(value).unwrap() {
            StateUrl::Etcd(t) => t,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paths_are_redb_files() {
        assert_eq!(
            StateUrl::parse("/var/lib/fastbox/state.redb").unwrap(),
            StateUrl::Redb("/var/lib/fastbox/state.redb".into())
        );
        assert_eq!(
            StateUrl::parse("redb:state.redb").unwrap(),
            StateUrl::Redb("state.redb".into())
        );
    }

    #[test]
    fn etcd_urls_name_members_auth_and_prefix() {
        let t = etcd("etcd://127.0.0.1:2379,127.0.0.1:2380");
        assert_eq!(t.members, ["127.0.0.1:2379", "127.0.0.1:2380"]);
        assert!(!t.tls);
        assert_eq!(t.prefix, "/fastbox");
        assert_eq!(t.user, None);

        let t = etcd("etcds://fb:secret@etcd-a:2379/prod/");
        assert!(t.tls);
        assert_eq!(t.user.as_deref(), Some("fb"));
        assert_eq!(t.password.as_deref(), Some("secret"));
        assert_eq!(t.prefix, "/prod");
        assert_eq!(t.to_string(), "etcds://fb@etcd-a:2379/prod");
        assert!(!format!("{t:?}").contains("secret"));
    }

    #[test]
    fn bad_urls_are_refused_without_echoing_the_password() {
        for bad in [
            "etcd://",
            "etcd://host",
            "etcd://host:0",
            "etcd://host:x",
            "etcd://:2379",
            "etcd://:pw@host:2379",
            "http://host:2379",
            "",
        ] {
            assert!(StateUrl::parse(bad).is_err(), "{bad}");
        }
        let e = StateUrl::parse("etcd://u:hunter2@host").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
