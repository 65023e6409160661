//! A node cut off in the middle of a resume (`verify cluster`'s last step). A sandbox on node
//! n1 holds memory and reports to the collector; it is paused, its resume is requested, and at
//! once n1 is cut off from the server (every packet between n1's host and the server's is
//! dropped; the rest of the bridge, the collector included, stays reachable, so a copy left
//! running there would show).
//!
//! Checked: the server declares n1 lost no sooner than its lease after the cut; the sandbox
//! reports from n1 at most until then (n1's fence froze what the resume started); it is
//! `Paused` (`NODE_LOST`) on its published checkpoint, and a resume moves it to another
//! node, where its count and its memory go on; once the cut is mended, n1 comes back, the
//! server removes what the sandbox left there, and it never reports from n1 again.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use super::api::Api;
use super::{READY_TIMEOUT, REPORT_TIMEOUT, Scenario, moves, progress};

/// What the cut found.
#[derive(Debug, Serialize)]
pub struct CutReport {
    pub node: String,
    pub memory_mib: u64,
    /// Whether the resume ran on the cut node before its fence (the sandbox reported from it
    /// after the cut).
    pub resumed_there: bool,
    /// From the cut until the sandbox's last report from the cut node.
    pub last_report_after_cut_ms: Option<u64>,
    /// From the cut until the server declared the node lost.
    pub lost_after_ms: u64,
    /// The sandbox's state and reason once the node was lost.
    pub state_after_loss: (String, Option<String>),
    /// Where the next resume took it, and whether its count and memory went on there.
    pub moved_to: Option<String>,
    pub count_went_on: bool,
    pub memory_intact: bool,
    /// Its reports from the cut node after the cut was mended (none in a passing run).
    pub reports_after_mend: usize,
}

impl Scenario<'_> {
    /// The cut of node n1 in the middle of a resume (see the module docs); `logs`: each
    /// node's log, by id.
    pub(super) fn cut_mid_resume(
        &mut self,
        api: &Api,
        logs: &[(String, std::path::PathBuf)],
    ) -> anyhow::Result<CutReport> {
        let id = "n1".to_string();
        let lease = Duration::from_millis(self.args.lease_ms);
        let proxy = api.node_proxy(&id)?;
        let log_of = |node: &str| super::log_in(logs, node);
        let mib = self.args.move_mib;
        let sandbox = self.create_on(api, &proxy, Some(moves::memory_limit(mib)))?;
        progress(format!(
            "{sandbox} on node {id} fills {mib} MiB, reports, and pauses"
        ));
        moves::start_holder(api, &sandbox, mib)?;
        self.report_from(api, &sandbox, &id)?;
        moves::pause(api, &sandbox)?;
        let paused = Instant::now();

        progress(format!(
            "resuming {sandbox}, and at once cutting node {id} off from the server"
        ));
        let (status, body) = api.post(&format!("/v1/sandboxes/{sandbox}/resume"))?;
        if status != 202 {
            bail!("resume {sandbox}: {status} {body}");
        }
        self.net.partition(0, self.host_ip(), true)?;
        let cut = Instant::now();
        let outcome = self.after_cut(api, &id, &sandbox, (paused, cut), &log_of);
        // Mended whatever happened, so the run ends clean.
        let mended = self.net.partition(0, self.host_ip(), false);
        let mut report = outcome?;
        mended?;
        let mended = Instant::now();

        progress(format!("the cut is mended: node {id} comes back"));
        wait(READY_TIMEOUT, &format!("node {id} ready again"), || {
            api.node(&id)
                .ok()
                .flatten()
                .is_some_and(|n| n["state"] == "ready")
        })?;
        if report.moved_to.is_some() {
            wait(
                READY_TIMEOUT,
                &format!("what {sandbox} left on node {id} removed"),
                || api.events(&sandbox).is_ok_and(|e| e.contains("Cleaned")),
            )?;
        }
        std::thread::sleep(Duration::from_millis(1500));
        report.reports_after_mend = self.reports_after(&sandbox, &id, mended).len();
        api.delete(&format!("/v1/sandboxes/{sandbox}"))?;

        self.check(
            report.lost_after_ms >= lease.as_millis() as u64,
            format!(
                "node {id} was declared lost {} ms after the cut, within its lease",
                report.lost_after_ms
            ),
        );
        self.check(
            report.state_after_loss == ("Paused".to_string(), Some("NODE_LOST".to_string())),
            format!(
                "{sandbox}, whose resume the cut interrupted, is {:?}, not Paused (NODE_LOST)",
                report.state_after_loss
            ),
        );
        self.check(
            report
                .moved_to
                .as_ref()
                .is_some_and(|to| *to != id && report.count_went_on && report.memory_intact),
            format!(
                "{sandbox} did not go on elsewhere: moved to {:?}, its count went on: {}, its memory intact: {}",
                report.moved_to, report.count_went_on, report.memory_intact
            ),
        );
        self.check(
            report.reports_after_mend == 0,
            format!(
                "{sandbox} reported {} time(s) from node {id} after the cut was mended",
                report.reports_after_mend
            ),
        );
        Ok(report)
    }

    /// From the cut until the sandbox went on elsewhere.
    fn after_cut(
        &mut self,
        api: &Api,
        id: &str,
        sandbox: &str,
        (paused, cut): (Instant, Instant),
        log_of: &dyn Fn(&str) -> Option<std::path::PathBuf>,
    ) -> anyhow::Result<CutReport> {
        let lease = Duration::from_millis(self.args.lease_ms);
        wait(
            lease * 4 + Duration::from_secs(10),
            &format!("node {id} lost"),
            || {
                api.node(id)
                    .ok()
                    .flatten()
                    .is_some_and(|n| n["state"] == "lost")
            },
        )?;
        let lost = cut.elapsed();
        let settled = Instant::now() + Duration::from_secs(10);
        let state_after_loss = loop {
            let state = api.state(sandbox)?;
            if state.0 != "Resuming" || Instant::now() >= settled {
                break state;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let there = self.reports_after(sandbox, id, cut);
        let late = self.reports_after(sandbox, id, cut + lease).len();
        self.check(
            late == 0,
            format!(
                "{sandbox} reported {late} time(s) from the cut node {id} after its lease ran out"
            ),
        );
        let mut report = CutReport {
            node: id.to_string(),
            memory_mib: self.args.move_mib,
            resumed_there: !there.is_empty(),
            last_report_after_cut_ms: there
                .iter()
                .map(|r| r.at.duration_since(cut).as_millis() as u64)
                .max(),
            lost_after_ms: lost.as_millis() as u64,
            state_after_loss,
            moved_to: None,
            count_went_on: false,
            memory_intact: false,
            reports_after_mend: 0,
        };
        if report.state_after_loss.0 != "Paused" {
            return Ok(report);
        }
        progress(format!(
            "resuming {sandbox} again, now that node {id} is lost"
        ));
        let (_, to) = moves::timed_resume(api, sandbox, log_of)?;
        self.collector
            .wait_for(sandbox, self.ip_of(&to), REPORT_TIMEOUT)
            .with_context(|| format!("{sandbox} moved to {to}"))?;
        report.count_went_on = self.count_went_on(sandbox, id, paused, &to);
        report.memory_intact = moves::memory_intact(api, sandbox)?;
        report.moved_to = Some(to);
        Ok(report)
    }
}

/// Waits until `ready` holds, at most `within`.
fn wait(within: Duration, what: &str, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while !ready() {
        if Instant::now() >= deadline {
            bail!("not {what} within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
