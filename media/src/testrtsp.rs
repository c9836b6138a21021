//! A tiny RTSP server for tests (the media crate's and the end-to-end ones): it
//! answers each request as the test says and records what it was asked, plus a
//! listener that counts who connects to it (where a redirect points).

use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A request's header lines, as the server read them.
pub type Request = Vec<String>;

/// How the server answers: `(method, cseq)` → the whole answer.
pub type Answer = Arc<dyn Fn(&str, &str) -> String + Send + Sync>;

/// An RTSP server on 127.0.0.1 that runs until the test ends.
pub struct RtspServer {
    pub port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl RtspServer {
    /// Listens on a free port of 127.0.0.1 and answers with `answer`.
    pub fn start(answer: Answer) -> io::Result<RtspServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (log, answer) = (log.clone(), answer.clone());
                std::thread::spawn(move || serve(conn, &*answer, &log));
            }
        });
        Ok(RtspServer { port, requests })
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn serve(
    conn: TcpStream,
    answer: &(dyn Fn(&str, &str) -> String + Send + Sync),
    log: &Mutex<Vec<Request>>,
) {
    let Ok(mut writer) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    loop {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end().to_owned();
            if line.is_empty() {
                break;
            }
            lines.push(line);
        }
        let method = lines
            .first()
            .and_then(|l| l.split(' ').next())
            .unwrap_or("")
            .to_owned();
        let cseq = lines
            .iter()
            .find_map(|l| l.strip_prefix("CSeq: "))
            .unwrap_or("0")
            .to_owned();
        log.lock().unwrap_or_else(|e| e.into_inner()).push(lines);
        if writer.write_all(answer(&method, &cseq).as_bytes()).is_err() {
            return;
        }
    }
}

/// The answer to OPTIONS.
pub fn options(cseq: &str) -> String {
    format!("RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nPublic: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN\r\n\r\n")
}

/// A server that answers DESCRIBE (and anything after OPTIONS) with a 302 to
/// `location`.
pub fn redirecting(location: String) -> Answer {
    Arc::new(move |method, cseq| match method {
        "OPTIONS" => options(cseq),
        _ => format!(
            "RTSP/1.0 302 Moved Temporarily\r\nCSeq: {cseq}\r\nLocation: {location}\r\n\r\n"
        ),
    })
}

/// A listener on `ip` that counts the connections made to it.
pub struct Trap {
    pub port: u16,
    hits: Arc<AtomicUsize>,
}

impl Trap {
    /// Listens on a free port of `ip` (127.0.0.2, say: another loopback host).
    pub fn start(ip: IpAddr) -> io::Result<Trap> {
        let listener = TcpListener::bind((ip, 0))?;
        let port = listener.local_addr()?.port();
        let hits = Arc::new(AtomicUsize::new(0));
        let count = hits.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                count.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        Ok(Trap { port, hits })
    }

    /// Connections so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}
