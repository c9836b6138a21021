//! The dispatch budget (the design's formula) and the target it reads.
//!
//! A [`DispatchTarget`] is what jobs are fed to: the local server (read in
//! process, [`crate::local::LocalTarget`]) or a remote pool of KServe v2 servers
//! read through their `/metrics`. Each [`Reading`] gives the target's requests in
//! flight (`cur_sys`: in batches, running), waiting in its queues (`cur_q`), and
//! its capacity (`max_sys`), jobs included. [`DispatchBudget::update`] takes the
//! dispatcher's own jobs in flight out of those figures (they are the load being
//! budgeted, not the load to protect) and computes:
//!
//! - `F_sys = cur_sys / max_sys`, `F_q = cur_q / max_sys` (realtime's share),
//! - `D = 1 − (F_sys + F_q + B)`, `B` the baseline kept for realtime bursts,
//! - the budget: at most `floor(max_sys × min(D, u))` jobs in flight, none when
//!   `D ≤ 0`, and at least one while `D > 0` (so a target of one slot, where
//!   `max_sys × u < 1`, still takes a job when realtime leaves it idle).
//!
//! The design note says the dispatcher stops above `u`; read literally an idle
//! server (`D = 1 − B`) would never get a job, so kiln caps at `u` instead: an
//! idle target takes `floor(max_sys × u)` jobs at once, a busy one what realtime
//! leaves of it less `B`.
//!
//! No reading (unreadable metrics) → budget 0. An overload answer (429,
//! RESOURCE_EXHAUSTED, a full queue) → [`DispatchBudget::on_overload`]: budget 0 until a
//! reading taken after it arrives. No blind retries.
//!
//! The target's methods are async (a remote target scrapes and posts over HTTP);
//! the dispatcher awaits them on its own thread.

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use crate::queue::{ClaimedJob, Outcome};

/// A boxed future the targets return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A target's load at one moment, every request counted (the dispatcher's jobs
/// included).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// Requests in flight: in batches being run.
    pub cur_sys: f64,
    /// Requests waiting in the target's own queues.
    pub cur_q: f64,
    /// What the target can have in flight (`--jobs-max-sys`, or its default).
    pub max_sys: f64,
    /// When the figures were read (an overload is over once a later reading came).
    pub taken: Instant,
}

/// How one dispatched job went.
#[derive(Debug, Clone, PartialEq)]
pub enum Dispatched {
    /// It ran: its result (a response, or the error the target answered for this
    /// job, such as a worker failure or a request the model refuses).
    Ran(Outcome),
    /// The target refused it for load (429, RESOURCE_EXHAUSTED, a full queue): it
    /// did not run; it goes back to the queue and the budget drops to 0.
    Overloaded,
    /// The target could not be reached or lost the job (connection refused, the
    /// model unloading): it did not run, or not to an answer; it goes back to the
    /// queue to run again.
    Unavailable(String),
}

/// What jobs are fed to.
pub trait DispatchTarget: Send + Sync {
    /// A fresh reading of the target's load; `None` when it cannot be read (the
    /// budget is then 0).
    fn read(&self) -> BoxFuture<'_, Option<Reading>>;

    /// Runs one job on the target as a request below every realtime request and
    /// yields how it went. The future owns what it needs (`'static`): the
    /// dispatcher keeps many in flight.
    fn dispatch(&self, job: ClaimedJob) -> BoxFuture<'static, Dispatched>;
}

/// The budget's settings (`--jobs-max-sys`, `--jobs-baseline`, `--jobs-cap`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    /// `max_sys` instead of the target's own figure; 0 holds every job queued
    /// (accepted and stored, none dispatched).
    pub max_sys: Option<f64>,
    /// `B`, in `[0, 1)`.
    pub baseline: f64,
    /// `u`, in `(0, 1)`.
    pub cap: f64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            max_sys: None,
            baseline: 0.05,
            cap: 0.8,
        }
    }
}

impl BudgetConfig {
    /// Checks the ranges (`B` in `[0, 1)`, `u` in `(0, 1)`, `max_sys` 0 or at
    /// least 1).
    pub fn validate(self) -> Result<BudgetConfig, String> {
        if !(0.0..1.0).contains(&self.baseline) {
            return Err(format!(
                "the jobs baseline B must be in [0, 1), got {}",
                self.baseline
            ));
        }
        if !(self.cap > 0.0 && self.cap < 1.0) {
            return Err(format!(
                "the jobs cap u must be in (0, 1), got {}",
                self.cap
            ));
        }
        if let Some(m) = self.max_sys {
            if !(m.is_finite() && (m == 0.0 || m >= 1.0)) {
                return Err(format!(
                    "--jobs-max-sys must be 0 (hold every job) or at least 1, got {m}"
                ));
            }
        }
        Ok(self)
    }
}

/// The figures of one update (exported as metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Figures {
    pub f_sys: f64,
    pub f_q: f64,
    pub d: f64,
    pub max_sys: f64,
    /// Jobs allowed in flight.
    pub budget: usize,
}

/// The budget's state: the last figures and the overload latch.
#[derive(Debug, Clone)]
pub struct DispatchBudget {
    config: BudgetConfig,
    overload_since: Option<Instant>,
    figures: Figures,
}

impl DispatchBudget {
    /// A budget of 0 until the first reading.
    pub fn new(config: BudgetConfig) -> DispatchBudget {
        DispatchBudget {
            config,
            overload_since: None,
            figures: Figures::default(),
        }
    }

    /// Computes the budget from `reading` (`None`: unreadable → 0), with
    /// `own_in_flight` of the dispatcher's jobs counted in the reading.
    pub fn update(&mut self, reading: Option<Reading>, own_in_flight: usize) -> Figures {
        let Some(r) = reading else {
            self.figures = Figures::default();
            return self.figures;
        };
        if self.overload_since.is_some_and(|at| r.taken > at) {
            self.overload_since = None;
        }
        let max_sys = self.config.max_sys.unwrap_or(r.max_sys);
        if max_sys.is_nan() || max_sys < 1.0 {
            self.figures = Figures::default();
            return self.figures;
        }
        let own = own_in_flight as f64;
        let cur_q = r.cur_q.max(0.0);
        let cur_sys = r.cur_sys.max(0.0);
        // The dispatcher's jobs are the lowest priority: count them as waiting
        // first, then running; what remains is realtime's.
        let own_waiting = own.min(cur_q);
        let rt_q = cur_q - own_waiting;
        let rt_sys = (cur_sys - (own - own_waiting)).max(0.0);
        let f_sys = rt_sys / max_sys;
        let f_q = rt_q / max_sys;
        let d = 1.0 - (f_sys + f_q + self.config.baseline);
        let budget = if d <= 0.0 || self.overload_since.is_some() {
            0
        } else {
            // The epsilon keeps 100 × 0.45 from flooring to 44. At least one while
            // D > 0: a target of one slot (max_sys × u < 1) still drains when idle.
            ((max_sys * d.min(self.config.cap) + 1e-9).floor() as usize).max(1)
        };
        self.figures = Figures {
            f_sys,
            f_q,
            d,
            max_sys,
            budget,
        };
        self.figures
    }

    /// The target answered with an overload: budget 0 until a reading taken
    /// after now.
    pub fn on_overload(&mut self) {
        self.overload_since = Some(Instant::now());
        self.figures.budget = 0;
    }

    /// The last figures.
    pub fn figures(&self) -> Figures {
        self.figures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(cur_sys: f64, cur_q: f64, max_sys: f64) -> Option<Reading> {
        Some(Reading {
            cur_sys,
            cur_q,
            max_sys,
            taken: Instant::now(),
        })
    }

    #[test]
    fn idle_target_is_capped_at_u() {
        let mut b = DispatchBudget::new(BudgetConfig::default());
        let f = b.update(reading(0.0, 0.0, 100.0), 0);
        assert_eq!(f.budget, 80);
        assert!((f.d - 0.95).abs() < 1e-9);
    }

    #[test]
    fn realtime_load_takes_its_share() {
        let mut b = DispatchBudget::new(BudgetConfig::default());
        // 40 realtime in batches, 10 waiting, plus 20 of our jobs waiting.
        let f = b.update(reading(40.0, 30.0, 100.0), 20);
        assert!((f.f_sys - 0.4).abs() < 1e-9);
        assert!((f.f_q - 0.1).abs() < 1e-9);
        assert_eq!(f.budget, 45);
    }

    #[test]
    fn saturated_or_unreadable_gives_none() {
        let mut b = DispatchBudget::new(BudgetConfig::default());
        assert_eq!(b.update(reading(96.0, 0.0, 100.0), 0).budget, 0);
        assert_eq!(b.update(reading(50.0, 50.0, 100.0), 0).budget, 0);
        assert_eq!(b.update(None, 0).budget, 0);
    }

    #[test]
    fn overload_holds_until_a_later_reading() {
        let mut b = DispatchBudget::new(BudgetConfig::default());
        let before = reading(0.0, 0.0, 10.0);
        b.on_overload();
        assert_eq!(
            b.update(before, 0).budget,
            0,
            "a reading from before the 429"
        );
        assert_eq!(b.update(reading(0.0, 0.0, 10.0), 0).budget, 8);
    }

    #[test]
    fn a_target_of_one_slot_takes_one_job_when_idle() {
        let mut b = DispatchBudget::new(BudgetConfig::default());
        assert_eq!(b.update(reading(0.0, 0.0, 1.0), 0).budget, 1);
        // Its one slot taken by realtime: none.
        assert_eq!(b.update(reading(1.0, 0.0, 1.0), 0).budget, 0);
        // Our own job in it: still one (ours, not realtime's).
        assert_eq!(b.update(reading(1.0, 0.0, 1.0), 1).budget, 1);
    }

    #[test]
    fn configured_max_sys_wins() {
        let mut b = DispatchBudget::new(BudgetConfig {
            max_sys: Some(10.0),
            ..BudgetConfig::default()
        });
        assert_eq!(b.update(reading(0.0, 0.0, 1000.0), 0).budget, 8);
    }

    #[test]
    fn ranges_are_checked() {
        let bad = BudgetConfig {
            cap: 1.0,
            ..BudgetConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = BudgetConfig {
            baseline: -0.1,
            ..BudgetConfig::default()
        };
        assert!(bad.validate().is_err());
        for (m, ok) in [(0.0, true), (0.5, false), (1.0, true), (f64::NAN, false)] {
            let config = BudgetConfig {
                max_sys: Some(m),
                ..BudgetConfig::default()
            };
            assert_eq!(config.validate().is_ok(), ok, "max_sys {m}");
        }
    }

    #[test]
    fn max_sys_zero_holds_every_job() {
        let mut b = DispatchBudget::new(BudgetConfig {
            max_sys: Some(0.0),
            ..BudgetConfig::default()
        });
        assert_eq!(b.update(reading(0.0, 0.0, 100.0), 0).budget, 0);
    }
}
