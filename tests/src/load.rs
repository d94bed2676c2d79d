//! `lb-load`: continuous TCP load through a Service VIP while the agent is restarted
//! or the endpoints change. The binary writes one JSON object per stdout line (the
//! [`LoadLine`] events); tests read them through [`LoadRun`].
//!
//! - `ready` once the long-lived connections are open (and said who they reached);
//! - `progress` every `--progress-ms`, so a test can wait for the load to have moved
//!   on by some amount of its own time instead of sleeping;
//! - `report` at the end: every attempt, its outcome by errno name, and what happened
//!   to each long-lived connection.
//!
//! It stops on a `stop` line or EOF on stdin, or after `--max-duration-ms`.

use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::cgroup::Cgroup;
use crate::netns::NetNs;
use crate::process::{Child, Spawner};

/// One line of `lb-load` output.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum LoadLine {
    Ready { long_lived: Vec<LongLivedHello> },
    Progress(Progress),
    Report(LoadReport),
}

/// A long-lived connection right after it was opened.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LongLivedHello {
    /// Greeting of the backend (its pod name); empty if the connection failed.
    pub backend: String,
    /// Local address ("ip:port").
    pub local: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Progress {
    /// Milliseconds since the load started (its own clock).
    pub elapsed_ms: u64,
    pub attempts: u64,
    pub successes: u64,
    pub failures: u64,
    /// Long-lived connections broken so far.
    pub broken: u64,
}

/// What happened to one long-lived connection.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LongLivedReport {
    pub backend: String,
    pub local: String,
    /// Lines sent and answered correctly.
    pub exchanges: u64,
    /// Why it broke (`EOF`, `ECONNRESET`, `mismatch: ...`, `open: ...`), if it did.
    pub broken: Option<String>,
    /// When it broke, in the load's own milliseconds.
    pub broken_at_ms: Option<u64>,
}

/// One failed short connection (the first few are kept in full).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FailureSample {
    pub at_ms: u64,
    pub op: String,
    pub error: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LoadReport {
    pub elapsed_ms: u64,
    /// Short connections started (connect, read the greeting, close).
    pub attempts: u64,
    /// Those that got a greeting.
    pub successes: u64,
    /// errno name (`ECONNREFUSED`, `EHOSTUNREACH`, `ETIMEDOUT`, `EOF`, ...) -> count.
    pub failures: BTreeMap<String, u64>,
    pub failure_samples: Vec<FailureSample>,
    /// Backend name -> short connections it greeted.
    pub backends: BTreeMap<String, u64>,
    /// Longest connect() of all short attempts, in milliseconds.
    pub max_connect_ms: f64,
    pub long_lived: Vec<LongLivedReport>,
}

impl LoadReport {
    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }

    pub fn broken(&self) -> impl Iterator<Item = &LongLivedReport> {
        self.long_lived.iter().filter(|l| l.broken.is_some())
    }

    /// Zero failed connections and no broken long-lived one, and the load really
    /// ran: at least `min_attempts` short connections, and every long-lived one
    /// exchanged a line.
    pub fn check_clean(&self, min_attempts: u64) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.failed() == 0 && self.successes == self.attempts,
            "connections failed: {self:#?}"
        );
        let broken: Vec<_> = self.broken().collect();
        anyhow::ensure!(
            broken.is_empty(),
            "long-lived connections broke: {broken:#?}"
        );
        anyhow::ensure!(
            self.attempts >= min_attempts,
            "the load made only {} attempts: {self:#?}",
            self.attempts
        );
        anyhow::ensure!(
            self.long_lived.iter().all(|l| l.exchanges > 0),
            "a long-lived connection never exchanged a line: {self:#?}"
        );
        Ok(())
    }
}

/// How to run `lb-load`.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub to: SocketAddrV4,
    /// Long-lived connections kept open for the whole run.
    pub long_lived: u32,
    /// Pause between the lines a long-lived connection exchanges.
    pub interval: Duration,
    /// Threads opening short connections.
    pub workers: u32,
    /// Pause of each worker between two short connections (keeps the rate, and the
    /// TIME_WAIT sockets it leaves, bounded).
    pub pause: Duration,
    /// Hard bound on the run, whatever the test does.
    pub max_duration: Duration,
}

impl LoadSpec {
    pub fn new(to: SocketAddrV4) -> Self {
        LoadSpec {
            to,
            long_lived: 10,
            interval: Duration::from_millis(50),
            workers: 2,
            pause: Duration::from_millis(3),
            max_duration: Duration::from_secs(120),
        }
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--to".into(),
            self.to.to_string(),
            "--long-lived".into(),
            self.long_lived.to_string(),
            "--interval-ms".into(),
            self.interval.as_millis().to_string(),
            "--workers".into(),
            self.workers.to_string(),
            "--pause-ms".into(),
            self.pause.as_millis().to_string(),
            "--max-duration-ms".into(),
            self.max_duration.as_millis().to_string(),
        ]
    }
}

/// A running `lb-load` (killed on drop if not stopped).
pub struct LoadRun {
    child: Child,
    /// The long-lived connections as opened.
    pub long_lived: Vec<LongLivedHello>,
    max_duration: Duration,
}

/// Opening the long-lived connections is local and quick; this is generous.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

impl LoadRun {
    /// Start `lb-load` in `netns` and `cgroup` and wait for its `ready` line.
    pub fn start(
        bin: &std::path::Path,
        netns: &NetNs,
        cgroup: &Cgroup,
        spec: &LoadSpec,
    ) -> Result<Self> {
        let child = Spawner::new(bin)
            .label(format!("lb-load in {}", netns.name()))
            .cgroup(cgroup)?
            .netns(netns)?
            .args(spec.args())
            .stdin_piped()
            .spawn()?;
        let line = child
            .stdout
            .wait_for(READY_TIMEOUT, |l| l.contains("\"ready\""))
            .context("waiting for lb-load to open its long-lived connections")?;
        let long_lived = match serde_json::from_str(&line)? {
            LoadLine::Ready { long_lived } => long_lived,
            other => bail!("unexpected first line of lb-load: {other:?}"),
        };
        Ok(LoadRun {
            child,
            long_lived,
            max_duration: spec.max_duration,
        })
    }

    /// The latest progress line.
    pub fn progress(&self) -> Option<Progress> {
        self.child
            .stdout
            .snapshot()
            .iter()
            .rev()
            .find_map(|l| match serde_json::from_str(l) {
                Ok(LoadLine::Progress(p)) => Some(p),
                _ => None,
            })
    }

    /// Wait until a progress line satisfies `pred` (bounded by `timeout`); returns it.
    pub fn wait_progress(
        &self,
        timeout: Duration,
        pred: impl Fn(&Progress) -> bool,
    ) -> Result<Progress> {
        let line = self.child.stdout.wait_for(
            timeout,
            |l| matches!(serde_json::from_str(l), Ok(LoadLine::Progress(p)) if pred(&p)),
        )?;
        match serde_json::from_str(&line)? {
            LoadLine::Progress(p) => Ok(p),
            _ => unreachable!("matched a progress line"),
        }
    }

    /// Wait until the load has run `more` of its own time past now.
    pub fn run_for(&self, more: Duration) -> Result<Progress> {
        let now = self.progress().map_or(0, |p| p.elapsed_ms);
        let until = now + u64::try_from(more.as_millis())?;
        self.wait_progress(more + Duration::from_secs(10), |p| p.elapsed_ms >= until)
    }

    /// Tell it to stop; return its report.
    pub fn stop(mut self) -> Result<LoadReport> {
        // It may have stopped by itself (max duration): the report is there anyway.
        let _ = self.child.write_stdin("stop\n");
        // Long-lived connections finish their current exchange (bounded by their
        // read timeout) before the report.
        let grace = Duration::from_secs(15);
        let status = self.child.wait_timeout(grace)?;
        let Some(status) = status else {
            bail!(
                "lb-load did not stop within {grace:?} (max duration {:?}); stderr:\n{}",
                self.max_duration,
                self.child.stderr.text()
            );
        };
        self.child.stdout.wait_closed(Duration::from_secs(5))?;
        let lines = self.child.stdout.snapshot();
        let report = lines
            .iter()
            .rev()
            .find_map(|l| match serde_json::from_str(l) {
                Ok(LoadLine::Report(r)) => Some(r),
                _ => None,
            });
        match report {
            Some(r) if status.success() => Ok(r),
            _ => bail!(
                "lb-load exited with {status} without a report; stderr:\n{}",
                self.child.stderr.text()
            ),
        }
    }
}
