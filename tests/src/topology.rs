//! The test network: one "node" namespace with a bridge, and one namespace per pod,
//! each joined to the bridge by a veth pair — a node's pod network in miniature.
//!
//! ```text
//!   node ns:   br0 10.244.1.1/24 ── vpod-a ── vpod-b ── ... ── vclient
//!                                     │          │               │
//!   pod ns:      eth0 10.244.1.11  10.244.1.12  ...     eth0 10.244.1.20 (client)
//! ```
//!
//! Dual-stack: the bridge and every pod also have an IPv6 address
//! (`fd00:244:1::1/64`, pods `fd00:244:1::11`..., clients `fd00:244:1::20`...),
//! added without duplicate address detection so they are usable at once.
//!
//! Nothing is connected to the host's own namespace: test traffic cannot leave.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::netns::NetNs;
use crate::process::{Child, Spawner};
use crate::util::unique_name;

/// Gateway of the pod network: the bridge address in the node namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
/// Service CIDR of the test cluster; every VIP the tests use is inside it.
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// IPv6 gateway of the pod network (the bridge).
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 1);
/// IPv6 Service CIDR of the test cluster.
pub const SERVICE_CIDR6: &str = "fd00:96::/108";
/// IPv6 address of backend pod `i`: pod-a is fd00:244:1::11, pod-b ::12, ...
pub fn pod_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x244,
        1,
        0,
        0,
        0,
        0,
        0x11 + u16::try_from(i).expect("few pods"),
    )
}
/// IPv6 address of client pod `i`: the first client is fd00:244:1::20.
pub fn client_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x244,
        1,
        0,
        0,
        0,
        0,
        0x20 + u16::try_from(i).expect("few clients"),
    )
}
/// Address of backend pod `i` (0-based): pod-a is 10.244.1.11, pod-b .12, ...
pub fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1, 11 + u8::try_from(i).expect("at most 9 pods"))
}
/// Name of backend pod `i`: pod-a, pod-b, ...
pub fn pod_name(i: usize) -> String {
    format!(
        "pod-{}",
        char::from(b'a' + u8::try_from(i).expect("at most 9 pods"))
    )
}
/// Address of client pod `i`: the first client is 10.244.1.20.
pub fn client_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1, 20 + u8::try_from(i).expect("at most 9 clients"))
}
/// Name of client pod `i`: client, client-2, client-3, ...
pub fn client_name(i: usize) -> String {
    if i == 0 {
        "client".into()
    } else {
        format!("client-{}", i + 1)
    }
}

/// Timeout for a freshly started lb-echo to bind its ports.
const ECHO_READY: Duration = Duration::from_secs(10);

/// One pod: its namespace, address and (for backends) the lb-echo server in it.
pub struct Pod {
    /// Declared before `ns`: the server is killed before its namespace is deleted.
    server: Option<Child>,
    name: String,
    ip: Ipv4Addr,
    ip6: Option<Ipv6Addr>,
    ns: NetNs,
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    pub fn netns(&self) -> &NetNs {
        &self.ns
    }

    /// The pod's IPv6 address, when it has one (see [`Pod::add_ipv6`]).
    pub fn ip6(&self) -> Option<Ipv6Addr> {
        self.ip6
    }

    /// Gives eth0 `ip`/64 too, without duplicate address detection (usable at once),
    /// with a default IPv6 route via `gateway`.
    pub fn add_ipv6(&mut self, ip: Ipv6Addr, gateway: Ipv6Addr) -> Result<()> {
        self.ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{ip}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        self.ns
            .ip(&["-6", "route", "add", "default", "via", &gateway.to_string()])?;
        self.ip6 = Some(ip);
        Ok(())
    }

    /// A host in namespace `ns` (set up by the caller) at `ip` (and `ip6`), which
    /// can run lb-echo like a pod: e.g. a host outside the cluster.
    pub fn standalone(name: &str, ns: NetNs, ip: Ipv4Addr, ip6: Option<Ipv6Addr>) -> Pod {
        Pod {
            server: None,
            name: name.to_string(),
            ip,
            ip6,
            ns,
        }
    }

    /// Create namespace `ns_name` holding pod `name`: its eth0 (`ip`/24, default
    /// route via `gateway`) is a veth whose other end, `host_if`, is put in
    /// `host` as a port of `bridge`.
    pub fn create(
        name: &str,
        ns_name: &str,
        ip: Ipv4Addr,
        gateway: Ipv4Addr,
        host: &NetNs,
        bridge: &str,
        host_if: &str,
    ) -> Result<Pod> {
        // IFNAMSIZ allows 15 characters.
        ensure!(host_if.len() <= 15, "interface name {host_if} too long");
        let ns = NetNs::create(ns_name)?;
        host.veth_to(host_if, &ns, "eth0")?;
        host.ip(&["link", "set", host_if, "master", bridge, "up"])?;
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["route", "add", "default", "via", &gateway.to_string()])?;
        Ok(Pod {
            server: None,
            name: name.to_string(),
            ip,
            ip6: None,
            ns,
        })
    }

    /// Start `lb-echo --name <pod> --port P...` in this pod and wait until it is bound.
    pub fn start_echo(&mut self, echo_bin: &Path, ports: &[u16]) -> Result<()> {
        self.start_echo_with(echo_bin, ports, &[])
    }

    /// [`Pod::start_echo`] with more lb-echo arguments (`--whoami-port P`, ...).
    pub fn start_echo_with(
        &mut self,
        echo_bin: &Path,
        ports: &[u16],
        extra: &[String],
    ) -> Result<()> {
        let mut spawner = Spawner::new(echo_bin)
            .label(format!("lb-echo {}", self.name))
            .netns(&self.ns)?
            .args(["--name", &self.name]);
        for port in ports {
            spawner = spawner.args(["--port", &port.to_string()]);
        }
        let server = spawner.args(extra).spawn()?;
        server
            .stdout
            .wait_for(ECHO_READY, |l| l.contains("listening"))
            .with_context(|| format!("lb-echo in {} did not start", self.name))?;
        self.server = Some(server);
        Ok(())
    }

    /// Stops this pod's lb-echo (SIGKILL, reaped): its ports are closed, so a new
    /// TCP connection gets a RST, as from a backend whose process died.
    pub fn stop_echo(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.kill();
        }
    }
}

/// The whole test network. Dropping it kills the servers and deletes every namespace.
pub struct Topology {
    /// Pods are declared before the node so they are torn down first.
    pods: Vec<Pod>,
    clients: Vec<Pod>,
    node: NetNs,
    base: String,
}

impl Topology {
    /// Build a node with `pods` backend pods and `clients` client pods.
    pub fn build(pods: usize, clients: usize) -> Result<Self> {
        let base = unique_name("lbt");
        let node = NetNs::create(&format!("{base}-node"))?;
        node.ip(&["link", "add", "br0", "type", "bridge"])?;
        node.ip(&["addr", "add", &format!("{GATEWAY}/24"), "dev", "br0"])?;
        node.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{GATEWAY6}/64"),
            "dev",
            "br0",
            "nodad",
        ])?;
        node.ip(&["link", "set", "br0", "up"])?;
        // Filled as we go: if a step fails, what exists so far is dropped (cleaned up).
        let mut topo = Topology {
            pods: Vec::new(),
            clients: Vec::new(),
            node,
            base,
        };
        for i in 0..pods {
            let mut pod = topo.add_pod(&pod_name(i), pod_ip(i))?;
            pod.add_ipv6(pod_ip6(i), GATEWAY6)?;
            topo.pods.push(pod);
        }
        for i in 0..clients {
            let mut client = topo.add_pod(&client_name(i), client_ip(i))?;
            client.add_ipv6(client_ip6(i), GATEWAY6)?;
            // Untranslated VIP traffic must fail at once and stay in the namespace:
            // without this route a packet to a VIP the hooks did not rewrite would leave
            // through the default route to the node namespace, whose answer (an ICMP
            // error, rate-limited by route.error_cost, or nothing at all) makes the
            // connect fail slowly or hang until its timeout. An `unreachable` route
            // makes the client's own route lookup fail with EHOSTUNREACH synchronously:
            // the packet is never built, and the tests can tell "not translated"
            // (EHOSTUNREACH) from "rejected by the hook" (ECONNREFUSED) at once.
            client
                .ns
                .ip(&["route", "add", "unreachable", SERVICE_CIDR])?;
            client
                .ns
                .ip(&["-6", "route", "add", "unreachable", SERVICE_CIDR6])?;
            topo.clients.push(client);
        }
        Ok(topo)
    }

    /// A namespace joined to the bridge with eth0 = `ip`/24, default route via br0.
    fn add_pod(&self, name: &str, ip: Ipv4Addr) -> Result<Pod> {
        // The bridge-side name only has to be unique in the node namespace (which is
        // ours alone).
        Pod::create(
            name,
            &format!("{}-{name}", self.base),
            ip,
            GATEWAY,
            &self.node,
            "br0",
            &format!("v{name}"),
        )
    }

    /// Start lb-echo on `ports` in every backend pod.
    pub fn start_echo(&mut self, echo_bin: &Path, ports: &[u16]) -> Result<()> {
        for pod in &mut self.pods {
            pod.start_echo(echo_bin, ports)?;
        }
        Ok(())
    }

    pub fn node(&self) -> &NetNs {
        &self.node
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    pub fn clients(&self) -> &[Pod] {
        &self.clients
    }

    /// The first client pod.
    pub fn client(&self) -> &Pod {
        &self.clients[0]
    }

    /// The backend pod called `name`.
    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .with_context(|| format!("no pod {name} in the topology"))
    }

    /// Backend pod `name`, to stop or start its server.
    pub fn pod_mut(&mut self, name: &str) -> Result<&mut Pod> {
        self.pods
            .iter_mut()
            .find(|p| p.name == name)
            .with_context(|| format!("no pod {name} in the topology"))
    }

    /// Unique prefix of this topology's namespace names.
    pub fn base(&self) -> &str {
        &self.base
    }
}
