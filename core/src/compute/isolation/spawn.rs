//! Starting and ending a `kiln worker-host` process: its command line, clean
//! environment and inherited descriptors, its stderr read into the server's log,
//! and how it ended, in words.

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::arena::Arena;
use super::{host_program, passes_environment};

/// One running `kiln worker-host`.
pub struct Host {
    pub child: Child,
    pub socket: UnixStream,
    pub arena: Arena,
}

/// Starts `kiln worker-host` for `model`: a clean environment (see
/// [`passes_environment`]), the control socket and the arena as its only
/// inherited descriptors, killed when the server dies (`PR_SET_PDEATHSIG`; it
/// also exits when its socket closes), its stderr read into the server's log;
/// its private memory bounded to `max_memory` bytes (`RLIMIT_DATA`: an allocation
/// past it fails in the host, whose worker then fails its batch or crashes).
pub fn spawn(model: &str, max_memory: Option<usize>) -> Result<Host, String> {
    let failed = |what: &str, e: std::io::Error| {
        format!("cannot start a worker host for model `{model}`: {what}: {e}")
    };
    let program = host_program()?;
    let arena = Arena::create().map_err(|e| failed("shared memory", e))?;
    let (ours, theirs) = UnixStream::pair().map_err(|e| failed("socket", e))?;
    let (control_fd, arena_fd) = (theirs.as_raw_fd(), arena.fd());
    let server = std::process::id() as libc::pid_t;
    let mut command = Command::new(&program);
    command
        .arg("worker-host")
        .arg("--control-fd")
        .arg(control_fd.to_string())
        .arg("--arena-fd")
        .arg(arena_fd.to_string())
        .env_clear()
        .envs(std::env::vars_os().filter(|(k, _)| passes_environment(k)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            for fd in [control_fd, arena_fd] {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(max) = max_memory {
                let max = max as libc::rlim_t;
                let limit = libc::rlimit {
                    rlim_cur: max,
                    rlim_max: max,
                };
                if libc::setrlimit(libc::RLIMIT_DATA, &limit) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The server died before the line above: nobody would kill us.
            if libc::getppid() != server {
                return Err(std::io::Error::other("the server is gone"));
            }
            Ok(())
        });
    }
    let mut child = command
        .spawn()
        .map_err(|e| failed(&program.display().to_string(), e))?;
    drop(theirs);
    if let Some(stderr) = child.stderr.take() {
        let label = format!("worker host `{model}` pid {}", child.id());
        let _ = std::thread::Builder::new()
            .name("kiln-host-log".into())
            .spawn(move || forward_log(&label, stderr));
    }
    Ok(Host {
        child,
        socket: ours,
        arena,
    })
}

/// Copies a host's stderr into the server's log, line by line: a plugin's
/// record (`kiln-log <level> ...`) at its level, anything else (a panic message,
/// an abort's) as a warning.
fn forward_log(label: &str, stderr: impl std::io::Read) {
    let mut reader = BufReader::new(stderr);
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line).unwrap_or(0) > 0 {
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        let level = text
            .strip_prefix("kiln-log ")
            .and_then(|rest| rest.split_once(' '))
            .and_then(|(level, message)| Some((level.parse::<u8>().ok()?, message)));
        match level {
            Some((level, message)) => {
                let level = match level {
                    1 => spdlog::Level::Error,
                    2 => spdlog::Level::Warn,
                    3 => spdlog::Level::Info,
                    4 => spdlog::Level::Debug,
                    _ => spdlog::Level::Trace,
                };
                spdlog::log!(level, "[{label}] {message}");
            }
            None => spdlog::warn!("[{label}] {text}"),
        }
        line.clear();
    }
}

/// The child's exit status once it has exited, waiting at most `within`.
pub fn reap(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            _ => return None,
        }
    }
}

/// How a host ended, in words: `killed by signal 11 (SIGSEGV)`, `exited with status 3`.
pub fn describe(status: ExitStatus) -> String {
    if let Some(signal) = status.signal() {
        let name = match signal {
            libc::SIGSEGV => "SIGSEGV",
            libc::SIGABRT => "SIGABRT",
            libc::SIGBUS => "SIGBUS",
            libc::SIGILL => "SIGILL",
            libc::SIGFPE => "SIGFPE",
            libc::SIGKILL => "SIGKILL",
            libc::SIGTERM => "SIGTERM",
            _ => "signal",
        };
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        format!("killed by signal {signal} ({name}{core})")
    } else {
        format!("exited with status {}", status.code().unwrap_or(-1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ending_is_described_by_its_signal_or_status() {
        let status = |script: &str| Command::new("sh").args(["-c", script]).status().unwrap();
        assert_eq!(
            describe(status("kill -SEGV $$")),
            "killed by signal 11 (SIGSEGV)"
        );
        assert!(describe(status("kill -ABRT $$")).starts_with("killed by signal 6 (SIGABRT"));
        assert_eq!(describe(status("exit 3")), "exited with status 3");
    }

    #[test]
    fn the_environment_is_an_allow_list() {
        for passed in ["PATH", "KILN_CACHE", "KILN_ONNXRUNTIME", "LD_LIBRARY_PATH"] {
            assert!(passes_environment(passed.as_ref()), "{passed}");
        }
        for kept in [
            "AWS_SECRET_ACCESS_KEY",
            "LD_PRELOAD",
            "SSH_AUTH_SOCK",
            "kiln_x",
        ] {
            assert!(!passes_environment(kept.as_ref()), "{kept}");
        }
    }
}
