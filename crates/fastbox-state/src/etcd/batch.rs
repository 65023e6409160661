//! Group commit of the store's compare-and-swaps. A write that finds fewer than
//! [`IN_FLIGHT`] transactions on their way to etcd goes at once, alone, as a plain
//! transaction. One that arrives while that many are on their way waits for one of them;
//! the writes that waited then go together in one transaction, each as a nested
//! transaction of its own (`request_txn`) whose compares decide it alone. etcd takes one
//! proposal, one log entry and one watch message for them all instead of one each: under
//! concurrent creates that is a third of the CPU per write (measured on a three-member
//! cluster on one 2-core machine). Two on their way, not one, so that a create's intent
//! does not wait behind the `Running` write of the create answered just before it.
//!
//! Nested transactions' compares are all evaluated against the state before the
//! transaction, as if each ran first. So writes go together only when none writes a key
//! another one writes or compares (its guard's): a batch holds at most one write per key,
//! and the rest wait for the next one. Writes together share etcd's revision of the
//! transaction; a record's revision still changes with every write of it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex};

use serde_json::{Value, json};

use super::client::{Answer, EtcdClient, Method, off_worker};
use crate::StateError;

/// At most this many writes go in one transaction (etcd takes 128 operations in one by
/// default; a write's reads of its fence or guard on failure count too).
const MAX_BATCH: usize = 32;
/// At most this many transactions are on their way at once.
const IN_FLIGHT: usize = 2;
/// And at most about this many bytes of values (etcd takes requests of 1.5 MiB by
/// default); a write bigger than that goes alone.
const MAX_BATCH_BYTES: usize = 512 * 1024;

/// One compare-and-swap.
pub(super) struct Write {
    /// The etcd key it writes.
    pub key: String,
    /// The keys it compares besides its own (a guard's); a fence's claim is never written
    /// by a write.
    pub reads: Vec<String>,
    /// Its transaction alone: `{"compare": …, "success": […], "failure": […]}`.
    pub txn: Value,
    /// About how many bytes it sends (its value, encoded).
    pub bytes: usize,
}

#[derive(Default)]
pub(super) struct Batcher {
    state: Mutex<Queue>,
    answered: Condvar,
}

/// How many writes went, in how many transactions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteCounts {
    pub writes: u64,
    pub transactions: u64,
}

#[derive(Default)]
struct Queue {
    next_ticket: u64,
    waiting: VecDeque<(u64, Write)>,
    answers: HashMap<u64, Result<Answer, StateError>>,
    /// A transaction is on its way.
    committing: usize,
    counts: WriteCounts,
}

impl Batcher {
    /// Commits `write`, with whatever writes wait with it; returns what its own
    /// transaction answered (as a plain transaction's answer).
    pub fn commit(&self, client: &EtcdClient, write: Write) -> Result<Answer, StateError> {
        off_worker(|| self.commit_blocking(client, write))
    }

    pub fn counts(&self) -> WriteCounts {
        self.state.lock().expect("batch lock").counts
    }

    fn commit_blocking(&self, client: &EtcdClient, write: Write) -> Result<Answer, StateError> {
        let mut queue = self.state.lock().expect("batch lock");
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.waiting.push_back((ticket, write));
        loop {
            if let Some(answer) = queue.answers.remove(&ticket) {
                return answer;
            }
            if queue.committing >= IN_FLIGHT || queue.waiting.is_empty() {
                queue = self.answered.wait(queue).expect("batch lock");
                continue;
            }
            // Room on the way: this thread takes what waits (its own write first in line,
            // or behind others) to etcd.
            queue.committing += 1;
            let batch = take_batch(&mut queue.waiting);
            drop(queue);
            // Should the call panic, the writers of the batch are answered all the same
            // and the next one commits: nobody waits forever.
            let mut turn = Turn {
                batcher: self,
                tickets: batch.iter().map(|(t, _)| *t).collect(),
                answers: None,
            };
            turn.answers = Some(send(client, &batch));
            drop(turn);
            queue = self.state.lock().expect("batch lock");
        }
    }
}

/// One committer's turn: on drop, the batch's answers are handed out (an error each when
/// the call did not return) and the next writer may commit.
struct Turn<'a> {
    batcher: &'a Batcher,
    tickets: Vec<u64>,
    answers: Option<Vec<Result<Answer, StateError>>>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut queue = self
            .batcher
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let answers = self.answers.take().unwrap_or_else(|| {
            self.tickets
                .iter()
                .map(|_| {
                    Err(StateError::Unavailable(
                        "the write's transaction failed on this server".into(),
                    ))
                })
                .collect()
        });
        for (ticket, answer) in self.tickets.iter().zip(answers) {
            queue.answers.insert(*ticket, answer);
        }
        queue.committing -= 1;
        queue.counts.writes += self.tickets.len() as u64;
        queue.counts.transactions += 1;
        self.batcher.answered.notify_all();
    }
}

/// The next batch from the front of `waiting`: writes that touch no key another of them
/// writes, at most [`MAX_BATCH`] of them and [`MAX_BATCH_BYTES`] (unless one alone is
/// bigger). A write left waiting holds its key back for the writes
/// behind it, so one caller's writes of a key keep their order.
fn take_batch(waiting: &mut VecDeque<(u64, Write)>) -> Vec<(u64, Write)> {
    let mut written: HashSet<String> = HashSet::new();
    let mut read: HashSet<String> = HashSet::new();
    let mut held_back: HashSet<String> = HashSet::new();
    let mut batch = Vec::new();
    let mut bytes = 0;
    let mut left = VecDeque::new();
    while let Some((ticket, write)) = waiting.pop_front() {
        let full = batch.len() >= MAX_BATCH
            || (!batch.is_empty() && bytes + write.bytes > MAX_BATCH_BYTES);
        let clashes = full
            || held_back.contains(&write.key)
            || written.contains(&write.key)
            || read.contains(&write.key)
            || write.reads.iter().any(|k| written.contains(k));
        if clashes {
            held_back.insert(write.key.clone());
            left.push_back((ticket, write));
            continue;
        }
        written.insert(write.key.clone());
        read.extend(write.reads.iter().cloned());
        bytes += write.bytes;
        batch.push((ticket, write));
    }
    *waiting = left;
    batch
}

/// One transaction for `batch`; each write's answer, in order.
fn send(client: &EtcdClient, batch: &[(u64, Write)]) -> Vec<Result<Answer, StateError>> {
    if let [(_, alone)] = batch {
        return vec![client.call_blocking(Method::Txn, &alone.txn)];
    }
    let success: Vec<Value> = batch
        .iter()
        .map(|(_, w)| json!({"request_txn": w.txn}))
        .collect();
    let answer = client.call_blocking(
        Method::Txn,
        &json!({"compare": [], "success": success, "failure": []}),
    );
    match answer {
        Err(e) => batch.iter().map(|_| Err(e.clone())).collect(),
        Ok(answer) => {
            let header = answer.body.get("header").cloned().unwrap_or(Value::Null);
            (0..batch.len())
                .map(|i| {
                    let Some(own) = answer
                        .body
                        .pointer(&format!("/responses/{i}/response_txn"))
                        .cloned()
                    else {
                        return Err(StateError::Failed(format!(
                            "etcd answered a transaction of {} writes without the answer of write {i}",
                            batch.len()
                        )));
                    };
                    let mut body = own;
                    if let Some(object) = body.as_object_mut() {
                        object.insert("header".into(), header.clone());
                    }
                    Ok(Answer {
                        body,
                        retried: answer.retried,
                    })
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(key: &str, reads: &[&str]) -> Write {
        Write {
            key: key.into(),
            reads: reads.iter().map(|r| r.to_string()).collect(),
            txn: Value::Null,
            bytes: 1000,
        }
    }

    fn keys(batch: &[(u64, Write)]) -> Vec<&str> {
        batch.iter().map(|(_, w)| w.key.as_str()).collect()
    }

    #[test]
    fn a_batch_never_holds_two_writes_of_a_key_or_a_write_of_a_key_another_compares() {
        let mut waiting: VecDeque<(u64, Write)> = [
            write("a", &[]),
            write("b", &[]),
            write("a", &[]),
            write("c", &["b"]),
            write("k", &[]),
            write("d", &["k"]),
            write("e", &["x"]),
            write("x", &[]),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, w)| (i as u64, w))
        .collect();
        let first = take_batch(&mut waiting);
        assert_eq!(keys(&first), ["a", "b", "k", "e"]);
        let second = take_batch(&mut waiting);
        assert_eq!(keys(&second), ["a", "c", "d", "x"]);
        assert!(waiting.is_empty());
    }

    #[test]
    fn a_write_held_back_keeps_its_key_from_the_writes_behind_it() {
        let mut waiting: VecDeque<(u64, Write)> =
            [write("g", &[]), write("a", &["g"]), write("a", &[])]
                .into_iter()
                .enumerate()
                .map(|(i, w)| (i as u64, w))
                .collect();
        let first = take_batch(&mut waiting);
        assert_eq!(keys(&first), ["g"]);
        let order: Vec<u64> = waiting.iter().map(|(t, _)| *t).collect();
        assert_eq!(order, [1, 2], "the key's writes stay in order");
    }

    #[test]
    fn batches_are_bounded() {
        let mut waiting: VecDeque<(u64, Write)> = (0..MAX_BATCH as u64 + 5)
            .map(|i| (i, write(&format!("k{i}"), &[])))
            .collect();
        assert_eq!(take_batch(&mut waiting).len(), MAX_BATCH);
        assert_eq!(take_batch(&mut waiting).len(), 5);
        let big = |key: &str, bytes| Write {
            bytes,
            ..write(key, &[])
        };
        let mut waiting: VecDeque<(u64, Write)> = [
            big("huge", MAX_BATCH_BYTES * 2),
            big("a", MAX_BATCH_BYTES / 2),
            big("b", MAX_BATCH_BYTES / 2),
            big("c", 1),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, w)| (i as u64, w))
        .collect();
        assert_eq!(keys(&take_batch(&mut waiting)), ["huge"], "alone");
        assert_eq!(keys(&take_batch(&mut waiting)), ["a", "b"]);
        assert_eq!(keys(&take_batch(&mut waiting)), ["c"]);
    }
}
