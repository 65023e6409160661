//! A create answers once its intent is durable and its node call is done: the record's
//! `Running` is shown by the server that started it before it is durable, and a change
//! made from that version (a delete, a pause sent as soon as the create answered) is neither
//! refused as busy nor lost to the start's own write, which lands after it.
//!
//! The store is the embedded one behind a wrapper that runs a test's step just before the
//! start's `Running` write reaches it: the moment after the answer, before the write.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec, SandboxState};
use fastbox_node_api::NodeAgent;
use fastbox_node_api::testkit::{FakeNode, SlotState, Verb};
use fastbox_server::config::{ServerConfig, Settings};
use fastbox_server::nodes::Nodes;
use fastbox_server::service::Lifecycle;
use fastbox_server::store::{SANDBOXES, Store};
use fastbox_state::{Delegate, Fence, RedbBackend, Revision, StateBackend, StateError};

const IMAGE: &str = "registry.test/app:1";
const PATIENCE: Duration = Duration::from_secs(10);

type Step = Box<dyn FnOnce(&Arc<Lifecycle>, &str) + Send>;

/// The embedded store, running `before_running` once, just before the first write of a
/// sandbox record whose state is `Running`.
struct BeforeRunning {
    inner: RedbBackend,
    /// How many `Running` writes fail as an unreachable store would.
    unreachable_running_writes: AtomicUsize,
    before_running: Mutex<Option<Step>>,
    lifecycle: OnceLock<Arc<Lifecycle>>,
    /// What the store held of the sandbox when the step ran.
    durable_then: Mutex<Option<String>>,
}

fn state_in(value: &[u8]) -> String {
    let record: serde_json::Value = serde_json::from_slice(value).expect("a record");
    record["status"]["state"]
        .as_str()
        .expect("a state")
        .to_string()
}

impl Delegate for BeforeRunning {
    fn inner(&self) -> &dyn StateBackend {
        &self.inner
    }
    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        if table == SANDBOXES && state_in(value) == "Running" {
            if self
                .unreachable_running_writes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(StateError::Unavailable("the store is cut off".into()));
            }
            let step = self.before_running.lock().unwrap().take();
            if let Some(step) = step {
                let durable = self.inner.get(table, key)?.expect("the intent is durable");
                *self.durable_then.lock().unwrap() = Some(state_in(&durable.value));
                step(self.lifecycle.get().expect("lifecycle"), key);
            }
        }
        self.inner.put(table, key, value, expected, fence)
    }
}

/// Creates a sandbox on a server whose store runs `step` between the create's answer and
/// its durable `Running`; returns what the store held when `step` ran, and the sandbox's
/// state once things settle on `settled`.
fn create_with_step_before_running(
    fake: &Arc<FakeNode>,
    step: Step,
    settled: SandboxState,
) -> (String, SandboxState) {
    create_with(fake, step, settled, 0)
}

/// [`create_with_step_before_running`], the first `unreachable` `Running` writes failing as
/// an unreachable store's.
fn create_with(
    fake: &Arc<FakeNode>,
    step: Step,
    settled: SandboxState,
    unreachable: usize,
) -> (String, SandboxState) {
    let dir = tempfile::tempdir().expect("tempdir");
    let backend = Arc::new(BeforeRunning {
        unreachable_running_writes: AtomicUsize::new(unreachable),
        inner: RedbBackend::open(&dir.path().join("state.redb")).expect("redb"),
        before_running: Mutex::new(Some(step)),
        lifecycle: OnceLock::new(),
        durable_then: Mutex::new(None),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let settled = runtime.block_on(async {
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
        backend.lifecycle.set(lc.clone()).ok().expect("set once");
        let created = lc
            .create(CreateSandboxRequest {
                image: Some(ImageSpec {
                    uri: IMAGE.into(),
                    auth: None,
                }),
                entrypoint: Some(vec!["sleep".into(), "infinity".into()]),
                ..Default::default()
            })
            .await
            .expect("create");
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let now = lc.get(&created.id).expect("record").status.state;
            let durable = backend
                .inner
                .get(SANDBOXES, &created.id)
                .expect("get")
                .map(|e| state_in(&e.value));
            if (now == settled && durable.as_deref() == Some(&format!("{settled:?}")))
                || tokio::time::Instant::now() > deadline
            {
                break now;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    drop(runtime);
    let durable_then = backend
        .durable_then
        .lock()
        .unwrap()
        .clone()
        .expect("the step ran");
    assert!(fake.violations().is_empty(), "{:?}", fake.violations());
    (durable_then, settled)
}

#[test]
fn a_delete_sent_before_the_running_write_lands_ends_the_sandbox() {
    let fake = Arc::new(FakeNode::new(4).with_image(IMAGE));
    let (durable_then, settled) = create_with_step_before_running(
        &fake,
        Box::new(|lc, id| {
            // The server shows it running already (the create's answer is free to go), and
            // a delete is taken at once.
            assert_eq!(lc.get(id).unwrap().status.state, SandboxState::Running);
            lc.delete(id).expect("a delete is not refused");
        }),
        SandboxState::Terminated,
    );
    assert_eq!(
        durable_then, "Pending",
        "the step ran before Running was durable"
    );
    assert_eq!(settled, SandboxState::Terminated);
    assert!(fake.sandboxes().is_empty(), "nothing left on the node");
    assert_eq!(fake.count(Verb::Remove), 1, "removed once");
    assert!(
        fake.slots().iter().all(|s| *s == SlotState::Free),
        "every slot free: {:?}",
        fake.slots()
    );
}

#[test]
fn a_pause_sent_before_the_running_write_lands_pauses_the_sandbox() {
    let fake = Arc::new(FakeNode::new(4).with_image(IMAGE));
    // From the pool: the slot reserved at admission is given back after the start.
    assert_eq!(fake.fill_pool(1), 1);
    let (durable_then, settled) = create_with_step_before_running(
        &fake,
        Box::new(|lc, id| {
            assert_eq!(lc.get(id).unwrap().status.state, SandboxState::Running);
            lc.pause(id).expect("a pause is not refused as busy");
        }),
        SandboxState::Paused,
    );
    assert_eq!(durable_then, "Pending");
    assert_eq!(settled, SandboxState::Paused);
    assert_eq!(fake.count(Verb::Pause), 1, "paused once");
    assert_eq!(
        fake.slots()
            .iter()
            .filter(|s| **s != SlotState::Free)
            .count(),
        1,
        "only the paused sandbox's slot is held: {:?}",
        fake.slots()
    );
}

#[test]
fn a_running_write_the_store_refuses_for_a_while_is_written_when_it_answers() {
    let fake = Arc::new(FakeNode::new(4).with_image(IMAGE));
    // Two writes of `Running` fail as an unreachable store's; the third lands.
    let (_, settled) = create_with(&fake, Box::new(|_, _| {}), SandboxState::Running, 2);
    assert_eq!(settled, SandboxState::Running, "durable at last");
    assert_eq!(fake.count(Verb::Remove), 0, "the sandbox ran on");
    assert_eq!(fake.sandboxes().len(), 1);
}
