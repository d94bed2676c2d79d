//! `lb`: the agent and its inspection tools.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lb_userspace::agent::{self, AgentConfig, ObjectSource};
use lb_userspace::control::masquerade::MasqueradeMode;
use lb_userspace::control::NodePortRange;
use lb_userspace::datapath::forwarding::{DsrDispatch, Forwarding, LbMode};
use lb_userspace::datapath::loader::{TcAttach, XdpAttach};
use lb_userspace::datapath::maps::{ConntrackMap, PinnedMaps, QuarantineMap};
use lb_userspace::datapath::masquerade::{self, MasqMaps};
use lb_userspace::datapath::pins::{self, MapSizes, PinLayout};
use lb_userspace::datapath::policy::PolicyMaps;
use lb_userspace::datapath::{conntrack, device_links, table};
use lb_userspace::model::{Algorithm, Frontend, Protocol, Scope};
use lb_userspace::node::host as sys;
use lb_userspace::node::{NodePortAddresses, Overrides};
use lb_userspace::ops::{self, pod_policy, BindAddress};

/// The agent builds hundreds of thousands of small objects per full sync (the
/// Kubernetes types, then the desired table); glibc's malloc spent about 60% of
/// `build_desired` and much of the parse in allocation and freeing. The
/// `system-allocator` feature keeps glibc's, for heap profilers (heaptrack) that
/// follow malloc.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's defaults trade memory for speed: freed pages are returned to the
/// system only 10 ms later, and arenas are committed whole up front. At 10k
/// Services x 10 endpoints they made the agent's peak RSS 158-180 MiB against
/// 104 MiB with eager commit off and a purge delay of 0 (109 MiB with glibc's
/// malloc), for the same start time (0.44-0.48 s). A delay of 0 re-faulted every
/// buffer freed and allocated again (a list page, a growing map): the API start
/// at 100k took 8.71 s, against 7.58 s with 2 ms, for the same peak (701 and
/// 702 MiB). Set by a process constructor, before the first allocation reserves
/// an arena: set in `main`, the first arena was already committed (and backed by
/// transparent huge pages), and the peak at 10k was 119 MiB.
#[cfg(not(feature = "system-allocator"))]
#[used]
#[unsafe(link_section = ".init_array")]
static TUNE_ALLOCATOR: extern "C" fn() = tune_allocator;

#[cfg(not(feature = "system-allocator"))]
extern "C" fn tune_allocator() {
    use libmimalloc_sys::{mi_option_set, mi_version};
    // `mi_option_t` numbers of mimalloc 3's header (libmimalloc-sys does not name
    // these two); another major version numbers them differently, so leave it be.
    // mimalloc's own variables (`MIMALLOC_PURGE_DELAY=10`, ...) still win.
    const OPTIONS: [(i32, &str, i64); 2] = [
        (4, "MIMALLOC_ARENA_EAGER_COMMIT", 0),
        (15, "MIMALLOC_PURGE_DELAY", 2),
    ];
    // SAFETY: plain setters of mimalloc's global options, valid at any time.
    unsafe {
        if (30000..40000).contains(&mi_version()) {
            for (option, variable, value) in OPTIONS {
                if std::env::var_os(variable).is_none() {
                    mi_option_set(option, value as _);
                }
            }
        }
    }
}

#[derive(Parser)]
#[command(
    name = "lb",
    version,
    about = "eBPF Service load balancer (kube-proxy replacement)"
)]
struct Cli {
    /// bpffs directory holding this agent's pinned maps and links.
    #[arg(long, global = true, default_value = "/sys/fs/bpf/lb")]
    pin_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct PolicyArgs {
    /// A pod, as NAMESPACE/NAME.
    pod: Option<String>,
    /// The verdict for a connection from this address to the pod (ingress).
    #[arg(long, requires = "pod", conflicts_with = "to")]
    from: Option<IpAddr>,
    /// The verdict for a connection from the pod to this address (egress).
    #[arg(long, requires = "pod")]
    to: Option<IpAddr>,
    /// The connection's destination port: the pod's with --from, the peer's
    /// with --to.
    #[arg(long)]
    port: Option<u16>,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    protocol: String,
    #[arg(long)]
    json: bool,
    /// Where the agent serves /metrics (its --metrics-bind-address); a pod's
    /// policies are asked for there.
    #[arg(long, default_value = ops::DEFAULT_METRICS_ADDR)]
    metrics_address: SocketAddr,
}

#[derive(Subcommand)]
enum Command {
    /// Load and attach the datapath, then keep the maps in sync with the manifests.
    /// A flag given twice takes its last value, as kube-proxy's flags do.
    #[command(args_override_self = true)]
    Agent(Box<AgentArgs>),
    /// Print the service table as the kernel programs see it.
    Services {
        #[arg(long)]
        json: bool,
    },
    /// Print egress masquerading's translations (`lb agent --masquerade bpf`): each
    /// pod flow, its destination and the node address and port it left with, and
    /// how full the map is.
    Masquerade {
        #[arg(long)]
        json: bool,
    },
    /// Print this node's pods as NetworkPolicy sees them (`lb agent
    /// --network-policy on`): each address, the directions a policy selects it
    /// for (none: open), and the packets dropped each way. With POD, that pod:
    /// the policies selecting it (asked of the agent), its drops, and with
    /// --from or --to the verdict the datapath gives a new connection now.
    Policy(Box<PolicyArgs>),
    /// Print the flows of the per-packet path (NodePort, external IPs, ...).
    Conntrack {
        #[arg(long)]
        json: bool,
    },
    /// Print the datapath counters.
    Stats {
        #[arg(long)]
        json: bool,
        /// Connections and refusals per frontend instead of the datapath counters.
        #[arg(long)]
        per_service: bool,
    },
    /// Show which devices the per-packet programs are attached to, and why, and
    /// the manifest files the agent cannot read.
    Status {
        #[arg(long)]
        json: bool,
        /// Where the agent serves /metrics (its --metrics-bind-address); its own
        /// view (unreadable manifest files) is asked for there.
        #[arg(long, default_value = ops::DEFAULT_METRICS_ADDR)]
        metrics_address: SocketAddr,
    },
    /// Show a Maglev frontend's table: its size and each backend's share of it.
    Maglev {
        /// The frontend as `lb services` prints it: ADDRESS:PORT/PROTOCOL, e.g.
        /// 192.0.2.10:30080/TCP or [2001:db8::10]:443/TCP.
        frontend: String,
        /// The entry of externalTrafficPolicy: Local traffic from outside the
        /// cluster (`lb services` marks it "(external)").
        #[arg(long)]
        external: bool,
        #[arg(long)]
        json: bool,
    },
    /// Detach the hooks and unpin every map and link under --pin-dir.
    Cleanup,
}

/// A feature flag's two values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Read Services and EndpointSlices from Kubernetes YAML/JSON (Service,
    /// EndpointSlice, List; this node's Node for its zone) in a file or a directory
    /// instead of the API server.
    #[arg(long, conflicts_with = "kubeconfig")]
    services_file: Option<PathBuf>,
    /// Follow the API server with this kubeconfig (default without --services-file:
    /// in-cluster config, else $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// cgroup v2 directory to attach to (default: the cgroup v2 root).
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// This node's name, as in EndpointSlice `nodeName` (default: $NODE_NAME, else the hostname).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// This node's zone for topology-aware routing (EndpointSlice
    /// `hints.forZones`), used when this node's Node object (from the API server,
    /// or in the --services-file manifests) has no topology.kubernetes.io/zone label.
    #[arg(long)]
    zone: Option<String>,
    /// This node's address (IPv4 or IPv6): NodePorts are served on it, and it is the
    /// source of traffic SNATed to backends on other nodes. Repeat for several
    /// addresses (dual-stack: one of each family); the first of each family is that
    /// family's SNAT source. Default: NodePorts on every address of the node
    /// (see --nodeport-addresses), SNAT from the address the node's routing uses
    /// towards the backend.
    #[arg(long = "node-ip")]
    node_ips: Vec<IpAddr>,
    /// kube-proxy's --nodeport-addresses: a comma-separated list of CIDRs (NodePorts
    /// are served on the node's addresses inside them), or `primary` (the node's
    /// primary address only). Default: every address of the node.
    #[arg(long, default_value = "")]
    nodeport_addresses: NodePortAddresses,
    /// The cluster's NodePort range (kube-apiserver's --service-node-port-range).
    #[arg(long, default_value = "30000-32767")]
    nodeport_range: NodePortRange,
    /// Treat this device as node-facing (NodePort, LoadBalancer, externalIPs, traffic
    /// from other nodes). Repeatable. Not needed: by default every device but a pod's
    /// veth is node-facing, and devices are followed as they come and go.
    #[arg(long = "iface")]
    ifaces: Vec<String>,
    /// Treat this device as pod-facing (pods outside --cgroup, replies of local
    /// backends). Repeatable. Not needed: by default a veth or netkit end without a
    /// node address (a pod's veth, whatever the CNI names it) is pod-facing.
    #[arg(long = "pod-iface")]
    pod_ifaces: Vec<String>,
    /// How the per-packet programs attach: TCX links (kernel >= 6.6) or netlink
    /// clsact filters; `auto` picks by kernel version; `off` runs the socket hooks
    /// only.
    #[arg(long, value_enum, default_value_t = TcAttach::Auto)]
    tc_attach: TcAttach,
    /// XDP in front of the TC program on node-facing devices, for NodePort,
    /// LoadBalancer and externalIP traffic: `native` attaches in the driver on
    /// every node-facing device that takes it (a device that refuses keeps the TC
    /// path and is reported in the log and `lb status`; never generic on its own);
    /// `generic` is for testing only.
    #[arg(long, value_enum, default_value_t = XdpAttach::Off)]
    xdp: XdpAttach,
    /// How flows entering a node-facing device (NodePort, LoadBalancer IPs,
    /// externalIPs) reach a backend on another node: `snat` (to this node; replies
    /// come back through it), `dsr` (direct server return: the backend sees the
    /// client's address and its node answers the client directly; every node must
    /// run lb, any mode), `hybrid` (DSR for TCP, SNAT for UDP).
    #[arg(long, value_enum, default_value_t = LbMode::Snat)]
    lb_mode: LbMode,
    /// How DSR tells the backend's node the frontend: `opt` (an IPv4 option /
    /// IPv6 destination option on a connection's SYN and on every UDP datagram; the
    /// network must forward IP options) or `ipip` (every packet inside an outer
    /// IPv4 / IPv6 header to the backend's node, for networks that drop options).
    #[arg(long, value_enum, default_value_t = DsrDispatch::Opt)]
    dsr_dispatch: DsrDispatch,
    /// Load this kernel object instead of the one built into `lb`.
    #[arg(long)]
    bpf_object: Option<PathBuf>,
    #[arg(long, default_value_t = lb_common::DEFAULT_SERVICES_MAX, value_parser = map_size())]
    services_map_size: u32,
    #[arg(long, default_value_t = lb_common::DEFAULT_BACKENDS_MAX, value_parser = map_size())]
    backends_map_size: u32,
    #[arg(long, default_value_t = lb_common::DEFAULT_SOCK_REVNAT_MAX, value_parser = map_size())]
    sock_revnat_map_size: u32,
    #[arg(long, default_value_t = lb_common::DEFAULT_AFFINITY_MAX, value_parser = map_size())]
    affinity_map_size: u32,
    #[arg(long, default_value_t = lb_common::DEFAULT_CT_MAX, value_parser = map_size())]
    conntrack_map_size: u32,
    /// Idle timeout of TCP flows that never completed the handshake.
    #[arg(long, default_value_t = 60, value_parser = timeout_secs())]
    ct_tcp_syn_timeout: u64,
    /// Idle timeout of established TCP flows.
    #[arg(long, default_value_t = 21_600, value_parser = timeout_secs())]
    ct_tcp_timeout: u64,
    /// Idle timeout of TCP flows that saw a FIN or RST.
    #[arg(long, default_value_t = 10, value_parser = timeout_secs())]
    ct_tcp_closing_timeout: u64,
    /// Idle timeout of UDP flows.
    #[arg(long, default_value_t = 60, value_parser = timeout_secs())]
    ct_udp_timeout: u64,
    /// How often idle conntrack entries are collected.
    #[arg(long, default_value_t = 5_000, value_parser = interval_ms())]
    ct_gc_interval_ms: u64,
    /// IP:PORT for GET /healthz (kube-proxy's contract); empty to turn it off.
    #[arg(long, default_value = ops::DEFAULT_HEALTHZ_ADDR)]
    healthz_bind_address: BindAddress,
    /// IP:PORT for GET /metrics (Prometheus); empty to turn it off.
    #[arg(long, default_value = ops::DEFAULT_METRICS_ADDR)]
    metrics_bind_address: BindAddress,
    /// /healthz answers 503 once a change has waited longer than this to be applied.
    #[arg(long, default_value_t = ops::DEFAULT_HEALTHZ_TIMEOUT.as_secs(), value_parser = timeout_secs())]
    healthz_timeout_secs: u64,
    /// How often the service table in the kernel is compared with what the agent
    /// wrote, and repaired (an entry changed behind the agent's back).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    consistency_check_interval_secs: u64,
    /// When another agent holds --pin-dir, wait for it to stop instead of failing
    /// (the DaemonSet sets it, so a rolling update's new agent takes over).
    #[arg(long)]
    wait_for_lock: bool,
    /// When an endpoint leaves its Service, also close the TCP connections the socket
    /// hooks made to it (their peers get a RST). Connected UDP sockets to it are
    /// always closed; kube-proxy, like the default here, leaves TCP connections be.
    #[arg(long)]
    terminate_tcp_to_removed_endpoints: bool,
    /// How new flows to NodePort, LoadBalancer and externalIP frontends pick a
    /// backend (TC and XDP): `random`, or `maglev` (consistent hashing of the
    /// client's address and port: the same backend whichever node the flow enters).
    /// A Service's `service.lb/algorithm: maglev|random` annotation overrides it.
    /// Cluster IPs and the socket hooks always pick at random.
    #[arg(long, value_enum, default_value_t = Algorithm::Random)]
    lb_algorithm: Algorithm,
    /// Seed of the Maglev tables and flow hash, decimal or 0x-hex. Every node must
    /// use the same one (the DaemonSet sets it), else a flow entering another node
    /// may reach another backend.
    #[arg(long, default_value = "0", value_parser = parse_seed)]
    maglev_seed: u64,
    /// Capacity of LB_MAGLEV, the kernel array holding every Maglev table, in table
    /// slots (a multiple of 4; 2 bytes each, allocated when the map is created: the
    /// default 2097152 is 4 MiB). A table takes 252 slots for 1-2 backends, 512 for
    /// 3-5, 1024 for 6-10, 2040 for 11-20, ... (about 100 a backend, doubling);
    /// frontends with equal backends share one. A Maglev frontend whose table finds
    /// no room picks at random, and the agent says so.
    #[arg(long, default_value_t = lb_common::DEFAULT_MAGLEV_SLOTS, value_parser = maglev_slots)]
    maglev_table_slots: u32,
    /// Egress masquerading: `bpf` gives local pods' traffic to destinations outside
    /// the cluster the node's address on every node-facing device (as iptables
    /// MASQUERADE does), replies translated back; `off` (the default) leaves it to
    /// the CNI or ip-masq-agent. Turn theirs off when turning this on.
    #[arg(long, value_enum, default_value_t = MasqueradeMode::Off)]
    masquerade: MasqueradeMode,
    /// Passive health: a backend that refuses a new connection (a RST to the SYN,
    /// an ICMP unreachable, a connect() through the socket hooks that fails) is
    /// skipped by that frontend's new connections for 1 s, doubling on each repeat
    /// up to 60 s, until it accepts one. Established connections are never touched;
    /// when every backend is quarantined they are used anyway.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    backend_quarantine: Switch,
    /// NetworkPolicy (networking.k8s.io/v1) enforced on this node's pods, at
    /// their veths, after Service translation. Off by default: a node whose CNI
    /// enforces policy already must not enforce it twice; turn that off first.
    /// Traffic from the node itself to its pods (kubelet probes) is always allowed.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    network_policy: Switch,
    /// ip-masq-agent's config file (YAML or JSON: nonMasqueradeCIDRs, masqLinkLocal,
    /// masqLinkLocalIPv6), followed for changes; a bad file is reported and the last
    /// good one kept. Without it: ip-masq-agent's defaults (the private and
    /// reserved ranges, link-local). The cluster's pod CIDRs are never masqueraded.
    #[arg(long)]
    ip_masq_agent_config: Option<PathBuf>,
    /// kube-proxy's --masquerade-all: every new flow the per-packet path takes to
    /// a cluster IP leaves with the node's address (connections the socket hooks
    /// translate carry no NAT and keep the pod's address). Without it, as
    /// kube-proxy: only traffic to a cluster IP from outside the cluster's pod
    /// ranges, and a pod reaching itself through its Service.
    #[arg(long)]
    masquerade_all: bool,
    /// The cluster's pod ranges (kube-proxy's --cluster-cidr), comma-separated,
    /// one per family, added to every Node's spec.podCIDRs: traffic to a cluster IP
    /// from outside them gets the node's address (kube-proxy's rule); exempt from
    /// egress masquerading, and its sources on a node whose Node object gives no
    /// spec.podCIDRs.
    #[arg(long, value_delimiter = ',')]
    cluster_cidr: Vec<ipnet::IpNet>,
    /// Capacity of LB_MASQ, egress masquerading's translations: two entries per
    /// flow; a full map drops new flows (counted as masq_map_full).
    #[arg(long, default_value_t = lb_common::DEFAULT_MASQ_MAX, value_parser = map_size())]
    masquerade_map_size: u32,
}

/// `--maglev-seed`: a u64, decimal or `0x`-hex.
fn parse_seed(value: &str) -> Result<u64, String> {
    let value = value.trim();
    let parsed = match value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
        None => value.replace('_', "").parse::<u64>(),
    };
    parsed.map_err(|e| format!("{value:?} is not a 64-bit seed (decimal, or hex with 0x): {e}"))
}

/// `--maglev-table-slots`: whole 4-slot entries, room for the header and at least
/// the smallest table, at most 2^31 slots (4 GiB).
fn maglev_slots(value: &str) -> Result<u32, String> {
    let slots: u32 = value
        .trim()
        .parse()
        .map_err(|e| format!("{value:?} is not a slot count: {e}"))?;
    let smallest = lb_common::MAGLEV_FIRST_TABLE_SLOT
        + lb_common::maglev::extent_slots(lb_common::maglev::TABLE_SIZES[0]);
    if !slots.is_multiple_of(lb_common::MAGLEV_SLOTS_PER_ENTRY) {
        return Err(format!(
            "{slots} is not a multiple of 4 (slots come 4 to an entry)"
        ));
    }
    if !(smallest..=1 << 31).contains(&slots) {
        return Err(format!("{slots} is outside {smallest}..={}", 1u32 << 31));
    }
    Ok(slots)
}

/// A frontend as `lb services` prints it (`ADDRESS:PORT/PROTOCOL`).
fn parse_frontend(text: &str, external: bool) -> Result<Frontend> {
    let (address, protocol) = text.rsplit_once('/').with_context(|| {
        format!("{text:?}: expected ADDRESS:PORT/PROTOCOL, e.g. 192.0.2.10:30080/TCP")
    })?;
    let address: SocketAddr = address
        .parse()
        .with_context(|| format!("{address:?} is not ADDRESS:PORT ([ADDRESS]:PORT for IPv6)"))?;
    let protocol = match protocol.to_ascii_uppercase().as_str() {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        other => anyhow::bail!("protocol {other:?}: expected TCP or UDP"),
    };
    let scope = if external {
        Scope::External
    } else {
        Scope::Internal
    };
    Ok(Frontend::internal(address.ip().to_canonical(), address.port(), protocol).with_scope(scope))
}

// Ranges of the numeric agent flags, checked while parsing: a zero interval makes
// tokio's timers panic, a zero-sized map is refused by the kernel only after
// everything else was set up, and a huge duration overflows the clock.

/// Polling and collection intervals: 1 ms to 1 hour.
fn interval_ms() -> impl clap::builder::TypedValueParser<Value = u64> {
    clap::value_parser!(u64).range(1..=3_600_000)
}

/// Timeouts: 1 s to 1 year.
fn timeout_secs() -> impl clap::builder::TypedValueParser<Value = u64> {
    clap::value_parser!(u64).range(1..=365 * 24 * 3600)
}

/// `max_entries` of a hash map: the kernel rounds it up to a power-of-two bucket
/// count of at most 2^31 (E2BIG beyond).
fn map_size() -> impl clap::builder::TypedValueParser<Value = u32> {
    clap::value_parser!(u32).range(1..=1 << 31)
}

/// `lb maglev FRONTEND`: the frontend's table as the pinned maps hold it.
fn show_maglev(layout: &PinLayout, frontend: &str, external: bool, json: bool) -> Result<()> {
    let frontend = parse_frontend(frontend, external)?;
    let maps = PinnedMaps::open(layout)?;
    let snapshot = maps.snapshot()?;
    let Some(place) = table::maglev_table_of(&snapshot, &frontend) else {
        let known = table::decode(&snapshot)
            .into_iter()
            .any(|f| f.frontend == frontend);
        anyhow::bail!(
            "{frontend}: {}",
            if known {
                "picks backends at random (no Maglev table); see `lb services`"
            } else {
                "no such frontend in the service table; see `lb services`"
            }
        );
    };
    let slots = maps.maglev_table(place.first_slot, place.size)?;
    let shares = table::maglev_shares(&snapshot, &frontend, &slots)
        .context("the frontend changed while it was read; try again")?;
    if json {
        emit(&(serde_json::to_string_pretty(&shares)? + "\n"))
    } else {
        emit(&table::render_maglev_shares(&shares))
    }
}

/// Writes to stdout. A reader that went away (`lb services | head -c1`) ends the
/// command quietly and successfully, as it does other Unix tools; Rust ignores
/// SIGPIPE, so the write fails with EPIPE instead, which `println!` turns into a panic.
fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        result => Ok(result.context("writing to stdout")?),
    }
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LB_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let layout = PinLayout::new(&cli.pin_dir);
    match cli.command {
        Command::Agent(args) => run_agent(*args, layout),
        Command::Services { json } => {
            let maps = PinnedMaps::open(&layout)?;
            let mut frontends = table::decode(&maps.snapshot()?);
            let quarantine = QuarantineMap::open(&layout)?.entries()?;
            table::with_quarantine(&mut frontends, &quarantine, conntrack::monotonic_now_ns());
            if json {
                emit(&(serde_json::to_string_pretty(&frontends)? + "\n"))
            } else {
                emit(&table::render_text(&frontends))
            }
        }
        Command::Masquerade { json } => {
            let maps = MasqMaps::open(&layout)?;
            let entries = maps.translations()?;
            let flows = masquerade::translations(&entries, conntrack::monotonic_now_ns());
            if json {
                let report = serde_json::json!({
                    "entries": entries.len(),
                    "capacity": maps.capacity(),
                    "flows": flows,
                });
                emit(&(serde_json::to_string_pretty(&report)? + "\n"))
            } else {
                emit(&masquerade::render_text(
                    &flows,
                    entries.len(),
                    maps.capacity(),
                ))
            }
        }
        Command::Policy(args) if args.pod.is_some() => pod_policy(&layout, &args),
        Command::Policy(args) => {
            let rows = PolicyMaps::open(&layout)?.rows()?;
            if args.json {
                emit(&(serde_json::to_string_pretty(&rows)? + "\n"))
            } else {
                emit(&lb_userspace::datapath::policy::render_text(&rows))
            }
        }
        Command::Conntrack { json } => {
            let map = ConntrackMap::open(&layout)?;
            let flows = conntrack::flows(&map.entries()?, conntrack::monotonic_now_ns());
            if json {
                emit(&(serde_json::to_string_pretty(&flows)? + "\n"))
            } else {
                emit(&conntrack::render_text(&flows))
            }
        }
        Command::Stats {
            json,
            per_service: true,
        } => {
            let maps = PinnedMaps::open(&layout)?;
            let rows = table::service_counters(&maps.snapshot()?, &maps.service_stats()?);
            if json {
                emit(&(serde_json::to_string_pretty(&rows)? + "\n"))
            } else {
                emit(&table::render_service_counters(&rows))
            }
        }
        Command::Stats { json, .. } => {
            let maps = PinnedMaps::open(&layout)?;
            let mut stats: Vec<(&str, u64)> = maps.stats()?;
            // Egress masquerading's pressure (its map is there whatever the mode).
            if let Ok(masq) = MasqMaps::open(&layout) {
                let entries = masq.translations().map_or(0, |e| e.len());
                stats.push(("masq_map_entries", entries as u64));
                stats.push(("masq_map_capacity", u64::from(masq.capacity())));
            }
            if json {
                let object: serde_json::Map<String, serde_json::Value> = stats
                    .into_iter()
                    .map(|(name, value)| (name.to_string(), value.into()))
                    .collect();
                emit(&format!("{}\n", serde_json::Value::Object(object)))
            } else {
                let text: String = stats
                    .into_iter()
                    .map(|(name, value)| format!("{name:<24} {value}\n"))
                    .collect();
                emit(&text)
            }
        }
        Command::Status {
            json,
            metrics_address,
        } => {
            let links = device_links::recorded(&layout)?;
            let agent = agent_status(metrics_address)?;
            if json {
                let agent = match &agent {
                    Ok(report) => serde_json::json!({
                        "address": metrics_address,
                        "reachable": true,
                        "initialSyncDone": report.initial_sync_done,
                        "unreadableFiles": report.unreadable_files,
                        "modes": report.modes,
                        "xdp": report.xdp,
                    }),
                    Err(e) => serde_json::json!({
                        "address": metrics_address,
                        "reachable": false,
                        "error": e.to_string(),
                    }),
                };
                let status = serde_json::json!({ "links": links, "agent": agent });
                emit(&(serde_json::to_string_pretty(&status)? + "\n"))
            } else {
                let mut text = device_links::render_text(&links);
                text += &render_agent_status(metrics_address, &agent);
                emit(&text)
            }
        }
        Command::Maglev {
            frontend,
            external,
            json,
        } => show_maglev(&layout, &frontend, external, json),
        Command::Cleanup => {
            let Some(lock) = pins::lock_for_cleanup(&layout)? else {
                eprintln!(
                    "nothing to clean up: {} does not exist",
                    layout.root().display()
                );
                return Ok(());
            };
            // The netlink filters first: their record is a map about to be unpinned.
            let filters = device_links::cleanup(&layout);
            if !filters.elsewhere.is_empty() {
                let devices: Vec<&str> =
                    filters.elsewhere.iter().map(|(d, _)| d.as_str()).collect();
                anyhow::bail!(
                    "{} has netlink TC filters on devices of another network namespace \
                     (netns inode {}): {}; run `lb cleanup --pin-dir {}` inside that \
                     namespace (e.g. `nsenter --net=...`); nothing was removed",
                    layout.root().display(),
                    filters.elsewhere[0].1,
                    devices.join(", "),
                    layout.root().display()
                );
            }
            let report = pins::cleanup(&layout, &lock)?;
            eprintln!(
                "removed {} pins under {}",
                report.removed.len(),
                layout.root().display()
            );
            if !filters.removed.is_empty() {
                eprintln!("removed netlink TC filters: {}", filters.removed.join(", "));
            }
            if !report.left.is_empty() {
                let left: Vec<String> = report
                    .left
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                eprintln!(
                    "left in place (not pinned by lb), with their directories: {}",
                    left.join(", ")
                );
            }
            Ok(())
        }
    }
}

/// How long `lb status` waits for the agent.
const AGENT_STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// The agent's own view, or why it could not be had (the attachments are still
/// shown then).
/// `lb policy POD [--from|--to PEER --port N]`.
fn pod_policy(layout: &PinLayout, args: &PolicyArgs) -> Result<()> {
    let pod = args.pod.as_deref().unwrap_or_default();
    let (namespace, name) = pod
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
        .with_context(|| format!("{pod:?}: name the pod as NAMESPACE/NAME"))?;
    let protocol = pod_policy::protocol(&args.protocol)
        .with_context(|| format!("--protocol {}: TCP, UDP or SCTP", args.protocol))?;
    let probe = match (args.from, args.to) {
        (None, None) => None,
        (from, to) => Some(pod_policy::Probe {
            ingress: from.is_some(),
            peer: from.or(to).expect("one is set"),
            protocol,
            port: args.port.context("--from and --to need --port")?,
        }),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let found = runtime
        .block_on(ops::fetch_pod_policies(
            args.metrics_address,
            namespace,
            name,
            AGENT_STATUS_TIMEOUT,
        ))
        .with_context(|| {
            format!(
                "asking the agent at {} about {pod} (pass its --metrics-bind-address as \
                 --metrics-address)",
                args.metrics_address
            )
        })?;
    let maps = PolicyMaps::open(layout)?;
    let drops = match found.endpoint {
        Some(id) => maps.drops(id)?.unwrap_or_default(),
        None => Default::default(),
    };
    let verdict = probe
        .map(|probe| pod_policy::judge(&maps, &found, probe))
        .transpose()?;
    let report = pod_policy::PodReport::new(found, drops, verdict);
    if args.json {
        emit(&(serde_json::to_string_pretty(&report)? + "\n"))
    } else {
        emit(&report.render_text())
    }
}

fn agent_status(addr: SocketAddr) -> Result<Result<ops::StatusReport, ops::FetchError>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(runtime.block_on(ops::fetch_status(addr, AGENT_STATUS_TIMEOUT)))
}

fn render_agent_status(
    addr: SocketAddr,
    agent: &Result<ops::StatusReport, ops::FetchError>,
) -> String {
    let report = match agent {
        Ok(report) => report,
        Err(e) => {
            return format!(
                "\nagent: not reachable at {addr} ({e}); pass its --metrics-bind-address \
                 as --metrics-address\n"
            )
        }
    };
    let mut out = if report.unreadable_files.is_empty() {
        format!("\nagent at {addr}: every manifest file is readable\n")
    } else {
        let mut out = format!(
            "\nagent at {addr}: {} manifest file(s) cannot be read (their last good objects stay):\n",
            report.unreadable_files.len()
        );
        for file in &report.unreadable_files {
            out += &format!("  {}: {}\n", file.path.display(), file.reason);
        }
        out
    };
    let modes = &report.modes;
    if !modes.lb_mode.is_empty() {
        let dispatch = if modes.lb_mode == "snat" {
            String::new()
        } else {
            format!(" (dispatch {})", modes.dsr_dispatch)
        };
        out += &format!(
            "modes: xdp {}, lb-mode {}{dispatch}, lb-algorithm {}, masquerade {}\n",
            modes.xdp, modes.lb_mode, modes.lb_algorithm, modes.masquerade
        );
    }
    for device in &report.xdp {
        out += &match &device.reason {
            Some(reason) => format!("xdp {}: {} ({reason})\n", device.device, device.state),
            None => format!("xdp {}: {}\n", device.device, device.state),
        };
    }
    out
}

fn run_agent(args: AgentArgs, layout: PinLayout) -> Result<()> {
    let cgroup = match args.cgroup {
        Some(path) => path,
        None => sys::cgroup2_root()?,
    };
    let config = AgentConfig {
        source: match args.services_file {
            Some(path) => ObjectSource::Files(path),
            None => ObjectSource::Kubernetes {
                kubeconfig: args.kubeconfig,
            },
        },
        cgroup,
        pin: layout,
        node_name: args.node_name.unwrap_or_else(hostname),
        bpf_object: args.bpf_object,
        sizes: MapSizes {
            services: args.services_map_size,
            backends: args.backends_map_size,
            sock_revnat: args.sock_revnat_map_size,
            affinity: args.affinity_map_size,
            conntrack: args.conntrack_map_size,
            maglev_slots: args.maglev_table_slots,
            masquerade: args.masquerade_map_size,
        },
        tc_mode: args.tc_attach,
        xdp_mode: args.xdp,
        forwarding: Forwarding {
            mode: args.lb_mode,
            dispatch: args.dsr_dispatch,
        },
        tc_overrides: Overrides {
            node_facing: args.ifaces,
            pod_facing: args.pod_ifaces,
            off: false,
        },
        node_ips: args.node_ips,
        nodeport_addresses: args.nodeport_addresses,
        node_port_range: args.nodeport_range,
        zone: args.zone,
        ct_timeouts: conntrack::Timeouts {
            tcp_syn: Duration::from_secs(args.ct_tcp_syn_timeout),
            tcp_established: Duration::from_secs(args.ct_tcp_timeout),
            tcp_closing: Duration::from_secs(args.ct_tcp_closing_timeout),
            udp: Duration::from_secs(args.ct_udp_timeout),
        },
        ct_gc_interval: Duration::from_millis(args.ct_gc_interval_ms),
        healthz_addr: args.healthz_bind_address,
        metrics_addr: args.metrics_bind_address,
        healthz_timeout: Duration::from_secs(args.healthz_timeout_secs),
        wait_for_lock: args.wait_for_lock,
        terminate_tcp: args.terminate_tcp_to_removed_endpoints,
        lb_algorithm: args.lb_algorithm,
        backend_quarantine: args.backend_quarantine == Switch::On,
        network_policy: args.network_policy == Switch::On,
        maglev_seed: args.maglev_seed,
        masquerade: args.masquerade,
        masquerade_all: args.masquerade_all,
        ip_masq_agent_config: args.ip_masq_agent_config,
        cluster_cidrs: args.cluster_cidr,
        consistency_interval: Duration::from_secs(args.consistency_check_interval_secs),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(agent::run(config))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent_args(extra: &[&str]) -> AgentArgs {
        let args = ["lb", "agent", "--services-file", "/nonexistent"]
            .iter()
            .chain(extra);
        match Cli::try_parse_from(args).expect("parses").command {
            Command::Agent(args) => *args,
            _ => unreachable!("the agent subcommand"),
        }
    }

    /// Passive health is on unless `--backend-quarantine off`; nothing but on and
    /// off is taken.
    #[test]
    fn backend_quarantine_defaults_to_on_and_takes_off() {
        assert_eq!(agent_args(&[]).backend_quarantine, Switch::On);
        assert_eq!(
            agent_args(&["--backend-quarantine", "off"]).backend_quarantine,
            Switch::Off
        );
        assert_eq!(
            agent_args(&["--backend-quarantine", "on"]).backend_quarantine,
            Switch::On
        );
        let args = [
            "lb",
            "agent",
            "--services-file",
            "/x",
            "--backend-quarantine",
            "no",
        ];
        assert!(Cli::try_parse_from(args).is_err());
    }

    /// NetworkPolicy is off unless `--network-policy on`: a CNI may enforce it
    /// already.
    #[test]
    fn network_policy_defaults_to_off_and_takes_on() {
        assert_eq!(agent_args(&[]).network_policy, Switch::Off);
        assert_eq!(
            agent_args(&["--network-policy", "on"]).network_policy,
            Switch::On
        );
    }

    /// Random stays the default; the flag turns Maglev on and can name random
    /// again; anything else is refused by name.
    #[test]
    fn lb_algorithm_defaults_to_random_and_takes_both_values() {
        let default = agent_args(&[]);
        assert_eq!(default.lb_algorithm, Algorithm::Random);
        assert_eq!(default.maglev_seed, 0);
        assert_eq!(default.maglev_table_slots, lb_common::DEFAULT_MAGLEV_SLOTS);
        for (value, want) in [("maglev", Algorithm::Maglev), ("random", Algorithm::Random)] {
            assert_eq!(agent_args(&["--lb-algorithm", value]).lb_algorithm, want);
        }
        let refused = Cli::try_parse_from([
            "lb",
            "agent",
            "--services-file",
            "/nonexistent",
            "--lb-algorithm",
            "consistent",
        ])
        .err()
        .expect("refused")
        .to_string();
        assert!(refused.contains("consistent"), "{refused}");
        assert!(refused.contains("maglev"), "{refused}");
    }

    #[test]
    fn maglev_seeds_are_decimal_or_hex() {
        assert_eq!(parse_seed("0"), Ok(0));
        assert_eq!(parse_seed("12345"), Ok(12_345));
        assert_eq!(parse_seed("0x6c62000000000001"), Ok(0x6c62_0000_0000_0001));
        assert_eq!(parse_seed("0XFF"), Ok(255));
        assert_eq!(parse_seed("18446744073709551615"), Ok(u64::MAX));
        for bad in ["", "-1", "0x", "0x1_0000_0000_0000_0000", "seed", "1e3"] {
            assert!(parse_seed(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            agent_args(&["--maglev-seed", "0x10"]).maglev_seed,
            16,
            "through clap"
        );
    }

    #[test]
    fn maglev_table_slots_are_whole_entries_with_room_for_a_table() {
        assert_eq!(maglev_slots("2097152"), Ok(2_097_152));
        // The header entry and the smallest table (252 slots).
        assert_eq!(maglev_slots("256"), Ok(256));
        for bad in ["252", "1026", "0", "4294967292", "lots"] {
            assert!(maglev_slots(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn frontends_are_read_as_lb_services_prints_them() {
        let f = parse_frontend("192.0.2.10:30080/TCP", false).unwrap();
        assert_eq!(
            f,
            Frontend::internal("192.0.2.10".parse().unwrap(), 30080, Protocol::Tcp)
        );
        let f = parse_frontend("[2001:db8::10]:443/udp", true).unwrap();
        assert_eq!(
            f,
            Frontend::internal("2001:db8::10".parse().unwrap(), 443, Protocol::Udp)
                .with_scope(Scope::External)
        );
        // An IPv4-mapped address is the IPv4 frontend.
        assert_eq!(
            parse_frontend("[::ffff:192.0.2.10]:30080/TCP", false).unwrap(),
            parse_frontend("192.0.2.10:30080/TCP", false).unwrap()
        );
        for bad in [
            "192.0.2.10:30080",
            "192.0.2.10/TCP",
            "192.0.2.10:30080/SCTP",
        ] {
            assert!(parse_frontend(bad, false).is_err(), "{bad:?}");
        }
    }
}
