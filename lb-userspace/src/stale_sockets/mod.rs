//! Sockets that follow endpoint removal.
//!
//! The socket hooks pick a backend once, at `connect()`. kube-proxy's NAT picks per
//! flow and deletes the UDP conntrack entries of a removed endpoint, so a client's
//! next datagram is balanced anew; a socket the hooks connected would instead keep
//! talking to the removed endpoint for as long as it lives (DNS clients, QUIC,
//! statsd). So when an endpoint leaves a Service, the agent closes the sockets the
//! hooks connected to it through that Service, with sock_diag's `SOCK_DESTROY`
//! (what `ss -K` does): a call blocked on the socket fails with ECONNABORTED, the
//! next send with EDESTADDRREQ (a UDP socket is left unconnected), and the owner
//! reconnects through the Service. TCP connections are left alone unless
//! `--terminate-tcp-to-removed-endpoints` says otherwise (kube-proxy leaves them
//! too); closing one sends its peer a RST.
//!
//! Which sockets: `LB_SOCK_REVNAT` records, per socket cookie, the backend the hooks
//! chose and the frontend the socket asked for, so exactly those sockets are closed,
//! never one that reached the pod's address on its own. Sockets live in their
//! owners' network namespaces; the agent looks in each namespace that a process of
//! the hooked cgroup is in. Needs a kernel built with `CONFIG_INET_DIAG_DESTROY`
//! (no kfunc or BPF iterator support, unlike `bpf_sock_destroy`, which needs 6.5);
//! without it the agent says so once and such sockets stay where they are, as
//! before. Unconnected UDP sockets need nothing
//! closed: they pick among the remaining backends on their next send; their
//! reverse-translation entries for the removed endpoint are deleted.
//!
//! The work runs on a thread of its own after the change is in the maps: closing
//! sockets never delays the next change. Closing needs no walk of the map: the
//! namespaces' sockets are listed, and only those whose peer departed are looked up
//! (by cookie and peer) in `LB_SOCK_REVNAT`; passes run at most every
//! [`CLOSE_EVERY`], so a churn of endpoints costs a bounded share of a CPU. The
//! entries of unconnected sockets are found by reading the whole map, which the
//! sweep does at most every [`SWEEP_EVERY`] for what departed meanwhile.

mod departed;
mod diag;
mod netns;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use lb_common::SockRevNatKey;
use tracing::{debug, info, warn};

pub use departed::{stale_entries, Departed, Departures, Touched};
use diag::{Diag, DiagError, FAMILIES};

use crate::datapath::codec::Be16;
use crate::datapath::maps::{MapsError, SockRevNatMap};
use crate::datapath::pins::PinLayout;
use crate::model::Protocol;
use crate::ops::AgentStatus;

/// Least time between two passes that close sockets: departures meanwhile go
/// into one pass. Well inside the second a client may take to notice.
pub const CLOSE_EVERY: Duration = Duration::from_millis(100);
/// Least time between two sweeps of `LB_SOCK_REVNAT` for the entries of departed
/// backends (a batched read of the whole map; with closing and sweeping so
/// bounded, the thread had 2.2% of the CPU samples under the bench's churn).
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("cannot start the thread that closes sockets of removed endpoints: {0}")]
    Thread(#[source] std::io::Error),
}

/// Where the hooked sockets are and which ones to close.
#[derive(Clone, Debug)]
pub struct ReaperConfig {
    pub pin: PinLayout,
    /// The cgroup the socket hooks are attached to.
    pub cgroup: PathBuf,
    /// Close TCP connections to removed endpoints too.
    pub close_tcp: bool,
}

/// Hands departed endpoints to the closing thread.
pub struct Reaper {
    tx: mpsc::Sender<Vec<Departed>>,
}

impl Reaper {
    pub fn spawn(config: ReaperConfig, status: Arc<AgentStatus>) -> Result<Self, ReaperError> {
        let mut map = SockRevNatMap::open(&config.pin)?;
        let (tx, rx) = mpsc::channel::<Vec<Departed>>();
        std::thread::Builder::new()
            .name("lb-stale-sockets".into())
            .spawn(move || {
                // Background work: a change the agent is applying must not wait for
                // a sweep on a busy CPU (it showed as p99 latency in the bench).
                let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
                run(&rx, &mut map, &config, &status)
            })
            .map_err(ReaperError::Thread)?;
        Ok(Reaper { tx })
    }

    /// Closes, soon, the sockets the hooks connected to `departed` endpoints.
    pub fn send(&self, departed: Vec<Departed>) {
        if !departed.is_empty() {
            // The thread only ends with the agent.
            let _ = self.tx.send(departed);
        }
    }
}

/// The closing thread: passes as departures come (at most every [`CLOSE_EVERY`]),
/// sweeps at most every [`SWEEP_EVERY`]; ends when the agent drops the sender.
fn run(
    rx: &mpsc::Receiver<Vec<Departed>>,
    map: &mut SockRevNatMap,
    config: &ReaperConfig,
    status: &AgentStatus,
) {
    let mut to_close = Departures::default();
    let mut to_sweep = Departures::default();
    let mut last_close: Option<Instant> = None;
    let mut last_sweep: Option<Instant> = None;
    let mut unsupported_said = false;
    let take = |departed: Vec<Departed>, close: &mut Departures, sweep: &mut Departures| {
        close.extend(&departed);
        sweep.extend(&departed);
    };
    loop {
        // Wait for departures; while some wait for a sweep, only until it is due.
        let received = match last_sweep.filter(|_| !to_sweep.is_empty()) {
            Some(last) => match rx
                .recv_timeout((last + SWEEP_EVERY).saturating_duration_since(Instant::now()))
            {
                Ok(departed) => Some(departed),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            },
            None if to_sweep.is_empty() => match rx.recv() {
                Ok(departed) => Some(departed),
                Err(_) => return,
            },
            None => None,
        };
        if let Some(departed) = received {
            take(departed, &mut to_close, &mut to_sweep);
        }
        if !to_close.is_empty() {
            if let Some(last) = last_close {
                std::thread::sleep((last + CLOSE_EVERY).saturating_duration_since(Instant::now()));
            }
            for departed in rx.try_iter() {
                take(departed, &mut to_close, &mut to_sweep);
            }
            let pass = close(map, config, &std::mem::take(&mut to_close));
            last_close = Some(Instant::now());
            for (protocol, count) in &pass.closed {
                status.record_stale_sockets_closed(*protocol, *count);
            }
            report(&pass, &mut unsupported_said);
        }
        if !to_sweep.is_empty() && last_sweep.is_none_or(|last| last.elapsed() >= SWEEP_EVERY) {
            let departures = std::mem::take(&mut to_sweep);
            last_sweep = Some(Instant::now());
            match sweep(map, &departures, config.close_tcp) {
                Ok(0) => {}
                Ok(n) => debug!(entries = n, "reverse entries of removed endpoints deleted"),
                Err(e) => warn!("deleting reverse entries of removed endpoints: {e}"),
            }
        }
    }
}

/// What one closing pass did.
#[derive(Debug, Default)]
struct Pass {
    closed: HashMap<Protocol, u64>,
    /// What went wrong, per namespace or map; the rest of the pass went on.
    errors: Vec<String>,
    /// The kernel cannot destroy sockets (EOPNOTSUPP).
    unsupported: bool,
}

/// Closes, in every namespace of the hooked cgroup's processes, the sockets the
/// hooks sent to a departed backend through the frontend it left, and deletes their
/// reverse entries.
fn close(map: &mut SockRevNatMap, config: &ReaperConfig, departures: &Departures) -> Pass {
    let mut pass = Pass::default();
    let protocols = departures.protocols(config.close_tcp);
    if protocols.is_empty() {
        return pass;
    }
    let mut forget = Vec::new();
    let (namespaces, refused) = netns::of_cgroup(&config.cgroup);
    if let Some(error) = &refused.first {
        pass.errors.push(format!(
            "cannot open the network namespace of {} process(es) in {} ({error}): closing \
             their sockets needs CAP_SYS_PTRACE",
            refused.count,
            config.cgroup.display()
        ));
    }
    for ns in namespaces {
        let found = netns::run_in(&ns, || {
            close_here(map, departures, &protocols, config.close_tcp)
        });
        match found {
            Ok(Ok((closed, keys))) => {
                for (protocol, count) in closed {
                    *pass.closed.entry(protocol).or_default() += count;
                }
                forget.extend(keys);
            }
            Ok(Err(CloseError::Diag(DiagError::Io { source, .. })))
                if source.raw_os_error() == Some(libc::EOPNOTSUPP) =>
            {
                pass.unsupported = true;
                break;
            }
            Ok(Err(e)) => pass.errors.push(e.to_string()),
            Err(e) => pass
                .errors
                .push(format!("entering a network namespace: {e}")),
        }
    }
    for key in &forget {
        if let Err(e) = map.remove(key) {
            pass.errors.push(e.to_string());
        }
    }
    pass
}

#[derive(Debug, thiserror::Error)]
enum CloseError {
    #[error(transparent)]
    Diag(#[from] DiagError),
    #[error(transparent)]
    Maps(#[from] MapsError),
}

/// In the current network namespace: closes each socket whose peer departed and
/// whose reverse entry (by cookie and peer) names the frontend it departed from.
/// Returns what it closed and the entries to delete.
fn close_here(
    map: &SockRevNatMap,
    departures: &Departures,
    protocols: &BTreeSet<Protocol>,
    close_tcp: bool,
) -> Result<(HashMap<Protocol, u64>, Vec<SockRevNatKey>), CloseError> {
    let mut diag = Diag::open()?;
    let mut closed = HashMap::new();
    let mut keys = Vec::new();
    for &protocol in protocols {
        for family in FAMILIES {
            for socket in diag.list(family, protocol)? {
                let peer = socket.peer();
                if !departures.has_backend(peer) {
                    continue;
                }
                let key = SockRevNatKey {
                    cookie: socket.cookie(),
                    address: peer.ip().into(),
                    port: Be16::from_host(peer.port()).to_map(),
                    ..SockRevNatKey::default()
                };
                let Some(value) = map.get(&key)? else {
                    continue;
                };
                if !departures.is_stale(value.rev_nat_id, peer, protocol, close_tcp) {
                    continue;
                }
                match diag.destroy(protocol, &socket) {
                    Ok(()) => *closed.entry(protocol).or_default() += 1,
                    // Closed by its owner since the listing.
                    Err(DiagError::Io { source, .. })
                        if source.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e.into()),
                }
                keys.push(key);
            }
        }
    }
    Ok((closed, keys))
}

/// Deletes the reverse entries left by `departures` (those of unconnected sockets;
/// closed sockets' went with them). Returns how many.
fn sweep(
    map: &mut SockRevNatMap,
    departures: &Departures,
    close_tcp: bool,
) -> Result<usize, MapsError> {
    let mut stale = Vec::new();
    map.for_each_batch(|batch| stale.extend(stale_entries(batch, departures, close_tcp)))?;
    for key in &stale {
        map.remove(key)?;
    }
    Ok(stale.len())
}

fn report(pass: &Pass, unsupported_said: &mut bool) {
    let closed: u64 = pass.closed.values().sum();
    if closed > 0 {
        info!(
            sockets = closed,
            "closed sockets connected to removed endpoints"
        );
    }
    if pass.unsupported && !*unsupported_said {
        *unsupported_said = true;
        warn!(
            "this kernel cannot close sockets (CONFIG_INET_DIAG_DESTROY is off): connected \
             UDP sockets keep talking to endpoints that left their Service until their \
             owners reconnect"
        );
    }
    for e in &pass.errors {
        warn!("closing sockets of removed endpoints: {e}");
    }
}
