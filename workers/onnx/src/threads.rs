//! Where a session's threads come from. By default every session of the process
//! runs on ONNX Runtime's global thread pools, created once with the environment
//! ([`crate::runtime`]): one intra-op thread per physical core, shared by every
//! model loaded, spinning allowed. One pool means no model's idle threads spin
//! against another's work (the reason the PP-OCR configs once turned spinning off,
//! which cost each model alone: ocr-det 0.67× Python), and a pool that is idle
//! parks (no CPU: tests/tests/onnx_thread_pool.rs); runs on it take turns
//! ([`crate::turns`]). An operator who sets
//! `intra_op_threads`, `inter_op_threads`, `allow_spinning` or
//! `force_spinning_stop` gets a pool of the session's own with those settings
//! (the others at their former defaults); only such a pool can stop spinning as a
//! run returns (ONNX Runtime's `session.force_spinning_stop`).

use kiln_worker_sdk::{Params, WorkerError, INSTANCES_PARAM};

/// The load parameters that ask for a session's own pool.
const OWN_POOL_PARAMS: [&str; 4] = [
    "intra_op_threads",
    "inter_op_threads",
    "allow_spinning",
    "force_spinning_stop",
];

/// A session's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// The process's global pools (see [`crate::runtime`]).
    Shared,
    /// A pool of the session's own.
    Own {
        intra: usize,
        inter: usize,
        spinning: bool,
        /// ONNX Runtime's `session.force_spinning_stop`: the pool stops spinning
        /// when the session's last run returns (only a session's own pool can).
        stop_between_runs: bool,
    },
}

impl Threads {
    /// The side session's: one thread, the caller's, for a run beside others on one
    /// core of the shared pool ([`crate::turns`]). ONNX Runtime starts no pool
    /// threads for it, so there is nothing to spin.
    pub const SIDE: Threads = Threads::Own {
        intra: 1,
        inter: 1,
        spinning: false,
        stop_between_runs: false,
    };

    /// [`Threads::Shared`] unless one of [`OWN_POOL_PARAMS`] is set; then its own
    /// pool: `intra_op_threads` (default: `physical_cores` divided among the
    /// group's instances, which the server passes as [`INSTANCES_PARAM`]),
    /// `inter_op_threads` (1), `allow_spinning` (true).
    pub fn from_params(params: &Params<'_>, physical_cores: usize) -> Result<Self, WorkerError> {
        if OWN_POOL_PARAMS.iter().all(|p| params.get(p).is_none()) {
            return Ok(Threads::Shared);
        }
        let intra = if params.get("intra_op_threads").is_some() {
            crate::count(params, "intra_op_threads", 1)?
        } else {
            let instances = params.int(INSTANCES_PARAM)?.unwrap_or(1);
            default_intra_op_threads(physical_cores, usize::try_from(instances).unwrap_or(1))
        };
        Ok(Threads::Own {
            intra,
            inter: crate::count(params, "inter_op_threads", 1)?,
            spinning: params
                .bool("allow_spinning")
                .map_err(WorkerError::new)?
                .unwrap_or(true),
            stop_between_runs: params
                .bool("force_spinning_stop")
                .map_err(WorkerError::new)?
                .unwrap_or(false),
        })
    }
}

impl std::fmt::Display for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Threads::Shared => write!(
                f,
                "the process's shared pool of {} intra-op thread(s)",
                crate::runtime::GLOBAL_INTRA_OP_THREADS
                    .get()
                    .copied()
                    .unwrap_or(0)
            ),
            Threads::Own {
                intra,
                spinning,
                stop_between_runs,
                ..
            } => write!(
                f,
                "its own pool of {intra} intra-op thread(s){}{}",
                if *spinning { "" } else { " (no spinning)" },
                if *stop_between_runs {
                    " (spinning stops between runs)"
                } else {
                    ""
                }
            ),
        }
    }
}

/// Physical cores this process may use: distinct (`physical id`, `core id`) pairs
/// of `/proc/cpuinfo`, at most the CPUs it may run on (affinity, cgroup quota);
/// without `/proc/cpuinfo`'s topology, the CPUs it may run on.
pub fn physical_cores() -> usize {
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| count_physical_cores(&text))
        .map_or(available, |cores| cores.min(available))
}

/// Distinct (`physical id`, `core id`) pairs of a `/proc/cpuinfo`; `None` when it
/// does not say (some architectures and virtual machines leave them out).
pub fn count_physical_cores(cpuinfo: &str) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for processor in cpuinfo.split("\n\n") {
        let field = |name: &str| {
            processor.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == name).then(|| value.trim().to_owned())
            })
        };
        if let (Some(package), Some(core)) = (field("physical id"), field("core id")) {
            cores.insert((package, core));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Intra-op threads per instance of an own pool when none is set: the physical
/// cores divided among the group's `instances`, at least 1.
pub fn default_intra_op_threads(cores: usize, instances: usize) -> usize {
    (cores / instances.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use kiln_worker_sdk::{params_from_pairs, Params};

    use super::{count_physical_cores, default_intra_op_threads, physical_cores, Threads};

    /// Two packages of two cores with two hyperthreads each: 8 CPUs, 4 cores.
    const CPUINFO: &str = "\
processor\t: 0\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 1\nphysical id\t: 0\ncore id\t\t: 1\n\n\
processor\t: 2\nphysical id\t: 1\ncore id\t\t: 0\n\n\
processor\t: 3\nphysical id\t: 1\ncore id\t\t: 1\n\n\
processor\t: 4\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 5\nphysical id\t: 0\ncore id\t\t: 1\n\n\
processor\t: 6\nphysical id\t: 1\ncore id\t\t: 0\n\n\
processor\t: 7\nphysical id\t: 1\ncore id\t\t: 1\n";

    #[test]
    fn counts_cores_not_hyperthreads() {
        assert_eq!(count_physical_cores(CPUINFO), Some(4));
        // No topology (e.g. some ARM kernels): unknown, not 0.
        assert_eq!(
            count_physical_cores("processor\t: 0\nBogoMIPS\t: 50\n"),
            None
        );
        assert!(physical_cores() >= 1);
    }

    #[test]
    fn divides_the_cores_among_the_instances() {
        assert_eq!(default_intra_op_threads(8, 1), 8);
        assert_eq!(default_intra_op_threads(8, 2), 4);
        assert_eq!(default_intra_op_threads(8, 3), 2);
        assert_eq!(default_intra_op_threads(2, 4), 1);
        assert_eq!(default_intra_op_threads(1, 0), 1);
    }

    #[test]
    fn the_shared_pool_unless_an_operator_sets_threads() {
        let threads = |pairs: &[(&str, &str)]| {
            let params = params_from_pairs(pairs);
            Threads::from_params(&Params(&params), 8).map_err(|e| e.to_string())
        };
        let own = |intra, spinning| {
            Ok(Threads::Own {
                intra,
                inter: 1,
                spinning,
                stop_between_runs: false,
            })
        };
        assert_eq!(threads(&[]), Ok(Threads::Shared));
        assert_eq!(threads(&[("instances", "2")]), Ok(Threads::Shared));
        assert_eq!(
            threads(&[("instances", "2"), ("intra_op_threads", "3")]),
            own(3, true)
        );
        assert_eq!(threads(&[("Intra_Op_Threads", "1")]), own(1, true));
        assert_eq!(
            threads(&[("instances", "2"), ("allow_spinning", "false")]),
            own(4, false)
        );
        assert_eq!(
            threads(&[("force_spinning_stop", "true")]),
            Ok(Threads::Own {
                intra: 8,
                inter: 1,
                spinning: true,
                stop_between_runs: true,
            })
        );
        assert!(threads(&[("intra_op_threads", "0")]).is_err());
        assert!(threads(&[("intra_op_threads", "many")]).is_err());
        assert!(threads(&[("allow_spinning", "sometimes")]).is_err());
    }
}
