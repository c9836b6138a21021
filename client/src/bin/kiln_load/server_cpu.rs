//! The server's CPU time over a run, so kiln-load can report CPU per request:
//! user + system time of the server process read before and after the measured
//! window, either from `/proc/PID/stat` (`--server-pid`, any server on this
//! machine, Triton included) or from the server's Prometheus
//! `process_cpu_seconds_total` (`--server-cpu`/`--server-metrics`, any server
//! exporting the standard process metrics, kiln included).

use std::time::Duration;

/// Where the server's CPU time is read.
#[derive(Clone, Debug)]
pub enum CpuSource {
    /// `/proc/PID/stat` of a process on this machine.
    Pid(u32),
    /// `process_cpu_seconds_total` at this Prometheus text URL.
    Metrics(String),
}

impl CpuSource {
    /// The server's user + system CPU time so far, in seconds.
    pub async fn cpu_seconds(&self, client: &reqwest::Client) -> Result<f64, String> {
        match self {
            CpuSource::Pid(pid) => {
                let path = format!("/proc/{pid}/stat");
                let stat = std::fs::read_to_string(&path)
                    .map_err(|e| format!("--server-pid: reading {path}: {e}"))?;
                let ticks = stat_cpu_ticks(&stat)
                    .ok_or_else(|| format!("--server-pid: {path} has no utime/stime"))?;
                Ok(ticks as f64 / clock_ticks_per_second())
            }
            CpuSource::Metrics(url) => {
                let answer = client
                    .get(url)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .and_then(reqwest::Response::error_for_status)
                    .map_err(|e| format!("--server-metrics: GET {url}: {e}"))?;
                let text = answer
                    .text()
                    .await
                    .map_err(|e| format!("--server-metrics: GET {url}: {e}"))?;
                metric_value(&text, "process_cpu_seconds_total").ok_or_else(|| {
                    format!("--server-metrics: {url} has no process_cpu_seconds_total")
                })
            }
        }
    }
}

/// utime + stime (fields 14 and 15, in clock ticks) of a `/proc/PID/stat` line.
/// The command name (field 2) may hold spaces and parentheses: fields are counted
/// from the last `)`, where field 3 begins.
fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads system configuration.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// The value of the unlabelled sample `name` in Prometheus/OpenMetrics text.
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::{metric_value, stat_cpu_ticks};

    #[test]
    fn reads_utime_and_stime_after_the_command_name() {
        let stat = "77 (tritonserver (x) y) S 1 77 77 0 -1 4194560 2000 0 0 0 \
                    1234 56 0 0 20 0 40 0 98765 123456789 3000";
        assert_eq!(stat_cpu_ticks(stat), Some(1290));
        assert_eq!(stat_cpu_ticks("77 (kiln) S 1"), None);
    }

    #[test]
    fn reads_an_unlabelled_sample() {
        let text = "# HELP process_cpu_seconds Total user and system CPU time.\n\
                    # TYPE process_cpu_seconds counter\n\
                    process_cpu_seconds_total_x 9\n\
                    process_cpu_seconds_total 12.5\n# EOF\n";
        assert_eq!(metric_value(text, "process_cpu_seconds_total"), Some(12.5));
        assert_eq!(metric_value(text, "process_threads"), None);
    }
}
