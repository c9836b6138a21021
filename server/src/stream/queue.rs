//! A bounded queue that drops its oldest item when full: a session's frames
//! waiting for a place in the model, and its results waiting to be written
//! (docs/websocket.md, "Flow control"). One consumer awaits items; producers are
//! the session's task or, for a server-side source, its thread, which may
//! instead wait for room ([`DropQueue::push_wait`]).
//!
//! A `parking_lot` mutex around a `VecDeque`: it is taken once per frame by each
//! side and never held across an await; a frame is milliseconds of work.

use std::collections::VecDeque;

use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

/// The queue; share it in an `Arc`.
pub struct DropQueue<T> {
    state: Mutex<State<T>>,
    capacity: usize,
    /// Wakes the consumer when an item arrives or the queue closes.
    items: Notify,
    /// Wakes a producer waiting for room.
    room: Condvar,
}

struct State<T> {
    items: VecDeque<T>,
    closed: bool,
}

impl<T> DropQueue<T> {
    /// An empty queue of `capacity` places (at least 1).
    pub fn new(capacity: usize) -> DropQueue<T> {
        let capacity = capacity.max(1);
        DropQueue {
            state: Mutex::new(State {
                items: VecDeque::with_capacity(capacity),
                closed: false,
            }),
            capacity,
            items: Notify::new(),
            room: Condvar::new(),
        }
    }

    /// Adds `item`; when the queue is full its oldest item makes room and is
    /// returned. A closed queue returns `item` itself.
    pub fn push(&self, item: T) -> Option<T> {
        let dropped = {
            let mut state = self.state.lock();
            if state.closed {
                return Some(item);
            }
            let dropped = if state.items.len() == self.capacity {
                state.items.pop_front()
            } else {
                None
            };
            state.items.push_back(item);
            dropped
        };
        self.items.notify_one();
        dropped
    }

    /// Adds `item`, blocking the calling thread (not an async task's) until there
    /// is room; `Err(item)` once the queue is closed.
    pub fn push_wait(&self, item: T) -> Result<(), T> {
        {
            let mut state = self.state.lock();
            while !state.closed && state.items.len() == self.capacity {
                self.room.wait(&mut state);
            }
            if state.closed {
                return Err(item);
            }
            state.items.push_back(item);
        }
        self.items.notify_one();
        Ok(())
    }

    /// The oldest item, waiting for one; `None` once the queue is closed and empty.
    pub async fn pop(&self) -> Option<T> {
        loop {
            let notified = self.items.notified();
            if let Some(item) = self.try_pop() {
                return Some(item);
            }
            if self.state.lock().closed {
                return None;
            }
            notified.await;
        }
    }

    /// The oldest item, if any.
    pub fn try_pop(&self) -> Option<T> {
        let item = self.state.lock().items.pop_front();
        if item.is_some() {
            self.room.notify_one();
        }
        item
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    /// Whether no item is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the queue was closed.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Closes the queue: pushes are refused, waiting producers return, and the
    /// consumer gets what is left, then `None`.
    pub fn close(&self) {
        self.state.lock().closed = true;
        self.room.notify_all();
        self.items.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_oldest_item_is_dropped_when_full() {
        let q = DropQueue::new(2);
        assert_eq!(q.push(1), None);
        assert_eq!(q.push(2), None);
        assert_eq!(q.push(3), Some(1));
        assert_eq!(q.len(), 2);
        assert_eq!(q.try_pop(), Some(2));
        assert_eq!(q.try_pop(), Some(3));
        assert_eq!(q.try_pop(), None);
    }

    #[tokio::test]
    async fn a_waiting_producer_gets_room_or_the_close() {
        let q = Arc::new(DropQueue::new(1));
        q.push_wait(1).unwrap();
        let producer = {
            let q = Arc::clone(&q);
            std::thread::spawn(move || q.push_wait(2))
        };
        assert_eq!(q.pop().await, Some(1));
        assert_eq!(q.pop().await, Some(2));
        producer.join().unwrap().unwrap();
        let blocked = {
            let q = Arc::clone(&q);
            q.push_wait(3).unwrap();
            std::thread::spawn(move || q.push_wait(4))
        };
        q.close();
        assert_eq!(blocked.join().unwrap(), Err(4));
        assert_eq!(q.pop().await, Some(3));
        assert_eq!(q.pop().await, None);
        assert_eq!(q.push(5), Some(5));
    }
}
