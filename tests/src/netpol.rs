//! The NetworkPolicy conformance testbed, after the model of Kubernetes' netpol
//! e2e suite: namespaces x, y and z, pods a, b and c in each (nine pods, spread
//! over the two nodes of a [`Cluster`] so that every pod has peers on its own
//! node and on the other), each serving TCP and UDP on ports 80 and 81 under
//! named container ports (`serve-80-tcp`, ...), and one dual-stack ClusterIP
//! Service per pod (`s-x-a`, port 1080 -> 80 and 1081 -> 81 for both protocols:
//! a Service port other than the pod's, so that a policy's port can only match
//! after translation).
//!
//! Everything the agents need is written to their manifest directory as the API
//! server would serve it: the Namespaces (labels `ns: x` and
//! `kubernetes.io/metadata.name: x`), the Pods (labels `pod: a`, addresses,
//! node, named ports), the Services with their EndpointSlices, and the
//! NetworkPolicies a test applies ([`Netpol::apply`]).
//!
//! A [`Reachability`] says which (client pod, server pod, protocol, port) pairs
//! must connect; [`Netpol::expect`] probes the whole matrix (from each pod to
//! every other pod, by pod address and through the server's Service, for every
//! protocol and port, in each address family of the test) until it equals the
//! expectation or a bounded deadline passes, and otherwise fails with both
//! matrices side by side. Two probe processes per client pod (pod addresses,
//! Services) try all their targets at once with a short timeout, so a round
//! costs about half a second whatever is denied.
//!
//! A pod reaching itself is left out, as upstream leaves it out: by its own
//! address the traffic never leaves the pod, and through its Service it comes
//! back from the node's address (hairpin masquerade), which policy lets in on
//! ingress while the pod's egress policy still judges it: a verdict the matrix
//! of one boolean per pair cannot state.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::agent::SYNC_TIMEOUT;
use crate::cluster::{node_ip, node_name, Cluster};
use crate::manifests::{
    documents, namespace_yaml, network_policy_yaml, ContainerPort, Endpoint, EndpointSlice,
    PodManifest, Service, ServicePort,
};
use crate::probe::{ReachReport, ReachResult};
use crate::util::poll;
use crate::Tools;

/// The test namespaces.
pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
/// The pods of each namespace.
pub const POD_NAMES: [&str; 3] = ["a", "b", "c"];
/// Ports every pod serves, TCP and UDP.
pub const SERVED_PORTS: [u16; 2] = [80, 81];
/// A Service port is its target port plus this.
pub const SERVICE_PORT_OFFSET: u16 = 1000;

/// How long one attempt of a probe waits (TCP connect, then the greeting; a UDP
/// datagram sent again every 100 ms until an answer): long for a local network,
/// short enough for a matrix of denied pairs to take half a second.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(400);
/// How long [`Netpol::expect`] polls for the matrix to match.
pub const MATCH_DEADLINE: Duration = Duration::from_secs(20);
/// How long [`Netpol::start`] waits for the agents to serve every Service and
/// the whole matrix to answer.
pub const SERVED_DEADLINE: Duration = Duration::from_secs(30);

/// Client ports of the probes by pod address, and through Services: apart, since
/// a Service flow's reverse-translation entry (kept a while after the flow)
/// would claim the replies of a later flow from the same client port straight
/// to the backend, which the client then never sees (kube-proxy's conntrack
/// would refuse that second flow the same way).
const POD_PROBE_PORTS: (u16, u16) = (33_000, 45_999);
const SERVICE_PROBE_PORTS: (u16, u16) = (46_000, 58_999);

const POD_COUNT: usize = NAMESPACES.len() * POD_NAMES.len();

/// One of the nine pods: `x/a` is 0, `x/b` 1, ..., `z/c` 8.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef(usize);

impl PodRef {
    pub fn all() -> impl Iterator<Item = PodRef> {
        (0..POD_COUNT).map(PodRef)
    }

    /// `x/a` and the like; panics on anything else (tests write these literally).
    pub fn parse(text: &str) -> PodRef {
        let (ns, pod) = text.split_once('/').expect("a pod is written ns/pod");
        let n = NAMESPACES.iter().position(|&n| n == ns);
        let p = POD_NAMES.iter().position(|&p| p == pod);
        match (n, p) {
            (Some(n), Some(p)) => PodRef(n * POD_NAMES.len() + p),
            _ => panic!("no pod {text} in the model (x|y|z)/(a|b|c)"),
        }
    }

    pub fn namespace(self) -> &'static str {
        NAMESPACES[self.0 / POD_NAMES.len()]
    }

    /// The pod's name in its namespace: `a`.
    pub fn name(self) -> &'static str {
        POD_NAMES[self.0 % POD_NAMES.len()]
    }

    /// `x/a`.
    pub fn label(self) -> String {
        format!("{}/{}", self.namespace(), self.name())
    }

    /// The pod's name in the cluster (its network namespace, veth and the name
    /// lb-echo answers with): `x-a`.
    pub fn host_name(self) -> String {
        format!("{}-{}", self.namespace(), self.name())
    }

    /// Alternating, so every namespace has pods on both nodes.
    pub fn node(self) -> usize {
        self.0 % 2
    }

    /// Its Service: `s-x-a`.
    pub fn service_name(self) -> String {
        format!("s-{}", self.host_name())
    }

    fn index(self) -> u8 {
        u8::try_from(self.0).expect("nine pods")
    }

    /// The Service's IPv4 cluster IP: 10.96.50.10 for x/a.
    pub fn cluster_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(10, 96, 50, 10 + self.index())
    }

    /// The Service's IPv6 cluster IP: fd00:96::5:10 for x/a.
    pub fn cluster_ip6(self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 5, 0x10 + u16::from(self.index()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// As Kubernetes spells it.
    pub fn k8s(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

/// A protocol and a served port: one layer of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Case {
    pub protocol: Protocol,
    pub port: u16,
}

pub const TCP80: Case = Case {
    protocol: Protocol::Tcp,
    port: 80,
};
pub const TCP81: Case = Case {
    protocol: Protocol::Tcp,
    port: 81,
};
pub const UDP80: Case = Case {
    protocol: Protocol::Udp,
    port: 80,
};
pub const UDP81: Case = Case {
    protocol: Protocol::Udp,
    port: 81,
};
/// Every layer, in the order of [`Reachability`]'s cells.
pub const CASES: [Case; 4] = [TCP80, TCP81, UDP80, UDP81];

impl Case {
    fn index(self) -> usize {
        CASES.iter().position(|&c| c == self).expect("one of CASES")
    }

    /// The named container port serving it: `serve-80-tcp`.
    pub fn port_name(self) -> String {
        format!(
            "serve-{}-{}",
            self.port,
            self.protocol.k8s().to_ascii_lowercase()
        )
    }
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.protocol.k8s(), self.port)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

/// How a client addresses the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Via {
    /// The server pod's own address and port.
    PodIp,
    /// The server's Service: its cluster IP and Service port.
    Service,
}

/// A set of pods in an expectation: every pod, a namespace's, or one pod.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    namespace: Option<&'static str>,
    pod: Option<&'static str>,
}

/// Every pod.
pub const ANY: Peer = Peer {
    namespace: None,
    pod: None,
};

/// The pods of namespace `name`.
pub fn ns(name: &'static str) -> Peer {
    assert!(
        NAMESPACES.contains(&name),
        "no namespace {name} in the model"
    );
    Peer {
        namespace: Some(name),
        pod: None,
    }
}

/// One pod, written `x/a`.
pub fn pod(label: &'static str) -> Peer {
    let p = PodRef::parse(label);
    Peer {
        namespace: Some(p.namespace()),
        pod: Some(p.name()),
    }
}

impl Peer {
    fn matches(self, p: PodRef) -> bool {
        self.namespace.is_none_or(|n| n == p.namespace()) && self.pod.is_none_or(|n| n == p.name())
    }
}

/// Which client pods must reach which server pods, per protocol and port. The
/// same for pod addresses and Services, and for both families: policy is
/// judged on the server pod after translation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reachability {
    /// `[from][to][case]`.
    allowed: [[[bool; CASES.len()]; POD_COUNT]; POD_COUNT],
}

impl Reachability {
    /// Every pod reaches every pod on every port: no policy in effect.
    pub fn all_allowed() -> Self {
        Reachability {
            allowed: [[[true; CASES.len()]; POD_COUNT]; POD_COUNT],
        }
    }

    /// From every pod of `from` to every pod of `to`, on every protocol and port.
    pub fn expect(self, from: Peer, to: Peer, allowed: bool) -> Self {
        self.expect_on(&CASES, from, to, allowed)
    }

    /// [`Reachability::expect`] on `cases` only.
    pub fn expect_on(mut self, cases: &[Case], from: Peer, to: Peer, allowed: bool) -> Self {
        for f in PodRef::all().filter(|&p| from.matches(p)) {
            for t in PodRef::all().filter(|&p| to.matches(p)) {
                for case in cases {
                    self.allowed[f.0][t.0][case.index()] = allowed;
                }
            }
        }
        self
    }

    /// Everything into `to` (a pod or a namespace).
    pub fn expect_all_ingress(self, to: Peer, allowed: bool) -> Self {
        self.expect(ANY, to, allowed)
    }

    /// Everything out of `from`.
    pub fn expect_all_egress(self, from: Peer, allowed: bool) -> Self {
        self.expect(from, ANY, allowed)
    }

    pub fn allowed(&self, from: PodRef, to: PodRef, case: Case) -> bool {
        self.allowed[from.0][to.0][case.index()]
    }
}

/// A NetworkPolicy `namespace/name` with its spec as the API's JSON.
#[derive(Clone, Debug)]
pub struct Policy {
    pub namespace: String,
    pub name: String,
    pub spec: serde_json::Value,
}

/// A NetworkPolicy `namespace/name` whose spec is `spec` (NetworkPolicySpec JSON).
pub fn policy(namespace: &str, name: &str, spec: serde_json::Value) -> Policy {
    Policy {
        namespace: namespace.into(),
        name: name.into(),
        spec,
    }
}

impl Policy {
    fn file_name(&self) -> String {
        policy_file(&self.namespace, &self.name)
    }
}

fn policy_file(namespace: &str, name: &str) -> String {
    format!("netpol-{namespace}-{name}.yaml")
}

/// How to start a [`Netpol`].
#[derive(Clone, Debug)]
pub struct Setup {
    /// Flags of every agent.
    agent_args: Vec<String>,
    families: Vec<Family>,
    /// Written before the agents start.
    policies: Vec<Policy>,
}

impl Setup {
    /// Agents enforcing policy (`--network-policy on`), probing IPv4.
    pub fn enforcing() -> Self {
        Setup {
            // The metrics listener at its default address (the harness turns it
            // off for agents side by side; each node here has its own loopback),
            // where `lb policy POD` asks the agent.
            agent_args: [
                "--network-policy",
                "on",
                "--metrics-bind-address",
                "127.0.0.1:10249",
            ]
            .map(String::from)
            .to_vec(),
            families: vec![Family::V4],
            policies: Vec::new(),
        }
    }

    /// Agents with their default flags (policy enforcement left off), probing
    /// IPv4.
    pub fn default_flags() -> Self {
        Setup {
            agent_args: Vec::new(),
            ..Setup::enforcing()
        }
    }

    /// Probe over IPv6 instead.
    pub fn ipv6(mut self) -> Self {
        self.families = vec![Family::V6];
        self
    }

    /// Probe over both families.
    pub fn dual_stack(mut self) -> Self {
        self.families = vec![Family::V4, Family::V6];
        self
    }

    /// `policy` is in the manifest directory before the agents start: they read it
    /// with everything else at start, and [`Netpol::start`] expects nothing of
    /// the matrix.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policies.push(policy);
        self
    }
}

/// A client, its probe's arguments, and the probe each target stands for.
type ProbePlan = (PodRef, Vec<String>, HashMap<(Protocol, SocketAddr), Probe>);

/// One probe of a matrix round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Probe {
    family: Family,
    via: Via,
    case: Case,
    from: PodRef,
    to: PodRef,
}

/// What one probe saw.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    /// This pod answered.
    Answered(String),
    /// The failed call and its errno name.
    Failed(String),
}

impl Seen {
    fn reached(&self, to: PodRef) -> bool {
        matches!(self, Seen::Answered(name) if *name == to.host_name())
    }
}

/// One round of the whole matrix.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    seen: BTreeMap<Probe, Seen>,
}

/// The testbed. Dropping it drops the cluster (agents, pods, namespaces,
/// manifests).
pub struct Netpol {
    cluster: Cluster,
    families: Vec<Family>,
    /// Every pod's labels (the model's `pod: a` first).
    pod_labels: HashMap<PodRef, Vec<(String, String)>>,
    /// Every namespace's labels.
    namespace_labels: HashMap<&'static str, Vec<(String, String)>>,
}

impl Netpol {
    /// Build the cluster with the nine pods, write every manifest (and the
    /// setup's policies), start the agents and wait until both serve every
    /// Service. Without policies at start, then also until the whole matrix
    /// answers (the harness works before any policy is applied).
    pub fn start(tools: Tools, lb: &std::path::Path, setup: Setup) -> Result<Self> {
        let mut builder = Cluster::builder();
        for p in PodRef::all() {
            builder = builder.echo_server(&p.host_name(), p.node(), &SERVED_PORTS);
        }
        let cluster = builder.build(tools)?;
        let pod_labels = PodRef::all()
            .map(|p| (p, vec![("pod".to_string(), p.name().to_string())]))
            .collect();
        let namespace_labels = NAMESPACES
            .iter()
            .map(|&n| (n, model_namespace_labels(n)))
            .collect();
        let mut netpol = Netpol {
            cluster,
            families: setup.families.clone(),
            pod_labels,
            namespace_labels,
        };
        netpol.write_model()?;
        for p in &setup.policies {
            netpol.apply(p)?;
        }
        netpol
            .cluster
            .start_agents(lb, |_| setup.agent_args.clone())?;
        netpol.wait_served()?;
        if setup.policies.is_empty() {
            netpol
                .expect_within(&Reachability::all_allowed(), SERVED_DEADLINE)
                .context("before any policy, every pod must reach every other")?;
        }
        Ok(netpol)
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// `lb policy NS/NAME --json ARGS...` for pod `label` (`x/a`), run on its
    /// node (in that node's namespace, where the agent's metrics listener is), as
    /// an operator on the node would.
    pub fn lb_policy(&self, label: &str, args: &[&str]) -> Result<serde_json::Value> {
        let node = self.cluster.node(PodRef::parse(label).node());
        node.agent().pod_policy(node.netns(), label, args)
    }

    /// Pod `label`'s (`x/a`) address in `family`.
    pub fn pod_ip(&self, label: &str, family: Family) -> Result<IpAddr> {
        let p = PodRef::parse(label);
        let pod = self.cluster.pod(&p.host_name())?;
        Ok(match family {
            Family::V4 => pod.ip().into(),
            Family::V6 => pod.ip6().context("dual-stack pods")?.into(),
        })
    }

    /// `pod_ip` as a host CIDR (/32 or /128), for an ipBlock.
    pub fn pod_cidr(&self, label: &str, family: Family) -> Result<String> {
        let ip = self.pod_ip(label, family)?;
        let len = if ip.is_ipv4() { 32 } else { 128 };
        Ok(format!("{ip}/{len}"))
    }

    /// The /4 holding pod `label`'s address (upstream's "large CIDR" around a
    /// pod: every pod address of the cluster falls in it).
    pub fn wide_cidr_around(&self, label: &str, family: Family) -> Result<String> {
        Ok(match self.pod_ip(label, family)? {
            IpAddr::V4(ip) => format!("{}/4", Ipv4Addr::from(u32::from(ip) & 0xf000_0000)),
            IpAddr::V6(ip) => format!("{}/4", Ipv6Addr::from(u128::from(ip) & (0xf << 124))),
        })
    }

    /// Create or replace `policy` (its file in the manifest directory).
    pub fn apply(&self, policy: &Policy) -> Result<()> {
        write_policy(&self.cluster, policy)
    }

    /// Delete NetworkPolicy `namespace/name`.
    pub fn delete(&self, namespace: &str, name: &str) -> Result<()> {
        self.cluster.manifests.remove(&policy_file(namespace, name))
    }

    /// Give pod `label` (`x/a`) the labels `extra` beside its `pod` label.
    pub fn set_pod_labels(&mut self, label: &str, extra: &[(&str, &str)]) -> Result<()> {
        let p = PodRef::parse(label);
        let mut labels = vec![("pod".to_string(), p.name().to_string())];
        labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self.pod_labels.insert(p, labels);
        self.write_pod(p)
    }

    /// Give namespace `name` the labels `extra` beside its model labels.
    pub fn set_namespace_labels(
        &mut self,
        name: &'static str,
        extra: &[(&str, &str)],
    ) -> Result<()> {
        let mut labels = model_namespace_labels(name);
        labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self.namespace_labels.insert(name, labels);
        self.write_namespace(name)
    }

    fn write_model(&self) -> Result<()> {
        for n in NAMESPACES {
            self.write_namespace(n)?;
        }
        for p in PodRef::all() {
            self.write_pod(p)?;
            self.write_service(p)?;
        }
        Ok(())
    }

    fn write_namespace(&self, name: &'static str) -> Result<()> {
        let yaml = namespace_yaml(name, &self.namespace_labels[name]);
        self.cluster
            .manifests
            .write(&format!("ns-{name}.yaml"), &yaml)
    }

    fn write_pod(&self, p: PodRef) -> Result<()> {
        let pod = self.cluster.pod(&p.host_name())?;
        let mut ips: Vec<IpAddr> = vec![pod.ip().into()];
        ips.extend(pod.ip6().map(IpAddr::from));
        let ports = CASES
            .iter()
            .map(|c| ContainerPort {
                name: c.port_name(),
                port: c.port,
                protocol: c.protocol.k8s(),
            })
            .collect();
        let manifest = PodManifest {
            namespace: p.namespace().into(),
            name: p.name().into(),
            labels: self.pod_labels[&p].clone(),
            node: node_name(p.node()),
            host_ip: node_ip(p.node()).into(),
            ips,
            ports,
            host_network: false,
        };
        self.cluster
            .manifests
            .write(&format!("pod-{}.yaml", p.host_name()), &manifest.to_yaml())
    }

    /// The pod's Service and its two EndpointSlices (one per family).
    fn service(&self, p: PodRef) -> Service {
        let ports = CASES
            .iter()
            .map(|c| {
                let name = format!("{}-{}", c.protocol.k8s().to_ascii_lowercase(), c.port);
                let port = u32::from(c.port + SERVICE_PORT_OFFSET);
                match c.protocol {
                    Protocol::Tcp => ServicePort::tcp(&name, port, c.port.into()),
                    Protocol::Udp => ServicePort::udp(&name, port, c.port.into()),
                }
            })
            .collect();
        Service::new(&p.service_name(), p.cluster_ip(), ports)
            .in_namespace(p.namespace())
            .dual_stack(p.cluster_ip6())
    }

    fn write_service(&self, p: PodRef) -> Result<()> {
        let svc = self.service(p);
        let endpoint = |family| -> Result<Endpoint> {
            let ip = self.pod_ip(&p.label(), family)?;
            Ok(Endpoint::ready(p.name(), ip).on_node(&node_name(p.node())))
        };
        let docs = [
            svc.to_yaml(),
            EndpointSlice::for_service(&svc, vec![endpoint(Family::V4)?]).to_yaml(),
            EndpointSlice::ipv6_for_service(&svc, vec![endpoint(Family::V6)?]).to_yaml(),
        ];
        self.cluster
            .manifests
            .write(&format!("svc-{}.yaml", p.host_name()), &documents(docs))
    }

    /// Where a client sends `case` to `to`.
    fn target(&self, to: PodRef, case: Case, family: Family, via: Via) -> Result<SocketAddr> {
        Ok(match via {
            Via::PodIp => SocketAddr::new(self.pod_ip(&to.label(), family)?, case.port),
            Via::Service => {
                let ip: IpAddr = match family {
                    Family::V4 => to.cluster_ip().into(),
                    Family::V6 => to.cluster_ip6().into(),
                };
                SocketAddr::new(ip, case.port + SERVICE_PORT_OFFSET)
            }
        })
    }

    /// Both agents list every Service frontend with its one backend.
    fn wait_served(&self) -> Result<()> {
        let mut want = Vec::new();
        for p in PodRef::all() {
            for family in [Family::V4, Family::V6] {
                let backend_ip = self.pod_ip(&p.label(), family)?;
                for case in CASES {
                    let frontend = self.target(p, case, family, Via::Service)?;
                    let backend = SocketAddr::new(backend_ip, case.port);
                    want.push((frontend, case.protocol.k8s(), backend));
                }
            }
        }
        for node in self.cluster.nodes() {
            node.agent().wait_services(
                &format!(
                    "{} to serve the {} Service frontends",
                    node.name(),
                    want.len()
                ),
                SYNC_TIMEOUT,
                |entries| {
                    want.iter().all(|(frontend, protocol, backend)| {
                        entries.iter().any(|e| {
                            e.is(frontend.ip(), frontend.port(), protocol)
                                && e.backend_addrs() == [*backend].into()
                        })
                    })
                },
            )?;
        }
        Ok(())
    }

    /// A long-lived TCP connection from pod `from` to pod `to` (`x/a`) on served
    /// port `port` (an echo), addressed as `via` says, over IPv4.
    pub fn hold(&self, from: &str, to: &str, port: u16, via: Via) -> Result<crate::Hold> {
        let case = Case {
            protocol: Protocol::Tcp,
            port,
        };
        let addr = self.target(PodRef::parse(to), case, Family::V4, via)?;
        let client = self.cluster.pod(&PodRef::parse(from).host_name())?;
        self.cluster.hold(client.netns(), addr)
    }

    /// One `lb-probe reach` of client `from`: its targets `via`, the probe's
    /// arguments, and which probe each (protocol, address) answers.
    fn plan(&self, from: PodRef, via: Via) -> Result<ProbePlan> {
        let mut by_target = HashMap::new();
        let (mut tcp, mut udp) = (Vec::new(), Vec::new());
        for to in PodRef::all().filter(|&to| to != from) {
            for &family in &self.families {
                for case in CASES {
                    let addr = self.target(to, case, family, via)?;
                    match case.protocol {
                        Protocol::Tcp => tcp.push(addr),
                        Protocol::Udp => udp.push(addr),
                    }
                    let probe = Probe {
                        family,
                        via,
                        case,
                        from,
                        to,
                    };
                    by_target.insert((case.protocol, addr), probe);
                }
            }
        }
        let (lo, hi) = match via {
            Via::PodIp => POD_PROBE_PORTS,
            Via::Service => SERVICE_PROBE_PORTS,
        };
        let mut args = vec![
            "reach".to_string(),
            "--timeout-ms".into(),
            PROBE_TIMEOUT.as_millis().to_string(),
            "--local-ports".into(),
            format!("{lo}-{hi}"),
        ];
        args.extend(tcp.iter().flat_map(|a| ["--tcp".into(), a.to_string()]));
        args.extend(udp.iter().flat_map(|a| ["--udp".into(), a.to_string()]));
        Ok((from, args, by_target))
    }

    /// Probe the whole matrix once: all client pods at once, each trying all its
    /// targets at once (one probe process for pod addresses, one for Services).
    pub fn observe(&self) -> Result<Observation> {
        let mut plans = Vec::new();
        for from in PodRef::all() {
            for via in [Via::PodIp, Via::Service] {
                plans.push(self.plan(from, via)?);
            }
        }
        let reports: Vec<Result<ReachReport>> = std::thread::scope(|scope| {
            let running: Vec<_> = plans
                .iter()
                .map(|(from, args, _)| {
                    scope.spawn(move || -> Result<ReachReport> {
                        let pod = self.cluster.pod(&from.host_name())?;
                        self.cluster
                            .probe_in(pod.netns(), args, Duration::from_secs(15))
                    })
                })
                .collect();
            running
                .into_iter()
                .map(|r| r.join().expect("a probe thread panicked"))
                .collect()
        });
        let mut seen = BTreeMap::new();
        for ((from, _, by_target), report) in plans.iter().zip(reports) {
            let report = report.with_context(|| format!("probing from {}", from.label()))?;
            ensure!(
                report.results.len() == by_target.len(),
                "lb-probe reach from {} gave {} results for {} targets",
                from.label(),
                report.results.len(),
                by_target.len()
            );
            for r in report.results {
                let protocol = match r.protocol.as_str() {
                    "tcp" => Protocol::Tcp,
                    "udp" => Protocol::Udp,
                    other => bail!("lb-probe reach: unknown protocol {other}"),
                };
                let probe = by_target
                    .get(&(protocol, r.to))
                    .with_context(|| format!("lb-probe reach answered for {r:?}, not asked"))?;
                seen.insert(*probe, seen_of(r));
            }
        }
        Ok(Observation { seen })
    }

    /// Poll the matrix until it is `want`, at most [`MATCH_DEADLINE`]; on failure
    /// the error shows the expected and last observed matrices where they differ.
    pub fn expect(&self, want: &Reachability) -> Result<()> {
        self.expect_within(want, MATCH_DEADLINE)
    }

    fn expect_within(&self, want: &Reachability, deadline: Duration) -> Result<()> {
        let mut last = None;
        let mut rounds = 0u32;
        let result = poll("the reachability matrix to match", deadline, || {
            rounds += 1;
            let seen = self.observe()?;
            let matched = seen.mismatches(want).is_empty();
            last = Some(seen);
            Ok(matched.then_some(()))
        });
        result.map_err(|e| match &last {
            Some(seen) => e.context(format!(
                "after {rounds} rounds:\n{}\n{}",
                seen.report(want),
                self.cluster.all_stats()
            )),
            None => e.context(format!("no round completed in {rounds} attempts")),
        })
    }
}

/// A namespace's labels in the model: its name under the label the API server
/// sets, and `ns: <name>`.
fn model_namespace_labels(name: &str) -> Vec<(String, String)> {
    vec![
        ("kubernetes.io/metadata.name".to_string(), name.to_string()),
        ("ns".to_string(), name.to_string()),
    ]
}

fn write_policy(cluster: &Cluster, policy: &Policy) -> Result<()> {
    let yaml = network_policy_yaml(&policy.namespace, &policy.name, &policy.spec);
    cluster.manifests.write(&policy.file_name(), &yaml)
}

fn seen_of(r: ReachResult) -> Seen {
    match (r.answer, r.error) {
        (Some(name), _) => Seen::Answered(name),
        (None, Some(error)) => Seen::Failed(error),
        (None, None) => Seen::Failed("no answer".into()),
    }
}

impl Observation {
    fn mismatches(&self, want: &Reachability) -> Vec<(&Probe, &Seen)> {
        self.seen
            .iter()
            .filter(|(p, s)| s.reached(p.to) != want.allowed(p.from, p.to, p.case))
            .collect()
    }

    /// For each layer (family, via, case) that differs from `want`: the
    /// expected and observed matrices side by side (`.` reached, `X` not, `?`
    /// another pod answered, `-` not probed; a `!` marks a difference), then
    /// the differing probes with what they saw.
    pub fn report(&self, want: &Reachability) -> String {
        let wrong = self.mismatches(want);
        let mut out = format!(
            "{} of {} probes differ from the expectation\n",
            wrong.len(),
            self.seen.len()
        );
        let mut layers: Vec<(Family, Via, Case)> = wrong
            .iter()
            .map(|(p, _)| (p.family, p.via, p.case))
            .collect();
        layers.dedup();
        for (family, via, case) in layers {
            let _ = writeln!(out, "\n{case} {family:?} via {via:?}: expected | observed");
            out += &self.layer_table(want, family, via, case);
        }
        out += "\ndiffering probes:\n";
        for (p, s) in wrong.iter().take(40) {
            let _ = writeln!(
                out,
                "  {} -> {} {} {:?} via {:?}: expected {}, saw {s:?}",
                p.from.label(),
                p.to.label(),
                p.case,
                p.family,
                p.via,
                if want.allowed(p.from, p.to, p.case) {
                    "reached"
                } else {
                    "blocked"
                }
            );
        }
        out
    }

    fn layer_table(&self, want: &Reachability, family: Family, via: Via, case: Case) -> String {
        let header: String = PodRef::all().map(|p| format!("{:>5}", p.label())).collect();
        let mut out = format!("{:6}{header}   |{:6}{header}\n", "", "");
        for from in PodRef::all() {
            let mut expected = String::new();
            let mut observed = String::new();
            for to in PodRef::all() {
                let probe = Probe {
                    family,
                    via,
                    case,
                    from,
                    to,
                };
                let want_it = want.allowed(from, to, case);
                let (e, o) = match self.seen.get(&probe) {
                    None => ("-", "-".to_string()),
                    Some(s) => {
                        let o = match s {
                            s if s.reached(to) => ".",
                            Seen::Answered(_) => "?",
                            Seen::Failed(_) => "X",
                        };
                        let mark = if s.reached(to) != want_it { "!" } else { "" };
                        (if want_it { "." } else { "X" }, format!("{mark}{o}"))
                    }
                };
                let _ = write!(expected, "{e:>5}");
                let _ = write!(observed, "{o:>5}");
            }
            let _ = writeln!(
                out,
                "{:6}{expected}   |{:6}{observed}",
                from.label(),
                from.label()
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_are_named_and_placed_as_the_model_says() {
        let labels: Vec<String> = PodRef::all().map(PodRef::label).collect();
        assert_eq!(
            labels,
            ["x/a", "x/b", "x/c", "y/a", "y/b", "y/c", "z/a", "z/b", "z/c"]
        );
        let x_b = PodRef::parse("x/b");
        assert_eq!(x_b.host_name(), "x-b");
        assert_eq!(x_b.service_name(), "s-x-b");
        // Every namespace has pods on both nodes.
        for n in NAMESPACES {
            let nodes: std::collections::BTreeSet<usize> = PodRef::all()
                .filter(|p| p.namespace() == n)
                .map(PodRef::node)
                .collect();
            assert_eq!(nodes.len(), 2, "namespace {n}");
        }
        assert_eq!(TCP81.port_name(), "serve-81-tcp");
        assert_eq!(UDP80.port_name(), "serve-80-udp");
        assert_eq!(
            PodRef::parse("z/c").cluster_ip6().to_string(),
            "fd00:96::5:18"
        );
    }

    #[test]
    fn reachability_builder_sets_exactly_what_it_names() {
        let r = Reachability::all_allowed()
            .expect(ANY, ns("x"), false)
            .expect_on(&[TCP81], pod("y/a"), pod("x/b"), true);
        let count = |r: &Reachability| {
            let mut n = 0;
            for f in PodRef::all() {
                for t in PodRef::all() {
                    n += CASES.iter().filter(|&&c| !r.allowed(f, t, c)).count();
                }
            }
            n
        };
        // 9 clients x 3 servers x 4 cases, less the one pair reopened on TCP 81.
        assert_eq!(count(&r), 9 * 3 * 4 - 1);
        let (y_a, x_b) = (PodRef::parse("y/a"), PodRef::parse("x/b"));
        assert!(r.allowed(y_a, x_b, TCP81));
        assert!(!r.allowed(y_a, x_b, TCP80));
        assert!(r.allowed(x_b, y_a, UDP81));
        let egress = Reachability::all_allowed().expect_all_egress(pod("z/c"), false);
        assert_eq!(count(&egress), 9 * 4);
    }

    #[test]
    fn report_marks_the_differences() {
        let want = Reachability::all_allowed().expect(pod("y/a"), pod("x/a"), false);
        let mut seen = Observation::default();
        for (from, to, answer) in [("y/a", "x/a", Some("x-a")), ("x/b", "x/a", None)] {
            let probe = Probe {
                family: Family::V4,
                via: Via::Service,
                case: TCP80,
                from: PodRef::parse(from),
                to: PodRef::parse(to),
            };
            let s = match answer {
                Some(name) => Seen::Answered(name.into()),
                None => Seen::Failed("connect ETIMEDOUT".into()),
            };
            seen.seen.insert(probe, s);
        }
        assert_eq!(seen.mismatches(&want).len(), 2);
        let text = seen.report(&want);
        assert!(text.contains("2 of 2 probes differ"), "{text}");
        assert!(text.contains("TCP/80 V4 via Service"), "{text}");
        assert!(text.contains("!."), "{text}");
        assert!(text.contains("!X"), "{text}");
        assert!(text.contains("x/b -> x/a"), "{text}");
    }
}
