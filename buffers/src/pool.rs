//! A bounded pool: a number of items, handed out and returned on drop.
//!
//! The number can change while items are out ([`Pool::resize`], when a group's
//! instances are scaled): growing adds items at once; shrinking drops free items at
//! once and each item still out when it comes back, never one in use. The free
//! list's capacity, fixed when the pool is made ([`Pool::resizable`]), bounds growth.
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
    /// Items the pool is to hold ([`Pool::size`]).
    size: AtomicUsize,
    /// Items that exist, free or out: more than `size` while a shrink waits for
    /// items in use to come back.
    live: AtomicUsize,
    /// Items to drop as they come back rather than free (what a shrink could not
    /// take from the free list at once).
    retiring: AtomicUsize,
    /// One resize at a time.
    resizing: Mutex<()>,
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

    /// A pool of `size` items made by `make` that [`Pool::resize`] may grow up to
    /// `capacity` items (at least `size`); `track` as for [`Pool::from_items`].
    pub fn resizable(
        size: usize,
        capacity: usize,
        track: bool,
        mut make: impl FnMut() -> T,
    ) -> Arc<Pool<T>> {
        let items = (0..size.max(1)).map(|_| make()).collect();
        Pool::with_capacity(items, capacity, track)
    }

    /// A pool of these items (at least one: a pool of none would block every
    /// taker); `track`: note the high-water mark as [`Pool::tracked`] does.
    pub fn from_items(items: Vec<T>, track: bool) -> Arc<Pool<T>> {
        let capacity = items.len();
        Pool::with_capacity(items, capacity, track)
    }

    fn with_capacity(items: Vec<T>, capacity: usize, track: bool) -> Arc<Pool<T>> {
        assert!(!items.is_empty(), "a pool needs at least one item");
        let size = items.len();
        let free = ArrayQueue::new(capacity.max(size));
        for item in items {
            // Cannot fail: the queue has room for `size` items.
            let _ = free.push(item);
        }
        Arc::new(Pool {
            free,
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
            size: AtomicUsize::new(size),
            live: AtomicUsize::new(size),
            retiring: AtomicUsize::new(0),
            resizing: Mutex::new(()),
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

    /// Returns an item and wakes a parked taker, if any; drops it instead while a
    /// shrink waits for items to come back.
    fn put(&self, item: T) {
        // A relaxed load per return (no write) unless a shrink is under way.
        if self.retiring.load(Ordering::Relaxed) > 0 && take_one(&self.retiring) {
            self.live.fetch_sub(1, Ordering::SeqCst);
            drop(item);
            return;
        }
        // Cannot fail: the pool's items are never more than its capacity.
        let _ = self.free.push(item);
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock();
            self.cond.notify_one();
        }
    }

    /// Makes the pool hold `size` items (at least 1). Growing adds items made by
    /// `make` (or keeps items a shrink had yet to drop) and wakes parked takers;
    /// shrinking drops free items now and items in use as they come back. Refused
    /// beyond [`Pool::capacity`].
    pub fn resize(&self, size: usize, mut make: impl FnMut() -> T) -> Result<(), TooLarge> {
        let size = size.max(1);
        if size > self.capacity() {
            return Err(TooLarge {
                size,
                capacity: self.capacity(),
            });
        }
        let _one_at_a_time = self.resizing.lock();
        let old = self.size.swap(size, Ordering::SeqCst);
        if size >= old {
            let mut add = size - old;
            // Items still to be dropped stay instead of new ones.
            while add > 0 && take_one(&self.retiring) {
                add -= 1;
            }
            for _ in 0..add {
                self.live.fetch_add(1, Ordering::SeqCst);
                // Cannot fail: `live` stays within the capacity (checked above,
                // and items still to be dropped were taken back first).
                let _ = self.free.push(make());
            }
            fence(Ordering::SeqCst);
            if self.waiters.load(Ordering::SeqCst) > 0 {
                let _guard = self.lock.lock();
                self.cond.notify_all();
            }
        } else {
            self.retiring.fetch_add(old - size, Ordering::SeqCst);
            // What is free goes now; the rest as it comes back (`put`).
            while take_one(&self.retiring) {
                match self.free.pop() {
                    Some(item) => {
                        self.live.fetch_sub(1, Ordering::SeqCst);
                        drop(item);
                    }
                    None => {
                        self.retiring.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// The most items [`Pool::resize`] can make the pool hold.
    pub fn capacity(&self) -> usize {
        self.free.capacity()
    }

    /// Items that exist now, free or in use: more than [`Pool::size`] while a
    /// shrink waits for items in use to come back.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
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

    /// Number of items the pool holds (once a shrink's items in use are back).
    pub fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
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
        self.live
            .load(Ordering::Relaxed)
            .saturating_sub(self.free.len())
    }
}

/// Takes one from `counter` if it is above zero; whether it did.
fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// A [`Pool::resize`] beyond the pool's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub size: usize,
    pub capacity: usize,
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} buffer sets asked for; the pool holds at most {}",
            self.size, self.capacity
        )
    }
}

impl std::error::Error for TooLarge {}

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

    /// Waits until `n` takers have registered as waiters on `pool`: each then holds
    /// the lock until it is parked, so a return or a grow from now on must wake it.
    fn parked<T>(pool: &Pool<T>, n: usize) {
        while pool.waiters.load(Ordering::SeqCst) < n {
            std::thread::yield_now();
        }
    }

    #[test]
    fn blocked_acquire_wakes_on_return() {
        let pool = Pool::new(1, || 7u32);
        let held = pool.acquire();
        let p = Arc::clone(&pool);
        let waiter = std::thread::spawn(move || *p.acquire());
        parked(&pool, 1);
        assert!(!waiter.is_finished());
        drop(held);
        assert_eq!(waiter.join().unwrap(), 7);
    }

    #[test]
    fn growing_adds_items_and_wakes_a_parked_taker() {
        let pool = Pool::resizable(1, 4, false, || 0u8);
        let held = pool.acquire();
        let p = Arc::clone(&pool);
        // Parked (or about to park, holding the lock) on the empty pool: the grow
        // must reach it.
        let waiter = std::thread::spawn(move || drop(p.acquire()));
        parked(&pool, 1);
        pool.resize(3, || 0u8).unwrap();
        waiter.join().unwrap();
        assert_eq!((pool.size(), pool.live()), (3, 3));
        let more: Vec<_> = (0..2).map(|_| pool.try_acquire().unwrap()).collect();
        assert!(pool.try_acquire().is_none());
        drop((held, more));
        assert_eq!(
            pool.resize(5, || 0u8),
            Err(TooLarge {
                size: 5,
                capacity: 4
            })
        );
        assert_eq!(pool.size(), 3);
    }

    #[test]
    fn shrinking_never_takes_an_item_in_use() {
        let pool = Pool::resizable(4, 4, false, || vec![1u8]);
        let mut a = pool.acquire();
        let b = pool.acquire();
        let c = pool.acquire();
        pool.resize(1, Vec::new).unwrap();
        // The free item went at once; the three in use stay theirs.
        assert_eq!((pool.size(), pool.live(), pool.in_use()), (1, 3, 3));
        a.push(2);
        assert_eq!(*a, [1, 2]);
        assert!(pool.try_acquire().is_none());
        drop((a, b));
        // Two came back and were dropped: one remains, in use.
        assert_eq!((pool.live(), pool.in_use()), (1, 1));
        assert!(pool.try_acquire().is_none());
        drop(c);
        assert_eq!((pool.live(), pool.in_use()), (1, 0));
        let d = pool.try_acquire();
        assert!(d.is_some());
        assert!(pool.try_acquire().is_none());
    }

    #[test]
    fn growing_while_a_shrink_waits_keeps_the_items_out() {
        let pool = Pool::resizable(3, 3, false, || 0u8);
        let held: Vec<_> = (0..3).map(|_| pool.acquire()).collect();
        pool.resize(1, || 0u8).unwrap();
        let mut made = 0;
        pool.resize(3, || {
            made += 1;
            0u8
        })
        .unwrap();
        // The two to be dropped were kept instead of making new ones.
        assert_eq!(made, 0);
        drop(held);
        assert_eq!((pool.size(), pool.live(), pool.in_use()), (3, 3, 0));
        let all: Vec<_> = (0..3).map(|_| pool.try_acquire().unwrap()).collect();
        assert!(pool.try_acquire().is_none());
        drop(all);
    }

    #[test]
    fn resizing_under_contention_keeps_the_bound() {
        // 4 threads take and return while the pool goes 1 → 4 → 2 → 3 → 1: never
        // more out than the larger of the sizes before and after the last resize,
        // and at the end exactly the last size exists.
        let pool = Pool::resizable(1, 4, false, || 0u64);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let mut item = pool.acquire();
                        *item += 1;
                        assert!(pool.in_use() <= 4);
                    }
                });
            }
            for size in [4, 2, 3, 1] {
                std::thread::sleep(Duration::from_millis(10));
                pool.resize(size, || 0u64).unwrap();
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert_eq!((pool.size(), pool.live(), pool.in_use()), (1, 1, 0));
    }
}
