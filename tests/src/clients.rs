//! [`Clients`]: clients that call a model over HTTP throughout a change (a reload, an
//! upgrade, a scale, a version unloaded) and count every answer, so a test can say
//! that none failed, and wait until answers came between its steps.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// `n` clients calling `model` (the echo worker) until stopped: client `c` sends one
/// row `[c, c + 1]` and expects `[c + 1, c + 2]`, from one of `versions` when given.
/// Each counts its right answers and keeps its failures; all answers are also
/// counted together, for [`Clients::answered_past`].
pub struct Clients {
    stop: Arc<AtomicBool>,
    answered: watch::Receiver<u64>,
    tasks: Vec<JoinHandle<(u64, Vec<String>)>>,
}

/// The request client `c` sends to `model` (`"echo/versions/2"` names a version).
pub fn echo_row(model: &str, c: u32) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 2],
            &[c, c + 1],
        )],
        ..Default::default()
    }
}

impl Clients {
    /// Starts `n` clients of `model`, any version answering.
    pub fn start(client: &HttpClient, model: &str, n: u32) -> Clients {
        Clients::start_from(client, model, n, &[])
    }

    /// Starts `n` clients of `model` whose answers must come from one of
    /// `versions` (any, when empty).
    pub fn start_from(
        client: &HttpClient,
        model: &str,
        n: u32,
        versions: &'static [&'static str],
    ) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let (total, answered) = watch::channel(0u64);
        let total = Arc::new(total);
        let tasks = (0..n)
            .map(|c| {
                let (client, model) = (client.clone(), model.to_owned());
                let (stop, total) = (stop.clone(), total.clone());
                tokio::spawn(async move {
                    let request = echo_row(&model, c);
                    let (mut answered, mut failed) = (0, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        match client.infer(&request).await {
                            Ok(r)
                                if r.outputs[0].values::<u32>() == [c + 1, c + 2]
                                    && (versions.is_empty()
                                        || versions.contains(&r.model_version.as_str())) =>
                            {
                                answered += 1;
                                total.send_modify(|n| *n += 1);
                            }
                            Ok(r) => failed.push(format!(
                                "wrong answer from version {}: {:?}",
                                r.model_version, r.outputs
                            )),
                            Err(e) => failed.push(e.to_string()),
                        }
                    }
                    (answered, failed)
                })
            })
            .collect();
        Clients {
            stop,
            answered,
            tasks,
        }
    }

    /// Waits until the clients together have had more than `count` right answers;
    /// returns how many they have had. Only a server that stopped answering waits
    /// the minute.
    pub async fn answered_past(&mut self, count: u64) -> u64 {
        let more = self.answered.wait_for(|&n| n > count);
        let answered = tokio::time::timeout(Duration::from_secs(60), more)
            .await
            .unwrap_or_else(|_| panic!("no answer past {count} in a minute"));
        *answered.expect("the clients' counter lives as long as they do")
    }

    /// Stops the clients; asserts that every request they sent was answered, and
    /// some were. Returns how many.
    pub async fn none_failed(self, what: &str) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let (mut answered, mut failed) = (0, Vec::new());
        for task in self.tasks {
            let (a, f) = task.await.expect("a client task");
            answered += a;
            failed.extend(f);
        }
        assert!(
            failed.is_empty(),
            "{what}: {} of {} requests failed, e.g. {:?}",
            failed.len(),
            answered + failed.len() as u64,
            &failed[..failed.len().min(3)]
        );
        assert!(answered > 0, "{what}: nothing was answered");
        println!("{what}: {answered} requests, none failed");
        answered
    }
}
