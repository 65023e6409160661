//! The etcd watch: one stream of every change under the prefix, followed again from the
//! next revision after any failure (another member, when the one it was on is gone).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::time::Duration;

use serde_json::{Value, json};

use super::client::{EtcdClient, Method, b64, int, unb64};
use crate::{Entry, Revision, StateError, Watch, WatchEvent};

/// A stream with nothing to read this long is opened again (a member cut off without a
/// reset is noticed).
const IDLE: Duration = Duration::from_secs(15);
/// The pause before following again after a failure.
const RETRY: Duration = Duration::from_millis(300);

pub(super) fn start(client: Arc<EtcdClient>, from: Revision) -> Result<Watch, StateError> {
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::Builder::new()
        .name("state-watch".into())
        .spawn(move || {
            follow(&client, from, &tx, &stopped);
            stopped.store(true, Ordering::Relaxed);
        })
        .map_err(|e| StateError::Failed(format!("cannot start the watch thread: {e}")))?;
    Ok(Watch::new(rx, stop))
}

/// Follows the changes from `from` until `stop` is set or the receiver is gone.
fn follow(client: &EtcdClient, from: Revision, tx: &Sender<WatchEvent>, stop: &AtomicBool) {
    let prefix = format!("{}/", client.target().prefix);
    let mut end = prefix.clone().into_bytes();
    *end.last_mut().expect("prefix ends in /") += 1;
    let mut next = from;
    let mut receiver_gone = false;
    while !stop.load(Ordering::Relaxed) && !receiver_gone {
        let body = json!({"create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&end),
            "start_revision": next.to_string(),
        }});
        let outcome = client.stream(Method::Watch, &body, Some(IDLE), |message| {
            if stop.load(Ordering::Relaxed) {
                return Err(StateError::Failed("stopped".into()));
            }
            let result = message;
            let compacted = int(result.get("compact_revision"));
            if compacted > 0 || result.get("canceled").and_then(Value::as_bool) == Some(true) {
                // The history from `next` is gone: the receiver reads everything again,
                // and the watch goes on from the present.
                next = match compacted {
                    0 => int(result.pointer("/header/revision")) + 1,
                    // The oldest revision etcd still has.
                    oldest => oldest,
                };
                send(tx, WatchEvent::Reset, &mut receiver_gone)?;
                return Err(StateError::Failed("history compacted".into()));
            }
            for event in result
                .get("events")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let kv = &event["kv"];
                let revision = int(kv.get("mod_revision"));
                let full = String::from_utf8(unb64(&kv["key"])?).unwrap_or_default();
                let Some((table, key)) = full
                    .strip_prefix(&prefix)
                    .and_then(|rest| rest.split_once('/'))
                else {
                    next = revision + 1;
                    continue;
                };
                let change = if event.get("type").and_then(Value::as_str) == Some("DELETE") {
                    WatchEvent::Delete {
                        table: table.to_string(),
                        key: key.to_string(),
                        revision,
                    }
                } else {
                    WatchEvent::Put {
                        table: table.to_string(),
                        entry: Entry {
                            key: key.to_string(),
                            value: unb64(&kv["value"])?,
                            revision,
                        },
                    }
                };
                send(tx, change, &mut receiver_gone)?;
                next = revision + 1;
            }
            Ok(())
        });
        if let Err(e) = outcome
            && !stop.load(Ordering::Relaxed)
        {
            tracing::debug!(error = %e, next, "the state watch follows again");
        }
        std::thread::sleep(RETRY);
    }
}

fn send(tx: &Sender<WatchEvent>, event: WatchEvent, gone: &mut bool) -> Result<(), StateError> {
    tx.send(event).map_err(|_| {
        *gone = true;
        StateError::Failed("the watch's receiver is gone".into())
    })
}
