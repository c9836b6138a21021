//! `kiln-load --stream`: N WebSocket sessions (`--concurrency`), each streaming
//! JPEG frames of `--frame-size` to `--model` and keeping `--stream-window`
//! frames unanswered (closed loop: the next frame goes when a result comes, so
//! nothing is dropped and the rate is what the server sustains). Reports frames
//! per second in total and per session, each frame's latency (sent to result
//! read, p50/p99) and the model's mean batch over the window (from `/metrics`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use kiln_client::stream::{encode_jpeg, Event, StreamClient};

/// What a stream run needs.
#[derive(Clone)]
pub struct StreamLoad {
    pub url: String,
    pub model: String,
    pub width: usize,
    pub height: usize,
    pub window: usize,
    pub warmup: Duration,
    pub duration: Duration,
}

/// A run's numbers.
pub struct StreamStats {
    pub frames: u64,
    pub errors: u64,
    pub dropped: u64,
    pub latency: Histogram<u64>,
    pub mean_batch: Option<f64>,
}

/// Parses `WxH`.
pub fn parse_size(text: &str) -> anyhow::Result<(usize, usize)> {
    let (w, h) = text
        .split_once('x')
        .with_context(|| format!("--frame-size `{text}`: expected WIDTHxHEIGHT"))?;
    let (w, h): (usize, usize) = (w.parse()?, h.parse()?);
    if w == 0 || h == 0 || w > 8192 || h > 8192 {
        bail!("--frame-size `{text}`: 1 to 8192 on each side");
    }
    Ok((w, h))
}

/// Eight JPEG frames of a moving square over a gradient, sent in turn.
fn frames(width: usize, height: usize) -> anyhow::Result<Vec<Vec<u8>>> {
    (0..8)
        .map(|i| {
            let pixels: Vec<u8> = (0..width * height)
                .flat_map(|p| {
                    let (x, y) = (p % width, p / width);
                    let square = (x / 32 + y / 32) % 8 == i;
                    if square {
                        [255, 255, 255]
                    } else {
                        [(x * 255 / width) as u8, (y * 255 / height) as u8, 96]
                    }
                })
                .collect();
            Ok(encode_jpeg(&pixels, width as u16, height as u16, 85)?)
        })
        .collect()
}

/// `kiln_batch_size`'s sum and count for `model` on the server's `/metrics`.
async fn batch_totals(http: &reqwest::Client, url: &str, model: &str) -> Option<(f64, f64)> {
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let sample = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?;
            rest.contains(&format!("model=\"{model}\""))
                .then(|| rest.rsplit_once(' ')?.1.parse::<f64>().ok())
                .flatten()
        })
    };
    Some((
        sample("kiln_batch_size_sum{")?,
        sample("kiln_batch_size_count{")?,
    ))
}

/// Runs `sessions` sessions for the warm-up and the measured window.
pub async fn run(load: &StreamLoad, sessions: usize) -> anyhow::Result<StreamStats> {
    let frames = std::sync::Arc::new(frames(load.width, load.height)?);
    let start = Instant::now();
    let (measure_from, end) = (start + load.warmup, start + load.warmup + load.duration);
    let url = load.url.trim_end_matches('/').to_owned();
    let mut tasks = Vec::new();
    for _ in 0..sessions {
        let (load, frames) = (load.clone(), std::sync::Arc::clone(&frames));
        tasks.push(tokio::spawn(async move {
            session(&load, &frames, measure_from, end).await
        }));
    }
    let http = reqwest::Client::new();
    tokio::time::sleep_until(measure_from.into()).await;
    let before = batch_totals(&http, &url, &load.model).await;
    tokio::time::sleep_until(end.into()).await;
    let after = batch_totals(&http, &url, &load.model).await;
    let mut total = StreamStats {
        frames: 0,
        errors: 0,
        dropped: 0,
        latency: Histogram::new(3)?,
        mean_batch: match (before, after) {
            (Some((s0, c0)), Some((s1, c1))) if c1 > c0 => Some((s1 - s0) / (c1 - c0)),
            _ => None,
        },
    };
    for t in tasks {
        let stats = t.await??;
        total.frames += stats.frames;
        total.errors += stats.errors;
        total.dropped += stats.dropped;
        total.latency.add(&stats.latency)?;
    }
    Ok(total)
}

/// One session until `end`, counting what is answered after `measure_from`.
async fn session(
    load: &StreamLoad,
    frames: &[Vec<u8>],
    measure_from: Instant,
    end: Instant,
) -> anyhow::Result<StreamStats> {
    let mut s = StreamClient::connect(&load.url, &load.model, None).await?;
    s.open(serde_json::json!({"encoding": "jpeg", "max_inflight_frames": load.window}))
        .await?;
    let mut stats = StreamStats {
        frames: 0,
        errors: 0,
        dropped: 0,
        latency: Histogram::new(3)?,
        mean_batch: None,
    };
    let mut sent: VecDeque<Instant> = VecDeque::new();
    let mut next = 0usize;
    loop {
        while sent.len() < load.window && Instant::now() < end {
            s.send_frame(frames[next % frames.len()].clone()).await?;
            sent.push_back(Instant::now());
            next += 1;
        }
        let Some(at) = sent.pop_front() else { break };
        let event = s.recv().await?;
        let now = Instant::now();
        let measured = now >= measure_from && now < end;
        match event {
            Event::Result(r) => {
                if measured {
                    stats.frames += 1;
                    stats
                        .latency
                        .record(now.duration_since(at).as_micros() as u64)?;
                    let dropped = ["overrun", "slow_reader", "rejected"].map(|d| r.dropped(d));
                    stats.dropped = dropped.iter().sum();
                }
            }
            Event::FrameError { .. } if measured => stats.errors += 1,
            Event::FrameError { .. } => {}
            other => bail!("the session ended: {other:?}"),
        }
    }
    s.close().await?;
    Ok(stats)
}
