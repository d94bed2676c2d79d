//! The agent: start-up ([`start`]), then one loop ([`event_loop`]) that follows the
//! objects (manifest files or the API server), the node's devices and addresses and
//! its timers, and turns each event into one change ([`change`]): the objects
//! interpreted into the desired state, its difference planned and written to the
//! maps ([`writes`]). Reads and writes happen here, at the edge; deciding what to
//! write is the pure planner's job.

mod change;
mod consistency;
mod ct_gc;
mod event_loop;
mod masquerade;
mod names;
mod node_objects;
mod policy;
mod start;
mod writes;

use std::path::PathBuf;
use std::time::Duration;

use crate::control::NodePortRange;
use crate::datapath::conntrack;
use crate::datapath::device_links::DeviceLinksError;
use crate::datapath::forwarding::Forwarding;
use crate::datapath::loader::{LoadError, TcAttach, XdpAttach};
use crate::datapath::maps::MapsError;
use crate::datapath::pins::{self, MapSizes, PinLayout, PinLockError};
use crate::node::host::SysError;
use crate::node::netlink::NetlinkError;
use crate::node::{NodePortAddresses, Overrides};
use crate::ops::{self, BindAddress};
use crate::source::{self, files, kube};
use crate::stale_sockets;

/// Where Services and EndpointSlices come from.
#[derive(Clone, Debug)]
pub enum ObjectSource {
    /// A YAML/JSON manifest file or a directory of them, followed for changes.
    Files(PathBuf),
    /// The API server: this kubeconfig, else in-cluster config, else the default
    /// kubeconfig.
    Kubernetes { kubeconfig: Option<PathBuf> },
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub source: ObjectSource,
    /// cgroup v2 directory the socket hooks attach to.
    pub cgroup: PathBuf,
    pub pin: PinLayout,
    /// Endpoints on this node are "local" (internalTrafficPolicy: Local).
    pub node_name: String,
    /// `--node-ip`: NodePorts are served on these (unless `nodeport_addresses`
    /// selects otherwise), and the first one is the source address for traffic
    /// SNATed to backends on other nodes. Empty: found from the node's devices.
    pub node_ips: Vec<std::net::IpAddr>,
    /// kube-proxy's `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// NodePorts outside this range are refused.
    pub node_port_range: NodePortRange,
    /// `--zone`: this node's zone when its Node object (from the API server or
    /// the files) has no `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
    /// Kernel object to load instead of the embedded one.
    pub bpf_object: Option<PathBuf>,
    pub sizes: MapSizes,
    /// How the per-packet programs attach (`Off`: socket hooks only).
    pub tc_mode: TcAttach,
    /// Whether `lb_xdp` goes in front of the TC program on node-facing devices.
    pub xdp_mode: XdpAttach,
    /// `--lb-mode` and `--dsr-dispatch`: how the per-packet programs reach
    /// backends on other nodes (SNAT, or direct server return).
    pub forwarding: Forwarding,
    /// Devices whose role the operator fixed (`--iface`, `--pod-iface`).
    pub tc_overrides: Overrides,
    /// Conntrack idle timeouts of the per-packet path.
    pub ct_timeouts: conntrack::Timeouts,
    /// How often idle conntrack entries are collected.
    pub ct_gc_interval: Duration,
    /// Where /healthz and /metrics listen (None: not served; equal: one listener).
    pub healthz_addr: BindAddress,
    pub metrics_addr: BindAddress,
    /// /healthz answers 503 once a change has waited longer than this to be applied.
    pub healthz_timeout: Duration,
    /// How often the maps are compared with what the agent wrote, and repaired.
    pub consistency_interval: Duration,
    /// Wait for another agent holding the pin directory to stop, instead of
    /// failing (a rolling update's new agent).
    pub wait_for_lock: bool,
    /// Close TCP connections to endpoints that left their Service (UDP sockets
    /// always are).
    pub terminate_tcp: bool,
    /// `--lb-algorithm`: how external frontends pick backends unless a Service's
    /// `service.lb/algorithm` annotation says.
    pub lb_algorithm: crate::model::Algorithm,
    /// `--maglev-seed`: the Maglev tables' and flow hash's seed, the same on every
    /// node.
    pub maglev_seed: u64,
    /// `--masquerade`: egress masquerading of local pods' traffic in BPF.
    pub masquerade: crate::control::masquerade::MasqueradeMode,
    /// `--masquerade-all` (kube-proxy's): every per-packet flow to a cluster IP
    /// gets the node's address.
    pub masquerade_all: bool,
    /// `--ip-masq-agent-config`: ip-masq-agent's file, followed for changes.
    pub ip_masq_agent_config: Option<PathBuf>,
    /// `--cluster-cidr` (kube-proxy's flag): the cluster's pod ranges, beside the
    /// Nodes' `spec.podCIDRs`.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// `--backend-quarantine`: passive health, a backend that refuses a new
    /// connection is skipped by the new connections of that frontend for a while.
    pub backend_quarantine: bool,
    /// `--network-policy`: NetworkPolicy enforced on this node's pods.
    pub network_policy: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Ops(#[from] ops::OpsError),
    #[error(transparent)]
    Kube(#[from] kube::KubeSourceError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Watch(#[from] files::WatchError),
    #[error(transparent)]
    PinLock(#[from] PinLockError),
    #[error(transparent)]
    DeviceLinks(#[from] DeviceLinksError),
    #[error(transparent)]
    Source(#[from] source::SourceError),
    #[error(transparent)]
    Pins(#[from] pins::PinsError),
    #[error(transparent)]
    Reaper(#[from] stale_sockets::ReaperError),
    #[error(transparent)]
    Collector(#[from] ct_gc::CollectorError),
    #[error("cannot install signal handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// Runs until SIGINT/SIGTERM. The hooks and maps stay pinned afterwards: stopping the
/// agent must not stop the datapath.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let started = start::start(config).await?;
    let (agent, outcome) = event_loop::follow(started).await;
    agent.stop().await;
    outcome
}
