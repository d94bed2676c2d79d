//! The bed of the rows that compare two ways of entering a node for a backend on
//! another node (`dsr`: DSR against SNAT; `xdp-bulk`: XDP against TC): two entry
//! nodes configured alike but for the compared setting, in front of one backend on
//! a third node, so that one client process can interleave its connections to
//! both (as every paired row does), with no agent restarted in between.
//!
//! ```text
//!  client 192.168.50.100 ── switch ─┬─ node1 192.168.50.1  control entry node (lb agent)
//!  (lb-bench client)                ├─ node2 192.168.50.2  backend's node (lb agent)
//!                                   │    br0 ── server-0..7 10.244.2.20-27 (lb-bench serve)
//!                                   └─ node3 192.168.50.3  measured entry node (lb agent)
//! ```
//!
//! This is `lb_tests::cluster` with three nodes: each node routes the others'
//! pod CIDRs, the client routes no pod CIDR (only a translated packet reaches a
//! server). The Service is a NodePort whose endpoints are the servers on node2;
//! the client reaches it through node1's or node3's address. Eight servers, not
//! one: SNAT gives each flow a node port towards its backend, and a quick run's
//! 19k connections through the SNAT node to one backend left too few free (the
//! closed flows' entries live on), so SYNs were dropped (`tc_snat_exhausted`) and
//! the SNAT side measured retransmission timeouts; spread over eight, each
//! backend's ports stay mostly free. A row checks that none was exhausted. Everything is owned by
//! the cluster's guards and the server's child handle: dropping the bed removes it.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::agent::READY_TIMEOUT;
use lb_tests::cluster::{node_ip, Cluster};
use lb_tests::manifests::{Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::process::{Child, Spawner};
use lb_tests::testbed::Tools;
use lb_tests::util::poll;

use crate::netio::{ClientReport, BULK_VERIFY_PORT, RR_PORT};
use crate::run::Config;

/// The control entry node (node1), the backend's node (node2) and the measured
/// entry node (node3), as indices of the cluster's nodes.
pub const CONTROL: usize = 0;
pub const BACKEND: usize = 1;
pub const MEASURED: usize = 2;

/// The NodePorts: request/response, and bulk with verified data.
const RR_NODE_PORT: u16 = 30280;
const BULK_NODE_PORT: u16 = 30281;
/// Server pods on node2.
const SERVERS: usize = 8;

/// The cluster and the servers; field order is teardown order.
pub struct EntryBed {
    servers: Vec<Child>,
    cluster: Cluster,
    exe: PathBuf,
    cpu: usize,
}

impl EntryBed {
    /// The cluster (`xdp_ready`: fit for `lb_xdp` on the nodes' uplinks, see
    /// `ClusterBuilder::xdp_ready`), the servers on node2, the Service, and node
    /// `i`'s agent started with `args(i)`, ready with the NodePorts programmed.
    pub fn build(
        exe: &Path,
        lb: &Path,
        cfg: &Config,
        xdp_ready: bool,
        args: impl Fn(usize) -> Vec<String>,
    ) -> Result<EntryBed> {
        let names: Vec<String> = (0..SERVERS).map(|i| format!("server-{i}")).collect();
        let mut builder = Cluster::builder().nodes(3);
        for name in &names {
            builder = builder.client_pod(name, BACKEND);
        }
        if xdp_ready {
            builder = builder.xdp_ready();
        }
        // No pod of this cluster is a `Role::Backend` and the bench runs no
        // lb-probe: the cluster never starts lb-echo or lb-probe here, and the
        // server and client are lb-bench's own.
        let mut cluster = builder.build(Tools::new(exe, exe))?;
        let mut servers = Vec::with_capacity(SERVERS);
        for name in &names {
            let pod = cluster.pod(name)?;
            let server = Spawner::new(exe)
                .label(format!("lb-bench serve in {}", pod.netns().name()))
                .netns(pod.netns())?
                .args(["serve", "--name", name, "--cpu", &cfg.cpu.to_string()])
                .spawn()?;
            server
                .stdout
                .wait_for(Duration::from_secs(10), |l| l.contains("listening"))?;
            servers.push(server);
        }
        let svc = Service::new(
            "entry",
            Ipv4Addr::new(10, 96, 28, 1),
            vec![
                ServicePort::tcp("rr", 80, RR_PORT.into()).with_node_port(RR_NODE_PORT.into()),
                ServicePort::tcp("bulk", 81, BULK_VERIFY_PORT.into())
                    .with_node_port(BULK_NODE_PORT.into()),
            ],
        )
        .node_port();
        let backends: Vec<&str> = names.iter().map(String::as_str).collect();
        cluster.publish(&svc, &backends)?;
        cluster.start_agents(lb, args)?;
        // Ready: their logs are not part of the bench's output.
        for node in 0..3 {
            cluster.node_mut(node).agent_mut().set_log_on_drop(false);
        }
        let pod_ips: Vec<Ipv4Addr> = backends
            .iter()
            .map(|name| Ok(cluster.pod(name)?.ip()))
            .collect::<Result<_>>()?;
        for node in [CONTROL, MEASURED] {
            for (port, target) in [(RR_NODE_PORT, RR_PORT), (BULK_NODE_PORT, BULK_VERIFY_PORT)] {
                let want: Vec<SocketAddrV4> = pod_ips
                    .iter()
                    .map(|ip| SocketAddrV4::new(*ip, target))
                    .collect();
                cluster.wait_frontend(
                    node,
                    SocketAddrV4::new(node_ip(node), port),
                    "TCP",
                    "internal",
                    &want,
                )?;
            }
        }
        Ok(EntryBed {
            servers,
            cluster,
            exe: exe.to_path_buf(),
            cpu: cfg.cpu,
        })
    }

    /// The request/response NodePort at entry node `node`.
    pub fn rr(node: usize) -> SocketAddr {
        SocketAddrV4::new(node_ip(node), RR_NODE_PORT).into()
    }

    /// The verified bulk NodePort at entry node `node`.
    pub fn bulk(node: usize) -> SocketAddr {
        SocketAddrV4::new(node_ip(node), BULK_NODE_PORT).into()
    }

    /// The servers' pids (their CPU time is part of a connection's).
    pub fn server_pids(&self) -> Vec<u32> {
        self.servers.iter().map(Child::pid).collect()
    }

    /// `lb-bench client --to TO ARGS...` in the client's namespace, pinned to the
    /// bench's CPU (as the server is).
    pub fn client(&self, to: SocketAddr, args: &[String]) -> Result<ClientReport> {
        crate::run::run_client(&self.exe, self.cpu, self.cluster.client(), None, to, args)
    }

    /// Node `node`'s namespace.
    pub fn node_ns(&self, node: usize) -> &NetNs {
        self.cluster.node(node).netns()
    }

    /// The client's namespace.
    pub fn client_ns(&self) -> &NetNs {
        self.cluster.client()
    }

    /// Every node's `lb stats`.
    pub fn stats(&self) -> Result<Vec<BTreeMap<String, u64>>> {
        (0..3)
            .map(|i| self.cluster.node(i).agent().stats())
            .collect()
    }

    /// How every node's counters grew since `before` ([`EntryBed::stats`]).
    pub fn stats_since(
        &self,
        before: &[BTreeMap<String, u64>],
    ) -> Result<Vec<BTreeMap<String, u64>>> {
        Ok(self
            .stats()?
            .iter()
            .zip(before)
            .map(|(after, before)| crate::pps::counter_deltas(before, after))
            .collect())
    }

    /// Waits until `lb status` of node `node` says `lb_xdp` runs natively on its
    /// uplink (`eth0`), or, with `want` false, that nothing does.
    pub fn ensure_xdp(&self, node: usize, want: bool) -> Result<()> {
        let agent = self.cluster.node(node).agent();
        poll(
            &format!("node{}'s uplink XDP to be native: {want}", node + 1),
            READY_TIMEOUT,
            || {
                let links = agent.status_links()?;
                let eth0 = links.iter().find(|l| l.name == "eth0");
                Ok(eth0
                    .is_some_and(|l| (l.xdp == "native") == want)
                    .then_some(()))
            },
        )
    }

    /// Failure context: every node's non-zero counters.
    pub fn all_stats(&self) -> String {
        self.cluster.all_stats()
    }
}

/// Packets received and sent on every device of `ns` but loopback.
pub fn packets(ns: &NetNs) -> Result<(u64, u64)> {
    let text = ns.ip(&["-s", "-j", "link", "show"])?;
    let links: Vec<serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("ip -s -j link show: {text}"))?;
    let (mut rx, mut tx) = (0, 0);
    for link in links.iter().filter(|l| l["ifname"] != "lo") {
        let count = |dir: &str| {
            link["stats64"][dir]["packets"]
                .as_u64()
                .with_context(|| format!("no {dir} packet count in {link}"))
        };
        rx += count("rx")?;
        tx += count("tx")?;
    }
    Ok((rx, tx))
}

/// The sum of the named counters in `counters`.
pub fn sum(counters: &BTreeMap<String, u64>, names: &[&str]) -> u64 {
    names
        .iter()
        .map(|n| counters.get(*n).copied().unwrap_or(0))
        .sum()
}

/// No packet of a new flow on entry node `node` was dropped for want of a
/// conntrack entry or SNAT port (`deltas` from [`EntryBed::stats_since`]): a row
/// that hit those measured the drops and the client's retransmissions, not the
/// path.
pub fn ensure_not_starved(deltas: &BTreeMap<String, u64>, node: usize) -> Result<()> {
    let starved = sum(deltas, &["tc_ct_full", "tc_snat_exhausted"]);
    ensure!(
        starved == 0,
        "node{}: {starved} packets found no conntrack entry or SNAT port (counters grown: \
         {deltas:?})",
        node + 1
    );
    Ok(())
}

/// No counter whose name starts with `prefix` grew (`deltas` from
/// [`EntryBed::stats_since`]).
pub fn ensure_none(deltas: &BTreeMap<String, u64>, prefix: &str, node: &str) -> Result<()> {
    let grown: BTreeMap<&String, &u64> = deltas
        .iter()
        .filter(|(k, v)| k.starts_with(prefix) && **v > 0)
        .collect();
    ensure!(
        grown.is_empty(),
        "{node}: {prefix}* counters grew: {grown:?}"
    );
    Ok(())
}
