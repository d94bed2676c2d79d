//! Egress masquerading end to end (`lb agent --masquerade bpf`), on the two-node
//! cluster of `lb_tests::cluster` with its host outside the cluster: reached only
//! through node1's second uplink `up1`, routing only to the node network, so a
//! packet from a pod address reaching it cannot be answered (as on the internet
//! behind a cloud's network). The Nodes' pod CIDRs come from Node objects among
//! the manifests, as the API server would give them.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    node_ip, node_ip6, Cluster, DROP_CONNECT_TIMEOUT, OUTSIDE_GATEWAY, OUTSIDE_GATEWAY6,
    OUTSIDE_IP, OUTSIDE_IP6, WHOAMI_PORT,
};
use lb_tests::manifests::{documents, node_yaml_with_pod_cidrs, Service, ServicePort};
use lb_tests::{cargo_tools, lb_binary};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const CONFIG: &str = "ip-masq-agent.yaml";

fn cluster() -> Result<Cluster> {
    let cluster = Cluster::builder()
        .client_pod("client", 0)
        .backend("pod-a", 0)
        .backend("pod-b", 1)
        .client_pod("client2", 1)
        .outside_host()
        .build(cargo_tools!())?;
    cluster.manifests.write(
        "nodes.yaml",
        &documents([
            node_yaml_with_pod_cidrs("node1", &["10.244.1.0/24", "fd00:244:1::/64"]),
            node_yaml_with_pod_cidrs("node2", &["10.244.2.0/24", "fd00:244:2::/64"]),
        ]),
    )?;
    Ok(cluster)
}

/// Where the agents read ip-masq-agent's file: beside the manifests would make it
/// a manifest, so in a directory of its own, removed with the test.
struct ConfigDir(std::path::PathBuf);

impl ConfigDir {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(lb_tests::util::unique_name("lb-masq-config"));
        std::fs::create_dir(&dir)?;
        Ok(ConfigDir(dir))
    }

    fn path(&self) -> std::path::PathBuf {
        self.0.join(CONFIG)
    }

    /// Replaces the file at once (a rename), as a ConfigMap update does.
    fn write(&self, text: &str) -> Result<()> {
        let staged = self.0.join("staged");
        std::fs::write(&staged, text)?;
        std::fs::rename(&staged, self.path())?;
        Ok(())
    }
}

impl Drop for ConfigDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `count` whoami requests from `pod` to `to`; every one answered; the addresses
/// the server saw.
fn seen_from(cluster: &Cluster, pod: &str, to: SocketAddr, udp: bool) -> Result<BTreeSet<IpAddr>> {
    let ns = cluster.pod(pod)?.netns();
    let r = cluster.whoami(ns, to, 3, udp, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 3,
        "{pod} -> {to} ({}): {r:#?}\n{}",
        if udp { "UDP" } else { "TCP" },
        cluster.all_stats()
    );
    Ok(r.answers.iter().filter_map(|a| a.seen_ip()).collect())
}

fn one(ip: impl Into<IpAddr>) -> BTreeSet<IpAddr> {
    BTreeSet::from([ip.into()])
}

#[test]
fn pods_reach_the_outside_as_their_node_and_in_cluster_traffic_keeps_their_address() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = cluster()?;
    let config = ConfigDir::new()?;
    // A Service for pod-to-Service traffic (a cluster IP, on the TC path).
    let vip = Ipv4Addr::new(10, 96, 0, 90);
    let svc = Service::new(
        "whoami",
        vip,
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into())],
    );
    cluster.publish(&svc, &["pod-b"])?;
    let config_path = config.path();
    cluster.start_agents(&lb, |_| {
        vec![
            "--masquerade".into(),
            "bpf".into(),
            "--ip-masq-agent-config".into(),
            config_path.display().to_string(),
        ]
    })?;
    let outside = SocketAddr::new(OUTSIDE_IP.into(), WHOAMI_PORT);
    let outside6 = SocketAddr::new(OUTSIDE_IP6.into(), WHOAMI_PORT);

    // (1) From node1's pod: the address node1's routing uses on up1, both
    // protocols, both families; the replies come back.
    for udp in [false, true] {
        let seen = seen_from(&cluster, "client", outside, udp)?;
        ensure!(seen == one(OUTSIDE_GATEWAY), "udp={udp}: {seen:?}");
        let seen = seen_from(&cluster, "client", outside6, udp)?;
        ensure!(seen == one(OUTSIDE_GATEWAY6), "udp={udp} (IPv6): {seen:?}");
    }
    // From node2's pod: node2's own address (routed on by node1 as it is).
    let seen = seen_from(&cluster, "client2", outside, false)?;
    ensure!(seen == one(node_ip(1)), "{seen:?}\n{}", cluster.all_stats());
    let seen = seen_from(&cluster, "client2", outside6, true)?;
    ensure!(
        seen == one(node_ip6(1)),
        "{seen:?}\n{}",
        cluster.all_stats()
    );
    let listed = cluster.node(0).agent().lb_command(&["masquerade"])?;
    ensure!(
        listed.contains(&format!("{OUTSIDE_GATEWAY}:")) && listed.contains(&format!("{outside}")),
        "lb masquerade on node1:\n{listed}"
    );

    // (2) Inside the cluster nothing changes: pod to pod keeps the pod's address,
    // and so does pod to Service towards a backend on node2 (kube-proxy's
    // cluster-IP rule: the pod is inside the pod CIDRs; its flow is exempt).
    let client_ip = cluster.pod("client")?.ip();
    let pod_b = SocketAddr::new(cluster.pod("pod-b")?.ip().into(), WHOAMI_PORT);
    let seen = seen_from(&cluster, "client", pod_b, false)?;
    ensure!(seen == one(client_ip), "pod to pod: {seen:?}");
    let seen = seen_from(&cluster, "client", SocketAddr::new(vip.into(), 80), false)?;
    ensure!(seen == one(client_ip), "pod to Service: {seen:?}");
    let exempt_before = cluster.stat(0, "masq_exempt")?;
    ensure!(exempt_before > 0, "{}", cluster.all_stats());

    // (3) The file changes at run time: the outside network becomes exempt (and
    // learns the pods' routes, as a peered network would): it sees the pod.
    let out = cluster.outside().netns();
    out.ip(&[
        "route",
        "add",
        "10.244.0.0/16",
        "via",
        &OUTSIDE_GATEWAY.to_string(),
    ])?;
    config.write("nonMasqueradeCIDRs:\n  - 11.0.0.0/24\n")?;
    let mut last = None;
    lb_tests::util::poll("the outside sees the pod", Duration::from_secs(10), || {
        let seen = seen_from(&cluster, "client", outside, false)?;
        if seen == one(client_ip) {
            return Ok(Some(()));
        }
        last = Some(seen);
        Ok(None)
    })
    .with_context(|| format!("after the config change the outside still sees {last:?}"))?;
    // (4) A bad file is reported, naming the file and the field; the last good
    // one stays.
    config.write("nonMasqueradeCIDRs:\n  - 11.0.0.1/24\n")?;
    let line = cluster
        .node(0)
        .agent()
        .wait_for_line("nonMasqueradeCIDRs[0]", Duration::from_secs(10))
        .context("the bad file reported")?;
    ensure!(line.contains(CONFIG), "{line}");
    let seen = seen_from(&cluster, "client", outside, false)?;
    ensure!(seen == one(client_ip), "after a bad file: {seen:?}");
    Ok(())
}

/// The control: without `--masquerade bpf` a pod's packets reach the outside host
/// with the pod's address, which it cannot answer.
#[test]
fn without_masquerading_the_outside_host_cannot_answer_pods() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = cluster()?;
    cluster.start_agents(&lb, |_| Vec::new())?;
    let ns = cluster.pod("client")?.netns();
    let outside = SocketAddr::new(OUTSIDE_IP.into(), WHOAMI_PORT);
    let r = cluster.whoami(ns, outside, 2, false, DROP_CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 0, "{r:#?}");
    let r = cluster.whoami(ns, outside, 2, true, DROP_CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 0, "{r:#?}");
    Ok(())
}
