//! The create requests this server has yet to answer, each by its sandbox's id.
//!
//! A create answers once its sandbox runs in this server's cache; the durable `Running`
//! write comes after the answer. That write waits until the creates answering meanwhile on
//! this server have answered, for at most [`RUNNING_WRITE_HOLD_OFF`]: a burst of creates
//! then takes the store's time (and, with etcd on the node's machine, the members' CPU)
//! only for its intents while it is being answered, and its `Running` writes go together
//! after it. With a three-member etcd on the node's 2-core machine that took 7 to 9 ms off
//! the node call of each of ten concurrent creates, and 8 to 22 ms off create-to-ready at the
//! median (with redb it changed nothing). A create waiting on a slow image stays unanswered
//! meanwhile: the writes then wait the whole hold-off.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// The longest a `Running` write waits for other creates to answer.
pub(super) const RUNNING_WRITE_HOLD_OFF: Duration = Duration::from_millis(100);

#[derive(Default)]
pub(super) struct CreateAnswers {
    waiting: Mutex<HashMap<String, oneshot::Sender<()>>>,
    answered: Condvar,
}

impl CreateAnswers {
    /// Create `id` will answer through `answer`.
    pub fn insert(&self, id: String, answer: oneshot::Sender<()>) {
        self.waiting
            .lock()
            .expect("create answers lock")
            .insert(id, answer);
    }

    /// The answer of create `id`, taken (None when no request waits for it, or it was
    /// taken already).
    pub fn take(&self, id: &str) -> Option<oneshot::Sender<()>> {
        let taken = self.waiting.lock().expect("create answers lock").remove(id);
        if taken.is_some() {
            self.answered.notify_all();
        }
        taken
    }

    /// Waits, blocking the thread, until no create waits to answer, or `limit` passed.
    /// True when none waits.
    pub fn wait_all_answered(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut waiting = self.waiting.lock().expect("create answers lock");
        while !waiting.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            waiting = self
                .answered
                .wait_timeout(waiting, left)
                .expect("create answers lock")
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_wait_ends_when_the_last_create_answered_and_not_before() {
        let answers = Arc::new(CreateAnswers::default());
        assert!(answers.wait_all_answered(Duration::ZERO), "none waits");
        let (a, _a) = oneshot::channel();
        let (b, _b) = oneshot::channel();
        answers.insert("a".into(), a);
        answers.insert("b".into(), b);
        let answering = {
            let answers = answers.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                assert!(answers.take("a").is_some());
                std::thread::sleep(Duration::from_millis(20));
                let last = Instant::now();
                assert!(answers.take("b").is_some());
                last
            })
        };
        assert!(answers.wait_all_answered(Duration::from_secs(30)));
        let woke = Instant::now();
        let last_answered = answering.join().unwrap();
        assert!(
            woke >= last_answered,
            "woke before the last create answered"
        );
        assert!(answers.take("a").is_none(), "an answer is taken once");
    }

    #[test]
    fn a_wait_gives_up_at_its_limit() {
        let answers = CreateAnswers::default();
        let (a, _a) = oneshot::channel();
        answers.insert("slow".into(), a);
        let began = Instant::now();
        assert!(!answers.wait_all_answered(Duration::from_millis(30)));
        assert!(began.elapsed() >= Duration::from_millis(30));
    }
}
