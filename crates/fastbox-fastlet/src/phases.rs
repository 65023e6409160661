//! Named phases of a start and their durations, measured with a lap clock: what the fastlet
//! reports for every restore and claim (logs, sandbox events, the server's metrics).

use std::fmt;
use std::time::{Duration, Instant};

/// Phases in order, each with its duration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Phases(Vec<(&'static str, Duration)>);

impl Phases {
    pub fn push(&mut self, name: &'static str, took: Duration) {
        self.0.push((name, took));
    }

    pub fn extend(&mut self, other: &Phases) {
        self.0.extend(other.0.iter().copied());
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Duration)> + '_ {
        self.0.iter().copied()
    }

    pub fn total(&self) -> Duration {
        self.0.iter().map(|(_, d)| *d).sum()
    }
}

/// `slot 9.8 ms, rootfs 2.1 ms, ...`.
impl fmt::Display for Phases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, took)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name} {:.1} ms", took.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}

/// Records phases one after another: each `lap` is the time since the previous one.
#[derive(Debug)]
pub struct LapClock {
    last: Instant,
    phases: Phases,
}

impl LapClock {
    pub fn start() -> Self {
        Self {
            last: Instant::now(),
            phases: Phases::default(),
        }
    }

    /// Ends phase `name` now.
    pub fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases.push(name, now - self.last);
        self.last = now;
    }

    /// Adds phases measured elsewhere that ended now (they replace one lap).
    pub fn laps(&mut self, measured: &Phases) {
        self.phases.extend(measured);
        self.last = Instant::now();
    }

    pub fn finish(self) -> Phases {
        self.phases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_print_in_order_with_tenths_of_milliseconds() {
        let mut p = Phases::default();
        p.push("slot", Duration::from_micros(9_840));
        p.push("criu", Duration::from_millis(21));
        assert_eq!(p.to_string(), "slot 9.8 ms, criu 21.0 ms");
        assert_eq!(p.total(), Duration::from_micros(30_840));
    }

    #[test]
    fn laps_measure_from_the_previous_lap() {
        let mut clock = LapClock::start();
        std::thread::sleep(Duration::from_millis(2));
        clock.lap("a");
        let mut elsewhere = Phases::default();
        elsewhere.push("b", Duration::from_millis(5));
        clock.laps(&elsewhere);
        clock.lap("c");
        let phases = clock.finish();
        let names: Vec<_> = phases.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let a = phases.iter().next().unwrap().1;
        assert!(a >= Duration::from_millis(2), "{a:?}");
    }
}
