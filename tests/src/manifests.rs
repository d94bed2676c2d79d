//! Kubernetes manifests for the agent, written as YAML in the shape `kubectl get -o
//! yaml` prints (apiVersion, kind, metadata with namespace/uid/resourceVersion, spec),
//! into a directory the agent watches.

use std::fmt::Write as _;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::util::unique_name;

/// Namespace of every object the tests create.
pub const NAMESPACE: &str = "demo";

/// One port of a Service.
#[derive(Clone, Debug)]
pub struct ServicePort {
    pub name: String,
    pub port: u32,
    pub target_port: u32,
    pub protocol: &'static str,
    /// `nodePort` (for `type: NodePort`/`LoadBalancer` Services).
    pub node_port: Option<u32>,
}

impl ServicePort {
    pub fn tcp(name: &str, port: u32, target_port: u32) -> Self {
        Self::new(name, port, target_port, "TCP")
    }

    pub fn udp(name: &str, port: u32, target_port: u32) -> Self {
        Self::new(name, port, target_port, "UDP")
    }

    fn new(name: &str, port: u32, target_port: u32, protocol: &'static str) -> Self {
        ServicePort {
            name: name.into(),
            port,
            target_port,
            protocol,
            node_port: None,
        }
    }

    pub fn with_node_port(mut self, node_port: u32) -> Self {
        self.node_port = Some(node_port);
        self
    }
}

/// A ClusterIP Service. Port numbers are `u32` so tests can write invalid ones.
#[derive(Clone, Debug)]
pub struct Service {
    pub name: String,
    /// `metadata.namespace` (default [`NAMESPACE`]).
    pub namespace: String,
    pub cluster_ip: String,
    /// `spec.clusterIPs` after `cluster_ip` (dual-stack: the other family's).
    pub more_cluster_ips: Vec<String>,
    /// `spec.ipFamilies`, e.g. `["IPv4"]`.
    pub ip_families: Vec<&'static str>,
    pub ports: Vec<ServicePort>,
    /// `sessionAffinity: ClientIP` with this timeout, or `None`.
    pub affinity_timeout_sec: Option<u32>,
    /// `spec.type`: `ClusterIP` (default), `NodePort` or `LoadBalancer`.
    pub service_type: &'static str,
    /// `spec.externalTrafficPolicy` (written for NodePort and LoadBalancer Services).
    pub external_traffic_policy: &'static str,
    /// `spec.externalIPs`.
    pub external_ips: Vec<String>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<String>,
    /// `spec.healthCheckNodePort` (LoadBalancer with externalTrafficPolicy: Local).
    pub health_check_node_port: Option<u16>,
    /// `spec.trafficDistribution`, e.g. `PreferSameZone`.
    pub traffic_distribution: Option<&'static str>,
    /// `spec.loadBalancerSourceRanges`.
    pub load_balancer_source_ranges: Vec<String>,
    /// `ipMode` of every `status.loadBalancer.ingress[]` (default `VIP`).
    pub ip_mode: &'static str,
    /// `metadata.annotations`.
    pub annotations: Vec<(String, String)>,
}

impl Service {
    pub fn new(name: &str, cluster_ip: Ipv4Addr, ports: Vec<ServicePort>) -> Self {
        Service {
            name: name.into(),
            namespace: NAMESPACE.into(),
            cluster_ip: cluster_ip.to_string(),
            more_cluster_ips: Vec::new(),
            ip_families: vec!["IPv4"],
            ports,
            affinity_timeout_sec: None,
            service_type: "ClusterIP",
            external_traffic_policy: "Cluster",
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            health_check_node_port: None,
            traffic_distribution: None,
            load_balancer_source_ranges: Vec::new(),
            ip_mode: "VIP",
            annotations: Vec::new(),
        }
    }

    /// In namespace `namespace` instead of [`NAMESPACE`] (its EndpointSlices
    /// follow it).
    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// An annotation, e.g. `service.lb/algorithm: maglev`.
    pub fn with_annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// `spec.trafficDistribution` (the EndpointSlice controller's cue to write
    /// zone hints; see [`Endpoint::in_zone`]).
    pub fn with_traffic_distribution(mut self, value: &'static str) -> Self {
        self.traffic_distribution = Some(value);
        self
    }

    /// Dual-stack (`ipFamilyPolicy: RequireDualStack`): `ip` is the second cluster IP.
    pub fn dual_stack(mut self, ip: std::net::Ipv6Addr) -> Self {
        self.more_cluster_ips.push(ip.to_string());
        self.ip_families.push("IPv6");
        self
    }

    /// IPv6 only: `ip` is the cluster IP.
    pub fn ipv6_only(mut self, ip: std::net::Ipv6Addr) -> Self {
        self.cluster_ip = ip.to_string();
        self.ip_families = vec!["IPv6"];
        self
    }

    /// `spec.loadBalancerSourceRanges`.
    pub fn with_source_ranges(mut self, cidrs: &[&str]) -> Self {
        self.load_balancer_source_ranges = cidrs.iter().map(|c| c.to_string()).collect();
        self
    }

    /// `ipMode` of the load-balancer ingress addresses (`VIP` or `Proxy`).
    pub fn with_ip_mode(mut self, mode: &'static str) -> Self {
        self.ip_mode = mode;
        self
    }

    /// `type: NodePort` (give the ports a node port with
    /// [`ServicePort::with_node_port`]).
    pub fn node_port(mut self) -> Self {
        self.service_type = "NodePort";
        self
    }

    /// `type: LoadBalancer` with these addresses in `status.loadBalancer.ingress`.
    pub fn load_balancer<I: IntoIterator<Item = impl Into<std::net::IpAddr>>>(
        mut self,
        ips: I,
    ) -> Self {
        self.service_type = "LoadBalancer";
        self.load_balancer_ips = ips.into_iter().map(|ip| ip.into().to_string()).collect();
        self
    }

    /// `spec.externalIPs`.
    pub fn with_external_ips<I: IntoIterator<Item = impl Into<std::net::IpAddr>>>(
        mut self,
        ips: I,
    ) -> Self {
        self.external_ips = ips.into_iter().map(|ip| ip.into().to_string()).collect();
        self
    }

    /// `spec.healthCheckNodePort`.
    pub fn with_health_check_node_port(mut self, port: u16) -> Self {
        self.health_check_node_port = Some(port);
        self
    }

    /// `externalTrafficPolicy: Local`.
    pub fn external_local(mut self) -> Self {
        self.external_traffic_policy = "Local";
        self
    }

    pub fn with_affinity(mut self, timeout_sec: u32) -> Self {
        self.affinity_timeout_sec = Some(timeout_sec);
        self
    }

    pub fn to_yaml(&self) -> String {
        let mut y = String::new();
        y += "apiVersion: v1\nkind: Service\n";
        y += &metadata_in(&self.namespace, &self.name, &[("app", &self.name)]);
        if !self.annotations.is_empty() {
            y += "  annotations:\n";
            for (k, v) in &self.annotations {
                let _ = writeln!(y, "    {k}: {v}");
            }
        }
        y += "spec:\n";
        let _ = writeln!(y, "  clusterIP: {}", self.cluster_ip);
        let _ = writeln!(y, "  clusterIPs:\n  - {}", self.cluster_ip);
        for ip in &self.more_cluster_ips {
            let _ = writeln!(y, "  - {ip}");
        }

        y += "  internalTrafficPolicy: Cluster\n  ipFamilies:\n";
        for family in &self.ip_families {
            let _ = writeln!(y, "  - {family}");
        }
        if !self.external_ips.is_empty() {
            y += "  externalIPs:\n";
            for ip in &self.external_ips {
                let _ = writeln!(y, "  - {ip}");
            }
        }
        let external = matches!(self.service_type, "NodePort" | "LoadBalancer");
        if external {
            let _ = writeln!(
                y,
                "  externalTrafficPolicy: {}",
                self.external_traffic_policy
            );
        }
        if let Some(port) = self.health_check_node_port {
            let _ = writeln!(y, "  healthCheckNodePort: {port}");
        }
        if !self.load_balancer_source_ranges.is_empty() {
            y += "  loadBalancerSourceRanges:\n";
            for cidr in &self.load_balancer_source_ranges {
                let _ = writeln!(y, "  - {cidr}");
            }
        }
        let policy = if self.more_cluster_ips.is_empty() {
            "SingleStack"
        } else {
            "RequireDualStack"
        };
        let _ = writeln!(y, "  ipFamilyPolicy: {policy}\n  ports:");
        for p in &self.ports {
            let _ = writeln!(y, "  - name: {}", p.name);
            if let Some(node_port) = p.node_port {
                let _ = writeln!(y, "    nodePort: {node_port}");
            }
            let _ = writeln!(y, "    port: {}", p.port);
            let _ = writeln!(y, "    protocol: {}", p.protocol);
            let _ = writeln!(y, "    targetPort: {}", p.target_port);
        }
        let _ = writeln!(y, "  selector:\n    app: {}", self.name);
        match self.affinity_timeout_sec {
            Some(t) => {
                y += "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n";
                let _ = writeln!(y, "    clientIP:\n      timeoutSeconds: {t}");
            }
            None => y += "  sessionAffinity: None\n",
        }
        if let Some(value) = self.traffic_distribution {
            let _ = writeln!(y, "  trafficDistribution: {value}");
        }
        let _ = writeln!(y, "  type: {}", self.service_type);
        if self.load_balancer_ips.is_empty() {
            y += "status:\n  loadBalancer: {}\n";
        } else {
            y += "status:\n  loadBalancer:\n    ingress:\n";
            for ip in &self.load_balancer_ips {
                let _ = writeln!(y, "    - ip: {ip}\n      ipMode: {}", self.ip_mode);
            }
        }
        y
    }
}

/// `conditions` of one endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Conditions {
    pub const READY: Conditions = Conditions {
        ready: true,
        serving: true,
        terminating: false,
    };
    /// Being deleted but still serving (KEP-1669): used only when nothing is ready.
    pub const TERMINATING_SERVING: Conditions = Conditions {
        ready: false,
        serving: true,
        terminating: true,
    };
    /// Not ready and not serving (e.g. failing its readiness probe).
    pub const NOT_READY: Conditions = Conditions {
        ready: false,
        serving: false,
        terminating: false,
    };
}

/// One endpoint of an EndpointSlice: a pod address.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub ip: std::net::IpAddr,
    pub pod: String,
    pub node: String,
    pub conditions: Conditions,
    /// `zone`, also written as the endpoint's only `hints.forZones` entry, as the
    /// EndpointSlice controller writes it for a Service preferring its zone.
    pub zone: Option<String>,
}

impl Endpoint {
    pub fn ready(pod: &str, ip: impl Into<std::net::IpAddr>) -> Self {
        Endpoint {
            ip: ip.into(),
            pod: pod.into(),
            node: NODE_NAME.into(),
            conditions: Conditions::READY,
            zone: None,
        }
    }

    pub fn with_conditions(mut self, conditions: Conditions) -> Self {
        self.conditions = conditions;
        self
    }

    /// In `zone`, hinted for it (see [`Endpoint::zone`]).
    pub fn in_zone(mut self, zone: &str) -> Self {
        self.zone = Some(zone.into());
        self
    }

    /// `nodeName` (default [`NODE_NAME`]).
    pub fn on_node(mut self, node: &str) -> Self {
        self.node = node.into();
        self
    }
}

/// Node name the endpoints carry and the agent is started with.
pub const NODE_NAME: &str = "node-1";

/// A port of an EndpointSlice: named like the Service port it serves.
#[derive(Clone, Debug)]
pub struct SlicePort {
    pub name: String,
    pub port: u32,
    pub protocol: &'static str,
}

impl SlicePort {
    /// The slice port matching a Service port (same name, the target port).
    pub fn for_service_port(p: &ServicePort) -> Self {
        SlicePort {
            name: p.name.clone(),
            port: p.target_port,
            protocol: p.protocol,
        }
    }
}

/// An EndpointSlice of `service` (linked by the `kubernetes.io/service-name` label).
#[derive(Clone, Debug)]
pub struct EndpointSlice {
    pub name: String,
    pub service: String,
    /// The Service's namespace, which the slice and its pods' references share.
    pub namespace: String,
    pub endpoints: Vec<Endpoint>,
    pub ports: Vec<SlicePort>,
    /// `addressType: IPv6` (else IPv4).
    pub ipv6: bool,
}

impl EndpointSlice {
    /// The slice the EndpointSlice controller would write for `svc`: `<svc>-xxxxx`,
    /// with one port per Service port.
    pub fn for_service(svc: &Service, endpoints: Vec<Endpoint>) -> Self {
        EndpointSlice {
            name: format!("{}-x7k2p", svc.name),
            service: svc.name.clone(),
            namespace: svc.namespace.clone(),
            endpoints,
            ports: svc.ports.iter().map(SlicePort::for_service_port).collect(),
            ipv6: false,
        }
    }

    /// The IPv6 slice of a dual-stack Service: `<svc>-v6xyz`, `addressType: IPv6`.
    pub fn ipv6_for_service(svc: &Service, endpoints: Vec<Endpoint>) -> Self {
        EndpointSlice {
            name: format!("{}-v6xyz", svc.name),
            ipv6: true,
            ..EndpointSlice::for_service(svc, endpoints)
        }
    }

    pub fn to_yaml(&self) -> String {
        let mut y = String::new();
        let family = if self.ipv6 { "IPv6" } else { "IPv4" };
        let _ = writeln!(y, "addressType: {family}\napiVersion: discovery.k8s.io/v1");
        if self.endpoints.is_empty() {
            // kubectl prints `endpoints: null` for a slice without endpoints.
            y += "endpoints: null\n";
        } else {
            y += "endpoints:\n";
        }
        for e in &self.endpoints {
            let c = e.conditions;
            // IPv6 addresses quoted, as kubectl prints them.
            if e.ip.is_ipv6() {
                let _ = writeln!(y, "- addresses:\n  - \"{}\"", e.ip);
            } else {
                let _ = writeln!(y, "- addresses:\n  - {}", e.ip);
            }
            let _ = writeln!(
                y,
                "  conditions:\n    ready: {}\n    serving: {}\n    terminating: {}",
                c.ready, c.serving, c.terminating
            );
            if let Some(zone) = &e.zone {
                let _ = writeln!(y, "  hints:\n    forZones:\n    - name: {zone}");
            }
            let _ = writeln!(y, "  nodeName: {}", e.node);
            let _ = writeln!(
                y,
                "  targetRef:\n    kind: Pod\n    name: {}\n    namespace: {}\n    uid: {}",
                e.pod,
                self.namespace,
                fake_uid(&e.pod)
            );
            if let Some(zone) = &e.zone {
                let _ = writeln!(y, "  zone: {zone}");
            }
        }
        y += "kind: EndpointSlice\n";
        y += &metadata_in(
            &self.namespace,
            &self.name,
            &[
                (
                    "endpointslice.kubernetes.io/managed-by",
                    "endpointslice-controller.k8s.io",
                ),
                ("kubernetes.io/service-name", &self.service),
            ],
        );
        if self.ports.is_empty() {
            y += "ports: null\n";
        } else {
            y += "ports:\n";
        }
        for p in &self.ports {
            let _ = writeln!(
                y,
                "- name: {}\n  port: {}\n  protocol: {}",
                p.name, p.port, p.protocol
            );
        }
        y
    }
}

/// `labels:` at `indent`, every value quoted: `ns: y` unquoted is a boolean to
/// the API's YAML 1.1 reader, so kubectl prints such values quoted too.
fn labels_yaml(indent: &str, labels: &[(String, String)]) -> String {
    let mut y = String::new();
    if labels.is_empty() {
        return y;
    }
    let _ = writeln!(y, "{indent}labels:");
    for (k, v) in labels {
        let _ = writeln!(y, "{indent}  {k}: \"{v}\"");
    }
    y
}

/// `metadata:` of a namespaced object with quoted label values (see
/// [`labels_yaml`]).
fn object_metadata(namespace: Option<&str>, name: &str, labels: &[(String, String)]) -> String {
    static VERSION: AtomicU32 = AtomicU32::new(500_000);
    let mut y = String::from("metadata:\n  creationTimestamp: \"2024-05-01T10:00:00Z\"\n");
    y += &labels_yaml("  ", labels);
    let _ = writeln!(y, "  name: {name}");
    if let Some(namespace) = namespace {
        let _ = writeln!(y, "  namespace: {namespace}");
    }
    let _ = writeln!(
        y,
        "  resourceVersion: \"{}\"",
        VERSION.fetch_add(1, Ordering::Relaxed)
    );
    let uid_seed = format!("{}/{name}", namespace.unwrap_or(""));
    let _ = writeln!(y, "  uid: {}", fake_uid(&uid_seed));
    y
}

/// A Namespace object `name` with `labels`, as `kubectl get namespace -o yaml`
/// prints it (the API server adds `kubernetes.io/metadata.name` itself: give it
/// in `labels` to have it).
pub fn namespace_yaml(name: &str, labels: &[(String, String)]) -> String {
    let mut y = String::from("apiVersion: v1\nkind: Namespace\n");
    y += &object_metadata(None, name, labels);
    y += "spec:\n  finalizers:\n  - kubernetes\nstatus:\n  phase: Active\n";
    y
}

/// A named container port of a [`PodManifest`].
#[derive(Clone, Debug)]
pub struct ContainerPort {
    /// The port's `name` (what a NetworkPolicy's named port refers to).
    pub name: String,
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: &'static str,
}

/// A running Pod as `kubectl get pod -o yaml` prints it (trimmed to what a proxy
/// or a policy engine reads): labels, node, named container ports (one container
/// per port, as the netpol e2e pods have), host network or not, and its addresses.
#[derive(Clone, Debug)]
pub struct PodManifest {
    pub namespace: String,
    pub name: String,
    pub labels: Vec<(String, String)>,
    /// `spec.nodeName`.
    pub node: String,
    /// `status.hostIP`: the node's address.
    pub host_ip: std::net::IpAddr,
    /// `status.podIPs` (the first is `status.podIP`).
    pub ips: Vec<std::net::IpAddr>,
    pub ports: Vec<ContainerPort>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
}

impl PodManifest {
    pub fn to_yaml(&self) -> String {
        let mut y = String::from("apiVersion: v1\nkind: Pod\n");
        y += &object_metadata(Some(&self.namespace), &self.name, &self.labels);
        y += "spec:\n  containers:\n";
        for p in &self.ports {
            let container = p.name.replacen("serve", "cont", 1);
            let _ = writeln!(
                y,
                "  - image: lb-echo\n    name: {container}\n    ports:\n    - containerPort: {}\n      name: {}\n      protocol: {}",
                p.port, p.name, p.protocol
            );
        }
        if self.host_network {
            y += "  hostNetwork: true\n";
        }
        let _ = writeln!(y, "  nodeName: {}", self.node);
        let _ = writeln!(y, "status:\n  hostIP: {}\n  phase: Running", self.host_ip);
        if let Some(first) = self.ips.first() {
            let _ = writeln!(y, "  podIP: {}", quoted_ip(*first));
            y += "  podIPs:\n";
            for ip in &self.ips {
                let _ = writeln!(y, "  - ip: {}", quoted_ip(*ip));
            }
        }
        y
    }
}

/// IPv6 addresses quoted, as kubectl prints them.
fn quoted_ip(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V6(_) => format!("\"{ip}\""),
        std::net::IpAddr::V4(_) => ip.to_string(),
    }
}

/// A `networking.k8s.io/v1` NetworkPolicy `namespace/name` whose `spec` is given as
/// JSON (the shape of the API's NetworkPolicySpec), written as block YAML.
pub fn network_policy_yaml(namespace: &str, name: &str, spec: &serde_json::Value) -> String {
    let mut y = String::from("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n");
    y += &object_metadata(Some(namespace), name, &[]);
    y += &block_yaml("spec", spec, 0);
    y
}

/// `key: value` as block YAML at `indent` spaces, nested maps and lists on lines
/// of their own, empty ones as `{}` and `[]`. Every string is double-quoted (a
/// JSON string is a valid YAML double-quoted scalar): unquoted, `y` or `on` would
/// be a boolean to the API's YAML 1.1 reader, `80` a number.
fn block_yaml(key: &str, value: &serde_json::Value, indent: usize) -> String {
    use serde_json::Value;
    let pad = " ".repeat(indent);
    let key = yaml_key(key);
    match value {
        Value::Object(map) if !map.is_empty() => {
            let mut y = format!("{pad}{key}:\n");
            for (k, v) in map {
                y += &block_yaml(k, v, indent + 2);
            }
            y
        }
        Value::Array(items) if !items.is_empty() => {
            let mut y = format!("{pad}{key}:\n");
            for item in items {
                y += &list_item(item, indent);
            }
            y
        }
        scalar => format!("{pad}{key}: {}\n", flow_scalar(scalar)),
    }
}

/// One `- item` of a block list at `indent` (kubectl writes a list at its key's
/// indentation).
fn list_item(item: &serde_json::Value, indent: usize) -> String {
    use serde_json::Value;
    let pad = " ".repeat(indent);
    match item {
        Value::Object(map) if !map.is_empty() => {
            let mut y = String::new();
            for (i, (k, v)) in map.iter().enumerate() {
                let line = block_yaml(k, v, indent + 2);
                if i == 0 {
                    // The first key rides on the dash.
                    y += &format!("{pad}- {}", &line[indent + 2..]);
                } else {
                    y += &line;
                }
            }
            y
        }
        Value::Array(inner) if !inner.is_empty() => {
            let mut y = format!("{pad}-\n");
            for i in inner {
                y += &list_item(i, indent + 2);
            }
            y
        }
        scalar => format!("{pad}- {}\n", flow_scalar(scalar)),
    }
}

/// A scalar, or an empty map or list, on one line.
fn flow_scalar(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
        // A JSON string is a YAML double-quoted scalar.
        other => other.to_string(),
    }
}

/// A map key bare when it is a plain name (label keys included), else quoted.
fn yaml_key(key: &str) -> String {
    let plain = !key.is_empty()
        && key.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    if plain {
        key.to_string()
    } else {
        serde_json::Value::from(key).to_string()
    }
}

/// A Node object `name` with the `topology.kubernetes.io/zone` label `zone`, as
/// `kubectl get node -o yaml` prints it (trimmed).
pub fn node_yaml(name: &str, zone: &str) -> String {
    let mut y = String::from("apiVersion: v1\nkind: Node\n");
    y += &metadata(name, &[("topology.kubernetes.io/zone", zone)])
        .replace(&format!("  namespace: {NAMESPACE}\n"), "");
    y += "spec: {}\n";
    y
}

/// A Node object `name` whose `spec.podCIDRs` (and `podCIDR`, the first) are
/// `cidrs`, as the node IPAM controller writes them.
pub fn node_yaml_with_pod_cidrs(name: &str, cidrs: &[&str]) -> String {
    let mut y = String::from("apiVersion: v1\nkind: Node\n");
    y += &metadata(name, &[]).replace(&format!("  namespace: {NAMESPACE}\n"), "");
    y += "spec:\n";
    if let Some(first) = cidrs.first() {
        let _ = writeln!(y, "  podCIDR: {first}");
    }
    y += "  podCIDRs:\n";
    for cidr in cidrs {
        let _ = writeln!(y, "  - {cidr}");
    }
    y
}

/// `metadata:` as the API server returns it, in namespace [`NAMESPACE`].
fn metadata(name: &str, labels: &[(&str, &str)]) -> String {
    metadata_in(NAMESPACE, name, labels)
}

/// `metadata:` as the API server returns it, in `namespace`.
fn metadata_in(namespace: &str, name: &str, labels: &[(&str, &str)]) -> String {
    static VERSION: AtomicU32 = AtomicU32::new(1000);
    let mut y = String::from("metadata:\n  creationTimestamp: \"2024-05-01T10:00:00Z\"\n");
    if !labels.is_empty() {
        y += "  labels:\n";
        for (k, v) in labels {
            let _ = writeln!(y, "    {k}: {v}");
        }
    }
    let _ = writeln!(y, "  name: {name}\n  namespace: {namespace}");
    let _ = writeln!(
        y,
        "  resourceVersion: \"{}\"",
        VERSION.fetch_add(1, Ordering::Relaxed)
    );
    let _ = writeln!(y, "  uid: {}", fake_uid(name));
    y
}

/// A stable UUID-shaped uid derived from the name (FNV-1a), so output is reproducible.
fn fake_uid(name: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let hex = format!("{h:016x}{:016x}", h.rotate_left(29) ^ 0x5bd1_e995);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Join YAML documents into one multi-document file.
pub fn documents<I: IntoIterator<Item = String>>(docs: I) -> String {
    docs.into_iter()
        .map(|d| format!("---\n{d}"))
        .collect::<Vec<_>>()
        .join("")
}

/// A temporary directory of manifests the agent reads (`--services-file DIR`).
///
/// Files are replaced atomically: written in a sibling staging directory (same
/// filesystem, outside the watched directory, and not named `*.yaml` there) and
/// renamed into place, so the polling agent sees either the old or the new file,
/// never half of one.
pub struct ManifestDir {
    root: PathBuf,
    dir: PathBuf,
    staging: PathBuf,
}

impl ManifestDir {
    pub fn create() -> Result<Self> {
        let root = std::env::temp_dir().join(unique_name("lb-test-manifests"));
        let dir = root.join("manifests");
        let staging = root.join("staging");
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::create_dir_all(&staging)?;
        Ok(ManifestDir { root, dir, staging })
    }

    /// The directory to pass to the agent.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Create or replace `file_name` (e.g. `web.yaml`) with `content`.
    pub fn write(&self, file_name: &str, content: &str) -> Result<()> {
        let tmp = self.staging.join(file_name);
        fs::write(&tmp, content).with_context(|| format!("writing {}", tmp.display()))?;
        let dest = self.dir.join(file_name);
        fs::rename(&tmp, &dest).with_context(|| format!("renaming into {}", dest.display()))
    }

    pub fn remove(&self, file_name: &str) -> Result<()> {
        fs::remove_file(self.dir.join(file_name)).with_context(|| format!("removing {file_name}"))
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> Service {
        Service::new(
            "web",
            Ipv4Addr::new(10, 96, 0, 10),
            vec![
                ServicePort::tcp("http", 80, 8080),
                ServicePort::udp("dns", 53, 5353),
            ],
        )
    }

    #[test]
    fn service_yaml_has_kubectl_shape() {
        let y = web().with_affinity(60).to_yaml();
        for needle in [
            "kind: Service\n",
            "  namespace: demo\n",
            "  clusterIP: 10.96.0.10\n",
            "  - name: dns\n    port: 53\n    protocol: UDP\n    targetPort: 5353\n",
            "  sessionAffinity: ClientIP\n",
            "      timeoutSeconds: 60\n",
        ] {
            assert!(y.contains(needle), "{needle:?} missing in\n{y}");
        }
        assert!(web().to_yaml().contains("  sessionAffinity: None\n"));
    }

    #[test]
    fn external_service_yaml_has_kubectl_shape() {
        let svc = Service::new(
            "web",
            Ipv4Addr::new(10, 96, 0, 10),
            vec![ServicePort::tcp("http", 80, 8080).with_node_port(30080)],
        )
        .load_balancer([Ipv4Addr::new(192, 168, 50, 201)])
        .with_external_ips([Ipv4Addr::new(192, 168, 50, 200)])
        .external_local();
        let y = svc.to_yaml();
        for needle in [
            "  externalIPs:\n  - 192.168.50.200\n",
            "  externalTrafficPolicy: Local\n",
            "  - name: http\n    nodePort: 30080\n    port: 80\n",
            "  type: LoadBalancer\n",
            "status:\n  loadBalancer:\n    ingress:\n    - ip: 192.168.50.201\n",
        ] {
            assert!(y.contains(needle), "{needle:?} missing in\n{y}");
        }
        let plain = web().to_yaml();
        assert!(!plain.contains("externalTrafficPolicy"), "{plain}");
        assert!(!plain.contains("nodePort"), "{plain}");
    }

    #[test]
    fn slice_yaml_links_service_and_names_ports() {
        let eps = vec![Endpoint::ready("pod-b", Ipv4Addr::new(10, 244, 1, 12))
            .with_conditions(Conditions::TERMINATING_SERVING)];
        let y = EndpointSlice::for_service(&web(), eps).to_yaml();
        for needle in [
            "    kubernetes.io/service-name: web\n",
            "- addresses:\n  - 10.244.1.12\n",
            "    ready: false\n    serving: true\n    terminating: true\n",
            "- name: http\n  port: 8080\n  protocol: TCP\n",
        ] {
            assert!(y.contains(needle), "{needle:?} missing in\n{y}");
        }
        let empty = EndpointSlice::for_service(&web(), vec![]).to_yaml();
        assert!(empty.contains("\nendpoints: null\n"), "{empty}");
    }

    #[test]
    fn pod_namespace_and_policy_yaml_have_kubectl_shape() {
        let labels = vec![("ns".to_string(), "y".to_string())];
        let ns = namespace_yaml("y", &labels);
        assert!(ns.contains("kind: Namespace\n"), "{ns}");
        assert!(ns.contains("  labels:\n    ns: \"y\"\n  name: y\n"), "{ns}");
        assert!(!ns.contains("namespace:"), "{ns}");
        let pod = PodManifest {
            namespace: "x".into(),
            name: "a".into(),
            labels: vec![("pod".into(), "a".into())],
            node: "node1".into(),
            host_ip: Ipv4Addr::new(192, 168, 50, 1).into(),
            ips: vec![
                Ipv4Addr::new(10, 244, 1, 11).into(),
                "fd00:244:1::11".parse().unwrap(),
            ],
            ports: vec![ContainerPort {
                name: "serve-80-udp".into(),
                port: 80,
                protocol: "UDP",
            }],
            host_network: false,
        }
        .to_yaml();
        for needle in [
            "kind: Pod\n",
            "  name: a\n  namespace: x\n",
            "    name: cont-80-udp\n    ports:\n    - containerPort: 80\n      name: serve-80-udp\n      protocol: UDP\n",
            "  nodeName: node1\n",
            "  podIP: 10.244.1.11\n  podIPs:\n  - ip: 10.244.1.11\n  - ip: \"fd00:244:1::11\"\n",
        ] {
            assert!(pod.contains(needle), "{needle:?} missing in\n{pod}");
        }
        assert!(!pod.contains("hostNetwork"), "{pod}");
        let spec = serde_json::json!({
            "podSelector": {},
            "ingress": [{ "from": [{ "namespaceSelector": { "matchLabels": { "ns": "y" } } }] }],
        });
        let policy = network_policy_yaml("x", "from-y", &spec);
        assert!(policy.starts_with("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"));
        assert!(
            policy.contains("  name: from-y\n  namespace: x\n"),
            "{policy}"
        );
        assert!(policy.contains("spec:\n  ingress:\n"), "{policy}");
        // Read back, the policy is the spec given (a YAML 1.1 reader included:
        // `y` must be quoted or it is a boolean).
        let doc: serde_json::Value = serde_norway::from_str(&policy).unwrap();
        assert_eq!(doc["spec"], spec);
        assert!(policy.contains("          ns: \"y\"\n"), "{policy}");
        assert!(policy.contains("  podSelector: {}\n"), "{policy}");
    }

    #[test]
    fn uid_is_uuid_shaped_and_stable() {
        let uid = fake_uid("pod-a");
        assert_eq!(uid, fake_uid("pod-a"));
        let lens: Vec<usize> = uid.split('-').map(str::len).collect();
        assert_eq!(lens, [8, 4, 4, 4, 12]);
    }
}
