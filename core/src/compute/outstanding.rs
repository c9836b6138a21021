//! The count of an asynchronous group's outstanding batches: the cap each
//! instance keeps (`max_outstanding`) and the group's gauges. A leaf: the instance
//! context holds it, the asynchronous instances count through it.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::observe::metrics::ModelMetrics;

/// What a group of asynchronous instances shares: the cap per instance and the
/// group's count of outstanding batches (for `/metrics`).
pub struct Outstanding {
    /// `max_outstanding`: batches each instance may have submitted at once.
    pub max: usize,
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Outstanding {
    /// A group whose instances each keep at most `max` batches submitted.
    pub fn new(max: usize) -> Outstanding {
        Outstanding {
            max: max.max(1),
            now: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
        }
    }

    /// One more batch submitted.
    pub fn submitted(&self, metrics: &ModelMetrics) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        let most = self.most.fetch_max(now, Ordering::SeqCst).max(now);
        metrics.outstanding.set(now as i64);
        metrics.outstanding_max.set(most as i64);
    }

    /// One batch completed.
    pub fn completed(&self, metrics: &ModelMetrics) {
        let now = self.now.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
        metrics.outstanding.set(now as i64);
    }
}
