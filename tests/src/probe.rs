//! What `lb-probe` reports (one JSON object per run). Shared by the probe, which
//! writes it, and the tests and demo, which read it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

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
    /// The connection's local address (`getsockname`, "ip:port").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<String>,
}

/// One line of `lb-probe udp-follow`: the backend that answered (printed when it
/// differs from the last one), or a failed call (after which the probe connects a
/// new socket to the same address).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FollowEvent {
    /// Milliseconds since the probe started.
    pub at_ms: u64,
    /// Which socket of the probe (counting from 0).
    pub socket: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// The call that failed and its errno name (`send ECONNABORTED`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One answer of an lb-echo `--whoami-port`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct WhoamiAnswer {
    /// The backend that answered.
    pub backend: String,
    /// The client address as the backend saw it ("ip:port").
    pub seen: String,
    /// The client's own local address ("ip:port").
    pub local: String,
    /// TCP: `getpeername()`; UDP: the source of the answer (`recvfrom`).
    pub peer: String,
}

impl WhoamiAnswer {
    /// The IP part of `seen`.
    pub fn seen_ip(&self) -> Option<IpAddr> {
        self.seen.parse::<SocketAddr>().ok().map(|a| a.ip())
    }

    /// Whether the backend saw the client's own port.
    pub fn port_kept(&self) -> bool {
        let port = |s: &str| s.parse::<SocketAddr>().ok().map(|a| a.port());
        port(&self.seen).is_some() && port(&self.seen) == port(&self.local)
    }
}

/// `lb-probe whoami`: TCP connections (or UDP datagrams) to a whoami port.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WhoamiReport {
    #[serde(flatten)]
    pub tally: Tally,
    pub answers: Vec<WhoamiAnswer>,
    /// Longest connect() of all attempts (TCP), failed ones included, in milliseconds.
    pub max_connect_ms: f64,
}

impl WhoamiReport {
    /// Distinct client IPs that `backend` saw.
    pub fn seen_ips(&self, backend: &str) -> BTreeSet<IpAddr> {
        self.answers
            .iter()
            .filter(|a| a.backend == backend)
            .filter_map(WhoamiAnswer::seen_ip)
            .collect()
    }

    /// Distinct peers (`getpeername`/`recvfrom` source) over all answers.
    pub fn peers(&self) -> BTreeSet<&str> {
        self.answers.iter().map(|a| a.peer.as_str()).collect()
    }
}

/// One target of `lb-probe reach`: who answered, or why nothing did.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ReachResult {
    /// `tcp` or `udp`.
    pub protocol: String,
    pub to: SocketAddr,
    /// The name the server gave (lb-echo's greeting or UDP answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// The failed call and its errno name (`connect ETIMEDOUT`, `recv EAGAIN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How long the attempt took, in milliseconds.
    pub ms: f64,
}

/// `lb-probe reach`: one attempt per target, all at once, in the order given.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ReachReport {
    pub results: Vec<ReachResult>,
}

/// `lb-probe bulk`: one TCP connection that sends a pseudo-random stream and checks
/// that exactly the same bytes come back.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BulkReport {
    /// Greeting of the backend (its name); empty if the connection failed first.
    pub backend: String,
    pub peer: String,
    pub local: String,
    pub bytes_sent: u64,
    /// Bytes received back and compared equal (a prefix of the stream).
    pub bytes_verified: u64,
    /// Offset of the first byte that came back different, if any.
    pub mismatch_at: Option<u64>,
    /// Why the transfer stopped early, if it did.
    pub error: Option<String>,
    pub elapsed_ms: f64,
}

impl BulkReport {
    /// Everything sent came back, byte for byte, and nothing else.
    pub fn complete(&self, bytes: u64) -> bool {
        self.error.is_none()
            && self.mismatch_at.is_none()
            && self.bytes_sent == bytes
            && self.bytes_verified == bytes
    }
}

/// `lb-probe udp-echo`: large datagrams to an lb-echo `--bulk-port` (UDP side).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct UdpEchoReport {
    /// An answer counts as answered only when it echoed the datagram byte for byte;
    /// a changed echo is the error `MISMATCH`.
    #[serde(flatten)]
    pub tally: Tally,
    /// Distinct source addresses `recvfrom()` reported ("ip:port").
    pub sources: BTreeSet<String>,
    /// Size of each datagram sent (bytes of UDP payload).
    pub size: usize,
}

/// The byte stream of `lb-probe bulk`: xorshift64* from a seed, so the receiver can
/// regenerate and compare what it expects without keeping a copy.
#[derive(Clone, Debug)]
pub struct PatternStream {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl PatternStream {
    pub fn new(seed: u64) -> Self {
        PatternStream {
            // xorshift must not start at 0.
            state: (seed ^ 0x9e37_79b9_7f4a_7c15) | 1,
            word: [0; 8],
            used: 8,
        }
    }

    /// Fill `buf` with the next bytes of the stream.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            if self.used == 8 {
                self.state ^= self.state >> 12;
                self.state ^= self.state << 25;
                self.state ^= self.state >> 27;
                self.word = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
                self.used = 0;
            }
            *b = self.word[self.used];
            self.used += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PatternStream;

    #[test]
    fn pattern_is_deterministic_whatever_the_chunking() {
        let mut whole = vec![0u8; 1000];
        PatternStream::new(7).fill(&mut whole);
        let mut pieces = vec![0u8; 1000];
        let mut s = PatternStream::new(7);
        for chunk in pieces.chunks_mut(13) {
            s.fill(chunk);
        }
        assert_eq!(whole, pieces);
        let mut other = vec![0u8; 1000];
        PatternStream::new(8).fill(&mut other);
        assert_ne!(whole, other);
        // Not trivially repetitive.
        assert!(whole.windows(8).take(100).any(|w| w != &whole[..8]));
    }
}

/// One attempt of `lb-probe tcp-seq` (a connection) or `udp-seq` (a datagram
/// from a new connected socket).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SeqAttempt {
    /// When the attempt began, in milliseconds since the probe's first.
    pub at_ms: f64,
    /// How long it took to learn the outcome, failed ones included, in
    /// milliseconds: the connect (tcp-seq), or from the send to the answer or the
    /// error (udp-seq, where a closed port shows as ECONNREFUSED on the receive).
    pub connect_ms: f64,
    /// The backend that answered (its greeting, or its UDP answer).
    pub backend: Option<String>,
    /// The errno name of the call that failed (`ECONNREFUSED`; `EAGAIN` for a
    /// UDP answer that did not come in time, ...).
    pub error: Option<String>,
    /// The client's own port for the attempt (0 when no socket got that far): a
    /// failure on a port an earlier attempt used may have followed that flow.
    #[serde(default)]
    pub local_port: u16,
}

/// `lb-probe tcp-seq` / `udp-seq`: attempts one after another, each reported in
/// order.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SeqReport {
    pub attempts: Vec<SeqAttempt>,
}

impl SeqReport {
    /// The first failed attempt's index, if any failed.
    pub fn first_failure(&self) -> Option<usize> {
        self.attempts.iter().position(|a| a.error.is_some())
    }
}
