//! A worker group: the endpoint clients address. It owns a bounded request queue,
//! its batching (hard and soft: `batchers` formers on which the instance threads
//! take turns forming their own batches; a plain dynamic batcher, one with nothing
//! to schedule, the same with one former; sequence: the instances take turns on
//! the sequence batcher, each forming batches of the sequences pinned to it; the
//! other dynamic batchers: a scheduler thread handing batches over), a pool of
//! buffer sets bounding the batches in flight, and one thread per worker instance.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use kiln_batchers::dynamic::{run_dynamic_batcher, Pulls};
use kiln_batchers::sequence::SequenceFormer;
use kiln_batchers::{Admission, Batch, BatchFormer, BatcherConfig, Request};
use kiln_buffers::{BufferSet, Pool};
use kiln_worker_sdk::{BatcherKind, WorkerBox, WorkerInfo};
use parking_lot::Mutex;

use crate::compute::async_instance::run_async_instance;
use crate::compute::instance::{run_instance, BatchSource, From, InstanceContext, Pulled};
use crate::error::{Result, ServerError};
use crate::group::sequence::{SequenceGroupHost, SequenceLink, SequenceModel};
use crate::load::limits::Demand;
use crate::observe::metrics::ModelMetrics;
use crate::observe::stats::ModelStats;
pub use crate::request::answer::Reply;

mod admit;
mod dynamic_host;
pub mod reshape;
mod scale;
pub mod sequence;
mod settings;

use dynamic_host::DynamicGroupHost;

use reshape::Reshape;
use settings::{batcher_threads, buffer_capacities};
pub use settings::{demand, pool_bytes, resolve, GroupSettings};

/// What names a group: its endpoint, the worker behind it, the identity of its
/// load-time parameters and the model version it serves.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupName {
    pub endpoint: String,
    pub worker: String,
    pub identity: String,
    pub version: String,
    /// The load-time parameters (new instances of a scale up are made with them).
    pub params: Vec<kiln_worker_sdk::Param>,
}

/// A group's load at one moment ([`WorkerGroup::load`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupLoad {
    /// Requests accepted and in a batch (being run, or formed and waiting for an
    /// instance).
    pub in_batches: u64,
    /// Requests accepted and not yet in a batch.
    pub queued: u64,
    /// Requests it runs at once: its healthy instances × `batch_size` (× an
    /// asynchronous worker's `max_outstanding`), at most its `queue_size`. The
    /// jobs dispatcher's `max_sys`: one batch per instance, so jobs in flight
    /// never stand more than about one batch ahead of a realtime request.
    pub capacity: u64,
}

/// A loaded endpoint.
pub struct WorkerGroup {
    pub endpoint: String,
    pub worker: String,
    /// The model as clients see it (a stateful model's control and state tensors,
    /// which the server fills and keeps, are not part of it).
    pub info: Arc<WorkerInfo>,
    /// The worker's own description.
    pub worker_info: Arc<WorkerInfo>,
    pub settings: GroupSettings,
    /// The load-time parameters' identity (see [`crate::params::identity`]).
    pub identity: String,
    /// The model version served ("1" for workers loaded directly).
    pub version: String,
    /// The load-time parameters, as given (see [`GroupName::params`]).
    pub params: Vec<kiln_worker_sdk::Param>,
    queue: ArcSwapOption<Sender<Request<Reply>>>,
    /// The group that took this one's name when a reload replaced it: a request
    /// that found this group in the snapshot just before the swap goes there, so a
    /// reload under load fails no request ([`WorkerGroup::submit`]).
    successor: ArcSwapOption<WorkerGroup>,
    /// `queue_size`: the bound on requests accepted and not yet in a batch, wherever
    /// they wait (the channel, a batcher's own queues, a batcher's hands).
    admission: Arc<Admission>,
    batches: Receiver<Batch<Reply>>,
    /// Dynamic: the instances' asks for a batch (the batcher forms one per ask).
    pulls: Option<Arc<Pulls>>,
    /// Hard and soft: the `batchers` formers the instances take turns on (empty for
    /// dynamic and sequence, whose scheduler thread fills `batches`).
    formers: Vec<Arc<BatchFormer<Reply>>>,
    pool: Arc<Pool<BufferSet>>,
    context: Arc<InstanceContext>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The instance count, the pool's memory, and the channel that tells instances
    /// to leave ([`scale`]).
    scaling: scale::Scaling,
    sequence: Option<SequenceRuntime>,
    /// The worker's declared request parameters, checked at admission.
    request_params: crate::params::RequestRules,
    /// The model's shapes of reshaped inputs ([`reshape`]).
    reshape: Arc<Reshape>,
    /// When the gauges were last refreshed and the instances' busy time then
    /// (`kiln_instance_busy_*`).
    last_scrape: Mutex<(Instant, u64)>,
}

/// A stateful group's link to its sequence batcher.
struct SequenceRuntime {
    model: SequenceModel,
    /// The sequence batcher its instances take turns on.
    former: Arc<SequenceFormer<Reply>>,
    /// Whether requests carry a batch dimension.
    batched: bool,
}

impl WorkerGroup {
    /// Starts a group around initialized worker instances (all of one plugin, all
    /// with the same `info`); `request_params` are the worker's declared request
    /// parameters.
    pub fn start(
        name: GroupName,
        info: WorkerInfo,
        settings: GroupSettings,
        instances: Vec<WorkerBox>,
        metrics: ModelMetrics,
        request_params: crate::params::RequestRules,
    ) -> Result<Arc<WorkerGroup>> {
        let GroupName {
            endpoint,
            worker,
            identity,
            version,
            params,
        } = name;
        let sequence_model = match settings.batcher {
            BatcherKind::Sequence => Some(SequenceModel::new(&info, &settings.sequence)?),
            _ => None,
        };
        let client_info = sequence_model
            .as_ref()
            .map_or_else(|| info.clone(), |m| m.client_info.clone());
        // Triton's `dims` and `reshape`: what clients see, and the shapes changed
        // where tensors enter and leave the group.
        let (client_info, reshape) = settings
            .shapes
            .client_view(&client_info, &info)
            .map_err(|e| ServerError::invalid(format!("model `{endpoint}`: {e}")))?;
        let client_info = Arc::new(client_info);
        let reshape = Arc::new(reshape);
        let info = Arc::new(info);
        // The channel never fills: `admission` refuses first (it also counts what
        // the batchers took out and hold).
        let (queue_tx, queue_rx) = bounded::<Request<Reply>>(settings.queue_size);
        let (batch_tx, batch_rx) = unbounded::<Batch<Reply>>();
        let (input_caps, output_caps) = buffer_capacities(&info, settings.batch_size);
        // An asynchronous group's pool notes its high-water mark (the bound on
        // batches out is the point of its tests); a synchronous one's hot path
        // does not pay for it.
        let make = || BufferSet::with_capacities(&input_caps, &output_caps);
        let pool = Pool::resizable(
            settings.max_buffers,
            settings.buffer_capacity,
            settings.max_outstanding.is_some(),
            make,
        );
        metrics.pool_size.set(settings.max_buffers as i64);
        let metrics = Arc::new(metrics);
        // A stateful group's instances take turns on its sequence batcher.
        let sequence = sequence_model.map(|model| {
            let config = model.config(
                &settings.sequence,
                &settings.dynamic,
                settings.batch_size,
                instances.len(),
                settings.queue_size,
            );
            let host = SequenceGroupHost::new(&config, &endpoint, Arc::clone(&metrics));
            let (inputs, pool) = (info.inputs.len(), Arc::clone(&pool));
            let former =
                SequenceFormer::new(config, inputs, queue_rx.clone(), pool, Box::new(host));
            (model, Arc::new(former))
        });
        let context = Arc::new(InstanceContext {
            outstanding: settings
                .max_outstanding
                .map(crate::compute::outstanding::Outstanding::new),
            ordering: (settings.batcher == BatcherKind::Dynamic
                && settings.dynamic.preserve_ordering)
                .then(crate::request::ordering::OrderGate::default),
            sequence: sequence.as_ref().map(|(m, former)| SequenceLink {
                former: Arc::clone(former),
                state_outputs: m.state_outputs.clone(),
                state_bytes: m.state_bytes.clone(),
            }),
            ..context_of(&endpoint, &version, &info, &reshape, metrics)
        });
        let config = BatcherConfig {
            kind: settings.batcher,
            batch_size: settings.batch_size,
            timeout: settings.timeout,
            gather: settings.gather,
            allow_ragged: info.allow_ragged_batch,
            inputs: info.inputs.len(),
        };
        let mut threads = Vec::new();
        let mut formers = Vec::new();
        let mut pulls = None;
        if sequence.is_some() {
            // No thread, no former: the instances take turns on the sequence
            // batcher (above).
        } else if settings.batcher == BatcherKind::Dynamic && settings.dynamic.is_plain() {
            // Nothing needs a scheduler: one former, on which the instances take
            // turns, batching what is queued (no gathering: the delay is 0) and
            // leaving out requests whose client went away.
            let host = DynamicGroupHost {
                ctx: Arc::clone(&context),
                policies: settings.dynamic.policies.clone(),
                levels: settings.dynamic.priority_levels,
            };
            let config = BatcherConfig {
                timeout: Duration::ZERO,
                gather: false,
                ..config
            };
            let dynamic = settings.dynamic.clone();
            let former = BatchFormer::new(config, queue_rx.clone(), Arc::clone(&pool))
                .with_screen(Box::new(move |request| host.screen(&dynamic, request)));
            formers = vec![Arc::new(former)];
        } else if settings.batcher == BatcherKind::Dynamic {
            // One scheduler: the queue's order and priorities are one thread's.
            let dynamic = settings.dynamic.clone();
            let host = DynamicGroupHost {
                ctx: Arc::clone(&context),
                policies: dynamic.policies.clone(),
                levels: dynamic.priority_levels,
            };
            let (rx, tx, pool) = (queue_rx.clone(), batch_tx.clone(), Arc::clone(&pool));
            let asks = Arc::<Pulls>::default();
            pulls = Some(Arc::clone(&asks));
            let inputs = info.inputs.len();
            threads.push(spawn(format!("dynamic-{endpoint}"), move || {
                run_dynamic_batcher(dynamic, inputs, rx, pool, (tx, asks), host)
            })?);
        } else {
            // No batcher thread: the instances form their own batches (BatchFormer).
            formers = (0..settings.batchers.max(1))
                .map(|_| {
                    Arc::new(BatchFormer::new(
                        config,
                        queue_rx.clone(),
                        Arc::clone(&pool),
                    ))
                })
                .collect();
        }
        let admission = Admission::new(settings.queue_size);
        let pool_bytes = pool_bytes(&info, &settings);
        let group = Arc::new(WorkerGroup {
            endpoint,
            worker,
            info: client_info,
            worker_info: info,
            settings,
            identity,
            version,
            params,
            queue: ArcSwapOption::from_pointee(queue_tx),
            successor: ArcSwapOption::empty(),
            admission,
            batches: batch_rx,
            pulls,
            formers,
            pool,
            context,
            threads: Mutex::new(threads),
            scaling: scale::Scaling::new(pool_bytes),
            sequence: sequence.map(|(model, former)| SequenceRuntime {
                batched: model.layout.batched,
                model,
                former,
            }),
            request_params,
            reshape,
            last_scrape: Mutex::new((Instant::now(), 0)),
        });
        let mut pending = instances.into_iter();
        while let Some(instance) = pending.next() {
            if let Err(e) = group.add_instance(instance) {
                // Nothing remains: the instances not started end here, the started
                // ones with the group's threads.
                pending.for_each(end_lifecycle);
                group.drain();
                return Err(e);
            }
        }
        Ok(group)
    }

    /// The statistics and metrics the group's requests are counted in.
    pub(crate) fn counters(&self) -> (&Arc<ModelStats>, &Arc<ModelMetrics>) {
        (&self.context.stats, &self.context.metrics)
    }

    /// Starts one more worker instance on this group's batch queue. If its thread
    /// cannot be started, nothing of it remains: it is not counted, a stateful group's
    /// batcher never hears of it, and the instance's lifecycle is ended.
    pub fn add_instance(&self, worker: WorkerBox) -> Result<()> {
        // A stateful group's instances each get their own batches (sequences are
        // pinned to one instance); the others share the group's batch queue.
        let n = self.scaling.started.fetch_add(1, Ordering::SeqCst);
        let (rx, index) = match &self.sequence {
            Some(seq) => {
                let turn = seq.former.join();
                let index = turn.index;
                let from = From::Sequence {
                    former: Arc::clone(&seq.former),
                    turn,
                };
                (BatchSource { from, leave: None }, index)
            }
            None => {
                // Instance `n` takes its turns on former `n % batchers`.
                let from = match self.formers.get(n % self.formers.len().max(1)) {
                    Some(former) => From::Former(Arc::clone(former)),
                    None => match &self.pulls {
                        Some(pulls) => {
                            From::Pulled(Pulled::new(self.batches.clone(), Arc::clone(pulls)))
                        }
                        None => From::Queue(self.batches.clone()),
                    },
                };
                let leave = Some(self.scaling.leave_rx.clone());
                (BatchSource { from, leave }, 0)
            }
        };
        let ctx = Arc::clone(&self.context);
        // The thread takes the instance from this slot; if it never starts, the
        // instance is still here to be taken down.
        let slot = Arc::new(Mutex::new(Some(worker)));
        let theirs = Arc::clone(&slot);
        // Counted before its thread runs, so a request arriving as the load returns
        // finds it; taken back if the thread cannot start.
        self.context.healthy.fetch_add(1, Ordering::SeqCst);
        let spawned = spawn(format!("worker-{}-{n}", self.endpoint), move || {
            let worker = theirs.lock().take();
            match worker {
                Some(worker) if ctx.outstanding.is_some() => run_async_instance(worker, ctx, rx),
                Some(worker) => run_instance(worker, ctx, rx, index),
                None => {}
            }
        });
        let handle = match spawned {
            Ok(handle) => handle,
            Err(e) => {
                self.context.healthy.fetch_sub(1, Ordering::SeqCst);
                let worker = slot.lock().take();
                if let Some(worker) = worker {
                    end_lifecycle(worker);
                }
                return Err(e);
            }
        };
        self.threads.lock().push(handle);
        self.scaling.instances.fetch_add(1, Ordering::SeqCst);
        self.context
            .metrics
            .instances
            .set(self.context.healthy.load(Ordering::SeqCst) as i64);
        Ok(())
    }

    /// The group's load now: requests in batches, waiting, and how many it can
    /// have in batches at once (a few atomic loads; the jobs dispatcher reads it).
    pub fn load(&self) -> GroupLoad {
        let pending = self.context.metrics.pending.get().max(0) as u64;
        let queued = self.admission.queued() as u64;
        GroupLoad {
            in_batches: pending.saturating_sub(queued),
            queued,
            capacity: (self.context.healthy.load(Ordering::Relaxed)
                * self.settings.batch_size
                * self.settings.max_outstanding.unwrap_or(1))
            .min(self.settings.queue_size) as u64,
        }
    }

    /// Sequences open in a stateful group (0 for the others): a server that stops
    /// waits for them ([`crate::Server::is_idle`]).
    pub fn live_sequences(&self) -> u64 {
        self.context.metrics.sequences.get().max(0) as u64
    }

    /// The lowest priority level this group's batcher has (the dynamic batcher's
    /// `priority_levels`; 1 for the others, which have one level).
    pub fn lowest_priority(&self) -> u32 {
        match self.settings.batcher {
            BatcherKind::Dynamic => self.settings.dynamic.priority_levels.max(1) as u32,
            _ => 1,
        }
    }

    /// Lets the group's workers call the models of `models` (before it is
    /// published).
    pub(crate) fn connect_calls(&self, callees: Arc<dyn crate::compute::calls::Callees>) {
        self.context.caller.connect(callees);
    }

    /// Whether the group's workers call models (then it may not be called).
    pub fn is_caller(&self) -> bool {
        self.context.caller.is_caller()
    }

    fn gone(&self) -> ServerError {
        ServerError::NotFound(format!("model `{}` is unloading", self.endpoint))
    }

    /// Whether some instance can run batches.
    pub fn is_ready(&self) -> bool {
        self.queue.load().is_some() && self.context.healthy.load(Ordering::SeqCst) > 0
    }

    /// Worker instances running (those told to leave by a scale down not counted).
    pub fn instance_count(&self) -> usize {
        self.scaling.instances.load(Ordering::SeqCst)
    }

    /// What this group takes of the machine (for the server-wide limits).
    pub fn demand(&self) -> Demand {
        Demand {
            instances: self.instance_count(),
            // A hard or soft group's formers count as its batcher threads.
            batcher_threads: batcher_threads(&self.settings),
            buffer_bytes: self.scaling.pool_bytes.load(Ordering::SeqCst),
        }
    }

    /// Refreshes gauges that are read rather than counted (at each scrape: the hot
    /// path keeps no counter of its own for them).
    pub fn refresh_gauges(&self) {
        let m = &self.context.metrics;
        let in_use = self.pool.in_use();
        m.pool_in_use.set(in_use as i64);
        m.pool_in_use_max.set(self.pool.high_water() as i64);
        m.pool_free
            .set(self.pool.size().saturating_sub(in_use) as i64);
        m.queue_depth.set(self.admission.queued() as i64);
        m.capacity.set(self.load().capacity as i64);
        let instances = self.context.healthy.load(Ordering::SeqCst);
        m.instances.set(instances as i64);
        // Read under the lock: concurrent scrapes each count a part once.
        let mut last = self.last_scrape.lock();
        let busy_ns = self.context.busy_ns.load(Ordering::Relaxed);
        let (when, then_busy_ns) = *last;
        let now = Instant::now();
        let busy = busy_ns.saturating_sub(then_busy_ns);
        m.busy_seconds.inc_by(busy as f64 / 1e9);
        let capacity = now.duration_since(when).as_secs_f64() * instances.max(1) as f64;
        if capacity > 0.0 {
            m.busy_fraction
                .set((busy as f64 / 1e9 / capacity).clamp(0.0, 1.0));
        }
        *last = (now, busy_ns);
    }

    /// Names `next` as the group that replaced this one (before this one drains):
    /// requests that reach this group after it stopped taking them go there.
    pub fn replaced_by(&self, next: &Arc<WorkerGroup>) {
        self.successor.store(Some(Arc::clone(next)));
    }

    /// Refuses new requests, answers every accepted one, then stops the threads and
    /// ends every instance's lifecycle. Returns when all is done.
    pub fn drain(&self) {
        // Dropping the last sender lets the batchers drain the queue and exit; the
        // worker threads then drain the batch queue and exit (hard and soft: the
        // instances form batches until the request queue is drained, then exit).
        self.queue.store(None);
        let threads = std::mem::take(&mut *self.threads.lock());
        for handle in threads {
            if handle.join().is_err() {
                spdlog::error!("a thread of `{}` panicked", self.endpoint);
            }
        }
    }
}

/// Ends the lifecycle of an acquired instance that never ran.
fn end_lifecycle(mut worker: WorkerBox) {
    let _ = worker.release();
    let _ = worker.deallocate();
    worker.destroy();
}

/// A group's shared context: no outstanding bound, order gate or sequence link; a
/// caller of models not yet connected.
fn context_of(
    endpoint: &str,
    version: &str,
    info: &Arc<WorkerInfo>,
    reshape: &Arc<Reshape>,
    metrics: Arc<ModelMetrics>,
) -> InstanceContext {
    InstanceContext {
        answer_model: Arc::new(crate::request::answer::AnswerModel {
            name: endpoint.to_owned(),
            version: version.to_owned(),
            info: Arc::clone(info),
            reshape: Arc::clone(reshape),
        }),
        endpoint: endpoint.to_owned(),
        version: version.to_owned(),
        info: Arc::clone(info),
        metrics,
        stats: Arc::default(),
        healthy: AtomicUsize::new(0),
        busy_ns: std::sync::atomic::AtomicU64::new(0),
        compute_estimate_ns: std::sync::atomic::AtomicU64::new(0),
        outstanding: None,
        ordering: None,
        sequence: None,
        caller: crate::compute::calls::Caller::new(endpoint),
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(|e| ServerError::Internal(format!("cannot start a thread: {e}")))
}
