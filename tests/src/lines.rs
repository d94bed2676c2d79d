//! Collects the lines a child writes to a pipe on a thread, so tests can wait for a
//! line ("listening", "ready and serving") with a timeout instead of sleeping, and can
//! show everything a process said when a test fails.

use std::io::{BufRead, BufReader, Read};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

#[derive(Default)]
struct State {
    lines: Vec<String>,
    /// The writer closed the pipe (the process exited or closed the stream).
    eof: bool,
}

/// Lines read so far from one pipe. Cloning shares the same buffer.
#[derive(Clone)]
pub struct Lines {
    label: String,
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl Lines {
    /// Start a thread that reads `reader` line by line until EOF. The thread ends by
    /// itself when the pipe closes, which happens at the latest when the child is killed.
    pub fn collect<R: Read + Send + 'static>(label: &str, reader: R) -> Self {
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let thread_shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            let (state, cv) = &*thread_shared;
            let mut reader = BufReader::new(reader);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let line = strip_ansi(String::from_utf8_lossy(&buf).trim_end());
                        state.lock().unwrap().lines.push(line);
                        cv.notify_all();
                    }
                }
            }
            state.lock().unwrap().eof = true;
            cv.notify_all();
        });
        Lines {
            label: label.to_string(),
            shared,
        }
    }

    /// Every line so far.
    pub fn snapshot(&self) -> Vec<String> {
        self.shared.0.lock().unwrap().lines.clone()
    }

    /// Everything so far as one text block, for error messages.
    pub fn text(&self) -> String {
        self.snapshot().join("\n")
    }

    /// Wait until some line (already read or still to come) satisfies `pred`; fail on
    /// timeout or when the pipe closes first.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        self.wait(timeout, |lines| lines.iter().find(|l| pred(l)).cloned())
    }

    /// Wait for the line with index `index` (0-based) to arrive.
    pub fn wait_line(&self, index: usize, timeout: Duration) -> Result<String> {
        self.wait(timeout, |lines| lines.get(index).cloned())
    }

    /// Wait until the writer closed the pipe (all output has been read).
    pub fn wait_closed(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let (state, cv) = &*self.shared;
        let mut guard = state.lock().unwrap();
        while !guard.eof {
            let now = Instant::now();
            if now >= deadline {
                bail!("{} still open after {timeout:?}", self.label);
            }
            guard = cv.wait_timeout(guard, deadline - now).unwrap().0;
        }
        Ok(())
    }

    fn wait(
        &self,
        timeout: Duration,
        found: impl Fn(&[String]) -> Option<String>,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let (state, cv) = &*self.shared;
        let mut guard = state.lock().unwrap();
        // Bounded: each round either returns or waits at most until the deadline; the
        // short wait slice lets an interrupt (demo Ctrl-C) be noticed.
        loop {
            if let Some(line) = found(&guard.lines) {
                return Ok(line);
            }
            if guard.eof {
                bail!(
                    "{} closed its output before the expected line; it said:\n{}",
                    self.label,
                    guard.lines.join("\n")
                );
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "timed out after {timeout:?} waiting for a line from {}; it said:\n{}",
                    self.label,
                    guard.lines.join("\n")
                );
            }
            crate::interrupt::check()?;
            let slice = (deadline - now).min(Duration::from_millis(200));
            guard = cv.wait_timeout(guard, slice).unwrap().0;
        }
    }
}

/// Remove ANSI escape sequences (colour codes a logger may add), so tests match on the
/// text and logs read cleanly in failure messages.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        // CSI: ESC [ parameters... final byte in '@'..='~'. Other escapes: drop ESC
        // and the next character.
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::strip_ansi;

    #[test]
    fn strips_colour_codes() {
        assert_eq!(
            strip_ansi("\u{1b}[33m WARN\u{1b}[0m \u{1b}[2mlb\u{1b}[0m: demo/web"),
            " WARN lb: demo/web"
        );
        assert_eq!(strip_ansi("plain"), "plain");
    }
}
