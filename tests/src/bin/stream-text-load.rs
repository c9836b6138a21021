//! `stream-text-load URL MODEL SESSIONS SECONDS MEDIA [WINDOW]`: text detection on
//! video at N WebSocket sessions, for `scripts/bench-stream-text`. Each session
//! names the server-side video MEDIA (under kiln's `--media-dir`) with
//! `"processing": "text_boxes"` and `max_inflight_frames` WINDOW (default 2), and
//! reads results (a new session when the video ends). After 2 s of warm-up it
//! counts SECONDS of results and prints one JSON line: sessions, frames per second
//! in total and per session, the p50/p99 of each frame's `latency_ms` (kiln's: the
//! frame decoded to its boxes ready to send), and the mean boxes per frame.
//!
//! `stream-text-load --videos DIR` generates the test videos into DIR
//! (`kiln_media::testvideo`, as the tests do) and exits.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_client::stream::{Event, StreamClient};
use serde_json::json;

#[derive(Default)]
struct Counts {
    latencies_ms: Vec<f64>,
    boxes: u64,
    errors: u64,
}

/// What every session of a run shares.
struct Run {
    url: String,
    model: String,
    media: String,
    window: u64,
    /// Results are counted from `warm` to `end`.
    warm: Instant,
    end: Instant,
    counts: Mutex<Counts>,
}

async fn session(run: Arc<Run>) {
    while Instant::now() < run.end {
        let mut client = StreamClient::connect(&run.url, &run.model, None)
            .await
            .expect("connect");
        let open = json!({"source": {"media": run.media}, "processing": "text_boxes",
                          "max_inflight_frames": run.window});
        client.open(open).await.expect("open");
        loop {
            match client.recv().await.expect("a message") {
                Event::Result(r) => {
                    let now = Instant::now();
                    if now >= run.end {
                        return;
                    }
                    if now >= run.warm {
                        let mut c = run.counts.lock().unwrap();
                        let latency = r.header["latency_ms"].as_f64().unwrap_or(0.0);
                        c.latencies_ms.push(latency);
                        c.boxes += r.header["boxes"].as_array().map_or(0, |b| b.len() as u64);
                    }
                }
                Event::FrameError { .. } => run.counts.lock().unwrap().errors += 1,
                Event::Message(m) if m["event"] == "end" => break,
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--videos" {
        kiln_media::testvideo::ensure(std::path::Path::new(&args[2])).expect("the test videos");
        return;
    }
    if args.len() < 6 {
        eprintln!("usage: stream-text-load URL MODEL SESSIONS SECONDS MEDIA [WINDOW]");
        std::process::exit(2);
    }
    let sessions: usize = args[3].parse().expect("SESSIONS");
    let seconds: f64 = args[4].parse().expect("SECONDS");
    let warm = Instant::now() + Duration::from_secs(2);
    let run = Arc::new(Run {
        url: args[1].clone(),
        model: args[2].clone(),
        media: args[5].clone(),
        window: args.get(6).map_or(2, |w| w.parse().expect("WINDOW")),
        warm,
        end: warm + Duration::from_secs_f64(seconds),
        counts: Mutex::new(Counts::default()),
    });
    let tasks: Vec<_> = (0..sessions)
        .map(|_| tokio::spawn(session(run.clone())))
        .collect();
    for t in tasks {
        t.await.expect("a session failed");
    }
    let mut c = run.counts.lock().unwrap();
    c.latencies_ms.sort_by(f64::total_cmp);
    let n = c.latencies_ms.len();
    let at = |p: f64| {
        let i = ((n as f64 * p) as usize).min(n.saturating_sub(1));
        c.latencies_ms.get(i).copied().unwrap_or(0.0)
    };
    let fps = n as f64 / seconds;
    let line = json!({"sessions": sessions, "fps": fps, "fps_per_session": fps / sessions as f64,
                      "p50_ms": at(0.5), "p99_ms": at(0.99), "frames": n,
                      "boxes_per_frame": c.boxes as f64 / n.max(1) as f64, "errors": c.errors});
    println!("{line}");
}
