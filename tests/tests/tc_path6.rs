//! IPv6 on the per-packet (TC) path, end to end on the two-node cluster of
//! `lb_tests::cluster` (dual-stack: every node, pod and client has an IPv6 address
//! beside its IPv4 one): NodePorts with a local backend (the client's address kept)
//! and a remote one (SNAT to the node's IPv6 address), externalTrafficPolicy: Local,
//! externalIPs and LoadBalancer IPs, a dual-stack Service whose frontends of each
//! family get only that family's backends, UDP, bulk transfers, a RST for a Service
//! without endpoints and an ICMPv6 Packet Too Big from beyond the node reaching the
//! client.
//!
//! The agents get no flag: each finds its node's IPv6 addresses itself, as on a real
//! node. No test process is in a hooked cgroup: every translation is the TC path.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use anyhow::{ensure, Result};
use lb_tests::cluster::{
    node_ip, node_ip6, pod_cidr6, whoami_node_port, Cluster, ClusterBuilder, BULK_PORT, CLIENT_IP,
    CLIENT_IP6, DROP_CONNECT_TIMEOUT, WHOAMI_PORT,
};
use lb_tests::manifests::{Service, ServicePort};
use lb_tests::{cargo_tools, lb_binary};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// pod-a on node1 and pod-b on node2.
fn two_backends() -> ClusterBuilder {
    Cluster::builder().backend("pod-a", 0).backend("pod-b", 1)
}

/// The IPv6 cluster IP `fd00:96::<n>`.
fn vip6(n: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, n)
}

/// `[node_ip6(node)]:port`.
fn on_node6(node: usize, port: u16) -> SocketAddr {
    SocketAddr::V6(SocketAddrV6::new(node_ip6(node), port, 0, 0))
}

/// An IPv6-only NodePort Service: whoami 80 -> 9000/TCP on node port `node_port`.
fn whoami6(name: &str, n: u16, node_port: u16) -> Service {
    whoami_node_port(name, Ipv4Addr::new(10, 96, 9, 9), node_port).ipv6_only(vip6(n))
}

/// `pod:port` over IPv6 for each pod named.
fn pod_addrs6(cluster: &Cluster, pods: &[&str], port: u16) -> Result<Vec<SocketAddr>> {
    pods.iter()
        .map(|name| {
            let ip = cluster.pod(name)?.ip6().expect("dual-stack pods");
            Ok(SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0)))
        })
        .collect()
}

fn setup(builder: ClusterBuilder, services: &[(&Service, &[&str])]) -> Result<Cluster> {
    let lb = lb_binary()?;
    let mut cluster = builder.build(cargo_tools!())?;
    for (svc, backends) in services {
        cluster.publish(svc, backends)?;
    }
    cluster.start_agents(&lb, |_| Vec::new())?;
    Ok(cluster)
}

fn set(items: &[IpAddr]) -> BTreeSet<IpAddr> {
    items.iter().copied().collect()
}

/// `count` connections from the external client to `to` are all answered by `pod`,
/// which sees them from `source`; the client keeps its port and sees `to` as its
/// peer.
fn answers_from(
    cluster: &Cluster,
    to: SocketAddr,
    count: u32,
    pod: &str,
    source: IpAddr,
) -> Result<()> {
    cluster
        .expect_answers(cluster.client(), to, count, &[(pod, source)], true)
        .map(drop)
}

/// NodePorts on node1's IPv6 address: to the local backend the client's own IPv6
/// address arrives; to the remote one node1's IPv6 address (SNAT, client port
/// kept), and the replies are reverse-translated on their way back.
#[test]
fn ipv6_node_port_local_keeps_client_remote_snats_to_node() -> Result<()> {
    let local = whoami6("local6", 0x30, 30180);
    let remote = whoami6("remote6", 0x31, 30181);
    let cluster = setup(
        two_backends(),
        &[(&local, &["pod-a"]), (&remote, &["pod-b"])],
    )?;
    for (port, pod) in [(30180, "pod-a"), (30181, "pod-b")] {
        let want = pod_addrs6(&cluster, &[pod], WHOAMI_PORT)?;
        cluster.wait_frontend(0, on_node6(0, port), "TCP", "internal", &want)?;
    }
    answers_from(&cluster, on_node6(0, 30180), 10, "pod-a", CLIENT_IP6.into())?;
    answers_from(
        &cluster,
        on_node6(0, 30181),
        10,
        "pod-b",
        node_ip6(0).into(),
    )?;
    Ok(())
}

/// A dual-stack NodePort Service: the IPv4 NodePort reaches the pods' IPv4
/// addresses, the IPv6 NodePort their IPv6 ones, each with only its own family's
/// backends (as kube-proxy programs each family from its own EndpointSlices).
#[test]
fn dual_stack_node_port_serves_each_family_with_its_own_backends() -> Result<()> {
    let svc = whoami_node_port("dual", Ipv4Addr::new(10, 96, 0, 60), 30186).dual_stack(vip6(0x60));
    let cluster = setup(two_backends(), &[(&svc, &["pod-a", "pod-b"])])?;
    let v4: Vec<SocketAddr> = ["pod-a", "pod-b"]
        .iter()
        .map(|p| Ok(SocketAddr::new(cluster.pod(p)?.ip().into(), WHOAMI_PORT)))
        .collect::<Result<_>>()?;
    let v6 = pod_addrs6(&cluster, &["pod-a", "pod-b"], WHOAMI_PORT)?;
    let np4 = SocketAddr::new(node_ip(0).into(), 30186);
    let np6 = on_node6(0, 30186);
    cluster.wait_frontend(0, np4, "TCP", "internal", &v4)?;
    cluster.wait_frontend(0, np6, "TCP", "internal", &v6)?;

    for (to, client, node) in [
        (np4, IpAddr::from(CLIENT_IP), IpAddr::from(node_ip(0))),
        (np6, CLIENT_IP6.into(), node_ip6(0).into()),
    ] {
        // 40 independent choices: missing a backend has probability 2 * 2^-40.
        let expect = [("pod-a", client), ("pod-b", node)];
        cluster.expect_answers(cluster.client(), to, 40, &expect, false)?;
    }
    Ok(())
}

/// externalTrafficPolicy: Local over IPv6: via node1 (local endpoint) the client's
/// IPv6 address is kept; via node2 (none) the SYN is dropped.
#[test]
fn ipv6_external_traffic_policy_local_keeps_client_or_drops() -> Result<()> {
    let svc = whoami6("etp6", 0x32, 30182).external_local();
    let cluster = setup(two_backends(), &[(&svc, &["pod-a"])])?;
    let pod_a = pod_addrs6(&cluster, &["pod-a"], WHOAMI_PORT)?;
    let (via1, via2) = (on_node6(0, 30182), on_node6(1, 30182));
    cluster.wait_frontend(0, via1, "TCP", "external", &pod_a)?;
    cluster.wait_frontend(1, via2, "TCP", "external", &[] as &[SocketAddr])?;

    answers_from(&cluster, via1, 10, "pod-a", CLIENT_IP6.into())?;

    let dropped_before = cluster.stat(1, "tc_no_backend")?;
    let r = cluster.whoami(cluster.client(), via2, 3, false, DROP_CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.errors_of("ETIMEDOUT") == 3,
        "via node2 (no local endpoint) the connection must be dropped: {r:#?}\n{}",
        cluster.all_stats()
    );
    let dropped = cluster.stat(1, "tc_no_backend")? - dropped_before;
    ensure!(
        dropped >= 3,
        "node2 dropped {dropped} as tc_no_backend\n{}",
        cluster.all_stats()
    );
    Ok(())
}

/// An IPv6 externalIP and LoadBalancer ingress IP, routed to node1 by the client,
/// reach both backends: the local one sees the client, the remote one node1.
#[test]
fn ipv6_external_ip_and_load_balancer_ip_reach_backends() -> Result<()> {
    let external_ip = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x200);
    let lb_ip = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x201);
    let svc = Service::new(
        "ingress6",
        Ipv4Addr::new(10, 96, 9, 9),
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30183)],
    )
    .ipv6_only(vip6(0x33))
    .load_balancer([lb_ip])
    .with_external_ips([external_ip]);
    let builder = two_backends()
        .client_route_via_node1(external_ip)
        .client_route_via_node1(lb_ip);
    let cluster = setup(builder, &[(&svc, &["pod-a", "pod-b"])])?;
    let both = pod_addrs6(&cluster, &["pod-a", "pod-b"], WHOAMI_PORT)?;

    for ip in [external_ip, lb_ip] {
        let to = SocketAddr::V6(SocketAddrV6::new(ip, 80, 0, 0));
        cluster.wait_frontend(0, to, "TCP", "internal", &both)?;
        let expect = [("pod-a", CLIENT_IP6.into()), ("pod-b", node_ip6(0).into())];
        cluster.expect_answers(cluster.client(), to, 40, &expect, false)?;
    }
    Ok(())
}

/// 16 MiB each way through IPv6 NodePorts, to the remote backend (SNAT) and to the
/// local one: every byte comes back unchanged.
#[test]
fn ipv6_bulk_transfer_through_node_port_is_byte_exact() -> Result<()> {
    const BYTES: u64 = 16 << 20;
    let bulk = |name: &str, n: u16, node_port: u16| {
        Service::new(
            name,
            Ipv4Addr::new(10, 96, 9, 9),
            vec![ServicePort::tcp("bulk", 81, BULK_PORT.into()).with_node_port(node_port.into())],
        )
        .node_port()
        .ipv6_only(vip6(n))
    };
    let remote = bulk("bulk-remote6", 0x34, 30184);
    let local = bulk("bulk-local6", 0x35, 30185);
    let cluster = setup(
        two_backends(),
        &[(&remote, &["pod-b"]), (&local, &["pod-a"])],
    )?;
    for (node_port, pod, seed) in [(30184, "pod-b", 1), (30185, "pod-a", 2)] {
        let to = on_node6(0, node_port);
        let want = pod_addrs6(&cluster, &[pod], BULK_PORT)?;
        cluster.wait_frontend(0, to, "TCP", "internal", &want)?;
        let r = cluster.bulk(cluster.client(), to, BYTES, seed)?;
        ensure!(
            r.complete(BYTES),
            "{to} ({pod}): {r:#?}\n{}",
            cluster.all_stats()
        );
        ensure!(r.backend == pod, "{to}: answered by {}: {r:#?}", r.backend);
        ensure!(r.peer == to.to_string(), "{to}: {r:#?}");
    }
    Ok(())
}

/// UDP over an IPv6 NodePort to the remote backend: answered from the NodePort,
/// the backend sees node1.
#[test]
fn ipv6_udp_node_port_to_remote_backend() -> Result<()> {
    let svc = Service::new(
        "dns6",
        Ipv4Addr::new(10, 96, 9, 9),
        vec![ServicePort::udp("dns", 53, WHOAMI_PORT.into()).with_node_port(30153)],
    )
    .node_port()
    .ipv6_only(vip6(0x37));
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])])?;
    let np = on_node6(0, 30153);
    let want = pod_addrs6(&cluster, &["pod-b"], WHOAMI_PORT)?;
    cluster.wait_frontend(0, np, "UDP", "internal", &want)?;

    let r = cluster.whoami(cluster.client(), np, 10, true, CONNECT_TIMEOUT)?;
    let stats = cluster.all_stats();
    ensure!(
        r.tally.answered == 10 && r.tally.errors.is_empty(),
        "{r:#?}\n{stats}"
    );
    ensure!(r.tally.names() == ["pod-b"].into(), "{r:#?}");
    ensure!(r.peers() == [np.to_string().as_str()].into(), "{r:#?}");
    ensure!(r.seen_ips("pod-b") == set(&[node_ip6(0).into()]), "{r:#?}");
    Ok(())
}

/// A Service without endpoints, over IPv6: a TCP connect is refused at once (the
/// TC path answers the SYN with a RST), a connected UDP socket gets ECONNREFUSED
/// (an ICMPv6 port unreachable), as kube-proxy's REJECT does.
#[test]
fn ipv6_service_without_endpoints_is_refused() -> Result<()> {
    let svc = Service::new(
        "empty6",
        Ipv4Addr::new(10, 96, 9, 9),
        vec![
            ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30187),
            ServicePort::udp("dns", 53, WHOAMI_PORT.into()).with_node_port(30187),
        ],
    )
    .node_port()
    .ipv6_only(vip6(0x38));
    let cluster = setup(two_backends(), &[(&svc, &[])])?;
    let np = on_node6(0, 30187);
    cluster.wait_frontend(0, np, "TCP", "internal", &[] as &[SocketAddr])?;
    cluster.wait_frontend(0, np, "UDP", "internal", &[] as &[SocketAddr])?;

    cluster.expect_refused(np)
}

/// PMTU through the NodePort: node2's route to its pods allows 1280 bytes, the
/// client's and node1's links 1500. The client's full-sized segments, SNATed by
/// node1 towards pod-b, are refused by node2 with a Packet Too Big to node1's
/// address; node1 must hand it to the client, rewritten to quote what the client
/// sent, or the client never shrinks its segments and the transfer stalls. The
/// transfer completes byte-exact and the client's route to node1 has learnt 1280.
#[test]
fn ipv6_packet_too_big_from_beyond_the_node_reaches_the_client() -> Result<()> {
    const BYTES: u64 = 4 << 20;
    let svc = Service::new(
        "pmtu6",
        Ipv4Addr::new(10, 96, 9, 9),
        vec![ServicePort::tcp("bulk", 81, BULK_PORT.into()).with_node_port(30188)],
    )
    .node_port()
    .ipv6_only(vip6(0x39));
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])])?;
    cluster.node(1).netns().ip(&[
        "-6",
        "route",
        "replace",
        &pod_cidr6(1),
        "dev",
        "br0",
        "proto",
        "kernel",
        "metric",
        "256",
        "mtu",
        "1280",
    ])?;
    let to = on_node6(0, 30188);
    let want = pod_addrs6(&cluster, &["pod-b"], BULK_PORT)?;
    cluster.wait_frontend(0, to, "TCP", "internal", &want)?;

    let r = cluster.bulk(cluster.client(), to, BYTES, 7)?;
    ensure!(
        r.complete(BYTES),
        "{to}: the transfer did not complete: {r:#?}\n{}",
        cluster.all_stats()
    );
    ensure!(r.backend == "pod-b", "{r:#?}");
    let route = cluster
        .client()
        .ip(&["-6", "route", "get", &node_ip6(0).to_string()])?;
    ensure!(
        route.contains("mtu 1280"),
        "the client did not learn the path MTU: {route}"
    );
    Ok(())
}

/// `lb conntrack` lists an IPv6 flow through a NodePort to the remote backend:
/// the client's address and port, the NodePort, the backend, and node1 as the
/// SNAT source keeping the client's port.
#[test]
fn ipv6_conntrack_lists_the_flow() -> Result<()> {
    let svc = Service::new(
        "held6",
        Ipv4Addr::new(10, 96, 9, 9),
        vec![ServicePort::tcp("echo", 80, lb_tests::ECHO_TCP_PORT.into()).with_node_port(30189)],
    )
    .node_port()
    .ipv6_only(vip6(0x3a));
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])])?;
    let np = on_node6(0, 30189);
    let backend = pod_addrs6(&cluster, &["pod-b"], lb_tests::ECHO_TCP_PORT)?[0];
    cluster.wait_frontend(0, np, "TCP", "internal", &[backend])?;

    let mut held = cluster.hold(cluster.client(), np)?;
    ensure!(held.echo("ping")? == "pod-b ping");
    let client: SocketAddr = held
        .local
        .as_deref()
        .expect("lb-probe hold reports its local address")
        .parse()?;
    ensure!(client.ip() == IpAddr::from(CLIENT_IP6), "{client}");
    let flows = cluster.wait_conntrack(
        0,
        &format!("node1 to list the flow of {client}"),
        Duration::from_secs(5),
        |flows| flows.iter().any(|f| f.client == client),
    )?;
    let flow = flows.iter().find(|f| f.client == client).expect("found");
    ensure!(flow.frontend == np, "{flow:#?}");
    ensure!(flow.backend == backend, "{flow:#?}");
    ensure!(
        flow.snat == Some(SocketAddr::new(node_ip6(0).into(), client.port())),
        "{flow:#?}"
    );
    ensure!(flow.state == "ESTABLISHED", "{flow:#?}");
    held.close()?;
    Ok(())
}
