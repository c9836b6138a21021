//! A private `redis-server` for the jobs tests: Debian's binary
//! (`scripts/setup-redis` installs it), on a free loopback port, with its own
//! folder under the build directory, killed on drop.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`, killed (and its folder removed) on drop.
pub struct RedisServer {
    child: Child,
    dir: PathBuf,
    /// The server's port on 127.0.0.1.
    pub port: u16,
}

impl RedisServer {
    /// Starts `redis-server` on a free loopback port: no RDB snapshots, the
    /// append-only file on with `appendfsync always` (what kiln's docs tell an
    /// operator who wants an accepted job to survive a Redis crash), and its files
    /// in a folder of its own. Waits until it answers `PING`.
    pub fn start() -> RedisServer {
        let binary = which("redis-server")
            .expect("redis-server is not installed: run scripts/setup-redis (scripts/test does)");
        // A free port: bind port 0, read it, let it go. A race with another
        // process taking it in between shows as a failed start below.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = crate::build_dir()
            .join("redis-test")
            .join(format!("{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis test folder");
        let child = Command::new(binary)
            .current_dir(&dir)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .args(["--daemonize", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let server = RedisServer { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while server.command(&["PING"]).as_deref() != Some("+PONG") {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// The URL kiln's `--jobs` takes (`redis://127.0.0.1:PORT/`).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Sends one command (inline protocol) and returns the first line of the
    /// answer (`+PONG`, `:3`, `$5` ...), `None` when the server cannot be reached.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        self.lines(args, 1).map(|mut lines| lines.remove(0))
    }

    /// The first `n` lines of the answer to one command.
    pub fn lines(&self, args: &[&str], n: usize) -> Option<Vec<String>> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).ok()?;
        let mut reader = BufReader::new(stream);
        let mut lines = Vec::with_capacity(n);
        for _ in 0..n {
            let mut line = String::new();
            reader.read_line(&mut line).ok()?;
            lines.push(line.trim_end().to_owned());
        }
        Some(lines)
    }

    /// Entries read and not acknowledged in `stream`'s group `group` (`XPENDING`).
    pub fn pending(&self, stream: &str, group: &str) -> i64 {
        let lines = self
            .lines(&["XPENDING", stream, group], 2)
            .expect("redis answers");
        lines[1]
            .strip_prefix(':')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("XPENDING answered {lines:?}"))
    }

    /// An integer answer (`XLEN`, `XPENDING`'s count ...); panics on anything else.
    pub fn integer(&self, args: &[&str]) -> i64 {
        let line = self.command(args).expect("redis answers");
        line.strip_prefix(':')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{args:?} answered {line:?}, not an integer"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What a `MONITOR` connection saw: the largest number of commands Redis ran
/// in one atomic step (a `MULTI`/`EXEC` block of one client, or one script's
/// commands, which `MONITOR` tags `lua`), and every command's name with how
/// many times it ran.
#[derive(Debug, Default)]
pub struct Monitored {
    pub largest_step: usize,
    pub counts: std::collections::HashMap<String, usize>,
}

/// A `MONITOR` connection read on a thread of its own until [`Monitor::finish`].
pub struct Monitor {
    thread: std::thread::JoinHandle<Monitored>,
    port: u16,
}

/// The command [`Monitor::finish`] sends to mark the end of what it reads.
const MONITOR_END: &str = "kiln-test-monitor-end";

impl RedisServer {
    /// Starts reading every command Redis runs (`MONITOR`).
    pub fn monitor(&self) -> Monitor {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        stream.write_all(b"MONITOR\r\n").expect("MONITOR");
        let mut reader = BufReader::new(stream);
        let mut ok = String::new();
        reader.read_line(&mut ok).expect("MONITOR answers");
        assert_eq!(ok.trim_end(), "+OK");
        let thread = std::thread::spawn(move || {
            let mut seen = Monitored::default();
            // The current step: whose (a client's MULTI block, or `lua`) and its size.
            let mut multi: std::collections::HashMap<String, usize> = Default::default();
            let mut lua_run = 0usize;
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let text = String::from_utf8_lossy(&line);
                // `+1700000000.123456 [0 127.0.0.1:5555] "CMD" "arg" ...`
                let Some((source, rest)) =
                    text.split_once(" [").and_then(|(_, r)| r.split_once("] "))
                else {
                    continue;
                };
                let source = source.split_once(' ').map_or(source, |(_, s)| s).to_owned();
                let name = rest
                    .split('"')
                    .nth(1)
                    .unwrap_or_default()
                    .to_ascii_uppercase();
                if name == "ECHO" && rest.contains(MONITOR_END) {
                    break;
                }
                *seen.counts.entry(name.clone()).or_default() += 1;
                if source == "lua" {
                    lua_run += 1;
                    seen.largest_step = seen.largest_step.max(lua_run);
                    continue;
                }
                lua_run = 0;
                match name.as_str() {
                    "MULTI" => {
                        multi.insert(source, 0);
                    }
                    "EXEC" | "DISCARD" => {
                        let n = multi.remove(&source).unwrap_or(0);
                        seen.largest_step = seen.largest_step.max(n);
                    }
                    _ => {
                        if let Some(n) = multi.get_mut(&source) {
                            *n += 1;
                        }
                    }
                }
            }
            seen
        });
        Monitor {
            thread,
            port: self.port,
        }
    }
}

impl Monitor {
    /// Marks the end (an `ECHO` the reader stops at) and answers what it saw.
    pub fn finish(self) -> Monitored {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        let mark = format!(
            "*2\r\n$4\r\nECHO\r\n${}\r\n{MONITOR_END}\r\n",
            MONITOR_END.len()
        );
        stream.write_all(mark.as_bytes()).expect("ECHO");
        let mut answer = String::new();
        let _ = BufReader::new(stream).read_line(&mut answer);
        self.thread.join().expect("the MONITOR reader")
    }
}

/// The path of `program` on `$PATH` (Debian puts redis-server in /usr/bin).
fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}
