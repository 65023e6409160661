//! The sandbox lifecycle's transition table, as the chaos tests judge recorded histories
//! by it: the states a client saw of one sandbox, in order, must be a walk through it (states
//! nobody saw in between allowed).

use std::collections::BTreeSet;

/// Where state `state` may go next (directly), by the names the API uses.
pub fn next_states(state: &str) -> &'static [&'static str] {
    match state {
        "Pending" => &["Running", "Failed", "Stopping"],
        "Running" => &["Pausing", "Stopping", "Failed"],
        "Pausing" => &["Paused", "Running", "Failed", "Stopping"],
        "Paused" => &["Resuming", "Stopping", "Failed"],
        "Resuming" => &["Running", "Paused", "Failed", "Stopping"],
        "Stopping" => &["Terminated", "Failed"],
        "Failed" => &["Stopping", "Terminated"],
        _ => &[],
    }
}

/// Whether `to` can follow `from`, through states nobody saw (or is `from` itself).
pub fn may_follow(from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from];
    while let Some(s) = todo.pop() {
        if s == to {
            return true;
        }
        for next in next_states(s) {
            if seen.insert(*next) {
                todo.push(next);
            }
        }
    }
    false
}

/// The steps of `states` (one sandbox, in the order seen) that the table does not allow,
/// as `"A then B"`.
pub fn violations(states: &[String]) -> Vec<String> {
    states
        .windows(2)
        .filter(|pair| !may_follow(&pair[0], &pair[1]))
        .map(|pair| format!("{} then {}", pair[0], pair[1]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_through_the_table() {
        assert!(may_follow("Running", "Running"));
        assert!(
            may_follow("Pending", "Paused"),
            "through Running and Pausing"
        );
        assert!(may_follow("Paused", "Running"), "through Resuming");
        assert!(!may_follow("Terminated", "Running"), "a final state stays");
        assert!(!may_follow("Running", "Pending"), "never back to Pending");
        let seen: Vec<String> = ["Pending", "Running", "Paused", "Pending"]
            .map(String::from)
            .to_vec();
        assert_eq!(violations(&seen), ["Paused then Pending"]);
    }
}
