//! What `lb-probe` reports (one JSON object per run). Shared by the probe, which
//! writes it, and the tests and demo, which read it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Counts of a probe run, common to every mode.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Tally {
    /// Attempts made (connections or datagrams).
    pub attempts: u32,
    /// Attempts that got a backend name back.
    pub answered: u32,
    /// Backend name -> number of answers from it.
    pub backends: BTreeMap<String, u32>,
    /// errno name (`ECONNREFUSED`, `EHOSTUNREACH`, `EAGAIN` for a receive timeout,
    /// `ETIMEDOUT` for a connect timeout, `EOF`) -> number of failed attempts.
    pub errors: BTreeMap<String, u32>,
    /// The first few failures in full ("connect: ECONNREFUSED ..."), for messages.
    pub error_samples: Vec<String>,
}

impl Tally {
    const MAX_SAMPLES: usize = 5;

    pub fn answer(&mut self, name: &str) {
        self.answered += 1;
        *self.backends.entry(name.to_string()).or_default() += 1;
    }

    pub fn error(&mut self, op: &str, errno_name: String, detail: &str) {
        if self.error_samples.len() < Self::MAX_SAMPLES {
            self.error_samples
                .push(format!("{op}: {errno_name} ({detail})"));
        }
        *self.errors.entry(errno_name).or_default() += 1;
    }

    /// Number of failures with this errno name.
    pub fn errors_of(&self, errno_name: &str) -> u32 {
        self.errors.get(errno_name).copied().unwrap_or(0)
    }

    /// Backend names that answered.
    pub fn names(&self) -> BTreeSet<&str> {
        self.backends.keys().map(String::as_str).collect()
    }
}

/// `lb-probe tcp`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TcpReport {
    #[serde(flatten)]
    pub tally: Tally,
    /// Distinct `getpeername()` results of the connected sockets ("ip:port").
    pub peers: BTreeSet<String>,
    /// Longest connect() of all attempts, failed ones included, in milliseconds.
    pub max_connect_ms: f64,
}

/// `lb-probe udp` (unconnected sendto/recvfrom).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct UdpReport {
    #[serde(flatten)]
    pub tally: Tally,
    /// Distinct source addresses `recvfrom()` reported ("ip:port").
    pub sources: BTreeSet<String>,
    /// For each socket used, the distinct backend names it got answers from.
    pub per_socket: Vec<BTreeSet<String>>,
}

/// `lb-probe udp-connected`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct UdpConnectedReport {
    #[serde(flatten)]
    pub tally: Tally,
    /// Distinct `getpeername()` results of the connected sockets.
    pub peers: BTreeSet<String>,
}

/// First line of `lb-probe hold`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HoldHello {
    pub backend: String,
}
