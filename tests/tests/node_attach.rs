//! The per-packet path on a node as the DaemonSet runs it: no interface, address or
//! pod named anywhere. Pods are created after the agents are ready and replaced
//! while traffic runs; every Service kind answers from inside and outside the
//! cluster, and `lb cleanup` removes only what the agent attached.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use aya::programs::tc::{self, NlOptions, TcAttachOptions, TcAttachType, TcHandle};
use aya::programs::{links::LinkOrder, SchedClassifier};
use lb_tests::agent::LinkStatus;
use lb_tests::cluster::{node_ip, whoami_node_port, Cluster, Node, Role, CLIENT_IP, WHOAMI_PORT};
use lb_tests::manifests::{Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::util::poll;
use lb_tests::{cargo_tools, lb_binary, ECHO_TCP_PORT};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A device change must reach the datapath within a second (the target);
/// the polls allow for a loaded test machine.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(10);

/// `count` connections from `ns` to `to` are all answered by `pod`, which sees them
/// from `source`.
fn answered(
    cluster: &Cluster,
    ns: &NetNs,
    to: SocketAddrV4,
    pod: &str,
    source: Ipv4Addr,
) -> Result<()> {
    let r = cluster.whoami(ns, to, 5, false, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 5 && r.tally.errors.is_empty(),
        "{} -> {to}: {r:#?}\n{}",
        ns.name(),
        cluster.all_stats()
    );
    ensure!(r.tally.names() == [pod].into(), "{to}: {r:#?}");
    ensure!(
        r.seen_ips(pod) == [std::net::IpAddr::V4(source)].into(),
        "{to}: {pod} must see {source}: {r:#?}"
    );
    ensure!(
        r.peers() == [to.to_string().as_str()].into(),
        "{to}: {r:#?}"
    );
    Ok(())
}

/// Names of the TCX ingress programs on `dev` in `ns`, as the kernel lists them.
fn tcx_programs(ns: &NetNs, dev: &str) -> Result<Vec<String>> {
    ns.run_in(|| {
        let (_, programs) = SchedClassifier::query_tcx(dev, TcAttachType::Ingress)
            .with_context(|| format!("querying the TCX programs of {dev}"))?;
        Ok(programs
            .iter()
            .map(|p| p.name_as_str().unwrap_or("?").to_string())
            .collect())
    })
}

/// `tc filter show dev DEV ingress` in `ns`.
fn ingress_filters(ns: &NetNs, dev: &str) -> Result<String> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", ns.path().display()))
        .args(["tc", "filter", "show", "dev", dev, "ingress"])
        .output()?;
    ensure!(out.status.success(), "tc filter show: {out:?}");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn link<'a>(links: &'a [LinkStatus], name: &str) -> Option<&'a LinkStatus> {
    links.iter().find(|l| l.name == name)
}

/// Wait until node `node`'s `lb status` lists `dev` with `role`/`reason` at an
/// ifindex other than `not_ifindex`; returns it.
fn wait_link(
    cluster: &Cluster,
    node: usize,
    dev: &str,
    role: &str,
    reason: &str,
    not_ifindex: Option<u32>,
) -> Result<LinkStatus> {
    let agent = cluster.node(node).agent();
    let mut last = Vec::new();
    poll(&format!("{dev} in lb status"), DEVICE_TIMEOUT, || {
        last = agent.status_links()?;
        Ok(link(&last, dev)
            .filter(|l| l.role == role && l.reason == reason && Some(l.ifindex) != not_ifindex)
            .cloned())
    })
    .with_context(|| format!("lb status: {last:#?}"))
}

/// Every case the issue lists, with every pod created after the agents are ready
/// and the agents given no interface, address or pod: an external client to a
/// NodePort with a local backend (client IP kept), a remote backend (SNAT to the
/// node), ETP Local, a LoadBalancer IP and an externalIP; a pod to its own node's
/// NodePort (hairpin) and to the other node's; a host-network process to its node's
/// NodePort. A held connection survives an unrelated pod coming and going, and a
/// pod deleted and created again (a new veth under the same name) gets the program
/// back and serves ETP Local traffic.
#[test]
fn every_service_kind_answers_on_pods_created_after_the_agents() -> Result<()> {
    let lb = lb_binary()?;
    let lb_ip = Ipv4Addr::new(192, 168, 50, 210);
    let external_ip = Ipv4Addr::new(192, 168, 50, 211);
    let mut cluster = Cluster::builder()
        .client_route_via_node1(lb_ip)
        .client_route_via_node1(external_ip)
        .build(cargo_tools!())?;
    cluster.start_agents(&lb, |_| Vec::new())?;
    // The uplink carries the node's address; nothing else exists yet but the bridge.
    for node in 0..2 {
        wait_link(&cluster, node, "eth0", "node-facing", "auto", None)?;
    }
    cluster.add_pod("pod-a", 0, Role::Backend)?;
    cluster.add_pod("pod-b", 1, Role::Backend)?;
    cluster.add_pod("client", 0, Role::Client)?;

    let local = whoami_node_port("local", Ipv4Addr::new(10, 96, 1, 1), 30201);
    let remote = whoami_node_port("remote", Ipv4Addr::new(10, 96, 1, 2), 30202);
    let etp = whoami_node_port("etp", Ipv4Addr::new(10, 96, 1, 3), 30203).external_local();
    let ingress = whoami_node_port("ingress", Ipv4Addr::new(10, 96, 1, 4), 30204)
        .load_balancer([lb_ip])
        .with_external_ips([external_ip]);
    let echo = Service::new(
        "echo",
        Ipv4Addr::new(10, 96, 1, 5),
        vec![ServicePort::tcp("echo", 7, ECHO_TCP_PORT.into()).with_node_port(30205)],
    )
    .node_port();
    for (svc, backends) in [
        (&local, ["pod-a"]),
        (&remote, ["pod-b"]),
        (&etp, ["pod-a"]),
        (&ingress, ["pod-a"]),
        (&echo, ["pod-a"]),
    ] {
        cluster.publish(svc, &backends)?;
    }
    let pod_a = SocketAddrV4::new(cluster.pod("pod-a")?.ip(), WHOAMI_PORT);
    let pod_b = SocketAddrV4::new(cluster.pod("pod-b")?.ip(), WHOAMI_PORT);
    let (n1, n2) = (node_ip(0), node_ip(1));
    cluster.wait_frontend(0, SocketAddrV4::new(n1, 30201), "TCP", "internal", &[pod_a])?;
    cluster.wait_frontend(0, SocketAddrV4::new(n1, 30202), "TCP", "internal", &[pod_b])?;
    cluster.wait_frontend(0, SocketAddrV4::new(n1, 30203), "TCP", "external", &[pod_a])?;
    cluster.wait_frontend(0, SocketAddrV4::new(lb_ip, 80), "TCP", "internal", &[pod_a])?;
    cluster.wait_frontend(1, SocketAddrV4::new(n2, 30201), "TCP", "internal", &[pod_a])?;
    cluster.wait_frontend(1, SocketAddrV4::new(n2, 30202), "TCP", "internal", &[pod_b])?;
    // The pods' veths are found as they appear.
    wait_link(
        &cluster,
        0,
        &Node::pod_iface("pod-a"),
        "pod-facing",
        "auto",
        None,
    )?;
    wait_link(
        &cluster,
        1,
        &Node::pod_iface("pod-b"),
        "pod-facing",
        "auto",
        None,
    )?;
    wait_link(
        &cluster,
        0,
        &Node::pod_iface("client"),
        "pod-facing",
        "auto",
        None,
    )?;

    let ext = cluster.client();
    answered(
        &cluster,
        ext,
        SocketAddrV4::new(n1, 30201),
        "pod-a",
        CLIENT_IP,
    )?;
    answered(&cluster, ext, SocketAddrV4::new(n1, 30202), "pod-b", n1)?;
    answered(
        &cluster,
        ext,
        SocketAddrV4::new(n1, 30203),
        "pod-a",
        CLIENT_IP,
    )?;
    answered(
        &cluster,
        ext,
        SocketAddrV4::new(lb_ip, 80),
        "pod-a",
        CLIENT_IP,
    )?;
    answered(
        &cluster,
        ext,
        SocketAddrV4::new(external_ip, 80),
        "pod-a",
        CLIENT_IP,
    )?;

    let client_pod = cluster.pod("client")?;
    let client_ip = client_pod.ip();
    let pod_ns = client_pod.netns();
    // Hairpin: a pod to its own node's NodePort, local and remote backend.
    answered(
        &cluster,
        pod_ns,
        SocketAddrV4::new(n1, 30201),
        "pod-a",
        client_ip,
    )?;
    answered(&cluster, pod_ns, SocketAddrV4::new(n1, 30202), "pod-b", n1)?;
    // A pod to the other node's NodePort: node2 translates it.
    answered(
        &cluster,
        pod_ns,
        SocketAddrV4::new(n2, 30202),
        "pod-b",
        client_ip,
    )?;
    answered(&cluster, pod_ns, SocketAddrV4::new(n2, 30201), "pod-a", n2)?;
    // A host-network process to its node's own address: the socket hooks.
    let r = cluster.host_whoami(0, SocketAddrV4::new(n1, 30201), 5)?;
    ensure!(
        r.tally.answered == 5 && r.tally.names() == ["pod-a"].into(),
        "host process -> {n1}:30201: {r:#?}"
    );

    // An established connection is not disturbed by pods coming and going.
    let mut held = cluster.hold(cluster.client(), SocketAddrV4::new(n1, 30205))?;
    ensure!(held.backend == "pod-a", "held by {}", held.backend);
    cluster.add_pod("pod-c", 0, Role::Backend)?;
    wait_link(
        &cluster,
        0,
        &Node::pod_iface("pod-c"),
        "pod-facing",
        "auto",
        None,
    )?;
    ensure!(
        held.echo("one")? == "pod-a one",
        "held connection after a pod came"
    );
    cluster.remove_pod("pod-c")?;
    poll("pod-c's veth to leave lb status", DEVICE_TIMEOUT, || {
        let links = cluster.node(0).agent().status_links()?;
        Ok(link(&links, &Node::pod_iface("pod-c"))
            .is_none()
            .then_some(()))
    })?;
    ensure!(
        held.echo("two")? == "pod-a two",
        "held connection after a pod went"
    );
    held.close()?;

    // pod-a deleted and created again (as a Deployment's pod would be, with a new
    // address): a new veth under the same name, at a new ifindex, gets the
    // pod-facing program back, and ETP Local replies (which only that program
    // reverse-translates) reach the client again.
    let before = wait_link(&cluster, 0, "vpod-a", "pod-facing", "auto", None)?;
    cluster.remove_pod("pod-a")?;
    cluster.add_pod("pod-a", 0, Role::Backend)?;
    cluster.publish(&etp, &["pod-a"])?;
    let new_a = SocketAddrV4::new(cluster.pod("pod-a")?.ip(), WHOAMI_PORT);
    ensure!(new_a != pod_a, "pod-a has a new address");
    cluster.wait_frontend(0, SocketAddrV4::new(n1, 30203), "TCP", "external", &[new_a])?;
    let after = wait_link(
        &cluster,
        0,
        "vpod-a",
        "pod-facing",
        "auto",
        Some(before.ifindex),
    )?;
    let node1 = cluster.node(0).netns();
    let programs = tcx_programs(node1, "vpod-a")?;
    ensure!(
        programs == ["lb_tc_internal"],
        "the re-created vpod-a (ifindex {}) has {programs:?}",
        after.ifindex
    );
    answered(
        &cluster,
        cluster.client(),
        SocketAddrV4::new(n1, 30203),
        "pod-a",
        CLIENT_IP,
    )?;
    Ok(())
}

/// `lb status` says why: `auto` for what the agent found, `flag` for a device named
/// by `--pod-iface`/`--iface`.
#[test]
fn status_tells_found_devices_from_flagged_ones() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = Cluster::builder()
        .backend("pod-a", 0)
        .client_pod("client", 0)
        .build(cargo_tools!())?;
    cluster.start_agents(&lb, |node| {
        if node == 0 {
            vec![
                "--pod-iface".into(),
                "vclient".into(),
                "--iface".into(),
                "br0".into(),
            ]
        } else {
            Vec::new()
        }
    })?;
    let links = cluster.node(0).agent().status_links()?;
    let want = |dev: &str, role: &str, reason: &str| -> Result<()> {
        let l = link(&links, dev).with_context(|| format!("{dev} missing: {links:#?}"))?;
        ensure!(
            l.role == role && l.reason == reason && l.mode == "tcx",
            "{dev}: {l:?}"
        );
        Ok(())
    };
    want("eth0", "node-facing", "auto")?;
    want("br0", "node-facing", "flag")?;
    want("vpod-a", "pod-facing", "auto")?;
    want("vclient", "pod-facing", "flag")?;
    ensure!(
        link(&links, "lo").is_none(),
        "loopback is never attached: {links:#?}"
    );
    let text = cluster.node(0).agent().lb_command(&["status"])?;
    ensure!(
        text.lines()
            .any(|l| l.contains("vclient") && l.contains("flag")),
        "{text}"
    );
    Ok(())
}

/// A program another owner attached (same program name, even) stays through `lb
/// cleanup`: a TCX program on a pod veth and a netlink filter at another priority
/// on the uplink; lb's own filter and links go.
#[test]
fn cleanup_detaches_only_what_the_agent_attached() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = Cluster::builder()
        .backend("pod-a", 0)
        .build(cargo_tools!())?;
    cluster.start_agents(&lb, |_| vec!["--tc-attach".into(), "netlink".into()])?;
    let node1 = cluster.node(0).netns();
    ensure!(
        ingress_filters(node1, "eth0")?.contains("lb_tc_external"),
        "the agent's filter on eth0"
    );

    // The kernel object `cargo xtask test` built (and embedded in lb).
    let object_path = option_env!("LB_EBPF_OBJECT")
        .context("built without LB_EBPF_OBJECT: run through `cargo xtask test`")?;
    let object = std::fs::read(object_path).with_context(|| format!("reading {object_path}"))?;
    // The foreign owner's attachments live as long as this value.
    let foreign = node1.run_in(move || {
        let mut ebpf = aya::EbpfLoader::new().load(&object)?;
        let prog: &mut SchedClassifier = ebpf
            .program_mut("lb_tc_internal")
            .context("program")?
            .try_into()?;
        prog.load()?;
        prog.attach_with_options(
            "vpod-a",
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )?;
        let _ = tc::qdisc_add_clsact("eth0");
        prog.attach_with_options(
            "eth0",
            TcAttachType::Ingress,
            TcAttachOptions::Netlink(NlOptions {
                priority: 7,
                handle: TcHandle::new(0, 7),
                ..NlOptions::default()
            }),
        )?;
        Ok(ebpf)
    })?;
    ensure!(
        tcx_programs(node1, "vpod-a")?.len() == 1,
        "the agent attached netlink filters, so the only TCX program is the foreign one"
    );

    // lb cleanup where the agent ran: netlink filters are found by device name,
    // which only means something in the agent's network namespace. The agent stops
    // first: cleanup refuses to pull the maps from under a running one.
    let pin_dir = cluster.node(0).agent().pin_dir().to_owned();
    cluster.node_mut(0).agent_mut().stop()?;
    let node1 = cluster.node(0).netns();
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", node1.path().display()))
        .arg(&lb)
        .args(["cleanup", "--pin-dir"])
        .arg(&pin_dir)
        .output()?;
    ensure!(out.status.success(), "lb cleanup: {out:?}");
    let filters = ingress_filters(node1, "eth0")?;
    ensure!(
        !filters.contains("lb_tc_external"),
        "lb cleanup left its own filter: {filters}"
    );
    ensure!(
        filters.contains("pref 7") && filters.contains("lb_tc_internal"),
        "lb cleanup removed the foreign filter: {filters}"
    );
    ensure!(
        !ingress_filters(node1, "vpod-a")?.contains("lb_tc_"),
        "lb cleanup left its filter on vpod-a"
    );
    let on_veth = tcx_programs(node1, "vpod-a")?;
    ensure!(
        on_veth == ["lb_tc_internal"],
        "lb cleanup removed the foreign TCX program: {on_veth:?}"
    );
    drop(foreign);
    Ok(())
}

/// NodePorts follow the node's addresses: one added to the uplink is served (and
/// answers) within the sync timeout, and dropped when the address goes;
/// `--nodeport-addresses` narrows the set as kube-proxy's flag does.
#[test]
fn node_ports_follow_the_nodes_addresses() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = Cluster::builder()
        .backend("pod-a", 0)
        .build(cargo_tools!())?;
    let svc = whoami_node_port("addr", Ipv4Addr::new(10, 96, 1, 20), 30220);
    cluster.publish(&svc, &["pod-a"])?;
    cluster.start_agents(&lb, |node| {
        if node == 1 {
            vec!["--nodeport-addresses".into(), "192.168.50.0/24".into()]
        } else {
            Vec::new()
        }
    })?;
    let pod_a = SocketAddrV4::new(cluster.pod("pod-a")?.ip(), WHOAMI_PORT);
    // Default: every address of the node, the pod bridge's included.
    cluster.wait_frontend(
        0,
        SocketAddrV4::new(node_ip(0), 30220),
        "TCP",
        "internal",
        &[pod_a],
    )?;
    let bridge1 = lb_tests::cluster::pod_gateway(0);
    cluster.wait_frontend(
        0,
        SocketAddrV4::new(bridge1, 30220),
        "TCP",
        "internal",
        &[pod_a],
    )?;
    // Narrowed to the node network on node2.
    cluster.wait_frontend(
        1,
        SocketAddrV4::new(node_ip(1), 30220),
        "TCP",
        "internal",
        &[pod_a],
    )?;
    let on_node2 = cluster.node(1).agent().services_json()?;
    let bridge2 = lb_tests::cluster::pod_gateway(1);
    ensure!(
        !on_node2.iter().any(|e| e.frontend.ip == bridge2),
        "--nodeport-addresses 192.168.50.0/24 must leave {bridge2} out: {on_node2:#?}"
    );

    let extra = Ipv4Addr::new(192, 168, 50, 51);
    let node1 = cluster.node(0).netns();
    node1.ip(&["addr", "add", &format!("{extra}/32"), "dev", "eth0"])?;
    let np = SocketAddrV4::new(extra, 30220);
    cluster.wait_frontend(0, np, "TCP", "internal", &[pod_a])?;
    answered(&cluster, cluster.client(), np, "pod-a", CLIENT_IP)?;
    node1.ip(&["addr", "del", &format!("{extra}/32"), "dev", "eth0"])?;
    cluster.node(0).agent().wait_services(
        &format!("{np} to be dropped with its address"),
        DEVICE_TIMEOUT,
        |entries| !entries.iter().any(|e| e.frontend.ip == extra),
    )?;
    Ok(())
}
