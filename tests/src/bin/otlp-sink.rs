//! `otlp-sink [ADDR]`: an OTLP/gRPC receiver that counts the spans it is sent and
//! keeps none, for `scripts/bench-tracing`. Prints `otlp-sink: listening on URL`,
//! then, on SIGINT or SIGTERM, `otlp-sink: N spans` and exits.

#![allow(clippy::unwrap_used)]

use kiln_tests::otlp::OtlpReceiver;
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    let receiver = OtlpReceiver::counting(&addr).await;
    println!("otlp-sink: listening on {}", receiver.url);
    let (mut int, mut term) = (
        signal(SignalKind::interrupt()).unwrap(),
        signal(SignalKind::terminate()).unwrap(),
    );
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    println!("otlp-sink: {} spans", receiver.count());
}
