//! A bounded pool: a fixed number of items, handed out and returned on drop.
//!
//! The free list is a lock-free `crossbeam_queue::ArrayQueue` (a take and a return
//! cost about half of a bounded channel's: `docs/benchmarks.md`, "#12"). Only a
//! taker that finds it empty parks, on a mutex and condition variable; a return
//! takes that mutex only while someone is parked.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use parking_lot::{Condvar, Mutex};

/// A fixed set of reusable items. [`Pool::acquire`] blocks while every item is out;
/// a [`Pooled`] goes back when dropped.
pub struct Pool<T> {
    free: ArrayQueue<T>,
    /// Takers parked (or about to park) on `cond`.
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
    size: usize,
    /// Whether takes note the most items out ([`Pool::tracked`]).
    track: bool,
    /// The most items seen handed out at once (see [`Pool::high_water`]).
    most_out: AtomicUsize,
}

impl<T> Pool<T> {
    /// A pool of `size` items (at least 1) made by `make`.
    pub fn new(size: usize, mut make: impl FnMut() -> T) -> Arc<Pool<T>> {
        Pool::from_items((0..size.max(1)).map(|_| make()).collect(), false)
    }

    /// A pool that also notes the most items handed out at once
    /// ([`Pool::high_water`]), at a read of the free list per take.
    pub fn tracked(size: usize, mut make: impl FnMut() -> T) -> Arc<Pool<T>> {
        Pool::from_items((0..size.max(1)).map(|_| make()).collect(), true)
    }

    /// A pool of these items (at least one: a pool of none would block every
    /// taker); `track`: note the high-water mark as [`Pool::tracked`] does.
    pub fn from_items(items: Vec<T>, track: bool) -> Arc<Pool<T>> {
        assert!(!items.is_empty(), "a pool needs at least one item");
        let size = items.len();
        let free = ArrayQueue::new(size);
        for item in items {
            // Cannot fail: the queue has room for `size` items.
            let _ = free.push(item);
        }
        Arc::new(Pool {
            free,
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
            size,
            track,
            most_out: AtomicUsize::new(0),
        })
    }

    /// Takes an item, waiting while every item is out.
    pub fn acquire(self: &Arc<Self>) -> Pooled<T> {
        let item = self.take(None);
        self.wrap(item)
    }

    /// Takes an item if one is free now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Pooled<T>> {
        self.free.pop().map(|item| self.wrap(Some(item)))
    }

    /// Takes an item, waiting at most `timeout`.
    pub fn acquire_timeout(self: &Arc<Self>, timeout: Duration) -> Option<Pooled<T>> {
        // A timeout beyond what `Instant` can hold waits as `acquire` does.
        self.take(Instant::now().checked_add(timeout))
            .map(|item| self.wrap(Some(item)))
    }

    /// Pops an item, parking while there is none (until `deadline`, if given).
    fn take(&self, deadline: Option<Instant>) -> Option<T> {
        if let Some(item) = self.free.pop() {
            return Some(item);
        }
        let mut guard = self.lock.lock();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `put`: either this pop sees the item returned, or
        // the returner sees this waiter and notifies under the lock, which this
        // taker holds until it waits.
        fence(Ordering::SeqCst);
        let item = loop {
            if let Some(item) = self.free.pop() {
                break Some(item);
            }
            match deadline {
                None => self.cond.wait(&mut guard),
                Some(deadline) => {
                    if self.cond.wait_until(&mut guard, deadline).timed_out() {
                        break self.free.pop();
                    }
                }
            }
        };
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        item
    }

    /// Returns an item and wakes a parked taker, if any.
    fn put(&self, item: T) {
        // Cannot fail: the pool's items are never more than its capacity.
        let _ = self.free.push(item);
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock();
            self.cond.notify_one();
        }
    }

    fn wrap(self: &Arc<Self>, item: Option<T>) -> Pooled<T> {
        if self.track && item.is_some() {
            // Read, not counted: no atomic write per take or return unless a new
            // most is seen. A counter of items out (an add per take and per
            // return, a max per take) cost 17-27 ns per take and return in
            // `pool_acquire_release` (64.5 → 81.2, 73.9 → 100.7 ns); this read is
            // within the noise (80.8 → 79.3, 77.2 → 86.0 ns; load average ~8).
            let out = self.in_use();
            if out > self.most_out.load(Ordering::Relaxed) {
                self.most_out.fetch_max(out, Ordering::Relaxed);
            }
        }
        Pooled {
            item,
            pool: Arc::clone(self),
        }
    }

    /// Number of items.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The most items handed out at once since the pool was made (0 unless made
    /// [`Pool::tracked`]), as each taker
    /// saw it just after its take (every item then held counts, so a peak of `n`
    /// items held together is seen by the last of them taken; never more than
    /// [`Pool::size`]).
    pub fn high_water(&self) -> usize {
        self.most_out.load(Ordering::Relaxed)
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
            self.pool.put(item);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn bounds_items_in_flight() {
        let pool = Pool::tracked(2, Vec::<u8>::new);
        let a = pool.acquire();
        let b = pool.acquire();
        assert_eq!(pool.in_use(), 2);
        assert!(pool.try_acquire().is_none());
        let start = Instant::now();
        assert!(pool.acquire_timeout(Duration::from_millis(20)).is_none());
        assert!(start.elapsed() >= Duration::from_millis(20));
        assert_eq!(pool.high_water(), 2);
        drop(a);
        assert_eq!(pool.in_use(), 1);
        assert_eq!(pool.high_water(), 2);
        let c = pool.try_acquire();
        assert!(c.is_some());
        drop((b, c));
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn a_pool_of_given_items_hands_each_out_once() {
        let pool = Pool::from_items(vec![1u8, 2, 3], false);
        assert_eq!(pool.size(), 3);
        let taken: Vec<_> = (0..3).map(|_| pool.try_acquire().unwrap()).collect();
        let mut values: Vec<u8> = taken.iter().map(|p| **p).collect();
        values.sort_unstable();
        assert_eq!(values, [1, 2, 3]);
        assert!(pool.try_acquire().is_none());
    }

    #[test]
    fn contended_takers_all_get_their_turn() {
        // 4 threads, 2 items, 1000 takes each: no wake-up is lost (a lost one would
        // hang this test) and never more than 2 are out.
        let pool = Pool::new(2, || 0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        let mut item = pool.acquire();
                        *item += 1;
                        assert!(pool.in_use() <= 2);
                    }
                });
            }
        });
        let a = pool.acquire();
        let b = pool.acquire();
        assert_eq!(*a + *b, 4000);
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
