//! The benchmark run: one topology, every datapath, every scale.
//!
//! ```text
//!   node ns: br0 10.244.1.1/24 ── pod-a 10.244.1.11, pod-b 10.244.1.12 (lb-bench serve)
//!                              ├─ client   10.244.1.20  direct + socket LB (bench cgroup)
//!                              ├─ client-2 10.244.1.21  iptables mode (rules in its nat OUTPUT)
//!                              └─ client-3 10.244.1.22  nftables mode
//!            ext0 192.168.77.1/24 ── ext ns eth0 192.168.77.100 (NodePort client, TC path)
//! ```
//!
//! Every link is dual-stack (pods fd00:244:1::11.., ext0 fd00:77::1, the external
//! client fd00:77::100): the measured Service has an IPv6 cluster IP too, and the
//! IPv6 rows (`socket-lb6`, `tc-nodeport6`) are paired with the IPv6 pod path as
//! the IPv4 rows are with the IPv4 one.
//!
//! Everything (namespaces, cgroups, pin dirs, processes, temp files) is owned by RAII
//! guards declared in teardown order; nothing touches the host's own namespace.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::api::ApiSource;
use crate::cpu::CpuCost;
use crate::kubeproxy::{self, ProxyConfig, SvcPort};
use crate::netio::{monotonic_ns, ClientReport, BULK_PORT, RR_PORT};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{
    documents, Endpoint, EndpointSlice, ManifestDir, Service, ServicePort, NODE_NAME,
};
use lb_tests::netns::NetNs;
use lb_tests::process::{Child, Spawner};
use lb_tests::topology::{pod_ip, pod_ip6, pod_name, Topology, GATEWAY6, SERVICE_CIDR};
use lb_tests::util::unique_name;

pub const ENDPOINTS_PER_SERVICE: usize = 10;
/// Changes timed per scale for the change-latency distribution (enough for a
/// p99.9 where the targets are judged, 10k and up), and the churn of other
/// Services meanwhile.
/// `LB_BENCH_CHANGES` overrides the count (a quick look at the distribution).
pub fn measured_changes(s: usize) -> usize {
    if let Some(n) = std::env::var("LB_BENCH_CHANGES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    if s >= 10_000 {
        1000
    } else {
        200
    }
}
pub const CHURN_PER_SEC: u64 = 50;
/// Services `churn.yaml` holds (each write moves one of them to another endpoint).
const CHURN_SERVICES: u64 = 20;

/// `churn.yaml` after `writes` writes: CHURN_SERVICES Services (cluster IPs in
/// 10.98.0.0/24, never connected to), the one the write is about on an endpoint
/// derived from the write count.
fn churn_manifests(writes: u64) -> String {
    documents((0..CHURN_SERVICES).map(|j| {
        let c = churn_service(j, writes);
        let svc = Service::new(
            &c.name,
            c.cluster_ip,
            vec![ServicePort::tcp("rr", SVC_PORT.into(), RR_PORT.into())],
        );
        let slice = EndpointSlice::for_service(
            &svc,
            vec![Endpoint::ready(&format!("{}-0", c.name), c.endpoints[0])],
        );
        format!("{}---\n{}", svc.to_yaml(), slice.to_yaml())
    }))
}

/// Churn Service `j` after `writes` writes: write w moves Service w % N to another
/// endpoint.
fn churn_service(j: u64, writes: u64) -> SvcPort {
    // How often service j was moved by writes 0..=writes.
    let moves = if writes >= j {
        (writes - j) / CHURN_SERVICES + 1
    } else {
        0
    };
    let ep =
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 130, 0, 1)) + (j * 1000 + moves % 1000) as u32);
    SvcPort {
        namespace: lb_tests::manifests::NAMESPACE.into(),
        name: format!("churn-{j}"),
        port_name: "rr".into(),
        // Past the S Services' cluster IPs (10.96.0.100 + i reaches 10.97.134.x at 100k).
        cluster_ip: Ipv4Addr::new(10, 98, 0, 1 + j as u8),
        port: SVC_PORT,
        target_port: RR_PORT,
        node_port: None,
        endpoints: vec![ep],
    }
}
pub const SVC_PORT: u16 = 80;
pub const NODE_PORT: u16 = 30080;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 100);
/// The external client's source for the NodePort baseline (direct to the pod IP).
const EXT_BASELINE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 101);
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
const EXT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x100);
const EXT_BASELINE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x101);
/// The measured Service's IPv6 cluster IP (the others are IPv4 only).
const MEASURED_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x100);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Config {
    pub quick: bool,
    /// Scales of every datapath.
    pub scales: Vec<usize>,
    /// Extra scales for our datapaths only.
    pub ours_extra_scales: Vec<usize>,
    /// Largest S the iptables / nftables peers are loaded with.
    pub iptables_max: usize,
    pub nft_max: usize,
    pub reps: usize,
    pub lat_count: u64,
    pub rate_secs: f64,
    pub bulk_secs: f64,
    pub cpu: usize,
    pub tc_path: bool,
    /// Only these datapaths (empty: all).
    pub only: Vec<String>,
    /// Time `measured_changes` changes under churn (full runs; `--change-distribution`).
    #[serde(default)]
    pub change_distribution: bool,
    /// Paired CPU per connection: connections per block, and rounds (a block to each
    /// side) per repetition.
    #[serde(default)]
    pub cpu_block: u64,
    #[serde(default)]
    pub cpu_rounds: u64,
}

impl Config {
    pub fn wants(&self, datapath: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == datapath)
    }

    pub fn new(quick: bool) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Config {
            quick,
            scales: if quick {
                vec![1, 1000]
            } else {
                vec![1, 1000, 10_000]
            },
            // Beyond what the peers load in the time budget (and beyond 16-bit ids).
            ours_extra_scales: if quick { vec![] } else { vec![65_000, 100_000] },
            iptables_max: 10_000,
            // nft -f of 10k Services took ~105 s with 4 endpoints (docs/benchmarks/NOTES.md); with
            // 10 endpoints it does not fit the bench's time budget.
            nft_max: 1000,
            reps: if quick { 1 } else { 3 },
            lat_count: if quick { 2000 } else { 4000 },
            rate_secs: if quick { 2.0 } else { 3.0 },
            bulk_secs: if quick { 2.0 } else { 3.0 },
            cpu: cpus - 1,
            tc_path: true,
            only: Vec::new(),
            change_distribution: !quick,
            // Sizing of the paired CPU runs, for the /proc/stat cross-check, the
            // statistical one (the task clocks it is judged by are exact; their
            // spread is the machine's, shown per repetition). A connection costs
            // ~80 µs of CPU here (12.5k conn/s on one busy CPU). Each 4 ms tick
            // (HZ=250) charges the whole tick to what the CPU was doing, so over N
            // ticks of a busy CPU the kernel's count is ~Binomial(N, p), relative
            // error sqrt((1-p) / (N p)); with p ~ 0.9 (system + softirq + irq: the
            // client and server spent 4-6 µs of ~150 in user mode in the first run,
            // but other tasks' ticks on the CPU lowered p to 0.7-0.85 there), 1%
            // needs N ~ 1100 ticks = 4.4 s = 55k connections per side (at p = 0.7,
            // 1.3%). Full: 3 repetitions x 11 rounds x
            // 2000 = 66k connections a side, ~1300 ticks: ~0.9%; /proc/stat's 10 ms
            // units add ~4 ms of rounding per block, sqrt(33) x 4 ms = 23 ms of
            // 5.3 s (0.4%). Quick: 1 x 8 x 2000 = 16k a side: ~2%. Cost: 2 x 22k x
            // 80 µs = 3.5 s per repetition and row: ~11 s per row, 20 rows (four
            // datapaths x five scales) ~4 min of a full run; quick ~2.6 s per row.
            // (On a loaded machine a connection took ~150 µs: twice that.)
            cpu_block: 2000,
            cpu_rounds: if quick { 8 } else { 11 },
        }
    }
}

/// One figure of a paired row's target and baseline per repetition, and their
/// ratio (the DSR and masquerade rows).
#[derive(Default)]
pub struct Samples {
    pub target: Vec<f64>,
    pub baseline: Vec<f64>,
    pub ratios: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, target: f64, baseline: f64) {
        self.target.push(target);
        self.baseline.push(baseline);
        self.ratios.push(target / baseline);
    }

    /// The last repetition's ratio of target to baseline (0 before any).
    pub fn ratio_last(&self) -> f64 {
        match (self.target.last(), self.baseline.last()) {
            (Some(t), Some(b)) => t / b,
            _ => 0.0,
        }
    }
}

/// median / min / max of repetitions.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Stat {
    pub fn of(mut v: Vec<f64>) -> Option<Stat> {
        if v.is_empty() {
            return None;
        }
        let samples = v.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
            samples,
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DataResult {
    pub datapath: String,
    pub services: usize,
    /// Where the measured Service sits in the iptables KUBE-SERVICES chain.
    pub position: Option<String>,
    pub lat_p50_us: Option<Stat>,
    pub lat_p99_us: Option<Stat>,
    pub conn_per_sec: Option<Stat>,
    pub bulk_mb_per_sec: Option<Stat>,
    pub errors: u64,
    /// Connection cycles over 200 ms in the rate runs (lost SYNs).
    #[serde(default)]
    pub stalls: u64,
    /// What the paired figures below compare against.
    #[serde(default)]
    pub paired_baseline: Option<String>,
    /// Per repetition: p50 (p99) of this datapath / p50 (p99) of the baseline, with
    /// connections to the two interleaved one by one in the same client process.
    #[serde(default)]
    pub paired_p50_ratio: Option<Stat>,
    #[serde(default)]
    pub paired_p99_ratio: Option<Stat>,
    /// Per repetition: median over alternating bulk windows of MB/s / baseline MB/s.
    #[serde(default)]
    pub paired_bulk_ratio: Option<Stat>,
    /// CPU per connection against the baseline's, from blocks of connections
    /// alternating between the two (crate::cpu).
    #[serde(default)]
    pub paired_cpu: Option<CpuCost>,
}

/// The direct path a datapath is paired with: the same backend by its pod IP, from
/// the same client.
#[derive(Clone, Copy)]
struct Baseline {
    rr: SocketAddr,
    bulk: SocketAddr,
    what: &'static str,
}

/// A measured datapath's pairing: its baseline, and the agent serving it (whose CPU
/// time the paired CPU run reports beside the connections').
#[derive(Clone, Copy)]
struct Paired {
    base: Baseline,
    agent_pid: Option<u64>,
}

impl Baseline {
    fn with_agent(self, pid: u64) -> Option<Paired> {
        Some(Paired {
            base: self,
            agent_pid: Some(pid),
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControlResult {
    pub datapath: String,
    pub services: usize,
    pub endpoints_per_service: usize,
    /// Wall time to program all Services (rule load, or agent start to listing).
    pub program_secs: Option<f64>,
    /// One EndpointSlice change to the first connection reaching the new backend.
    pub change_ms: Option<f64>,
    /// The same over `changes_measured` changes under churn of other Services.
    #[serde(default)]
    pub change_p50_ms: Option<f64>,
    #[serde(default)]
    pub change_p99_ms: Option<f64>,
    #[serde(default)]
    pub change_p999_ms: Option<f64>,
    #[serde(default)]
    pub change_max_ms: Option<f64>,
    #[serde(default)]
    pub changes_measured: usize,
    /// The agent's `slow change` log lines (over 10 ms) during the distribution,
    /// and the stage that took longest in each, counted.
    #[serde(default)]
    pub slow_changes: std::collections::BTreeMap<String, usize>,
    /// Peak RSS at the end of the row (after the churn, when measured).
    pub agent_vmhwm_kib: Option<u64>,
    /// Peak RSS read once the agent was ready.
    #[serde(default)]
    pub agent_vmhwm_ready_kib: Option<u64>,
    pub rules_bytes: Option<usize>,
    pub note: String,
    /// Where the agent's start went, from its own log (ms; `operations` is a count).
    #[serde(default)]
    pub agent_phases: std::collections::BTreeMap<String, u64>,
}

/// The agent's start-up phases from its log: BPF load, manifest parse, desired
/// state, plan and map writes of the first sync.
fn agent_phases(log: &[String]) -> std::collections::BTreeMap<String, u64> {
    let mut phases = std::collections::BTreeMap::new();
    let wanted: [(&str, &[(&str, &str)]); 4] = [
        ("datapath programs loaded", &[("load_ms", "load_ms")]),
        ("manifests read", &[("read_ms", "parse_ms")]),
        ("desired state built", &[("desired_ms", "desired_ms")]),
        (
            "service table applied",
            &[
                ("plan_ms", "plan_ms"),
                ("apply_ms", "apply_ms"),
                // A start into empty maps plans and writes at once (two threads).
                ("total_ms", "maps_ms"),
                ("operations", "operations"),
            ],
        ),
    ];
    for (needle, fields) in wanted {
        let Some(line) = log.iter().find(|l| l.contains(needle)) else {
            continue;
        };
        for (field, name) in fields {
            let value = line
                .split_whitespace()
                .find_map(|word| word.strip_prefix(field)?.strip_prefix('=')?.parse().ok());
            if let Some(value) = value {
                phases.insert(name.to_string(), value);
            }
        }
    }
    phases
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Skipped {
    pub datapath: String,
    pub services: usize,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub config: Config,
    pub machine: serde_json::Value,
    pub direct_start: Option<DataResult>,
    pub direct_end: Option<DataResult>,
    pub datapaths: Vec<DataResult>,
    pub control: Vec<ControlResult>,
    pub skipped: Vec<Skipped>,
    pub errors: Vec<String>,
    pub wall_secs: f64,
    /// NodePort packet rate on one CPU (pps.rs).
    #[serde(default)]
    pub pps: Vec<crate::pps::PpsResult>,
    /// DSR against SNAT for a backend on another node (dsr.rs).
    #[serde(default)]
    pub dsr: Option<crate::dsr::DsrResult>,
    /// Bulk TCP through XDP against TC (xdp_bulk.rs).
    #[serde(default)]
    pub xdp_bulk: Option<crate::xdp_bulk::XdpBulkResult>,
    /// Egress masquerading, lb against iptables MASQUERADE (masq.rs).
    #[serde(default)]
    pub masq: Option<crate::masq::MasqResult>,
    /// A dead backend's share of failed connections, lb against iptables mode
    /// (quarantine.rs).
    #[serde(default)]
    pub quarantine: Option<crate::quarantine::QuarantineResult>,
    /// NetworkPolicy change -> enforced at 10k pods and 1k policies (policy.rs).
    #[serde(default)]
    pub policy: Option<crate::policy::PolicyResult>,
    /// Connection rate and bulk through pods 1k policies select, against open
    /// ones (policy_rate.rs).
    #[serde(default)]
    pub policy_rate: Option<crate::policy_rate::PolicyRateResult>,
}

/// The bench environment. Field order is teardown order.
pub struct Env {
    servers: Vec<Child>,
    ext: NetNs,
    pub topo: Topology,
    cgroup: Cgroup,
    tc_cgroup: Cgroup,
    manifests: ManifestDir,
    tmp: TempDir,
    exe: PathBuf,
    lb: PathBuf,
    cfg: Config,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `lb-bench client --to TO --cpu CPU ARGS...` (`exe` is lb-bench) in `ns`, in
/// `cgroup` when given (else in none the agents hook); its report.
pub fn run_client(
    exe: &Path,
    cpu: usize,
    ns: &NetNs,
    cgroup: Option<&Cgroup>,
    to: SocketAddr,
    args: &[String],
) -> Result<ClientReport> {
    let mut sp = Spawner::new(exe).netns(ns)?;
    if let Some(cgroup) = cgroup {
        sp = sp.cgroup(cgroup)?;
    }
    let out = sp
        .args(["client", "--to", &to.to_string(), "--cpu", &cpu.to_string()])
        .args(args)
        .output(Duration::from_secs(120))?
        .checked_stdout()?;
    let line = out.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("client printed {out}"))
}

/// The client's arguments for one paired-cpu run against `baseline` (sized by
/// `cfg.cpu_block` and `cfg.cpu_rounds`), the CPU time of the processes `servers`
/// counted with the client's, the agent's `agent_pid` reported beside.
pub fn paired_cpu_args(
    cfg: &Config,
    baseline: SocketAddr,
    servers: &[u32],
    agent_pid: Option<u64>,
) -> Vec<String> {
    let servers: Vec<String> = servers.iter().map(u32::to_string).collect();
    let mut args = vec![
        "--mode".to_string(),
        "paired-cpu".into(),
        "--count".into(),
        cfg.cpu_block.max(1).to_string(),
        "--rounds".into(),
        cfg.cpu_rounds.max(1).to_string(),
        "--baseline".into(),
        baseline.to_string(),
        "--server-pids".into(),
        servers.join(","),
    ];
    if let Some(pid) = agent_pid.filter(|p| *p > 0) {
        args.extend(["--agent-pid".into(), pid.to_string()]);
    }
    args
}

/// `program ARGS` in `ns` through `ip netns exec` (for iptables and nft, which
/// need neither bpffs nor cgroups), stdin from `stdin_file`; how long it took.
pub(crate) fn ns_exec(
    ns: &NetNs,
    program: &str,
    args: &[&str],
    stdin_file: Option<&Path>,
) -> Result<Duration> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns.name(), program]).args(args);
    if let Some(f) = stdin_file {
        cmd.stdin(fs::File::open(f)?);
    }
    let t = Instant::now();
    let out = cmd.output().with_context(|| format!("running {program}"))?;
    let took = t.elapsed();
    if !out.status.success() {
        bail!(
            "{program} {args:?} in {} failed: {}",
            ns.name(),
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(2000)
                .collect::<String>()
        );
    }
    Ok(took)
}

/// The bench's manifests at scale `s`: `others.yaml` (S-1 Services with 10 unreachable
/// endpoints each) and `measured.yaml` (the measured Service, one endpoint on pod-a).
pub fn write_manifests(dir: &Path, s: usize) -> Result<()> {
    let s = s.max(1);
    let svcs = services(s, pod_ip(0));
    fs::create_dir_all(dir)?;
    let others = documents(svcs[..s - 1].iter().map(manifest_of));
    fs::write(dir.join("others.yaml"), others)?;
    fs::write(dir.join("measured.yaml"), manifest_of(&svcs[s - 1]))?;
    Ok(())
}

/// Cluster IP of Service `i` (the measured one is the last).
fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 100)) + i as u32)
}

/// Address of fake endpoint `j` of Service `i` (never connected to).
fn fake_ep(i: usize, j: usize) -> Ipv4Addr {
    let k = (i * ENDPOINTS_PER_SERVICE + j) as u32;
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 1)) + k)
}

fn svc_name(i: usize) -> String {
    format!("svc-{i}")
}

/// The S Services: S-1 with 10 unreachable endpoints, the measured one (last) with
/// one real endpoint `backend`.
fn services(s: usize, backend: Ipv4Addr) -> Vec<SvcPort> {
    (0..s).map(|i| service_at(s, i, backend)).collect()
}

/// Service `i` of the S (the measured one is the last).
fn service_at(s: usize, i: usize, backend: Ipv4Addr) -> SvcPort {
    let measured = i + 1 == s;
    SvcPort {
        namespace: lb_tests::manifests::NAMESPACE.into(),
        name: if measured {
            "measured".into()
        } else {
            svc_name(i)
        },
        port_name: "rr".into(),
        cluster_ip: vip(i),
        port: SVC_PORT,
        target_port: RR_PORT,
        node_port: measured.then_some(NODE_PORT),
        endpoints: if measured {
            vec![backend]
        } else {
            (0..ENDPOINTS_PER_SERVICE).map(|j| fake_ep(i, j)).collect()
        },
    }
}

fn manifest_of(svc: &SvcPort) -> String {
    let mut port = ServicePort::tcp(&svc.port_name, svc.port.into(), svc.target_port.into());
    let mut service = Service::new(&svc.name, svc.cluster_ip, vec![]);
    if let Some(np) = svc.node_port {
        port = port.with_node_port(np.into());
        service = service.node_port();
    }
    // The bulk port rides on a second Service port of the measured Service.
    let mut ports = vec![port];
    if svc.node_port.is_some() {
        let mut bulk = ServicePort::tcp("bulk", (SVC_PORT + 1).into(), BULK_PORT.into());
        bulk = bulk.with_node_port((NODE_PORT + 1).into());
        ports.push(bulk);
    }
    service.ports = ports;
    let eps = svc
        .endpoints
        .iter()
        .enumerate()
        .map(|(j, ip)| Endpoint::ready(&format!("{}-{j}", svc.name), *ip))
        .collect();
    let slice = EndpointSlice::for_service(&service, eps);
    if svc.node_port.is_none() {
        return format!("{}---\n{}", service.to_yaml(), slice.to_yaml());
    }
    // The measured Service is dual-stack: its IPv6 slice names the same pods by
    // their IPv6 addresses (pod_ip(i) <-> pod_ip6(i)).
    let service = service.dual_stack(MEASURED_VIP6);
    let eps6 = svc
        .endpoints
        .iter()
        .enumerate()
        .map(|(j, ip)| {
            let i = (0..2).find(|&i| pod_ip(i) == *ip).unwrap_or(0);
            Endpoint::ready(&format!("{}-{j}", svc.name), pod_ip6(i))
        })
        .collect();
    let slice6 = EndpointSlice::ipv6_for_service(&service, eps6);
    documents([service.to_yaml(), slice.to_yaml(), slice6.to_yaml()])
}

/// `pod_ip(0)`, as a constant.
const POD_A: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);

/// Socket LB's baseline: pod-a's IP from the same client pod, in the agent's cgroup
/// (so its connects pass the connect4 hook, which finds no Service).
const SOCKET_BASELINE: Baseline = Baseline {
    rr: SocketAddr::V4(SocketAddrV4::new(POD_A, RR_PORT)),
    bulk: SocketAddr::V4(SocketAddrV4::new(POD_A, BULK_PORT)),
    what: "pod IP, same client",
};

/// NodePort's baseline: pod-a's IP routed through the node from the same external
/// client, i.e. the same hops without the Service translation.
const NODEPORT_BASELINE: Baseline = Baseline {
    rr: SocketAddr::V4(SocketAddrV4::new(POD_A, RR_PORT)),
    bulk: SocketAddr::V4(SocketAddrV4::new(POD_A, BULK_PORT)),
    what: "pod IP routed via the node, same external client (2nd address)",
};

/// `pod_ip6(0)`, as a constant.
const POD_A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x11);

/// [`SOCKET_BASELINE`] over IPv6: pod-a's IPv6 address.
const SOCKET_BASELINE6: Baseline = Baseline {
    rr: SocketAddr::V6(SocketAddrV6::new(POD_A6, RR_PORT, 0, 0)),
    bulk: SocketAddr::V6(SocketAddrV6::new(POD_A6, BULK_PORT, 0, 0)),
    what: "pod IPv6 address, same client",
};

/// [`NODEPORT_BASELINE`] over IPv6.
const NODEPORT_BASELINE6: Baseline = Baseline {
    rr: SocketAddr::V6(SocketAddrV6::new(POD_A6, RR_PORT, 0, 0)),
    bulk: SocketAddr::V6(SocketAddrV6::new(POD_A6, BULK_PORT, 0, 0)),
    what: "pod IPv6 address routed via the node, same external client (2nd address)",
};

impl Env {
    pub fn new(exe: PathBuf, lb: PathBuf, cfg: Config) -> Result<Self> {
        lb_tests::util::require_root()?;
        let topo = Topology::build(2, 3)?;
        let tmp = TempDir(std::env::temp_dir().join(unique_name("lb-bench")));
        fs::create_dir_all(&tmp.0)?;
        let ext = NetNs::create(&format!("{}-ext", topo.base()))?;
        let mut env = Env {
            servers: Vec::new(),
            ext,
            cgroup: Cgroup::create(&unique_name("lb-bench"))?,
            tc_cgroup: Cgroup::create(&unique_name("lb-bench-tc"))?,
            manifests: ManifestDir::create()?,
            topo,
            tmp,
            exe,
            lb,
            cfg,
        };
        // Peers' clients route VIPs to the node (their nat OUTPUT DNATs them first).
        for c in &env.topo.clients()[1..] {
            c.netns()
                .ip(&["route", "del", "unreachable", SERVICE_CIDR])?;
        }
        // The NodePort client on a link of its own.
        let node = env.topo.node();
        node.sysctls(&[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
        ])?;
        node.veth_to("ext0", &env.ext, "eth0")?;
        node.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "ext0"])?;
        node.ip(&["link", "set", "ext0", "up"])?;
        env.ext
            .ip(&["addr", "add", &format!("{EXT_IP}/24"), "dev", "eth0"])?;
        env.ext.ip(&["link", "set", "eth0", "up"])?;
        // The NodePort baseline reaches the pods directly, routed by the node, from
        // a second address of the client. From the same address, a direct
        // connection and a NodePort one from a reused port are the same 4-tuple at
        // the pod (DNAT without SNAT) but get unrelated initial sequence numbers,
        // so the pod's TIME_WAIT refuses about half of the reuses: the NodePort
        // runs after the first paired one fell to ~1.2k conn/s with 12 ms p99.
        env.ext.ip(&[
            "addr",
            "add",
            &format!("{EXT_BASELINE_IP}/24"),
            "dev",
            "eth0",
        ])?;
        let [a, b, c, _] = lb_tests::topology::GATEWAY.octets();
        let pods = format!("{a}.{b}.{c}.0/24");
        env.ext.ip(&[
            "route",
            "add",
            &pods,
            "via",
            &NODE_IP.to_string(),
            "src",
            &EXT_BASELINE_IP.to_string(),
        ])?;
        // The same link, over IPv6 (no duplicate address detection: usable at once).
        node.sysctls(&[("net/ipv6/conf/all/forwarding", "1")])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_IP6}/64"),
            "dev",
            "ext0",
            "nodad",
        ])?;
        env.ext.ip(&[
            "addr",
            "add",
            &format!("{EXT_IP6}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        // Deprecated (preferred_lft 0): never the default source, so the NodePort
        // connections come from EXT_IP6 and only the baseline route's `src` uses it
        // (the reason for a second address is the same as over IPv4, above).
        env.ext.ip(&[
            "addr",
            "add",
            &format!("{EXT_BASELINE_IP6}/64"),
            "dev",
            "eth0",
            "nodad",
            "preferred_lft",
            "0",
        ])?;
        let pods6 = format!("{}/64", GATEWAY6);
        env.ext.ip(&[
            "-6",
            "route",
            "add",
            &pods6,
            "via",
            &NODE_IP6.to_string(),
            "src",
            &EXT_BASELINE_IP6.to_string(),
        ])?;
        node.sysctls(&[("net/ipv4/conf/*/rp_filter", "0")])?;
        for i in 0..2 {
            let server = serve_in(&env.exe, &env.topo.pods()[i], &pod_name(i), env.cfg.cpu)?;
            env.servers.push(server);
        }
        Ok(env)
    }

    fn client(
        &self,
        ns: &NetNs,
        in_cgroup: bool,
        to: SocketAddr,
        args: &[String],
    ) -> Result<ClientReport> {
        let cgroup = in_cgroup.then_some(&self.cgroup);
        run_client(&self.exe, self.cfg.cpu, ns, cgroup, to, args)
    }

    /// Latency, rate and (optionally) bulk, `reps` times; with a baseline, also
    /// latency, bulk and CPU per connection interleaved with it.
    #[allow(clippy::too_many_arguments)]
    fn measure(
        &self,
        name: &str,
        s: usize,
        ns: &NetNs,
        cg: bool,
        to: SocketAddr,
        bulk_to: Option<SocketAddr>,
        baseline: Option<Paired>,
    ) -> Result<DataResult> {
        let (mut p50, mut p99, mut rate, mut bulk) = (vec![], vec![], vec![], vec![]);
        let (mut pair_p50, mut pair_p99, mut pair_bulk) = (vec![], vec![], vec![]);
        let mut pair_cpu = vec![];
        let mut errors = 0;
        let mut stalls = 0;
        for rep in 0..self.cfg.reps {
            lb_tests::interrupt::check()?;
            let lat = self.client(
                ns,
                cg,
                to,
                &[
                    "--mode".into(),
                    "lat".into(),
                    "--count".into(),
                    self.cfg.lat_count.to_string(),
                ],
            )?;
            errors += lat.errors;
            p50.extend(lat.p50_us);
            p99.extend(lat.p99_us);
            let r = self.client(
                ns,
                cg,
                to,
                &[
                    "--mode".into(),
                    "rate".into(),
                    "--secs".into(),
                    self.cfg.rate_secs.to_string(),
                ],
            )?;
            errors += r.errors;
            stalls += r.stalls;
            rate.extend(r.conn_per_sec);
            if let Some(b) = bulk_to {
                let r = self.client(
                    ns,
                    cg,
                    b,
                    &[
                        "--mode".into(),
                        "bulk".into(),
                        "--secs".into(),
                        self.cfg.bulk_secs.to_string(),
                    ],
                )?;
                bulk.extend(r.mb_per_sec);
            }
            if let Some(Paired { base, agent_pid }) = baseline {
                let base_arg = |a: SocketAddr| ["--baseline".to_string(), a.to_string()];
                let lat = self.client(
                    ns,
                    cg,
                    to,
                    &[
                        &["--mode".into(), "paired-lat".into()][..],
                        &["--count".into(), self.cfg.lat_count.to_string()],
                        &base_arg(base.rr),
                    ]
                    .concat(),
                )?;
                errors += lat.errors;
                if let (Some(t), Some(b)) = (lat.p50_us, lat.baseline_p50_us) {
                    pair_p50.push(t / b);
                }
                if let (Some(t), Some(b)) = (lat.p99_us, lat.baseline_p99_us) {
                    pair_p99.push(t / b);
                }
                if let Some(bulk_to) = bulk_to {
                    let r = self.client(
                        ns,
                        cg,
                        bulk_to,
                        &[
                            &["--mode".into(), "paired-bulk".into()][..],
                            &["--secs".into(), (2.0 * self.cfg.bulk_secs).to_string()],
                            &base_arg(base.bulk),
                        ]
                        .concat(),
                    )?;
                    pair_bulk.extend(r.bulk_ratio);
                }
                let cpu = self.paired_cpu(ns, cg, to, base.rr, agent_pid)?;
                errors += cpu.errors;
                pair_cpu.extend(cpu.cpu);
                let cpu_now = pair_cpu
                    .last()
                    .and_then(|r| CpuCost::of(std::slice::from_ref(r)));
                println!(
                    "  {name:<10} S={s:<6} rep {rep}: paired with {}: p50 {:.3}x, p99 {:.3}x{}{}",
                    base.what,
                    pair_p50.last().copied().unwrap_or_default(),
                    pair_p99.last().copied().unwrap_or_default(),
                    pair_bulk
                        .last()
                        .map(|b| format!(", bulk {b:.3}x"))
                        .unwrap_or_default(),
                    cpu_now
                        .map(|c| format!(
                            ", CPU {:.1} vs {:.1} us/conn {:.3}x (ticks {:.3}x, user {:.1} us, idle {:.1}%)",
                            c.kernel_us,
                            c.baseline_kernel_us,
                            c.ratio,
                            c.ticks_ratio,
                            c.user_us,
                            100.0 * c.ticks_idle_share
                        ))
                        .unwrap_or_default()
                );
            }
            println!(
                "  {name:<10} S={s:<6} rep {rep}: p50 {:.1} us, p99 {:.1} us, {:.0} conn/s ({} stalls){} (backends {:?})",
                lat.p50_us.unwrap_or_default(),
                lat.p99_us.unwrap_or_default(),
                r_last(&rate),
                r.stalls,
                bulk.last().map(|b| format!(", {b:.0} MB/s")).unwrap_or_default(),
                lat.backends
            );
        }
        Ok(DataResult {
            datapath: name.into(),
            services: s,
            position: None,
            lat_p50_us: Stat::of(p50),
            lat_p99_us: Stat::of(p99),
            conn_per_sec: Stat::of(rate),
            bulk_mb_per_sec: Stat::of(bulk),
            errors,
            stalls,
            paired_baseline: baseline.map(|b| b.base.what.to_owned()),
            paired_p50_ratio: Stat::of(pair_p50),
            paired_p99_ratio: Stat::of(pair_p99),
            paired_bulk_ratio: Stat::of(pair_bulk),
            paired_cpu: CpuCost::of(&pair_cpu),
        })
    }

    /// One paired-cpu client run: `cpu_rounds` blocks of `cpu_block` connections to
    /// `to` and to `baseline`, the servers' CPU time counted with the client's.
    fn paired_cpu(
        &self,
        ns: &NetNs,
        cg: bool,
        to: SocketAddr,
        baseline: SocketAddr,
        agent_pid: Option<u64>,
    ) -> Result<ClientReport> {
        let servers: Vec<u32> = self.servers.iter().map(Child::pid).collect();
        let args = paired_cpu_args(&self.cfg, baseline, &servers, agent_pid);
        let r = self.client(ns, cg, to, &args)?;
        if r.cpu.is_none() {
            bail!("paired-cpu client to {to} reported no CPU figures");
        }
        Ok(r)
    }

    /// Start a watcher that connects until pod-b answers; run `change`; the time from
    /// just before `change` to the first answer from pod-b.
    fn change_latency(
        &self,
        ns: &NetNs,
        cg: bool,
        to: SocketAddr,
        change: impl FnOnce() -> Result<()>,
    ) -> Result<f64> {
        self.change_latency_until(ns, cg, to, &pod_name(1), change)
    }

    /// [`Env::change_latency`] until backend `until` answers.
    fn change_latency_until(
        &self,
        ns: &NetNs,
        cg: bool,
        to: SocketAddr,
        until: &str,
        change: impl FnOnce() -> Result<()>,
    ) -> Result<f64> {
        let mut sp = Spawner::new(&self.exe).netns(ns)?;
        if cg {
            sp = sp.cgroup(&self.cgroup)?;
        }
        let mut child = sp
            .args([
                "client",
                "--to",
                &to.to_string(),
                "--mode",
                "watch",
                "--until",
                until,
                "--secs",
                "60",
            ])
            .spawn()?;
        child
            .stdout
            .wait_for(Duration::from_secs(10), |l| l.contains("watching"))?;
        std::thread::sleep(Duration::from_millis(100));
        let t0 = monotonic_ns();
        change()?;
        let status = child.wait_interruptible(Duration::from_secs(90))?;
        if status.is_none() {
            bail!("watcher did not finish");
        }
        child.stdout.wait_closed(Duration::from_secs(5))?;
        let out = child.stdout.text();
        let line = out.lines().last().unwrap_or_default();
        let r: ClientReport =
            serde_json::from_str(line).with_context(|| format!("watcher printed {out}"))?;
        let seen = r.seen_at_ns.context("the new backend never answered")?;
        Ok(seen.saturating_sub(t0) as f64 / 1e6)
    }

    pub fn direct(&self) -> Result<DataResult> {
        let to = SocketAddr::new(pod_ip(0).into(), RR_PORT);
        let bulk = SocketAddr::new(pod_ip(0).into(), BULK_PORT);
        self.measure(
            "direct",
            0,
            self.topo.client().netns(),
            false,
            to,
            Some(bulk),
            None,
        )
    }

    fn vip_addr(&self, s: usize) -> SocketAddr {
        SocketAddr::new(vip(s - 1).into(), SVC_PORT)
    }

    pub fn iptables(&self, s: usize, res: &mut Results) -> Result<()> {
        let ns = self.topo.clients()[1].netns();
        let cfg = ProxyConfig::default();
        let svcs = services(s, pod_ip(0));
        let rules = kubeproxy::iptables_full(&svcs, &cfg);
        let file = self.tmp.0.join("iptables.rules");
        fs::write(&file, &rules)?;
        let took = ns_exec(ns, "iptables-restore", &[], Some(&file))?;
        println!(
            "  iptables   S={s:<6} iptables-restore: {:.2} s ({} bytes)",
            took.as_secs_f64(),
            rules.len()
        );
        let mut d = self.measure("iptables", s, ns, false, self.vip_addr(s), None, None)?;
        d.position = Some(if s == 1 {
            "only".into()
        } else {
            format!("last ({s} of {s})")
        });
        res.datapaths.push(d);
        // One EndpointSlice change as a partial sync (--noflush).
        let mut change_ms = None;
        let mut note = "iptables-restore (nft backend) without --noflush into the client namespace"
            .to_string();
        if s <= 1000 {
            let mut changed = svcs[s - 1].clone();
            changed.endpoints = vec![pod_ip(1)];
            let mut all = svcs.clone();
            all[s - 1] = changed.clone();
            let partial = kubeproxy::iptables_partial(&all, &changed, &[pod_ip(0)], &cfg);
            let pfile = self.tmp.0.join("iptables.partial");
            fs::write(&pfile, partial)?;
            change_ms = Some(self.change_latency(ns, false, self.vip_addr(s), || {
                ns_exec(ns, "iptables-restore", &["--noflush"], Some(&pfile)).map(drop)
            })?);
        } else {
            note += "; change skipped: iptables-nft-restore --noflush takes minutes at this size (docs/benchmarks/NOTES.md)";
        }
        res.control.push(ControlResult {
            datapath: "iptables".into(),
            services: s,
            endpoints_per_service: ENDPOINTS_PER_SERVICE,
            program_secs: Some(took.as_secs_f64()),
            change_ms,
            change_p50_ms: None,
            change_p99_ms: None,
            change_p999_ms: None,
            change_max_ms: None,
            changes_measured: 0,
            slow_changes: Default::default(),
            agent_vmhwm_kib: None,
            agent_vmhwm_ready_kib: None,
            rules_bytes: Some(rules.len()),
            note,
            agent_phases: Default::default(),
        });
        Ok(())
    }

    pub fn nft(&self, s: usize, res: &mut Results) -> Result<()> {
        let ns = self.topo.clients()[2].netns();
        let cfg = ProxyConfig::default();
        let svcs = services(s, pod_ip(0));
        let rules = kubeproxy::nft_full(&svcs, &cfg);
        let file = self.tmp.0.join("nft.rules");
        fs::write(&file, &rules)?;
        let took = ns_exec(ns, "nft", &["-f", &file.to_string_lossy()], None)?;
        println!(
            "  nftables   S={s:<6} nft -f: {:.2} s ({} bytes)",
            took.as_secs_f64(),
            rules.len()
        );
        let d = self.measure("nftables", s, ns, false, self.vip_addr(s), None, None)?;
        res.datapaths.push(d);
        let mut changed = svcs[s - 1].clone();
        changed.endpoints = vec![pod_ip(1)];
        let pfile = self.tmp.0.join("nft.partial");
        fs::write(&pfile, kubeproxy::nft_partial(&changed, &[pod_ip(0)], &cfg))?;
        let change_ms = self.change_latency(ns, false, self.vip_addr(s), || {
            ns_exec(ns, "nft", &["-f", &pfile.to_string_lossy()], None).map(drop)
        })?;
        res.control.push(ControlResult {
            datapath: "nftables".into(),
            services: s,
            endpoints_per_service: ENDPOINTS_PER_SERVICE,
            program_secs: Some(took.as_secs_f64()),
            change_ms: Some(change_ms),
            change_p50_ms: None,
            change_p99_ms: None,
            change_p999_ms: None,
            change_max_ms: None,
            changes_measured: 0,
            slow_changes: Default::default(),
            agent_vmhwm_kib: None,
            agent_vmhwm_ready_kib: None,
            rules_bytes: Some(rules.len()),
            note: "nft -f of the whole table (one transaction)".into(),
            agent_phases: Default::default(),
        });
        Ok(())
    }

    fn write_manifests(&self, s: usize) -> Result<()> {
        write_manifests(self.manifests.path(), s)
    }

    /// Rewrites `measured.yaml` with `backend`. Inside the timed window of a change:
    /// builds the measured Service alone (building all S first took tens of ms at
    /// 100k and was counted as the agent's latency before).
    fn set_measured_backend(&self, s: usize, backend: Ipv4Addr) -> Result<()> {
        let m = service_at(s.max(1), s.max(1) - 1, backend);
        self.manifests.write("measured.yaml", &manifest_of(&m))
    }

    /// Start an agent; the time until `lb services --json` lists all S frontends.
    fn start_agent(&self, s: usize, tc: bool) -> Result<(Agent, f64, u64)> {
        self.start_agent_from(s, tc, None)
    }

    /// [`Env::start_agent`], following the API server `kubeconfig` names when given.
    fn start_agent_from(
        &self,
        s: usize,
        tc: bool,
        kubeconfig: Option<&Path>,
    ) -> Result<(Agent, f64, u64)> {
        let size = (s * (ENDPOINTS_PER_SERVICE + 2) + 4096)
            .max(65_536)
            .to_string();
        let mut args: Vec<String> = vec![
            "--services-map-size".into(),
            size.clone(),
            "--backends-map-size".into(),
            size,
        ];
        // LB_BENCH_AGENT_ARGS adds agent flags (space-separated), to look at one
        // cause by hand, e.g. `--consistency-check-interval-secs 5`.
        if let Ok(extra) = std::env::var("LB_BENCH_AGENT_ARGS") {
            args.extend(extra.split_whitespace().map(String::from));
        }
        let cg = if tc { &self.tc_cgroup } else { &self.cgroup };
        let mut spec = AgentSpec::new(self.manifests.path(), cg, NODE_NAME);
        if tc {
            // As on a real node: the agent finds the devices and addresses itself.
            spec = spec.netns(self.topo.node());
        }
        if let Some(path) = kubeconfig {
            spec = spec.kubeconfig(path);
        }
        let spec = spec.args(args);
        let mut agent = Agent::start_with(&self.lb, &spec)?;
        // Timed from the agent's exec (spawn returns once it succeeded), not from
        // the fork: this process holds the fake API server's encoded objects, and
        // forking it took 0.45-2.0 s at 100k, a cost of the bench and not the agent's.
        let t = Instant::now();
        agent.set_log_on_drop(false);
        // Frontends: S ClusterIPs + the bulk port; NodePort entries come on top.
        let want = s + 1;
        // Bounded: 100k Services get at most READY_TIMEOUT + 150 s.
        let timeout = READY_TIMEOUT + Duration::from_secs((s as u64 / 200).min(150));
        // The agent says `ready and serving` once every map entry is written and the
        // hooks are attached; watching its log costs the agent nothing, where
        // polling `lb services` would compete with it for the CPUs.
        agent
            .wait_for_line("ready and serving", timeout)
            .with_context(|| {
                format!("agent did not program {want} frontends within {timeout:?}")
            })?;
        let ready = t.elapsed().as_secs_f64();
        if let Some(line) = agent
            .log()
            .iter()
            .find(|l| l.contains("no free frontend id"))
        {
            bail!("the agent cannot hold {want} frontends: {}", line.trim());
        }
        // Then check the claim: every frontend is in the maps.
        let listed = agent
            .services_json()?
            .iter()
            .filter(|e| e.frontend.port == SVC_PORT || e.frontend.port == SVC_PORT + 1)
            .count();
        if listed < want {
            bail!("agent said ready with {listed} of {want} frontends in the maps");
        }
        let pid = pid_of_agent(agent.pin_dir()).unwrap_or(0);
        Ok((agent, ready, pid))
    }

    /// [`measured_changes`] changes of the measured Service's endpoint (pod-a and
    /// pod-b in turn), each timed from just before its manifest write to the first
    /// connection that reaches the new backend, while a thread rewrites
    /// `churn.yaml` (other Services, one endpoint moved per write)
    /// [`CHURN_PER_SEC`] times a second. The latencies in ms, sorted.
    /// No samples unless `--change-distribution` asked for them.
    fn change_distribution(
        &self,
        label: &str,
        s: usize,
        ns: &NetNs,
        to: SocketAddr,
        churn_write: &(dyn Fn(u64) -> Result<()> + Sync),
        set_backend: &dyn Fn(Ipv4Addr) -> Result<()>,
    ) -> Result<Vec<f64>> {
        use std::sync::atomic::{AtomicBool, Ordering};
        if !self.cfg.change_distribution {
            return Ok(Vec::new());
        }
        // LB_BENCH_CHURN_PER_SEC overrides the rate, to tell the churn's share of
        // the latency from the rest.
        let rate = std::env::var("LB_BENCH_CHURN_PER_SEC")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(CHURN_PER_SEC)
            .max(1);
        let period = Duration::from_micros(1_000_000 / rate);
        let stop = AtomicBool::new(false);
        let count = measured_changes(s);
        let mut samples = Vec::with_capacity(count);
        let (measured, writes) = std::thread::scope(|scope| {
            // Written as every manifest of the bench is (staged, then renamed in).
            let churn = scope.spawn(|| -> Result<u64> {
                let mut writes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let next = Instant::now() + period;
                    churn_write(writes)?;
                    writes += 1;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
                Ok(writes)
            });
            let measured = (|| -> Result<()> {
                for k in 0..count {
                    lb_tests::interrupt::check()?;
                    let target = if k % 2 == 0 { 1 } else { 0 };
                    let ms = self.change_latency_until(ns, true, to, &pod_name(target), || {
                        set_backend(pod_ip(target))
                    })?;
                    samples.push(ms);
                }
                Ok(())
            })();
            stop.store(true, Ordering::Relaxed);
            let writes = churn
                .join()
                .map_err(|_| anyhow::anyhow!("churn thread panicked"));
            (measured, writes)
        });
        measured?;
        let writes = writes??;
        println!(
            "  {label:<10} S={s:<6} {} changes under {writes} churn writes",
            samples.len()
        );
        samples.sort_by(f64::total_cmp);
        Ok(samples)
    }

    pub fn ours(&self, s: usize, res: &mut Results, peers_too: bool) -> Result<()> {
        let _ = peers_too;
        self.write_manifests(s)?;
        let (agent, listed, pid) = self.start_agent(s, false)?;
        let ready_kib = vm_hwm_kib(pid);
        println!("  socket-lb  S={s:<6} agent programmed in {listed:.2} s");
        let to = self.vip_addr(s);
        let bulk = SocketAddr::new(vip(s - 1).into(), SVC_PORT + 1);
        let ns = self.topo.client().netns();
        res.datapaths.push(self.measure(
            "socket-lb",
            s,
            ns,
            true,
            to,
            Some(bulk),
            SOCKET_BASELINE.with_agent(pid),
        )?);
        if self.cfg.wants("socket-lb6") {
            let vip6 = |port| SocketAddr::new(MEASURED_VIP6.into(), port);
            res.datapaths.push(self.measure(
                "socket-lb6",
                s,
                ns,
                true,
                vip6(SVC_PORT),
                Some(vip6(SVC_PORT + 1)),
                SOCKET_BASELINE6.with_agent(pid),
            )?);
        }
        let change_ms =
            self.change_latency(ns, true, to, || self.set_measured_backend(s, pod_ip(1)))?;
        show_changes(&agent);
        let churn = |writes| self.manifests.write("churn.yaml", &churn_manifests(writes));
        let set = |ip| self.set_measured_backend(s, ip);
        let distribution = self.change_distribution("socket-lb", s, ns, to, &churn, &set);
        let _ = self.manifests.remove("churn.yaml");
        let distribution = distribution?;
        res.control.push(control_row(
            "socket-lb",
            s,
            (&agent, listed, pid),
            ready_kib,
            change_ms,
            &distribution,
            "agent start (load, parse, sync, attach) until it logs `ready and serving`, then checked with `lb services --json`; change = manifest file rewrite (inotify)",
        ));
        drop(agent);
        self.set_measured_backend(s, pod_ip(0))?;
        if s > 10_000 && listed > 60.0 {
            res.skipped.push(Skipped {
                datapath: "tc-nodeport".into(),
                services: s,
                reason: format!("the agent took {listed:.0} s to program {s} Services; a second start did not fit the time budget"),
            });
        } else if self.cfg.tc_path && self.cfg.wants("tc-nodeport") {
            if let Err(e) = self.tc(s, res) {
                res.errors.push(format!("tc S={s}: {e:#}"));
                eprintln!("tc path S={s} failed: {e:#}");
            }
        }
        Ok(())
    }

    /// The socket-LB agent following the fake API server: list -> ready (agent start
    /// to `ready and serving`), one change, the change distribution under churn,
    /// and the agent's peak RSS.
    pub fn ours_api(&self, s: usize, res: &mut Results) -> Result<()> {
        let s = s.max(1);
        let api = ApiSource::start(&self.tmp.0)?;
        let loading = Instant::now();
        api.load(&services(s, pod_ip(0)));
        println!(
            "  socket-lb-api S={s:<6} fake API server loaded in {:.1} s",
            loading.elapsed().as_secs_f64()
        );
        let (agent, listed, pid) = self.start_agent_from(s, false, Some(api.kubeconfig()))?;
        let ready_kib = vm_hwm_kib(pid);
        println!("  socket-lb-api S={s:<6} agent listed and programmed in {listed:.2} s");
        let to = self.vip_addr(s);
        let ns = self.topo.client().netns();
        let set = |ip| {
            api.put_slice(&service_at(s, s - 1, ip));
            Ok(())
        };
        let change_ms = self.change_latency(ns, true, to, || set(pod_ip(1)))?;
        let churn = |writes: u64| {
            let j = writes % CHURN_SERVICES;
            let svc = churn_service(j, writes);
            // The Service once, then only its slice: one event per write.
            if writes < CHURN_SERVICES {
                api.put(&svc);
            } else {
                api.put_slice(&svc);
            }
            Ok(())
        };
        let distribution = self.change_distribution("socket-lb-api", s, ns, to, &churn, &set)?;
        show_changes(&agent);
        res.control.push(control_row(
            "socket-lb-api",
            s,
            (&agent, listed, pid),
            ready_kib,
            change_ms,
            &distribution,
            "agent start until `ready and serving` (BPF load, list of S Services and S slices from the fake API server in pages of 500, sync, attach); change = one EndpointSlice written to the fake API server (watch event)",
        ));
        Ok(())
    }

    fn tc(&self, s: usize, res: &mut Results) -> Result<()> {
        let (agent, listed, pid) = self.start_agent(s, true)?;
        println!("  tc-nodeport S={s:<6} agent programmed in {listed:.2} s");
        let mut rows = vec![("tc-nodeport", IpAddr::from(NODE_IP), NODEPORT_BASELINE)];
        if self.cfg.wants("tc-nodeport6") {
            rows.push(("tc-nodeport6", NODE_IP6.into(), NODEPORT_BASELINE6));
        }
        for (name, node_ip, baseline) in rows {
            let d = self
                .measure(
                    name,
                    s,
                    &self.ext,
                    false,
                    SocketAddr::new(node_ip, NODE_PORT),
                    Some(SocketAddr::new(node_ip, NODE_PORT + 1)),
                    baseline.with_agent(pid),
                )
                .map_err(|e| {
                    let stats = agent.lb_command(&["stats"]).unwrap_or_default();
                    let ct = agent.lb_command(&["conntrack"]).unwrap_or_default();
                    let svcs = agent.lb_command(&["services"]).unwrap_or_default();
                    e.context(format!(
                        "stats:\n{stats}\nconntrack:\n{}\nservices:\n{}\nlog tail:\n{}",
                        ct.lines().take(8).collect::<Vec<_>>().join("\n"),
                        svcs.lines().rev().take(8).collect::<Vec<_>>().join("\n"),
                        tail(&agent.log(), 8)
                    ))
                })?;
            res.datapaths.push(d);
        }
        res.control.push(ControlResult {
            datapath: "tc-nodeport".into(),
            services: s,
            endpoints_per_service: ENDPOINTS_PER_SERVICE,
            program_secs: Some(listed),
            change_ms: None,
            change_p50_ms: None,
            change_p99_ms: None,
            change_p999_ms: None,
            change_max_ms: None,
            changes_measured: 0,
            slow_changes: Default::default(),
            agent_vmhwm_kib: vm_hwm_kib(pid),
            agent_vmhwm_ready_kib: None,
            rules_bytes: None,
            note: "agent in the node namespace, devices and addresses found by the agent (no interface flags)".into(),
            agent_phases: agent_phases(&agent.log()),
        });
        drop(agent);
        Ok(())
    }
}

/// The last `n` lines.
/// One agent's control-plane row: its start (`started`: the agent, seconds to
/// ready, pid), one change, and the change distribution (sorted ms), whose
/// quantiles are printed too.
fn control_row(
    datapath: &str,
    s: usize,
    started: (&Agent, f64, u64),
    ready_kib: Option<u64>,
    change_ms: f64,
    distribution: &[f64],
    note: &str,
) -> ControlResult {
    let (agent, listed, pid) = started;
    // LB_BENCH_AGENT_LOG=DIR keeps each row's whole agent log (the slow changes'
    // stages, the file source's reads) for a closer look.
    if let Some(dir) = std::env::var_os("LB_BENCH_AGENT_LOG") {
        let path = std::path::Path::new(&dir).join(format!("{datapath}-{s}.log"));
        if let Err(e) = fs::write(&path, agent.log().join("\n")) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
    let quantile =
        |q: f64| (!distribution.is_empty()).then(|| crate::netio::percentile(distribution, q));
    let slow_changes = slow_changes(&agent.log());
    if let (Some(p50), Some(p99), Some(p999)) = (quantile(0.5), quantile(0.99), quantile(0.999)) {
        println!(
            "  {datapath:<10} S={s:<6} change -> datapath: p50 {p50:.2} ms, p99 {p99:.2} ms, p99.9 {p999:.2} ms, max {:.2} ms ({} changes); slow changes by stage: {slow_changes:?}",
            distribution.last().copied().unwrap_or_default(),
            distribution.len()
        );
    }
    ControlResult {
        datapath: datapath.into(),
        services: s,
        endpoints_per_service: ENDPOINTS_PER_SERVICE,
        program_secs: Some(listed),
        change_ms: Some(change_ms),
        change_p50_ms: quantile(0.5),
        change_p99_ms: quantile(0.99),
        change_p999_ms: quantile(0.999),
        change_max_ms: distribution.last().copied(),
        changes_measured: distribution.len(),
        slow_changes,
        agent_vmhwm_kib: vm_hwm_kib(pid),
        agent_vmhwm_ready_kib: ready_kib,
        rules_bytes: None,
        note: note.into(),
        agent_phases: agent_phases(&agent.log()),
    }
}

/// The agent's `slow change` lines, counted by the stage that took longest in
/// each (`queued`: between reaching the source and being taken by the agent's
/// loop, which includes reading the file; `derive`, `ranges`, `write`, `record`).
fn slow_changes(log: &[String]) -> std::collections::BTreeMap<String, usize> {
    let mut by_stage = std::collections::BTreeMap::new();
    for line in log.iter().filter(|l| l.contains("slow change")) {
        let stage = [
            "queued_us",
            "derive_us",
            "ranges_us",
            "write_us",
            "record_us",
        ]
        .iter()
        .filter_map(|field| {
            let at = line.find(&format!("{field}="))? + field.len() + 1;
            let digits: String = line[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            Some((digits.parse::<u64>().ok()?, field.trim_end_matches("_us")))
        })
        .max();
        if let Some((_, stage)) = stage {
            *by_stage.entry(stage.to_owned()).or_default() += 1;
        }
    }
    by_stage
}

/// With LB_BENCH_SHOW_CHANGES set, prints the agent's log lines about its syncs
/// (run the bench with LB_LOG=lb_userspace=debug for each change's timings).
fn show_changes(agent: &Agent) {
    if std::env::var_os("LB_BENCH_SHOW_CHANGES").is_none() {
        return;
    }
    for line in agent
        .log()
        .iter()
        .filter(|l| l.contains("lb_userspace::agent") || l.contains("manifests read"))
    {
        println!("    agent: {}", line.trim());
    }
}

fn tail(lines: &[String], n: usize) -> String {
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn r_last(v: &[f64]) -> f64 {
    v.last().copied().unwrap_or_default()
}

/// The pid of the agent pinning under `pin_dir` (its command line names the dir).
pub(crate) fn pid_of_agent(pin_dir: &Path) -> Option<u64> {
    let needle = pin_dir.to_string_lossy().into_owned();
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u64>().ok()) else {
            continue;
        };
        let Ok(cmd) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(" agent ") && cmd.contains(&needle) {
            return Some(pid);
        }
    }
    None
}

fn vm_hwm_kib(pid: u64) -> Option<u64> {
    proc_status_kib(pid, "VmHWM:")
}

/// A `/proc/PID/status` memory field (`VmHWM:`, `VmRSS:`), in KiB.
pub fn proc_status_kib(pid: u64, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// `lb-bench serve --name NAME` in `pod`'s namespace, pinned to the bench's CPU,
/// once it listens.
pub fn serve_in(
    exe: &Path,
    pod: &lb_tests::topology::Pod,
    name: &str,
    cpu: usize,
) -> Result<Child> {
    let server = Spawner::new(exe)
        .label(format!("lb-bench serve {}", pod.name()))
        .netns(pod.netns())?
        .args(["serve", "--name", name, "--cpu", &cpu.to_string()])
        .spawn()?;
    server
        .stdout
        .wait_for(Duration::from_secs(10), |l| l.contains("listening"))?;
    Ok(server)
}

/// Kernel, CPU model, cores.
pub fn machine() -> serde_json::Value {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let ipt = Command::new("iptables")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let nft = Command::new("nft")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    serde_json::json!({ "kernel": kernel, "cpu": cpu, "cores": cores, "iptables": ipt, "nft": nft, "loadavg_start": loadavg() })
}

/// /proc/loadavg: other work on the machine shows up as noise.
fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// A row's result; its error, if any, recorded in `errors` and shown.
fn recorded<T>(errors: &mut Vec<String>, row: &str, result: Result<T>) -> Option<T> {
    result
        .map_err(|e| {
            errors.push(format!("{row}: {e:#}"));
            eprintln!("{row} failed: {e:#}");
        })
        .ok()
}

/// The whole run. Errors of one datapath are recorded and the run goes on.
pub fn run(exe: PathBuf, lb: PathBuf, cfg: Config) -> Result<Results> {
    let start = Instant::now();
    let env = Env::new(exe.clone(), lb.clone(), cfg.clone())?;
    let mut res = Results {
        config: cfg.clone(),
        machine: machine(),
        direct_start: None,
        direct_end: None,
        datapaths: vec![],
        control: vec![],
        skipped: vec![],
        errors: vec![],
        wall_secs: 0.0,
        pps: vec![],
        dsr: None,
        xdp_bulk: None,
        masq: None,
        quarantine: None,
        policy: None,
        policy_rate: None,
    };
    println!("direct (start)");
    res.direct_start = Some(env.direct()?);
    let mut all_scales: Vec<(usize, bool)> = cfg.scales.iter().map(|s| (*s, true)).collect();
    all_scales.extend(cfg.ours_extra_scales.iter().map(|s| (*s, false)));
    for (s, peers) in all_scales {
        println!("S = {s}");
        if peers {
            if s <= cfg.iptables_max && cfg.wants("iptables") {
                if let Err(e) = env.iptables(s, &mut res) {
                    res.errors.push(format!("iptables S={s}: {e:#}"));
                    eprintln!("iptables S={s} failed: {e:#}");
                }
            }
            if !cfg.wants("nftables") {
            } else if s <= cfg.nft_max {
                if let Err(e) = env.nft(s, &mut res) {
                    res.errors.push(format!("nftables S={s}: {e:#}"));
                    eprintln!("nftables S={s} failed: {e:#}");
                }
            } else {
                res.skipped.push(Skipped {
                    datapath: "nftables".into(),
                    services: s,
                    reason: "nft -f of 10k Services x 4 endpoints took ~105 s (~0.7 GB) here (docs/benchmarks/NOTES.md); with 10 endpoints it does not fit the bench's time budget".into(),
                });
            }
        }
        let file_rows = ["socket-lb", "socket-lb6", "tc-nodeport", "tc-nodeport6"];
        let ours = if file_rows.iter().any(|d| cfg.wants(d)) {
            env.ours(s, &mut res, peers)
        } else {
            Ok(())
        };
        if let Err(e) = ours {
            let msg = format!("{e:#}");
            let first = msg.lines().next().unwrap_or_default().to_string();
            if msg.contains("cannot hold") {
                println!("  ours       S={s:<6} skipped: {first}");
                res.skipped.push(Skipped {
                    datapath: "socket-lb, tc-nodeport".into(),
                    services: s,
                    reason: first,
                });
                continue;
            }
            res.errors.push(format!(
                "ours S={s}: {}",
                msg.chars().take(3000).collect::<String>()
            ));
            eprintln!("ours S={s} failed: {first}");
        }
        if cfg.wants("socket-lb-api") {
            if let Err(e) = env.ours_api(s, &mut res) {
                res.errors.push(format!("socket-lb-api S={s}: {e:#}"));
                eprintln!("socket-lb-api S={s} failed: {e:#}");
            }
        }
        lb_tests::interrupt::check()?;
    }
    // The rows built on the TC path that hold no S Services: once each, after the
    // scales; a failed one is recorded and the run goes on.
    if cfg.tc_path && cfg.wants("pps") {
        println!("packet rate");
        res.pps =
            recorded(&mut res.errors, "pps", crate::pps::run(&env.lb, &cfg)).unwrap_or_default();
    }
    if cfg.tc_path && cfg.wants("dsr") {
        println!("DSR against SNAT (backend on another node)");
        res.dsr = recorded(&mut res.errors, "dsr", crate::dsr::run(&exe, &lb, &cfg));
    }
    if cfg.tc_path && cfg.wants("xdp-bulk") {
        println!("bulk TCP through XDP against TC (backend on another node)");
        let row = crate::xdp_bulk::run(&exe, &lb, &cfg);
        res.xdp_bulk = recorded(&mut res.errors, "xdp-bulk", row);
    }
    if cfg.tc_path && cfg.wants("masquerade") {
        println!("egress masquerading: lb against iptables MASQUERADE (pod to outside)");
        let row = crate::masq::run(&exe, &lb, &cfg);
        res.masq = recorded(&mut res.errors, "masquerade", row);
    }
    if cfg.wants("quarantine") {
        println!("a dead backend: lb's quarantine against iptables mode");
        let row = crate::quarantine::run(&exe, &lb, &cfg);
        res.quarantine = recorded(&mut res.errors, "quarantine", row);
    }
    if cfg.wants("policy") {
        println!("NetworkPolicy: change -> enforced at 10k pods and 1k policies");
        let row = crate::policy::run(&lb, &cfg);
        res.policy = recorded(&mut res.errors, "policy", row);
    }
    if cfg.wants("policy-rate") {
        println!("NetworkPolicy: pods 1k policies select against open ones");
        let row = crate::policy_rate::run(&exe, &lb, &cfg);
        res.policy_rate = recorded(&mut res.errors, "policy-rate", row);
    }
    println!("direct (end)");
    res.direct_end = Some(env.direct()?);
    res.machine["loadavg_end"] = serde_json::Value::String(loadavg());
    drop(env);
    res.wall_secs = start.elapsed().as_secs_f64();
    Ok(res)
}
