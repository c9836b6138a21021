//! The life of one gRPC connection: the cap on open connections, the handshake
//! and idle timeouts.
//!
//! - **Cap** ([`Slots`]): each open connection holds a [`Slot`]; past
//!   `max_connections` a new connection is accepted and closed at once (the client
//!   sees the connection closed, `UNAVAILABLE`), so it costs no descriptor for
//!   longer than that and the clients already connected keep theirs.
//! - **Handshake**: the client's HTTP/2 preface (after the TLS handshake, when
//!   there is one) must arrive within `handshake_timeout` of the accept, else the
//!   connection is dropped.
//! - **Idle**: a connection with no call open, on which no call ended since the
//!   previous check, is shut down gracefully (`GOAWAY`); checks run every
//!   `idle_timeout`, so an idle connection is closed between one and two idle
//!   timeouts after its last call. A client that does not complete the graceful
//!   close within `handshake_timeout` is dropped.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The bytes of the client's HTTP/2 connection preface (`PRI * HTTP/2.0…`).
const PREFACE_LEN: usize = 24;

/// The cap on the open connections of one port, shared by its serving threads.
pub(super) struct Slots {
    open: AtomicUsize,
    max: usize,
    /// When a refusal was last logged: at most one warning every 10 s.
    warned: Mutex<Option<Instant>>,
}

/// One open connection's place under the cap; given back on drop.
pub(super) struct Slot(Arc<Slots>);

impl Slots {
    pub(super) fn new(max: usize) -> Arc<Slots> {
        Arc::new(Slots {
            open: AtomicUsize::new(0),
            max: max.max(1),
            warned: Mutex::new(None),
        })
    }

    /// A place for a new connection, or `None` (logged) when `max` are open.
    pub(super) fn take(self: &Arc<Self>) -> Option<Slot> {
        if self.open.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.open.fetch_sub(1, Ordering::Relaxed);
            let mut warned = self.warned.lock();
            if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                *warned = Some(Instant::now());
                spdlog::warn!(
                    "gRPC: {} connections open (--grpc-max-connections): refusing new ones",
                    self.max
                );
            }
            return None;
        }
        Some(Slot(Arc::clone(self)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the timers of one connection watch: whether the client greeted, and its
/// calls. Each call costs two uncontended atomic additions on the connection's
/// own thread (start, end), and the `Arc` clone its [`Call`] holds.
#[derive(Default)]
pub(crate) struct Activity {
    greeted: AtomicBool,
    started: AtomicUsize,
    ended: AtomicUsize,
}

/// One open call; counted as ended on drop.
pub(crate) struct Call(Arc<Activity>);

impl Activity {
    /// Counts a call started; it stays open until the [`Call`] is dropped.
    pub(crate) fn start(self: &Arc<Self>) -> Call {
        self.started.fetch_add(1, Ordering::Relaxed);
        Call(Arc::clone(self))
    }

    fn greeted(&self) -> bool {
        self.greeted.load(Ordering::Relaxed)
    }

    /// Calls ended so far, and whether a call is open.
    fn calls(&self) -> (usize, bool) {
        let ended = self.ended.load(Ordering::Acquire);
        let started = self.started.load(Ordering::Relaxed);
        (ended, started != ended)
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Release);
    }
}

/// A connection's socket (or TLS stream) that notes when the client's preface has
/// been read: one branch per read until then, nothing after.
pub(super) struct Greeting<T> {
    inner: T,
    read: usize,
    activity: Arc<Activity>,
}

impl<T> Greeting<T> {
    pub(super) fn new(inner: T, activity: Arc<Activity>) -> Greeting<T> {
        Greeting {
            inner,
            read: 0,
            activity,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Greeting<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.read >= PREFACE_LEN {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.read += buf.filled().len() - before;
        if this.read >= PREFACE_LEN {
            this.activity.greeted.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Greeting<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A connection's timeouts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    pub handshake: Duration,
    pub idle: Duration,
}

/// What the timers decided at a check.
pub(super) enum Verdict {
    /// Keep serving; check again at the returned instant.
    Serve(tokio::time::Instant),
    /// The client never greeted: drop the connection.
    Drop,
    /// No call for an idle timeout: close gracefully.
    Idle,
}

/// The timers of one connection (see the module documentation).
pub(super) struct Watch {
    timeouts: Timeouts,
    activity: Arc<Activity>,
    /// Calls ended at the previous check (`None` before the handshake check).
    ended: Option<usize>,
}

impl Watch {
    pub(super) fn new(timeouts: Timeouts, activity: Arc<Activity>) -> Watch {
        Watch {
            timeouts,
            activity,
            ended: None,
        }
    }

    /// Checks the connection (its timer fired).
    pub(super) fn check(&mut self) -> Verdict {
        if !self.activity.greeted() {
            return Verdict::Drop;
        }
        let (ended, open) = self.activity.calls();
        if !open && self.ended == Some(ended) {
            return Verdict::Idle;
        }
        self.ended = Some(ended);
        Verdict::Serve(tokio::time::Instant::now() + self.timeouts.idle)
    }

    /// How long a graceful close may take.
    pub(super) fn grace(&self) -> Duration {
        self.timeouts.handshake
    }

    /// The timeouts it checks.
    pub(super) fn timeouts(&self) -> Timeouts {
        self.timeouts
    }
}

/// What a connection's watchdog asks of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// Go on serving.
    Serve = 0,
    /// Close gracefully (`GOAWAY`): open calls finish, no new ones start.
    Close = 1,
    /// Close now.
    Drop = 2,
}

/// The watchdog's latest [`Order`] and the connection task's waker, which the
/// watchdog wakes to deliver it. The connection reads the order with one atomic
/// load per wake-up; its waker is stored once (a task's waker stays valid for the
/// task's life).
#[derive(Default)]
pub(super) struct Orders {
    order: std::sync::atomic::AtomicU8,
    waker: Mutex<Option<std::task::Waker>>,
    registered: AtomicBool,
}

impl Orders {
    /// Gives `order` (a later order never weakens an earlier one) and wakes the
    /// connection's task.
    pub(super) fn give(&self, order: Order) {
        self.order.fetch_max(order as u8, Ordering::SeqCst);
        if let Some(waker) = self.waker.lock().as_ref() {
            waker.wake_by_ref();
        }
    }

    /// The order in force; stores `cx`'s waker the first time.
    pub(super) fn take(&self, cx: &Context<'_>) -> Order {
        if !self.registered.load(Ordering::Relaxed) {
            *self.waker.lock() = Some(cx.waker().clone());
            self.registered.store(true, Ordering::Relaxed);
        }
        match self.order.load(Ordering::SeqCst) {
            0 => Order::Serve,
            1 => Order::Close,
            _ => Order::Drop,
        }
    }
}
