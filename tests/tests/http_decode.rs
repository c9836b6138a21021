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
