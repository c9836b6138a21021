//! What the HTTP I/O threads would spend on one request's body, by size: JSON
//! decoding and encoding, copying a shared-memory input, and the hop to actix's
//! blocking pool that `http::offload` pays above its threshold. The numbers behind
//! `INLINE_BYTES` in `server/src/http/offload.rs`:
//!
//! `cargo run --release -p kiln-server --example decode_cost`

// A measuring program: a failed step should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_core::memory::shared_memory::SharedMemory;
use kiln_core::request::infer::{InferResponse, OutputTensor};
use kiln_server::http::{decode_request, encode_response};
use kiln_worker_sdk::DataType;

/// The median time of `f` over enough runs to take about 0.3 s.
fn median(mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    f();
    let once = start.elapsed().max(Duration::from_nanos(100));
    let runs = (Duration::from_millis(300).as_nanos() / once.as_nanos()).clamp(5, 20_000);
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// A JSON request with `count` FP32 values (as clients write them: `0.123456`).
fn request_body(count: usize) -> Vec<u8> {
    let values: Vec<String> = (0..count)
        .map(|i| format!("{:.6}", i as f32 / 7.0))
        .collect();
    format!(
        r#"{{"inputs":[{{"name":"INPUT0","shape":[1,{count}],"datatype":"FP32","data":[{}]}}]}}"#,
        values.join(",")
    )
    .into_bytes()
}

fn response(count: usize) -> InferResponse {
    let data: Vec<u8> = (0..count)
        .flat_map(|i| (i as f32 / 7.0).to_le_bytes())
        .collect();
    InferResponse {
        model_name: "m".into(),
        model_version: "1".into(),
        id: None,
        outputs: vec![OutputTensor {
            name: "OUTPUT0".into(),
            dtype: DataType::Fp32,
            shape: vec![1, count as i64],
            data: Bytes::from(data),
        }],
    }
}

fn rate(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e6
}

fn main() {
    let hop = actix_web::rt::System::new().block_on(async {
        let mut times = Vec::new();
        for _ in 0..2000 {
            let start = Instant::now();
            actix_web::web::block(|| black_box(1)).await.unwrap();
            times.push(start.elapsed());
        }
        times.sort();
        times[times.len() / 2]
    });
    println!("hop to the blocking pool and back: {hop:?} (median of 2000)");

    let key = format!("/kiln-decode-cost-{}", std::process::id());
    let path = format!("/dev/shm{key}");
    std::fs::write(&path, vec![1u8; 16 << 20]).unwrap();
    let shm = SharedMemory::new();
    shm.register("r", &key, 0, 16 << 20).unwrap();

    println!(
        "{:>10} {:>10} {:>12} {:>9} {:>12} {:>9} {:>12}",
        "tensor", "JSON body", "decode", "MB/s", "encode", "MB/s", "shm read"
    );
    for count in [256, 1024, 4096, 16384, 65536, 262144, 1 << 20] {
        let tensor = 4 * count;
        let body = request_body(count);
        let decode = median(|| {
            black_box(decode_request("m", black_box(&body)).unwrap());
        });
        let answer = response(count);
        let encode = median(|| {
            black_box(encode_response(black_box(&answer)));
        });
        let read = median(|| {
            black_box(shm.read("r", 0, tensor).unwrap());
        });
        println!(
            "{tensor:>10} {:>10} {decode:>12.1?} {:>9.0} {encode:>12.1?} {:>9.0} {read:>12.1?}",
            body.len(),
            rate(body.len(), decode),
            rate(tensor, encode),
        );
    }
    let _ = std::fs::remove_file(&path);
}
