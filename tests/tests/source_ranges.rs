//! `spec.loadBalancerSourceRanges` end to end, on the two-node cluster of
//! `lb_tests::cluster` with two external clients: 192.168.50.100 inside the
//! Service's range, 192.168.50.101 outside it. Real connections through the
//! LoadBalancer IP (announced via node1) and the same Service's NodePort.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use anyhow::{ensure, Result};
use lb_tests::cluster::{node_ip, node_name, Cluster, CLIENT2_IP, CLIENT_IP, WHOAMI_PORT};
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, Service, ServicePort};
use lb_tests::{cargo_tools, lb_binary};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections expected to be dropped give up after this.
const DROPPED_TIMEOUT: Duration = Duration::from_millis(700);

const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 210);
const NODE_PORT: u16 = 30210;

fn service(ranges: &[&str], ip_mode: &'static str) -> Service {
    Service::new(
        "guarded",
        Ipv4Addr::new(10, 96, 0, 80),
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(NODE_PORT.into())],
    )
    .load_balancer([LB_IP])
    .with_ip_mode(ip_mode)
    .with_source_ranges(ranges)
}

fn publish(cluster: &Cluster, svc: &Service) -> Result<()> {
    let pod_a = Endpoint::ready("pod-a", cluster.pod("pod-a")?.ip()).on_node(&node_name(0));
    cluster.manifests.write(
        "guarded.yaml",
        &documents([
            svc.to_yaml(),
            EndpointSlice::for_service(svc, vec![pod_a]).to_yaml(),
        ]),
    )
}

/// This node's `source_range_drops` of `lb stats --per-service` for the LB IP.
fn lb_ip_drops(cluster: &Cluster) -> Result<u64> {
    let rows = cluster.node(0).agent().per_service_stats()?;
    Ok(rows
        .iter()
        .filter(|r| r["frontend"]["ip"] == LB_IP.to_string())
        .map(|r| r["source_range_drops"].as_u64().unwrap_or(0))
        .sum())
}

#[test]
fn source_ranges_admit_only_their_clients_to_the_load_balancer_ip() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = Cluster::builder()
        .backend("pod-a", 0)
        .second_client()
        .client_route_via_node1(LB_IP)
        .build(cargo_tools!())?;
    // CLIENT_IP alone (and a range no client is in), not CLIENT2_IP.
    let svc = service(&[&format!("{CLIENT_IP}/32"), "10.99.0.0/16"], "VIP");
    publish(&cluster, &svc)?;
    cluster.start_agents(&lb, |_| Vec::new())?;
    let pod_a = [SocketAddrV4::new(cluster.pod("pod-a")?.ip(), WHOAMI_PORT)];
    let lb_addr = SocketAddrV4::new(LB_IP, 80);
    let node_port = SocketAddrV4::new(node_ip(0), NODE_PORT);
    cluster.wait_frontend(0, lb_addr, "TCP", "internal", &pod_a)?;

    // Inside the range: answered through the LB IP.
    let r = cluster.whoami(cluster.client(), lb_addr, 5, false, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 5 && r.tally.names() == ["pod-a"].into(),
        "{CLIENT_IP} is inside the range: {r:#?}\n{}",
        cluster.all_stats()
    );
    // Outside: every connection dropped (it times out), counted for the Service.
    let before = cluster.stat(0, "tc_source_range_drop")?;
    let r = cluster.whoami(cluster.client2(), lb_addr, 3, false, DROPPED_TIMEOUT)?;
    ensure!(
        r.tally.answered == 0 && r.tally.errors_of("ETIMEDOUT") == 3,
        "{CLIENT2_IP} is outside the range: {r:#?}"
    );
    ensure!(
        cluster.stat(0, "tc_source_range_drop")? - before >= 3,
        "{}",
        cluster.all_stats()
    );
    ensure!(
        lb_ip_drops(&cluster)? >= 3,
        "{:#?}",
        cluster.node(0).agent().per_service_stats()?
    );
    // The same Service's NodePort answers both clients.
    for client in [cluster.client(), cluster.client2()] {
        let r = cluster.whoami(client, node_port, 3, false, CONNECT_TIMEOUT)?;
        ensure!(
            r.tally.answered == 3 && r.tally.names() == ["pod-a"].into(),
            "NodePort from {}: {r:#?}",
            client.name()
        );
    }

    // The range widened to take the second client in: it is answered too.
    publish(&cluster, &service(&["192.168.50.100/31"], "VIP"))?;
    lb_tests::util::poll(
        "the second client to be admitted once the range includes it",
        Duration::from_secs(10),
        || {
            let r = cluster.whoami(cluster.client2(), lb_addr, 1, false, DROPPED_TIMEOUT)?;
            Ok((r.tally.answered == 1).then_some(()))
        },
    )?;

    // ipMode: Proxy: the LB IP is the load balancer's, not served by the node.
    publish(&cluster, &service(&["192.168.50.100/31"], "Proxy"))?;
    lb_tests::util::poll(
        "node1 to stop serving the Proxy-mode LB IP",
        Duration::from_secs(10),
        || {
            let entries = cluster.node(0).agent().services_json()?;
            Ok((!entries.iter().any(|e| e.is(LB_IP, 80, "TCP"))).then_some(()))
        },
    )?;
    let r = cluster.whoami(cluster.client(), lb_addr, 1, false, DROPPED_TIMEOUT)?;
    ensure!(
        r.tally.answered == 0,
        "nothing answers the Proxy-mode LB IP on the node: {r:#?}"
    );
    let r = cluster.whoami(cluster.client(), node_port, 1, false, CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 1, "the NodePort still answers: {r:#?}");
    Ok(())
}
