//! `kiln worker-host`: the process a worker group with `isolation = "process"`
//! runs its plugin in. It loads the plugin the server names (the server found it
//! in the operator's plugin directories), then answers the server's calls one at
//! a time: each lifecycle step of its one worker instance, and each batch, whose
//! inputs it reads from the shared arena and whose outputs the worker writes
//! straight into it; a batch's model calls go to the server ([`super::relay`]).
//! It exits when the server closes the socket or dies.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use kiln_worker_sdk::reexports::{RResult, RSliceMut, RStr, RString};
use kiln_worker_sdk::{
    BatchFfi, InputFfi, LogSink, OutputBuffer, OutputFfi, Param, RequestError, RequestFfi, Shape,
    WorkerBox, WorkerInfo,
};

use super::arena::{align, Arena};
use super::wire::{read_frame, write_frame, Call, Reader, WireError, Writer, REPLY_ERR, REPLY_OK};

/// Runs the host on the control socket and arena descriptors it inherited;
/// returns when the server is gone or has destroyed the worker.
pub fn run(control_fd: RawFd, arena_fd: RawFd) -> Result<(), String> {
    // SAFETY: the server passed these descriptors, open, for this process to own.
    let (socket, arena) = unsafe {
        (
            OwnedFd::from_raw_fd(control_fd),
            OwnedFd::from_raw_fd(arena_fd),
        )
    };
    let mut socket = UnixStream::from(socket);
    let arena = Arena::open(arena).map_err(|e| format!("worker host: arena: {e}"))?;
    let mut host = Host {
        arena,
        worker: None,
        info: None,
        scratch: Scratch::default(),
    };
    let (mut body, mut reply) = (Vec::new(), Vec::new());
    loop {
        match read_frame(&mut socket, &mut body) {
            Ok(()) => {}
            Err(WireError::Closed) => return Ok(()),
            Err(e) => return Err(format!("worker host: {e}")),
        }
        let mut r = Reader::new(&body);
        let call = r.call().map_err(|e| format!("worker host: {e}"))?;
        match host.serve(call, &mut r, &socket, &mut reply) {
            Ok(()) => {}
            Err(message) => {
                Writer::start(&mut reply, REPLY_ERR).str(&message);
            }
        }
        write_frame(&mut socket, &reply).map_err(|e| format!("worker host: {e}"))?;
        socket.flush().map_err(|e| format!("worker host: {e}"))?;
        if call == Call::Destroy {
            return Ok(());
        }
    }
}

/// Buffers reused from batch to batch.
#[derive(Default)]
struct Scratch {
    shapes: Vec<Vec<Shape>>,
    spans: Vec<(usize, usize)>,
    params: Vec<Vec<Param>>,
    out_shapes: Vec<Vec<Shape>>,
}

struct Host {
    arena: Arena,
    worker: Option<WorkerBox>,
    info: Option<WorkerInfo>,
    scratch: Scratch,
}

impl Host {
    /// Serves one call, writing its successful reply into `reply`.
    fn serve(
        &mut self,
        call: Call,
        r: &mut Reader<'_>,
        socket: &UnixStream,
        reply: &mut Vec<u8>,
    ) -> Result<(), String> {
        if call == Call::Init {
            let plugin = r.str().map_err(|e| e.to_string())?;
            let mut params = Vec::new();
            r.params_into(&mut params).map_err(|e| e.to_string())?;
            let mut worker = load(Path::new(plugin))?;
            let info = worker.init(params.as_slice().into()).into_result()?;
            if worker.is_async() {
                // Its batches complete on its own threads, after `submit` returns:
                // the host's request/reply exchange has no way to carry that.
                worker.destroy();
                return Err("an asynchronous worker cannot run in a worker host \
                            (isolation = \"process\"); load it with isolation = \"none\""
                    .to_owned());
            }
            Writer::start(reply, REPLY_OK).info(&info);
            self.worker = Some(worker);
            self.info = Some(info);
            return Ok(());
        }
        let worker = self
            .worker
            .as_mut()
            .ok_or_else(|| format!("{call:?} before init"))?;
        let done = match call {
            Call::Init => unreachable!("handled above"),
            Call::Allocate => {
                let batch_size = r.usize().map_err(|e| e.to_string())?;
                worker.allocate(batch_size)
            }
            Call::Acquire => worker.acquire(),
            Call::Release => worker.release(),
            Call::Deallocate => worker.deallocate(),
            Call::Destroy => {
                if let Some(mut worker) = self.worker.take() {
                    worker.destroy();
                }
                RResult::ROk(())
            }
            Call::Run => {
                let info = self.info.as_ref().ok_or("run before init")?;
                let arena = &self.arena;
                return run_batch(worker, info, arena, socket, &mut self.scratch, r, reply);
            }
        };
        done.into_result()?;
        Writer::start(reply, REPLY_OK);
        Ok(())
    }
}

/// Loads the plugin at `path` and makes one uninitialized worker of it, its log
/// going to this process's stderr (which the server reads into its log).
fn load(path: &Path) -> Result<WorkerBox, String> {
    let module = crate::load::plugin::open_plugin(path).map_err(|e| e.to_string())?;
    (module.set_logger())(LogSink { log: log_line });
    // Its model calls go to the server over the control socket.
    (module.set_caller())(super::relay::host_call_sink());
    Ok((module.new_worker())())
}

/// A plugin's log record as a line on stderr: `kiln-log <level> [<target>] <message>`
/// (`super::process` parses it back into the server's log at that level).
extern "C" fn log_line(level: u8, target: RStr<'_>, message: RStr<'_>) {
    let mut err = std::io::stderr().lock();
    for line in message.as_str().lines() {
        let _ = writeln!(err, "kiln-log {level} [plugin {}] {line}", target.as_str());
    }
}

/// An output the worker sizes: a range of the arena placed after everything
/// placed so far (`next`); growing it places it anew (contents need not move:
/// they are unspecified after a resize).
struct ArenaOutput<'a> {
    arena: &'a Arena,
    next: &'a std::cell::Cell<usize>,
    offset: usize,
    capacity: usize,
}

impl OutputBuffer for ArenaOutput<'_> {
    fn resize(&mut self, len: usize) -> RResult<RSliceMut<'_, u8>, RString> {
        if len > self.capacity {
            let offset = align(self.next.get());
            let end = match offset.checked_add(len) {
                Some(end) => end,
                None => return RResult::RErr(format!("cannot allocate {len} bytes").into()),
            };
            if let Err(e) = self.arena.ensure(end) {
                return RResult::RErr(format!("cannot allocate {len} bytes: {e}").into());
            }
            self.next.set(end);
            self.offset = offset;
            self.capacity = len;
        }
        // SAFETY: ensured above; this output's range is disjoint from every other
        // placed range, and the server reads it only after the reply.
        RResult::ROk(unsafe { self.arena.slice_mut(self.offset, len) }.into())
    }
}

/// Runs one batch: inputs from the arena as the server placed them, outputs
/// written into it; the reply names where each output is, its shapes, and the
/// requests the worker failed alone.
fn run_batch(
    worker: &mut WorkerBox,
    info: &WorkerInfo,
    arena: &Arena,
    socket: &UnixStream,
    s: &mut Scratch,
    r: &mut Reader<'_>,
    reply: &mut Vec<u8>,
) -> Result<(), String> {
    let bad = |e: WireError| e.to_string();
    let inputs = r.count(9).map_err(bad)?;
    if inputs != info.inputs.len() {
        return Err(format!(
            "{inputs} inputs sent, the worker has {}",
            info.inputs.len()
        ));
    }
    s.shapes.resize_with(inputs, Vec::new);
    s.spans.clear();
    for shapes in &mut s.shapes {
        let (offset, len) = (r.usize().map_err(bad)?, r.usize().map_err(bad)?);
        arena.check(offset, len)?;
        s.spans.push((offset, len));
        r.shapes_into(shapes).map_err(bad)?;
    }
    let out_start = r.usize().map_err(bad)?;
    let requests = r.count(4).map_err(bad)?;
    s.params.resize_with(requests, Vec::new);
    for params in &mut s.params[..requests] {
        r.params_into(params).map_err(bad)?;
    }
    let ffi_inputs: Vec<InputFfi<'_>> = info
        .inputs
        .iter()
        .zip(&s.spans)
        .zip(&s.shapes)
        .map(|((spec, &(offset, len)), shapes)| InputFfi {
            name: RStr::from_str(spec.name.as_str()),
            dtype: spec.dtype,
            // SAFETY: checked above; the server does not write the arena while
            // the batch runs.
            data: unsafe { arena.slice(offset, len) }.into(),
            shapes: shapes.as_slice().into(),
        })
        .collect();
    let next = std::cell::Cell::new(out_start);
    let mut buffers: Vec<ArenaOutput<'_>> = info
        .outputs
        .iter()
        .map(|_| ArenaOutput {
            arena,
            next: &next,
            offset: 0,
            capacity: 0,
        })
        .collect();
    s.out_shapes.resize_with(info.outputs.len(), Vec::new);
    for shapes in &mut s.out_shapes {
        shapes.clear();
        shapes.resize(requests, Shape::scalar());
    }
    let mut outputs: Vec<OutputFfi<'_>> = info
        .outputs
        .iter()
        .zip(buffers.iter_mut())
        .zip(s.out_shapes.iter_mut())
        .map(|((spec, buffer), shapes)| OutputFfi::new(spec, shapes, buffer))
        .collect();
    let mut ffi_requests: Vec<RequestFfi<'_>> = s.params[..requests]
        .iter()
        .map(|p| RequestFfi::new(p))
        .collect();
    let mut batch = BatchFfi {
        inputs: ffi_inputs.as_slice().into(),
        outputs: outputs.as_mut_slice().into(),
        requests: ffi_requests.as_mut_slice().into(),
    };
    // The worker's model calls place their inputs after what it placed so far.
    let calls = super::relay::open(socket, arena, &next);
    let ran = worker.run(&mut batch).into_result();
    drop(calls);
    ran?;
    let written: Vec<(bool, usize)> = outputs.iter().map(|o| (o.written, o.len)).collect();
    let failures: Vec<(usize, RequestError)> = ffi_requests
        .into_iter()
        .enumerate()
        .filter_map(|(j, r)| r.failure.into_option().map(|e| (j, e)))
        .collect();
    drop(outputs);
    let mut w = Writer::start(reply, REPLY_OK);
    w.count(written.len());
    for ((was_written, len), (buffer, shapes)) in
        written.into_iter().zip(buffers.iter().zip(&s.out_shapes))
    {
        w.u8(u8::from(was_written));
        w.usize(buffer.offset);
        w.usize(len.min(buffer.capacity));
        w.shapes(shapes);
    }
    w.count(failures.len());
    for (j, error) in &failures {
        w.u32(*j as u32);
        w.request_error(error);
    }
    Ok(())
}
