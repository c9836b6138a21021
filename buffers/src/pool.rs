//! A bounded pool: a fixed number of items, handed out and returned on drop.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

/// A fixed set of reusable items. [`Pool::acquire`] blocks while every item is out;
/// a [`Pooled`] goes back when dropped.
pub struct Pool<T> {
    free: Receiver<T>,
    back: Sender<T>,
    size: usize,
}

impl<T> Pool<T> {
    /// A pool of `size` items made by `make`.
    pub fn new(size: usize, mut make: impl FnMut() -> T) -> Arc<Pool<T>> {
        let (back, free) = bounded(size);
        for _ in 0..size {
            // Cannot fail: the channel has room for `size` items and we hold the receiver.
            let _ = back.send(make());
        }
        Arc::new(Pool { free, back, size })
    }

    /// Takes an item, waiting while every item is out.
    pub fn acquire(self: &Arc<Self>) -> Pooled<T> {
        // Cannot disconnect: the pool holds a sender.
        let item = self.free.recv().ok();
        self.wrap(item)
    }

    /// Takes an item if one is free now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Pooled<T>> {
        self.free.try_recv().ok().map(|item| self.wrap(Some(item)))
    }

    /// Takes an item, waiting at most `timeout`.
    pub fn acquire_timeout(self: &Arc<Self>, timeout: Duration) -> Option<Pooled<T>> {
        self.free
            .recv_timeout(timeout)
            .ok()
            .map(|item| self.wrap(Some(item)))
    }

    fn wrap(self: &Arc<Self>, item: Option<T>) -> Pooled<T> {
        Pooled {
            item,
            pool: Arc::clone(self),
        }
    }

    /// Number of items.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Number of items handed out now.
    pub fn in_use(&self) -> usize {
        self.size - self.free.len()
    }
}

/// An item out of a [`Pool`]; returns on drop.
pub struct Pooled<T> {
    item: Option<T>,
    pool: Arc<Pool<T>>,
}

impl<T> Deref for Pooled<T> {
    type Target = T;

    fn deref(&self) -> &T {
        match &self.item {
            Some(item) => item,
            None => unreachable!("pooled item taken before drop"),
        }
    }
}

impl<T> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut T {
        match &mut self.item {
            Some(item) => item,
            None => unreachable!("pooled item taken before drop"),
        }
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            let _ = self.pool.back.send(item);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn bounds_items_in_flight() {
        let pool = Pool::new(2, Vec::<u8>::new);
        let a = pool.acquire();
        let b = pool.acquire();
        assert_eq!(pool.in_use(), 2);
        assert!(pool.try_acquire().is_none());
        let start = Instant::now();
        assert!(pool.acquire_timeout(Duration::from_millis(20)).is_none());
        assert!(start.elapsed() >= Duration::from_millis(20));
        drop(a);
        assert_eq!(pool.in_use(), 1);
        let c = pool.try_acquire();
        assert!(c.is_some());
        drop((b, c));
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn blocked_acquire_wakes_on_return() {
        let pool = Pool::new(1, || 7u32);
        let held = pool.acquire();
        let p = Arc::clone(&pool);
        let waiter = std::thread::spawn(move || *p.acquire());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished());
        drop(held);
        assert_eq!(waiter.join().unwrap(), 7);
    }
}
