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

/// The path of `program` on `$PATH` (Debian puts redis-server in /usr/bin).
fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}
