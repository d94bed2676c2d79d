//! The `quarantine` row (issue 26): one of three backends is dead (its server
//! killed, so its port refuses: a RST to every SYN) while one client opens
//! connections at a steady pace to the Service, through lb (the socket hooks,
//! and a NodePort through the per-packet path) and through kube-proxy's
//! iptables-mode rules (no lb). What is measured is the share of those
//! connections that failed: lb quarantines the backend at its first refusal
//! (1 s, doubling while it keeps refusing), so at most one connection per
//! quarantine period fails; iptables mode picks it a third of the time until
//! the endpoint is removed, which takes a readiness probe and a sync that do not
//! happen here.
//!
//! ```text
//!   node ns: br0 10.244.1.1/24 ── pod-a .11, pod-b .12, pod-c .13 (lb-bench serve; pod-c's killed)
//!                              ├─ client   .20  socket hooks (in the agent's cgroup)
//!                              └─ client-2 .21  iptables mode (kube-proxy's rules in its nat OUTPUT)
//!            ext0 192.168.77.1/24 ── ext ns eth0 192.168.77.100 (NodePort client, per-packet path)
//! ```
//!
//! Per repetition: the iptables client's run (no agent running), then a fresh
//! agent (no quarantine carried over from the last repetition) and the socket
//! hooks' run, then the NodePort's. Every run is [`CONNECTIONS`] connections,
//! one every [`INTERVAL`] (connect, request, response, close), by one client.
//! Checked: every failure was a refusal (none timed out), the iptables client
//! met the dead backend, and lb's counters show the quarantine and its skips.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{find_frontend, Agent, AgentSpec, READY_TIMEOUT, SYNC_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{
    documents, Endpoint, EndpointSlice, ManifestDir, Service, ServicePort, NODE_NAME,
};
use lb_tests::netns::NetNs;
use lb_tests::process::Child;
use lb_tests::topology::{pod_ip, pod_name, Topology, SERVICE_CIDR};
use lb_tests::util::unique_name;
use serde::{Deserialize, Serialize};

use crate::kubeproxy::{self, ProxyConfig, SvcPort};
use crate::netio::{ClientReport, RR_PORT};
use crate::run::{ns_exec, Config, Samples, Stat};

/// Connections per run, one every [`INTERVAL`]: 20 s.
const CONNECTIONS: u64 = 2000;
const INTERVAL: Duration = Duration::from_millis(10);
/// Of pod-a, pod-b and pod-c, the one whose server is killed.
const DEAD: usize = 2;
const BACKENDS: usize = 3;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const SVC_PORT: u16 = 80;
const NODE_PORT: u16 = 30090;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 100);

/// One client's runs through one path: how many of its connections failed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PathRuns {
    /// Per repetition: failed connections of [`QuarantineResult::connections`].
    pub failed: Vec<u64>,
    /// Per repetition: the share of connections that failed (0 to 1).
    pub share: Option<Stat>,
    /// Per repetition: when each failed connection began, seconds into the run.
    pub failed_at_s: Vec<Vec<f64>>,
}

/// The `quarantine` row, as stored in results.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QuarantineResult {
    /// Connections each run opened, one every `interval_ms`.
    pub connections: u64,
    pub interval_ms: f64,
    pub backends: usize,
    /// The refusals lb's backoff lets through in a run's length: one per
    /// quarantine period (1 s, 2 s, 4 s, ... from the first refusal), the target.
    pub allowed_failures: u64,
    pub socket: PathRuns,
    /// Empty without the per-packet path (`--no-tc`).
    pub nodeport: PathRuns,
    pub iptables: PathRuns,
    /// Per repetition: lb's share / iptables' share.
    pub socket_ratio: Option<Stat>,
    pub nodeport_ratio: Option<Stat>,
}

/// The namespaces, servers and rules; field order is teardown order.
struct QuarBed {
    servers: Vec<Child>,
    ext: NetNs,
    topo: Topology,
    cgroup: Cgroup,
    manifests: ManifestDir,
    exe: PathBuf,
    lb: PathBuf,
    cpu: usize,
}

impl QuarBed {
    fn build(exe: &Path, lb: &Path, cfg: &Config) -> Result<QuarBed> {
        let topo = Topology::build(BACKENDS, 2)?;
        let ext = NetNs::create(&format!("{}-ext", topo.base()))?;
        let node = topo.node();
        node.sysctls(&[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
        ])?;
        node.veth_to("ext0", &ext, "eth0")?;
        node.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "ext0"])?;
        node.ip(&["link", "set", "ext0", "up"])?;
        ext.ip(&["addr", "add", &format!("{EXT_IP}/24"), "dev", "eth0"])?;
        ext.ip(&["link", "set", "eth0", "up"])?;
        node.sysctls(&[("net/ipv4/conf/*/rp_filter", "0")])?;
        // kube-proxy's rules DNAT in the iptables client's nat OUTPUT, after its
        // route lookup: the VIP needs a route there (the topology's clients have
        // none, so that an untranslated connect fails at once).
        topo.clients()[1]
            .netns()
            .ip(&["route", "del", "unreachable", SERVICE_CIDR])?;
        let mut bed = QuarBed {
            servers: Vec::new(),
            ext,
            cgroup: Cgroup::create(&unique_name("lb-bench-quar"))?,
            manifests: ManifestDir::create()?,
            topo,
            exe: exe.to_path_buf(),
            lb: lb.to_path_buf(),
            cpu: cfg.cpu,
        };
        for i in 0..BACKENDS {
            let server = crate::run::serve_in(exe, &bed.topo.pods()[i], &pod_name(i), cfg.cpu)?;
            bed.servers.push(server);
        }
        // The dead backend: its process gone, its ports closed.
        bed.servers[DEAD].kill();
        let service = Service::new(
            "quar",
            VIP,
            vec![ServicePort::tcp("rr", SVC_PORT.into(), RR_PORT.into())
                .with_node_port(NODE_PORT.into())],
        )
        .node_port();
        let endpoints = (0..BACKENDS)
            .map(|i| Endpoint::ready(&pod_name(i), pod_ip(i)))
            .collect();
        let slice = EndpointSlice::for_service(&service, endpoints);
        bed.manifests.write(
            "quar.yaml",
            &documents([service.to_yaml(), slice.to_yaml()]),
        )?;
        let rules = kubeproxy::iptables_full(&[svc_port()], &ProxyConfig::default());
        let file = std::env::temp_dir().join(unique_name("lb-bench-quar-iptables"));
        std::fs::write(&file, rules)?;
        let loaded = ns_exec(bed.iptables_ns(), "iptables-restore", &[], Some(&file));
        let _ = std::fs::remove_file(&file);
        loaded?;
        Ok(bed)
    }

    fn iptables_ns(&self) -> &NetNs {
        self.topo.clients()[1].netns()
    }

    /// An agent on the node (socket hooks on the bed's cgroup, the per-packet
    /// programs on the node's devices), once it serves the Service on both.
    fn agent(&self) -> Result<Agent> {
        let spec = AgentSpec::new(self.manifests.path(), &self.cgroup, NODE_NAME)
            .netns(self.topo.node())
            .args(["--backend-quarantine", "on"]);
        let mut agent = Agent::start_with(&self.lb, &spec)?;
        agent.wait_ready(READY_TIMEOUT)?;
        agent.set_log_on_drop(false);
        let backends = BACKENDS;
        agent.wait_services(
            &format!("{VIP}:{SVC_PORT} and :{NODE_PORT} with {backends} backends"),
            SYNC_TIMEOUT,
            |entries| {
                let cluster_ip = find_frontend(entries, VIP, SVC_PORT, "TCP");
                let node_port = entries
                    .iter()
                    .find(|e| e.is(IpAddr::from(NODE_IP), NODE_PORT, "TCP"));
                [cluster_ip, node_port]
                    .iter()
                    .all(|e| e.is_some_and(|e| e.backends.len() == backends))
            },
        )?;
        Ok(agent)
    }

    /// One paced run from `ns` (in the hooked cgroup with `hooked`) to `to`.
    fn paced(&self, ns: &NetNs, hooked: bool, to: SocketAddr) -> Result<ClientReport> {
        let cgroup = hooked.then_some(&self.cgroup);
        let secs = INTERVAL.as_secs_f64() * CONNECTIONS as f64;
        crate::run::run_client(
            &self.exe,
            self.cpu,
            ns,
            cgroup,
            to,
            &[
                "--mode".into(),
                "paced".into(),
                "--count".into(),
                CONNECTIONS.to_string(),
                "--secs".into(),
                secs.to_string(),
            ],
        )
    }
}

/// The Service as kube-proxy's rule generator sees it.
fn svc_port() -> SvcPort {
    SvcPort {
        namespace: lb_tests::manifests::NAMESPACE.into(),
        name: "quar".into(),
        port_name: "rr".into(),
        cluster_ip: VIP,
        port: SVC_PORT,
        target_port: RR_PORT,
        node_port: Some(NODE_PORT),
        endpoints: (0..BACKENDS).map(pod_ip).collect(),
    }
}

/// How many refusals lb's backoff lets through in `run`: the first, then one
/// as each quarantine ends (1 s, then twice as long each time).
fn allowed_failures(run: Duration) -> u64 {
    let end = run.as_nanos() as u64;
    let (mut at, mut level, mut n) = (0u64, 1u32, 0u64);
    while at < end {
        n += 1;
        at += lb_common::quarantine::backoff_ns(level);
        level += 1;
    }
    n
}

/// Every failure of a run was a refusal, and nothing else went wrong.
fn ensure_refusals(what: &str, r: &ClientReport) -> Result<()> {
    ensure!(
        r.count + r.errors == CONNECTIONS,
        "{what}: {} answered and {} failed of {CONNECTIONS}",
        r.count,
        r.errors
    );
    ensure!(
        r.refused == r.errors,
        "{what}: {} of {} failures were not refusals (timeouts?): the dead backend \
         must refuse at once",
        r.errors - r.refused,
        r.errors
    );
    let dead = pod_name(DEAD);
    ensure!(
        !r.backends.contains(&dead),
        "{what}: {dead}, whose server was killed, answered"
    );
    Ok(())
}

fn record(runs: &mut PathRuns, r: &ClientReport) {
    runs.failed.push(r.errors);
    runs.failed_at_s
        .push(r.failed_at_ms.iter().map(|ms| ms / 1000.0).collect());
}

fn share(r: &ClientReport) -> f64 {
    r.errors as f64 / CONNECTIONS as f64
}

pub fn run(exe: &Path, lb: &Path, cfg: &Config) -> Result<QuarantineResult> {
    let bed = QuarBed::build(exe, lb, cfg)?;
    let vip = SocketAddr::new(VIP.into(), SVC_PORT);
    let node_port = SocketAddr::new(NODE_IP.into(), NODE_PORT);
    let mut result = QuarantineResult {
        connections: CONNECTIONS,
        interval_ms: INTERVAL.as_secs_f64() * 1000.0,
        backends: BACKENDS,
        allowed_failures: allowed_failures(INTERVAL * CONNECTIONS as u32),
        socket: PathRuns::default(),
        nodeport: PathRuns::default(),
        iptables: PathRuns::default(),
        socket_ratio: None,
        nodeport_ratio: None,
    };
    let (mut socket, mut nodeport) = (Samples::default(), Samples::default());
    for rep in 0..cfg.reps {
        lb_tests::interrupt::check()?;
        let ipt = bed.paced(bed.iptables_ns(), false, vip)?;
        ensure_refusals("iptables", &ipt)?;
        ensure!(
            ipt.errors > 0,
            "iptables: no connection of {CONNECTIONS} met the dead backend"
        );
        record(&mut result.iptables, &ipt);
        let agent = bed.agent()?;
        let before = agent.stats()?;
        let s = bed.paced(bed.topo.client().netns(), true, vip)?;
        ensure_refusals("socket hooks", &s).with_context(|| show(&agent))?;
        record(&mut result.socket, &s);
        socket.push(share(&s), share(&ipt));
        let mut line = format!(
            "  quarantine rep {rep}: failed of {CONNECTIONS}: socket hooks {}, ",
            s.errors
        );
        if cfg.tc_path {
            let n = bed.paced(&bed.ext, false, node_port)?;
            ensure_refusals("NodePort", &n).with_context(|| show(&agent))?;
            record(&mut result.nodeport, &n);
            nodeport.push(share(&n), share(&ipt));
            line += &format!("NodePort {}, ", n.errors);
        }
        let grown = crate::pps::counter_deltas(&before, &agent.stats()?);
        ensure_counted(&grown, cfg.tc_path).with_context(|| show(&agent))?;
        println!(
            "{line}iptables {} (lb allows {})",
            ipt.errors, result.allowed_failures
        );
    }
    result.socket.share = Stat::of(socket.target);
    result.socket_ratio = Stat::of(socket.ratios);
    result.iptables.share = Stat::of(socket.baseline);
    result.nodeport.share = Stat::of(nodeport.target);
    result.nodeport_ratio = Stat::of(nodeport.ratios);
    Ok(result)
}

/// lb quarantined the dead backend and skipped it: on each path it served, at
/// least one quarantine and one skip.
fn ensure_counted(grown: &BTreeMap<String, u64>, both_paths: bool) -> Result<()> {
    let get = |name: &str| grown.get(name).copied().unwrap_or(0);
    let paths = if both_paths { 2 } else { 1 };
    ensure!(
        get("quarantined") >= paths && get("quarantine_skip") >= paths,
        "lb's counters do not show the dead backend quarantined and skipped on \
         {paths} path(s): counters grown {grown:?}"
    );
    Ok(())
}

/// The agent's view, for an error.
fn show(agent: &Agent) -> String {
    let svcs = agent.lb_command(&["services"]).unwrap_or_default();
    let stats = agent.lb_command(&["stats"]).unwrap_or_default();
    format!("lb services:\n{svcs}\nlb stats:\n{stats}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_allows_one_refusal_per_quarantine_period() {
        // Refusals at 0, 1, 3, 7 and 15 s.
        assert_eq!(allowed_failures(Duration::from_secs(20)), 5);
        assert_eq!(allowed_failures(Duration::from_millis(500)), 1);
        assert_eq!(allowed_failures(Duration::from_secs(2)), 2);
    }
}
