//! A create with an `Idempotency-Key` makes one sandbox, whatever became of the store's
//! answer to the write of its intent: a write that landed though its answer was lost (the
//! create goes on, or, once another server took it over, a retry gets that sandbox), or a
//! write still on its way when the failed create gave its key back (it can no longer land).
//!
//! The store is the embedded one behind a wrapper that loses the answer to the first
//! create of a sandbox record.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec};
use fastbox_node_api::NodeAgent;
use fastbox_node_api::testkit::FakeNode;
use fastbox_server::config::{ServerConfig, Settings};
use fastbox_server::error::ApiError;
use fastbox_server::nodes::Nodes;
use fastbox_server::service::Lifecycle;
use fastbox_server::store::{IDEMPOTENCY, SANDBOXES, Store};
use fastbox_state::{Delegate, Guard, RedbBackend, Revision, StateBackend, StateError};

const IMAGE: &str = "registry.test/app:1";
const KEY: &str = "create-1";
const BODY: &[u8] = br#"{"image":{"uri":"registry.test/app:1"}}"#;

/// What becomes of the first create of a sandbox record; its answer is lost every time.
#[derive(Clone, Copy)]
enum Lost {
    /// It lands.
    Landed,
    /// It lands, and another server takes the create over at once.
    LandedAndTakenOver,
    /// It is held back (on its way still), to be let through by the test.
    HeldBack,
}

struct LosesFirstAnswer {
    inner: RedbBackend,
    lost: Lost,
    done: Mutex<bool>,
    held: Mutex<Option<(String, Vec<u8>, Guard)>>,
}

impl Delegate for LosesFirstAnswer {
    fn inner(&self) -> &dyn StateBackend {
        &self.inner
    }
    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        if table != SANDBOXES || std::mem::replace(&mut *self.done.lock().unwrap(), true) {
            return self.inner.create_under(table, key, value, guard);
        }
        match self.lost {
            Lost::Landed => {
                self.inner.create_under(table, key, value, guard)?;
            }
            Lost::LandedAndTakenOver => {
                let revision = self.inner.create_under(table, key, value, guard)?;
                let mut record: serde_json::Value = serde_json::from_slice(value).unwrap();
                record["acting"] = "another-server".into();
                let taken = serde_json::to_vec(&record).unwrap();
                self.inner.put(table, key, &taken, revision, None)?;
            }
            Lost::HeldBack => {
                *self.held.lock().unwrap() = Some((key.to_string(), value.to_vec(), guard.clone()));
            }
        }
        Err(StateError::Unavailable("the answer was lost".into()))
    }
}

fn request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: IMAGE.into(),
            auth: None,
        }),
        entrypoint: Some(vec!["sleep".into(), "infinity".into()]),
        ..Default::default()
    }
}

/// Runs `body` against a server on a store that loses the first create's answer as `lost`
/// says, with one fake node.
fn with_server<F>(lost: Lost, body: F)
where
    F: AsyncFnOnce(Arc<Lifecycle>, Arc<LosesFirstAnswer>, Arc<FakeNode>),
{
    let dir = tempfile::tempdir().expect("tempdir");
    let backend = Arc::new(LosesFirstAnswer {
        inner: RedbBackend::open(&dir.path().join("state.redb")).expect("redb"),
        lost,
        done: Mutex::new(false),
        held: Mutex::new(None),
    });
    let fake = Arc::new(FakeNode::new(4).with_image(IMAGE));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut cfg = ServerConfig::resolve(Settings {
            data_dir: Some(dir.path().to_path_buf()),
            cache_dir: Some(dir.path().join("cache")),
            ..Default::default()
        })
        .expect("config");
        cfg.create_wait = Duration::from_secs(5);
        let keys = fastbox_proxy::RouteKeys::load_or_create(&dir.path().join("route-key"))
            .expect("route keys");
        let lc = Lifecycle::with_nodes(
            cfg,
            Store::with_backend(backend.clone()),
            Nodes::new(vec![fake.clone() as Arc<dyn NodeAgent>]).expect("nodes"),
            fastbox_image::ImageConfig::default(),
            keys,
        )
        .expect("lifecycle");
        body(lc, backend.clone(), fake.clone()).await;
    });
    assert!(fake.violations().is_empty(), "{:?}", fake.violations());
}

fn sandbox_ids(backend: &LosesFirstAnswer) -> Vec<String> {
    let mut ids: Vec<String> = backend
        .inner
        .list(SANDBOXES)
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    ids.sort();
    ids
}

#[test]
fn an_intent_that_landed_though_its_answer_was_lost_is_the_one_sandbox() {
    with_server(Lost::Landed, async |lc, backend, fake| {
        let (first, made_before) = lc
            .create_once(request(), KEY, BODY)
            .await
            .expect("the create goes on from the intent the store holds");
        assert!(!made_before);
        let (again, made_before) = lc.create_once(request(), KEY, BODY).await.expect("retry");
        assert!(made_before, "the retry is answered with the first sandbox");
        assert_eq!(again.id, first.id);
        assert_eq!(sandbox_ids(&backend), vec![first.id.clone()]);
        assert_eq!(fake.sandboxes().len(), 1, "one sandbox on the node");
    });
}

#[test]
fn a_create_taken_over_meanwhile_fails_here_and_its_key_stays_with_the_sandbox() {
    with_server(Lost::LandedAndTakenOver, async |lc, backend, _fake| {
        let failed = lc.create_once(request(), KEY, BODY).await;
        assert!(
            matches!(failed, Err(ApiError::StoreUnavailable(_))),
            "{failed:?}"
        );
        let recorded = sandbox_ids(&backend);
        assert_eq!(recorded.len(), 1, "the intent is recorded: {recorded:?}");
        assert_eq!(
            backend.inner.list(IDEMPOTENCY).unwrap().len(),
            1,
            "the key was not given back"
        );
        let (again, made_before) = lc.create_once(request(), KEY, BODY).await.expect("retry");
        assert!(made_before);
        assert_eq!(
            again.id, recorded[0],
            "the retry gets the sandbox taken over"
        );
        assert_eq!(sandbox_ids(&backend), recorded, "no second sandbox");
    });
}

#[test]
fn an_intent_still_on_its_way_when_the_key_is_given_back_can_no_longer_land() {
    with_server(Lost::HeldBack, async |lc, backend, fake| {
        let failed = lc.create_once(request(), KEY, BODY).await;
        assert!(
            matches!(failed, Err(ApiError::StoreUnavailable(_))),
            "{failed:?}"
        );
        assert!(sandbox_ids(&backend).is_empty());
        assert!(
            backend.inner.list(IDEMPOTENCY).unwrap().is_empty(),
            "no record of the sandbox: the key is given back"
        );
        // The held write arrives now: its guard (the key as recorded) is gone.
        let (id, value, guard) = backend.held.lock().unwrap().take().expect("held");
        let late = backend.inner.create_under(SANDBOXES, &id, &value, &guard);
        assert!(
            matches!(&late, Err(StateError::Conflict { table, .. }) if table == IDEMPOTENCY),
            "{late:?}"
        );
        let (retried, made_before) = lc.create_once(request(), KEY, BODY).await.expect("retry");
        assert!(!made_before, "the retry runs the create again");
        assert_ne!(retried.id, id);
        assert_eq!(
            sandbox_ids(&backend),
            vec![retried.id.clone()],
            "one sandbox"
        );
        assert_eq!(fake.sandboxes().len(), 1);
    });
}
