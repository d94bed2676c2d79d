//! Egress masquerading end to end (`lb agent --masquerade bpf`), on the two-node
//! cluster of `lb_tests::cluster` with its host outside the cluster: reached only
//! through node1's second uplink `up1`, routing only to the node network, so a
//! packet from a pod address reaching it cannot be answered (as on the internet
//! behind a cloud's network). The Nodes' pod CIDRs come from Node objects among
//! the manifests, as the API server would give them.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

mod masq_support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    node_ip, node_ip6, Cluster, ClusterBuilder, DROP_CONNECT_TIMEOUT, OUTSIDE_GATEWAY,
    OUTSIDE_GATEWAY6, OUTSIDE_IP, OUTSIDE_IP6, WHOAMI_PORT,
};
use lb_tests::manifests::{documents, node_yaml_with_pod_cidrs, Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::process::Spawner;
use lb_tests::util::poll;
use lb_tests::{cargo_tools, lb_binary};
use masq_support::{PeerEcho, Stream, IO_TIMEOUT};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const CONFIG: &str = "ip-masq-agent.yaml";

fn cluster() -> Result<Cluster> {
    with_pod_cidrs(
        Cluster::builder()
            .client_pod("client", 0)
            .backend("pod-a", 0)
            .backend("pod-b", 1)
            .client_pod("client2", 1)
            .outside_host(),
    )
}

/// The cluster `builder` describes, with the Nodes' pod CIDRs among its manifests.
fn with_pod_cidrs(builder: ClusterBuilder) -> Result<Cluster> {
    let cluster = builder.build(cargo_tools!())?;
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

/// The agents' flags for masquerading with the defaults (no ip-masq-agent file).
fn masquerade_args() -> Vec<String> {
    vec!["--masquerade".into(), "bpf".into()]
}

/// The address `pod` uses towards `to`'s family.
fn pod_address(cluster: &Cluster, pod: &str, to: IpAddr) -> Result<IpAddr> {
    let pod = cluster.pod(pod)?;
    Ok(match to {
        IpAddr::V4(_) => pod.ip().into(),
        IpAddr::V6(_) => pod.ip6().context("pod without IPv6")?.into(),
    })
}

/// ICMP and ICMPv6 echo requests arriving in a namespace, read from raw sockets
/// there (the kernel gives a raw socket a copy of every packet of its protocol
/// that the host receives): each request's source, as that host saw it.
struct EchoRequests {
    seen: Arc<Mutex<Vec<IpAddr>>>,
    stop: Arc<AtomicBool>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl EchoRequests {
    fn listen(ns: &NetNs) -> Result<EchoRequests> {
        use socket2::{Domain, Protocol, Socket, Type};
        let sockets = ns.run_in(|| {
            let v4 = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))?;
            let v6 = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
            Ok([(v4, false), (v6, true)])
        })?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::new();
        for (socket, v6) in sockets {
            socket.set_read_timeout(Some(Duration::from_millis(100)))?;
            // recvfrom on a raw socket as on any datagram socket: std's UdpSocket
            // reads the source address (the "port" is 0) with no unsafe code here.
            let socket = std::net::UdpSocket::from(socket);
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            readers.push(std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    if is_echo_request(&buf[..n], v6) {
                        seen.lock().expect("not poisoned").push(from.ip());
                    }
                }
            }));
        }
        Ok(EchoRequests {
            seen,
            stop,
            readers,
        })
    }

    /// The sources of the requests seen since the last call; waits (bounded)
    /// until there are at least `count`.
    fn take(&self, count: usize) -> Result<Vec<IpAddr>> {
        poll(
            &format!("{count} echo requests at the outside host"),
            Duration::from_secs(5),
            || {
                let seen = self.seen.lock().expect("not poisoned");
                Ok((seen.len() >= count).then_some(()))
            },
        )
        .with_context(|| format!("seen: {:?}", self.seen.lock().expect("not poisoned")))?;
        Ok(std::mem::take(
            &mut *self.seen.lock().expect("not poisoned"),
        ))
    }
}

impl Drop for EchoRequests {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

/// Whether a raw socket's datagram is an echo request: an IPv4 packet (raw IPv4
/// sockets get the IP header) or an ICMPv6 message (raw IPv6 sockets do not).
fn is_echo_request(datagram: &[u8], v6: bool) -> bool {
    use etherparse::{Icmpv4Slice, Icmpv4Type, Icmpv6Slice, Icmpv6Type, Ipv4Slice};
    if v6 {
        return Icmpv6Slice::from_slice(datagram)
            .is_ok_and(|m| matches!(m.icmp_type(), Icmpv6Type::EchoRequest(_)));
    }
    let Ok(ip) = Ipv4Slice::from_slice(datagram) else {
        return false;
    };
    Icmpv4Slice::from_slice(ip.payload().payload)
        .is_ok_and(|m| matches!(m.icmp_type(), Icmpv4Type::EchoRequest(_)))
}

/// `ping -c COUNT TO` in `ns` (iputils, as a user runs it): replies received.
fn ping(ns: &NetNs, to: IpAddr, count: u32) -> Result<u32> {
    let out = Spawner::new("ping")
        .label(format!("ping {to} in {}", ns.name()))
        .netns(ns)?
        .args(["-n", "-c", &count.to_string(), "-i", "0.2", "-W", "2"])
        .arg(to.to_string())
        .output(Duration::from_secs(30))
        .context("running ping (Debian: iputils-ping; `cargo xtask setup` installs it)")?;
    // "3 packets transmitted, 3 received, 0% packet loss, time 401ms"
    let received = out
        .stdout
        .lines()
        .find_map(|l| {
            let (_, rest) = l.split_once("packets transmitted, ")?;
            rest.split_once(" received")?.0.parse().ok()
        })
        .with_context(|| {
            format!(
                "no summary in ping's output:\n{}\n{}",
                out.stdout, out.stderr
            )
        })?;
    Ok(received)
}

/// Ping from pods: the outside host answers every request, and every request it
/// got came from the pod's node (node1's address on the link to it; node2's
/// pod as node2, routed on by node1 untouched), never from the pod.
#[test]
fn ping_from_pods_reaches_the_outside_as_their_node() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = cluster()?;
    cluster.start_agents(&lb, |_| masquerade_args())?;
    let requests = EchoRequests::listen(cluster.outside().netns())?;
    let cases: [(&str, IpAddr, IpAddr); 4] = [
        ("client", OUTSIDE_IP.into(), OUTSIDE_GATEWAY.into()),
        ("client", OUTSIDE_IP6.into(), OUTSIDE_GATEWAY6.into()),
        ("client2", OUTSIDE_IP.into(), node_ip(1).into()),
        ("client2", OUTSIDE_IP6.into(), node_ip6(1).into()),
    ];
    for (pod, to, node) in cases {
        let replies = ping(cluster.pod(pod)?.netns(), to, 3)?;
        ensure!(
            replies == 3,
            "ping {to} from {pod}: {replies} of 3 replies\n{}",
            cluster.all_stats()
        );
        let sources: BTreeSet<IpAddr> = requests.take(3)?.into_iter().collect();
        ensure!(
            sources == BTreeSet::from([node]),
            "ping {to} from {pod} ({}): the outside saw requests from {sources:?}, not only {node}",
            pod_address(&cluster, pod, to)?
        );
    }
    // Echo was masqueraded by lb (by identifier), on both nodes.
    for node in 0..2 {
        ensure!(
            cluster.stat(node, "masq_new_flow")? >= 2,
            "{}",
            cluster.all_stats()
        );
    }
    Ok(())
}

/// The host beyond a router ([`far_host`]): the outside host forwards to it over
/// a narrower path.
const FAR_IP: Ipv4Addr = Ipv4Addr::new(11, 0, 1, 2);
const FAR_ROUTER: Ipv4Addr = Ipv4Addr::new(11, 0, 1, 1);
const FAR_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x12, 0, 0, 0, 0, 2);
const FAR_ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x12, 0, 0, 0, 0, 1);
/// The narrower path's MTU; every other link has 1500.
const PATH_MTU: u32 = 1400;
const LINK_MTU: u32 = 1500;
const FAR_PORT: u16 = 7100;

/// A host beyond the outside host, which becomes a router on the way: node1 ->
/// outside (a router now) -> far. The router forwards towards the far host at
/// most [`PATH_MTU`] bytes a packet, by a route MTU: the far host's own link
/// keeps 1500, so it still announces an MSS of 1460 and the pod sends full-size
/// segments, which the router refuses with "fragmentation needed" / "packet too
/// big" sent to the address they came from, node1's. Like the outside host, the
/// far one routes only to the node network.
fn far_host(cluster: &Cluster) -> Result<NetNs> {
    let router = cluster.outside().netns();
    let far = NetNs::create(&format!("{}-far", cluster.base()))?;
    router.veth_to("far0", &far, "eth0")?;
    for (ns, dev, v4, v6) in [
        (router, "far0", FAR_ROUTER, FAR_ROUTER6),
        (&far, "eth0", FAR_IP, FAR_IP6),
    ] {
        ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", dev])?;
        ns.ip(&["addr", "add", &format!("{v6}/64"), "dev", dev, "nodad"])?;
        ns.ip(&["link", "set", dev, "up"])?;
    }
    for net in ["192.168.50.0/24", "11.0.0.0/24"] {
        far.ip(&["route", "add", net, "via", &FAR_ROUTER.to_string()])?;
    }
    for net in ["fd00:50::/64", "2001:db8:11::/64"] {
        far.ip(&["route", "add", net, "via", &FAR_ROUTER6.to_string()])?;
    }
    router.sysctls(&[
        ("net/ipv4/ip_forward", "1"),
        ("net/ipv6/conf/all/forwarding", "1"),
    ])?;
    // Locked: IPv6 forwarding honours only a locked route MTU (IPv4 any).
    let mtu = PATH_MTU.to_string();
    for far in [format!("{FAR_IP}/32"), format!("{FAR_IP6}/128")] {
        router.ip(&["route", "add", &far, "dev", "far0", "mtu", "lock", &mtu])?;
    }
    let node1 = cluster.node(0).netns();
    node1.ip(&[
        "route",
        "add",
        "11.0.1.0/24",
        "via",
        &OUTSIDE_IP.to_string(),
    ])?;
    node1.ip(&[
        "route",
        "add",
        "2001:db8:12::/64",
        "via",
        &OUTSIDE_IP6.to_string(),
    ])?;
    Ok(far)
}

/// DF on every packet, fragments never (TCP's default, made explicit):
/// IP_MTU_DISCOVER / IPV6_MTU_DISCOVER set to "do".
fn never_fragment(socket: &socket2::Socket, v6: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (level, name, value) = match v6 {
        true => (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DO,
        ),
        false => (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        ),
    };
    // SAFETY: setsockopt reads the int we own, of the size given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The path MTU a connected socket's route has (IP_MTU / IPV6_MTU).
fn path_mtu(stream: &std::net::TcpStream, v6: bool) -> Result<u32> {
    use std::os::fd::AsRawFd;
    let (level, name) = match v6 {
        true => (libc::IPPROTO_IPV6, libc::IPV6_MTU),
        false => (libc::IPPROTO_IP, libc::IP_MTU),
    };
    let mut mtu: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into the int we own.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&mut mtu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    ensure!(
        rc == 0,
        "getsockopt(IP_MTU): {}",
        std::io::Error::last_os_error()
    );
    Ok(u32::try_from(mtu)?)
}

/// PMTU discovery through the masquerade: a pod's bulk transfer (DF set) to a
/// host beyond a router with a narrower next link completes, and the pod's
/// socket learned the router's MTU: the router's "fragmentation needed" /
/// "packet too big", sent to node1's address about the translated flow, was
/// translated back to the pod and its flow. Both families.
#[test]
fn a_router_beyond_the_node_teaches_the_pod_its_path_mtu() -> Result<()> {
    use std::io::{Read, Write};
    let lb = lb_binary()?;
    let mut cluster = cluster()?;
    cluster.start_agents(&lb, |_| masquerade_args())?;
    let far = far_host(&cluster)?;
    let server = PeerEcho::start(
        &far,
        &[
            SocketAddr::new(FAR_IP.into(), FAR_PORT),
            SocketAddr::new(FAR_IP6.into(), FAR_PORT),
        ],
    )?;
    let pod = cluster.pod("client")?.netns();
    const BYTES: usize = 2 << 20;
    for (to, node) in [
        (IpAddr::from(FAR_IP), IpAddr::from(OUTSIDE_GATEWAY)),
        (FAR_IP6.into(), OUTSIDE_GATEWAY6.into()),
    ] {
        let v6 = to.is_ipv6();
        let errors_before = cluster.stat(0, "masq_icmp_error")?;
        let (stream, seen) =
            masq_support::connect(pod, None, SocketAddr::new(to, FAR_PORT), |s| {
                never_fragment(s, v6)
            })?;
        ensure!(seen.ip() == node, "{to}: the far host saw {seen}");
        let before = path_mtu(&stream, v6)?;
        ensure!(
            before == LINK_MTU,
            "{to}: path MTU {before} before the transfer"
        );
        // The echo comes back as it is sent, so the writer runs beside the reader
        // (neither side's buffers fill up).
        let mut out = stream.try_clone()?;
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            let mut data = vec![0u8; BYTES];
            masq_support::fill(1, 0, &mut data);
            out.write_all(&data)?;
            out.shutdown(std::net::Shutdown::Write)
        });
        let mut echoed = Vec::with_capacity(BYTES);
        let read = (&stream).read_to_end(&mut echoed);
        let written = writer
            .join()
            .map_err(|_| anyhow::anyhow!("writer panicked"))?;
        let mtu = path_mtu(&stream, v6)?;
        let icmp_errors = cluster.stat(0, "masq_icmp_error")? - errors_before;
        let context = || {
            format!(
                "{to}: the pod's path MTU is {mtu}, {icmp_errors} ICMP errors translated\n{}",
                cluster.all_stats()
            )
        };
        written.with_context(context)?;
        read.with_context(context)?;
        let mut want = vec![0u8; BYTES];
        masq_support::fill(1, 0, &mut want);
        ensure!(
            echoed == want,
            "{to}: {} bytes echoed, not the {BYTES} sent",
            echoed.len()
        );
        ensure!(mtu == PATH_MTU, "{}", context());
        ensure!(icmp_errors > 0, "{}", context());
    }
    ensure!(server.failures().is_empty(), "{:?}", server.failures());
    Ok(())
}

/// Pods of the crowd test, each with this many connections open at once.
const CROWD_PODS: usize = 50;
const CROWD_CONNS: usize = 100;
const CROWD_PORT: u16 = 7200;
/// Connection `j` of every pod comes from port `SHARED_PORT + j`.
const SHARED_PORT: u16 = 40000;
/// The node's own connection to the crowd's server comes from this port, one
/// every pod uses too.
const NODE_HELD_PORT: u16 = SHARED_PORT + 7;

fn crowd_pod(i: usize) -> String {
    format!("m{i:02}")
}

/// 50 pods, each with 100 connections to one outside address and port open at
/// once (all established before any sends its data): every connection reaches
/// the outside host from its own port of node1's address, and echoes a payload
/// of its own intact. The 50 pods are 50 pod namespaces with their own veths on
/// node1's bridge, as a CNI makes them. Each pod's connection `j` comes from
/// port 40000 + j, the worst case of pods' kernels choosing alike: every port is
/// wanted by 50 flows to the same destination, so 49 of them must get another.
/// Meanwhile a socket of node1 itself, connected to the same server from port
/// 40007 of the same address (one the pods want too), keeps exchanging data:
/// no pod flow may take its port. Both families, one after the other.
#[test]
fn fifty_pods_with_a_hundred_connections_each_get_their_own_ports_outside() -> Result<()> {
    // Both ends of every connection are in this process.
    masq_support::raise_open_files((2 * CROWD_PODS * CROWD_CONNS + 1000) as u64)?;
    let lb = lb_binary()?;
    let mut builder = Cluster::builder().outside_host();
    for i in 0..CROWD_PODS {
        builder = builder.client_pod(&crowd_pod(i), 0);
    }
    let mut cluster = with_pod_cidrs(builder)?;
    cluster.start_agents(&lb, |_| masquerade_args())?;
    let outside = cluster.outside().netns();
    // Room for every connection arriving at once (both are capped at listen()).
    outside.sysctls(&[
        ("net/core/somaxconn", "8192"),
        ("net/ipv4/tcp_max_syn_backlog", "8192"),
    ])?;
    let server = PeerEcho::start(
        outside,
        &[
            SocketAddr::new(OUTSIDE_IP.into(), CROWD_PORT),
            SocketAddr::new(OUTSIDE_IP6.into(), CROWD_PORT),
        ],
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    for (to, node) in [
        (IpAddr::from(OUTSIDE_IP), IpAddr::from(OUTSIDE_GATEWAY)),
        (OUTSIDE_IP6.into(), OUTSIDE_GATEWAY6.into()),
    ] {
        crowd(&cluster, &rt, SocketAddr::new(to, CROWD_PORT), node)
            .with_context(|| format!("towards {to}"))?;
    }
    ensure!(
        server.failures().is_empty(),
        "the server's failed connections: {:?}",
        server.failures()
    );
    for counter in ["masq_port_exhausted", "masq_map_full"] {
        ensure!(
            cluster.stat(0, counter)? == 0,
            "{counter}: {}",
            cluster.all_stats()
        );
    }
    Ok(())
}

/// One family of the crowd test: the crowd towards `to`, which must see every
/// connection from `node`.
fn crowd(
    cluster: &Cluster,
    rt: &tokio::runtime::Runtime,
    to: SocketAddr,
    node: IpAddr,
) -> Result<()> {
    let held = SocketAddr::new(node, NODE_HELD_PORT);
    let host = Stream::start(cluster.node(0).netns(), Some(held), to, 7)
        .context("node1's own connection")?;
    ensure!(
        host.seen == held,
        "node1's own connection seen as {}",
        host.seen
    );
    // Every socket made in its pod's namespace, bound, not yet connected.
    let mut sockets = Vec::with_capacity(CROWD_PODS);
    for i in 0..CROWD_PODS {
        let name = crowd_pod(i);
        let ip = pod_address(cluster, &name, to.ip())?;
        let pod_sockets = cluster.pod(&name)?.netns().run_in(|| {
            (0..CROWD_CONNS)
                .map(|j| {
                    let from = SocketAddr::new(ip, SHARED_PORT + j as u16);
                    let s = socket2::Socket::new(
                        socket2::Domain::for_address(from),
                        socket2::Type::STREAM,
                        None,
                    )?;
                    s.bind(&from.into())
                        .with_context(|| format!("binding {from}"))?;
                    s.set_nonblocking(true)?;
                    Ok(std::net::TcpStream::from(s))
                })
                .collect::<Result<Vec<_>>>()
        })?;
        sockets.push(pod_sockets);
    }
    let host_before = host.echoed();
    let total = CROWD_PODS * CROWD_CONNS;
    let outcomes = rt.block_on(async {
        let all_open = Arc::new(tokio::sync::Barrier::new(total));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, pod_sockets) in sockets.into_iter().enumerate() {
            for (j, socket) in pod_sockets.into_iter().enumerate() {
                let seed = ((i as u64) << 32) | j as u64 | u64::from(to.is_ipv6()) << 63;
                let all_open = Arc::clone(&all_open);
                tasks.spawn(async move {
                    let r = crowd_connection(socket, to, seed, &all_open).await;
                    (i, j, r)
                });
            }
        }
        tokio::time::timeout(Duration::from_secs(60), tasks.join_all()).await
    });
    let outcomes = outcomes.map_err(|_| {
        anyhow::anyhow!(
            "the crowd did not finish within 60 s\n{}",
            cluster.all_stats()
        )
    })?;
    let host_during = host.echoed() - host_before;
    let host_alive = host.alive();
    let host_total = host.finish().context("node1's own connection")?;
    ensure!(
        host_alive && host_during > 0,
        "node1's own connection moved {host_during} bytes during the crowd"
    );

    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|(i, j, r)| {
            r.as_ref()
                .err()
                .map(|e| format!("{} #{j}: {e:#}", crowd_pod(*i)))
        })
        .collect();
    ensure!(
        failed.is_empty(),
        "{} of {total} connections failed, e.g. {:#?}\n{}",
        failed.len(),
        &failed[..failed.len().min(5)],
        cluster.all_stats()
    );
    let seen: Vec<SocketAddr> = outcomes
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok().copied())
        .collect();
    let not_node: Vec<&SocketAddr> = seen.iter().filter(|s| s.ip() != node).collect();
    ensure!(
        not_node.is_empty(),
        "{} connections seen from elsewhere than {node}: {:?}",
        not_node.len(),
        &not_node[..not_node.len().min(5)]
    );
    let ports: BTreeSet<u16> = seen.iter().map(SocketAddr::port).collect();
    ensure!(
        ports.len() == total,
        "{total} connections open at once came from {} distinct ports",
        ports.len()
    );
    ensure!(
        !ports.contains(&NODE_HELD_PORT),
        "a pod's connection took port {NODE_HELD_PORT}, which node1's own socket holds with that peer"
    );
    // Where a pod's port was free it was kept: one flow per shared port (the
    // first to ask) unless a random pick took it before.
    let kept = outcomes
        .iter()
        .filter(|(_, j, r)| {
            r.as_ref()
                .is_ok_and(|s| s.port() == SHARED_PORT + *j as u16)
        })
        .count();
    ensure!(kept > 0, "no connection kept its pod's port");
    eprintln!(
        "{to}: {total} connections from {} ports ({kept} kept the pod's); node1's own \
         connection echoed {host_during} bytes during it, {host_total} in all",
        ports.len()
    );
    Ok(())
}

/// One crowd connection: connect, learn the source the server saw, wait until
/// every connection is open, then echo a payload of its own and close.
async fn crowd_connection(
    socket: std::net::TcpStream,
    to: SocketAddr,
    seed: u64,
    all_open: &tokio::sync::Barrier,
) -> Result<SocketAddr> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let open = async {
        let socket = tokio::net::TcpSocket::from_std_stream(socket);
        let mut stream = tokio::time::timeout(IO_TIMEOUT, socket.connect(to))
            .await
            .context("connect timed out")??;
        let seen =
            tokio::time::timeout(IO_TIMEOUT, masq_support::read_peer_line_async(&mut stream))
                .await
                .context("no first line")??;
        anyhow::Ok((stream, seen))
    }
    .await;
    // Every task passes here once, whatever happened to it, so the others go on.
    all_open.wait().await;
    let (mut stream, seen) = open?;
    let mut payload = [0u8; 256];
    masq_support::fill(seed, 0, &mut payload);
    let mut echoed = [0u8; 256];
    tokio::time::timeout(IO_TIMEOUT, async {
        stream.write_all(&payload).await?;
        stream.read_exact(&mut echoed).await?;
        stream.shutdown().await?;
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await?;
        anyhow::ensure!(rest.is_empty(), "{} bytes after the echo", rest.len());
        anyhow::Ok(())
    })
    .await
    .context("the echo timed out")??;
    ensure!(echoed == payload, "the echo differs from the payload");
    Ok(seen)
}

/// Waits until every stream has echoed another 128 KiB; a stream that breaks
/// meanwhile ends the wait, with what broke every broken one.
fn flowing(streams: Vec<Stream>, what: &str) -> Result<Vec<Stream>> {
    let marks: Vec<u64> = streams.iter().map(Stream::echoed).collect();
    let all_moved = poll(what, Duration::from_secs(15), || {
        if !streams.iter().all(Stream::alive) {
            return Ok(Some(false));
        }
        Ok(streams
            .iter()
            .zip(&marks)
            .all(|(s, m)| s.echoed() >= m + 128 * 1024)
            .then_some(true))
    })?;
    if all_moved {
        return Ok(streams);
    }
    // Every stream stopped (the live ones too, so no thread outlives the test).
    let broken: Vec<String> = streams
        .into_iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let (local, seen) = (s.local, s.seen);
            let why = s.finish().err()?;
            Some(format!("stream {i} from {local} (seen as {seen}): {why:#}"))
        })
        .collect();
    anyhow::bail!("streams broke ({what}):\n{}", broken.join("\n"))
}

/// An agent restart under masqueraded load: streams from two pods of node1 to
/// the outside host, both families, pairs of them from the same pod port
/// towards the same destination (so one of each pair leaves from a port lb
/// chose, which only the pinned state can give back), keep flowing while
/// node1's agent stops and starts again: no reset, every byte echoed intact,
/// the outside host saw each connection once. New flows work after it.
#[test]
fn masqueraded_flows_survive_an_agent_restart() -> Result<()> {
    const PORT: u16 = 7300;
    const STREAM_PORT: u16 = 45000;
    let lb = lb_binary()?;
    let mut cluster = with_pod_cidrs(
        Cluster::builder()
            .client_pod("client", 0)
            .client_pod("client3", 0)
            .outside_host(),
    )?;
    cluster.start_agents(&lb, |_| masquerade_args())?;
    let server = PeerEcho::start(
        cluster.outside().netns(),
        &[
            SocketAddr::new(OUTSIDE_IP.into(), PORT),
            SocketAddr::new(OUTSIDE_IP6.into(), PORT),
        ],
    )?;
    let mut streams = Vec::new();
    for (to, node) in [
        (IpAddr::from(OUTSIDE_IP), IpAddr::from(OUTSIDE_GATEWAY)),
        (OUTSIDE_IP6.into(), OUTSIDE_GATEWAY6.into()),
    ] {
        for k in 0..2u16 {
            for pod in ["client", "client3"] {
                let from = SocketAddr::new(pod_address(&cluster, pod, to)?, STREAM_PORT + k);
                let seed = streams.len() as u64 + 100;
                let s = Stream::start(
                    cluster.pod(pod)?.netns(),
                    Some(from),
                    SocketAddr::new(to, PORT),
                    seed,
                )
                .with_context(|| format!("stream from {from}"))?;
                ensure!(s.seen.ip() == node, "{from} seen as {}", s.seen);
                streams.push(s);
            }
        }
    }
    let moved = streams
        .iter()
        .filter(|s| s.seen.port() != s.local.port())
        .count();
    ensure!(
        moved == streams.len() / 2,
        "{moved} of {} streams left from a port of lb's choosing (one of each pair)",
        streams.len()
    );
    streams = flowing(streams, "every stream flowing")?;
    cluster
        .restart_agent(&lb, 0, masquerade_args())
        .context("restarting node1's agent")?;
    streams = flowing(streams, "every stream flowing after the restart")
        .with_context(|| cluster.all_stats())?;
    let count = streams.len();
    for (i, s) in streams.into_iter().enumerate() {
        let (local, seen) = (s.local, s.seen);
        s.finish()
            .with_context(|| format!("stream {i} from {local} (seen as {seen})"))?;
    }
    ensure!(
        server.failures().is_empty(),
        "connections the outside host saw fail: {:?}",
        server.failures()
    );
    let peers = server.peers();
    ensure!(
        peers.len() == count,
        "the outside host accepted {} connections for {count} streams: {peers:?}",
        peers.len()
    );
    // New flows after the restart.
    for to in [IpAddr::from(OUTSIDE_IP), OUTSIDE_IP6.into()] {
        for udp in [false, true] {
            let seen = seen_from(&cluster, "client", SocketAddr::new(to, WHOAMI_PORT), udp)?;
            let node = if to.is_ipv6() {
                IpAddr::from(OUTSIDE_GATEWAY6)
            } else {
                OUTSIDE_GATEWAY.into()
            };
            ensure!(
                seen == one(node),
                "after the restart, {to} udp={udp}: {seen:?}"
            );
        }
    }
    Ok(())
}
