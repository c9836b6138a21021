//! The standard Prometheus process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, `process_max_fds`,
//! `process_start_time_seconds`, `process_threads`), the names every Prometheus
//! client library exports, read from `/proc/self` on each scrape. A metric whose
//! source cannot be read (not Linux, a locked-down `/proc`) is left out rather than
//! reported as 0.
//!
//! `kiln-load --server-cpu` reads `process_cpu_seconds_total` before and after its
//! measured window to report the server's CPU per request.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// What `/proc/PID/stat` says about a process, in its own units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// User-mode CPU time, in clock ticks.
    pub utime: u64,
    /// Kernel-mode CPU time, in clock ticks.
    pub stime: u64,
    /// Threads in the process.
    pub threads: u64,
    /// When the process started, in clock ticks after boot.
    pub start_ticks: u64,
    /// Resident set size, in pages.
    pub rss_pages: u64,
}

impl ProcStat {
    /// Parses the one line of `/proc/PID/stat`. The command name (field 2) is in
    /// parentheses and may hold spaces or parentheses itself, so the fields are
    /// counted from the last `)`.
    pub fn parse(line: &str) -> Option<ProcStat> {
        let (_, rest) = line.rsplit_once(')')?;
        // `rest` starts at field 3 (state): field N is at index N - 3.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        Some(ProcStat {
            utime: field(14)?,
            stime: field(15)?,
            threads: field(20)?,
            start_ticks: field(22)?,
            rss_pages: field(24)?,
        })
    }
}

/// The boot time in seconds since the epoch (`btime` in `/proc/stat`).
fn boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft "Max open files" limit from `/proc/PID/limits` (None when unlimited).
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `sysconf(name)`, or `fallback` when the system does not say.
fn sysconf_or(name: libc::c_int, fallback: u64) -> u64 {
    // SAFETY: sysconf only reads system configuration.
    let value = unsafe { libc::sysconf(name) };
    u64::try_from(value)
        .ok()
        .filter(|&v| v > 0)
        .unwrap_or(fallback)
}

/// Collects the process metrics of this process on each scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let stat = read("/proc/self/stat").and_then(|s| ProcStat::parse(&s));
        let hz = sysconf_or(libc::_SC_CLK_TCK, 100) as f64;
        let mut gauge = |name: &str, help: &str, value: f64| {
            let gauge = ConstGauge::new(value);
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)
        };
        if let Some(stat) = stat {
            gauge(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                stat.rss_pages
                    .saturating_mul(sysconf_or(libc::_SC_PAGESIZE, 4096)) as f64,
            )?;
            gauge(
                "process_threads",
                "Number of OS threads in the process.",
                stat.threads as f64,
            )?;
            if let Some(boot) = read("/proc/stat").as_deref().and_then(boot_time) {
                gauge(
                    "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    boot as f64 + stat.start_ticks as f64 / hz,
                )?;
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            // The directory's own descriptor, open while it is read, is counted too,
            // as the Go and Python clients count it.
            gauge(
                "process_open_fds",
                "Number of open file descriptors.",
                fds.count() as f64,
            )?;
        }
        if let Some(max) = read("/proc/self/limits")
            .as_deref()
            .and_then(max_open_files)
        {
            gauge(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                max as f64,
            )?;
        }
        if let Some(stat) = stat {
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / hz);
            // The counter's encoder adds `_total`.
            let metric = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                cpu.metric_type(),
            )?;
            cpu.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{boot_time, max_open_files, ProcStat};

    #[test]
    fn parses_stat_with_a_command_name_holding_spaces_and_parentheses() {
        let line = "4242 (kiln (x) y) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    123 45 0 0 20 0 17 0 98765 123456789 3000 18446744073709551615";
        let stat = ProcStat::parse(line);
        assert_eq!(
            stat,
            Some(ProcStat {
                utime: 123,
                stime: 45,
                threads: 17,
                start_ticks: 98765,
                rss_pages: 3000,
            })
        );
        assert_eq!(ProcStat::parse("4242 (kiln) S 1 2"), None);
    }

    #[test]
    fn reads_boot_time_and_the_soft_descriptor_limit() {
        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1764000000\nprocesses 9\n"),
            Some(1764000000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             95000                95000                processes \n\
                      Max open files            1048576              1048576              files     \n";
        assert_eq!(max_open_files(limits), Some(1048576));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn reads_this_process() {
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| ProcStat::parse(&s));
        let stat = stat.map(|s| (s.threads > 0, s.rss_pages > 0));
        assert_eq!(stat, Some((true, true)));
    }
}
