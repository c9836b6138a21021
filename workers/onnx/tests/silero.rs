//! Silero VAD served batched with its state kept batch first: `batch_axis.state` and
//! `batch_axis.stateN` move the model's batch axis (1) to the front, and `input.sr`
//! feeds the sample rate. Needs `scripts/fetch-models` (the runtime and the model) and,
//! for the reference, `scripts/setup-python`.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use kiln_worker_sdk::testing::{Harness, TestTensor};
use kiln_worker_sdk::{DataType, TensorSpec};

const CHUNK: usize = 512;
const STATE: usize = 2 * 128;

/// Starts the worker on Silero with `extra` parameters after the model's location.
fn start(extra: &[(&str, &str)]) -> Result<Harness, String> {
    common::start("silero-vad", extra)
}

/// Silero with its state batch first and sr constant, as it is served statefully.
fn stateful() -> Harness {
    start(&[
        ("max_batch_size", "64"),
        ("input.sr", "16000"),
        ("batch_axis.state", "1"),
        ("batch_axis.stateN", "1"),
    ])
    .unwrap()
}

/// One stream's step: a chunk of audio and the state before it ([2, 128]).
#[derive(Clone)]
struct Row {
    audio: Vec<f32>,
    state: Vec<f32>,
}

/// What the model answered for a row: the speech probability and the next state.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    prob: f32,
    state: Vec<f32>,
}

/// Runs one batch: each request holds some rows; the answers in row order.
fn run(h: &mut Harness, requests: &[&[Row]]) -> Vec<Answer> {
    let tensors: Vec<Vec<TestTensor>> = requests
        .iter()
        .map(|rows| {
            let n = rows.len() as i64;
            let samples = rows.first().map_or(0, |r| r.audio.len()) as i64;
            let audio: Vec<f32> = rows.iter().flat_map(|r| r.audio.clone()).collect();
            let state: Vec<f32> = rows.iter().flat_map(|r| r.state.clone()).collect();
            vec![
                TestTensor::new("input", DataType::Fp32, &[n, samples], &audio),
                TestTensor::new("state", DataType::Fp32, &[n, 2, 128], &state),
            ]
        })
        .collect();
    let responses = h.run(&tensors).unwrap();
    let mut answers = Vec::new();
    for (rows, response) in requests.iter().zip(&responses) {
        let n = rows.len() as i64;
        assert_eq!(response[0].name, "output");
        assert_eq!(response[0].shape.dims(), &[n, 1]);
        assert_eq!(response[1].name, "stateN");
        assert_eq!(response[1].shape.dims(), &[n, 2, 128]);
        let probs = response[0].values::<f32>();
        let states = response[1].values::<f32>();
        for (prob, state) in probs.iter().zip(states.chunks_exact(STATE)) {
            answers.push(Answer {
                prob: *prob,
                state: state.to_vec(),
            });
        }
    }
    answers
}

/// Deterministic pseudo-random numbers in [-1, 1).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A row of tone-and-noise audio and a random state, different for every `seed`.
    fn row(&mut self, seed: usize) -> Row {
        let freq = 150.0 + 170.0 * seed as f32;
        let audio = (0..CHUNK)
            .map(|i| {
                let t = i as f32 / 16000.0;
                0.4 * (2.0 * std::f32::consts::PI * freq * t).sin() + 0.1 * self.next()
            })
            .collect();
        let state = (0..STATE).map(|_| 0.5 * self.next()).collect();
        Row { audio, state }
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn assert_close(got: &Answer, want: &Answer, tolerance: f32, what: &str) {
    let d = (got.prob - want.prob)
        .abs()
        .max(max_diff(&got.state, &want.state));
    assert!(d <= tolerance, "{what}: differs by {d}");
}

#[test]
fn declares_state_batch_first_and_hides_sr() {
    let h = stateful();
    let info = h.info();
    assert_eq!(info.max_batch_size, 64);
    assert_eq!(
        info.inputs.to_vec(),
        vec![
            TensorSpec::new("input", DataType::Fp32, &[-1]),
            TensorSpec::new("state", DataType::Fp32, &[2, 128]),
        ]
    );
    assert_eq!(
        info.outputs.to_vec(),
        vec![
            TensorSpec::new("output", DataType::Fp32, &[1]),
            TensorSpec::new("stateN", DataType::Fp32, &[-1, -1]),
        ]
    );
    // Without the parameters Silero does not batch, as before.
    let plain = start(&[]).unwrap();
    assert_eq!(plain.info().max_batch_size, 0);
    assert_eq!(plain.info().inputs.len(), 3);
}

#[test]
fn batched_rows_equal_each_row_alone() {
    let mut h = stateful();
    let mut noise = Noise(7);
    let rows: Vec<Row> = (0..4).map(|i| noise.row(i)).collect();
    let alone: Vec<Answer> = rows
        .iter()
        .map(|r| run(&mut h, &[std::slice::from_ref(r)]).remove(0))
        .collect();
    // The states (and so the answers) differ from row to row.
    assert!(alone.windows(2).all(|w| w[0] != w[1]));
    // Three requests of one row each.
    let batched = run(&mut h, &[&rows[0..1], &rows[1..2], &rows[2..3]]);
    for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
        assert_close(got, want, 1e-6, &format!("row {i} of three requests"));
    }
    // A request of two rows between requests of one, in another order.
    let mixed = [rows[3].clone(), rows[0].clone()];
    let batched = run(&mut h, &[&rows[2..3], &mixed, &rows[1..2]]);
    for (i, (got, want)) in batched
        .iter()
        .zip([&alone[2], &alone[3], &alone[0], &alone[1]])
        .enumerate()
    {
        assert_close(got, want, 1e-6, &format!("row {i} of a two-row request"));
    }
}

/// Reads a little-endian FP32 file.
fn floats(path: PathBuf) -> Vec<f32> {
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn batched_streams_match_onnxruntime_run_alone() {
    const STREAMS: usize = 3;
    const CHUNKS: usize = 12;
    // Each call's input: 64 samples of context (the previous chunk's last ones), then
    // the 512-sample chunk, as silero-vad's own wrapper feeds the model: the speech
    // probabilities then span 0..1.
    const WIDTH: usize = 64 + CHUNK;
    let python = common::cache_dir().join("venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-python",
        python.display()
    );
    let out = std::env::temp_dir().join(format!("kiln-onnx-silero-{}", std::process::id()));
    let status = Command::new(&python)
        .arg(common::repo_root().join("tests/golden/silero_reference.py"))
        .arg(common::model_dir("silero-vad").join("model.onnx"))
        .arg(&out)
        .args(["--streams", &STREAMS.to_string()])
        .args(["--chunks", &CHUNKS.to_string()])
        .args(["--seed", "11", "--context", "64"])
        .status()
        .unwrap();
    assert!(status.success(), "silero_reference.py failed");
    let inputs = floats(out.join("inputs.f32"));
    let probs = floats(out.join("probs.f32"));
    let final_states = floats(out.join("final_state.f32"));
    std::fs::remove_dir_all(&out).ok();

    let mut h = stateful();
    let mut states = vec![vec![0f32; STATE]; STREAMS];
    for c in 0..CHUNKS {
        // Every stream's chunk c in one batch, the streams in a different order each time.
        let order: Vec<usize> = (0..STREAMS).map(|k| (k + c) % STREAMS).collect();
        let rows: Vec<Row> = order
            .iter()
            .map(|&s| {
                let at = (s * CHUNKS + c) * WIDTH;
                Row {
                    audio: inputs[at..at + WIDTH].to_vec(),
                    state: states[s].clone(),
                }
            })
            .collect();
        let requests: Vec<&[Row]> = rows.iter().map(std::slice::from_ref).collect();
        for (answer, &s) in run(&mut h, &requests).into_iter().zip(&order) {
            let want = probs[s * CHUNKS + c];
            assert!(
                (answer.prob - want).abs() <= 1e-5,
                "stream {s} chunk {c}: {} != reference {want}",
                answer.prob
            );
            states[s] = answer.state;
        }
    }
    for (s, state) in states.iter().enumerate() {
        let want = &final_states[s * STATE..(s + 1) * STATE];
        let d = max_diff(state, want);
        assert!(d <= 1e-5, "stream {s}: final state differs by {d}");
    }
}

fn error(extra: &[(&str, &str)]) -> String {
    match start(extra) {
        Ok(_) => panic!("{extra:?} was accepted"),
        Err(e) => e,
    }
}

#[test]
fn refuses_wrong_parameters() {
    let batched = [
        ("max_batch_size", "64"),
        ("input.sr", "16000"),
        ("batch_axis.stateN", "1"),
    ];
    let with = |more: &[(&'static str, &'static str)]| {
        let mut params = batched.to_vec();
        params.extend_from_slice(more);
        error(&params)
    };
    let e = with(&[("batch_axis.stat", "1")]);
    assert!(
        e.contains("`batch_axis.stat`") && e.contains("no input or output `stat`"),
        "{e}"
    );
    let e = with(&[("batch_axis.state", "3")]);
    assert!(
        e.contains("`batch_axis.state` = 3") && e.contains("rank 3"),
        "{e}"
    );
    let e = with(&[("batch_axis.state", "-1")]);
    assert!(e.contains("`batch_axis.state`"), "{e}");
    let e = with(&[("batch_axis.state", "one")]);
    assert!(e.contains("must be an integer"), "{e}");
    let e = with(&[("batch_axis.state", "1"), ("input.rate", "16000")]);
    assert!(
        e.contains("`input.rate`") && e.contains("no input `rate`"),
        "{e}"
    );
    let e = with(&[("batch_axis.state", "1"), ("input.output", "1")]);
    assert!(e.contains("no input `output`"), "{e}");
    let e = error(&[("input.sr", "16k")]);
    assert!(
        e.contains("`input.sr`") && e.contains("INT64") && e.contains("16k"),
        "{e}"
    );
    let e = error(&[("input.sr", "1.5")]);
    assert!(e.contains("`input.sr`"), "{e}");
    let e = error(&[("input.state", "0")]);
    assert!(e.contains("fixed shape"), "{e}");
    let e = with(&[("batch_axis.state", "1"), ("batch_axis.sr", "0")]);
    assert!(e.contains("constant input"), "{e}");
    // Batching needs the state's batch axis declared.
    let e = with(&[]);
    assert!(
        e.contains("`state` has dims [2, -1, 128]") && e.contains("batch_axis.state"),
        "{e}"
    );
    // A batch axis without batching.
    let e = error(&[
        ("max_batch_size", "0"),
        ("input.sr", "16000"),
        ("batch_axis.state", "1"),
        ("batch_axis.stateN", "1"),
    ]);
    assert!(e.contains("max_batch_size is 0"), "{e}");
}
