//! An FFmpeg process's stderr, drained on a thread of its own into a bounded tail,
//! so the process never blocks on a full pipe and an error can quote its words.

use std::io::Read;
use std::process::ChildStderr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// How much of the end of stderr is kept.
const TAIL_BYTES: usize = 4096;

/// The kept end of a process's stderr, read until the process closes it.
pub(crate) struct StderrTail {
    tail: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl StderrTail {
    pub(crate) fn start(mut stderr: ChildStderr) -> StderrTail {
        let tail = Arc::new(Mutex::new(Vec::with_capacity(TAIL_BYTES)));
        let kept = tail.clone();
        let reader = std::thread::Builder::new()
            .name("kiln-ffmpeg-err".into())
            .spawn(move || {
                let mut chunk = [0u8; 1024];
                while let Ok(n) = stderr.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    let mut tail = kept.lock().unwrap_or_else(|e| e.into_inner());
                    tail.extend_from_slice(&chunk[..n]);
                    if tail.len() > TAIL_BYTES {
                        let cut = tail.len() - TAIL_BYTES;
                        tail.drain(..cut);
                    }
                }
            })
            .ok();
        StderrTail { tail, reader }
    }

    /// Waits for the process's stderr to close (the process has exited or been
    /// killed), then gives its last lines.
    pub(crate) fn finish(&mut self) -> String {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.text()
    }

    /// The last non-empty lines kept so far, joined with `; `.
    pub(crate) fn text(&self) -> String {
        let tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let text = String::from_utf8_lossy(&tail);
        let lines: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(tidy)
            .collect();
        let start = lines.len().saturating_sub(3);
        lines[start..].join("; ")
    }
}

impl Drop for StderrTail {
    fn drop(&mut self) {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// `[mov,mp4 @ 0x55d0c0] moov atom not found` → `mov,mp4: moov atom not found`
/// (a memory address tells a client nothing).
fn tidy(line: &str) -> String {
    if let Some(rest) = line.strip_prefix('[') {
        if let (Some(at), Some(end)) = (rest.find(" @ 0x"), rest.find("] ")) {
            if at < end {
                return format!("{}: {}", &rest[..at], &rest[end + 2..]);
            }
        }
    }
    line.to_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn component_addresses_are_left_out() {
        assert_eq!(
            super::tidy("[mov,mp4,m4a @ 0x559a4b5ab980] moov atom not found"),
            "mov,mp4,m4a: moov atom not found"
        );
        assert_eq!(super::tidy("x.mp4: Invalid data"), "x.mp4: Invalid data");
    }
}
