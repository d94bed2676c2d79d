//! A two-node cluster in network namespaces, for the per-packet (TC) path: nodes on a
//! shared "switch", each with its own pod bridge, an external client on the switch,
//! and one `lb agent` per node running inside that node's namespace.
//!
//! ```text
//!   ext client 192.168.50.100 ─┐        switch ns: br0 (L2 only)
//!  (ext client 2 192.168.50.101 ─┤  only with ClusterBuilder::second_client)
//!                              ├── sw-node1 ── eth0 192.168.50.1  node1 ns
//!                              │                 br0 10.244.1.1/24 ── vpod-a ── pod-a 10.244.1.11
//!                              │                                   └─ vclient ── client 10.244.1.20
//!                              └── sw-node2 ── eth0 192.168.50.2  node2 ns
//!                                                br0 10.244.2.1/24 ── vpod-b ── pod-b 10.244.2.11
//! ```
//!
//! Every network is dual-stack: beside each IPv4 address above, the same host
//! has an IPv6 one (node network fd00:50::/64, node1 fd00:50::1, the client
//! fd00:50::100; node `n`'s pods fd00:244:n::/64, bridge ::1, pod-a
//! fd00:244:1::11), all without duplicate address detection so they work at once.
//!
//! Each node routes the other node's pod CIDRs (both families) via the other
//! node's addresses and forwards (ip_forward=1, IPv6 forwarding=1, rp_filter=0,
//! send_redirects=0). The external client has no
//! route to any pod CIDR: a packet the datapath did not translate cannot reach a pod.
//! It routes the external/LoadBalancer IPs a test asks for (/32) via node1.
//!
//! Agents are started as the DaemonSet starts them on a real node: no interface,
//! address or pod is named; each finds its node's devices and addresses itself and
//! follows pods as their veths come and go ([`Cluster::add_pod`],
//! [`Cluster::remove_pod`] while they run). Each has a cgroup of its own that no
//! test process is in (so the socket hooks never translate anything here:
//! everything goes through the TC path, except for [`Cluster::host_probe_in_cgroup`]),
//! and a pin dir of its own.
//!
//! Nothing is connected to the host's own namespace, and every resource is owned by a
//! guard (namespaces, cgroups, pin dirs, processes): dropping the cluster removes
//! everything, whatever path the test leaves by.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;

use crate::agent::{Agent, AgentSpec, CtFlow, ServiceEntry, READY_TIMEOUT, SYNC_TIMEOUT};
use crate::cgroup::Cgroup;
use crate::manifests::{documents, Endpoint, EndpointSlice, ManifestDir, Service};
use crate::netns::NetNs;
use crate::probe::{BulkReport, TcpReport, WhoamiReport};
use crate::process::Spawner;
use crate::testbed::{Hold, Tools, ECHO_TCP_PORT, ECHO_UDP_PORT};
use crate::topology::Pod;
use crate::util::{poll, require_root, unique_name};

/// lb-echo port answering `<name> <peer ip:port>` (TCP and UDP) in every backend.
pub const WHOAMI_PORT: u16 = 9000;
/// lb-echo port echoing a byte stream back (TCP) in every backend.
pub const BULK_PORT: u16 = 9001;

/// A NodePort Service `name` on cluster IP `vip`: whoami 80 -> 9000/TCP (node port
/// `node_port`).
pub fn whoami_node_port(name: &str, vip: Ipv4Addr, node_port: u16) -> Service {
    Service::new(
        name,
        vip,
        vec![
            crate::manifests::ServicePort::tcp("whoami", 80, WHOAMI_PORT.into())
                .with_node_port(node_port.into()),
        ],
    )
    .node_port()
}

/// A NodePort Service `name` on cluster IP `vip`: bulk 81 -> the echo stream port
/// (node port `node_port`).
pub fn bulk_node_port(name: &str, vip: Ipv4Addr, node_port: u16) -> Service {
    Service::new(
        name,
        vip,
        vec![
            crate::manifests::ServicePort::tcp("bulk", 81, BULK_PORT.into())
                .with_node_port(node_port.into()),
        ],
    )
    .node_port()
}

/// `lb-probe whoami` arguments: `count` requests to `to`, then `extra`.
fn whoami_args(to: SocketAddr, count: u32, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "whoami".to_string(),
        "--to".into(),
        to.to_string(),
        "--count".into(),
        count.to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// The external client, on the node network but outside the cluster.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
/// The second external client ([`ClusterBuilder::second_client`]).
pub const CLIENT2_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 101);

/// The external client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x100);
/// The second external client's IPv6 address.
pub const CLIENT2_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x101);

/// IPv6 address of node `i` on the node network: node1 is fd00:50::1.
pub fn node_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x50,
        0,
        0,
        0,
        0,
        0,
        1 + u16::try_from(i).expect("few nodes"),
    )
}

/// IPv6 pod CIDR of node `i`: fd00:244:1::/64 for node1.
pub fn pod_cidr6(i: usize) -> String {
    format!("fd00:244:{}::/64", i + 1)
}

/// IPv6 pod bridge address of node `i`: fd00:244:1::1 for node1.
pub fn pod_gateway6(i: usize) -> Ipv6Addr {
    pod_ip6(i, 1)
}

/// IPv6 address of the pod of node `i` whose IPv4 host number is `host`, written
/// with the same digits: 10.244.1.11 -> fd00:244:1::11.
fn pod_ip6(i: usize, host: u8) -> Ipv6Addr {
    let host = u16::from_str_radix(&host.to_string(), 16).expect("decimal digits are hex digits");
    Ipv6Addr::new(
        0xfd00,
        0x244,
        1 + u16::try_from(i).expect("few nodes"),
        0,
        0,
        0,
        0,
        host,
    )
}

/// Address of node `i` (0-based) on the node network: node1 is 192.168.50.1.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 50, 1 + u8::try_from(i).expect("at most 9 nodes"))
}

/// Name of node `i` as EndpointSlices and `--node-name` spell it: node1, node2.
pub fn node_name(i: usize) -> String {
    format!("node{}", i + 1)
}

/// Pod CIDR of node `i`: 10.244.1.0/24 for node1.
pub fn pod_cidr(i: usize) -> String {
    format!("10.244.{}.0/24", i + 1)
}

/// Pod bridge address of node `i`, the pods' default gateway: 10.244.1.1 for node1.
pub fn pod_gateway(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1 + u8::try_from(i).expect("at most 9 nodes"), 1)
}

/// The host outside the cluster ([`ClusterBuilder::outside_host`]): reached only
/// through node1's second uplink `up1` (node1 there: [`OUTSIDE_GATEWAY`]), and
/// routing only to the node network, as the internet routes only to a cloud
/// node's address: a packet from a pod address that reaches it cannot be answered.
/// Outside every range ip-masq-agent leaves alone by default.
pub const OUTSIDE_IP: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 2);
/// node1's address on `up1`, the link to the outside host: the source the node's
/// routing gives traffic leaving there (what MASQUERADE picks).
pub const OUTSIDE_GATEWAY: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 1);
/// The outside host's and node1's `up1` IPv6 addresses.
pub const OUTSIDE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x11, 0, 0, 0, 0, 2);
pub const OUTSIDE_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x11, 0, 0, 0, 0, 1);

/// Connect timeout of probes that expect to be dropped: short, and explicit.
pub const DROP_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// What a pod is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Runs lb-echo (echo, whoami and bulk ports).
    Backend,
    /// Runs probes only (outside every hooked cgroup).
    Client,
}

#[derive(Clone, Debug)]
struct PodSpec {
    name: String,
    node: usize,
    role: Role,
    /// A backend serving lb-echo's plain echo on exactly these ports (TCP and UDP)
    /// instead of the usual echo, whoami and bulk ports.
    echo_ports: Option<Vec<u16>>,
}

/// What to build; see [`Cluster::builder`].
#[derive(Clone, Debug)]
pub struct ClusterBuilder {
    nodes: usize,
    pods: Vec<PodSpec>,
    client_routes: Vec<IpAddr>,
    accept_local: bool,
    second_client: bool,
    xdp_ready: bool,
    outside_host: bool,
}

impl ClusterBuilder {
    /// The host outside the cluster at [`OUTSIDE_IP`] / [`OUTSIDE_IP6`], running
    /// lb-echo (whoami, echo ports), beyond node1's second uplink; node2 routes
    /// there via node1.
    pub fn outside_host(mut self) -> Self {
        self.outside_host = true;
        self
    }

    /// Make the network fit for `lb_xdp` on the nodes' uplinks, as a network of
    /// NICs would be: the switch's ports to the nodes run a pass program (a veth
    /// delivers what XDP transmits into it only then), and the clients and pods
    /// send complete checksums (a veth hands over partial ones, which XDP cannot
    /// see).
    pub fn xdp_ready(mut self) -> Self {
        self.xdp_ready = true;
        self
    }

    /// `n` nodes instead of two (at most 9), each routing every other node's pod
    /// CIDRs.
    pub fn nodes(mut self, n: usize) -> Self {
        assert!((1..=9).contains(&n), "1 to 9 nodes, not {n}");
        self.nodes = n;
        self
    }

    /// A second external client at [`CLIENT2_IP`], with the same routes as the
    /// first (e.g. to tell two sources apart).
    pub fn second_client(mut self) -> Self {
        self.second_client = true;
        self
    }

    /// A backend pod `name` on node `node` (0-based), running lb-echo.
    pub fn backend(mut self, name: &str, node: usize) -> Self {
        self.pods.push(PodSpec {
            name: name.into(),
            node,
            role: Role::Backend,
            echo_ports: None,
        });
        self
    }

    /// A backend pod `name` on node `node` whose lb-echo serves only its plain
    /// echo (TCP greeting and UDP name), on each of `ports`, TCP and UDP: a pod
    /// with container ports of its own, such as the NetworkPolicy tests' servers
    /// on 80 and 81.
    pub fn echo_server(mut self, name: &str, node: usize, ports: &[u16]) -> Self {
        self.pods.push(PodSpec {
            name: name.into(),
            node,
            role: Role::Backend,
            echo_ports: Some(ports.to_vec()),
        });
        self
    }

    /// A client pod `name` on node `node`: a plain pod that no socket hook sees.
    pub fn client_pod(mut self, name: &str, node: usize) -> Self {
        self.pods.push(PodSpec {
            name: name.into(),
            node,
            role: Role::Client,
            echo_ports: None,
        });
        self
    }

    /// Give the external client a host route (/32 or /128) to `ip` via node1
    /// (external IPs and LoadBalancer IPs "announced" by node1).
    pub fn client_route_via_node1(mut self, ip: impl Into<IpAddr>) -> Self {
        self.client_routes.push(ip.into());
        self
    }

    /// Set `net.ipv4.conf.all.accept_local=1` in the node namespaces. Not part of the
    /// node set-up the datapath is specified against: only to diagnose whether a
    /// failure is the kernel discarding translated packets whose source is the node's
    /// own address ("martian source"). Also switched on by `LB_TEST_ACCEPT_LOCAL=1`.
    pub fn accept_local(mut self, on: bool) -> Self {
        self.accept_local = on;
        self
    }

    pub fn build(self, tools: Tools) -> Result<Cluster> {
        Cluster::build(self, tools)
    }
}

/// One node: its namespace, pods, cgroup and (once started) agent. Field order is
/// teardown order.
pub struct Node {
    agent: Option<Agent>,
    pods: Vec<Pod>,
    ns: NetNs,
    cgroup: Cgroup,
    index: usize,
    /// Every pod address ever given on this node: a pod created again gets a new
    /// one, as in Kubernetes (and no stale neighbour entry answers for it).
    used_addresses: Vec<Ipv4Addr>,
}

impl Node {
    pub fn name(&self) -> String {
        node_name(self.index)
    }

    pub fn ip(&self) -> Ipv4Addr {
        node_ip(self.index)
    }

    pub fn netns(&self) -> &NetNs {
        &self.ns
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The agent's hooked cgroup (empty: no test process runs in it).
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("agent not started")
    }

    pub fn agent_mut(&mut self) -> &mut Agent {
        self.agent.as_mut().expect("agent not started")
    }

    /// The host-side veth of pod `name` (what a CNI would create).
    pub fn pod_iface(name: &str) -> String {
        format!("v{name}")
    }
}

/// The whole cluster. Dropping it stops the agents (detaching their programs), kills
/// the servers and deletes every namespace, cgroup, pin dir and manifest.
pub struct Cluster {
    /// First: each node stops its agent, then its pods, namespace and cgroup go.
    nodes: Vec<Node>,
    /// The switch ports' pass programs ([`ClusterBuilder::xdp_ready`]).
    xdp_peers: Vec<crate::xdp::XdpPass>,
    /// Pods get complete checksums ([`ClusterBuilder::xdp_ready`]).
    xdp_ready: bool,
    /// The host outside the cluster ([`ClusterBuilder::outside_host`]).
    outside: Option<Pod>,
    client: NetNs,
    client2: Option<NetNs>,
    switch: NetNs,
    pub manifests: ManifestDir,
    tools: Tools,
    base: String,
    accept_local: bool,
}

impl Cluster {
    /// Two nodes (or [`ClusterBuilder::nodes`]); add pods and routes, then
    /// [`ClusterBuilder::build`].
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder {
            nodes: 2,
            pods: Vec::new(),
            client_routes: Vec::new(),
            accept_local: std::env::var("LB_TEST_ACCEPT_LOCAL").is_ok_and(|v| v == "1"),
            second_client: false,
            xdp_ready: false,
            outside_host: false,
        }
    }

    fn build(spec: ClusterBuilder, tools: Tools) -> Result<Self> {
        require_root()?;
        let base = unique_name("lbc");
        let switch = NetNs::create(&format!("{base}-switch"))?;
        switch.ip(&["link", "add", "br0", "type", "bridge"])?;
        switch.ip(&["link", "set", "br0", "up"])?;
        let client = NetNs::create(&format!("{base}-ext"))?;
        let client2 = match spec.second_client {
            true => Some(NetNs::create(&format!("{base}-ext2"))?),
            false => None,
        };
        let manifests = ManifestDir::create()?;
        // Filled as we go: whatever exists when a step fails is dropped (cleaned up).
        let mut cluster = Cluster {
            nodes: Vec::new(),
            xdp_peers: Vec::new(),
            xdp_ready: spec.xdp_ready,
            outside: None,
            client,
            client2,
            switch,
            manifests,
            tools,
            base,
            accept_local: spec.accept_local,
        };
        cluster.uplink(&cluster.client, "sw-ext", CLIENT_IP, CLIENT_IP6)?;
        if let Some(client2) = &cluster.client2 {
            cluster.uplink(client2, "sw-ext2", CLIENT2_IP, CLIENT2_IP6)?;
        }
        for client in [Some(&cluster.client), cluster.client2.as_ref()]
            .into_iter()
            .flatten()
        {
            for ip in &spec.client_routes {
                let (host, via) = match ip {
                    IpAddr::V4(_) => (format!("{ip}/32"), node_ip(0).to_string()),
                    IpAddr::V6(_) => (format!("{ip}/128"), node_ip6(0).to_string()),
                };
                client.ip(&["route", "add", &host, "via", &via])?;
            }
        }
        for i in 0..spec.nodes {
            let node = cluster.add_node(i, &spec)?;
            cluster.nodes.push(node);
        }
        if spec.xdp_ready {
            for client in [Some(&cluster.client), cluster.client2.as_ref()]
                .into_iter()
                .flatten()
            {
                crate::xdp::tx_checksum_off(client, "eth0")?;
            }
            for i in 0..spec.nodes {
                let port = format!("sw-{}", node_name(i));
                let pass = crate::xdp::attach_pass(&cluster.switch, &port)?;
                cluster.xdp_peers.push(pass);
            }
        }
        for i in 0..spec.nodes {
            for j in (0..spec.nodes).filter(|&j| j != i) {
                let ns = &cluster.nodes[i].ns;
                ns.ip(&["route", "add", &pod_cidr(j), "via", &node_ip(j).to_string()])?;
                ns.ip(&[
                    "route",
                    "add",
                    &pod_cidr6(j),
                    "via",
                    &node_ip6(j).to_string(),
                ])?;
            }
        }
        if spec.outside_host {
            cluster.outside = Some(cluster.add_outside()?);
        }
        Ok(cluster)
    }

    /// The outside host: a namespace behind node1's `up1`, routing only to the
    /// node network; node2 reaches it via node1.
    fn add_outside(&self) -> Result<Pod> {
        let ns = NetNs::create(&format!("{}-out", self.base))?;
        let node1 = &self.nodes[0].ns;
        node1.veth_to("up1", &ns, "eth0")?;
        node1.ip(&[
            "addr",
            "add",
            &format!("{OUTSIDE_GATEWAY}/24"),
            "dev",
            "up1",
        ])?;
        node1.ip(&[
            "addr",
            "add",
            &format!("{OUTSIDE_GATEWAY6}/64"),
            "dev",
            "up1",
            "nodad",
        ])?;
        node1.ip(&["link", "set", "up1", "up"])?;
        node1.sysctls(&[("net/ipv4/conf/up1/rp_filter", "0")])?;
        ns.ip(&["addr", "add", &format!("{OUTSIDE_IP}/24"), "dev", "eth0"])?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{OUTSIDE_IP6}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        // Only the node network: pod addresses stay unknown out here.
        ns.ip(&[
            "route",
            "add",
            "192.168.50.0/24",
            "via",
            &OUTSIDE_GATEWAY.to_string(),
        ])?;
        ns.ip(&[
            "route",
            "add",
            "fd00:50::/64",
            "via",
            &OUTSIDE_GATEWAY6.to_string(),
        ])?;
        for node in self.nodes.iter().skip(1) {
            node.ns.ip(&[
                "route",
                "add",
                "11.0.0.0/24",
                "via",
                &node_ip(0).to_string(),
            ])?;
            node.ns.ip(&[
                "route",
                "add",
                "2001:db8:11::/64",
                "via",
                &node_ip6(0).to_string(),
            ])?;
        }
        let mut host = Pod::standalone("outside", ns, OUTSIDE_IP, Some(OUTSIDE_IP6));
        host.start_echo_with(
            &self.tools.echo,
            &[ECHO_TCP_PORT, ECHO_UDP_PORT],
            &["--whoami-port".into(), WHOAMI_PORT.to_string()],
        )?;
        Ok(host)
    }

    /// The host outside the cluster ([`ClusterBuilder::outside_host`]).
    pub fn outside(&self) -> &Pod {
        self.outside.as_ref().expect("built with outside_host()")
    }

    /// Connect `ns` to the switch: `eth0` = `ip`/24 and `ip6`/64 in `ns`, `sw_if`
    /// on the switch bridge.
    fn uplink(&self, ns: &NetNs, sw_if: &str, ip: Ipv4Addr, ip6: Ipv6Addr) -> Result<()> {
        self.switch.veth_to(sw_if, ns, "eth0")?;
        self.switch
            .ip(&["link", "set", sw_if, "master", "br0", "up"])?;
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        Ok(())
    }

    fn add_node(&self, i: usize, spec: &ClusterBuilder) -> Result<Node> {
        let name = node_name(i);
        let ns = NetNs::create(&format!("{}-{name}", self.base))?;
        let cgroup = Cgroup::create(&unique_name(&format!("lb-test-{name}")))?;
        let mut node = Node {
            agent: None,
            pods: Vec::new(),
            ns,
            cgroup,
            index: i,
            used_addresses: Vec::new(),
        };
        // Before any device exists, so every device inherits `default`.
        node.ns.sysctls(&[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
            ("net/ipv4/conf/all/send_redirects", "0"),
            ("net/ipv4/conf/default/send_redirects", "0"),
            ("net/ipv6/conf/all/forwarding", "1"),
        ])?;
        if spec.accept_local {
            node.ns
                .sysctls(&[("net/ipv4/conf/all/accept_local", "1")])?;
        }
        self.uplink(&node.ns, &format!("sw-{name}"), node_ip(i), node_ip6(i))?;
        node.ns.ip(&["link", "add", "br0", "type", "bridge"])?;
        node.ns.ip(&[
            "addr",
            "add",
            &format!("{}/24", pod_gateway(i)),
            "dev",
            "br0",
        ])?;
        node.ns.ip(&[
            "addr",
            "add",
            &format!("{}/64", pod_gateway6(i)),
            "dev",
            "br0",
            "nodad",
        ])?;
        node.ns.ip(&["link", "set", "br0", "up"])?;
        for pod in spec.pods.iter().filter(|p| p.node == i) {
            let p = self.create_pod(&node, pod)?;
            node.used_addresses.push(p.ip());
            node.pods.push(p);
        }
        // Whatever the inheritance did (eth0 came from another namespace), every
        // interface ends up with the settings the node needs.
        node.ns.sysctls(&[
            ("net/ipv4/conf/*/rp_filter", "0"),
            ("net/ipv4/conf/*/send_redirects", "0"),
        ])?;
        Ok(node)
    }

    /// A pod on `node`, with the lowest address of its role's range not used
    /// before on the node, its veth in the node's bridge and, for a backend,
    /// lb-echo running.
    fn create_pod(&self, node: &Node, pod: &PodSpec) -> Result<Pod> {
        // Backends take .11-.19, clients .20-.254 (a test may want many clients:
        // the masquerade test's 50 pods).
        let hosts = match pod.role {
            Role::Backend => 11u8..=19,
            Role::Client => 20u8..=254,
        };
        let i = node.index;
        let ip = hosts
            .map(|host| Ipv4Addr::new(10, 244, 1 + u8::try_from(i).expect("few nodes"), host))
            .find(|ip| !node.used_addresses.contains(ip))
            .with_context(|| format!("no free pod address on {}", node_name(i)))?;
        let mut p = Pod::create(
            &pod.name,
            &format!("{}-{}", self.base, pod.name),
            ip,
            pod_gateway(i),
            &node.ns,
            "br0",
            &Node::pod_iface(&pod.name),
        )?;
        p.add_ipv6(pod_ip6(i, ip.octets()[3]), pod_gateway6(i))?;
        if self.xdp_ready {
            crate::xdp::tx_checksum_off(p.netns(), "eth0")?;
        }
        if let Some(ports) = &pod.echo_ports {
            p.start_echo(&self.tools.echo, ports)?;
        } else if pod.role == Role::Backend {
            p.start_echo_with(
                &self.tools.echo,
                &[ECHO_TCP_PORT, ECHO_UDP_PORT],
                &[
                    "--whoami-port".into(),
                    WHOAMI_PORT.to_string(),
                    "--bulk-port".into(),
                    BULK_PORT.to_string(),
                ],
            )?;
        }
        Ok(p)
    }

    /// Stops backend pod `name`'s lb-echo: every port of it refuses from now on
    /// (a RST to a SYN), as a backend whose process died.
    pub fn stop_backend(&mut self, name: &str) -> Result<()> {
        self.pod_mut(name)?.stop_echo();
        Ok(())
    }

    /// Starts backend pod `name`'s lb-echo again (the ports [`Cluster::build`]
    /// gives backends); returns once it listens.
    pub fn start_backend(&mut self, name: &str) -> Result<()> {
        let echo = self.tools.echo.clone();
        self.pod_mut(name)?.start_echo_with(
            &echo,
            &[ECHO_TCP_PORT, ECHO_UDP_PORT],
            &[
                "--whoami-port".into(),
                WHOAMI_PORT.to_string(),
                "--bulk-port".into(),
                BULK_PORT.to_string(),
            ],
        )
    }

    fn pod_mut(&mut self, name: &str) -> Result<&mut Pod> {
        self.nodes
            .iter_mut()
            .flat_map(|n| n.pods.iter_mut())
            .find(|p| p.name() == name)
            .with_context(|| format!("no pod {name} in the cluster"))
    }

    /// TCP connections from `ns` to an echo port `to`, one every `interval`, each
    /// reported (`lb-probe tcp-seq`); at most `count`, and with `window` only for
    /// that long after the first failure.
    pub fn tcp_seq(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        interval: Duration,
        window: Option<Duration>,
    ) -> Result<crate::probe::SeqReport> {
        self.seq("tcp-seq", ns, to.into(), count, (interval, window), &[])
    }

    /// [`Cluster::tcp_seq`] with UDP datagrams to an echo port, each from a new
    /// connected socket (`lb-probe udp-seq`: a closed port is ECONNREFUSED),
    /// attempt i from local port `first_port + i` (see `lb-probe udp-seq
    /// --first-port`).
    #[allow(clippy::too_many_arguments)]
    pub fn udp_seq(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        interval: Duration,
        window: Option<Duration>,
        first_port: u16,
    ) -> Result<crate::probe::SeqReport> {
        let first_port = ["--first-port".to_string(), first_port.to_string()];
        self.seq(
            "udp-seq",
            ns,
            to.into(),
            count,
            (interval, window),
            &first_port,
        )
    }

    fn seq(
        &self,
        mode: &str,
        ns: &NetNs,
        to: SocketAddr,
        count: u32,
        (interval, window): (Duration, Option<Duration>),
        extra: &[String],
    ) -> Result<crate::probe::SeqReport> {
        let mut args = vec![
            mode.to_string(),
            "--to".into(),
            to.to_string(),
            "--count".into(),
            count.to_string(),
            "--interval-ms".into(),
            interval.as_millis().to_string(),
        ];
        if let Some(window) = window {
            args.extend(["--window-ms".to_string(), window.as_millis().to_string()]);
        }
        args.extend_from_slice(extra);
        self.probe_in(
            ns,
            &args,
            Duration::from_secs(30) + Duration::from_millis(2500) * count,
        )
    }

    /// Create pod `name` on node `node` now (agents may be running): what a CNI
    /// does when the kubelet starts a pod.
    pub fn add_pod(&mut self, name: &str, node: usize, role: Role) -> Result<&Pod> {
        let spec = PodSpec {
            name: name.into(),
            node,
            role,
            echo_ports: None,
        };
        let pod = self.create_pod(&self.nodes[node], &spec)?;
        self.nodes[node].ns.sysctls(&[
            ("net/ipv4/conf/*/rp_filter", "0"),
            ("net/ipv4/conf/*/send_redirects", "0"),
        ])?;
        let node = &mut self.nodes[node];
        node.used_addresses.push(pod.ip());
        node.pods.push(pod);
        Ok(node.pods.last().expect("just pushed"))
    }

    /// Delete pod `name` (its namespace, so its veth goes too): a pod that ended.
    /// Returns once the host-side veth is gone (the kernel tears a namespace down
    /// asynchronously), so the name can be used again.
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        for node in &mut self.nodes {
            if let Some(at) = node.pods.iter().position(|p| p.name() == name) {
                drop(node.pods.remove(at));
                let veth = Node::pod_iface(name);
                return poll(
                    &format!("{veth} to disappear"),
                    Duration::from_secs(10),
                    || Ok(node.ns.ip(&["link", "show", &veth]).is_err().then_some(())),
                );
            }
        }
        bail!("no pod {name} in the cluster")
    }

    /// Run `lb-probe ARGS` as a host-network process of node `node`: in the
    /// node's namespace and in the agent's hooked cgroup, as every process of a
    /// real node is in the cgroup the DaemonSet attaches to.
    pub fn host_probe_in_cgroup<T: DeserializeOwned>(
        &self,
        node: usize,
        args: &[String],
        timeout: Duration,
    ) -> Result<T> {
        let n = self.node(node);
        let out = self
            .probe_cmd(&n.ns)?
            .cgroup(&n.cgroup)?
            .args(args)
            .output(timeout)?
            .checked_stdout()?;
        serde_json::from_str(out.trim())
            .with_context(|| format!("lb-probe {args:?} printed unexpected output:\n{out}"))
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut Node {
        &mut self.nodes[i]
    }

    /// The pod called `name`, on whichever node.
    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.nodes
            .iter()
            .flat_map(|n| n.pods.iter())
            .find(|p| p.name() == name)
            .with_context(|| format!("no pod {name} in the cluster"))
    }

    /// The ready endpoint of pod `name`, with the nodeName of the node it runs on.
    pub fn endpoint(&self, name: &str) -> Result<Endpoint> {
        self.endpoint_of(name, false)
    }

    /// [`Cluster::endpoint`] with the pod's IPv6 address (`ipv6`) or IPv4 one.
    pub fn endpoint_of(&self, name: &str, ipv6: bool) -> Result<Endpoint> {
        let (i, pod) = self
            .nodes
            .iter()
            .enumerate()
            .find_map(|(i, n)| n.pods.iter().find(|p| p.name() == name).map(|p| (i, p)))
            .with_context(|| format!("no pod {name} in the cluster"))?;
        let ip = match ipv6 {
            true => IpAddr::V6(pod.ip6().context("pod without an IPv6 address")?),
            false => IpAddr::V4(pod.ip()),
        };
        Ok(Endpoint::ready(name, ip).on_node(&node_name(i)))
    }

    /// Write `<service>.yaml`: the Service and one EndpointSlice with `endpoints`
    /// (IPv4; see [`Cluster::publish`] for other families).
    pub fn publish_endpoints(&self, svc: &Service, endpoints: Vec<Endpoint>) -> Result<()> {
        let slice = EndpointSlice::for_service(svc, endpoints);
        self.manifests.write(
            &format!("{}.yaml", svc.name),
            &documents([svc.to_yaml(), slice.to_yaml()]),
        )
    }

    /// Write `<service>.yaml`: the Service and, for each of its IP families, the
    /// EndpointSlice of that family with the ready endpoints of the pods `backends`,
    /// as the EndpointSlice controller writes them.
    pub fn publish(&self, svc: &Service, backends: &[&str]) -> Result<()> {
        let mut docs = vec![svc.to_yaml()];
        for family in &svc.ip_families {
            let ipv6 = *family == "IPv6";
            let endpoints = backends
                .iter()
                .map(|name| self.endpoint_of(name, ipv6))
                .collect::<Result<Vec<_>>>()?;
            let slice = match ipv6 {
                true => EndpointSlice::ipv6_for_service(svc, endpoints),
                false => EndpointSlice::for_service(svc, endpoints),
            };
            docs.push(slice.to_yaml());
        }
        self.manifests
            .write(&format!("{}.yaml", svc.name), &documents(docs))
    }

    /// The external client's namespace.
    pub fn client(&self) -> &NetNs {
        &self.client
    }

    /// The second external client's namespace ([`ClusterBuilder::second_client`]).
    pub fn client2(&self) -> &NetNs {
        self.client2
            .as_ref()
            .expect("built with ClusterBuilder::second_client")
    }

    /// The switch's namespace: its bridge `br0` and one port per host, `sw-node1`,
    /// `sw-node2`, ..., `sw-ext` (the client), whose counters say what crossed
    /// the switch to whom.
    pub fn switch(&self) -> &NetNs {
        &self.switch
    }

    /// Unique prefix of this cluster's namespace names.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Start an agent in every node, each with `extra(node index)` appended to its
    /// flags, and wait until all are ready.
    pub fn start_agents(&mut self, lb: &Path, extra: impl Fn(usize) -> Vec<String>) -> Result<()> {
        let services = self.manifests.path().to_path_buf();
        for node in &mut self.nodes {
            let args = extra(node.index);
            let name = node_name(node.index);
            let spec = AgentSpec::new(&services, &node.cgroup, &name)
                .netns(&node.ns)
                .args(args);
            let agent = Agent::start_with(lb, &spec)?;
            // Stored before waiting, so a failed start is still cleaned up by Drop.
            node.agent = Some(agent);
        }
        for node in &mut self.nodes {
            let agent = node.agent.as_mut().expect("started above");
            if let Err(e) = agent.wait_ready(READY_TIMEOUT) {
                let e = e.context(format!("agent of {}", node_name(node.index)));
                return Err(match agent.exit_status() {
                    Some(status) => e.context(format!("lb agent exited ({status})")),
                    None => e,
                });
            }
        }
        Ok(())
    }

    /// Stops node `node`'s agent and starts it again with `args` (its programs
    /// and maps stay pinned in between, as on a real node), and waits until it is
    /// ready.
    pub fn restart_agent(&mut self, lb: &Path, node: usize, args: Vec<String>) -> Result<()> {
        let services = self.manifests.path().to_path_buf();
        let n = &mut self.nodes[node];
        let old = n.agent.take().context("no agent to restart")?;
        let pins = old.stop_keeping_pins()?;
        let name = node_name(node);
        let spec = AgentSpec::new(&services, &n.cgroup, &name)
            .netns(&n.ns)
            .pin_dir(&pins)
            .args(args);
        n.agent = Some(Agent::start_with(lb, &spec)?);
        n.agent
            .as_ref()
            .expect("just started")
            .wait_ready(READY_TIMEOUT)
            .with_context(|| format!("agent of {name} after the restart"))
    }

    /// Wait until node `node`'s agent programmed `ip:port/protocol` (the entry of
    /// `scope`, "internal" or "external") with exactly the backends `want`.
    pub fn wait_frontend(
        &self,
        node: usize,
        frontend: impl Into<SocketAddr>,
        protocol: &str,
        scope: &str,
        want: &[impl Into<SocketAddr> + Copy],
    ) -> Result<ServiceEntry> {
        let frontend: SocketAddr = frontend.into();
        let want: std::collections::BTreeSet<SocketAddr> = want.iter().map(|&a| a.into()).collect();
        let matches = |e: &ServiceEntry| {
            e.is(frontend.ip(), frontend.port(), protocol)
                && (e.frontend.scope.is_empty() || e.frontend.scope == scope)
        };
        let entries = self.node(node).agent().wait_services(
            &format!(
                "{} to program {frontend}/{protocol} ({scope}) with backends {want:?}",
                node_name(node)
            ),
            SYNC_TIMEOUT,
            |entries| {
                entries
                    .iter()
                    .any(|e| matches(e) && e.backend_addrs() == want)
            },
        )?;
        Ok(entries
            .into_iter()
            .find(|e| matches(e) && e.backend_addrs() == want)
            .expect("checked by the predicate"))
    }

    /// A probe command in namespace `ns`, in no hooked cgroup.
    fn probe_cmd(&self, ns: &NetNs) -> Result<Spawner> {
        Spawner::new(&self.tools.probe)
            .label(format!("lb-probe in {}", ns.name()))
            .netns(ns)
    }

    /// Run `lb-probe ARGS` in namespace `ns`; parse its JSON report.
    pub fn probe_in<T: DeserializeOwned>(
        &self,
        ns: &NetNs,
        args: &[String],
        timeout: Duration,
    ) -> Result<T> {
        let out = self
            .probe_cmd(ns)?
            .args(args)
            .output(timeout)?
            .checked_stdout()?;
        serde_json::from_str(out.trim())
            .with_context(|| format!("lb-probe {args:?} printed unexpected output:\n{out}"))
    }

    /// `count` whoami requests from `ns` to `to` (TCP, or UDP datagrams).
    pub fn whoami(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        udp: bool,
        connect_timeout: Duration,
    ) -> Result<WhoamiReport> {
        let ms = connect_timeout.as_millis().to_string();
        let mut args = whoami_args(to.into(), count, &["--connect-timeout-ms", &ms]);
        if udp {
            args.push("--udp".into());
        }
        let per_attempt = connect_timeout.max(Duration::from_secs(2)) + Duration::from_millis(500);
        self.probe_in(ns, &args, Duration::from_secs(30) + per_attempt * count)
    }

    /// `count` whoami TCP requests from `ns` to `to`, request `i` from local port
    /// `from_port + i`: the same client flows each time it is called.
    pub fn whoami_from(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        from_port: u16,
    ) -> Result<WhoamiReport> {
        let args = whoami_args(to.into(), count, &["--from-port", &from_port.to_string()]);
        self.probe_in(
            ns,
            &args,
            Duration::from_secs(30) + Duration::from_secs(3) * count,
        )
    }

    /// [`Cluster::whoami`] from a host-network process of node `node` (see
    /// [`Cluster::host_probe_in_cgroup`]).
    pub fn host_whoami(
        &self,
        node: usize,
        to: impl Into<SocketAddr>,
        count: u32,
    ) -> Result<WhoamiReport> {
        let args = whoami_args(to.into(), count, &["--connect-timeout-ms", "2000"]);
        self.host_probe_in_cgroup(
            node,
            &args,
            Duration::from_secs(30) + Duration::from_secs(3) * count,
        )
    }

    /// `count` TCP connections from `ns` to an echo port `to`.
    pub fn tcp(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        connect_timeout: Duration,
    ) -> Result<TcpReport> {
        let to: SocketAddr = to.into();
        let args = vec![
            "tcp".to_string(),
            "--to".into(),
            to.to_string(),
            "--count".into(),
            count.to_string(),
            "--connect-timeout-ms".into(),
            connect_timeout.as_millis().to_string(),
        ];
        let per_attempt = connect_timeout.max(Duration::from_secs(2)) + Duration::from_millis(500);
        self.probe_in(ns, &args, Duration::from_secs(30) + per_attempt * count)
    }

    /// Open a long-lived TCP connection from `ns` to an echo port `to`.
    pub fn hold(&self, ns: &NetNs, to: impl Into<SocketAddr>) -> Result<Hold> {
        let to: SocketAddr = to.into();
        let child = self
            .probe_cmd(ns)?
            .args(["hold", "--to", &to.to_string()])
            .stdin_piped()
            .spawn()?;
        Hold::new(child)
    }

    /// `count` TCP connections from `ns` to `to` are all answered, by exactly the
    /// pods of `expect`, each seeing only its given source address; the client
    /// sees `to` as its peer and, with `port_kept`, keeps its own port. The report.
    pub fn expect_answers(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        count: u32,
        expect: &[(&str, IpAddr)],
        port_kept: bool,
    ) -> Result<WhoamiReport> {
        let to: SocketAddr = to.into();
        let r = self.whoami(ns, to, count, false, Duration::from_secs(2))?;
        let fail = |what: String| anyhow::anyhow!("{to}: {what}: {r:#?}\n{}", self.all_stats());
        if r.tally.answered != count || !r.tally.errors.is_empty() {
            return Err(fail(format!("{} of {count} answered", r.tally.answered)));
        }
        let pods: std::collections::BTreeSet<&str> = expect.iter().map(|(p, _)| *p).collect();
        if r.tally.names() != pods {
            return Err(fail(format!(
                "answered by {:?}, not {pods:?}",
                r.tally.names()
            )));
        }
        for (pod, source) in expect {
            if r.seen_ips(pod) != [*source].into() {
                return Err(fail(format!("{pod} must see {source} as the source")));
            }
        }
        if port_kept && !r.answers.iter().all(|a| a.port_kept()) {
            return Err(fail("the client's port was free but not kept".into()));
        }
        if r.peers() != [to.to_string().as_str()].into() {
            return Err(fail("the client must see the frontend as its peer".into()));
        }
        Ok(r)
    }

    /// A Service without endpoints at `to` (a TCP and a UDP port of that number)
    /// refuses the external client at once, as kube-proxy's REJECT: three TCP
    /// connects get ECONNREFUSED (a RST), three connected UDP sockets get
    /// ECONNREFUSED (an ICMP / ICMPv6 port unreachable).
    pub fn expect_refused(&self, to: impl Into<SocketAddr>) -> Result<()> {
        let to: SocketAddr = to.into();
        let r = self.whoami(self.client(), to, 3, false, Duration::from_secs(2))?;
        if r.tally.errors_of("ECONNREFUSED") != 3 {
            bail!(
                "TCP to {to} without endpoints: {r:#?}\n{}",
                self.all_stats()
            );
        }
        let r: crate::probe::UdpConnectedReport = self.probe_in(
            self.client(),
            &["udp-connected", "--to", &to.to_string(), "--count", "3"].map(String::from),
            Duration::from_secs(30),
        )?;
        if r.tally.errors_of("ECONNREFUSED") != 3 {
            bail!(
                "connected UDP to {to} without endpoints: {r:#?}\n{}",
                self.all_stats()
            );
        }
        Ok(())
    }

    /// Send `bytes` through a bulk port `to` from `ns` and verify the echo.
    pub fn bulk(
        &self,
        ns: &NetNs,
        to: impl Into<SocketAddr>,
        bytes: u64,
        seed: u64,
    ) -> Result<BulkReport> {
        let to: SocketAddr = to.into();
        let args = vec![
            "bulk".to_string(),
            "--to".into(),
            to.to_string(),
            "--bytes".into(),
            bytes.to_string(),
            "--seed".into(),
            seed.to_string(),
        ];
        // Local veths move hundreds of MB/s even in a debug build; the probe's own
        // stall timeout (10 s without progress) ends a stuck transfer well before this.
        self.probe_in(ns, &args, Duration::from_secs(120))
    }

    /// Poll node `node`'s `lb conntrack --json` until `pred` holds; the listing.
    pub fn wait_conntrack(
        &self,
        node: usize,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[CtFlow]) -> bool,
    ) -> Result<Vec<CtFlow>> {
        let agent = self.node(node).agent();
        let mut last = None;
        let result = poll(what, timeout, || {
            let flows = agent.conntrack()?;
            if pred(&flows) {
                return Ok(Some(flows));
            }
            last = Some(flows);
            Ok(None)
        });
        result.with_context(|| format!("last `lb conntrack --json`: {last:#?}"))
    }

    /// Counters of node `node`'s datapath, for failure messages.
    pub fn stats_text(&self, node: usize) -> String {
        match self.node(node).agent.as_ref().map(|agent| agent.stats()) {
            Some(Ok(stats)) => stats
                .iter()
                .filter(|(_, v)| **v != 0)
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
            Some(Err(e)) => format!("(lb stats failed: {e:#})"),
            None => "(no agent)".into(),
        }
    }

    /// One counter of node `node`'s datapath.
    pub fn stat(&self, node: usize, name: &str) -> Result<u64> {
        let stats = self.node(node).agent().stats()?;
        match stats.get(name) {
            Some(v) => Ok(*v),
            None => bail!("no counter {name} in `lb stats`: {stats:?}"),
        }
    }

    /// Both nodes' counters, for failure messages.
    pub fn all_stats(&self) -> String {
        let mut text = (0..self.nodes.len())
            .map(|i| format!("{}: {}", node_name(i), self.stats_text(i)))
            .collect::<Vec<_>>()
            .join("\n");
        text += &format!(
            "\nnode sysctl accept_local={} (LB_TEST_ACCEPT_LOCAL=1 tells whether the kernel \
             drops translated packets whose source is the node's own address)",
            u8::from(self.accept_local)
        );
        text
    }
}
