//! User and group names from the sandbox's own `/etc/passwd` and `/etc/group`.
//!
//! execd is a static glibc binary injected into arbitrary root filesystems: glibc's NSS
//! (getpwnam and friends) would try to dlopen modules that do not exist there, so names are
//! resolved by reading the two files directly. A missing file simply means "no names": ids are
//! then reported as numbers, as the reference execd does.

use std::path::Path;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("unknown user {0}")]
    UnknownUser(String),
    #[error("unknown group {0}")]
    UnknownGroup(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub gid: u32,
    pub members: Vec<String>,
}

/// The accounts of one root filesystem, loaded once per request.
#[derive(Debug, Default, Clone)]
pub struct Accounts {
    users: Vec<User>,
    groups: Vec<Group>,
}

impl Accounts {
    /// Reads `<root>/etc/passwd` and `<root>/etc/group`.
    pub fn load(root: &Path) -> Self {
        let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
        Self::parse(&read("etc/passwd"), &read("etc/group"))
    }

    /// Accounts of the filesystem execd runs in.
    pub fn system() -> Self {
        Self::load(Path::new("/"))
    }

    pub fn parse(passwd: &str, group: &str) -> Self {
        let users = passwd
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(':').collect();
                if f.len() < 4 || f[0].starts_with('#') {
                    return None;
                }
                Some(User {
                    name: f[0].to_string(),
                    uid: f[2].parse().ok()?,
                    gid: f[3].parse().ok()?,
                    home: f.get(5).copied().unwrap_or("/").to_string(),
                })
            })
            .collect();
        let groups = group
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(':').collect();
                if f.len() < 3 || f[0].starts_with('#') {
                    return None;
                }
                Some(Group {
                    name: f[0].to_string(),
                    gid: f[2].parse().ok()?,
                    members: f
                        .get(3)
                        .map(|m| {
                            m.split(',')
                                .filter(|s| !s.is_empty())
                                .map(str::to_string)
                                .collect()
                        })
                        .unwrap_or_default(),
                })
            })
            .collect();
        Accounts { users, groups }
    }

    pub fn user_by_uid(&self, uid: u32) -> Option<&User> {
        self.users.iter().find(|u| u.uid == uid)
    }

    /// The name for `uid`, or the number as a string.
    pub fn user_name(&self, uid: u32) -> String {
        self.user_by_uid(uid)
            .map(|u| u.name.clone())
            .unwrap_or_else(|| uid.to_string())
    }

    /// The name for `gid`, or the number as a string.
    pub fn group_name(&self, gid: u32) -> String {
        self.groups
            .iter()
            .find(|g| g.gid == gid)
            .map(|g| g.name.clone())
            .unwrap_or_else(|| gid.to_string())
    }

    /// A user given by name or by number.
    pub fn resolve_uid(&self, owner: &str) -> Result<u32, IdentityError> {
        self.users
            .iter()
            .find(|u| u.name == owner)
            .map(|u| u.uid)
            .or_else(|| owner.parse().ok())
            .ok_or_else(|| IdentityError::UnknownUser(owner.to_string()))
    }

    /// A group given by name or by number.
    pub fn resolve_gid(&self, group: &str) -> Result<u32, IdentityError> {
        self.groups
            .iter()
            .find(|g| g.name == group)
            .map(|g| g.gid)
            .or_else(|| group.parse().ok())
            .ok_or_else(|| IdentityError::UnknownGroup(group.to_string()))
    }

    /// The group list a login of `uid` with primary group `gid` gets: `gid` plus every group
    /// naming the user as a member (what initgroups(3) would compute).
    pub fn group_list(&self, uid: u32, gid: u32) -> Vec<u32> {
        let mut gids = vec![gid];
        if let Some(user) = self.user_by_uid(uid) {
            for g in &self.groups {
                if g.members.contains(&user.name) && !gids.contains(&g.gid) {
                    gids.push(g.gid);
                }
            }
        }
        gids
    }
}

/// The identity a child switches to before exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, the primary one included.
    pub groups: Vec<u32>,
}

impl Accounts {
    /// Credentials for running as `uid` with group `gid`, or the user's primary group (or the
    /// uid itself when the user is unknown) when no group is given.
    pub fn credentials(&self, uid: u32, gid: Option<u32>) -> Credentials {
        let gid = gid.unwrap_or_else(|| self.user_by_uid(uid).map(|u| u.gid).unwrap_or(uid));
        Credentials {
            uid,
            gid,
            groups: self.group_list(uid, gid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# comment\nalice:x:1000:1000:Alice:/home/alice:/bin/sh\nbroken\n";
    const GROUP: &str = "root:x:0:\nalice:x:1000:\ndocker:x:998:alice,bob\n";

    #[test]
    fn resolves_names_both_ways() {
        let a = Accounts::parse(PASSWD, GROUP);
        assert_eq!(a.user_name(1000), "alice");
        assert_eq!(a.user_name(4242), "4242");
        assert_eq!(a.group_name(998), "docker");
        assert_eq!(a.resolve_uid("alice"), Ok(1000));
        assert_eq!(a.resolve_uid("77"), Ok(77));
        assert_eq!(
            a.resolve_uid("nobody"),
            Err(IdentityError::UnknownUser("nobody".into()))
        );
        assert_eq!(a.resolve_gid("docker"), Ok(998));
        assert_eq!(a.user_by_uid(1000).unwrap().home, "/home/alice");
    }

    #[test]
    fn group_list_includes_memberships() {
        let a = Accounts::parse(PASSWD, GROUP);
        assert_eq!(a.group_list(1000, 1000), vec![1000, 998]);
        assert_eq!(a.group_list(5, 5), vec![5]);
    }

    #[test]
    fn credentials_default_to_primary_group() {
        let a = Accounts::parse(PASSWD, GROUP);
        let c = a.credentials(1000, None);
        assert_eq!((c.uid, c.gid, c.groups), (1000, 1000, vec![1000, 998]));
        assert_eq!(a.credentials(4242, None).gid, 4242);
        assert_eq!(a.credentials(1000, Some(5)).groups, vec![5, 998]);
    }

    #[test]
    fn missing_files_mean_numeric_names() {
        let a = Accounts::load(Path::new("/nonexistent-root"));
        assert_eq!(a.user_name(0), "0");
    }
}
