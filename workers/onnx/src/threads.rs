//! The default of `intra_op_threads`: what ONNX Runtime does when left alone — one
//! intra-op thread per physical core — divided among the group's instances, so a
//! model loaded with defaults neither runs on one thread of a many-core machine nor
//! has its instances fight over the cores. On the 2-core development machine the
//! PP-OCR detector served with 1 thread ran at 0.53× of `onnxruntime` in Python
//! with its defaults (docs/benchmarks.md); an explicit `intra_op_threads` wins.

use kiln_worker_sdk::{Params, WorkerError, INSTANCES_PARAM};

/// `intra_op_threads` if set, else `physical_cores` divided among the group's
/// instances (the server passes their count as [`INSTANCES_PARAM`]).
pub fn intra_op_threads(params: &Params<'_>, physical_cores: usize) -> Result<usize, WorkerError> {
    if params.get("intra_op_threads").is_some() {
        return crate::count(params, "intra_op_threads", 1);
    }
    let instances = params.int(INSTANCES_PARAM)?.unwrap_or(1);
    let instances = usize::try_from(instances).unwrap_or(1);
    Ok(default_intra_op_threads(physical_cores, instances))
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

/// Intra-op threads per instance when none is set: the physical cores divided
/// among the group's `instances`, at least 1.
pub fn default_intra_op_threads(cores: usize, instances: usize) -> usize {
    (cores / instances.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use kiln_worker_sdk::{params_from_pairs, Params};

    use super::{count_physical_cores, default_intra_op_threads, intra_op_threads, physical_cores};

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
    fn an_explicit_intra_op_threads_wins_over_the_default() {
        let threads = |pairs: &[(&str, &str)]| {
            let params = params_from_pairs(pairs);
            intra_op_threads(&Params(&params), 8).map_err(|e| e.to_string())
        };
        assert_eq!(threads(&[]), Ok(8));
        assert_eq!(threads(&[("instances", "2")]), Ok(4));
        assert_eq!(
            threads(&[("instances", "2"), ("intra_op_threads", "3")]),
            Ok(3)
        );
        assert_eq!(threads(&[("Intra_Op_Threads", "1")]), Ok(1));
        assert!(threads(&[("intra_op_threads", "0")]).is_err());
        assert!(threads(&[("intra_op_threads", "many")]).is_err());
    }
}
