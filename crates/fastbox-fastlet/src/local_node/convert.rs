//! The fastlet's own types as the node boundary carries them, and back: placements (whose
//! JSON stays what the server has always recorded), start, snapshot and removal reports,
//! errors and the node proxy's refusals.

use fastbox_node_api::wire::{self, NodeHandle, NodePlacement, PhaseTiming, ProxyRefusal};
use fastbox_node_api::{NodeError, NodeErrorKind};
use fastbox_runtime::sandbox::SandboxHandle;

use crate::agent::{FastletError, Placement, RemoveReport, StartReport};
use crate::node_proxy::NodeProxyError;
use crate::snapshot::SnapshotReport;

/// `placement` as the server records it: the runtime's handle serialized as it is, so the
/// JSON of the result is the JSON of `placement` (records written before the node boundary
/// read as placements, and the other way round).
pub fn to_node_placement(placement: &Placement) -> Result<NodePlacement, NodeError> {
    let handle = serde_json::to_value(&placement.handle).map_err(|e| {
        NodeError::failed(format!(
            "sandbox {}: its handle cannot be recorded: {e}",
            placement.handle.id
        ))
    })?;
    Ok(NodePlacement {
        slot: placement.slot,
        address: placement.address,
        handle: NodeHandle(handle),
    })
}

/// A placement this node answered earlier. A handle that is not a runtime handle was not
/// made here: the sandbox is not this node's ([`NodeErrorKind::NotFound`]).
pub fn to_placement(placement: &NodePlacement) -> Result<Placement, NodeError> {
    let handle: SandboxHandle = serde_json::from_value(placement.handle.0.clone())
        .map_err(|e| NodeError::not_found(format!("not a sandbox handle of this node: {e}")))?;
    Ok(Placement {
        slot: placement.slot,
        address: placement.address,
        handle,
    })
}

/// How a start went, in milliseconds.
pub fn start_report(report: &StartReport) -> wire::StartReport {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    wire::StartReport {
        source: report.source.clone(),
        phases: report
            .phases
            .all()
            .map(|(name, took, detail)| PhaseTiming {
                name: name.to_string(),
                ms: ms(took),
                detail,
            })
            .collect(),
        total_ms: ms(report.phases.total()),
        summary: report.summary(),
    }
}

/// How a checkpoint went: its one-line summary and what the server keeps of it.
pub fn snapshot_report(report: &SnapshotReport) -> wire::SnapshotReport {
    wire::SnapshotReport {
        summary: report.summary(),
        manifest: report.manifest.clone(),
        bytes: report.bytes,
        streamed: report.streamed,
    }
}

pub fn remove_report(report: RemoveReport) -> wire::RemoveReport {
    wire::RemoveReport {
        processes_gone_ms: report.processes_gone_ms,
        total_ms: report.total_ms,
    }
}

/// The kind of a fastlet error as the server acts on it; the message is its text.
pub fn node_error(e: &FastletError) -> NodeError {
    let kind = match e {
        FastletError::NoCapacity { .. } => NodeErrorKind::NoCapacity,
        FastletError::Image(_) => NodeErrorKind::BadImage,
        FastletError::NotHere(_) => NodeErrorKind::NotFound,
        _ => NodeErrorKind::Failed,
    };
    NodeError::new(kind, e.to_string())
}

impl From<FastletError> for NodeError {
    fn from(e: FastletError) -> Self {
        node_error(&e)
    }
}

/// The node proxy's refusal as the boundary carries it. A refusal the node proxy answers
/// itself (401, 429 with `Retry-After`) travels as that answer, so a caller that passes it
/// on answers what the node proxy would have.
impl From<NodeProxyError> for ProxyRefusal {
    fn from(e: NodeProxyError) -> Self {
        match e {
            NodeProxyError::BadRoute(path) => Self::BadRoute(path),
            NodeProxyError::NotRunning(id) => Self::NotRunning(id),
            NodeProxyError::Forbidden(why) => Self::Forbidden(why.to_string()),
            NodeProxyError::Unsigned => Self::Unsigned,
            NodeProxyError::Unauthorized(_) | NodeProxyError::TooManyFailures(_) => {
                Self::Answered {
                    status: e.status().as_u16(),
                    code: e.code().to_string(),
                    message: e.to_string(),
                    retry_after_secs: match &e {
                        NodeProxyError::TooManyFailures(limited) => {
                            Some(limited.retry_after_secs())
                        }
                        _ => None,
                    },
                }
            }
            NodeProxyError::Upstream(why) => Self::Upstream(why.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use axum::response::IntoResponse;

    use super::*;
    use crate::phases::Phases;

    fn placement() -> Placement {
        let mut handle = SandboxHandle::unstarted("sbx", "fb", PathBuf::from("/d/sandboxes/sbx"));
        handle.init_pid = 4242;
        handle.init_start_ticks = 99;
        handle.execd_digest = "blake3:ab".into();
        handle.netns = PathBuf::from("/run/netns/fb-3");
        Placement {
            slot: 3,
            address: "10.77.0.7".parse().unwrap(),
            handle,
        }
    }

    #[test]
    fn node_placements_are_recorded_as_placements_were() {
        let old = placement();
        let new = to_node_placement(&old).unwrap();
        assert_eq!(
            serde_json::to_value(&new).unwrap(),
            serde_json::to_value(&old).unwrap()
        );
        // A record written before the boundary reads as a node placement, and back.
        let recorded = serde_json::to_string(&old).unwrap();
        let read: NodePlacement = serde_json::from_str(&recorded).unwrap();
        assert_eq!(read, new);
        let back = to_placement(&read).unwrap();
        assert_eq!(
            serde_json::to_value(&back).unwrap(),
            serde_json::to_value(&old).unwrap()
        );
        let foreign = NodePlacement {
            handle: NodeHandle(serde_json::json!({"vm": 1})),
            ..new
        };
        assert_eq!(
            to_placement(&foreign).unwrap_err().kind,
            NodeErrorKind::NotFound
        );
    }

    #[test]
    fn start_reports_keep_phases_details_and_total() {
        let mut phases = Phases::default();
        phases.push("slot", Duration::from_micros(1500));
        phases.note("slot.netns", Duration::from_millis(1));
        phases.push("claim", Duration::from_millis(2));
        let report = StartReport {
            source: "restore".into(),
            phases,
        };
        let wire = start_report(&report);
        assert_eq!(wire.source, "restore");
        assert_eq!(wire.summary, report.summary());
        assert_eq!(wire.total_ms, 3.5);
        let phases: Vec<_> = wire
            .phases
            .iter()
            .map(|p| (p.name.as_str(), p.ms, p.detail))
            .collect();
        assert_eq!(
            phases,
            [
                ("slot", 1.5, false),
                ("slot.netns", 1.0, true),
                ("claim", 2.0, false)
            ]
        );
    }

    #[test]
    fn errors_keep_their_text_and_say_what_to_do() {
        let full = node_error(&FastletError::NoCapacity { capacity: 4 });
        assert_eq!(full.kind, NodeErrorKind::NoCapacity);
        assert!(full.message.contains("all 4 slots"), "{}", full.message);
        let gone = node_error(&FastletError::NotHere("sbx".into()));
        assert_eq!(gone.kind, NodeErrorKind::NotFound);
        let failed = node_error(&FastletError::Snapshot {
            key: "k".into(),
            message: "dump failed".into(),
        });
        assert_eq!(failed.kind, NodeErrorKind::Failed);
        assert_eq!(failed.message, "snapshot k: dump failed");
    }

    #[tokio::test]
    async fn answered_refusals_are_what_the_node_proxy_answers() {
        let unauthorized = || NodeProxyError::Unauthorized("wrong token");
        let ProxyRefusal::Answered {
            status,
            code,
            message,
            retry_after_secs,
        } = ProxyRefusal::from(unauthorized())
        else {
            panic!("not answered");
        };
        let response = unauthorized().into_response();
        assert_eq!(status, response.status().as_u16());
        assert_eq!(retry_after_secs, None);
        assert!(response.headers().get("retry-after").is_none());
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: fastbox_api::lifecycle::ErrorResponse = serde_json::from_slice(&body).unwrap();
        assert_eq!((code, message), (body.code, body.message));

        let limited = crate::node_proxy::access::Limited {
            by: crate::node_proxy::access::LimitedBy::Source,
            retry_after: Duration::from_millis(2500),
        };
        let too_many = || NodeProxyError::TooManyFailures(limited);
        let ProxyRefusal::Answered {
            status,
            code,
            message,
            retry_after_secs,
        } = ProxyRefusal::from(too_many())
        else {
            panic!("not answered");
        };
        let response = too_many().into_response();
        assert_eq!(status, 429);
        assert_eq!(retry_after_secs, Some(3));
        assert_eq!(status, response.status().as_u16());
        let retry_after = response.headers().get("retry-after").unwrap();
        assert_eq!(
            retry_after_secs.map(|s| s.to_string()).as_deref(),
            Some(retry_after.to_str().unwrap())
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: fastbox_api::lifecycle::ErrorResponse = serde_json::from_slice(&body).unwrap();
        assert_eq!((code, message), (body.code, body.message));
    }
}
