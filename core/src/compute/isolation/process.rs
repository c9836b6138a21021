//! The server's side of a worker host: [`ProcessWorker`] is a worker instance
//! (a [`WorkerFfi`] object, so the instance thread drives it exactly as it drives
//! an in-process plugin) whose calls are messages to a `kiln worker-host` child.
//!
//! Each batch's inputs are copied from the group's pooled buffer set into the
//! host's arena (one `memcpy` per input) and each output from the arena into the
//! set (one per output): the cost of isolation beyond the two messages, measured
//! in `docs/benchmarks.md` ("Worker isolation").
//!
//! When the host dies, the call in flight fails with a message naming the signal
//! or exit status; the instance thread then releases and acquires the instance
//! again, which starts a new host after a backoff of [`BACKOFF_BASE`] doubled per
//! crash in a row (no batch succeeded in between), at most [`BACKOFF_CAP`].

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use kiln_worker_sdk::reexports::{ROption, RResult, RSlice, RString};
use kiln_worker_sdk::{BatchCompletionBox, BatchFfi, Param, WorkerFfi, WorkerInfo};
use prometheus_client::metrics::counter::Counter;

use super::arena::{align, ARENA_KEEP};
use super::relay::{self, HOST_CALLS};
use super::spawn::{describe, reap, spawn, Host};
use super::wire::{read_frame, write_frame, Call, Reader, WireError, Writer, REPLY_OK};

/// The delay before the first restart after a crash.
pub const BACKOFF_BASE: Duration = Duration::from_millis(50);
/// The longest delay between restarts of a host that keeps crashing.
pub const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// What a worker host is started for: the model (for logs and errors), the
/// plugin file the server found, and the model's restart counter.
#[derive(Clone)]
pub struct HostSpec {
    pub model: String,
    pub plugin: PathBuf,
    pub restarts: Counter,
    /// The most bytes one batch may take in the host's shared memory (the
    /// model's buffer limit, `--max-buffer-bytes-per-model`).
    pub max_batch_bytes: usize,
    /// The most private memory the host may map (`max_host_memory`); a host
    /// that fails a batch close to it is restarted (its memory is spent).
    pub max_memory: Option<usize>,
}

/// A worker instance in its own process (see the module documentation).
pub struct ProcessWorker {
    spec: HostSpec,
    params: Vec<Param>,
    /// What the first host said of the worker; every later one must say the same.
    info: Option<WorkerInfo>,
    /// The lifecycle a new host is brought back to: allocated for this batch
    /// size, and acquired.
    allocated: Option<usize>,
    acquired: bool,
    host: Option<Host>,
    /// Crashes (and failed restarts) since the last batch that succeeded.
    crashes: u32,
    out: Vec<u8>,
    reply: Vec<u8>,
    /// The answer to the running batch's model calls.
    calls: Vec<u8>,
}

impl ProcessWorker {
    /// An instance whose host starts at `init`.
    pub fn new(spec: HostSpec) -> ProcessWorker {
        ProcessWorker {
            spec,
            params: Vec::new(),
            info: None,
            allocated: None,
            acquired: false,
            host: None,
            crashes: 0,
            out: Vec::new(),
            reply: Vec::new(),
            calls: Vec::new(),
        }
    }

    /// Starts a host and runs `init` in it.
    fn start(&mut self) -> Result<WorkerInfo, String> {
        let host = spawn(&self.spec.model, self.spec.max_memory)?;
        host.arena.set_limit(self.spec.max_batch_bytes);
        self.host = Some(host);
        let mut w = Writer::start(&mut self.out, Call::Init as u8);
        w.str(&self.spec.plugin.to_string_lossy());
        w.params(&self.params);
        self.exchange("starting")?;
        let info = self.results().info().map_err(|e| e.to_string())?;
        match &self.info {
            Some(first) if *first != info => {
                Err("the restarted worker describes itself differently".to_owned())
            }
            _ => Ok(info),
        }
    }

    /// A call with no results; `fields` writes its arguments.
    fn simple(&mut self, call: Call, fields: impl FnOnce(&mut Writer<'_>)) -> Result<(), String> {
        if self.host.is_none() {
            return Err(format!(
                "the worker host of model `{}` is not running",
                self.spec.model
            ));
        }
        fields(&mut Writer::start(&mut self.out, call as u8));
        self.exchange(&format!("in {call:?}"))
    }

    /// The results of the last reply (past its `OK` byte).
    fn results(&self) -> Reader<'_> {
        Reader::new(self.reply.get(1..).unwrap_or_default())
    }

    /// Sends the message in `out` and reads the reply: `Ok` (its results are in
    /// `reply`, see [`ProcessWorker::results`]), the worker's error, or (the host
    /// died) the crash's description.
    fn exchange(&mut self, during: &str) -> Result<(), String> {
        let Some(host) = self.host.as_mut() else {
            return Err("no worker host".to_owned());
        };
        let mut sent = write_frame(&mut host.socket, &self.out)
            .and_then(|()| read_frame(&mut host.socket, &mut self.reply));
        // A batch's model calls come before its reply; each is answered here, on
        // the instance thread, as an in-process worker's would be.
        while sent.is_ok() && self.reply.first() == Some(&HOST_CALLS) {
            relay::serve(&host.arena, &self.reply[1..], &mut self.calls);
            sent = write_frame(&mut host.socket, &self.calls)
                .and_then(|()| read_frame(&mut host.socket, &mut self.reply));
        }
        if let Err(e) = sent {
            return Err(self.lost(during, None, Some(e)));
        }
        let mut r = Reader::new(&self.reply);
        match r.u8() {
            Ok(REPLY_OK) => Ok(()),
            Ok(_) => Err(r.str().unwrap_or("malformed error reply").to_owned()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Takes down what is left of a host that died (or closed its socket) and
    /// describes how it ended.
    fn lost(
        &mut self,
        during: &str,
        status: Option<ExitStatus>,
        error: Option<WireError>,
    ) -> String {
        self.crashes = self.crashes.saturating_add(1);
        let Some(mut host) = self.host.take() else {
            return "no worker host".to_owned();
        };
        let pid = host.child.id();
        let status = status.or_else(|| reap(&mut host.child, Duration::from_secs(2)));
        let how = match (status, error) {
            (Some(status), _) => describe(status),
            (None, Some(e)) => format!("its connection failed ({e})"),
            (None, None) => "it stopped answering".to_owned(),
        };
        let message = format!(
            "worker host of model `{}` (pid {pid}) crashed {during}: {how}; it is restarted",
            self.spec.model
        );
        spdlog::error!("{message}");
        message
    }

    /// Whether the host is running; one that died while idle is taken down here
    /// (and counted as a crash).
    fn alive(&mut self) -> bool {
        let exited = match self.host.as_mut().map(|h| h.child.try_wait()) {
            None => return false,
            Some(Ok(None)) => return true,
            Some(Ok(status)) => status,
            Some(Err(_)) => None,
        };
        self.lost("while idle", exited, None);
        false
    }

    /// Starts a new host after the backoff, brought back to the lifecycle stage
    /// the instance is in.
    fn restart(&mut self) -> Result<(), String> {
        let doublings = self.crashes.saturating_sub(1).min(16);
        let delay = BACKOFF_BASE
            .saturating_mul(1u32 << doublings)
            .min(BACKOFF_CAP);
        std::thread::sleep(delay);
        let restarted = self.start().and_then(|info| {
            self.info.get_or_insert(info);
            if let Some(batch_size) = self.allocated {
                self.simple(Call::Allocate, |w| w.usize(batch_size))?;
            }
            if self.acquired {
                self.simple(Call::Acquire, |_| {})?;
            }
            Ok(())
        });
        match restarted {
            Ok(()) => {
                self.spec.restarts.inc();
                spdlog::info!(
                    "worker host of model `{}` restarted (pid {}) after {} ms",
                    self.spec.model,
                    self.host.as_ref().map_or(0, |h| h.child.id()),
                    delay.as_millis()
                );
                Ok(())
            }
            Err(e) => {
                self.crashes = self.crashes.saturating_add(1);
                if let Some(mut host) = self.host.take() {
                    let _ = host.child.kill();
                    let _ = host.child.wait();
                }
                Err(format!(
                    "worker host of model `{}` cannot be restarted: {e}",
                    self.spec.model
                ))
            }
        }
    }

    fn run_batch(&mut self, batch: &mut BatchFfi<'_, '_>) -> Result<(), String> {
        if !self.alive() {
            // Died between batches: this batch was not in it, and runs in a new one.
            self.restart()?;
        }
        let Some(host) = self.host.as_ref() else {
            return Err("no worker host".to_owned());
        };
        let mut w = Writer::start(&mut self.out, Call::Run as u8);
        w.count(batch.inputs.len());
        let mut end = 0usize;
        for input in batch.inputs.iter() {
            let data = input.data.as_slice();
            let at = align(end);
            end = at + data.len();
            host.arena.ensure(end)?;
            // SAFETY: ensured above; the host reads the arena only during the
            // call, after this write.
            unsafe { host.arena.slice_mut(at, data.len()) }.copy_from_slice(data);
            w.usize(at);
            w.usize(data.len());
            w.shapes(input.shapes.as_slice());
        }
        w.usize(align(end));
        w.count(batch.requests.len());
        for request in batch.requests.iter() {
            w.params(request.params.as_slice());
        }
        self.exchange("running a batch")?;
        let mut r = Reader::new(self.reply.get(1..).unwrap_or_default());
        let bad = |e: WireError| e.to_string();
        let outputs = r.count(1).map_err(bad)?;
        if outputs != batch.outputs.len() {
            return Err(format!("the worker host answered {outputs} outputs"));
        }
        let Some(host) = self.host.as_ref() else {
            return Err("no worker host".to_owned());
        };
        let requests = batch.requests.len();
        let mut shapes = Vec::new();
        for output in batch.outputs.iter_mut() {
            let written = r.u8().map_err(bad)? != 0;
            let (offset, len) = (r.usize().map_err(bad)?, r.usize().map_err(bad)?);
            r.shapes_into(&mut shapes).map_err(bad)?;
            if !written {
                continue;
            }
            if shapes.len() != requests {
                return Err(format!("the worker host answered {} shapes", shapes.len()));
            }
            host.arena.check(offset, len)?;
            let mut target = output.buffer.resize(len).into_result()?;
            // SAFETY: checked above; the host wrote it before its reply and
            // writes nothing until the next call.
            target.copy_from_slice(unsafe { host.arena.slice(offset, len) });
            output.shapes.as_mut_slice().copy_from_slice(&shapes);
            output.len = len;
            output.written = true;
        }
        let failures = r.count(6).map_err(bad)?;
        for _ in 0..failures {
            let index = r.u32().map_err(bad)? as usize;
            let error = r.request_error().map_err(bad)?;
            let request = batch
                .requests
                .get_mut(index)
                .ok_or("the worker host failed a request the batch does not have")?;
            request.failure = ROption::RSome(error);
        }
        self.crashes = 0;
        Ok(())
    }

    /// Takes down a host whose private memory is within [`SPENT`] of its
    /// `max_host_memory` after a failed batch (a worker that leaks fails its
    /// allocations there, and would fail every batch after): the next batch
    /// starts a new one. Read only after a failure (one `/proc` read).
    fn restart_if_spent(&mut self) {
        let (Some(max), Some(host)) = (self.spec.max_memory, self.host.as_mut()) else {
            return;
        };
        let pid = host.child.id();
        let Some(used) = private_memory(pid) else {
            return;
        };
        if used < max / 100 * SPENT {
            return;
        }
        let _ = host.child.kill();
        let during = format!(
            "after a failed batch: it held {used} bytes of private memory, \
             max_host_memory is {max}"
        );
        // Logged there.
        let _ = self.lost(&during, None, None);
    }

    /// Ends the host: `destroy` in it, then it exits (or is killed).
    fn stop(&mut self) {
        if let Some(host) = self.host.as_mut() {
            let _ = host.socket.set_read_timeout(Some(Duration::from_secs(10)));
        }
        if self.host.is_some() {
            let _ = self.simple(Call::Destroy, |_| {});
        }
        if let Some(mut host) = self.host.take() {
            if reap(&mut host.child, Duration::from_secs(2)).is_none() {
                let _ = host.child.kill();
                let _ = host.child.wait();
            }
        }
    }
}

/// The share of `max_host_memory` (percent) past which a host that failed a
/// batch is restarted.
const SPENT: usize = 90;

/// What `RLIMIT_DATA` counts of process `pid` (`VmData`, bytes).
fn private_memory(pid: u32) -> Option<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmData:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn result<T>(r: Result<T, String>) -> RResult<T, RString> {
    r.map_err(RString::from).into()
}

impl WorkerFfi for ProcessWorker {
    fn init(&mut self, params: RSlice<'_, Param>) -> RResult<WorkerInfo, RString> {
        self.params = params.to_vec();
        let started = self.start().inspect(|info| self.info = Some(info.clone()));
        result(started)
    }

    fn allocate(&mut self, batch_size: usize) -> RResult<(), RString> {
        self.allocated = Some(batch_size);
        result(self.simple(Call::Allocate, |w| w.usize(batch_size)))
    }

    fn acquire(&mut self) -> RResult<(), RString> {
        self.acquired = true;
        let acquired = if self.alive() {
            self.simple(Call::Acquire, |_| {})
        } else {
            self.restart()
        };
        result(acquired)
    }

    fn run(&mut self, batch: &mut BatchFfi<'_, '_>) -> RResult<(), RString> {
        let ran = self.run_batch(batch);
        if ran.is_err() {
            self.restart_if_spent();
        }
        // A burst's large batches do not leave the host holding their memory.
        if let Some(host) = &self.host {
            if let Err(e) = host.arena.release_beyond(ARENA_KEEP) {
                spdlog::warn!(
                    "model `{}`: cannot release shared memory: {e}",
                    self.spec.model
                );
            }
        }
        result(ran)
    }

    fn release(&mut self) -> RResult<(), RString> {
        self.acquired = false;
        if !self.alive() {
            return RResult::ROk(());
        }
        result(self.simple(Call::Release, |_| {}))
    }

    fn deallocate(&mut self) -> RResult<(), RString> {
        self.allocated = None;
        if !self.alive() {
            return RResult::ROk(());
        }
        result(self.simple(Call::Deallocate, |_| {}))
    }

    fn destroy(&mut self) {
        self.stop();
    }

    /// The host process drives its plugin through `run` (an asynchronous
    /// plugin's `run` answers each batch with an error saying so).
    fn is_async(&self) -> bool {
        false
    }

    fn submit(&mut self, mut batch: BatchCompletionBox) -> RResult<(), RString> {
        let why = "asynchronous workers do not run in a worker host process";
        batch.complete(RResult::RErr(why.into()));
        RResult::RErr(why.into())
    }
}

impl Drop for ProcessWorker {
    fn drop(&mut self) {
        if let Some(mut host) = self.host.take() {
            let _ = host.child.kill();
            let _ = host.child.wait();
        }
    }
}
