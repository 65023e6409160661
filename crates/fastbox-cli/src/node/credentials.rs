//! A node's two credentials (`fastbox_node_api::remote::Credential`): the one the server
//! presents to the node (`server-to-node`) and the one the node presents to the server's
//! control API (`node-to-server`). The node keeps them in `DATA_DIR/node-credentials/`
//! (0600, made at its first start); the operator hands both to the server as the two lines
//! `fastbox node --print-credentials` prints (`NAME=HEX`).

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;
use fastbox_node_api::remote::Credential;

/// The directory under the node's data directory.
pub const CREDENTIALS_DIR: &str = "node-credentials";
/// The credential the server presents to the node.
pub const SERVER_TO_NODE: &str = "server-to-node";
/// The credential the node presents to the server.
pub const NODE_TO_SERVER: &str = "node-to-server";

/// Both credentials of one node.
#[derive(Clone, Debug)]
pub struct NodeCredentials {
    pub server_to_node: Credential,
    pub node_to_server: Credential,
}

impl NodeCredentials {
    /// The node's credentials in `data_dir`, made now when missing; whether they were.
    pub fn load_or_create(data_dir: &Path) -> anyhow::Result<(Self, bool)> {
        let dir = data_dir.join(CREDENTIALS_DIR);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        let (server_to_node, made_a) = load_or_create_one(&dir.join(SERVER_TO_NODE))?;
        let (node_to_server, made_b) = load_or_create_one(&dir.join(NODE_TO_SERVER))?;
        Ok((
            Self {
                server_to_node,
                node_to_server,
            },
            made_a || made_b,
        ))
    }

    /// Where a node with data directory `data_dir` keeps them.
    pub fn dir(data_dir: &Path) -> PathBuf {
        data_dir.join(CREDENTIALS_DIR)
    }

    /// The two lines the server reads (`--remote-node-credentials`).
    pub fn to_text(&self) -> String {
        format!(
            "{SERVER_TO_NODE}={}\n{NODE_TO_SERVER}={}\n",
            self.server_to_node, self.node_to_server
        )
    }

    /// Reads what [`NodeCredentials::to_text`] wrote (blank lines and `#` comments ignored).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let (mut server_to_node, mut node_to_server) = (None, None);
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((name, value)) = line.split_once('=') else {
                anyhow::bail!("line {}: not NAME=CREDENTIAL", n + 1);
            };
            let slot = match name.trim() {
                SERVER_TO_NODE => &mut server_to_node,
                NODE_TO_SERVER => &mut node_to_server,
                other => anyhow::bail!(
                    "line {}: {other:?} is neither {SERVER_TO_NODE} nor {NODE_TO_SERVER}",
                    n + 1
                ),
            };
            *slot = Some(
                value
                    .parse::<Credential>()
                    .with_context(|| format!("line {} ({})", n + 1, name.trim()))?,
            );
        }
        Ok(Self {
            server_to_node: server_to_node.with_context(|| format!("no {SERVER_TO_NODE}= line"))?,
            node_to_server: node_to_server.with_context(|| format!("no {NODE_TO_SERVER}= line"))?,
        })
    }

    /// Reads the file the operator gave the server.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("node credentials {}", path.display()))?;
        Self::parse(&text).with_context(|| {
            format!(
                "node credentials {} (the two lines `fastbox node --print-credentials` prints)",
                path.display()
            )
        })
    }
}

/// Replaces the file at `path` with `text`, readable by root only (0600), atomically (a
/// sibling renamed over it); its directory is made (0700) when missing.
pub(crate) fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// The credential in `path`, or a new one written there (0600); whether it was made now.
pub(crate) fn load_or_create_one(path: &Path) -> anyhow::Result<(Credential, bool)> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let credential = text
                .parse::<Credential>()
                .with_context(|| format!("credential {}", path.display()))?;
            return Ok((credential, false));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let credential = Credential::generate().context("generate a credential")?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    writeln!(file, "{credential}").with_context(|| format!("write {}", path.display()))?;
    Ok((credential, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_once_kept_private_and_read_back_by_the_server() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (made, created) = NodeCredentials::load_or_create(dir.path()).unwrap();
        assert!(created);
        let (again, created) = NodeCredentials::load_or_create(dir.path()).unwrap();
        assert!(!created);
        assert_eq!(made.to_text(), again.to_text());
        for name in [SERVER_TO_NODE, NODE_TO_SERVER] {
            let meta = std::fs::metadata(NodeCredentials::dir(dir.path()).join(name)).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        }
        let parsed = NodeCredentials::parse(&format!("# node a\n\n{}", made.to_text())).unwrap();
        assert_eq!(parsed.to_text(), made.to_text());
        assert_ne!(
            made.server_to_node.to_string(),
            made.node_to_server.to_string()
        );
    }

    #[test]
    fn a_bad_file_says_what_is_wrong_without_repeating_secrets() {
        let (made, _) =
            NodeCredentials::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        let one = format!("{SERVER_TO_NODE}={}\n", made.server_to_node);
        let e = format!("{:#}", NodeCredentials::parse(&one).unwrap_err());
        assert!(e.contains("no node-to-server= line"), "{e}");
        let e = format!("{:#}", NodeCredentials::parse("nonsense").unwrap_err());
        assert!(e.contains("NAME=CREDENTIAL"), "{e}");
        let short = format!("{SERVER_TO_NODE}=abc\n{NODE_TO_SERVER}=def123\n");
        let e = format!("{:#}", NodeCredentials::parse(&short).unwrap_err());
        assert!(
            e.contains("64 hexadecimal digits") && !e.contains("abc"),
            "{e}"
        );
    }
}
