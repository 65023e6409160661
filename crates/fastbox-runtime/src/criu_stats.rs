//! CRIU's own statistics of a dump or a restore: the `stats-dump` file it writes into the
//! work directory of a dump (the images directory unless `--work-dir` says otherwise) and
//! `stats-restore` in the work directory of a restore.
//!
//! Both are CRIU "service" images: two little-endian `u32` magics (`IMG_SERVICE_MAGIC`, then
//! `STATS_MAGIC`), then one entry: a little-endian `u32` length and that many bytes of a
//! protobuf `stats_entry` message (CRIU's `images/stats.proto`), whose field 1 is a
//! `dump_stats_entry` and field 2 a `restore_stats_entry`. CRIU measures times with
//! `gettimeofday` and records them in microseconds. The messages are read here with a small
//! protobuf reader: varints and length-delimited fields, unknown fields skipped, so newer
//! CRIU versions that add fields still read.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file a dump writes into its work directory.
pub const DUMP_FILE: &str = "stats-dump";
/// The file a restore writes into its work directory.
pub const RESTORE_FILE: &str = "stats-restore";

/// `IMG_SERVICE_MAGIC` of CRIU's `magic.h`: the head of every service file.
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;
/// `STATS_MAGIC` of CRIU's `magic.h`.
const STATS_MAGIC: u32 = 0x5709_3306;
/// `stats_entry` fields.
const ENTRY_DUMP: u32 = 1;
const ENTRY_RESTORE: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("CRIU statistics {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("CRIU statistics {path}: not a stats image: {reason}")]
    Malformed { path: PathBuf, reason: &'static str },
    #[error("CRIU statistics {path}: holds no {which} statistics")]
    Missing { path: PathBuf, which: &'static str },
}

/// CRIU's `dump_stats_entry`. Times are in microseconds; missing optional fields read as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpStats {
    /// Freezing the tree (cgroup freezer or ptrace seize).
    pub freezing_time_us: u64,
    /// From frozen until the tree was killed or resumed: what the tree was stopped for.
    pub frozen_time_us: u64,
    /// Draining memory into page pipes.
    pub memdump_time_us: u64,
    /// Writing the page pipes into the images.
    pub memwrite_time_us: u64,
    pub pages_scanned: u64,
    pub pages_skipped_parent: u64,
    pub pages_written: u64,
    pub irmap_resolve_us: u64,
    pub pages_lazy: u64,
    pub page_pipes: u64,
    pub page_pipe_bufs: u64,
    pub shpages_scanned: u64,
    pub shpages_skipped_parent: u64,
    pub shpages_written: u64,
}

/// CRIU's `restore_stats_entry`. Times are in microseconds; missing optional fields read as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreStats {
    pub pages_compared: u64,
    pub pages_skipped_cow: u64,
    /// CRIU's `TIME_FORK`: the root task's stages from `RESTORE_SHARED` through `FORKING`,
    /// i.e. every task of the tree created (with its pid) and in its namespaces.
    pub forking_time_us: u64,
    /// CRIU's `TIME_RESTORE`: from the start of the tree's restore until every task has its
    /// memory, files and credentials back (what follows is only CRIU's own exit).
    pub restore_time_us: u64,
    pub pages_restored: u64,
}

/// Reads `DIR/stats-dump`.
pub fn read_dump_stats(dir: &Path) -> Result<DumpStats, StatsError> {
    let path = dir.join(DUMP_FILE);
    let entry = read_entry(&path)?;
    let message = entry.dump.ok_or(StatsError::Missing {
        path: path.clone(),
        which: "dump",
    })?;
    dump_stats(message).map_err(|Malformed(reason)| StatsError::Malformed { path, reason })
}

/// Reads `DIR/stats-restore`.
pub fn read_restore_stats(dir: &Path) -> Result<RestoreStats, StatsError> {
    let path = dir.join(RESTORE_FILE);
    let entry = read_entry(&path)?;
    let message = entry.restore.ok_or(StatsError::Missing {
        path: path.clone(),
        which: "restore",
    })?;
    restore_stats(message).map_err(|Malformed(reason)| StatsError::Malformed { path, reason })
}

/// The freeze of a dump whose CRIU wrote no `stats-dump` (a `--stream` dump), from the
/// timestamps of its info-level log `log`: from the first task seized until the tasks were
/// let go (`Unfreezing tasks`). That counts the seizing of the other tasks too, which
/// `frozen_time` does not, so it is the longer of the two. Only `frozen_time_us` is set.
pub fn frozen_from_log(log: &Path) -> Option<DumpStats> {
    let text = std::fs::read_to_string(log).ok()?;
    let stamp = |line: &str| -> Option<f64> {
        line.strip_prefix('(')?
            .split_once(')')?
            .0
            .trim()
            .parse()
            .ok()
    };
    let seized = text
        .lines()
        .find(|l| l.contains(") Seized task "))
        .and_then(stamp)?;
    let thawed = text
        .lines()
        .find(|l| l.contains(") Unfreezing tasks"))
        .and_then(stamp)?;
    (thawed >= seized).then(|| DumpStats {
        frozen_time_us: ((thawed - seized) * 1e6).round() as u64,
        ..DumpStats::default()
    })
}

/// A `stats_entry` message: its two submessages, still encoded.
#[derive(Debug, Default)]
struct Entry {
    dump: Option<Vec<u8>>,
    restore: Option<Vec<u8>>,
}

/// What is wrong with the bytes (the caller adds the path).
#[derive(Debug, PartialEq, Eq)]
struct Malformed(&'static str);

fn read_entry(path: &Path) -> Result<Entry, StatsError> {
    let bytes = std::fs::read(path).map_err(|source| StatsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_entry(&bytes).map_err(|Malformed(reason)| StatsError::Malformed {
        path: path.to_path_buf(),
        reason,
    })
}

/// The magics, the length prefix and the `stats_entry` message.
fn parse_entry(bytes: &[u8]) -> Result<Entry, Malformed> {
    let mut input = bytes;
    if take_u32_le(&mut input)? != IMG_SERVICE_MAGIC {
        return Err(Malformed("no service image magic"));
    }
    if take_u32_le(&mut input)? != STATS_MAGIC {
        return Err(Malformed("no stats magic"));
    }
    let len = take_u32_le(&mut input)? as usize;
    let message = input
        .get(..len)
        .ok_or(Malformed("entry shorter than its length prefix"))?;
    let mut entry = Entry::default();
    for field in Fields(message) {
        match field? {
            (ENTRY_DUMP, Value::Bytes(b)) => entry.dump = Some(b.to_vec()),
            (ENTRY_RESTORE, Value::Bytes(b)) => entry.restore = Some(b.to_vec()),
            _ => {}
        }
    }
    Ok(entry)
}

fn dump_stats(message: Vec<u8>) -> Result<DumpStats, Malformed> {
    let mut s = DumpStats::default();
    for field in Fields(&message) {
        let (number, Value::Varint(v)) = field? else {
            continue;
        };
        let slot = match number {
            1 => &mut s.freezing_time_us,
            2 => &mut s.frozen_time_us,
            3 => &mut s.memdump_time_us,
            4 => &mut s.memwrite_time_us,
            5 => &mut s.pages_scanned,
            6 => &mut s.pages_skipped_parent,
            7 => &mut s.pages_written,
            8 => &mut s.irmap_resolve_us,
            9 => &mut s.pages_lazy,
            10 => &mut s.page_pipes,
            11 => &mut s.page_pipe_bufs,
            12 => &mut s.shpages_scanned,
            13 => &mut s.shpages_skipped_parent,
            14 => &mut s.shpages_written,
            _ => continue,
        };
        *slot = v;
    }
    Ok(s)
}

fn restore_stats(message: Vec<u8>) -> Result<RestoreStats, Malformed> {
    let mut s = RestoreStats::default();
    for field in Fields(&message) {
        let (number, Value::Varint(v)) = field? else {
            continue;
        };
        let slot = match number {
            1 => &mut s.pages_compared,
            2 => &mut s.pages_skipped_cow,
            3 => &mut s.forking_time_us,
            4 => &mut s.restore_time_us,
            5 => &mut s.pages_restored,
            _ => continue,
        };
        *slot = v;
    }
    Ok(s)
}

fn take_u32_le(input: &mut &[u8]) -> Result<u32, Malformed> {
    let (head, rest) = input
        .split_first_chunk::<4>()
        .ok_or(Malformed("truncated header"))?;
    *input = rest;
    Ok(u32::from_le_bytes(*head))
}

/// One protobuf field's value, by wire type (fixed-width values are kept as integers).
#[derive(Debug, PartialEq, Eq)]
enum Value<'a> {
    Varint(u64),
    Fixed(u64),
    Bytes(&'a [u8]),
}

/// The fields of one encoded protobuf message, in order: `(field number, value)`.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.field();
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u32, Value<'a>), Malformed> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).map_err(|_| Malformed("field number too large"))?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => Value::Fixed(u64::from_le_bytes(*self.take::<8>()?)),
            2 => {
                let len =
                    usize::try_from(self.varint()?).map_err(|_| Malformed("length too large"))?;
                if len > self.0.len() {
                    return Err(Malformed("field longer than its message"));
                }
                let (bytes, rest) = self.0.split_at(len);
                self.0 = rest;
                Value::Bytes(bytes)
            }
            5 => Value::Fixed(u32::from_le_bytes(*self.take::<4>()?).into()),
            _ => return Err(Malformed("unsupported protobuf wire type")),
        };
        Ok((number, value))
    }

    fn take<const N: usize>(&mut self) -> Result<&'a [u8; N], Malformed> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(Malformed("truncated fixed-width field"))?;
        self.0 = rest;
        Ok(head)
    }

    /// A base-128 varint: at most 10 bytes, low groups first.
    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut value = 0u64;
        for (i, &byte) in self.0.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok(value);
            }
        }
        Err(Malformed("truncated or overlong varint"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `stats-restore` CRIU 4.2.1 wrote after restoring a golden checkpoint of execd.
    const RESTORE_FIXTURE: &[u8] = &[
        0x40, 0x59, 0x10, 0x55, 0x06, 0x33, 0x09, 0x57, 0x0f, 0x00, 0x00, 0x00, 0x12, 0x0d, 0x08,
        0x00, 0x10, 0x00, 0x18, 0x03, 0x20, 0xb7, 0x95, 0x04, 0x28, 0x91, 0x01,
    ];
    /// The `stats-dump` CRIU 4.2.1 wrote when it took that checkpoint.
    const DUMP_FIXTURE: &[u8] = &[
        0x40, 0x59, 0x10, 0x55, 0x06, 0x33, 0x09, 0x57, 0x25, 0x00, 0x00, 0x00, 0x0a, 0x23, 0x08,
        0xcd, 0x03, 0x10, 0xa2, 0x88, 0x03, 0x18, 0x9d, 0x06, 0x20, 0xf0, 0x02, 0x28, 0xa7, 0x01,
        0x30, 0x00, 0x38, 0x90, 0x01, 0x40, 0x00, 0x48, 0x00, 0x50, 0x06, 0x58, 0x06, 0x60, 0x00,
        0x68, 0x00, 0x70, 0x00,
    ];

    fn dir_with(name: &str, bytes: &[u8]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(name), bytes).unwrap();
        dir
    }

    #[test]
    fn reads_a_restore_file_of_criu_4_2() {
        let dir = dir_with(RESTORE_FILE, RESTORE_FIXTURE);
        let stats = read_restore_stats(dir.path()).unwrap();
        assert_eq!(
            stats,
            RestoreStats {
                pages_compared: 0,
                pages_skipped_cow: 0,
                forking_time_us: 3,
                restore_time_us: 68_279,
                pages_restored: 145,
            }
        );
    }

    #[test]
    fn reads_a_dump_file_of_criu_4_2() {
        let dir = dir_with(DUMP_FILE, DUMP_FIXTURE);
        let stats = read_dump_stats(dir.path()).unwrap();
        assert_eq!(
            stats,
            DumpStats {
                freezing_time_us: 461,
                frozen_time_us: 50_210,
                memdump_time_us: 797,
                memwrite_time_us: 368,
                pages_scanned: 167,
                pages_written: 144,
                page_pipes: 6,
                page_pipe_bufs: 6,
                ..DumpStats::default()
            }
        );
    }

    /// `RESTORE_FIXTURE` with its message grown by `extra` (length prefixes adjusted).
    fn restore_with_extra_fields(extra: &[u8]) -> Vec<u8> {
        let mut inner = RESTORE_FIXTURE[14..].to_vec();
        inner.extend_from_slice(extra);
        let mut entry = vec![0x12, inner.len() as u8];
        entry.extend(inner);
        let mut bytes = RESTORE_FIXTURE[..8].to_vec();
        bytes.extend((entry.len() as u32).to_le_bytes());
        bytes.extend(entry);
        bytes
    }

    #[test]
    fn fields_of_newer_criu_versions_are_skipped() {
        // Field 6 as a varint, 7 as bytes, 8 as fixed64, 9 as fixed32.
        let extra = [
            0x30, 0xff, 0x01, 0x3a, 0x02, 0xaa, 0xbb, 0x41, 1, 2, 3, 4, 5, 6, 7, 8, 0x4d, 1, 2, 3,
            4,
        ];
        let dir = dir_with(RESTORE_FILE, &restore_with_extra_fields(&extra));
        let stats = read_restore_stats(dir.path()).unwrap();
        assert_eq!(stats.restore_time_us, 68_279);
        assert_eq!(stats.pages_restored, 145);
    }

    #[test]
    fn damaged_files_are_errors_naming_the_file() {
        let cases: [(&[u8], &str); 4] = [
            (&RESTORE_FIXTURE[..6], "truncated header"),
            (&RESTORE_FIXTURE[..20], "shorter than its length prefix"),
            (&DUMP_FIXTURE[4..], "no service image magic"),
            (
                &[0x40, 0x59, 0x10, 0x55, 0x19, 0x43, 0x56, 0x54],
                "no stats magic",
            ),
        ];
        for (bytes, reason) in cases {
            let dir = dir_with(RESTORE_FILE, bytes);
            let err = read_restore_stats(dir.path()).unwrap_err().to_string();
            assert!(err.contains(reason), "{err}");
            assert!(err.contains(RESTORE_FILE), "{err}");
        }
        // The message ends inside restore_time's varint (length prefixes adjusted).
        let mut cut = RESTORE_FIXTURE[..23].to_vec();
        cut[8] = 11;
        cut[13] = 9;
        let dir = dir_with(RESTORE_FILE, &cut);
        let err = read_restore_stats(dir.path()).unwrap_err().to_string();
        assert!(err.contains("varint"), "{err}");
    }

    #[test]
    fn a_dump_file_is_not_restore_statistics_and_absence_is_io() {
        let dir = dir_with(RESTORE_FILE, DUMP_FIXTURE);
        assert!(matches!(
            read_restore_stats(dir.path()),
            Err(StatsError::Missing {
                which: "restore",
                ..
            })
        ));
        assert!(matches!(
            read_dump_stats(dir.path()),
            Err(StatsError::Io { ref source, .. }) if source.kind() == io::ErrorKind::NotFound
        ));
    }

    #[test]
    fn a_stream_dumps_freeze_comes_from_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(
            &log,
            "(00.034462) cg-prop: Parsing controller \"freezer\"\n\
             (00.034710) Seized task 10340, state 1\n\
             (00.041422) Dumping pages (type: 59 pid: 10340)\n\
             (00.134171) Unfreezing tasks into 1\n\
             (00.134300) Dumping finished successfully\n",
        )
        .unwrap();
        let stats = frozen_from_log(&log).unwrap();
        assert_eq!(stats.frozen_time_us, 99_461);
        std::fs::write(&log, "(00.034710) Seized task 10340, state 1\n").unwrap();
        assert_eq!(frozen_from_log(&log), None, "a dump that never thawed");
    }

    #[test]
    fn varints_read_up_to_64_bits() {
        let max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(Fields(&max).varint(), Ok(u64::MAX));
        assert_eq!(Fields(&[0xac, 0x02]).varint(), Ok(300));
        assert!(Fields(&[0x80; 11]).varint().is_err());
    }

    mod real_criu {
        //! A tiny process tree (`sh` and its `sleep`) dumped and restored by the real CRIU,
        //! then its statistics read back. Needs root and CRIU (`FASTBOX_CRIU`, else the
        //! repository's `.deps/criu`); otherwise prints why it is skipped.

        use std::os::unix::process::CommandExt;
        use std::path::{Path, PathBuf};
        use std::process::{Command, Stdio};
        use std::time::{Duration, Instant};

        use super::super::*;

        fn criu_or_skip_reason() -> Result<PathBuf, String> {
            if !nix::unistd::geteuid().is_root() {
                return Err("needs root (CRIU dump and restore)".into());
            }
            std::env::var_os("FASTBOX_CRIU")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/criu/bin/criu")
                })
                .canonicalize()
                .map_err(|_| "no CRIU: run scripts/setup.sh or set FASTBOX_CRIU".into())
        }

        fn criu(criu: &Path, args: &[&str], dir: &Path) -> Duration {
            let start = Instant::now();
            let out = Command::new(criu).args(args).output().expect("run criu");
            let elapsed = start.elapsed();
            let log = args.iter().position(|a| *a == "-o").map(|i| args[i + 1]);
            let log = log
                .map(|l| dir.join(l))
                .and_then(|p| std::fs::read_to_string(p).ok());
            assert!(
                out.status.success(),
                "criu {args:?}: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                log.unwrap_or_default()
            );
            elapsed
        }

        fn children(pid: u32) -> Vec<u32> {
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        }

        fn wait_gone(pid: u32) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while Path::new(&format!("/proc/{pid}")).exists() {
                assert!(Instant::now() < deadline, "pid {pid} still exists");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        #[test]
        fn a_real_dump_and_restore_report_plausible_statistics() {
            let criu_bin = match criu_or_skip_reason() {
                Ok(p) => p,
                Err(reason) => {
                    eprintln!("skipped: {reason}");
                    return;
                }
            };
            let tmp = tempfile::tempdir().unwrap();
            let (images, work) = (tmp.path().join("images"), tmp.path().join("work"));
            std::fs::create_dir_all(&images).unwrap();
            std::fs::create_dir_all(&work).unwrap();
            let mut tree = Command::new("/bin/sh");
            tree.args(["-c", "sleep 300 & wait"])
                .current_dir(tmp.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // SAFETY: setsid is async-signal-safe; CRIU wants the root a session leader.
            unsafe {
                tree.pre_exec(|| nix::unistd::setsid().map(drop).map_err(Into::into));
            }
            let mut root = tree.spawn().expect("spawn sh");
            let pid = root.id();
            let deadline = Instant::now() + Duration::from_secs(10);
            let sleeper = loop {
                if let Some(&child) = children(pid).first() {
                    break child;
                }
                assert!(Instant::now() < deadline, "sh started no child");
                std::thread::sleep(Duration::from_millis(5));
            };

            let (pid_s, images_s) = (pid.to_string(), images.display().to_string());
            let dump_wall = criu(
                &criu_bin,
                &["dump", "-t", &pid_s, "-D", &images_s, "-o", "dump.log"],
                &images,
            );
            root.wait().expect("reap the dumped sh");
            wait_gone(sleeper);

            let work_s = work.display().to_string();
            let pidfile = work.join("pid");
            let restore_wall = criu(
                &criu_bin,
                &[
                    "restore",
                    "-d",
                    "-D",
                    &images_s,
                    "-W",
                    &work_s,
                    "--pidfile",
                    "pid",
                    "-o",
                    "restore.log",
                ],
                &work,
            );
            let restored: i32 = std::fs::read_to_string(&pidfile)
                .expect("restore pidfile")
                .trim()
                .parse()
                .unwrap();
            assert_eq!(restored as u32, pid, "CRIU restores the tree's pids");
            // The tree is its own process group (setsid): kill both processes at once.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(restored),
                nix::sys::signal::Signal::SIGKILL,
            );

            let dump = read_dump_stats(&images).unwrap();
            assert!(dump.freezing_time_us > 0, "{dump:?}");
            assert!(dump.frozen_time_us > 0, "{dump:?}");
            assert!(dump.memdump_time_us > 0, "{dump:?}");
            assert!(dump.pages_written > 0, "{dump:?}");
            assert!(dump.pages_scanned >= dump.pages_written, "{dump:?}");
            assert!(
                u128::from(dump.frozen_time_us) < dump_wall.as_micros(),
                "times are microseconds within the dump's {dump_wall:?}: {dump:?}"
            );
            let restore = read_restore_stats(&work).unwrap();
            assert!(restore.forking_time_us > 0, "{restore:?}");
            assert!(
                restore.restore_time_us > restore.forking_time_us,
                "{restore:?}"
            );
            assert!(restore.pages_restored > 0, "{restore:?}");
            assert!(
                u128::from(restore.restore_time_us) < restore_wall.as_micros(),
                "times are microseconds within the restore's {restore_wall:?}: {restore:?}"
            );
            assert!(
                matches!(read_restore_stats(&images), Err(StatsError::Io { .. })),
                "the restore's statistics go to its work directory, not the images"
            );
        }
    }
}
