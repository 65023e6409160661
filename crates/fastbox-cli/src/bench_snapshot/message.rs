//! What the benchmark reads out of text: the cost of a snapshot or a pause from the status
//! message the server records with it (`SnapshotReport::summary` of the fastlet:
//! `frozen 84.1 ms, dump 97.0 ms, persist 120.3 ms, total 150.0 ms, 262.4 MiB`), and a
//! process's resident memory from its `/proc/PID/status`.

/// The cost of one snapshot or pause, as the server reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// How long the sandbox's processes were stopped (CRIU's `frozen_time`); the server
    /// leaves it out when CRIU's statistics could not be read.
    pub frozen_ms: Option<f64>,
    /// The `criu dump` run.
    pub dump_ms: f64,
    /// The whole operation on the node, until committed.
    pub total_ms: f64,
    /// Size of the checkpoint (memory images and writable layer).
    pub mib: f64,
}

/// Reads a status message of the form above. Parts are separated by commas, in any order;
/// parts it does not need (`persist`, `publish`, ...) are skipped. None unless `dump`,
/// `total` and the size are there.
pub fn parse_cost(message: &str) -> Option<Cost> {
    let (mut frozen, mut dump, mut total, mut mib) = (None, None, None, None);
    for part in message.split(',') {
        match part.split_whitespace().collect::<Vec<_>>().as_slice() {
            [name, value, "ms"] => {
                let value = value.parse::<f64>().ok()?;
                match *name {
                    "frozen" => frozen = Some(value),
                    "dump" => dump = Some(value),
                    "total" => total = Some(value),
                    _ => {}
                }
            }
            [value, "MiB"] => mib = Some(value.parse::<f64>().ok()?),
            _ => {}
        }
    }
    Some(Cost {
        frozen_ms: frozen,
        dump_ms: dump?,
        total_ms: total?,
        mib: mib?,
    })
}

/// `VmRSS` of a `/proc/PID/status` text, in KiB.
pub fn vm_rss_kib(status: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix("VmRSS:")?;
        let mut words = rest.split_whitespace();
        let value = words.next()?.parse().ok()?;
        (words.next() == Some("kB")).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_fastlet::snapshot::SnapshotReport;

    #[test]
    fn the_message_of_the_brief_parses() {
        let cost =
            parse_cost("frozen 84.1 ms, dump 97.0 ms, persist 120.3 ms, total 150.0 ms, 262.4 MiB")
                .unwrap();
        assert_eq!(
            cost,
            Cost {
                frozen_ms: Some(84.1),
                dump_ms: 97.0,
                total_ms: 150.0,
                mib: 262.4,
            }
        );
        let published =
            parse_cost("dump 1.0 ms, persist 2.0 ms, publish 80.2 ms, total 310.0 ms, 3.5 MiB");
        assert_eq!(published.map(|c| c.total_ms), Some(310.0));
    }

    #[test]
    fn what_the_fastlet_writes_reads_back() {
        let report = SnapshotReport {
            frozen_ms: Some(12.345),
            dump_ms: 20.0,
            persist_ms: 3.21,
            total_ms: 41.96,
            bytes: 256 * 1024 * 1024 + 512 * 1024,
            ..SnapshotReport::default()
        };
        let cost = parse_cost(&report.summary()).unwrap();
        assert_eq!(cost.frozen_ms, Some(12.3));
        assert_eq!((cost.dump_ms, cost.total_ms, cost.mib), (20.0, 42.0, 256.5));
        // Without CRIU's statistics the server leaves `frozen` out.
        let without = SnapshotReport {
            frozen_ms: None,
            ..report.clone()
        };
        assert_eq!(parse_cost(&without.summary()).unwrap().frozen_ms, None);
        // A streamed dump says so at the end; the figures read the same.
        let streamed = SnapshotReport {
            streamed: true,
            ..report
        };
        assert!(streamed.summary().ends_with("256.5 MiB, streamed"));
        assert_eq!(parse_cost(&streamed.summary()).unwrap(), cost);
    }

    #[test]
    fn other_messages_do_not_parse() {
        assert_eq!(parse_cost(""), None);
        assert_eq!(parse_cost("finished before a restart"), None);
        assert_eq!(parse_cost("dump 1.0 ms, total 2.0 ms"), None, "no size");
        assert_eq!(parse_cost("dump x ms, total 2.0 ms, 1.0 MiB"), None);
        let unknown_parts = parse_cost("dump 1.0 ms, restore 9 ms, total 2.0 ms, 3.0 MiB, ok");
        assert_eq!(unknown_parts.map(|c| c.mib), Some(3.0));
    }

    #[test]
    fn vm_rss_is_read_in_kib() {
        let status = "Name:\tpython3\nVmPeak:\t  300000 kB\nVmRSS:\t  266240 kB\nThreads:\t1\n";
        assert_eq!(vm_rss_kib(status), Some(266_240));
        assert_eq!(vm_rss_kib("Name:\tx\n"), None);
        assert_eq!(vm_rss_kib("VmRSS:\tmany kB\n"), None);
    }
}
