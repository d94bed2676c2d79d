//! End-to-end tests of the per-packet (TC) path on a two-node cluster built from
//! network namespaces (see `lb_tests::cluster`): NodePorts, externalIPs,
//! LoadBalancer IPs, externalTrafficPolicy: Local, SNAT to remote backends, ClusterIP
//! from pods the socket hooks do not see, conntrack, bulk transfers and UDP.
//!
//! Every test builds its own cluster (namespaces, cgroups, pin dirs, manifests) and
//! drops it at the end, so tests run in parallel and clean up even when they fail.
//! No test process is in a hooked cgroup: every translation seen here is the TC path.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    bulk_node_port, node_ip, node_name, pod_cidr, pod_gateway, whoami_node_port, Cluster,
    ClusterBuilder, BULK_PORT, CLIENT_IP, DROP_CONNECT_TIMEOUT, WHOAMI_PORT,
};
use lb_tests::manifests::{documents, node_yaml_with_pod_cidrs, Conditions, Service, ServicePort};
use lb_tests::probe::UdpEchoReport;
use lb_tests::util::ip;
use lb_tests::{cargo_tools, lb_binary};

/// Normal connect timeout of probes that expect an answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

fn node1_ip() -> Ipv4Addr {
    node_ip(0)
}

fn node2_ip() -> Ipv4Addr {
    node_ip(1)
}

/// pod-a on node1 and pod-b on node2, both running lb-echo.
fn two_backends() -> ClusterBuilder {
    Cluster::builder().backend("pod-a", 0).backend("pod-b", 1)
}

/// `pod:port` for each pod named.
fn pod_addrs(cluster: &Cluster, pods: &[&str], port: u16) -> Result<Vec<SocketAddrV4>> {
    pods.iter()
        .map(|name| Ok(SocketAddrV4::new(cluster.pod(name)?.ip(), port)))
        .collect()
}

/// Build the cluster, publish `services` (with their backends) and start the agents.
fn setup(
    builder: ClusterBuilder,
    services: &[(&Service, &[&str])],
    agent_args: impl Fn(usize) -> Vec<String>,
) -> Result<Cluster> {
    let lb = lb_binary()?;
    let mut cluster = builder.build(cargo_tools!())?;
    for (svc, backends) in services {
        cluster.publish(svc, backends)?;
    }
    cluster.start_agents(&lb, agent_args)?;
    Ok(cluster)
}

fn no_args(_: usize) -> Vec<String> {
    Vec::new()
}

/// 10 connections from the external client to `np` are all answered by `pod`, which
/// sees them from `source`; the client keeps its port and sees `np` as its peer.
fn answers_from(cluster: &Cluster, np: SocketAddrV4, pod: &str, source: Ipv4Addr) -> Result<()> {
    cluster
        .expect_answers(cluster.client(), np, 10, &[(pod, source.into())], true)
        .map(drop)
}

fn set(items: &[Ipv4Addr]) -> BTreeSet<IpAddr> {
    items.iter().map(|&ip| IpAddr::V4(ip)).collect()
}

/// (1) NodePort on node1 whose only endpoint is local (pod-a): pod-a answers and sees
/// the external client's own address (no SNAT for a local backend); the client sees
/// the NodePort as its peer.
#[test]
fn node_port_to_local_backend_keeps_client_ip() -> Result<()> {
    let svc = whoami_node_port("local", Ipv4Addr::new(10, 96, 0, 30), 30080);
    let cluster = setup(two_backends(), &[(&svc, &["pod-a"])], no_args)?;
    let np = SocketAddrV4::new(node1_ip(), 30080);
    cluster.wait_frontend(
        0,
        np,
        "TCP",
        "internal",
        &pod_addrs(&cluster, &["pod-a"], WHOAMI_PORT)?,
    )?;

    answers_from(&cluster, np, "pod-a", CLIENT_IP)?;
    Ok(())
}

/// (2) NodePort on node1 whose only endpoint is on node2 (pod-b): node1 SNATs to its
/// own address (keeping the client's port, which is free), pod-b answers, and the
/// reply is reverse-translated on its way back through node1.
#[test]
fn node_port_to_remote_backend_snats_to_node_ip() -> Result<()> {
    let svc = whoami_node_port("remote", Ipv4Addr::new(10, 96, 0, 31), 30081);
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])], no_args)?;
    let np = SocketAddrV4::new(node1_ip(), 30081);
    cluster.wait_frontend(
        0,
        np,
        "TCP",
        "internal",
        &pod_addrs(&cluster, &["pod-b"], WHOAMI_PORT)?,
    )?;

    answers_from(&cluster, np, "pod-b", node1_ip())?;
    Ok(())
}

/// (3) externalTrafficPolicy: Local with the only endpoint on node1: via node1 the
/// client's address is kept; via node2, which has no local endpoint, the SYN is
/// dropped (the connect times out) and counted as tc_no_backend.
#[test]
fn external_traffic_policy_local_keeps_client_ip_or_drops() -> Result<()> {
    let svc = whoami_node_port("etp-local", Ipv4Addr::new(10, 96, 0, 32), 30082).external_local();
    let cluster = setup(two_backends(), &[(&svc, &["pod-a"])], no_args)?;
    let pod_a = pod_addrs(&cluster, &["pod-a"], WHOAMI_PORT)?;
    let via1 = SocketAddrV4::new(node1_ip(), 30082);
    let via2 = SocketAddrV4::new(node2_ip(), 30082);
    cluster.wait_frontend(0, via1, "TCP", "external", &pod_a)?;
    cluster.wait_frontend(1, via2, "TCP", "external", &[] as &[SocketAddrV4])?;
    // Traffic from inside the cluster still gets every endpoint.
    cluster.wait_frontend(1, via2, "TCP", "internal", &pod_a)?;

    let r = cluster.whoami(cluster.client(), via1, 10, false, CONNECT_TIMEOUT)?;
    let stats = cluster.all_stats();
    ensure!(
        r.tally.answered == 10 && r.tally.errors.is_empty(),
        "via node1: {r:#?}\n{stats}"
    );
    ensure!(r.tally.names() == ["pod-a"].into(), "via node1: {r:#?}");
    ensure!(
        r.seen_ips("pod-a") == set(&[CLIENT_IP]),
        "via node1 pod-a must see the client's own address: {r:#?}"
    );

    let dropped_before = cluster.stat(1, "tc_no_backend")?;
    let r = cluster.whoami(cluster.client(), via2, 3, false, DROP_CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.errors_of("ETIMEDOUT") == 3,
        "via node2 (no local endpoint) the connection must be dropped: {r:#?}\n{}",
        cluster.all_stats()
    );
    let dropped = cluster.stat(1, "tc_no_backend")? - dropped_before;
    // Each connect sends its SYN at least once.
    ensure!(
        dropped >= 3,
        "node2 dropped {dropped} packets as tc_no_backend, expected >= 3\n{}",
        cluster.all_stats()
    );
    Ok(())
}

/// (4) An externalIP and a LoadBalancer ingress IP (both routed to node1 by the
/// client) reach both backends: the local one sees the client, the remote one node1.
#[test]
fn external_ip_and_load_balancer_ip_reach_backends() -> Result<()> {
    let external_ip = Ipv4Addr::new(192, 168, 50, 200);
    let lb_ip = Ipv4Addr::new(192, 168, 50, 201);
    let svc = Service::new(
        "ingress",
        Ipv4Addr::new(10, 96, 0, 33),
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30083)],
    )
    .load_balancer([lb_ip])
    .with_external_ips([external_ip]);
    let builder = two_backends()
        .client_route_via_node1(external_ip)
        .client_route_via_node1(lb_ip);
    let cluster = setup(builder, &[(&svc, &["pod-a", "pod-b"])], no_args)?;
    let both = pod_addrs(&cluster, &["pod-a", "pod-b"], WHOAMI_PORT)?;

    for ip in [external_ip, lb_ip] {
        let to = SocketAddrV4::new(ip, 80);
        cluster.wait_frontend(0, to, "TCP", "internal", &both)?;
        // 40 independent choices: missing a backend has probability 2 * 2^-40.
        let expect = [("pod-a", CLIENT_IP.into()), ("pod-b", node1_ip().into())];
        cluster.expect_answers(cluster.client(), to, 40, &expect, false)?;
    }
    Ok(())
}

/// (5) 16 MiB each way through a NodePort, to the remote backend (SNAT, reverse NAT
/// on node1's uplink) and to the local one: every byte comes back unchanged (so the
/// incremental checksum updates hold on large, segmented traffic).
#[test]
fn bulk_transfer_through_node_port_is_byte_exact() -> Result<()> {
    const BYTES: u64 = 16 << 20;
    let bulk = bulk_node_port;
    let remote = bulk("bulk-remote", Ipv4Addr::new(10, 96, 0, 34), 30084);
    let local = bulk("bulk-local", Ipv4Addr::new(10, 96, 0, 35), 30085);
    let cluster = setup(
        two_backends(),
        &[(&remote, &["pod-b"]), (&local, &["pod-a"])],
        no_args,
    )?;

    for (node_port, pod, seed) in [(30084, "pod-b", 1), (30085, "pod-a", 2)] {
        let to = SocketAddrV4::new(node1_ip(), node_port);
        cluster.wait_frontend(
            0,
            to,
            "TCP",
            "internal",
            &pod_addrs(&cluster, &[pod], BULK_PORT)?,
        )?;
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

/// (6) A pod on node1 that no socket hook sees (in no hooked cgroup) reaches a
/// ClusterIP through the TC path on its veth: both backends answer, both see the
/// pod's own address (kube-proxy masquerades cluster-IP traffic only from outside
/// the cluster; no pod CIDR is known here, so "inside" is "from a pod's device"),
/// the remote one's replies are translated back on node1, and the client only
/// ever sees the VIP.
#[test]
fn cluster_ip_from_unhooked_pod_goes_through_tc() -> Result<()> {
    let vip = Ipv4Addr::new(10, 96, 0, 20);
    let svc = Service::new(
        "web",
        vip,
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into())],
    );
    let builder = two_backends().client_pod("client", 0);
    let cluster = setup(builder, &[(&svc, &["pod-a", "pod-b"])], no_args)?;
    let to = SocketAddrV4::new(vip, 80);
    wait_for_both(&cluster, to)?;
    let client = cluster.pod("client")?;

    let expect = [("pod-a", client.ip().into()), ("pod-b", client.ip().into())];
    cluster.expect_answers(client.netns(), to, 40, &expect, true)?;
    let stats = cluster.all_stats();
    // The socket hooks played no part: node1's counters show only TC translations.
    ensure!(
        cluster.stat(0, "translated")? == 0 && cluster.stat(0, "tc_new_flow")? >= 40,
        "{stats}"
    );
    Ok(())
}

/// Until node1's agent has `to` with pod-a and pod-b behind it.
fn wait_for_both(cluster: &Cluster, to: SocketAddrV4) -> Result<()> {
    let backends = pod_addrs(cluster, &["pod-a", "pod-b"], WHOAMI_PORT)?;
    cluster
        .wait_frontend(0, to, "TCP", "internal", &backends)
        .map(drop)
}

/// The Service of (6b) and (6c): pod-a (node1) and pod-b (node2) behind a cluster
/// IP the external client reaches through node1, and the Nodes with their pod
/// CIDRs among the manifests, as the API server would give them.
fn cluster_ip_rules(agent_args: fn(usize) -> Vec<String>) -> Result<(Cluster, SocketAddrV4)> {
    let vip = Ipv4Addr::new(10, 96, 0, 21);
    let svc = Service::new(
        "web",
        vip,
        vec![ServicePort::tcp("whoami", 80, WHOAMI_PORT.into())],
    );
    let builder = two_backends()
        .client_pod("client", 0)
        .client_route_via_node1(vip);
    let lb = lb_binary()?;
    let mut cluster = builder.build(cargo_tools!())?;
    cluster.manifests.write(
        "nodes.yaml",
        &documents([
            node_yaml_with_pod_cidrs(&node_name(0), &[&pod_cidr(0)]),
            node_yaml_with_pod_cidrs(&node_name(1), &[&pod_cidr(1)]),
        ]),
    )?;
    cluster.publish(&svc, &["pod-a", "pod-b"])?;
    cluster.start_agents(&lb, agent_args)?;
    let to = SocketAddrV4::new(vip, 80);
    wait_for_both(&cluster, to)?;
    Ok((cluster, to))
}

/// (6b) kube-proxy's cluster-IP masquerade rules with the pod CIDRs known (the
/// Nodes' spec.podCIDRs): a pod keeps its address towards both backends; the
/// external client, outside every pod CIDR, gets node1's address towards both,
/// the local backend included; and a pod that reaches itself through the Service
/// (hairpin) arrives from node1's address, or its own reply would never leave it.
#[test]
fn cluster_ip_traffic_is_masqueraded_only_from_outside_the_pod_cidrs_and_on_hairpin() -> Result<()>
{
    let (cluster, to) = cluster_ip_rules(no_args)?;
    let client = cluster.pod("client")?;
    let inside = client.ip().into();
    cluster.expect_answers(
        client.netns(),
        to,
        30,
        &[("pod-a", inside), ("pod-b", inside)],
        true,
    )?;
    // The node's address is the one its routing uses towards the backend, as
    // MASQUERADE picks it: node1's on the pods' bridge for pod-a.
    let (node1, towards_pod_a) = (node1_ip().into(), pod_gateway(0).into());
    let expect = [("pod-a", towards_pod_a), ("pod-b", node1)];
    cluster.expect_answers(cluster.client(), to, 30, &expect, false)?;
    // pod-a as the client: the flows to itself come from node1, the ones to pod-b
    // keep pod-a's address.
    let pod_a = cluster.pod("pod-a")?;
    let expect = [("pod-a", towards_pod_a), ("pod-b", pod_a.ip().into())];
    cluster.expect_answers(pod_a.netns(), to, 30, &expect, false)?;
    Ok(())
}

/// (6c) `--masquerade-all` (kube-proxy's): every cluster-IP flow the per-packet
/// path takes gets the node's address (the one its routing uses towards the
/// backend), a pod's towards its local backend too.
#[test]
fn masquerade_all_gives_every_cluster_ip_flow_the_node_address() -> Result<()> {
    let (cluster, to) = cluster_ip_rules(|_| vec!["--masquerade-all".into()])?;
    let client = cluster.pod("client")?;
    let expect = [
        ("pod-a", pod_gateway(0).into()),
        ("pod-b", node1_ip().into()),
    ];
    cluster.expect_answers(client.netns(), to, 30, &expect, false)?;
    Ok(())
}

/// (7) `lb conntrack` on node1 lists a NodePort flow to the remote backend while it
/// is open (client, frontend, backend, SNAT address); with a 1 s closing timeout and
/// a 200 ms GC interval the flow is gone soon after the connection closes.
#[test]
fn conntrack_lists_flow_and_collects_it_after_close() -> Result<()> {
    let svc = Service::new(
        "held",
        Ipv4Addr::new(10, 96, 0, 36),
        vec![ServicePort::tcp("echo", 80, lb_tests::ECHO_TCP_PORT.into()).with_node_port(30086)],
    )
    .node_port();
    let ct_args = |node: usize| {
        if node == 0 {
            [
                "--ct-tcp-closing-timeout",
                "1",
                "--ct-gc-interval-ms",
                "200",
            ]
            .map(String::from)
            .to_vec()
        } else {
            Vec::new()
        }
    };
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])], ct_args)?;
    let np = SocketAddrV4::new(node1_ip(), 30086);
    let backend = SocketAddrV4::new(cluster.pod("pod-b")?.ip(), lb_tests::ECHO_TCP_PORT);
    cluster.wait_frontend(0, np, "TCP", "internal", &[backend])?;

    let mut held = cluster
        .hold(cluster.client(), np)
        .with_context(|| cluster.all_stats())?;
    ensure!(held.backend == "pod-b", "greeted by {}", held.backend);
    ensure!(held.echo("ping")? == "pod-b ping");
    let client: std::net::SocketAddr = held
        .local
        .as_deref()
        .context("lb-probe hold did not report its local address")?
        .parse()?;
    ensure!(client.ip() == IpAddr::V4(CLIENT_IP), "{client}");

    let flows = cluster.wait_conntrack(
        0,
        &format!("node1 to list the flow of {client}"),
        Duration::from_secs(5),
        |flows| flows.iter().any(|f| f.client == client),
    )?;
    let flow = flows
        .iter()
        .find(|f| f.client == client)
        .expect("checked by the predicate");
    ensure!(flow.protocol.eq_ignore_ascii_case("TCP"), "{flow:#?}");
    ensure!(flow.frontend == np.into(), "{flow:#?}");
    ensure!(flow.backend == backend.into(), "{flow:#?}");
    ensure!(
        flow.snat == Some(SocketAddrV4::new(node1_ip(), client.port()).into()),
        "SNAT to node1 keeping the client's port expected: {flow:#?}"
    );
    ensure!(flow.state == "ESTABLISHED", "{flow:#?}");

    held.close()?;
    cluster.wait_conntrack(
        0,
        &format!("node1 to collect the closed flow of {client}"),
        Duration::from_secs(10),
        |flows| flows.iter().all(|f| f.client != client),
    )?;
    Ok(())
}

/// (8) UDP through a NodePort to the remote backend: every datagram is answered, the
/// answer comes from the NodePort (reverse NAT), and pod-b saw node1 (SNAT).
#[test]
fn udp_node_port_to_remote_backend() -> Result<()> {
    let svc = Service::new(
        "dns",
        Ipv4Addr::new(10, 96, 0, 37),
        vec![ServicePort::udp("dns", 53, WHOAMI_PORT.into()).with_node_port(30053)],
    )
    .node_port();
    let cluster = setup(two_backends(), &[(&svc, &["pod-b"])], no_args)?;
    let np = SocketAddrV4::new(node1_ip(), 30053);
    cluster.wait_frontend(
        0,
        np,
        "UDP",
        "internal",
        &pod_addrs(&cluster, &["pod-b"], WHOAMI_PORT)?,
    )?;

    let r = cluster.whoami(cluster.client(), np, 10, true, CONNECT_TIMEOUT)?;
    let stats = cluster.all_stats();
    ensure!(
        r.tally.answered == 10 && r.tally.errors.is_empty(),
        "{r:#?}\n{stats}"
    );
    ensure!(r.tally.names() == ["pod-b"].into(), "{r:#?}");
    ensure!(
        r.peers() == [np.to_string().as_str()].into(),
        "answers must come from the NodePort: {r:#?}"
    );
    ensure!(r.seen_ips("pod-b") == set(&[node1_ip()]), "{r:#?}");
    Ok(())
}

/// (9) UDP datagrams larger than the MTU through NodePorts, to a local and to a
/// remote backend: they travel as IP fragments both ways (the client's and the
/// backend's stacks fragment them), every datagram reaches the backend whole and its
/// echo comes back whole, from the NodePort.
#[test]
fn fragmented_udp_through_node_ports_arrives_whole_both_ways() -> Result<()> {
    const SIZE: usize = 4000;
    let service = |name: &str, vip: [u8; 4], node_port: u16| {
        Service::new(
            name,
            Ipv4Addr::from(vip),
            vec![ServicePort::udp("big", 53, BULK_PORT.into()).with_node_port(node_port.into())],
        )
        .node_port()
    };
    let local = service("big-local", [10, 96, 0, 38], 30054);
    let remote = service("big-remote", [10, 96, 0, 39], 30055);
    let cluster = setup(
        two_backends(),
        &[(&local, &["pod-a"]), (&remote, &["pod-b"])],
        no_args,
    )?;
    // Datagrams of SIZE bytes must not fit the client's links, or nothing fragments.
    let links = ip(&["-n", cluster.client().name(), "-o", "link", "show"])?;
    for line in links.lines().filter(|l| !l.contains(" lo:")) {
        let mtu: usize = line
            .split_whitespace()
            .skip_while(|w| *w != "mtu")
            .nth(1)
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("no mtu in {line}"))?;
        ensure!(mtu < SIZE, "the client's link fits {SIZE} bytes: {line}");
    }

    for (node_port, pod) in [(30054, "pod-a"), (30055, "pod-b")] {
        let np = SocketAddrV4::new(node1_ip(), node_port);
        cluster.wait_frontend(
            0,
            np,
            "UDP",
            "internal",
            &pod_addrs(&cluster, &[pod], BULK_PORT)?,
        )?;
        let args: Vec<String> = ["udp-echo", "--to", &np.to_string(), "--count", "5"]
            .into_iter()
            .map(String::from)
            .chain(["--size".to_string(), SIZE.to_string()])
            .collect();
        let r: UdpEchoReport =
            cluster.probe_in(cluster.client(), &args, Duration::from_secs(60))?;
        let stats = cluster.all_stats();
        ensure!(
            r.tally.answered == 5 && r.tally.errors.is_empty(),
            "{SIZE}-byte datagrams to {np} ({pod}): {r:#?}\n{stats}"
        );
        ensure!(r.tally.names() == [pod].into(), "{r:#?}");
        ensure!(
            r.sources == [np.to_string()].into(),
            "answers must come from the NodePort: {r:#?}"
        );
    }
    Ok(())
}

/// The cluster network itself, without agents: pods reach each other across nodes
/// untranslated, and the external client has no route to any pod (so in the tests
/// above only translated traffic can reach a pod). If this fails, the failures above
/// mean nothing.
#[test]
fn cluster_network_routes_pods_and_isolates_the_client() -> Result<()> {
    let cluster = two_backends()
        .client_pod("client", 0)
        .build(cargo_tools!())?;
    let pod_a = cluster.pod("pod-a")?;
    let pod_b = cluster.pod("pod-b")?;
    let client = cluster.pod("client")?;

    // client (node1) -> pod-b (node2): routed by both nodes, source unchanged.
    let to_b = SocketAddrV4::new(pod_b.ip(), WHOAMI_PORT);
    let r = cluster.whoami(client.netns(), to_b, 3, false, CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 3, "{r:#?}");
    ensure!(r.seen_ips("pod-b") == set(&[client.ip()]), "{r:#?}");
    // pod-b -> pod-a, the other way.
    let to_a = SocketAddrV4::new(pod_a.ip(), WHOAMI_PORT);
    let r = cluster.whoami(pod_b.netns(), to_a, 3, true, CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 3, "{r:#?}");
    ensure!(r.seen_ips("pod-a") == set(&[pod_b.ip()]), "{r:#?}");

    // The external client cannot address pods at all.
    for pod in [pod_a, pod_b] {
        let to = SocketAddrV4::new(pod.ip(), WHOAMI_PORT);
        let r = cluster.tcp(cluster.client(), to, 1, DROP_CONNECT_TIMEOUT)?;
        ensure!(r.tally.errors_of("ENETUNREACH") == 1, "{to}: {r:#?}");
    }
    Ok(())
}

/// Dropping a cluster removes its namespaces, cgroups and pin dirs, and leaves no
/// agent running.
#[test]
fn cluster_teardown_removes_everything() -> Result<()> {
    let cluster = setup(two_backends(), &[], no_args)?;
    let base = cluster.base().to_string();
    let mut leftovers = Vec::new();
    for node in cluster.nodes() {
        leftovers.push(node.cgroup().path().to_path_buf());
        leftovers.push(node.agent().pin_dir().to_path_buf());
    }
    leftovers.push(cluster.manifests.path().to_path_buf());
    drop(cluster);
    // Exactly this cluster's names: another test's base may extend this one
    // (lbc-PID-1 vs lbc-PID-12).
    let namespaces = lb_tests::util::ip(&["netns", "list"])?;
    let ours = format!("{base}-");
    let left: Vec<&str> = namespaces
        .lines()
        .filter(|l| l.starts_with(&ours))
        .collect();
    ensure!(left.is_empty(), "namespaces left: {left:?}");
    for path in leftovers {
        ensure!(!path.exists(), "{} left", path.display());
    }
    Ok(())
}

/// `tc filter show dev DEV ingress` inside a namespace.
fn ingress_filters(netns: &str, dev: &str) -> Result<String> {
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", netns, "tc", "filter", "show", "dev", dev, "ingress",
        ])
        .output()?;
    ensure!(out.status.success(), "tc filter show: {out:?}");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The netlink clsact attach (kernels before 6.6 have no TCX): NodePorts work, a
/// second attach swaps the program in lb's filter slot instead of adding a filter,
/// and `lb cleanup` in the node's namespace removes the filter.
#[test]
fn netlink_attach_serves_node_ports_and_is_cleaned_up() -> Result<()> {
    let svc = whoami_node_port("netlink", Ipv4Addr::new(10, 96, 0, 40), 30090);
    let netlink = |_: usize| vec!["--tc-attach".to_string(), "netlink".to_string()];
    let mut cluster = setup(two_backends(), &[(&svc, &["pod-a"])], netlink)?;
    let np = SocketAddrV4::new(node1_ip(), 30090);
    cluster.wait_frontend(
        0,
        np,
        "TCP",
        "internal",
        &pod_addrs(&cluster, &["pod-a"], WHOAMI_PORT)?,
    )?;
    let node_ns = cluster.node(0).netns().name().to_owned();
    let filters = ingress_filters(&node_ns, "eth0")?;
    ensure!(
        filters.matches("name lb_tc_external").count() == 1,
        "one lb filter on eth0: {filters}"
    );

    let r = cluster.whoami(cluster.client(), np, 10, false, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 10 && r.tally.errors.is_empty(),
        "{r:#?}\n{}",
        cluster.all_stats()
    );
    ensure!(r.seen_ips("pod-a") == set(&[CLIENT_IP]), "{r:#?}");

    // A second agent on the same node (a restart) takes over the same slot.
    let lb = lb_binary()?;
    let pin_dir = cluster.node(0).agent().pin_dir().to_owned();
    cluster.node_mut(0).agent_mut().stop()?;
    let nsenter_lb = |args: &[&str]| -> Result<std::process::Output> {
        Ok(std::process::Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{node_ns}"))
            .arg(&lb)
            .args(args)
            .output()?)
    };
    let services = cluster.manifests.path().to_path_buf();
    let second = std::process::Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{node_ns}"))
        .arg(&lb)
        .args(["agent", "--services-file"])
        .arg(&services)
        .args(["--pin-dir"])
        .arg(&pin_dir)
        .args(["--cgroup"])
        .arg(cluster.node(0).cgroup().path())
        .args(["--node-name", &node_name(0)])
        .args(["--tc-attach", "netlink"])
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""])
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut second = KillOnDrop(second);
    let ready = wait_for_line(second.0.stderr.take().unwrap(), "ready and serving");
    ensure!(ready, "second agent never became ready");
    let filters = ingress_filters(&node_ns, "eth0")?;
    ensure!(
        filters.matches("name lb_tc_external").count() == 1,
        "still one lb filter after the restart: {filters}"
    );
    let r = cluster.whoami(cluster.client(), np, 5, false, CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 5, "{r:#?}");
    drop(second);

    let out = nsenter_lb(&["cleanup", "--pin-dir", pin_dir.to_str().unwrap()])?;
    ensure!(out.status.success(), "lb cleanup: {out:?}");
    let filters = ingress_filters(&node_ns, "eth0")?;
    ensure!(
        !filters.contains("lb_tc_"),
        "cleanup left a filter: {filters}"
    );
    Ok(())
}

/// Kills and reaps the child when dropped, also on a failed assertion.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads lines until one contains `needle` or the stream ends (the agent exits); a
/// thread with a deadline keeps a stuck agent from hanging the test.
fn wait_for_line(stream: std::process::ChildStderr, needle: &str) -> bool {
    use std::io::BufRead;
    let needle = needle.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stream)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains(&needle) {
                let _ = tx.send(());
                return;
            }
        }
    });
    rx.recv_timeout(std::time::Duration::from_secs(30)).is_ok()
}

/// `GET /` from inside `netns` (a thread that joins only that network namespace);
/// the status code and body.
fn http_get(netns: &str, to: SocketAddrV4) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let ns = std::fs::File::open(format!("/var/run/netns/{netns}"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<(u16, String)> {
                use std::os::fd::AsRawFd;
                // SAFETY: plain syscall on an open namespace file; only this thread moves.
                ensure!(
                    unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
                    "setns: {}",
                    std::io::Error::last_os_error()
                );
                let mut stream = std::net::TcpStream::connect_timeout(&to.into(), CONNECT_TIMEOUT)?;
                stream.set_read_timeout(Some(CONNECT_TIMEOUT))?;
                stream.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")?;
                let mut text = String::new();
                stream.read_to_string(&mut text)?;
                let code = text
                    .split(' ')
                    .nth(1)
                    .and_then(|c| c.parse().ok())
                    .with_context(|| format!("no status line in {text:?}"))?;
                let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
                Ok((code, body))
            })
            .join()
            .expect("http thread")
    })
}

/// kube-proxy's healthCheckNodePort for externalTrafficPolicy: Local: the node with
/// the endpoint answers 200 and counts it, the other 503, so a load balancer in front
/// of the nodes sends traffic only where it is served.
#[test]
fn health_check_node_port_reports_local_endpoints() -> Result<()> {
    let svc = whoami_node_port("hc", Ipv4Addr::new(10, 96, 0, 41), 30091)
        .external_local()
        .with_health_check_node_port(32091);
    let cluster = setup(two_backends(), &[(&svc, &["pod-a"])], no_args)?;
    let pod_a = pod_addrs(&cluster, &["pod-a"], WHOAMI_PORT)?;
    cluster.wait_frontend(
        0,
        SocketAddrV4::new(node1_ip(), 30091),
        "TCP",
        "external",
        &pod_a,
    )?;
    cluster.wait_frontend(
        1,
        SocketAddrV4::new(node2_ip(), 30091),
        "TCP",
        "external",
        &[] as &[SocketAddrV4],
    )?;
    let client = cluster.client().name().to_owned();

    let (code, body) = http_get(&client, SocketAddrV4::new(node1_ip(), 32091))?;
    ensure!(code == 200, "node1 has pod-a: {code} {body}");
    let json: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(json["localEndpoints"] == 1, "{json}");
    ensure!(json["service"]["name"] == "hc", "{json}");

    let (code, body) = http_get(&client, SocketAddrV4::new(node2_ip(), 32091))?;
    ensure!(code == 503, "node2 has no endpoint: {code} {body}");
    let json: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(json["localEndpoints"] == 0, "{json}");

    // pod-a is terminating (still serving): node1 says 503 so the load balancer
    // stops sending, as kube-proxy counts ready endpoints only, while traffic that
    // still arrives drains to pod-a.
    let draining = cluster
        .endpoint("pod-a")?
        .with_conditions(Conditions::TERMINATING_SERVING);
    cluster.publish_endpoints(&svc, vec![draining])?;
    let healthy = SocketAddrV4::new(node1_ip(), 32091);
    let (code, body) = lb_tests::util::poll(
        "node1's health check to answer 503 for a terminating-only node",
        Duration::from_secs(10),
        || {
            let (code, body) = http_get(&client, healthy)?;
            Ok((code == 503).then_some((code, body)))
        },
    )?;
    let json: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(json["localEndpoints"] == 0, "{code} {json}");
    answers_from(
        &cluster,
        SocketAddrV4::new(node1_ip(), 30091),
        "pod-a",
        CLIENT_IP,
    )?;
    Ok(())
}

/// A NodePort Service without endpoints: a TCP connect is refused at once (a RST
/// from the TC path) and a connected UDP socket gets ECONNREFUSED (an ICMP port
/// unreachable), as kube-proxy's REJECT answers.
#[test]
fn service_without_endpoints_is_refused() -> Result<()> {
    let svc = Service::new(
        "empty",
        Ipv4Addr::new(10, 96, 0, 38),
        vec![
            ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30087),
            ServicePort::udp("dns", 53, WHOAMI_PORT.into()).with_node_port(30087),
        ],
    )
    .node_port();
    let cluster = setup(two_backends(), &[(&svc, &[])], no_args)?;
    let np = SocketAddrV4::new(node1_ip(), 30087);
    cluster.wait_frontend(0, np, "TCP", "internal", &[] as &[SocketAddrV4])?;
    cluster.wait_frontend(0, np, "UDP", "internal", &[] as &[SocketAddrV4])?;

    cluster.expect_refused(np)
}
