//! kube-proxy's reading of Services and EndpointSlices: the ClusterIP frontends the
//! socket hooks translate, and the NodePort, externalIP and LoadBalancer frontends
//! the per-packet path serves.
//!
//! Both families, as kube-proxy's per-family proxiers see them: every address of a
//! Service (cluster IPs, external and load-balancer IPs, node addresses) is a
//! frontend, and gets the endpoints of its own family only; the endpoint rules
//! (readiness, traffic policies, topology) apply to each family on its own.

use std::borrow::Borrow;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::options::{NodePortRange, SourceOptions};
use super::topology::{self, EndpointInfo};
use crate::model::{
    Algorithm, BackendAddr, DesiredState, Frontend, FrontendSpec, HealthCheck, Protocol, Scope,
};
use crate::source::labels::{ANNOTATION_ALGORITHM, LABEL_HEADLESS, LABEL_PROXY_NAME};
use crate::source::lean::{EndpointAddress, EndpointSlice, Service, ServicePort, ServiceSpec};
use crate::source::{ObjectError, Problem};

const SERVICE: &str = "Service";
const SLICE: &str = "EndpointSlice";
const DEFAULT_AFFINITY_TIMEOUT: i32 = 10_800;
const MAX_AFFINITY_TIMEOUT: i32 = 86_400;

/// (namespace, name), borrowed from the object: tens of thousands of them are
/// sorted and looked up on every change.
type ObjectId<'a> = (&'a str, &'a str);

/// Objects without a namespace are taken to be in `default`, as `kubectl apply` of
/// the same file would place them with a default context.
fn object_id(meta: &crate::source::lean::Meta) -> ObjectId<'_> {
    (
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// One Service port this agent proxies.
struct PortPlan<'a> {
    name: &'a str,
    protocol: Protocol,
    port: u16,
    /// Set for `type: NodePort` and `LoadBalancer` Services that have one.
    node_port: Option<u16>,
}

/// A Service that passed validation.
struct ServicePlan<'a> {
    id: ObjectId<'a>,
    ports: Vec<PortPlan<'a>>,
    /// `spec.clusterIPs`, the primary (first) family first.
    cluster_ips: Vec<IpAddr>,
    /// `spec.externalIPs`.
    external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` (not also an external IP, and not
    /// `ipMode: Proxy`: that load balancer delivers to the node ports itself).
    load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`: only they may reach the load-balancer IPs.
    source_ranges: SourceRanges,
    affinity_timeout_sec: Option<u32>,
    /// `internalTrafficPolicy: Local`.
    internal_local: bool,
    /// `externalTrafficPolicy: Local`.
    external_local: bool,
    /// `spec.healthCheckNodePort`, kept for `externalTrafficPolicy: Local` only.
    health_check_node_port: Option<u16>,
    /// The `service.lb/algorithm` annotation, else `--lb-algorithm`: how the
    /// external frontends (not the cluster IPs) pick a backend.
    algorithm: Algorithm,
}

impl ServicePlan<'_> {
    /// This node's ready endpoints of the Service (distinct addresses over all its
    /// ports), what a health check reports. Terminating endpoints still get traffic
    /// when nothing else is left, but are not counted, as kube-proxy counts them:
    /// a node that is only draining must tell its load balancer to stop sending.
    /// Dual-stack: the primary family's, the one a client of the Service's first
    /// cluster IP reaches (a dual-stack pod has one endpoint in each).
    fn local_endpoints(&self, slices: &[SliceInfo]) -> usize {
        let primary_v6 = self.cluster_ips.first().is_some_and(IpAddr::is_ipv6);
        self.ports
            .iter()
            .flat_map(|port| port_endpoints(port, slices))
            .filter(|(_, e)| e.local && e.ready && e.ip.is_ipv6() == primary_v6)
            .map(|(backend, _)| backend.ip)
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Every frontend of one port with the backends it gets: cluster IPs follow
    /// internalTrafficPolicy; node ports, external and load-balancer IPs get all
    /// endpoints for traffic from inside, and with `externalTrafficPolicy: Local` a
    /// second, external entry with this node's endpoints only.
    fn frontends(
        &self,
        port: &PortPlan,
        slices: &[SliceInfo],
        opts: &SourceOptions,
    ) -> Vec<FrontendPlan> {
        let node_ips = &opts.node_ips;
        let mut out = Vec::new();
        // Per family, computed only for a family some frontend has: [v4, v6].
        let mut all: [Option<BTreeSet<BackendAddr>>; 2] = [None, None];
        let mut local: [Option<BTreeSet<BackendAddr>>; 2] = [None, None];
        let mut backends = |ip: &IpAddr, local_only: bool| {
            let family = usize::from(ip.is_ipv6());
            let cache = if local_only {
                &mut local[family]
            } else {
                &mut all[family]
            };
            cache
                .get_or_insert_with(|| {
                    select_backends(port, local_only, ip.is_ipv6(), slices, opts)
                })
                .clone()
        };
        // Cluster IPs stay random: their clients are this cluster's pods and
        // nodes, which reach them through their own node (socket hooks or TC), so
        // no other node's choice has to agree.
        for ip in &self.cluster_ips {
            out.push(FrontendPlan {
                frontend: Frontend::internal(*ip, port.port, port.protocol),
                backends: backends(ip, self.internal_local),
                source_ranges: None,
                maglev: false,
                cluster_ip: true,
            });
        }
        let maglev = self.algorithm == Algorithm::Maglev;
        // Source ranges guard the load-balancer IPs only, as kube-proxy's firewall
        // chains do: externalIPs and NodePorts of the same Service stay open.
        let external = self
            .external_ips
            .iter()
            .map(|&ip| (ip, port.port, None))
            .chain(
                self.load_balancer_ips
                    .iter()
                    .map(|&ip| (ip, port.port, self.source_ranges.for_family(ip))),
            )
            .chain(
                port.node_port
                    .into_iter()
                    .flat_map(|np| node_ips.iter().map(move |&ip| (ip, np, None))),
            );
        for (ip, p, ranges) in external {
            let frontend = Frontend::internal(ip, p, port.protocol);
            out.push(FrontendPlan {
                frontend,
                backends: backends(&ip, false),
                source_ranges: ranges,
                maglev,
                cluster_ip: false,
            });
            if self.external_local {
                out.push(FrontendPlan {
                    frontend: frontend.with_scope(Scope::External),
                    backends: backends(&ip, true),
                    source_ranges: None,
                    maglev,
                    cluster_ip: false,
                });
            }
        }
        out
    }
}

/// One frontend of a Service port, before the claims on it are settled.
struct FrontendPlan {
    frontend: Frontend,
    backends: BTreeSet<BackendAddr>,
    source_ranges: Option<BTreeSet<IpNet>>,
    maglev: bool,
    cluster_ip: bool,
}

/// An IPv4 or IPv6 EndpointSlice that passed validation.
struct SliceInfo<'a> {
    /// (port name, protocol as written or `TCP`, port).
    ports: Vec<(&'a str, &'a str, u16)>,
    endpoints: Vec<EndpointInfo>,
}

/// Turn Services and EndpointSlices into the frontends this node should translate.
/// Problems with single objects come back as errors; everything else still applies.
/// Takes the objects owned or shared (`Arc`), as the sources hold them.
pub fn build_desired<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
    opts: &SourceOptions,
) -> (DesiredState, Vec<ObjectError>) {
    let mut errors = Vec::new();

    // Sorted so that the first of two Services claiming a frontend is well defined.
    let mut sorted: Vec<(ObjectId, &Service)> = services
        .iter()
        .map(|s| (object_id(&s.borrow().metadata), s.borrow()))
        .collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let known: HashSet<ObjectId> = sorted.iter().map(|(id, _)| *id).collect();

    let plans: Vec<ServicePlan> = sorted
        .iter()
        .filter_map(|&(id, svc)| plan_service(id, svc, opts, &mut errors))
        .collect();
    let proxied: HashSet<ObjectId> = plans.iter().map(|p| p.id).collect();

    let mut sorted_slices: Vec<(ObjectId, &EndpointSlice)> = slices
        .iter()
        .map(|s| (object_id(&s.borrow().metadata), s.borrow()))
        .collect();
    sorted_slices.sort_by(|a, b| a.0.cmp(&b.0));
    let mut slices_of: HashMap<ObjectId, Vec<SliceInfo>> = HashMap::new();
    for &((ns, name), slice) in &sorted_slices {
        let slice_error = |problem| ObjectError::new(SLICE, ns, name, problem);
        let Some(svc_name) = slice.service_name.as_ref() else {
            errors.push(slice_error(Problem::MissingServiceName));
            continue;
        };
        let svc_id = (ns, svc_name.as_str());
        if !known.contains(&svc_id) {
            let service = format!("{ns}/{svc_name}");
            errors.push(slice_error(Problem::ServiceNotFound { service }));
            continue;
        }
        // Slices of Services this agent does not proxy (headless, another proxy's,
        // or invalid and already reported) need no checking.
        if !proxied.contains(&svc_id) {
            continue;
        }
        // FQDN slices name no address to translate to; kube-proxy skips them too.
        let v6 = match &*slice.address_type {
            "IPv4" => false,
            "IPv6" => true,
            _ => continue,
        };
        let info = read_slice(slice, v6, opts, &mut |p| errors.push(slice_error(p)));
        slices_of.entry(svc_id).or_default().push(info);
    }

    let mut desired = DesiredState::default();
    let mut owners: HashMap<Frontend, ObjectId> = HashMap::new();
    for plan in &plans {
        let (ns, name) = plan.id;
        let slices = slices_of.get(&plan.id).map(Vec::as_slice).unwrap_or(&[]);
        if let Some(port) = plan.health_check_node_port {
            if let Some(owner) = desired.health_checks.get(&port) {
                let owner = format!("{}/{}", owner.namespace, owner.name);
                errors.push(ObjectError::new(
                    SERVICE,
                    ns,
                    name,
                    Problem::DuplicateHealthCheckNodePort { port, owner },
                ));
            } else {
                desired.health_checks.insert(
                    port,
                    HealthCheck {
                        namespace: ns.to_owned(),
                        name: name.to_owned(),
                        local_endpoints: plan.local_endpoints(slices),
                    },
                );
            }
        }
        for port in &plan.ports {
            let service: Arc<str> = if port.name.is_empty() {
                format!("{ns}/{name}").into()
            } else {
                format!("{ns}/{name}:{}", port.name).into()
            };
            for FrontendPlan {
                frontend,
                backends,
                source_ranges,
                maglev,
                cluster_ip,
            } in plan.frontends(port, slices, opts)
            {
                if let Some((owner_ns, owner_name)) = owners.get(&frontend) {
                    let owner = format!("{owner_ns}/{owner_name}");
                    errors.push(ObjectError::new(
                        SERVICE,
                        ns,
                        name,
                        Problem::DuplicateFrontend { frontend, owner },
                    ));
                    continue;
                }
                owners.insert(frontend, plan.id);
                desired.frontends.insert(
                    frontend,
                    FrontendSpec {
                        service: service.clone(),
                        backends: Arc::new(backends),
                        affinity_timeout_sec: plan.affinity_timeout_sec,
                        source_ranges,
                        maglev,
                        cluster_ip,
                    },
                );
            }
        }
    }
    (desired, errors)
}

/// Validate one Service; `None` when it is not proxied (skipped or invalid).
fn plan_service<'a>(
    id: ObjectId<'a>,
    svc: &'a Service,
    opts: &SourceOptions,
    errors: &mut Vec<ObjectError>,
) -> Option<ServicePlan<'a>> {
    let (ns, name) = id;
    let error = |problem| ObjectError::new(SERVICE, ns, name, problem);
    let labels = svc.metadata.labels.as_ref();
    // Another proxy implementation owns it, or it is explicitly headless; kube-proxy
    // filters these out in its informer.
    if labels.is_some_and(|l| l.contains_key(LABEL_PROXY_NAME) || l.contains_key(LABEL_HEADLESS)) {
        return None;
    }
    // Without a spec there is no cluster IP, as with an empty one.
    let Some(spec) = svc.spec.as_ref() else {
        errors.push(error(Problem::MissingClusterIp));
        return None;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return None;
    }

    let cluster_ips = read_cluster_ips(spec, &mut |p| errors.push(error(p)))?;
    let cluster_ips = cluster_families(spec, cluster_ips, &mut |p| errors.push(error(p)))?;
    let affinity_timeout_sec = match read_affinity(spec) {
        Ok(timeout) => timeout,
        Err(problem) => {
            errors.push(error(problem));
            return None;
        }
    };

    let has_node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let mut ports = Vec::new();
    for sp in spec.ports.iter().flatten() {
        let node_ports = has_node_ports.then_some(&opts.node_port_range);
        if let Some(port) = plan_port(sp, node_ports, &mut |p| errors.push(error(p))) {
            ports.push(port);
        }
    }

    let (external_ips, load_balancer_ips) =
        read_external_addresses(svc, spec, &mut |p| errors.push(error(p)));
    let source_ranges = SourceRanges::read(spec.load_balancer_source_ranges.as_deref(), &mut |p| {
        errors.push(error(p))
    });

    let algorithm = read_algorithm(svc, opts.lb_algorithm, &mut |p| errors.push(error(p)));
    let external_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = match spec.health_check_node_port {
        Some(port) if external_local => {
            let valid = valid_port(port);
            if valid.is_none() {
                errors.push(error(Problem::HealthCheckNodePortOutOfRange { port }));
            }
            valid
        }
        _ => None,
    };

    Some(ServicePlan {
        id,
        ports,
        cluster_ips,
        external_ips,
        load_balancer_ips,
        source_ranges,
        affinity_timeout_sec,
        internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        external_local,
        health_check_node_port,
        algorithm,
    })
}

/// The Service's `service.lb/algorithm` annotation, else `default`; a value that
/// is neither algorithm is reported and the default used.
fn read_algorithm(svc: &Service, default: Algorithm, report: &mut dyn FnMut(Problem)) -> Algorithm {
    let Some(value) = svc
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ANNOTATION_ALGORITHM))
    else {
        return default;
    };
    Algorithm::from_annotation(value).unwrap_or_else(|| {
        report(Problem::InvalidAlgorithm {
            annotation: ANNOTATION_ALGORITHM,
            value: value.clone(),
            default,
        });
        default
    })
}

/// `spec.clusterIPs` (or `spec.clusterIP`), parsed, without repeats. `None` for a
/// headless Service, or one whose cluster IPs are missing or not addresses
/// (reported).
fn read_cluster_ips(spec: &ServiceSpec, report: &mut dyn FnMut(Problem)) -> Option<Vec<IpAddr>> {
    let cluster_ips: &[String] = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips,
        (_, Some(ip)) if !ip.is_empty() => std::slice::from_ref(ip),
        _ => {
            report(Problem::MissingClusterIp);
            return None;
        }
    };
    if cluster_ips[0] == "None" || spec.cluster_ip.as_deref() == Some("None") {
        return None; // headless: clients resolve pod IPs through DNS
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for value in cluster_ips {
        match value.parse::<IpAddr>() {
            Ok(ip) if !ips.contains(&ip) => ips.push(ip),
            Ok(_) => {}
            Err(_) => {
                report(Problem::InvalidClusterIp {
                    value: value.clone(),
                });
                return None;
            }
        }
    }
    Some(ips)
}

/// `sessionAffinity: ClientIP`'s timeout, `None` without affinity; a timeout out of
/// range is a problem that keeps the Service from being proxied.
fn read_affinity(spec: &ServiceSpec) -> Result<Option<u32>, Problem> {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return Ok(None);
    }
    let seconds = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref())
        .and_then(|c| c.timeout_seconds)
        .unwrap_or(DEFAULT_AFFINITY_TIMEOUT);
    if !(1..=MAX_AFFINITY_TIMEOUT).contains(&seconds) {
        return Err(Problem::AffinityTimeoutOutOfRange { seconds });
    }
    Ok(Some(seconds as u32))
}

/// `spec.externalIPs` and the load balancer's ingress IPs (an address in both is an
/// external IP), sorted; addresses that are none are reported and skipped.
fn read_external_addresses(
    svc: &Service,
    spec: &ServiceSpec,
    report: &mut dyn FnMut(Problem),
) -> (Vec<IpAddr>, Vec<IpAddr>) {
    let mut address = |field, value: &str| match value.parse::<IpAddr>() {
        Ok(ip) => Some(ip),
        Err(_) => {
            report(Problem::InvalidExternalAddress {
                field,
                value: value.to_owned(),
            });
            None
        }
    };
    let external_ips: BTreeSet<IpAddr> = spec
        .external_ips
        .iter()
        .flatten()
        .filter_map(|ip| address("spec.externalIPs", ip))
        .collect();
    let load_balancer_ips: BTreeSet<IpAddr> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        // KEP-1860: a load balancer in Proxy mode terminates the traffic itself and
        // sends it on to the node ports; the node must not claim its address.
        .filter(|ingress| ingress.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|ingress| ingress.ip.as_deref())
        .filter_map(|ip| address("status.loadBalancer.ingress.ip", ip))
        .filter(|ip| !external_ips.contains(ip))
        .collect();
    (
        external_ips.into_iter().collect(),
        load_balancer_ips.into_iter().collect(),
    )
}

fn plan_port<'a>(
    sp: &'a ServicePort,
    node_port_range: Option<&NodePortRange>,
    report: &mut dyn FnMut(Problem),
) -> Option<PortPlan<'a>> {
    let Some(port) = valid_port(sp.port) else {
        report(Problem::PortOutOfRange { port: sp.port });
        return None;
    };
    let protocol = match sp.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        other => {
            report(Problem::UnsupportedProtocol {
                port: sp.port,
                protocol: other.to_owned(),
            });
            return None;
        }
    };
    let node_port = match (sp.node_port, node_port_range) {
        (Some(np), Some(range)) => match valid_port(np) {
            None => {
                report(Problem::NodePortOutOfRange {
                    service_port: sp.port,
                    port: np,
                });
                None
            }
            Some(p) if p < range.first || p > range.last => {
                report(Problem::NodePortOutsideRange {
                    service_port: sp.port,
                    port: p,
                    range: range.to_string(),
                });
                None
            }
            valid => valid,
        },
        _ => None,
    };
    Some(PortPlan {
        name: sp.name.as_deref().unwrap_or_default(),
        protocol,
        port,
        node_port,
    })
}

/// `spec.loadBalancerSourceRanges` as kube-proxy reads them: trimmed, host bits
/// ignored, each family's ranges for that family's load-balancer IPs.
#[derive(Debug, Default)]
struct SourceRanges {
    ranges: BTreeSet<IpNet>,
    /// A value was no CIDR: reported, and it admits nobody, in either family. The
    /// Service asked for a restriction; dropping the value must not open its load
    /// balancer to all.
    invalid: bool,
}

impl SourceRanges {
    fn read(values: Option<&[String]>, report: &mut dyn FnMut(Problem)) -> Self {
        let mut out = SourceRanges::default();
        for value in values.into_iter().flatten() {
            match value.trim().parse::<IpNet>() {
                Ok(net) => {
                    out.ranges.insert(net.trunc());
                }
                Err(_) => {
                    out.invalid = true;
                    report(Problem::InvalidSourceRange {
                        value: value.clone(),
                    });
                }
            }
        }
        out
    }

    /// The ranges that guard a load-balancer IP `ip`; `None`: every source. As in
    /// kube-proxy's per-family proxiers, a family without a range of its own is
    /// unrestricted (unless a value was invalid).
    fn for_family(&self, ip: IpAddr) -> Option<BTreeSet<IpNet>> {
        let own: BTreeSet<IpNet> = self
            .ranges
            .iter()
            .filter(|net| matches!(net, IpNet::V6(_)) == ip.is_ipv6())
            .copied()
            .collect();
        (!own.is_empty() || self.invalid).then_some(own)
    }
}

/// `spec.clusterIPs` checked against `spec.ipFamilies` and `spec.ipFamilyPolicy`,
/// which the API server keeps consistent but a hand-written manifest may not:
/// families that contradict the addresses make the Service unusable (which one is
/// meant?); a policy the addresses do not meet is reported, and the addresses given
/// are served (`SingleStack`: the primary one only).
fn cluster_families(
    spec: &ServiceSpec,
    ips: Vec<IpAddr>,
    report: &mut dyn FnMut(Problem),
) -> Option<Vec<IpAddr>> {
    let family = |ip: &IpAddr| if ip.is_ipv6() { "IPv6" } else { "IPv4" };
    let families: Vec<&str> = ips.iter().map(family).collect();
    if let Some(declared) = spec.ip_families.as_ref().filter(|f| !f.is_empty()) {
        let consistent = declared.len() >= families.len()
            && families.iter().zip(declared).all(|(a, b)| *a == &**b);
        if !consistent {
            report(Problem::IpFamiliesMismatch {
                families: declared
                    .iter()
                    .map(|f| &**f)
                    .collect::<Vec<&str>>()
                    .join(", "),
                addresses: ips
                    .iter()
                    .map(IpAddr::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
            return None;
        }
    }
    let dual = families.len() == 2 && families[0] != families[1];
    if families.len() > 2 || (families.len() == 2 && !dual) {
        report(Problem::ClusterIpsNotOnePerFamily {
            addresses: ips
                .iter()
                .map(IpAddr::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        });
        return None;
    }
    match spec.ip_family_policy.as_deref() {
        Some("SingleStack") if dual => {
            report(Problem::IpFamilyPolicyNotMet {
                policy: "SingleStack",
                served: ips[0].to_string(),
            });
            Some(vec![ips[0]])
        }
        Some("RequireDualStack") if !dual => {
            report(Problem::IpFamilyPolicyNotMet {
                policy: "RequireDualStack",
                served: ips
                    .iter()
                    .map(IpAddr::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
            Some(ips)
        }
        _ => Some(ips),
    }
}

fn valid_port(port: i32) -> Option<u16> {
    u16::try_from(port).ok().filter(|&p| p != 0)
}

fn read_slice<'a>(
    slice: &'a EndpointSlice,
    v6: bool,
    opts: &SourceOptions,
    report: &mut dyn FnMut(Problem),
) -> SliceInfo<'a> {
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        let name = p.name.as_deref().unwrap_or_default();
        match p.port {
            None => report(Problem::EndpointPortMissing {
                name: name.to_owned(),
            }),
            Some(n) => match valid_port(n) {
                Some(port) => ports.push((name, p.protocol.as_deref().unwrap_or("TCP"), port)),
                None => report(Problem::EndpointPortOutOfRange {
                    name: name.to_owned(),
                    port: n,
                }),
            },
        }
    }

    let mut endpoints = Vec::new();
    for (index, ep) in slice.endpoints.iter().flatten().enumerate() {
        // Only the first address has defined meaning; kube-proxy ignores the others.
        let Some(address) = ep.address() else {
            report(Problem::EndpointWithoutAddress { index });
            continue;
        };
        // An address of the other family than the slice's `addressType` is as
        // unusable as one that does not parse.
        let parsed = match address {
            EndpointAddress::Ip(ip) => Some(ip),
            EndpointAddress::Invalid(_) => None,
        };
        let Some(ip) = parsed.filter(|ip| ip.is_ipv6() == v6) else {
            report(Problem::InvalidEndpointAddress {
                family: if v6 { "IPv6" } else { "IPv4" },
                index,
                address: address.to_string(),
            });
            continue;
        };
        let conditions = ep.conditions.as_ref();
        // Unknown readiness counts as ready, and a ready endpoint is serving.
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        endpoints.push(EndpointInfo {
            ip,
            ready,
            serving: conditions.and_then(|c| c.serving).unwrap_or(ready),
            terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
            local: ep.node_name.as_deref() == Some(opts.node_name.as_str()),
            hints: topology::Hints::read(ep.hints()),
        });
    }
    SliceInfo { ports, endpoints }
}

/// The endpoints of the slices that publish `port` (by name and protocol), with the
/// backend address each gives that port.
fn port_endpoints<'s>(
    port: &PortPlan,
    slices: &'s [SliceInfo],
) -> Vec<(BackendAddr, &'s EndpointInfo)> {
    let protocol = match port.protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
    };
    slices
        .iter()
        .filter_map(|s| {
            let (_, _, target) = s
                .ports
                .iter()
                .find(|(name, proto, _)| *name == port.name && *proto == protocol)?;
            Some((s, *target))
        })
        .flat_map(|(s, target)| {
            s.endpoints.iter().map(move |e| {
                (
                    BackendAddr {
                        ip: e.ip,
                        port: target,
                        local: e.local,
                    },
                    e,
                )
            })
        })
        .collect()
}

/// Ready endpoints; failing those, endpoints that still serve while terminating, so a
/// rolling update of the last pods drains instead of refusing (KEP-1669). Locality is
/// applied first, as kube-proxy picks the fallback among local endpoints only.
/// Traffic that may go anywhere in the cluster (`local_only` false) also follows
/// the endpoints' topology hints (see [`topology`]).
fn select_backends(
    port: &PortPlan,
    local_only: bool,
    v6: bool,
    slices: &[SliceInfo],
    opts: &SourceOptions,
) -> BTreeSet<BackendAddr> {
    let candidates: Vec<(BackendAddr, &EndpointInfo)> = port_endpoints(port, slices)
        .into_iter()
        .filter(|(_, e)| (e.local || !local_only) && e.ip.is_ipv6() == v6)
        .collect();
    let mode = if local_only {
        topology::Mode::Any
    } else {
        topology::mode(candidates.iter().map(|(_, e)| *e), opts)
    };
    let ready: BTreeSet<BackendAddr> = candidates
        .iter()
        .filter(|(_, e)| e.ready && mode.admits(e, opts))
        .map(|(b, _)| *b)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    // Hints are ignored here, as kube-proxy ignores them: a topology is only chosen
    // when some ready endpoint is hinted for this node, so nothing being ready
    // means nothing is ready anywhere.
    candidates
        .iter()
        .filter(|(_, e)| e.serving && e.terminating)
        .map(|(b, _)| *b)
        .collect()
}

#[cfg(test)]
mod tests;
