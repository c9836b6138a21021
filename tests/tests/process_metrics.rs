//! `/metrics` carries the standard Prometheus process metrics of the kiln process,
//! with values that agree with what `/proc` says about it.

use std::time::{SystemTime, UNIX_EPOCH};

use kiln_tests::{metric, Kiln};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_the_process_metrics() {
    let now = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let before_start = now();
    let kiln = Kiln::start(&["--load", "echo"]);
    let text = kiln.client.metrics().await.unwrap();
    let value =
        |name: &str| metric(&text, name, &[]).unwrap_or_else(|| panic!("no {name} in:\n{text}"));
    let cpu = value("process_cpu_seconds_total");
    assert!(cpu >= 0.0, "{cpu}");
    let resident = value("process_resident_memory_bytes");
    assert!(resident > 1e6 && resident < 1e11, "{resident}");
    let (open, max) = (value("process_open_fds"), value("process_max_fds"));
    assert!(open >= 3.0 && open <= max, "open {open}, max {max}");
    // kiln raises its soft descriptor limit to the hard one at start.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", kiln.pid())).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap_or_default();
    assert_eq!(soft, max.to_string(), "{limits}");
    // Two HTTP workers, two gRPC threads, the batcher and the instance, at least.
    let threads = value("process_threads");
    assert!(threads >= 4.0, "{threads}");
    // Start time: between just before the spawn (the clock ticks of /proc/stat's
    // boot time round to a second) and now.
    let started = value("process_start_time_seconds");
    assert!(
        started >= before_start - 2.0 && started <= now() + 2.0,
        "{started}"
    );
    // The counter counts: some requests later it has not gone back.
    for _ in 0..200 {
        assert!(kiln.client.is_ready().await.unwrap());
    }
    let later = kiln.client.metrics().await.unwrap();
    let cpu_later = metric(&later, "process_cpu_seconds_total", &[]).unwrap();
    assert!(cpu_later >= cpu, "{cpu} then {cpu_later}");
}
