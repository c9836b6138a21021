use super::super::Strategy;
use super::*;
use crossbeam_channel::bounded;
use std::sync::Mutex as StdMutex;

/// Records what the batcher refuses; the client of request `gone` went away.
#[derive(Clone, Default)]
struct Host {
    rejected: Arc<StdMutex<Vec<(u32, SequenceRejection)>>>,
    gone: Option<u32>,
}

impl SequenceHost<u32> for Host {
    fn rejected(&self, request: Request<u32>, why: SequenceRejection) {
        self.rejected.lock().unwrap().push((request.reply, why));
    }
    fn is_cancelled(&self, reply: &u32) -> bool {
        self.gone == Some(*reply)
    }
}

fn req(id: u64, tag: u32, start: bool, end: bool) -> Request<u32> {
    super::super::test_request(id, tag, (start, end), Instant::now())
}

/// A counter model on two instances taking their own turns: each sequence's state
/// counts its requests. Every run's state input must be the previous run's output
/// for that sequence, whatever instance and batch it lands in; closing the queue
/// ends both instances once everything taken has run.
#[test]
fn state_flows_through_instances_and_unload_drains() {
    let mut config = super::super::test_config(Strategy::Oldest, 4);
    config.max_idle = Duration::from_secs(10);
    config.max_sequences = 16;
    let (tx, rx) = bounded(256);
    let pool = Pool::new(5, || BufferSet::with_capacities(&[64, 64], &[64]));
    let host = Host::default();
    let former = Arc::new(SequenceFormer::new(
        config,
        2,
        rx,
        pool,
        Box::new(host.clone()),
    ));
    let seen = Arc::new(StdMutex::new(Vec::new()));
    let mut workers = Vec::new();
    for _ in 0..2 {
        let turn = former.join();
        let (former, seen) = (Arc::clone(&former), Arc::clone(&seen));
        workers.push(std::thread::spawn(move || {
            let mut batches = 0;
            while let Some(batch) = former.next_batch(&turn, &mut ()) {
                batches += 1;
                let states: Vec<u32> = batch.buffers.inputs[1]
                    .as_slice()
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let mut done = Vec::new();
                for (member, state) in batch.members.iter().zip(&states) {
                    seen.lock().unwrap().push((member.reply, *state));
                    let next = Bytes::copy_from_slice(&(state + 1).to_le_bytes());
                    done.push((member.sequence.unwrap(), Some(vec![next])));
                }
                former.complete(turn.index, done);
            }
            batches
        }));
    }
    // Sequence s sends tags s*100 + k, k = 0..5; each waits for nothing (all
    // queued at once): the scheduler alone keeps them in order.
    for k in 0..5u32 {
        for s in 1..=6u64 {
            tx.send(req(s, s as u32 * 100 + k, k == 0, k == 4)).unwrap();
        }
    }
    // A request for a sequence that ended is refused.
    std::thread::sleep(Duration::from_millis(200));
    tx.send(req(1, 999, false, false)).unwrap();
    drop(tx);
    let batches: Vec<usize> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert!(
        batches.iter().all(|&b| b > 0),
        "both instances ran: {batches:?}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 30);
    for &(tag, state) in seen.iter() {
        assert_eq!(state, tag % 100, "request {tag} saw state {state}");
    }
    assert_eq!(
        *host.rejected.lock().unwrap(),
        vec![(999, SequenceRejection::NotActive { expired: false })]
    );
}

/// An instance waiting for work forms its batch from a request that arrives after
/// it began to wait, and a sequence pinned to another instance wakes that one: with
/// `direct` and one slot per instance, sequence 1 lives on instance 0 and 2 on 1.
#[test]
fn a_waiting_instance_is_woken_for_its_own_sequences() {
    let config = super::super::test_config(Strategy::Direct, 1);
    let (tx, rx) = bounded(16);
    let pool = Pool::new(4, || BufferSet::with_capacities(&[64, 64], &[64]));
    let former = Arc::new(SequenceFormer::new(
        config,
        2,
        rx,
        pool,
        Box::new(Host::default()),
    ));
    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let mut workers = Vec::new();
    for _ in 0..2 {
        let turn = former.join();
        let (former, done_tx) = (Arc::clone(&former), done_tx.clone());
        workers.push(std::thread::spawn(move || {
            while let Some(batch) = former.next_batch(&turn, &mut ()) {
                let handles: Vec<(u64, Option<Vec<Bytes>>)> = batch
                    .members
                    .iter()
                    .map(|m| (m.sequence.unwrap(), None))
                    .collect();
                for member in &batch.members {
                    done_tx.send((turn.index, member.reply)).unwrap();
                }
                former.complete(turn.index, handles);
            }
        }));
    }
    // Both instances are waiting before anything arrives.
    std::thread::sleep(Duration::from_millis(50));
    tx.send(req(1, 10, true, false)).unwrap();
    tx.send(req(2, 20, true, false)).unwrap();
    let mut got = vec![done_rx.recv().unwrap(), done_rx.recv().unwrap()];
    got.sort();
    assert_eq!(got, vec![(0, 10), (1, 20)]);
    // Sequence 2's next request, taken in by whichever instance looks, runs on 1.
    tx.send(req(2, 21, false, true)).unwrap();
    assert_eq!(done_rx.recv().unwrap(), (1, 21));
    tx.send(req(1, 11, false, true)).unwrap();
    assert_eq!(done_rx.recv().unwrap(), (0, 11));
    drop(tx);
    for w in workers {
        w.join().unwrap();
    }
}

/// A request whose client goes away while its instance runs a batch is answered
/// `Cancelled` when the instance next looks, and never runs; its sequence goes on
/// with the state it had.
#[test]
fn a_request_cancelled_while_the_instance_runs_never_runs() {
    let config = super::super::test_config(Strategy::Direct, 1);
    let (tx, rx) = bounded(16);
    let pool = Pool::new(3, || BufferSet::with_capacities(&[64, 64], &[64]));
    let host = Host {
        gone: Some(11),
        ..Host::default()
    };
    let former = SequenceFormer::new(config, 2, rx, pool, Box::new(host.clone()));
    let turn = former.join();
    tx.send(req(1, 10, true, false)).unwrap();
    let first = former.next_batch(&turn, &mut ()).unwrap();
    assert_eq!(first.members[0].reply, 10);
    // While 10 runs: 11 (its client gone) and 12 arrive.
    tx.send(req(1, 11, false, false)).unwrap();
    tx.send(req(1, 12, false, true)).unwrap();
    let state = |batch: &Batch<u32>| {
        u32::from_le_bytes(batch.buffers.inputs[1].as_slice()[..4].try_into().unwrap())
    };
    let handle = first.members[0].sequence.unwrap();
    let next = Bytes::copy_from_slice(&(state(&first) + 1).to_le_bytes());
    former.complete(turn.index, vec![(handle, Some(vec![next]))]);
    let second = former.next_batch(&turn, &mut ()).unwrap();
    assert_eq!(second.members[0].reply, 12, "11 never runs");
    assert_eq!(state(&second), 1, "12 sees the state 10 left");
    assert_eq!(
        *host.rejected.lock().unwrap(),
        vec![(11, SequenceRejection::Cancelled)]
    );
}
