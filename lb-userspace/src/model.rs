//! The desired service table: what the datapath should do, independent of where the
//! objects came from (manifest files or the API server) and of the map layout.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::Serialize;

pub mod policy;

/// L4 protocol of a Service port. Only the ones the socket hooks translate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

/// Which traffic a frontend entry serves. Every frontend has an `Internal` entry
/// (sockets on this node, pods, other nodes); an `External` entry exists only when
/// traffic from outside the cluster must see other backends
/// (`externalTrafficPolicy: Local`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Internal,
    External,
}

/// What a client addresses: VIP (or node IP, external IP), port, protocol, and
/// which traffic the entry is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl Frontend {
    /// The internal-scope entry of `ip:port/protocol`.
    pub fn internal(ip: IpAddr, port: u16, protocol: Protocol) -> Self {
        Frontend {
            ip,
            port,
            protocol,
            scope: Scope::Internal,
        }
    }

    pub fn with_scope(self, scope: Scope) -> Self {
        Frontend { scope, ..self }
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.ip, self.port),
            self.protocol
        )?;
        if self.scope == Scope::External {
            f.write_str(" (external)")?;
        }
        Ok(())
    }
}

/// One endpoint address a frontend forwards to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct BackendAddr {
    pub ip: IpAddr,
    pub port: u16,
    /// The endpoint runs on this node (its replies come back through us without SNAT).
    pub local: bool,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::SocketAddr::new(self.ip, self.port).fmt(f)
    }
}

/// What one frontend should do. The index, the claims and the desired state each
/// hold the spec of a frontend, so its name and backends are shared, not copied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FrontendSpec {
    /// `namespace/name:portName` (kube-proxy's ServicePortName), for messages.
    pub service: Arc<str>,
    /// Usable backends. Empty means "reject" (ECONNREFUSED), as kube-proxy does.
    pub backends: Arc<BTreeSet<BackendAddr>>,
    /// `sessionAffinity: ClientIP` timeout in seconds, if enabled.
    pub affinity_timeout_sec: Option<u32>,
    /// Set on the internal entry of a LoadBalancer ingress IP whose Service has
    /// `spec.loadBalancerSourceRanges`: the per-packet path admits new flows only from
    /// these sources (an empty set admits none). `None`: every source.
    pub source_ranges: Option<BTreeSet<ipnet::IpNet>>,
    /// New flows of the per-packet path pick their backend from a Maglev table (one
    /// per distinct backend set, shared) rather than at random, so that a flow
    /// entering any node reaches the same backend. Set only on the frontends
    /// external traffic reaches (NodePort, LoadBalancer ingress IPs, externalIPs) of
    /// Services that use [`Algorithm::Maglev`]; the socket hooks pick at random
    /// whatever it says.
    pub maglev: bool,
    /// A Service's cluster IP (not a NodePort, load-balancer IP or externalIP): the
    /// per-packet path applies kube-proxy's cluster-IP masquerade rules to it.
    pub cluster_ip: bool,
}

/// How the per-packet path picks the backend of a new flow to a NodePort,
/// LoadBalancer or externalIP frontend: `lb agent --lb-algorithm`, or a Service's
/// `service.lb/algorithm` annotation, which overrides it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// A random backend per flow (kube-proxy's behaviour).
    #[default]
    Random,
    /// Maglev consistent hashing of the client's address and port, the frontend's
    /// port and the protocol: the same backend on every node.
    Maglev,
}

impl Algorithm {
    /// The annotation's value, as written (`maglev` or `random`); `None` for any
    /// other.
    pub fn from_annotation(value: &str) -> Option<Self> {
        match value.trim() {
            "maglev" => Some(Algorithm::Maglev),
            "random" => Some(Algorithm::Random),
            _ => None,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::Random => "random",
            Algorithm::Maglev => "maglev",
        })
    }
}

/// The whole desired table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, FrontendSpec>,
    /// `healthCheckNodePort` of `externalTrafficPolicy: Local` Services -> what the
    /// node answers there, so load balancers only send traffic to nodes with
    /// endpoints.
    pub health_checks: BTreeMap<u16, HealthCheck>,
}

/// One `healthCheckNodePort`, as kube-proxy serves it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HealthCheck {
    pub namespace: String,
    pub name: String,
    /// Usable endpoints of the Service on this node; 0 answers 503.
    pub local_endpoints: usize,
}

impl DesiredState {
    pub fn backend_count(&self) -> usize {
        self.frontends.values().map(|s| s.backends.len()).sum()
    }
}
