use std::time::Duration;

use super::*;

fn at(start: Instant, ms: u64) -> Instant {
    start + Duration::from_millis(ms)
}

fn config(strategy: Strategy, max_batch_size: usize) -> SequenceConfig {
    super::super::test_config(strategy, max_batch_size)
}

/// Request `tag` of sequence `id`: its one input is `tag` as a UINT32.
fn req(id: u64, tag: u32, start: bool, end: bool, arrived: Instant) -> Request<u32> {
    super::super::test_request(id, tag, (start, end), arrived)
}

fn scheduler(
    strategy: Strategy,
    max_batch_size: usize,
    instances: usize,
) -> SequenceScheduler<u32> {
    let mut s = SequenceScheduler::new(config(strategy, max_batch_size));
    for _ in 0..instances {
        s.add_instance(Instant::now());
    }
    s
}

/// The next batch of the first idle instance with one due (the instances' turns,
/// one at a time); else the earliest instant to look again.
fn poll(s: &mut SequenceScheduler<u32>, now: Instant) -> SequencePoll<u32> {
    let mut wake = None;
    for index in 0..s.instances.len() {
        match s.poll_instance(index, now) {
            SequencePoll::Wait(at) => wake = [wake, at].into_iter().flatten().min(),
            batch => return batch,
        }
    }
    SequencePoll::Wait(wake)
}

fn batch(poll: SequencePoll<u32>) -> (usize, Vec<u32>, Vec<u64>) {
    match poll {
        SequencePoll::Batch { instance, requests } => (
            instance,
            requests.iter().map(|r| r.reply).collect(),
            requests
                .iter()
                .map(|r| r.sequence.as_ref().unwrap().handle)
                .collect(),
        ),
        SequencePoll::Wait(w) => panic!("no batch (wait {w:?})"),
    }
}

fn state_of(requests: &[Request<u32>]) -> Vec<u32> {
    requests
        .iter()
        .map(|r| u32::from_le_bytes(r.inputs[1].data[..4].try_into().unwrap()))
        .collect()
}

fn word(v: u32) -> Option<Vec<Bytes>> {
    Some(vec![Bytes::copy_from_slice(&v.to_le_bytes())])
}

#[test]
fn one_request_per_sequence_per_batch_in_order() {
    let t0 = Instant::now();
    let mut s = scheduler(Strategy::Direct, 4, 1);
    s.admit(req(1, 10, true, false, t0), t0).unwrap();
    s.admit(req(1, 11, false, false, t0), t0).unwrap();
    s.admit(req(2, 20, true, false, t0), t0).unwrap();
    let (i, tags, handles) = batch(poll(&mut s, t0));
    assert_eq!((i, tags.clone()), (0, vec![10, 20]));
    // The instance is busy: nothing more until the batch completes.
    assert!(matches!(poll(&mut s, t0), SequencePoll::Wait(None)));
    s.complete(0, handles.iter().map(|&h| (h, word(5))).collect(), t0);
    let (_, tags, _) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![11]);
}

#[test]
fn state_is_carried_and_reset_by_a_start() {
    let t0 = Instant::now();
    let mut s = scheduler(Strategy::Direct, 4, 1);
    s.admit(req(7, 1, true, false, t0), t0).unwrap();
    let SequencePoll::Batch { requests, .. } = poll(&mut s, t0) else {
        panic!()
    };
    assert_eq!(state_of(&requests), vec![0]);
    let h = requests[0].sequence.as_ref().unwrap().handle;
    s.complete(0, vec![(h, word(41))], t0);
    s.admit(req(7, 2, false, false, t0), t0).unwrap();
    let SequencePoll::Batch { requests, .. } = poll(&mut s, t0) else {
        panic!()
    };
    assert_eq!(state_of(&requests), vec![41]);
    // A failed batch keeps the state.
    s.complete(0, vec![(h, None)], t0);
    s.admit(req(7, 3, false, false, t0), t0).unwrap();
    let SequencePoll::Batch { requests, .. } = poll(&mut s, t0) else {
        panic!()
    };
    assert_eq!(state_of(&requests), vec![41]);
    s.complete(0, vec![(h, word(42))], t0);
    // A start on a live id resets its state.
    s.admit(req(7, 4, true, false, t0), t0).unwrap();
    let SequencePoll::Batch { requests, .. } = poll(&mut s, t0) else {
        panic!()
    };
    assert_eq!(state_of(&requests), vec![0]);
}

#[test]
fn unknown_ended_and_expired_sequences_are_refused() {
    let t0 = Instant::now();
    let mut s = scheduler(Strategy::Direct, 4, 1);
    let refused = |r: Result<(), (Request<u32>, SequenceRejection)>| r.unwrap_err().1;
    assert_eq!(
        refused(s.admit(req(1, 1, false, false, t0), t0)),
        SequenceRejection::NotActive { expired: false }
    );
    s.admit(req(1, 1, true, true, t0), t0).unwrap();
    // The end is queued: only a new start may follow.
    assert_eq!(
        refused(s.admit(req(1, 2, false, false, t0), t0)),
        SequenceRejection::Ended
    );
    let (_, _, h) = batch(poll(&mut s, t0));
    s.complete(0, vec![(h[0], word(1))], t0);
    assert_eq!(s.live(), 0);
    // Idle expiry: freed after max_idle (1 s) with nothing queued.
    s.admit(req(2, 1, true, false, t0), t0).unwrap();
    let (_, _, h) = batch(poll(&mut s, t0));
    s.complete(0, vec![(h[0], word(1))], at(t0, 10));
    assert_eq!(s.expire(at(t0, 1009)), 0);
    assert_eq!(s.live(), 1);
    assert_eq!(s.expire(at(t0, 1010)), 1);
    assert_eq!(s.live(), 0);
    assert_eq!(
        refused(s.admit(req(2, 2, false, false, at(t0, 1011)), at(t0, 1011))),
        SequenceRejection::NotActive { expired: true }
    );
}

#[test]
fn max_sequences_then_backlog() {
    let t0 = Instant::now();
    let mut cfg = config(Strategy::Direct, 2);
    cfg.max_backlog = 1;
    let mut s = SequenceScheduler::new(cfg);
    s.add_instance(t0);
    s.admit(req(1, 1, true, false, t0), t0).unwrap();
    s.admit(req(2, 2, true, false, t0), t0).unwrap();
    // Two slots taken: the third waits in the backlog, the fourth is refused.
    s.admit(req(3, 3, true, false, t0), t0).unwrap();
    assert_eq!(s.backlogged(), 1);
    let (_, r) = s.admit(req(4, 4, true, false, t0), t0).unwrap_err();
    assert_eq!(r, SequenceRejection::TooManySequences);
    let (_, tags, h) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![1, 2]);
    // Sequence 1 ends: sequence 3 moves in and runs.
    s.admit(req(1, 5, false, true, t0), t0).unwrap();
    s.complete(0, h.iter().map(|&h| (h, word(0))).collect(), t0);
    let (_, tags, h) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![5]);
    s.complete(0, h.iter().map(|&h| (h, word(0))).collect(), t0);
    assert_eq!(s.backlogged(), 0);
    let (_, tags, _) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![3]);
}

#[test]
fn direct_orders_rows_by_slot_and_pins_to_instances() {
    let t0 = Instant::now();
    let mut s = scheduler(Strategy::Direct, 2, 2);
    for id in 1..=4 {
        s.admit(req(id, id as u32, true, false, at(t0, 10 - id)), t0)
            .unwrap();
    }
    // Sequences alternate between the two instances (least loaded first).
    let (i0, tags0, h0) = batch(poll(&mut s, t0));
    let (i1, tags1, h1) = batch(poll(&mut s, t0));
    assert_eq!((i0, tags0), (0, vec![1, 3]));
    assert_eq!((i1, tags1), (1, vec![2, 4]));
    // Later requests go to the same instances, in slot order whatever their age.
    s.complete(0, h0.iter().map(|&h| (h, word(0))).collect(), t0);
    s.complete(1, h1.iter().map(|&h| (h, word(0))).collect(), t0);
    s.admit(req(3, 30, false, false, t0), t0).unwrap();
    s.admit(req(1, 10, false, false, at(t0, 1)), at(t0, 1))
        .unwrap();
    let (i, tags, _) = batch(poll(&mut s, at(t0, 1)));
    assert_eq!((i, tags), (0, vec![10, 30]));
}

#[test]
fn oldest_orders_by_age_waits_for_the_delay_and_prefers_sizes() {
    let t0 = Instant::now();
    let mut cfg = config(Strategy::Oldest, 4);
    cfg.max_queue_delay = Duration::from_millis(5);
    cfg.preferred_batch_sizes = vec![2];
    let mut s = SequenceScheduler::new(cfg);
    s.add_instance(t0);
    for id in 1..=3 {
        s.admit(req(id, id as u32, true, false, t0), t0).unwrap();
    }
    let (_, _, h) = batch(poll(&mut s, t0));
    s.complete(0, h.iter().map(|&h| (h, word(0))).collect(), t0);
    // One of three live sequences ready: wait for the others until the delay.
    s.admit(req(3, 30, false, false, at(t0, 1)), at(t0, 1))
        .unwrap();
    match poll(&mut s, at(t0, 2)) {
        SequencePoll::Wait(Some(w)) => assert_eq!(w, at(t0, 6)),
        other => panic!("{other:?}"),
    }
    // Two ready: a preferred size, sent at once, oldest first.
    s.admit(req(1, 10, false, false, at(t0, 2)), at(t0, 2))
        .unwrap();
    let (_, tags, h) = batch(poll(&mut s, at(t0, 2)));
    assert_eq!(tags, vec![30, 10]);
    s.complete(0, h.iter().map(|&h| (h, word(0))).collect(), at(t0, 3));
    // One ready, not preferred: sent when the delay has passed.
    s.admit(req(2, 20, false, false, at(t0, 3)), at(t0, 3))
        .unwrap();
    assert!(matches!(
        poll(&mut s, at(t0, 7)),
        SequencePoll::Wait(Some(_))
    ));
    let (_, tags, _) = batch(poll(&mut s, at(t0, 8)));
    assert_eq!(tags, vec![20]);
}

#[test]
fn every_live_sequence_ready_sends_at_once() {
    let t0 = Instant::now();
    let mut cfg = config(Strategy::Direct, 8);
    cfg.max_queue_delay = Duration::from_secs(10);
    let mut s = SequenceScheduler::new(cfg);
    s.add_instance(t0);
    s.admit(req(1, 1, true, false, t0), t0).unwrap();
    s.admit(req(2, 2, true, false, t0), t0).unwrap();
    let (_, tags, _) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![1, 2]);
}

#[test]
fn cancelled_requests_leave_and_close_frees_idle_sequences() {
    let t0 = Instant::now();
    let mut s = scheduler(Strategy::Direct, 4, 1);
    s.admit(req(1, 1, true, false, t0), t0).unwrap();
    s.admit(req(2, 2, true, false, t0), t0).unwrap();
    let gone = s.cancel(t0, |&tag| tag == 2);
    assert_eq!(gone.iter().map(|r| r.reply).collect::<Vec<_>>(), vec![2]);
    assert_eq!(s.queued(), 1);
    s.close(t0);
    // Sequence 2 has nothing left: freed. Sequence 1 runs, then is freed.
    assert_eq!(s.live(), 1);
    let (_, tags, h) = batch(poll(&mut s, t0));
    assert_eq!(tags, vec![1]);
    assert!(!s.is_drained());
    s.complete(0, vec![(h[0], word(0))], t0);
    assert!(s.is_drained());
    assert_eq!(s.live(), 0);
}

#[test]
fn queue_bound_and_missing_ids() {
    let t0 = Instant::now();
    let mut cfg = config(Strategy::Direct, 4);
    cfg.max_queued = 2;
    let mut s = SequenceScheduler::new(cfg);
    s.add_instance(t0);
    s.admit(req(1, 1, true, false, t0), t0).unwrap();
    s.admit(req(1, 2, false, false, t0), t0).unwrap();
    let (_, why) = s.admit(req(1, 3, false, false, t0), t0).unwrap_err();
    assert_eq!(why, SequenceRejection::QueueFull);
    let mut no_id = req(1, 4, true, false, t0);
    no_id.sequence = None;
    assert_eq!(
        s.admit(no_id, t0).unwrap_err().1,
        SequenceRejection::MissingId
    );
}
