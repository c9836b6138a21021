//! REST decoding: what a request body can make the server allocate, and big
//! bodies decoded off the HTTP I/O threads. This test binary counts its own
//! allocations (a global allocator that notes, per thread, the largest one asked
//! for) to check the decoder in-process, and starts the real `kiln` for the rest.

// The helpers are test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kiln_tests::Kiln;
use serde_json::{json, Value};

/// The system allocator, noting the largest allocation of the thread.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
}

// SAFETY: every call is forwarded to `System` unchanged; the bookkeeping only
// writes a thread-local `Cell` (no allocation, no lock).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The largest allocation `f` makes on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(0));
    let out = f();
    (out, LARGEST.with(Cell::get))
}

/// A body declaring `shape` of `datatype` with only `data`.
fn declared(shape: &[u64], datatype: &str, data: Value) -> Value {
    json!({"inputs": [{"name": "INPUT0", "shape": shape, "datatype": datatype, "data": data}]})
}

/// Decoding reserves what the body can hold, not what its shape declares (it used
/// to reserve up to 64 MiB per input before the shape was checked).
#[test]
fn json_decoding_reserves_what_the_body_holds() {
    for (datatype, shape) in [("UINT8", 1u64 << 24), ("FP64", 1 << 30), ("INT32", 1 << 40)] {
        let body = declared(&[shape], datatype, json!([1, 2, 3])).to_string();
        let (result, largest) =
            largest_allocation(|| kiln_server::http::decode_request("m", body.as_bytes()));
        let err = result.unwrap_err().to_string();
        assert!(err.contains("but data has 3"), "{err}");
        assert!(
            largest < 4096,
            "{datatype} {shape}: a {largest}-byte allocation for a {}-byte body",
            body.len()
        );
    }
    // A body that does hold its shape still decodes at once into its size.
    let values: Vec<u32> = (0..100_000).collect();
    let body = declared(&[100_000], "UINT32", json!(values)).to_string();
    let (request, _) =
        largest_allocation(|| kiln_server::http::decode_request("m", body.as_bytes()));
    assert_eq!(request.unwrap().inputs[0].data.len(), 400_000);
}

/// Over the wire: a huge declared shape with three values is a 400, and the server
/// goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_declared_shape_is_a_bad_request() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let post = |body: Value| {
        let url = format!("{}/v2/models/echo/infer", kiln.url);
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .body(body.to_string())
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = post(declared(&[1, 1 << 24], "UINT32", json!([[1, 2, 3]]))).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("the shape holds 16777216 elements but data has 3"),
        "{v}"
    );
    let (status, v) = post(declared(&[1, 3], "UINT32", json!([[1, 2, 3]]))).await;
    assert_eq!((status, &v["outputs"][0]["data"]), (200, &json!([2, 3, 4])));
}

/// A large JSON body is decoded off the HTTP I/O threads: while one takes a second
/// to decode, small requests on other connections are answered. (They used to wait
/// for it: an actix worker decoded it on the thread serving them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_does_not_hold_up_other_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let kiln = Kiln::start(&["--load", "echo"]);
    // About 30 MB of JSON (seconds of decoding in a debug build) declaring one
    // value more than it has: decoded to its end, then a 400.
    let count = 3_000_000usize;
    let mut body = format!(
        r#"{{"inputs":[{{"name":"INPUT0","shape":[1,{}],"datatype":"UINT32","data":["#,
        count + 1
    )
    .into_bytes();
    for i in 0..count {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(format!("{}", 1_000_000 + i).as_bytes());
    }
    body.extend_from_slice(b"]}]}");
    let addr = kiln.url.trim_start_matches("http://").to_owned();
    let mut big = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v2/models/echo/infer HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    big.write_all(head.as_bytes()).await.unwrap();
    // All but its last byte: the server reads it without decoding anything yet.
    let (most, last) = body.split_at(body.len() - 1);
    big.write_all(most).await.unwrap();

    // Small requests on connections of their own, spread over the HTTP workers.
    let small = json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "UINT32",
                                   "data": [[1]]}]});
    let clients: Vec<reqwest::Client> = (0..4).map(|_| reqwest::Client::new()).collect();
    let url = format!("{}/v2/models/echo/infer", kiln.url);
    let send = |client: &reqwest::Client| {
        let request = client.post(&url).body(small.to_string());
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    };
    for client in &clients {
        assert_eq!(send(client).await.unwrap(), 200);
    }
    // The last byte starts the big decode; the small requests are answered while
    // it runs, before the big one's 400.
    big.write_all(last).await.unwrap();
    let mut answer = Vec::new();
    {
        let big_answer = big.read_to_end(&mut answer);
        tokio::pin!(big_answer);
        let smalls: Vec<_> = clients.iter().map(send).collect();
        let all_small = async {
            let mut statuses = Vec::new();
            for small in smalls {
                statuses.push(small.await.unwrap());
            }
            statuses
        };
        tokio::select! {
            statuses = all_small => assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}"),
            _ = &mut big_answer => panic!("the large body was answered before the small requests"),
        }
        big_answer.await.unwrap();
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains(&format!(
            "the shape holds {} elements but data has {count}",
            count + 1
        )),
        "{answer}"
    );
}

/// The requests and answers decoded or encoded on the blocking pool are the same
/// as those done inline: a large JSON answer, and a shared-memory input and output
/// above the copy bound (1 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_and_answers_off_the_io_threads_are_right() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let client = reqwest::Client::new();
    let post = |body: Value| {
        let request = client
            .post(format!("{}/v2/models/echo/infer", kiln.url))
            .body(body.to_string());
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    // 100 000 values: 400 KB of JSON each way.
    let values: Vec<u32> = (0..100_000).collect();
    let (status, v) = post(declared(&[1, 100_000], "UINT32", json!(values))).await;
    assert_eq!(status, 200);
    let data = v["outputs"][0]["data"].as_array().unwrap();
    assert_eq!(data.len(), 100_000);
    assert!(data
        .iter()
        .zip(1u64..)
        .all(|(got, want)| got.as_u64() == Some(want)));

    // 2 MiB in and out of shared memory.
    const COUNT: usize = 512 * 1024;
    let object = kiln_tests::fixtures::ShmObject::new(8 * COUNT);
    let input: Vec<u32> = (0..COUNT as u32).map(|v| v.wrapping_mul(7)).collect();
    object.write_u32(0, &input);
    let response = client
        .post(format!(
            "{}/v2/systemsharedmemory/region/io/register",
            kiln.url
        ))
        .body(json!({"key": object.key, "byte_size": 8 * COUNT}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let place = |offset: usize| {
        json!({"shared_memory_region": "io", "shared_memory_byte_size": 4 * COUNT,
               "shared_memory_offset": offset})
    };
    let body = json!({
        "inputs": [{"name": "INPUT0", "shape": [1, COUNT], "datatype": "UINT32",
                    "parameters": place(0)}],
        "outputs": [{"name": "OUTPUT0", "parameters": place(4 * COUNT)}]});
    let (status, v) = post(body).await;
    assert_eq!(status, 200, "{v}");
    let output = object.read_u32(4 * COUNT, COUNT);
    assert!(output.iter().zip(&input).all(|(o, i)| *o == i + 1));
}
