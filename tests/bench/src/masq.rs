//! The `masquerade` row: a pod's connections to a host outside the cluster,
//! masqueraded by lb (`--masquerade bpf`) against the same traffic masqueraded by
//! iptables `MASQUERADE` with nf_conntrack (what a CNI or ip-masq-agent installs),
//! in the same run, one client interleaving its connections between the two
//! (issue 25: connection rate >= 1.2x, bulk >= 0.98x, CPU per connection stated).
//!
//! ```text
//!              ┌ eth0 10.244.1.20 ─ vpod, br0 10.244.1.1  node1: lb agent --masquerade bpf      uplink 11.0.1.1 ─ eth0 11.0.1.2 ┐
//!  client ns ──┤                                                                                                            outside ns
//!  (the pod)   └ eth1 10.244.2.20 ─ vpod, br0 10.244.2.1  node2: lb agent + iptables MASQUERADE  uplink 11.0.2.1 ─ eth1 11.0.2.2 ┘ (lb-bench serve)
//! ```
//!
//! A paired run needs one client process for both sides, and a pod has one node:
//! so the client's namespace (the pod) has a leg into each node's bridge, and
//! reaches the outside host's first address through node1 and its second through
//! node2. The two nodes are alike but for who masquerades: both run the same lb
//! agent (the Service path stays on both, as on a node where lb replaces
//! kube-proxy), node1 with `--masquerade bpf`, node2 with masquerading off and
//! the CNI's rule instead (`-s 10.244.0.0/16 ! -d 10.244.0.0/16 -j MASQUERADE`
//! in its POSTROUTING). nf_conntrack then tracks every packet through node2 and
//! none through node1, as on two real nodes; only node2's namespace has a rule
//! (never the host's). The outside host routes only to the two uplinks, so an
//! untranslated packet gets no answer: every completed connection was
//! masqueraded, and the counters say by whom.
//!
//! Per repetition:
//! - one `paired-cpu` client run (blocks of `cfg.cpu_block` connections,
//!   alternately through each node; see `crate::cpu`): the CPU per connection of
//!   the whole path (client, node, server and ksoftirqd on the one CPU they are
//!   pinned to) and the connection rate, connections per second of wall time of
//!   the same blocks;
//! - one `paired-bulk` client run to the server's verified bulk port.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::ManifestDir;
use lb_tests::netns::NetNs;
use lb_tests::process::{Child, Spawner};
use lb_tests::util::{run as run_cmd, unique_name};
use serde::{Deserialize, Serialize};

use crate::cpu::CpuCost;
use crate::netio::{ClientReport, BULK_VERIFY_PORT, RR_PORT};
use crate::run::{paired_cpu_args, Config, Samples, Stat};

/// The node masquerading with lb, and the one masquerading with iptables.
const LB: usize = 0;
const IPTABLES: usize = 1;
const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// One path from the client to the outside host, through one node.
struct Leg {
    /// The node's pod bridge: the client's gateway on this leg.
    bridge: Ipv4Addr,
    /// The client's address on this leg.
    pod: Ipv4Addr,
    /// The node's uplink, and the outside host's address on that link.
    node_up: Ipv4Addr,
    outside: Ipv4Addr,
}

const LEGS: [Leg; 2] = [
    Leg {
        bridge: Ipv4Addr::new(10, 244, 1, 1),
        pod: Ipv4Addr::new(10, 244, 1, 20),
        node_up: Ipv4Addr::new(11, 0, 1, 1),
        outside: Ipv4Addr::new(11, 0, 1, 2),
    },
    Leg {
        bridge: Ipv4Addr::new(10, 244, 2, 1),
        pod: Ipv4Addr::new(10, 244, 2, 20),
        node_up: Ipv4Addr::new(11, 0, 2, 1),
        outside: Ipv4Addr::new(11, 0, 2, 2),
    },
];

/// The `masquerade` row, as stored in results.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MasqResult {
    /// Per repetition: connections per second (connect, request, response,
    /// close, one at a time) through each node, over the paired CPU blocks.
    pub lb_conn_per_sec: Option<Stat>,
    pub iptables_conn_per_sec: Option<Stat>,
    /// Per repetition: lb / iptables.
    pub rate_ratio: Option<Stat>,
    /// Per repetition: MB/s (10^6 bytes) of the bulk windows through each node.
    pub lb_mb_per_sec: Option<Stat>,
    pub iptables_mb_per_sec: Option<Stat>,
    /// Per repetition: the median over rounds of lb MB/s / iptables MB/s.
    pub bulk_ratio: Option<Stat>,
    /// CPU per connection of the whole path, lb as the target, iptables as the
    /// baseline.
    pub cpu: Option<CpuCost>,
    /// Failed connections over the row.
    pub errors: u64,
}

/// The namespaces, agents and server; field order is teardown order.
struct MasqBed {
    server: Child,
    agents: Vec<Agent>,
    client: NetNs,
    _outside: NetNs,
    nodes: Vec<NetNs>,
    _cgroups: Vec<Cgroup>,
    _manifests: ManifestDir,
    exe: PathBuf,
    cpu: usize,
}

impl MasqBed {
    fn build(exe: &Path, lb: &Path, cfg: &Config) -> Result<MasqBed> {
        let base = unique_name("lbm");
        let client = NetNs::create(&format!("{base}-pod"))?;
        let outside = NetNs::create(&format!("{base}-out"))?;
        let mut nodes = Vec::new();
        for (i, leg) in LEGS.iter().enumerate() {
            let node = NetNs::create(&format!("{base}-node{}", i + 1))?;
            nodes.push(node);
            let node = &nodes[i];
            node.sysctls(&[
                ("net/ipv4/ip_forward", "1"),
                ("net/ipv4/conf/all/rp_filter", "0"),
                ("net/ipv4/conf/default/rp_filter", "0"),
            ])?;
            node.ip(&["link", "add", "br0", "type", "bridge"])?;
            node.ip(&["addr", "add", &format!("{}/24", leg.bridge), "dev", "br0"])?;
            node.ip(&["link", "set", "br0", "up"])?;
            let pod_if = format!("eth{i}");
            node.veth_to("vpod", &client, &pod_if)?;
            node.ip(&["link", "set", "vpod", "master", "br0", "up"])?;
            client.ip(&["addr", "add", &format!("{}/24", leg.pod), "dev", &pod_if])?;
            client.ip(&["link", "set", &pod_if, "up"])?;
            client.ip(&[
                "route",
                "add",
                &format!("{}/32", leg.outside),
                "via",
                &leg.bridge.to_string(),
            ])?;
            let out_if = format!("eth{i}");
            // Not "up": ip takes that for its keyword.
            node.veth_to("uplink", &outside, &out_if)?;
            node.ip(&[
                "addr",
                "add",
                &format!("{}/24", leg.node_up),
                "dev",
                "uplink",
            ])?;
            node.ip(&["link", "set", "uplink", "up"])?;
            outside.ip(&[
                "addr",
                "add",
                &format!("{}/24", leg.outside),
                "dev",
                &out_if,
            ])?;
            outside.ip(&["link", "set", &out_if, "up"])?;
        }
        // The CNI's rule, on node2 only.
        iptables(
            &nodes[IPTABLES],
            &[
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                CLUSTER_CIDR,
                "!",
                "-d",
                CLUSTER_CIDR,
                "-j",
                "MASQUERADE",
            ],
        )?;
        let manifests = ManifestDir::create()?;
        let mut cgroups = Vec::new();
        let mut agents = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let name = format!("masq-node{}", i + 1);
            cgroups.push(Cgroup::create(&unique_name(&format!("lb-bench-{name}")))?);
            let mut args = vec!["--cluster-cidr", CLUSTER_CIDR];
            if i == LB {
                args.extend(["--masquerade", "bpf"]);
            }
            let spec = AgentSpec::new(manifests.path(), &cgroups[i], &name)
                .netns(node)
                .args(args);
            agents.push(Agent::start_with(lb, &spec)?);
        }
        for agent in &mut agents {
            agent.wait_ready(READY_TIMEOUT)?;
            // Ready: their logs are not part of the bench's output.
            agent.set_log_on_drop(false);
        }
        let server = Spawner::new(exe)
            .label(format!("lb-bench serve in {}", outside.name()))
            .netns(&outside)?
            .args(["serve", "--name", "outside", "--cpu", &cfg.cpu.to_string()])
            .spawn()?;
        server
            .stdout
            .wait_for(Duration::from_secs(10), |l| l.contains("listening"))?;
        Ok(MasqBed {
            server,
            agents,
            client,
            _outside: outside,
            nodes,
            _cgroups: cgroups,
            _manifests: manifests,
            exe: exe.to_path_buf(),
            cpu: cfg.cpu,
        })
    }

    /// The outside host's request/response port through node `node`.
    fn rr(node: usize) -> SocketAddr {
        SocketAddrV4::new(LEGS[node].outside, RR_PORT).into()
    }

    /// The outside host's verified bulk port through node `node`.
    fn bulk(node: usize) -> SocketAddr {
        SocketAddrV4::new(LEGS[node].outside, BULK_VERIFY_PORT).into()
    }

    /// `lb-bench client --to TO ARGS...` in the client's namespace, pinned to
    /// the bench's CPU (as the server is).
    fn client(&self, to: SocketAddr, args: &[String]) -> Result<ClientReport> {
        crate::run::run_client(&self.exe, self.cpu, &self.client, None, to, args)
    }

    /// Both agents' `lb stats`.
    fn stats(&self) -> Result<Vec<BTreeMap<String, u64>>> {
        self.agents.iter().map(|a| a.stats()).collect()
    }

    /// Packets the MASQUERADE rule of node2 matched: one per new connection.
    fn rule_packets(&self) -> Result<u64> {
        let text = iptables(
            &self.nodes[IPTABLES],
            &["-t", "nat", "-L", "POSTROUTING", "-v", "-x", "-n"],
        )?;
        text.lines()
            .find(|l| l.contains("MASQUERADE"))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no MASQUERADE rule counter in:\n{text}"))
    }

    fn all_stats(&self) -> String {
        match self.stats() {
            Ok(stats) => stats
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let nonzero: Vec<String> = s
                        .iter()
                        .filter(|(_, v)| **v != 0)
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    format!("node{}: {}", i + 1, nonzero.join(" "))
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Err(e) => format!("(lb stats failed: {e:#})"),
        }
    }
}

/// `iptables ARGS` in `ns` (iptables needs neither bpffs nor cgroups, so `ip
/// netns exec`'s private mounts do not matter).
fn iptables(ns: &NetNs, args: &[&str]) -> Result<String> {
    run_cmd(
        Command::new("ip")
            .args(["netns", "exec", ns.name(), "iptables"])
            .args(args),
    )
}

pub fn run(exe: &Path, lb: &Path, cfg: &Config) -> Result<MasqResult> {
    let bed = MasqBed::build(exe, lb, cfg)?;
    let agent_pid = crate::run::pid_of_agent(bed.agents[LB].pin_dir());
    let before = bed.stats()?;
    let rule_before = bed.rule_packets()?;
    let (mut rate, mut bulk) = (Samples::default(), Samples::default());
    let mut bulk_ratios = Vec::new();
    let (mut cpu_runs, mut errors) = (Vec::new(), 0);
    let mut connections = [0u64; 2];
    for rep in 0..cfg.reps {
        lb_tests::interrupt::check()?;
        let r = bed
            .client(
                MasqBed::rr(LB),
                &paired_cpu_args(cfg, MasqBed::rr(IPTABLES), &[bed.server.pid()], agent_pid),
            )
            .with_context(|| bed.all_stats())?;
        errors += r.errors;
        let cpu = r
            .cpu
            .context("the paired-cpu run reported no CPU figures")?;
        let per_sec = |s: &crate::netio::CpuSide| s.connections as f64 * 1e9 / s.wall_ns as f64;
        rate.push(per_sec(&cpu.target), per_sec(&cpu.baseline));
        connections[LB] += cpu.target.connections;
        connections[IPTABLES] += cpu.baseline.connections;
        let now = CpuCost::of(std::slice::from_ref(&cpu));
        cpu_runs.push(cpu);
        let b = bed
            .client(
                MasqBed::bulk(LB),
                &[
                    "--mode".into(),
                    "paired-bulk".into(),
                    "--secs".into(),
                    (2.0 * cfg.bulk_secs).to_string(),
                    "--baseline".into(),
                    MasqBed::bulk(IPTABLES).to_string(),
                ],
            )
            .with_context(|| bed.all_stats())?;
        let (l, i, ratio) = match (b.mb_per_sec, b.baseline_mb_per_sec, b.bulk_ratio) {
            (Some(l), Some(i), Some(ratio)) => (l, i, ratio),
            _ => anyhow::bail!("the paired bulk run reported no figures: {b:?}"),
        };
        bulk.push(l, i);
        bulk_ratios.push(ratio);
        println!(
            "  masquerade rep {rep}: {:.0} vs {:.0} conn/s ({:.3}x), bulk {l:.0} vs {i:.0} MB/s ({ratio:.3}x){}",
            rate.target.last().copied().unwrap_or_default(),
            rate.baseline.last().copied().unwrap_or_default(),
            rate.ratios.last().copied().unwrap_or_default(),
            now.map(|c| format!(
                ", CPU {:.1} vs {:.1} us/conn ({:.3}x, ticks {:.3}x)",
                c.kernel_us, c.baseline_kernel_us, c.ratio, c.ticks_ratio
            ))
            .unwrap_or_default()
        );
    }
    let after = bed.stats()?;
    let grown: Vec<_> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| crate::pps::counter_deltas(b, a))
        .collect();
    let rule = bed.rule_packets()? - rule_before;
    ensure_path(&grown, rule, connections).with_context(|| bed.all_stats())?;
    Ok(MasqResult {
        lb_conn_per_sec: Stat::of(rate.target),
        iptables_conn_per_sec: Stat::of(rate.baseline),
        rate_ratio: Stat::of(rate.ratios),
        lb_mb_per_sec: Stat::of(bulk.target),
        iptables_mb_per_sec: Stat::of(bulk.baseline),
        bulk_ratio: Stat::of(bulk_ratios),
        cpu: CpuCost::of(&cpu_runs),
        errors,
    })
}

/// Each node masqueraded its side's connections, and only its own: lb on node1
/// (`masq_new_flow` at least one per connection, none dropped for want of a
/// port or an entry), iptables on node2 (its rule matched at least one packet
/// per connection, and lb there masqueraded nothing).
fn ensure_path(grown: &[BTreeMap<String, u64>], rule: u64, connections: [u64; 2]) -> Result<()> {
    let get = |node: usize, name: &str| grown[node].get(name).copied().unwrap_or(0);
    ensure!(
        get(LB, "masq_new_flow") >= connections[LB],
        "node1 (lb) masqueraded {} new flows for {} connections (counters grown: {:?})",
        get(LB, "masq_new_flow"),
        connections[LB],
        grown[LB]
    );
    for name in ["masq_port_exhausted", "masq_map_full", "masq_no_source"] {
        ensure!(
            get(LB, name) == 0,
            "node1 (lb): {name} grew (counters grown: {:?})",
            grown[LB]
        );
    }
    let masq_on_iptables: BTreeMap<&String, &u64> = grown[IPTABLES]
        .iter()
        .filter(|(k, _)| k.starts_with("masq_"))
        .collect();
    ensure!(
        masq_on_iptables.is_empty(),
        "node2 (iptables) has masquerading off, yet lb's masq_* counters grew: {masq_on_iptables:?}"
    );
    ensure!(
        rule >= connections[IPTABLES],
        "node2's MASQUERADE rule matched {rule} packets for {} connections",
        connections[IPTABLES]
    );
    Ok(())
}
