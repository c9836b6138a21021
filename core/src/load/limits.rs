//! Server-wide limits: what one model, and all models together, may take of the
//! machine (instances, batcher threads, buffer memory). Operators set them with flags;
//! a load beyond one is refused with an error naming the flag and its value.
//!
//! The Manager checks every load against them, and it handles one load at a time, so
//! totals hold under concurrent loads; a group's share is freed when it is unloaded
//! (totals are summed over the loaded groups, nothing is counted separately).

use crate::error::{Result, ServerError};

/// What a group takes, or would take, of the machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Worker instances (one thread each).
    pub instances: usize,
    /// Batcher threads, or formers where the instances form the batches (`batchers`
    /// for hard and soft; one for dynamic and sequence).
    pub batcher_threads: usize,
    /// The buffer pool's memory at load: `max_buffers` sets of their initial sizes.
    pub buffer_bytes: u64,
}

impl std::ops::Add for Demand {
    type Output = Demand;
    fn add(self, other: Demand) -> Demand {
        Demand {
            instances: self.instances + other.instances,
            batcher_threads: self.batcher_threads + other.batcher_threads,
            buffer_bytes: self.buffer_bytes.saturating_add(other.buffer_bytes),
        }
    }
}

impl std::iter::Sum for Demand {
    fn sum<I: Iterator<Item = Demand>>(iter: I) -> Demand {
        iter.fold(Demand::default(), |a, b| a + b)
    }
}

/// The limits, per model and in total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `--max-instances-per-model`.
    pub instances_per_model: usize,
    /// `--max-instances`.
    pub instances: usize,
    /// `--max-batcher-threads-per-model`.
    pub batcher_threads_per_model: usize,
    /// `--max-batcher-threads`.
    pub batcher_threads: usize,
    /// `--max-buffer-bytes-per-model`.
    pub buffer_bytes_per_model: u64,
    /// `--max-buffer-bytes`.
    pub buffer_bytes: u64,
}

impl Default for Limits {
    /// Derived from the machine: see [`Limits::for_machine`].
    fn default() -> Limits {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Limits::for_machine(cores, physical_memory())
    }
}

impl Limits {
    /// Defaults for a machine of `cores` cores and `memory` bytes: an instance or a
    /// batcher thread beyond a few per core only adds switching, so instances are 4
    /// per core per model (at least 8) and 16 per core in total (at least 64);
    /// batcher threads one per core per model (at least 4) and 16 per core in total
    /// (at least 256: every model has one); buffer pools a quarter of the memory per
    /// model and half of it in total.
    pub fn for_machine(cores: usize, memory: u64) -> Limits {
        Limits {
            instances_per_model: (4 * cores).max(8),
            instances: (16 * cores).max(64),
            batcher_threads_per_model: cores.max(4),
            batcher_threads: (16 * cores).max(256),
            buffer_bytes_per_model: memory / 4,
            buffer_bytes: memory / 2,
        }
    }

    /// Checks that `model` may take `group` (its whole demand, with what it already
    /// has) while the server holds `total` (every group, this one's share included).
    pub fn check(&self, model: &str, group: Demand, total: Demand) -> Result<()> {
        let checks = [
            (
                group.instances as u64,
                self.instances_per_model as u64,
                "instances of model",
                "--max-instances-per-model",
            ),
            (
                total.instances as u64,
                self.instances as u64,
                "instances in all",
                "--max-instances",
            ),
            (
                group.batcher_threads as u64,
                self.batcher_threads_per_model as u64,
                "batcher threads of model",
                "--max-batcher-threads-per-model",
            ),
            (
                total.batcher_threads as u64,
                self.batcher_threads as u64,
                "batcher threads in all",
                "--max-batcher-threads",
            ),
            (
                group.buffer_bytes,
                self.buffer_bytes_per_model,
                "buffer bytes of model",
                "--max-buffer-bytes-per-model",
            ),
            (
                total.buffer_bytes,
                self.buffer_bytes,
                "buffer bytes in all",
                "--max-buffer-bytes",
            ),
        ];
        for (wanted, limit, what, flag) in checks {
            if wanted > limit {
                return Err(ServerError::LimitExceeded(format!(
                    "loading `{model}` would make {wanted} {what}{}: over the server's \
                     limit {flag} = {limit}",
                    if what.ends_with("model") {
                        format!(" `{model}`")
                    } else {
                        String::new()
                    }
                )));
            }
        }
        Ok(())
    }
}

/// The machine's memory in bytes (4 GiB when it cannot be read).
/// The machine's memory in bytes (4 GiB when the system does not say).
pub(crate) fn physical_memory() -> u64 {
    // SAFETY: sysconf only reads system configuration.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && size > 0 {
        (pages as u64).saturating_mul(size as u64)
    } else {
        4 << 30
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(instances: usize, batcher_threads: usize, buffer_bytes: u64) -> Demand {
        Demand {
            instances,
            batcher_threads,
            buffer_bytes,
        }
    }

    #[test]
    fn each_limit_is_named_when_exceeded() {
        let limits = Limits {
            instances_per_model: 2,
            instances: 3,
            batcher_threads_per_model: 2,
            batcher_threads: 3,
            buffer_bytes_per_model: 100,
            buffer_bytes: 150,
        };
        let ok = demand(2, 2, 100);
        assert!(limits.check("m", ok, ok + demand(1, 1, 50)).is_ok());
        for (group, total, flag) in [
            (
                demand(3, 1, 1),
                demand(3, 1, 1),
                "--max-instances-per-model = 2",
            ),
            (ok, demand(4, 1, 1), "--max-instances = 3"),
            (
                demand(1, 3, 1),
                demand(1, 3, 1),
                "--max-batcher-threads-per-model = 2",
            ),
            (ok, demand(1, 4, 1), "--max-batcher-threads = 3"),
            (
                demand(1, 1, 101),
                demand(1, 1, 101),
                "--max-buffer-bytes-per-model = 100",
            ),
            (ok, demand(1, 1, 151), "--max-buffer-bytes = 150"),
        ] {
            let e = limits.check("m", group, total).unwrap_err();
            assert!(e.to_string().contains(flag), "{e} should name {flag}");
            // HTTP 400, gRPC RESOURCE_EXHAUSTED (`http/error.rs`, `grpc/status.rs`).
            assert!(matches!(e, ServerError::LimitExceeded(_)), "{e:?}");
        }
    }

    #[test]
    fn defaults_scale_with_the_machine() {
        let small = Limits::for_machine(2, 8 << 30);
        assert_eq!((small.instances_per_model, small.instances), (8, 64));
        assert_eq!(small.buffer_bytes, 4 << 30);
        let big = Limits::for_machine(64, 512 << 30);
        assert_eq!((big.instances_per_model, big.instances), (256, 1024));
        assert!(Limits::default().buffer_bytes > 0);
    }
}
