//! How sandboxes look in a terminal: the `ls` table and the `get` summary.

use chrono::{DateTime, Utc};
use fastbox_api::lifecycle::Sandbox;

use super::quote::shell_join;

const TABLE_HEADER: [&str; 5] = ["ID", "STATE", "IMAGE", "CREATED", "EXPIRES"];

/// One row per sandbox under a header, columns aligned.
pub fn sandbox_table(items: &[Sandbox]) -> String {
    let rows: Vec<[String; 5]> = items
        .iter()
        .map(|s| {
            [
                s.id.clone(),
                s.status.state.to_string(),
                image(s),
                time(Some(s.created_at)),
                expiry(s),
            ]
        })
        .collect();
    let header = TABLE_HEADER.map(str::to_string);
    let mut widths = [0usize; 5];
    for row in std::iter::once(&header).chain(&rows) {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:width$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// A sandbox as `key  value` lines.
pub fn sandbox_summary(s: &Sandbox) -> String {
    let mut lines = vec![("id", s.id.clone()), ("state", s.status.state.to_string())];
    if let Some(reason) = &s.status.reason {
        lines.push(("reason", reason.clone()));
    }
    if let Some(message) = &s.status.message {
        lines.push(("message", message.clone()));
    }
    lines.extend([
        ("image", image(s)),
        ("entrypoint", shell_join(&s.entrypoint)),
        ("created", time(Some(s.created_at))),
        ("expires", expiry(s)),
    ]);
    let metadata = s.metadata.iter().flatten();
    let metadata: Vec<String> = metadata.map(|(k, v)| format!("{k}={v}")).collect();
    lines.push((
        "metadata",
        if metadata.is_empty() {
            "-".to_string()
        } else {
            metadata.join(", ")
        },
    ));
    lines
        .iter()
        .map(|(key, value)| format!("{key:<11} {value}\n"))
        .collect()
}

fn image(s: &Sandbox) -> String {
    s.image
        .as_ref()
        .map(|i| i.uri.clone())
        .or_else(|| s.snapshot_id.as_ref().map(|id| format!("snapshot {id}")))
        .unwrap_or_else(|| "-".to_string())
}

fn expiry(s: &Sandbox) -> String {
    match s.expires_at {
        Some(t) => time(Some(t)),
        None => "never".to_string(),
    }
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|| "-".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_api::lifecycle::{ImageSpec, SandboxState, SandboxStatus, StringMap};

    fn sandbox(id: &str, expires: bool) -> Sandbox {
        let created: DateTime<Utc> = "2026-11-30T01:02:03.456Z".parse().unwrap();
        Sandbox {
            id: id.into(),
            status: SandboxStatus {
                state: SandboxState::Running,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            entrypoint: vec!["sh".into(), "-c".into(), "sleep 1".into()],
            created_at: created,
            image: Some(ImageSpec {
                uri: "fastbox/busybox".into(),
                auth: None,
            }),
            snapshot_id: None,
            platform: None,
            metadata: Some(StringMap::from([("team".into(), "a".into())])),
            extensions: None,
            expires_at: expires.then(|| created + chrono::Duration::seconds(600)),
        }
    }

    #[test]
    fn the_table_aligns_columns() {
        let table = sandbox_table(&[sandbox("a", true), sandbox("longer-id", false)]);
        assert_eq!(
            table,
            "ID         STATE    IMAGE            CREATED               EXPIRES\n\
             a          Running  fastbox/busybox  2026-11-30T01:02:03Z  2026-11-30T01:12:03Z\n\
             longer-id  Running  fastbox/busybox  2026-11-30T01:02:03Z  never\n"
        );
    }

    #[test]
    fn the_summary_names_every_field() {
        let summary = sandbox_summary(&sandbox("a", false));
        assert!(summary.contains("state       Running\n"), "{summary}");
        assert!(
            summary.contains("entrypoint  sh -c 'sleep 1'\n"),
            "{summary}"
        );
        assert!(summary.contains("expires     never\n"), "{summary}");
        assert!(summary.contains("metadata    team=a\n"), "{summary}");
    }
}
