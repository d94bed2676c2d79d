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
//! sockets never delays the next change.

mod departed;
mod diag;
mod netns;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};

use tracing::{debug, info, warn};

pub use departed::{stale_sockets, Departed, StaleSocket, Touched};
use diag::{Diag, DiagError, Listed, FAMILIES};

use crate::loader::PinLayout;
use crate::maps::{MapsError, SockRevNatMap};
use crate::model::Protocol;
use crate::ops::AgentStatus;

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
                let mut unsupported_said = false;
                while let Ok(mut departed) = rx.recv() {
                    // Changes that came while the last pass ran go in one pass.
                    departed.extend(rx.try_iter().flatten());
                    let pass = reap(&mut map, &config, &departed);
                    for (protocol, count) in &pass.closed {
                        status.record_stale_sockets_closed(*protocol, *count);
                    }
                    report(&pass, &departed, &mut unsupported_said);
                }
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

/// What one pass did.
#[derive(Debug, Default)]
struct Pass {
    closed: HashMap<Protocol, u64>,
    /// Reverse-translation entries deleted.
    forgotten: usize,
    /// What went wrong, per namespace or map; the rest of the pass went on.
    errors: Vec<String>,
    /// The kernel cannot destroy sockets (EOPNOTSUPP).
    unsupported: bool,
}

fn reap(map: &mut SockRevNatMap, config: &ReaperConfig, departed: &[Departed]) -> Pass {
    let mut pass = Pass::default();
    let entries = match map.entries() {
        Ok(entries) => entries,
        Err(e) => {
            pass.errors.push(e.to_string());
            return pass;
        }
    };
    let (stale, forget) = stale_sockets(&entries, departed, config.close_tcp);
    if !stale.is_empty() {
        let protocols: BTreeSet<Protocol> = stale.values().map(|s| s.protocol).collect();
        for ns in netns::of_cgroup(&config.cgroup) {
            match netns::run_in(&ns, || close_here(&stale, &protocols)) {
                Ok(Ok(closed)) => {
                    for (protocol, count) in closed {
                        *pass.closed.entry(protocol).or_default() += count;
                    }
                }
                Ok(Err(DiagError::Io { source, .. }))
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
    }
    for key in &forget {
        match map.remove(key) {
            Ok(()) => pass.forgotten += 1,
            Err(e) => pass.errors.push(e.to_string()),
        }
    }
    pass
}

/// In the current network namespace: closes each socket whose cookie is `stale`
/// and whose peer is still the backend it was sent to.
fn close_here(
    stale: &HashMap<u64, StaleSocket>,
    protocols: &BTreeSet<Protocol>,
) -> Result<HashMap<Protocol, u64>, DiagError> {
    let mut diag = Diag::open()?;
    let mut closed = HashMap::new();
    for &protocol in protocols {
        for family in FAMILIES {
            let listed = diag.list(family, protocol)?;
            for socket in listed.iter().filter(|s| is_stale(stale, protocol, s)) {
                match diag.destroy(protocol, socket) {
                    Ok(()) => *closed.entry(protocol).or_default() += 1,
                    // Closed by its owner since the listing.
                    Err(DiagError::Io { source, .. })
                        if source.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(closed)
}

fn is_stale(stale: &HashMap<u64, StaleSocket>, protocol: Protocol, socket: &Listed) -> bool {
    stale
        .get(&socket.cookie())
        .is_some_and(|s| s.protocol == protocol && s.backend == socket.peer())
}

fn report(pass: &Pass, departed: &[Departed], unsupported_said: &mut bool) {
    let closed: u64 = pass.closed.values().sum();
    if closed > 0 {
        let backends: BTreeSet<String> = departed.iter().map(|d| d.backend.to_string()).collect();
        info!(
            sockets = closed,
            endpoints = ?backends,
            "closed sockets connected to removed endpoints"
        );
    }
    debug!(
        departed = departed.len(),
        closed,
        forgotten = pass.forgotten,
        "stale socket pass"
    );
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
