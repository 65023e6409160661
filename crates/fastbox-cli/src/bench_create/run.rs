//! Running the creates: warm-ups first, then one worker thread per unit of concurrency, either
//! back to back until N creates are done or in batches with a pause between them. Each worker
//! deletes its sandbox outside the timed region before its next create: back to back at once,
//! in batches once every create of the batch is ready (so no delete runs beside a timed
//! create). Progress goes to stderr every few seconds.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::client::{BenchClient, Failure};
use super::stats::Tally;

/// How often a long run reports how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// How workers follow each other.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pace {
    /// Each worker starts its next create as soon as it deleted its last sandbox.
    BackToBack,
    /// Batches of one create per worker; the batch's sandboxes are deleted once its last
    /// create is ready, and the next batch starts `pause` after that (the OpenSandbox SDK
    /// benchmark's shape).
    Batches { pause: Duration },
}

/// What to run.
pub struct Plan {
    /// Timed creates.
    pub n: usize,
    pub pace: Pace,
    /// The body of every create.
    pub body: Value,
    /// Longest create -> ready before it counts as a failure.
    pub ready_timeout: Duration,
}

/// W untimed creates, one after the other on `client`; returns how many failed.
pub fn warm_up(client: &BenchClient, plan: &Plan, count: usize) -> usize {
    let progress = Progress::default();
    let mut tally = Tally::default();
    for _ in 0..count {
        create_and_delete(client, plan, &mut tally, &progress);
    }
    tally.failures()
}

/// The timed creates, one worker per client; returns their tally and the wall time of the
/// whole run (deletes and pauses included).
pub fn measure(clients: &[BenchClient], plan: &Plan) -> (Tally, Duration) {
    let schedule = match plan.pace {
        Pace::BackToBack => Schedule::Claim(AtomicUsize::new(0)),
        Pace::Batches { pause } => Schedule::Batches {
            barrier: Barrier::new(clients.len()),
            pause,
        },
    };
    let progress = Progress::default();
    let start = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let (stop, stopped) = mpsc::channel::<()>();
        let progress = &progress;
        scope.spawn(move || report_progress(progress, plan.n, start, stopped));
        let workers: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(index, client)| {
                let schedule = &schedule;
                let workers = clients.len();
                scope.spawn(move || worker(index, workers, client, plan, schedule, progress))
            })
            .collect();
        let tallies = workers
            .into_iter()
            .map(|w| w.join().expect("a benchmark worker panicked"))
            .collect();
        drop(stop);
        tallies
    });
    let wall = start.elapsed();
    let mut total = Tally::default();
    for tally in tallies {
        total.merge(tally);
    }
    (total, wall)
}

enum Schedule {
    /// Workers claim the next create's number until N are claimed.
    Claim(AtomicUsize),
    /// Worker `w` makes create `b * workers + w` of batch `b`, then waits for the others.
    Batches { barrier: Barrier, pause: Duration },
}

fn worker(
    index: usize,
    workers: usize,
    client: &BenchClient,
    plan: &Plan,
    schedule: &Schedule,
    progress: &Progress,
) -> Tally {
    let mut tally = Tally::default();
    match schedule {
        Schedule::Claim(next) => {
            while next.fetch_add(1, Ordering::Relaxed) < plan.n {
                create_and_delete(client, plan, &mut tally, progress);
            }
        }
        Schedule::Batches { barrier, pause } => {
            let batches = plan.n.div_ceil(workers);
            for batch in 0..batches {
                let made = match batch * workers + index < plan.n {
                    true => create(client, plan, &mut tally, progress),
                    false => None,
                };
                barrier.wait();
                if let Some(id) = made {
                    delete(client, &id, &mut tally, progress);
                }
                barrier.wait();
                if batch + 1 < batches {
                    std::thread::sleep(*pause);
                }
            }
        }
    }
    tally
}

/// One timed create -> ready, then the untimed delete of what it made.
fn create_and_delete(client: &BenchClient, plan: &Plan, tally: &mut Tally, progress: &Progress) {
    if let Some(id) = create(client, plan, tally, progress) {
        delete(client, &id, tally, progress);
    }
}

/// One timed create -> ready; the sandbox it made, if any.
fn create(
    client: &BenchClient,
    plan: &Plan,
    tally: &mut Tally,
    progress: &Progress,
) -> Option<String> {
    let attempt = client.create_until_ready(&plan.body, plan.ready_timeout);
    let failed = match attempt.result {
        Ok(latency) => {
            tally.samples.push(latency);
            false
        }
        Err(failure) => {
            *tally.failure_reasons.entry(failure.reason()).or_default() += 1;
            progress.show_first(&failure);
            true
        }
    };
    progress.count(failed);
    attempt.sandbox
}

/// The untimed delete of sandbox `id`.
fn delete(client: &BenchClient, id: &str, tally: &mut Tally, progress: &Progress) {
    if let Err(failure) = client.delete(id) {
        tally.delete_failures += 1;
        progress.show_first(&failure);
    }
}

#[derive(Default)]
struct Progress {
    done: AtomicUsize,
    failed: AtomicUsize,
    /// Reasons already shown in full on stderr: each is shown once.
    shown: Mutex<BTreeSet<String>>,
}

impl Progress {
    fn count(&self, failed: bool) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn show_first(&self, failure: &Failure) {
        let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        if shown.insert(failure.reason()) {
            eprintln!("bench create: {failure} (further ones are only counted)");
        }
    }
}

/// Prints how far the run got every few seconds until `stopped` is disconnected.
fn report_progress(progress: &Progress, n: usize, start: Instant, stopped: mpsc::Receiver<()>) {
    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(PROGRESS_EVERY) {
        eprintln!(
            "bench create: {}/{n} done, {} failed, {:.0} s",
            progress.done.load(Ordering::Relaxed),
            progress.failed.load(Ordering::Relaxed),
            start.elapsed().as_secs_f64()
        );
    }
}
