//! A session's task, on the actix-web worker thread that took the upgrade: reads
//! the client's messages, keeps at most `max_inflight_frames` frames in the model
//! (`frame.rs`), queues the rest in a [`DropQueue`] (oldest dropped) and sends the
//! results in frame order through a second bounded queue that a writer task
//! drains into the socket (docs/websocket.md, "Flow control").

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_ws::{AggregatedMessage, AggregatedMessageStream, CloseReason, ProtocolError};
use bytes::Bytes;
use bytestring::ByteString;
use futures_util::stream::{FuturesOrdered, StreamExt};
use kiln_core::memory::client_bytes::{ClientBytes, Use};
use kiln_core::observe::stream_metrics::{DropReason, ModelStreamMetrics};

use super::frame::{self, Done, FrameContext, Incoming, Raw};
use super::held::{hold, Taken};
use super::protocol::{close, Closing, Open};
use super::queue::DropQueue;
use super::result::{self, Dropped, EncodeError, Message, Outgoing, ResultHead, ResultLimit};
use super::source::{self, FrameSource, SourceError, SourceInfo};
use super::{OpeningSlot, Streams};
use kiln_core::models::Served;
use kiln_core::server::Server;

/// The longest close reason a close frame carries (RFC 6455: 125 bytes of
/// payload, two of them the code).
const MAX_REASON: usize = 123;

/// Messages the writer lets wait in actix-ws' channel (of 32) at once: what a
/// client that stops reading can leave held, with the one in the connection's
/// write buffer, until it is shut out.
const AHEAD: u64 = 2;

/// How often a file source looks for room in the budget again.
const SOURCE_RETRY: Duration = Duration::from_millis(20);

/// A session's drop counts, shared with its source thread.
struct Drops {
    counts: [AtomicU64; DropReason::ALL.len()],
    metrics: ModelStreamMetrics,
}

impl Drops {
    fn count(&self, reason: DropReason) {
        self.counts[reason.index()].fetch_add(1, Ordering::Relaxed);
        self.metrics.dropped[reason.index()].inc();
    }

    fn totals(&self) -> Dropped {
        std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed))
    }
}

/// A session before its opening message.
pub(super) struct Session {
    server: Server,
    streams: Arc<Streams>,
    group: Served,
    /// Its own descriptor of the connection's socket, to shut a client that
    /// stopped reading out (`None`: not known; the session still ends).
    socket: Option<OwnedFd>,
}

type InFlight = FuturesOrdered<Pin<Box<dyn Future<Output = Done>>>>;

impl Session {
    pub(super) fn new(
        server: Server,
        streams: Arc<Streams>,
        group: Served,
        socket: Option<OwnedFd>,
    ) -> Session {
        Session {
            server,
            streams,
            group,
            socket,
        }
    }

    /// Runs the session to its end, closing the socket with the code it ended
    /// with. `opening` is its place among the upgrades not yet opened, given back
    /// once the opening message has come (or has not, in time).
    pub(super) async fn run(
        self,
        mut ws: actix_ws::Session,
        mut messages: AggregatedMessageStream,
        opening: OpeningSlot,
    ) {
        let wait = self.streams.config.open_timeout;
        let text = match tokio::time::timeout(wait, opening_message(&mut messages)).await {
            Ok(text) => text,
            Err(_) => Err(Closing::new(
                close::GOING_AWAY,
                "no opening message within --stream-open-timeout",
            )),
        };
        drop(opening);
        let opened = match text {
            Ok(text) => self.open(&text).await,
            Err(closing) => Err(closing),
        };
        let (open, source) = match opened {
            Ok(opened) => opened,
            Err(closing) => {
                let text = result::session_error(None, &closing.reason, closing.code);
                let _ = send(&mut ws, text).await;
                let _ = ws.close(Some(reason(&closing))).await;
                return;
            }
        };
        let metrics = self.server.stream_metrics(self.group.endpoint());
        metrics.opened.inc();
        metrics.sessions.inc();
        let closing = self.serve(&mut ws, messages, open, source, &metrics).await;
        metrics.sessions.dec();
        let _ = ws.close(Some(reason(&closing))).await;
    }

    /// Checks the opening message; opens a server-side source.
    async fn open(&self, text: &str) -> Result<(Open, Option<Box<dyn FrameSource>>), Closing> {
        let open = Open::parse(
            text,
            &self.group,
            || self.streams.key(),
            self.streams.config.max_inflight_frames,
        )?;
        let source = match &open.source {
            None => None,
            Some(spec) => {
                let (opener, spec) = (self.streams.config.sources.clone(), spec.clone());
                let opened = actix_web::web::block(move || source::open(opener.as_ref(), &spec))
                    .await
                    .map_err(|e| Closing::new(close::INTERNAL, e.to_string()))?;
                Some(opened.map_err(|e| match e {
                    SourceError::NotEnabled | SourceError::Refused(_) => {
                        Closing::new(close::POLICY, e.to_string())
                    }
                    SourceError::Failed(_) => Closing::new(close::INTERNAL, e.to_string()),
                })?)
            }
        };
        Ok((open, source))
    }

    /// The open session: frames in, results out, until it ends.
    async fn serve(
        self,
        ws: &mut actix_ws::Session,
        mut messages: AggregatedMessageStream,
        open: Open,
        source: Option<Box<dyn FrameSource>>,
        metrics: &ModelStreamMetrics,
    ) -> Closing {
        let open = Arc::new(open);
        let key = open.key.clone();
        let source_info = source.as_ref().map(|s| s.info());
        let hello = result::opened(
            &open,
            self.group.endpoint(),
            self.group.version(),
            source_info,
        );
        if send(ws, hello).await.is_err() {
            return Closing::new(close::NORMAL, "the client went away");
        }
        let limit = ResultLimit {
            max_bytes: self.streams.config.max_result_bytes,
            budget: Arc::clone(self.server.client_bytes()),
        };
        let ctx = Arc::new(FrameContext {
            batched: self.group.info().max_batch_size > 0,
            group: self.group.clone(),
            open: Arc::clone(&open),
            limit: limit.clone(),
        });
        let drops = Arc::new(Drops {
            counts: Default::default(),
            metrics: metrics.clone(),
        });
        let waiting: Arc<DropQueue<Incoming>> = Arc::new(DropQueue::new(open.max_inflight));
        let outgoing: Arc<DropQueue<Outgoing>> = Arc::new(DropQueue::new(open.max_inflight));
        let mut writer_ended: Option<bool> = None;
        let mut writer = actix_web::rt::spawn(write(
            ws.clone(),
            Arc::clone(&outgoing),
            self.streams.config.write_timeout,
        ));
        let from_source = source.is_some();
        let mut source_thread = match source
            .map(|s| read_source(s, Arc::clone(&waiting), Arc::clone(&drops), &limit.budget))
        {
            Some(Ok(thread)) => Some(thread),
            Some(Err(e)) => {
                return Closing::new(
                    close::INTERNAL,
                    format!("cannot start the source's thread: {e}"),
                )
            }
            None => None,
        };

        let mut inflight: InFlight = FuturesOrdered::new();
        let mut next_index: u64 = 0;
        let mut first_result = true;
        let mut source_ended = false;
        let idle = self.streams.config.idle_timeout;
        let deadline = tokio::time::sleep(idle);
        tokio::pin!(deadline);
        let closing = loop {
            let room = inflight.len() < open.max_inflight;
            tokio::select! {
                message = messages.recv() => {
                    deadline.as_mut().reset(tokio::time::Instant::now() + idle);
                    match message {
                        Some(Ok(AggregatedMessage::Binary(bytes))) if !from_source => {
                            metrics.frames.inc();
                            let index = next_index;
                            next_index += 1;
                            // Waiting frames hold their bytes of the budget too.
                            match limit.budget.reserve(Use::Body, bytes.len()) {
                                Ok(held) => {
                                    let frame = Incoming { index, arrived: Instant::now(), raw: Raw::Encoded(bytes, held) };
                                    if waiting.push(frame).is_some() {
                                        drops.count(DropReason::Overrun);
                                    }
                                }
                                Err(e) => {
                                    drops.count(DropReason::Memory);
                                    let error = format!("frame {index}: {e}");
                                    if outgoing.push(result::frame_error(&key, index, &error, &drops.totals()).into()).is_some() {
                                        drops.count(DropReason::SlowReader);
                                    }
                                }
                            }
                        }
                        Some(Ok(AggregatedMessage::Binary(_))) => break Closing::new(
                            close::UNSUPPORTED,
                            "this session's frames come from its server-side source: binary frames are not accepted",
                        ),
                        Some(Ok(AggregatedMessage::Text(_))) => break Closing::new(
                            close::UNSUPPORTED,
                            "the session is open: text messages are not accepted, frames are binary messages",
                        ),
                        Some(Ok(AggregatedMessage::Ping(data))) => {
                            let _ = ws.pong(&data).await;
                        }
                        Some(Ok(AggregatedMessage::Pong(_))) => {}
                        Some(Ok(AggregatedMessage::Close(_))) | None => {
                            break Closing::new(close::NORMAL, "closed by the client");
                        }
                        Some(Err(e)) => break protocol_error(e),
                    }
                }
                frame = waiting.pop(), if room && !source_ended => match frame {
                    Some(frame) => inflight.push_back(Box::pin(frame::run(Arc::clone(&ctx), frame))),
                    None => source_ended = true,
                },
                Some(done) = inflight.next() => {
                    deadline.as_mut().reset(tokio::time::Instant::now() + idle);
                    let message: Result<Outgoing, (String, Option<DropReason>)> = match done.outcome {
                        Ok(answered) => {
                            let latency = done.arrived.elapsed();
                            metrics.latency.observe(latency.as_secs_f64());
                            let source = if first_result {
                                first_result = false;
                                source_info.or(answered.size.map(|(width, height)| SourceInfo { width, height, fps: None }))
                            } else {
                                None
                            };
                            result::result_message(&ResultHead {
                                key: &key,
                                frame: done.index,
                                model_name: self.group.endpoint(),
                                model_version: self.group.version(),
                                source,
                                latency_ms: latency.as_secs_f64() * 1e3,
                                dropped: drops.totals(),
                                format: open.output_format,
                            }, answered.encoded, limit.max_bytes).map_err(|e| {
                                let dropped = matches!(e, EncodeError::Exhausted(_)).then_some(DropReason::Memory);
                                (format!("frame {}: {}", done.index, e.message(limit.max_bytes)), dropped)
                            })
                        }
                        Err(failed) => Err((failed.error, failed.dropped)),
                    };
                    let message = message.unwrap_or_else(|(error, dropped)| {
                        metrics.errors.inc();
                        if let Some(reason) = dropped {
                            drops.count(reason);
                        }
                        result::frame_error(&key, done.index, &error, &drops.totals()).into()
                    });
                    if outgoing.push(message).is_some() {
                        drops.count(DropReason::SlowReader);
                    }
                }
                written = &mut writer => {
                    let stalled = matches!(written, Ok(Written::Stalled));
                    writer_ended = Some(stalled);
                    break if stalled {
                        Closing::new(close::GOING_AWAY, "the client did not read its results within --stream-write-timeout")
                    } else {
                        Closing::new(close::NORMAL, "the client went away")
                    };
                }
                () = &mut deadline, if inflight.is_empty() && waiting.is_empty() => {
                    break Closing::new(close::GOING_AWAY, "idle timeout");
                }
            }
            if source_ended && inflight.is_empty() {
                // The source thread closed the queue: it has ended, or failed.
                let ended = match source_thread.take() {
                    Some(thread) => actix_web::web::block(move || thread.join()).await,
                    None => break Closing::new(close::INTERNAL, "a source without its thread"),
                };
                break match ended {
                    Ok(Ok(Ok(frames))) => {
                        let _ = outgoing.push(result::end(&key, frames, &drops.totals()).into());
                        Closing::new(close::NORMAL, "end of source")
                    }
                    Ok(Ok(Err(e))) => Closing::new(close::INTERNAL, e.to_string()),
                    _ => Closing::new(close::INTERNAL, "the source's thread failed"),
                };
            }
        };
        // Stop the source and the frames in flight (dropping their `Admitted`s
        // cancels what is still queued), then let the writer send what is left.
        waiting.close();
        drop(inflight);
        if let Some(thread) = source_thread {
            let _ = actix_web::web::block(move || thread.join()).await;
        }
        if closing.code != close::NORMAL {
            let _ = outgoing
                .push(result::session_error(Some(&key), &closing.reason, closing.code).into());
        }
        outgoing.close();
        // The writer gives up within the write timeout on a client that does
        // not read.
        let stalled = match writer_ended {
            Some(stalled) => stalled,
            None => matches!(writer.await, Ok(Written::Stalled)),
        };
        if stalled {
            self.shut_out();
        }
        closing
    }

    /// Shuts down the socket of a client that stopped reading: actix-web's
    /// writes to it fail, the connection ends, and the results waiting in
    /// actix-ws' channel and the connection's write buffer are freed (a client
    /// that never reads would otherwise hold them as long as its connection).
    fn shut_out(&self) {
        if let Some(socket) = &self.socket {
            // SAFETY: `shutdown` on a descriptor this session owns.
            unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

/// Waits for the opening text message.
async fn opening_message(
    messages: &mut AggregatedMessageStream,
) -> Result<bytestring::ByteString, Closing> {
    loop {
        match messages.recv().await {
            Some(Ok(AggregatedMessage::Text(text))) => return Ok(text),
            Some(Ok(AggregatedMessage::Binary(_))) => {
                return Err(Closing::new(
                    close::UNSUPPORTED,
                    "the first message must be the opening text message, not a binary frame",
                ))
            }
            Some(Ok(AggregatedMessage::Close(_))) | None => {
                return Err(Closing::new(close::NORMAL, "closed before opening"))
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Err(protocol_error(e)),
        }
    }
}

/// Reads `source` on a thread of its own into `waiting` (waiting for room, or for
/// a live source dropping the oldest frame) until it ends, fails or the session
/// closes the queue; closes the queue as it stops. Returns the frames read.
///
/// Each frame's pixels are reserved from `budget` before it is read. A file
/// waits for room (it is read no faster than the server can hold its frames); a
/// live source's frame is read and dropped (reason `memory`) when there is none,
/// so that the camera's stream does not back up.
fn read_source(
    mut source: Box<dyn FrameSource>,
    waiting: Arc<DropQueue<Incoming>>,
    drops: Arc<Drops>,
    budget: &Arc<ClientBytes>,
) -> std::io::Result<std::thread::JoinHandle<Result<u64, SourceError>>> {
    let budget = Arc::clone(budget);
    std::thread::Builder::new()
        .name("stream-source".into())
        .spawn(move || {
            let live = source.is_live();
            let info = source.info();
            let frame_bytes = info.width.saturating_mul(info.height).saturating_mul(3);
            let mut index = 0;
            let ended = loop {
                let held = loop {
                    match budget.reserve(Use::DecodedImage, frame_bytes) {
                        Ok(held) => break Some(held),
                        Err(_) if live => break None,
                        Err(_) if waiting.is_closed() => break None,
                        Err(_) => std::thread::sleep(SOURCE_RETRY),
                    }
                };
                let rgb = match source.next_frame() {
                    Ok(Some(rgb)) => rgb,
                    Ok(None) => break Ok(index),
                    Err(e) => break Err(e),
                };
                drops.metrics.frames.inc();
                let Some(mut held) = held else {
                    if waiting.is_closed() {
                        break Ok(index);
                    }
                    drops.count(DropReason::Memory);
                    index += 1;
                    continue;
                };
                // A source may change size midway (the reservation follows).
                if held.grow_to(rgb.pixels.len()).is_err() {
                    drops.count(DropReason::Memory);
                    index += 1;
                    continue;
                }
                held.shrink_to(rgb.pixels.len());
                let frame = Incoming {
                    index,
                    arrived: Instant::now(),
                    raw: Raw::Decoded(rgb, held),
                };
                index += 1;
                if live {
                    if waiting.push(frame).is_some() {
                        drops.count(DropReason::Overrun);
                    }
                } else if waiting.push_wait(frame).is_err() {
                    break Ok(index - 1);
                }
            };
            waiting.close();
            ended
        })
}

/// How the writer ended.
enum Written {
    /// The queue closed and everything in it was handed to actix-ws.
    Drained,
    /// The client is gone.
    Gone,
    /// The client read nothing for the write timeout.
    Stalled,
}

/// The writer: sends queued messages until the queue closes and is drained, the
/// client is gone, or it stops reading. At most [`AHEAD`] messages wait in
/// actix-ws' channel (it takes one when the connection's write buffer is nearly
/// empty, i.e. when the client reads); when none is taken for `timeout`, the
/// client has stopped reading.
async fn write(
    mut ws: actix_ws::Session,
    outgoing: Arc<DropQueue<Outgoing>>,
    timeout: Duration,
) -> Written {
    let taken = Arc::new(Taken::default());
    let mut handed: u64 = 0;
    let written = loop {
        let out = if handed > taken.count() {
            // A message still waits in the channel: the client must take it
            // within the timeout, even when nothing new comes to send.
            tokio::select! {
                out = outgoing.pop() => out,
                progress = tokio::time::timeout(timeout, taken.next()) => {
                    if progress.is_err() && handed > taken.count() {
                        break Written::Stalled;
                    }
                    continue;
                }
            }
        } else {
            outgoing.pop().await
        };
        let Some(out) = out else {
            break Written::Drained;
        };
        while handed - taken.count() >= AHEAD {
            if tokio::time::timeout(timeout, taken.next()).await.is_err() {
                break;
            }
        }
        if handed - taken.count() >= AHEAD {
            break Written::Stalled;
        }
        handed += 1;
        let sent = match out.message {
            Message::Text(text) => {
                let bytes = hold(Bytes::from(text), out.held, Some(Arc::clone(&taken)));
                match ByteString::try_from(bytes) {
                    Ok(text) => ws.text(text).await,
                    Err(_) => Ok(()),
                }
            }
            Message::Binary(bytes) => {
                ws.binary(hold(bytes, out.held, Some(Arc::clone(&taken))))
                    .await
            }
        };
        if sent.is_err() {
            break Written::Gone;
        }
    };
    outgoing.close();
    written
}

async fn send(ws: &mut actix_ws::Session, message: Message) -> Result<(), actix_ws::Closed> {
    match message {
        Message::Text(text) => ws.text(text).await,
        Message::Binary(bytes) => ws.binary(bytes).await,
    }
}

/// The close frame's code and reason (cut to what a close frame holds).
fn reason(closing: &Closing) -> CloseReason {
    let mut text = closing.reason.as_str();
    if text.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text = &text[..end];
    }
    CloseReason {
        code: closing.code.into(),
        description: Some(text.to_owned()),
    }
}

/// How a WebSocket protocol error closes the session.
fn protocol_error(e: ProtocolError) -> Closing {
    match e {
        ProtocolError::Overflow => Closing::new(
            close::TOO_BIG,
            "a message over the server's --stream-max-message-bytes",
        ),
        e => Closing::new(close::PROTOCOL, format!("WebSocket protocol error: {e}")),
    }
}
