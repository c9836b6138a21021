use super::*;
use crate::request::Tensor;
use bytes::Bytes;
use kiln_worker_sdk::{DataType, Shape};

fn at(start: Instant, ms: u64) -> Instant {
    start + Duration::from_millis(ms)
}

fn req(id: u32, rows: usize, arrived: Instant) -> Request<u32> {
    req_shaped(id, &[rows as i64, 2], arrived)
}

fn req_shaped(id: u32, dims: &[i64], arrived: Instant) -> Request<u32> {
    let shape = Shape::new(dims).unwrap();
    Request {
        inputs: vec![Tensor {
            dtype: DataType::Uint32,
            shape,
            data: Bytes::from(vec![0u8; shape.element_count() * 4]),
        }],
        rows: shape.rows(),
        params: Vec::new(),
        arrived,
        priority: None,
        timeout: None,
        sequence: None,
        ticket: None,
        reply: id,
    }
}

fn ids(poll: Poll<u32>) -> Vec<u32> {
    match poll {
        Poll::Batch(b) => b.into_iter().map(|r| r.reply).collect(),
        Poll::Wait(w) => panic!("expected a batch, got Wait({w:?})"),
    }
}

fn waits(poll: Poll<u32>) -> Option<Instant> {
    match poll {
        Poll::Wait(w) => w,
        Poll::Batch(b) => panic!(
            "expected to wait, got {:?}",
            b.iter().map(|r| r.reply).collect::<Vec<_>>()
        ),
    }
}

#[test]
fn waits_until_the_delay_counted_from_the_oldest() {
    let t = Instant::now();
    let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_millis(10)));
    q.admit(req(1, 1, at(t, 0)), at(t, 0)).unwrap();
    q.admit(req(2, 1, at(t, 4)), at(t, 4)).unwrap();
    assert_eq!(
        waits(q.poll(at(t, 5))),
        Some(at(t, 10)),
        "from the oldest, not the newest"
    );
    assert_eq!(ids(q.poll(at(t, 10))), vec![1, 2]);
    assert_eq!(waits(q.poll(at(t, 11))), None);
}

#[test]
fn a_full_batch_goes_at_once_and_zero_delay_sends_what_is_there() {
    let t = Instant::now();
    let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::from_secs(60)));
    for i in 0..5 {
        q.admit(req(i, 1, t), t).unwrap();
    }
    assert_eq!(ids(q.poll(t)), vec![0, 1, 2, 3]);
    let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::ZERO));
    q.admit(req(9, 1, t), t).unwrap();
    assert_eq!(ids(q.poll(t)), vec![9]);
}

#[test]
fn preferred_sizes_are_chosen_greedily() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(16, Duration::from_secs(60));
    config.preferred_batch_sizes = vec![2, 4, 8];
    let mut q = DynamicQueue::new(config);
    for i in 0..5 {
        q.admit(req(i, 1, t), t).unwrap();
    }
    // 5 queued: the largest preferred size reachable is 4.
    assert_eq!(ids(q.poll(t)), vec![0, 1, 2, 3]);
    // 1 left: no preferred size, so it waits for the delay.
    assert!(waits(q.poll(t)).is_some());
    // Requests carrying rows: 3 + 1 = 4 rows is preferred; the 2-row request
    // alone would be 2 (also preferred) but 4 is larger.
    let mut config = DynamicConfig::new(16, Duration::from_secs(60));
    config.preferred_batch_sizes = vec![2, 4];
    let mut q = DynamicQueue::new(config);
    q.admit(req(0, 3, t), t).unwrap();
    q.admit(req(1, 1, t), t).unwrap();
    q.admit(req(2, 2, t), t).unwrap();
    assert_eq!(ids(q.poll(t)), vec![0, 1]);
}

#[test]
fn rows_never_split_and_shapes_never_mix() {
    let t = Instant::now();
    let mut q = DynamicQueue::new(DynamicConfig::new(4, Duration::from_secs(60)));
    q.admit(req(0, 3, t), t).unwrap();
    q.admit(req(1, 2, t), t).unwrap();
    // 3 + 2 > 4: the batch cannot grow without splitting or reordering: send it.
    assert_eq!(ids(q.poll(t)), vec![0]);
    let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_secs(60)));
    q.admit(req_shaped(0, &[1, 2], t), t).unwrap();
    q.admit(req_shaped(1, &[1, 3], t), t).unwrap();
    assert_eq!(ids(q.poll(t)), vec![0]);
    assert_eq!(waits(q.poll(t)), Some(t + Duration::from_secs(60)));
}

#[test]
fn max_batch_bytes_limits_the_batch() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(64, Duration::from_secs(60));
    config.max_batch_bytes = Some(20); // each request is 8 bytes
    let mut q = DynamicQueue::new(config);
    for i in 0..4 {
        q.admit(req(i, 1, t), t).unwrap();
    }
    assert_eq!(ids(q.poll(t)), vec![0, 1]);
}

#[test]
fn strict_priority_across_levels_fifo_within() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(3, Duration::ZERO);
    config.priority_levels = 3;
    config.default_priority_level = 2;
    let mut q = DynamicQueue::new(config);
    let with = |id, p| {
        let mut r = req(id, 1, t);
        r.priority = p;
        r
    };
    q.admit(with(0, Some(3)), t).unwrap();
    q.admit(with(1, None), t).unwrap();
    q.admit(with(2, Some(1)), t).unwrap();
    q.admit(with(3, Some(3)), t).unwrap();
    q.admit(with(4, Some(1)), t).unwrap();
    assert_eq!(ids(q.poll(t)), vec![2, 4, 1]);
    assert_eq!(ids(q.poll(t)), vec![0, 3]);
    let (r, why) = q.admit(with(5, Some(4)), t).unwrap_err();
    assert_eq!((r.reply, why), (5, Rejection::BadPriority));
}

#[test]
fn queue_full_per_level() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(8, Duration::from_secs(1));
    config.policies = vec![QueuePolicy {
        max_queue_size: 2,
        ..QueuePolicy::default()
    }];
    let mut q = DynamicQueue::new(config);
    q.admit(req(0, 1, t), t).unwrap();
    q.admit(req(1, 1, t), t).unwrap();
    assert_eq!(
        q.admit(req(2, 1, t), t).unwrap_err().1,
        Rejection::QueueFull
    );
}

#[test]
fn timeouts_reject_or_delay_and_overrides_only_shorten() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(8, Duration::from_secs(60));
    config.priority_levels = 2;
    config.policies = vec![
        QueuePolicy {
            default_timeout: Some(Duration::from_millis(100)),
            timeout_action: TimeoutAction::Reject,
            ..QueuePolicy::default()
        },
        QueuePolicy {
            default_timeout: Some(Duration::from_millis(50)),
            timeout_action: TimeoutAction::Delay,
            ..QueuePolicy::default()
        },
    ];
    let mut q = DynamicQueue::new(config);
    let mut shorter = req(0, 1, t);
    shorter.timeout = Some(Duration::from_millis(20));
    let mut longer = req(1, 1, t);
    longer.timeout = Some(Duration::from_secs(10)); // may not lengthen: stays 100 ms
    let mut low = req(2, 1, t);
    low.priority = Some(2);
    q.admit(shorter, t).unwrap();
    q.admit(longer, t).unwrap();
    q.admit(low, t).unwrap();
    assert_eq!(q.next_deadline(), Some(at(t, 20)));
    assert_eq!(
        waits(q.poll(at(t, 1))),
        Some(at(t, 20)),
        "wakes for the deadline"
    );
    assert_eq!(
        q.expire(at(t, 20))
            .iter()
            .map(|r| r.reply)
            .collect::<Vec<_>>(),
        vec![0]
    );
    // At 50 ms the low-priority request is delayed, not rejected.
    assert!(q.expire(at(t, 50)).is_empty());
    assert_eq!(
        q.expire(at(t, 100))
            .iter()
            .map(|r| r.reply)
            .collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(q.len(), 1);
    assert_eq!(
        q.next_deadline(),
        None,
        "a delayed request has no deadline any more"
    );
}

#[test]
fn delayed_requests_come_after_all_others() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(2, Duration::ZERO);
    config.policies = vec![QueuePolicy {
        default_timeout: Some(Duration::from_millis(10)),
        timeout_action: TimeoutAction::Delay,
        allow_timeout_override: false,
        ..QueuePolicy::default()
    }];
    let mut q = DynamicQueue::new(config);
    q.admit(req(0, 1, t), t).unwrap();
    assert!(q.expire(at(t, 10)).is_empty());
    q.admit(req(1, 1, at(t, 11)), at(t, 11)).unwrap();
    q.admit(req(2, 1, at(t, 11)), at(t, 11)).unwrap();
    assert_eq!(ids(q.poll(at(t, 11))), vec![1, 2]);
    assert_eq!(ids(q.poll(at(t, 11))), vec![0]);
}

#[test]
fn cancelled_requests_leave_before_batching() {
    let t = Instant::now();
    let mut q = DynamicQueue::new(DynamicConfig::new(8, Duration::from_secs(60)));
    for i in 0..4 {
        q.admit(req(i, 1, t), t).unwrap();
    }
    let gone = q.cancel(|id| id % 2 == 1);
    assert_eq!(gone.iter().map(|r| r.reply).collect::<Vec<_>>(), vec![1, 3]);
    assert_eq!(ids(q.poll(at(t, 60_000))), vec![0, 2]);
}

#[test]
fn deadline_aware_sends_early() {
    let t = Instant::now();
    let mut config = DynamicConfig::new(8, Duration::from_millis(100));
    config.policies = vec![QueuePolicy {
        default_timeout: Some(Duration::from_millis(50)),
        ..QueuePolicy::default()
    }];
    let mut q = DynamicQueue::new(config);
    q.set_compute_estimate(Duration::from_millis(20));
    q.admit(req(0, 1, t), t).unwrap();
    // Deadline 50 ms, a batch takes ~20 ms: waiting past 30 ms would miss it.
    assert_eq!(waits(q.poll(at(t, 1))), Some(at(t, 30)));
    assert_eq!(ids(q.poll(at(t, 30))), vec![0]);
}
