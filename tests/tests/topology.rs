//! Topology-aware routing end to end, on the two-node cluster of
//! `lb_tests::cluster`: node1 is in zone-a (its Node object in the manifests says
//! so), node2 in zone-b (no Node object; `--zone zone-b`). A `PreferSameZone`
//! Service has one endpoint per zone, each hinted for its zone as the EndpointSlice
//! controller writes them.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{node_ip, node_name, Cluster, WHOAMI_PORT};
use lb_tests::manifests::{node_yaml, Endpoint, Service, ServicePort};
use lb_tests::{cargo_tools, lb_binary};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The ready endpoint of pod `name` on node `node`, hinted for `zone`.
fn zoned(cluster: &Cluster, name: &str, node: usize, zone: &str) -> Result<Endpoint> {
    Ok(Endpoint::ready(name, cluster.pod(name)?.ip())
        .on_node(&node_name(node))
        .in_zone(zone))
}

fn addrs(cluster: &Cluster, pods: &[&str]) -> Result<Vec<SocketAddrV4>> {
    pods.iter()
        .map(|p| Ok(SocketAddrV4::new(cluster.pod(p)?.ip(), WHOAMI_PORT)))
        .collect()
}

/// 20 whoami requests from the client pod on node1 to `to` (ClusterIP, through
/// node1's TC path): the set of pods that answered.
fn answered_from_node1(cluster: &Cluster, to: SocketAddrV4) -> Result<Vec<String>> {
    let client = cluster.pod("client")?;
    let r = cluster.whoami(client.netns(), to, 20, false, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 20 && r.tally.errors.is_empty(),
        "{r:#?}\n{}",
        cluster.all_stats()
    );
    Ok(r.tally.names().into_iter().map(str::to_owned).collect())
}

#[test]
fn prefer_same_zone_keeps_to_the_zone_and_falls_back_when_it_empties() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = Cluster::builder()
        .backend("pod-a", 0)
        .backend("pod-b", 1)
        .client_pod("client", 0)
        .build(cargo_tools!())?;
    let vip = Ipv4Addr::new(10, 96, 0, 70);
    let svc = Service::new(
        "zoned",
        vip,
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30170)],
    )
    .node_port()
    .with_traffic_distribution("PreferSameZone");
    cluster.publish_endpoints(
        &svc,
        vec![
            zoned(&cluster, "pod-a", 0, "zone-a")?,
            zoned(&cluster, "pod-b", 1, "zone-b")?,
        ],
    )?;
    cluster
        .manifests
        .write("node1.yaml", &node_yaml(&node_name(0), "zone-a"))?;
    cluster.start_agents(&lb, |node| {
        if node == 1 {
            vec!["--zone".into(), "zone-b".into()]
        } else {
            Vec::new()
        }
    })?;
    let cluster_ip = SocketAddrV4::new(vip, 80);
    let (pod_a, pod_b) = (addrs(&cluster, &["pod-a"])?, addrs(&cluster, &["pod-b"])?);

    // Each node keeps to its own zone's endpoint, for cluster IP and NodePort alike.
    cluster.wait_frontend(0, cluster_ip, "TCP", "internal", &pod_a)?;
    cluster.wait_frontend(1, cluster_ip, "TCP", "internal", &pod_b)?;
    cluster.wait_frontend(
        1,
        SocketAddrV4::new(node_ip(1), 30170),
        "TCP",
        "internal",
        &pod_b,
    )?;
    ensure!(answered_from_node1(&cluster, cluster_ip)? == ["pod-a"]);
    let r = cluster.whoami(
        cluster.client(),
        SocketAddrV4::new(node_ip(1), 30170),
        10,
        false,
        CONNECT_TIMEOUT,
    )?;
    ensure!(
        r.tally.answered == 10 && r.tally.names() == ["pod-b"].into(),
        "NodePort on node2 (zone-b): {r:#?}"
    );

    // The Node's zone label changes: node1 is re-programmed for zone-b.
    cluster
        .manifests
        .write("node1.yaml", &node_yaml(&node_name(0), "zone-b"))?;
    cluster.wait_frontend(0, cluster_ip, "TCP", "internal", &pod_b)?;
    ensure!(answered_from_node1(&cluster, cluster_ip)? == ["pod-b"]);
    cluster
        .manifests
        .write("node1.yaml", &node_yaml(&node_name(0), "zone-a"))?;
    cluster.wait_frontend(0, cluster_ip, "TCP", "internal", &pod_a)?;

    // zone-a's endpoint goes: nothing is hinted for zone-a any more, so node1 falls
    // back to every endpoint, here pod-b in zone-b.
    cluster.publish_endpoints(&svc, vec![zoned(&cluster, "pod-b", 1, "zone-b")?])?;
    cluster
        .wait_frontend(0, cluster_ip, "TCP", "internal", &pod_b)
        .context("node1 must fall back to zone-b's endpoint")?;
    ensure!(answered_from_node1(&cluster, cluster_ip)? == ["pod-b"]);
    Ok(())
}
