//! The `policy-rate` row (issue 27): connection rate and bulk throughput between
//! a client pod and a server pod that 1k NetworkPolicies select (the client for
//! egress, the server for ingress; the connection is admitted by one rule of
//! each side), paired in the same run against a client and server pod that no
//! policy selects, on the same node, through the same agent
//! (`--network-policy on`). Target: >= 0.97x.
//!
//! ```text
//!  node ns: br0 10.244.1.1/24 ── pod-a .11 (server, selected: role=server)
//!                             ├─ pod-b .12 (server, open)
//!                             ├─ client eth0 .20 (selected: role=client) ─┐ one namespace,
//!                             └─ client eth1 .21 (open)                  ─┘ one client process
//! ```
//!
//! A paired run needs one client process for both sides: the client's namespace
//! has a leg (and an address, each a Pod of its own to the agent) for each, and
//! routes pod-a through the selected leg and pod-b through the open one. Both
//! sides cross the same programs (the policy programs run for every local pod's
//! veth once policy is on); the measured side's new flows are judged against the
//! 1k policies' entries, the baseline's find their pods selected by none.
//!
//! Per repetition: one `paired-cpu` client run (connection rate and the whole
//! path's CPU per connection) and one `paired-bulk` run, as the masquerade row.
//! Checked: nothing was dropped by policy, and policy judged the measured side's
//! new flows (`policy_allowed` grew; the open pods' flows are never judged).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{
    namespace_yaml, network_policy_yaml, ContainerPort, ManifestDir, PodManifest, NODE_NAME,
};
use lb_tests::process::Child;
use lb_tests::topology::{client_ip, pod_ip, pod_name, Topology};
use lb_tests::util::{poll, unique_name};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::cpu::CpuCost;
use crate::netio::{BULK_VERIFY_PORT, RR_PORT};
use crate::run::{paired_cpu_args, Config, Samples, Stat};

const NS: &str = "bench";
const POLICIES: u16 = 1000;
/// The selected server (pod-a) and the open one (pod-b).
const SELECTED: usize = 0;
const OPEN: usize = 1;
/// The client's second address, on its second leg: the open client.
const OPEN_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);

/// The `policy-rate` row, as stored in results.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyRateResult {
    pub policies: u16,
    /// Per repetition: connections per second through the selected pods and the
    /// open ones, over the paired CPU blocks.
    pub selected_conn_per_sec: Option<Stat>,
    pub open_conn_per_sec: Option<Stat>,
    /// Per repetition: selected / open.
    pub rate_ratio: Option<Stat>,
    /// Per repetition: MB/s of the bulk windows.
    pub selected_mb_per_sec: Option<Stat>,
    pub open_mb_per_sec: Option<Stat>,
    /// Per repetition: the median over rounds of selected / open MB/s.
    pub bulk_ratio: Option<Stat>,
    /// CPU per connection of the whole path, selected as the target.
    pub cpu: Option<CpuCost>,
    /// Failed connections over the row.
    pub errors: u64,
}

fn pod(name: &str, ip: Ipv4Addr, role: &str) -> String {
    PodManifest {
        namespace: NS.into(),
        name: name.into(),
        labels: vec![("role".into(), role.into())],
        node: NODE_NAME.into(),
        host_ip: Ipv4Addr::new(10, 244, 1, 1).into(),
        ips: vec![ip.into()],
        ports: vec![ContainerPort {
            name: "rr".into(),
            port: RR_PORT,
            protocol: "TCP",
        }],
        host_network: false,
    }
    .to_yaml()
}

/// The namespace, the four pods and the 1k policies: even ones select the
/// server for ingress from the client, odd ones the client for egress to the
/// server, each on a port of its own; the first two also admit the bench's ports.
fn write_manifests(dir: &ManifestDir) -> Result<()> {
    let ns_labels = [("kubernetes.io/metadata.name".to_owned(), NS.to_owned())];
    let mut docs = vec![
        namespace_yaml(NS, &ns_labels),
        pod("client", client_ip(0), "client"),
        pod("client-open", OPEN_CLIENT, "other"),
        pod(&pod_name(SELECTED), pod_ip(SELECTED), "server"),
        pod(&pod_name(OPEN), pod_ip(OPEN), "other"),
    ];
    let role = |r: &str| json!({ "matchLabels": { "role": r } });
    for i in 0..POLICIES {
        let mut ports = vec![json!({ "port": 10_000 + i })];
        if i < 2 {
            ports.extend([
                json!({ "port": RR_PORT }),
                json!({ "port": BULK_VERIFY_PORT }),
            ]);
        }
        let spec = if i % 2 == 0 {
            json!({ "podSelector": role("server"),
                    "ingress": [{ "from": [{ "podSelector": role("client") }], "ports": ports }] })
        } else {
            json!({ "podSelector": role("client"),
                    "egress": [{ "to": [{ "podSelector": role("server") }], "ports": ports }] })
        };
        docs.push(network_policy_yaml(NS, &format!("np{i}"), &spec));
    }
    dir.write("bench.yaml", &docs.join("---\n"))
}

/// The bed; field order is teardown order.
struct Bed {
    servers: Vec<Child>,
    agent: Agent,
    topo: Topology,
    _cgroup: Cgroup,
    _manifests: ManifestDir,
}

impl Bed {
    fn build(exe: &Path, lb: &Path, cfg: &Config) -> Result<Bed> {
        let topo = Topology::build(2, 1)?;
        let node = topo.node();
        let client = topo.client().netns();
        node.sysctls(&[("net/ipv4/conf/all/rp_filter", "0")])?;
        // The open leg: its own veth into the bridge and address; each leg answers
        // ARP only for its own address, so each server's replies come back on the
        // leg its client sent from.
        node.veth_to("vclient2", client, "eth1")?;
        node.ip(&["link", "set", "vclient2", "master", "br0", "up"])?;
        client.ip(&["addr", "add", &format!("{OPEN_CLIENT}/32"), "dev", "eth1"])?;
        client.ip(&["link", "set", "eth1", "up"])?;
        client.sysctls(&[
            ("net/ipv4/conf/all/arp_ignore", "1"),
            ("net/ipv4/conf/all/arp_announce", "2"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/*/rp_filter", "0"),
        ])?;
        let (selected, open) = (pod_ip(SELECTED).to_string(), pod_ip(OPEN).to_string());
        let (c0, c1) = (client_ip(0).to_string(), OPEN_CLIENT.to_string());
        client.ip(&["route", "add", &selected, "dev", "eth0", "src", &c0])?;
        client.ip(&["route", "add", &open, "dev", "eth1", "src", &c1])?;

        let manifests = ManifestDir::create()?;
        write_manifests(&manifests)?;
        let cgroup = Cgroup::create(&unique_name("lb-bench-policy-rate"))?;
        let spec = AgentSpec::new(manifests.path(), &cgroup, NODE_NAME)
            .netns(node)
            .args(["--network-policy", "on"]);
        let agent = Agent::start_with(lb, &spec)?;
        agent.wait_ready(READY_TIMEOUT)?;
        let mut servers = Vec::new();
        for i in [SELECTED, OPEN] {
            servers.push(crate::run::serve_in(
                exe,
                &topo.pods()[i],
                &pod_name(i),
                cfg.cpu,
            )?);
        }
        let bed = Bed {
            servers,
            agent,
            topo,
            _cgroup: cgroup,
            _manifests: manifests,
        };
        bed.wait_enforced()?;
        Ok(bed)
    }

    /// Until the selected pods are enforced: `lb policy` lists them so.
    fn wait_enforced(&self) -> Result<()> {
        poll(
            "the selected pods enforced",
            Duration::from_secs(60),
            || {
                let rows = self.agent.policy()?;
                let enforced = |ip: Ipv4Addr, key: &str| {
                    rows.iter()
                        .any(|r| r["address"] == ip.to_string() && r[key] == true)
                };
                Ok((enforced(pod_ip(SELECTED), "ingress_enforced")
                    && enforced(client_ip(0), "egress_enforced"))
                .then_some(()))
            },
        )
    }

    fn rr(i: usize) -> SocketAddr {
        SocketAddrV4::new(pod_ip(i), RR_PORT).into()
    }

    fn bulk(i: usize) -> SocketAddr {
        SocketAddrV4::new(pod_ip(i), BULK_VERIFY_PORT).into()
    }

    fn client(
        &self,
        exe: &Path,
        cfg: &Config,
        to: SocketAddr,
        args: &[String],
    ) -> Result<crate::netio::ClientReport> {
        crate::run::run_client(exe, cfg.cpu, self.topo.client().netns(), None, to, args)
    }
}

pub fn run(exe: &Path, lb: &Path, cfg: &Config) -> Result<PolicyRateResult> {
    let bed = Bed::build(exe, lb, cfg)?;
    let agent_pid = Some(u64::from(bed.agent.pid()));
    let server_pids: Vec<u32> = bed.servers.iter().map(Child::pid).collect();
    let before = bed.agent.stats()?;
    let (mut rate, mut bulk) = (Samples::default(), Samples::default());
    let (mut bulk_ratios, mut cpu_runs, mut errors, mut connections) =
        (Vec::new(), Vec::new(), 0, 0);
    for rep in 0..cfg.reps {
        lb_tests::interrupt::check()?;
        let r = bed.client(
            exe,
            cfg,
            Bed::rr(SELECTED),
            &paired_cpu_args(cfg, Bed::rr(OPEN), &server_pids, agent_pid),
        )?;
        errors += r.errors;
        let cpu = r
            .cpu
            .context("the paired-cpu run reported no CPU figures")?;
        let per_sec = |s: &crate::netio::CpuSide| s.connections as f64 * 1e9 / s.wall_ns as f64;
        rate.push(per_sec(&cpu.target), per_sec(&cpu.baseline));
        connections += cpu.target.connections;
        cpu_runs.push(cpu);
        let b = bed.client(
            exe,
            cfg,
            Bed::bulk(SELECTED),
            &[
                "--mode".into(),
                "paired-bulk".into(),
                "--secs".into(),
                (2.0 * cfg.bulk_secs).to_string(),
                "--baseline".into(),
                Bed::bulk(OPEN).to_string(),
            ],
        )?;
        let (s, o, ratio) = match (b.mb_per_sec, b.baseline_mb_per_sec, b.bulk_ratio) {
            (Some(s), Some(o), Some(ratio)) => (s, o, ratio),
            _ => anyhow::bail!("the paired bulk run reported no figures: {b:?}"),
        };
        bulk.push(s, o);
        bulk_ratios.push(ratio);
        let now = CpuCost::of(&cpu_runs[cpu_runs.len() - 1..]);
        println!(
            "  policy-rate rep {rep}: {:.0} vs {:.0} conn/s ({:.3}x), bulk {s:.0} vs {o:.0} MB/s ({ratio:.3}x){}",
            rate.target.last().copied().unwrap_or_default(),
            rate.baseline.last().copied().unwrap_or_default(),
            rate.ratios.last().copied().unwrap_or_default(),
            now.map(|c| format!(", CPU {:.1} vs {:.1} us/conn ({:.3}x)", c.kernel_us, c.baseline_kernel_us, c.ratio))
                .unwrap_or_default()
        );
    }
    let grown = crate::pps::counter_deltas(&before, &bed.agent.stats()?);
    ensure_judged(&grown, connections)?;
    Ok(PolicyRateResult {
        policies: POLICIES,
        selected_conn_per_sec: Stat::of(rate.target),
        open_conn_per_sec: Stat::of(rate.baseline),
        rate_ratio: Stat::of(rate.ratios),
        selected_mb_per_sec: Stat::of(bulk.target),
        open_mb_per_sec: Stat::of(bulk.baseline),
        bulk_ratio: Stat::of(bulk_ratios),
        cpu: CpuCost::of(&cpu_runs),
        errors,
    })
}

/// Policy judged the measured side's connections and dropped nothing.
fn ensure_judged(grown: &BTreeMap<String, u64>, connections: u64) -> Result<()> {
    let get = |name: &str| grown.get(name).copied().unwrap_or(0);
    for name in [
        "policy_ingress_drop",
        "policy_egress_drop",
        "policy_ct_full",
    ] {
        ensure!(get(name) == 0, "{name} grew: {grown:?}");
    }
    // Not one per connection: a client port that comes round again finds its old
    // flow's entry and is not judged again (28k judged of 66k in a full run).
    ensure!(
        get("policy_allowed") > 0 && connections > 0,
        "policy judged no new flow of the {connections} measured connections: {grown:?}"
    );
    Ok(())
}
