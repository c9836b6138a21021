//! A worker compiled into the test program (a [`kiln_core::BuiltinWorker`]), so the
//! Manager, groups and instances are tested in-process: real batchers, real
//! instance threads and the real plugin boundary, no library and no socket.
//!
//! `fake`: UINT32 `IN` of shape [-1] → `OUT` = IN + 1, soft batcher. Load
//! parameters steer it:
//! - `gate` (int): the batch waits in `run` until [`Gate::open`] on the gate of
//!   that number ([`gate`]), so a test holds an instance busy while it fills the
//!   queue or unloads;
//! - `panic_on` (int): a batch holding that value panics (the SDK catches it);
//! - `fail_init` (bool): `init` fails.
//!
//! A request holding 7 fails alone (`Batch::fail`, invalid), the rest of its batch
//! is answered.

#![allow(dead_code)] // each test file uses part of it

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use kiln_core::{
    BuiltinWorker, DataType, InferRequest, InputTensor, Param, ParamValue, Server, ServerConfig,
};
use kiln_worker_sdk::{
    Batch, BatcherKind, ParamKind, ParamSpec, Params, RequestError, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};

/// A gate batches wait at, and how many have reached it.
#[derive(Default)]
pub struct Gate {
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    /// Lets every waiting and later batch through.
    pub fn open(&self) {
        self.state.lock().0 = true;
        self.changed.notify_all();
    }

    /// Waits until `n` batches have reached the gate.
    pub fn wait_arrived(&self, n: usize) {
        let mut state = self.state.lock();
        while state.1 < n {
            self.changed.wait(&mut state);
        }
    }

    /// Waits until `n` batches have reached the gate, or `limit` has passed (a
    /// guard against a test that would hang); whether they did.
    pub fn wait_arrived_within(&self, n: usize, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut state = self.state.lock();
        while state.1 < n {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return state.1 >= n;
            }
        }
        true
    }

    fn pass(&self) {
        let mut state = self.state.lock();
        state.1 += 1;
        self.changed.notify_all();
        while !state.0 {
            self.changed.wait(&mut state);
        }
    }
}

/// The gate numbered `n` (tests run on threads of one process: each takes its own).
pub fn gate(n: i64) -> Arc<Gate> {
    static GATES: OnceLock<Mutex<HashMap<i64, Arc<Gate>>>> = OnceLock::new();
    let mut gates = GATES.get_or_init(Default::default).lock();
    Arc::clone(gates.entry(n).or_default())
}

/// The fake worker.
pub struct Fake {
    gate: Option<Arc<Gate>>,
    panic_on: Option<u32>,
}

impl Worker for Fake {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::load(
            "gate",
            ParamKind::Int {
                min: 0,
                max: i64::MAX,
            },
        ),
        ParamSpec::load(
            "panic_on",
            ParamKind::Int {
                min: 0,
                max: u32::MAX as i64,
            },
        ),
        ParamSpec::load("fail_init", ParamKind::Bool),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        if params.bool("fail_init")?.unwrap_or(false) {
            return Err("fake: told to fail".into());
        }
        Ok(Fake {
            gate: params.int("gate")?.map(gate),
            panic_on: params.int("panic_on")?.map(|v| v as u32),
        })
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("IN", DataType::Uint32, &[-1])].into(),
            outputs: vec![TensorSpec::new("OUT", DataType::Uint32, &[-1])].into(),
            max_batch_size: 64,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        if let Some(gate) = &self.gate {
            gate.pass();
        }
        let input = batch.input(0)?;
        let values = input.as_slice::<u32>()?.to_vec();
        let shapes = input.shapes().to_vec();
        if let Some(v) = self.panic_on.filter(|v| values.contains(v)) {
            panic!("fake: told to panic on {v}");
        }
        let mut start = 0;
        for (request, shape) in shapes.iter().enumerate() {
            let end = start + shape.element_count();
            if values[start..end].contains(&7) {
                batch.fail(request, RequestError::invalid("fake: 7 is refused"))?;
            }
            start = end;
        }
        let mut output = batch.output(0)?;
        let out = output.allocate_as::<u32>(&shapes)?;
        for (o, v) in out.iter_mut().zip(&values) {
            *o = v.wrapping_add(1);
        }
        Ok(())
    }
}

/// A server whose only worker is `fake`, compiled in.
pub fn server() -> Server {
    Server::start(ServerConfig {
        // No plugin directory: only the builtin worker can be found.
        plugin_dirs: vec![std::env::temp_dir().join("kiln-core-tests-no-plugins")],
        builtin_workers: vec![BuiltinWorker::new::<Fake>("fake")],
        ..ServerConfig::default()
    })
    .expect("the server starts")
}

/// Load parameters from pairs.
pub fn params(pairs: &[(&str, i64)]) -> Vec<Param> {
    pairs
        .iter()
        .map(|(key, value)| Param {
            key: (*key).into(),
            value: ParamValue::Int(*value),
        })
        .collect()
}

/// A request of one row holding `values`.
pub fn request(model: &str, values: &[u32]) -> InferRequest {
    InferRequest {
        model: model.to_owned(),
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..InferRequest::default()
    }
}

/// A model repository holding `fake` (versions 1 and 2) in a folder of its own;
/// removed on drop.
pub struct Repository(pub std::path::PathBuf);

impl Repository {
    /// A new repository for the test `name`.
    pub fn new(name: &str) -> Repository {
        let root =
            std::env::temp_dir().join(format!("kiln-core-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for version in ["1", "2"] {
            std::fs::create_dir_all(root.join("fake").join(version)).expect("a folder");
        }
        std::fs::write(root.join("fake/config.toml"), "worker = \"fake\"\n").expect("a file");
        Repository(root)
    }

    /// A server serving this repository, with `fake` compiled in.
    pub fn server(&self) -> Server {
        Server::start(ServerConfig {
            plugin_dirs: vec![std::env::temp_dir().join("kiln-core-tests-no-plugins")],
            model_repository: Some(self.0.clone()),
            builtin_workers: vec![BuiltinWorker::new::<Fake>("fake")],
            ..ServerConfig::default()
        })
        .expect("the server starts")
    }
}

impl Drop for Repository {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` clients calling `model` until stopped, client `c` with requests of one row
/// holding `c + 100`, each counting its right answers and its failures; the
/// answers of all of them are also counted together, for [`Clients::answered_past`].
pub struct Clients {
    stop: Arc<std::sync::atomic::AtomicBool>,
    answered: tokio::sync::watch::Receiver<u64>,
    tasks: Vec<tokio::task::JoinHandle<(u64, Vec<String>)>>,
}

impl Clients {
    /// Starts them (on the current tokio runtime).
    pub fn start(server: &Server, model: &str, n: u32) -> Clients {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (total, answered) = tokio::sync::watch::channel(0u64);
        let total = Arc::new(total);
        let tasks = (0..n)
            .map(|c| {
                let (server, stop, model) = (server.clone(), stop.clone(), model.to_owned());
                let total = total.clone();
                tokio::spawn(async move {
                    let (mut answered, mut failed) = (0u64, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match server.infer(request(&model, &[c + 100])).await {
                            Ok(r) if r.outputs[0].values::<u32>() == [c + 101] => {
                                answered += 1;
                                total.send_modify(|n| *n += 1);
                            }
                            Ok(r) => failed.push(format!("wrong answer {:?}", r.outputs)),
                            Err(e) => failed.push(e.to_string()),
                        }
                    }
                    (answered, failed)
                })
            })
            .collect();
        Clients {
            stop,
            answered,
            tasks,
        }
    }

    /// Waits until the clients together have had more than `count` right answers;
    /// returns how many they have had. (A client that fails stops no wait: its
    /// failure is reported by [`Clients::none_failed`].)
    /// Only a server that stopped answering waits the minute.
    pub async fn answered_past(&mut self, count: u64) -> u64 {
        let more = self.answered.wait_for(|&n| n > count);
        let answered = tokio::time::timeout(std::time::Duration::from_secs(60), more)
            .await
            .unwrap_or_else(|_| panic!("no answer past {count} in a minute"));
        *answered.expect("the clients' counter lives as long as they do")
    }

    /// Stops them; asserts that every request was answered and some were.
    /// Returns how many.
    pub async fn none_failed(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (mut answered, mut failed) = (0, Vec::new());
        for task in self.tasks {
            let (a, f) = task.await.expect("a client task");
            answered += a;
            failed.extend(f);
        }
        assert!(
            failed.is_empty(),
            "{} of {} requests failed, e.g. {:?}",
            failed.len(),
            answered + failed.len() as u64,
            &failed[..failed.len().min(5)]
        );
        assert!(answered > 0, "nothing was answered");
        answered
    }
}

/// The worker group serving `name` now (its highest version).
pub fn group_of(server: &Server, name: &str) -> Arc<kiln_core::group::WorkerGroup> {
    let served = server.model(name).expect("the model is loaded");
    served.group().expect("a worker's group").clone()
}
