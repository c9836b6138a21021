//! Connections (issue #11, finding 5, and half-closed HTTP clients): gRPC
//! connections that never greet or go idle are closed, a cap on open gRPC
//! connections refuses the extra ones at once while HTTP and fresh clients still
//! get in, the descriptor limit is raised at start, an HTTP connection costs one
//! descriptor, and a half-closed HTTP client gets its answer while one that really
//! left is still cancelled. Raw sockets on loopback against the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::{metric, requests_outcome, GrpcClient, HttpClient, Kiln};

/// The client's HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame: the rest of a valid client greeting.
const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];
/// How long any wait for the server may take before the test fails.
const BOUND: Duration = Duration::from_secs(30);

fn host_port(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// A gRPC connection that greets (preface, SETTINGS) and then sends nothing,
/// once the server is serving it (its SETTINGS frame arrived).
fn greeted_connection(kiln: &Kiln) -> TcpStream {
    let mut s = TcpStream::connect(host_port(&kiln.grpc_url)).unwrap();
    s.write_all(PREFACE).unwrap();
    s.write_all(&EMPTY_SETTINGS).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut header = [0u8; 9];
    s.read_exact(&mut header).unwrap();
    assert_eq!(header[3], 4, "the server's first frame is its SETTINGS");
    s
}

/// Reads until the server closes `s`; panics when it stays open for [`BOUND`].
/// Returns the bytes read.
fn wait_closed(s: &mut TcpStream) -> usize {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut buf = [0u8; 4096];
    let mut read = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return read,
            Ok(n) => read += n,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return read,
            Err(e) => panic!("the connection is still open after {BOUND:?}: {e}"),
        }
    }
}

/// Waits (up to [`BOUND`]) until a fresh gRPC client gets an answer.
async fn wait_grpc_live(kiln: &Kiln) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if let Ok(client) = GrpcClient::connect(&kiln.grpc_url).await {
            if client.is_live().await.unwrap_or(false) {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no gRPC client got in; kiln's log:\n{}",
            kiln.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_connections_that_never_greet_or_go_idle_are_closed() {
    let kiln = Kiln::start(&["--grpc-handshake-timeout", "1", "--grpc-idle-timeout", "1"]);
    let mut silent = TcpStream::connect(host_port(&kiln.grpc_url)).unwrap();
    let mut idle = greeted_connection(&kiln);
    // A client that made a call and then went quiet is closed as well.
    let client = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    assert!(client.is_live().await.unwrap());
    wait_closed(&mut silent);
    wait_closed(&mut idle);
    // The server still takes new clients (tonic reconnects the idle one).
    assert!(client.is_live().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_connection_cap_refuses_at_once_and_both_ports_stay_reachable() {
    let kiln = Kiln::start(&[
        "--grpc-max-connections",
        "3",
        "--grpc-handshake-timeout",
        "2",
        "--grpc-idle-timeout",
        "2",
    ]);
    let mut held: Vec<TcpStream> = (0..3).map(|_| greeted_connection(&kiln)).collect();
    // The fourth is closed before the server says anything: no SETTINGS frame.
    let mut refused = TcpStream::connect(host_port(&kiln.grpc_url)).unwrap();
    let _ = refused.write_all(PREFACE);
    assert_eq!(
        wait_closed(&mut refused),
        0,
        "the extra connection was served"
    );
    // HTTP is untouched by the gRPC flood.
    let http = HttpClient::new(&kiln.url).unwrap();
    assert!(http.is_live().await.unwrap());
    // Once the idle ones time out, a fresh gRPC client gets in.
    for s in &mut held {
        wait_closed(s);
    }
    wait_grpc_live(&kiln).await;
    let log = kiln.log_with("refusing new ones");
    assert!(log.contains("refusing new ones"), "{log}");
}

/// `(soft, hard)` "Max open files" of a process.
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

#[test]
fn descriptor_limit_is_raised_to_the_hard_limit_at_start() {
    let (soft, hard) = open_file_limits(std::process::id());
    assert!(hard > 1024, "this test needs a hard limit above 1024");
    // kiln inherits a soft limit of 1024 (the other tests of this file need fewer).
    let lowered = libc::rlimit {
        rlim_cur: 1024,
        rlim_max: hard,
    };
    // SAFETY: a valid rlimit; lowering the soft limit needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
    let kiln = Kiln::start(&[]);
    let restored = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: as above; back to the limit the test started with.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &restored) };
    assert_eq!(open_file_limits(kiln.pid()), (hard, hard));
    let expected = format!("soft 1024 raised to {hard}");
    let log = kiln.log_with(&expected);
    assert!(log.contains(&expected), "{log}");
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn an_http_connection_costs_one_descriptor() {
    let kiln = Kiln::start(&[]);
    // One connection served first, so that lazily opened descriptors are counted.
    let live = |s: &mut TcpStream| {
        s.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: kiln\r\n\r\n")
            .unwrap();
        s.set_read_timeout(Some(BOUND)).unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    };
    let mut first = TcpStream::connect(host_port(&kiln.url)).unwrap();
    live(&mut first);
    let before = open_descriptors(kiln.pid());
    const N: usize = 32;
    let mut open: Vec<TcpStream> = (0..N)
        .map(|_| TcpStream::connect(host_port(&kiln.url)).unwrap())
        .collect();
    // Each connection answered once, so each is accepted and set up.
    for s in &mut open {
        live(s);
    }
    let grown = open_descriptors(kiln.pid()) - before;
    assert!(
        (N..N + N / 4).contains(&grown),
        "{N} keep-alive connections took {grown} descriptors"
    );
    live(&mut first);
}

/// `POST /v2/models/faulty/infer` of one INT32 value, as raw HTTP/1.1.
fn raw_infer(value: i32) -> Vec<u8> {
    let body = format!(
        r#"{{"inputs":[{{"name":"INPUT0","shape":[1,1],"datatype":"INT32","data":[{value}]}}]}}"#
    );
    format!(
        "POST /v2/models/faulty/infer HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_http_client_gets_its_answer() {
    let kiln = Kiln::start(&["--load", "faulty"]);
    let addr = host_port(&kiln.url).to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        // -3 takes the worker 1 s: the end of stream arrives while it waits.
        s.write_all(&raw_infer(-3)).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        s.set_read_timeout(Some(BOUND)).unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).unwrap();
        String::from_utf8(answer).unwrap()
    })
    .await
    .unwrap();
    // Interim answers (100 Continue) may come first; the final one is a 200.
    let last = answer
        .match_indices("HTTP/1.1 ")
        .last()
        .map(|(i, _)| &answer[i..])
        .unwrap_or_default();
    assert!(last.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(last.contains("\"data\":[-3]"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_client_that_closes_its_socket_is_still_cancelled() {
    let kiln = Kiln::start(&[
        "--load",
        "faulty:batcher=dynamic,batch_size=1,max_buffers=1",
    ]);
    let c = kiln.client.clone();
    let pending = |n: f64| {
        let c = c.clone();
        async move {
            for _ in 0..3000 {
                let text = c.metrics().await.unwrap();
                if metric(&text, "kiln_pending_requests", &[("model", "faulty")]) == Some(n) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("never {n} pending requests");
        }
    };
    // The slow request holds the only buffer set for 1 s.
    let slow = {
        let c = c.clone();
        tokio::spawn(async move {
            let r = InferRequest {
                model: "faulty".into(),
                inputs: vec![InputTensor::from_slice(
                    "INPUT0",
                    DataType::Int32,
                    &[1, 1],
                    &[-3i32],
                )],
                ..Default::default()
            };
            c.infer(&r).await
        })
    };
    pending(1.0).await;
    let mut quitter = TcpStream::connect(host_port(&kiln.url)).unwrap();
    quitter.write_all(&raw_infer(7)).unwrap();
    pending(2.0).await;
    drop(quitter);
    // Cancelled before it is batched: never run.
    slow.await.unwrap().unwrap();
    let mut outcome = None;
    for _ in 0..3000 {
        let text = c.metrics().await.unwrap();
        outcome = requests_outcome(&text, "faulty", "cancelled");
        if outcome == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(outcome, Some(1.0), "{}", kiln.log());
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, "faulty", "success"), Some(1.0));
}

/// Connections waiting in the accept queue of the listening socket on `port`
/// (`/proc/net/tcp`: `rx_queue` of the LISTEN entry).
fn accept_queue(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(fields[1].rsplit(':').next()?, 16).ok()?;
            if local_port != port || fields[3] != "0A" {
                return None;
            }
            usize::from_str_radix(fields[4].split(':').nth(1)?, 16).ok()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connections_beyond_the_cap_wait_and_grpc_is_untouched() {
    // Two workers (Kiln::start), one connection each.
    let kiln = Kiln::start(&["--http-max-connections", "2"]);
    let addr = host_port(&kiln.url).to_owned();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let request = b"GET /v2/health/live HTTP/1.1\r\nHost: kiln\r\n\r\n";
    let answered = |s: &mut TcpStream| {
        s.set_read_timeout(Some(BOUND)).unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    };
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(request).unwrap();
            answered(&mut s);
            s
        })
        .collect();
    // The third waits in the listen backlog: kiln gives it no descriptor.
    let mut third = TcpStream::connect(&addr).unwrap();
    third.write_all(request).unwrap();
    let deadline = std::time::Instant::now() + BOUND;
    while accept_queue(port) != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection over the cap was accepted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The gRPC port is not affected; the held connections are still served, and
    // the third still waits (an accept would have taken it long before).
    let grpc = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    assert!(grpc.is_live().await.unwrap());
    for s in &mut held {
        s.write_all(request).unwrap();
        answered(s);
    }
    assert_eq!(
        accept_queue(port),
        1,
        "the connection over the cap was accepted"
    );
    // Once a connection closes, the waiting one is served.
    drop(held.pop());
    answered(&mut third);
}

/// The timer of kiln's end of the connection from local port `client` to kiln's
/// `server` port (`/proc/net/tcp`'s `tr`: 2 the keepalive timer, 0 none, 1 a
/// retransmission).
fn server_side_timer(server: u16, client: u16) -> Option<u8> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port = |field: &str| u16::from_str_radix(field.rsplit(':').next()?, 16).ok();
        if port(fields[1])? != server || port(fields[2])? != client {
            return None;
        }
        u8::from_str_radix(fields[5].split(':').next()?, 16).ok()
    })
}

/// Triton's `--grpc-keepalive-time` probes an idle connection (TCP keepalive,
/// which the kernel runs at no cost per call); 0 turns it off.
#[test]
fn grpc_connections_are_probed_by_keepalive_unless_it_is_off() {
    for (time, timer) in [("60000", 2), ("0", 0)] {
        let kiln = Kiln::start(&["--grpc-keepalive-time", time]);
        let s = greeted_connection(&kiln);
        let server: u16 = host_port(&kiln.grpc_url)
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let client = s.local_addr().unwrap().port();
        let started = std::time::Instant::now();
        let mut last = None;
        while started.elapsed() < BOUND {
            last = server_side_timer(server, client);
            if last == Some(timer) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(last, Some(timer), "--grpc-keepalive-time {time}");
    }
}
