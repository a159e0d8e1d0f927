//! The circuit breaker in front of every Redis command.
//!
//! Redis is an optimisation: when it is down or slow, a request must not wait for it. After
//! `threshold` consecutive failures (errors or timeouts) the breaker opens and every call fails
//! at once for `cooldown`; then exactly one call is let through as a probe (half-open). The
//! probe's success closes the breaker, its failure opens it for another cooldown.
//!
//! The state sits behind a `parking_lot::Mutex`: it is touched twice per command for a few
//! nanoseconds and never held across an await, so a lock-free design would buy nothing.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Calls go through; `failures` consecutive ones have failed so far.
    Closed { failures: u32 },
    /// Calls fail fast until `until`.
    Open { until: Instant },
    /// One probe is in flight; everyone else fails fast until it reports.
    HalfOpen,
}

/// A consecutive-failure circuit breaker.
#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    cooldown: Duration,
    state: Mutex<State>,
}

/// What [`Breaker::acquire`] lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// A normal call (the breaker is closed).
    Normal,
    /// The one probe after a cooldown.
    Probe,
}

/// A state change worth reporting (gauges, logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// Nothing changed.
    None,
    /// The breaker just opened (or re-opened after a failed probe).
    Opened,
    /// The breaker just closed after having been open.
    Closed,
}

impl Breaker {
    /// A closed breaker. A threshold of zero is treated as one.
    pub(crate) fn new(threshold: u32, cooldown: Duration) -> Self {
        Breaker {
            threshold: threshold.max(1),
            cooldown,
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    /// Whether a call may go ahead now, and as what; `None` means fail fast.
    pub(crate) fn acquire(&self) -> Option<Pass> {
        let mut state = self.state.lock();
        match *state {
            State::Closed { .. } => Some(Pass::Normal),
            State::Open { until } if Instant::now() >= until => {
                *state = State::HalfOpen;
                Some(Pass::Probe)
            }
            State::Open { .. } | State::HalfOpen => None,
        }
    }

    /// Reports the outcome of a call let through by [`Breaker::acquire`].
    pub(crate) fn record(&self, pass: Pass, ok: bool) -> Transition {
        let mut state = self.state.lock();
        match (ok, *state) {
            (true, State::Closed { .. }) => {
                *state = State::Closed { failures: 0 };
                Transition::None
            }
            // A probe's success closes the breaker. A late normal call that succeeds while
            // open is good news too: Redis answers again.
            (true, _) => {
                *state = State::Closed { failures: 0 };
                Transition::Closed
            }
            (false, State::Closed { failures }) => {
                let failures = failures + 1;
                if failures >= self.threshold {
                    *state = State::Open {
                        until: Instant::now() + self.cooldown,
                    };
                    Transition::Opened
                } else {
                    *state = State::Closed { failures };
                    Transition::None
                }
            }
            (false, State::HalfOpen) if pass == Pass::Probe => {
                *state = State::Open {
                    until: Instant::now() + self.cooldown,
                };
                Transition::Opened
            }
            // A straggler failing while the breaker is already open changes nothing.
            (false, _) => Transition::None,
        }
    }

    /// Whether a call made now would fail fast (open and cooling down, or half-open with
    /// the probe in flight). Unlike [`Breaker::acquire`] this never claims the probe.
    pub(crate) fn fails_fast(&self) -> bool {
        match *self.state.lock() {
            State::Closed { .. } => false,
            State::Open { until } => Instant::now() < until,
            State::HalfOpen => true,
        }
    }

    /// Whether the breaker is not closed (open, or half-open with the probe in flight).
    pub(crate) fn is_open(&self) -> bool {
        !matches!(*self.state.lock(), State::Closed { .. })
    }
}

/// Reports a call's outcome to the breaker exactly once, even when the calling future is
/// dropped half-way (a cancelled probe counts as failed, so the breaker never stays half-open).
pub(crate) struct Permit<'a> {
    breaker: &'a Breaker,
    pass: Pass,
    done: bool,
}

impl<'a> Permit<'a> {
    /// Wraps a pass obtained from `breaker`.
    pub(crate) fn new(breaker: &'a Breaker, pass: Pass) -> Self {
        Permit {
            breaker,
            pass,
            done: false,
        }
    }

    /// Whether this call is the half-open probe.
    pub(crate) fn is_probe(&self) -> bool {
        self.pass == Pass::Probe
    }

    /// Reports the outcome.
    pub(crate) fn finish(mut self, ok: bool) -> Transition {
        self.done = true;
        self.breaker.record(self.pass, ok)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.done && self.pass == Pass::Probe {
            self.breaker.record(self.pass, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_probes_after_cooldown() {
        let b = Breaker::new(3, Duration::from_millis(30));
        for _ in 0..2 {
            assert_eq!(b.acquire(), Some(Pass::Normal));
            assert_eq!(b.record(Pass::Normal, false), Transition::None);
        }
        // A success in between resets the count.
        assert_eq!(b.record(Pass::Normal, true), Transition::None);
        for _ in 0..2 {
            b.record(Pass::Normal, false);
        }
        assert!(!b.is_open());
        assert_eq!(b.record(Pass::Normal, false), Transition::Opened);
        assert!(b.is_open());
        assert_eq!(b.acquire(), None);

        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.acquire(), Some(Pass::Probe));
        // Only one probe at a time.
        assert_eq!(b.acquire(), None);
        assert_eq!(b.record(Pass::Probe, false), Transition::Opened);
        assert_eq!(b.acquire(), None);

        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.acquire(), Some(Pass::Probe));
        assert_eq!(b.record(Pass::Probe, true), Transition::Closed);
        assert!(!b.is_open());
        assert_eq!(b.acquire(), Some(Pass::Normal));
    }

    #[test]
    fn a_dropped_probe_reopens() {
        let b = Breaker::new(1, Duration::from_millis(10));
        b.record(Pass::Normal, false);
        std::thread::sleep(Duration::from_millis(20));
        let pass = b.acquire().unwrap();
        drop(Permit::new(&b, pass));
        assert!(b.is_open());
        assert_eq!(b.acquire(), None);
    }
}
