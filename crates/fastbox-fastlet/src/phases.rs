//! Named phases of a start and their durations, measured with a lap clock: what the fastlet
//! reports for every restore and claim (logs, sandbox events, the server's metrics).

use std::fmt;
use std::time::{Duration, Instant};

/// Phases in order, each with its duration, and details: parts of the phase before them
/// (measured by someone else, such as CRIU's own stats), not counted in the total.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Phases(Vec<Phase>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Phase {
    name: &'static str,
    took: Duration,
    detail: bool,
}

impl Phases {
    pub fn push(&mut self, name: &'static str, took: Duration) {
        self.0.push(Phase {
            name,
            took,
            detail: false,
        });
    }

    /// A part of the phase pushed last.
    pub fn note(&mut self, name: &'static str, took: Duration) {
        self.0.push(Phase {
            name,
            took,
            detail: true,
        });
    }

    pub fn extend(&mut self, other: &Phases) {
        self.0.extend(other.0.iter().copied());
    }

    /// The phases (details excluded) in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Duration)> + '_ {
        self.0
            .iter()
            .filter(|p| !p.detail)
            .map(|p| (p.name, p.took))
    }

    /// Phases and details, in order, with whether each is a detail.
    pub fn all(&self) -> impl Iterator<Item = (&'static str, Duration, bool)> + '_ {
        self.0.iter().map(|p| (p.name, p.took, p.detail))
    }

    pub fn total(&self) -> Duration {
        self.iter().map(|(_, d)| d).sum()
    }
}

/// `slot 9.8 ms, criu 30.1 ms (criu.forking 4.0 ms), ...`.
impl fmt::Display for Phases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mut in_details = false;
        for (i, p) in self.0.iter().enumerate() {
            match (p.detail, in_details) {
                (true, false) => f.write_str(" (")?,
                (true, true) => f.write_str(", ")?,
                (false, true) => f.write_str("), ")?,
                (false, false) if i > 0 => f.write_str(", ")?,
                (false, false) => {}
            }
            in_details = p.detail;
            write!(f, "{} {:.1} ms", p.name, ms(p.took))?;
        }
        if in_details {
            f.write_str(")")?;
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
    fn details_print_in_brackets_and_do_not_count() {
        let mut p = Phases::default();
        p.push("criu", Duration::from_millis(30));
        p.note("criu.forking", Duration::from_millis(4));
        p.note("criu.restore", Duration::from_millis(20));
        p.push("ready", Duration::from_millis(1));
        assert_eq!(
            p.to_string(),
            "criu 30.0 ms (criu.forking 4.0 ms, criu.restore 20.0 ms), ready 1.0 ms"
        );
        assert_eq!(p.total(), Duration::from_millis(31));
        assert_eq!(p.iter().count(), 2);
        assert_eq!(p.all().count(), 4);
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
