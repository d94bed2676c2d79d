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
    BackendAddr, DesiredState, Frontend, FrontendSpec, HealthCheck, Protocol, Scope,
};
use crate::source::labels::{LABEL_HEADLESS, LABEL_PROXY_NAME};
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
    ) -> Vec<(Frontend, BTreeSet<BackendAddr>, Option<BTreeSet<IpNet>>)> {
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
        for ip in &self.cluster_ips {
            out.push((
                Frontend::internal(*ip, port.port, port.protocol),
                backends(ip, self.internal_local),
                None,
            ));
        }
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
            out.push((frontend, backends(&ip, false), ranges));
            if self.external_local {
                out.push((
                    frontend.with_scope(Scope::External),
                    backends(&ip, true),
                    None,
                ));
            }
        }
        out
    }
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
            for (frontend, backends, source_ranges) in plan.frontends(port, slices, opts) {
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

    let cluster_ips: &[String] = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips,
        (_, Some(ip)) if !ip.is_empty() => std::slice::from_ref(ip),
        _ => {
            errors.push(error(Problem::MissingClusterIp));
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
                errors.push(error(Problem::InvalidClusterIp {
                    value: value.clone(),
                }));
                return None;
            }
        }
    }
    let cluster_ips = cluster_families(spec, ips, &mut |p| errors.push(error(p)))?;

    let affinity_timeout_sec = if spec.session_affinity.as_deref() == Some("ClientIP") {
        let seconds = spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT);
        if !(1..=MAX_AFFINITY_TIMEOUT).contains(&seconds) {
            errors.push(error(Problem::AffinityTimeoutOutOfRange { seconds }));
            return None;
        }
        Some(seconds as u32)
    } else {
        None
    };

    let has_node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let mut ports = Vec::new();
    for sp in spec.ports.iter().flatten() {
        let node_ports = has_node_ports.then_some(&opts.node_port_range);
        if let Some(port) = plan_port(sp, node_ports, &mut |p| errors.push(error(p))) {
            ports.push(port);
        }
    }

    let mut address = |field, value: &str| match value.parse::<IpAddr>() {
        Ok(ip) => Some(ip),
        Err(_) => {
            errors.push(error(Problem::InvalidExternalAddress {
                field,
                value: value.to_owned(),
            }));
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
    let source_ranges = SourceRanges::read(spec.load_balancer_source_ranges.as_deref(), &mut |p| {
        errors.push(error(p))
    });

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
        external_ips: external_ips.into_iter().collect(),
        load_balancer_ips: load_balancer_ips.into_iter().collect(),
        source_ranges,
        affinity_timeout_sec,
        internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        external_local,
        health_check_node_port,
    })
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
mod tests {
    use super::*;
    use crate::source::yaml::parse_str;
    use std::path::Path;

    fn build(yaml: &str) -> (DesiredState, Vec<ObjectError>) {
        build_node(yaml, "node-a")
    }

    fn build_node(yaml: &str, node: &str) -> (DesiredState, Vec<ObjectError>) {
        let objects = parse_str(Path::new("t.yaml"), yaml);
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        let opts = SourceOptions {
            node_name: node.to_owned(),
            node_ips: vec!["192.168.50.2".parse().unwrap()],
            node_port_range: NodePortRange::default(),
            zone: String::new(),
        };
        build_desired(&objects.services, &objects.slices, &opts)
    }

    fn messages(errors: &[ObjectError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    fn fe(ip: &str, port: u16, protocol: Protocol) -> Frontend {
        Frontend::internal(ip.parse().unwrap(), port, protocol)
    }

    fn be(ip: &str, port: u16) -> BackendAddr {
        BackendAddr {
            ip: ip.parse().unwrap(),
            port,
            local: false,
        }
    }

    /// An endpoint on the node the test builds for.
    fn local_be(ip: &str, port: u16) -> BackendAddr {
        BackendAddr {
            local: true,
            ..be(ip, port)
        }
    }

    fn backends(d: &DesiredState, f: Frontend) -> Vec<BackendAddr> {
        d.frontends[&f].backends.iter().copied().collect()
    }

    /// As `kubectl get svc,endpointslices -o yaml` prints them, trimmed of status.
    const WEB: &str = include_str!("../source/testdata/kubectl-web-list.yaml");

    #[test]
    fn service_with_endpoint_slice() {
        let (d, errors) = build(WEB);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(d.frontends.len(), 2);
        let http = fe("10.96.0.10", 80, Protocol::Tcp);
        assert_eq!(&*d.frontends[&http].service, "default/web:http");
        assert_eq!(d.frontends[&http].affinity_timeout_sec, None);
        assert_eq!(
            backends(&d, http),
            [local_be("10.244.1.5", 8080), be("10.244.2.7", 8080)]
        );
        let metrics = fe("10.96.0.10", 9090, Protocol::Tcp);
        assert_eq!(
            backends(&d, metrics),
            [local_be("10.244.1.5", 9100), be("10.244.2.7", 9100)]
        );
    }

    /// WEB as a LoadBalancer Service with a NodePort, an external IP and an
    /// assigned load-balancer address; `build` runs as node-a at 192.168.50.2.
    fn web_load_balancer(etp: &str) -> String {
        WEB.replace(
            "    - name: http\n      port: 80\n",
            "    - name: http\n      nodePort: 30080\n      port: 80\n",
        )
        .replace("    type: ClusterIP\n  status:\n    loadBalancer: {}", &format!(
            "    type: LoadBalancer\n    externalTrafficPolicy: {etp}\n    externalIPs: [192.0.2.10, \"2001:db8::1\"]\n  status:\n    loadBalancer:\n      ingress:\n      - ip: 198.51.100.7"
        ))
    }

    #[test]
    fn external_frontends_follow_external_traffic_policy() {
        let both = [local_be("10.244.1.5", 8080), be("10.244.2.7", 8080)];
        for etp in ["Cluster", "Local"] {
            let (d, errors) = build(&web_load_balancer(etp));
            assert!(errors.is_empty(), "{errors:?}");
            for (ip, port) in [
                ("10.96.0.10", 80),
                ("192.168.50.2", 30080),
                ("192.0.2.10", 80),
                ("198.51.100.7", 80),
            ] {
                let internal = fe(ip, port, Protocol::Tcp);
                assert_eq!(backends(&d, internal), both, "{etp} {internal}");
                let external = internal.with_scope(Scope::External);
                if etp == "Local" && ip != "10.96.0.10" {
                    assert_eq!(
                        backends(&d, external),
                        [local_be("10.244.1.5", 8080)],
                        "{external}"
                    );
                } else {
                    assert!(!d.frontends.contains_key(&external), "{etp} {external}");
                }
            }
            // metrics has no nodePort: only its cluster IP and the external addresses.
            assert!(!d
                .frontends
                .contains_key(&fe("192.168.50.2", 9090, Protocol::Tcp)));
            assert!(d
                .frontends
                .contains_key(&fe("192.0.2.10", 9090, Protocol::Tcp)));
        }
    }

    #[test]
    fn health_check_node_port_counts_local_endpoints() {
        let with_port = |etp: &str| {
            web_load_balancer(etp).replace(
                "    externalIPs:",
                "    healthCheckNodePort: 32001\n    externalIPs:",
            )
        };
        let (d, errors) = build(&with_port("Local"));
        assert!(errors.is_empty(), "{errors:?}");
        let check = &d.health_checks[&32001];
        assert_eq!(
            (check.namespace.as_str(), check.name.as_str()),
            ("default", "web")
        );
        assert_eq!(
            check.local_endpoints, 1,
            "10.244.1.5 on node-a, over both ports"
        );
        let (d, _) = build_node(&with_port("Local"), "node-c");
        assert_eq!(d.health_checks[&32001].local_endpoints, 0);
        // Only terminating endpoints here: the check says 0 (503), so the load
        // balancer stops sending, while traffic that still arrives drains to them.
        let draining = with_port("Local").replace(
            "      ready: true\n      serving: true\n      terminating: false\n    nodeName: node-a",
            "      ready: false\n      serving: true\n      terminating: true\n    nodeName: node-a",
        );
        assert_ne!(draining, with_port("Local"));
        let (d, errors) = build(&draining);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(d.health_checks[&32001].local_endpoints, 0);
        let external = fe("192.168.50.2", 30080, Protocol::Tcp).with_scope(Scope::External);
        assert_eq!(backends(&d, external), [local_be("10.244.1.5", 8080)]);
        // Only externalTrafficPolicy: Local Services are health-checked per node.
        let (d, _) = build(&with_port("Cluster"));
        assert!(d.health_checks.is_empty());
    }

    fn ranges(d: &DesiredState, f: Frontend) -> Option<Vec<String>> {
        let spec = &d.frontends[&f];
        spec.source_ranges
            .as_ref()
            .map(|r| r.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn source_ranges_guard_only_the_load_balancer_ips() {
        let yaml = web_load_balancer("Local").replace(
            "    externalIPs:",
            "    loadBalancerSourceRanges: [\" 192.0.2.0/24\", 198.51.100.9/16, \"2001:db8::/32\"]\n    externalIPs:",
        );
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty(), "{errors:?}");
        let lb = fe("198.51.100.7", 80, Protocol::Tcp);
        // Trimmed, host bits dropped, the IPv6 range left to an IPv6 proxy.
        assert_eq!(ranges(&d, lb).unwrap(), ["192.0.2.0/24", "198.51.0.0/16"]);
        assert_eq!(
            ranges(&d, fe("198.51.100.7", 9090, Protocol::Tcp))
                .unwrap()
                .len(),
            2
        );
        // The ranges hang off the internal entry, which the kernel checks first.
        assert_eq!(ranges(&d, lb.with_scope(Scope::External)), None);
        for open in [
            fe("10.96.0.10", 80, Protocol::Tcp),
            fe("192.168.50.2", 30080, Protocol::Tcp),
            fe("192.0.2.10", 80, Protocol::Tcp),
        ] {
            assert_eq!(ranges(&d, open), None, "{open}");
        }
        // Without the field nothing is restricted.
        let (d, _) = build(&web_load_balancer("Cluster"));
        assert_eq!(ranges(&d, lb), None);
    }

    #[test]
    fn invalid_source_ranges_are_reported_and_admit_nobody() {
        let with = |list: &str| {
            web_load_balancer("Cluster").replace(
                "    externalIPs:",
                &format!("    loadBalancerSourceRanges: {list}\n    externalIPs:"),
            )
        };
        let (d, errors) = build(&with("[10.0.0.0/8, 10.1.2.3, nonsense/99]"));
        assert_eq!(
            messages(&errors),
            [
                "Service default/web: spec.loadBalancerSourceRanges \"10.1.2.3\" is not a CIDR \
                 (e.g. 203.0.113.0/24); it admits no client to the load-balancer IPs until it is fixed",
                "Service default/web: spec.loadBalancerSourceRanges \"nonsense/99\" is not a CIDR \
                 (e.g. 203.0.113.0/24); it admits no client to the load-balancer IPs until it is fixed",
            ]
        );
        let lb = fe("198.51.100.7", 80, Protocol::Tcp);
        assert_eq!(ranges(&d, lb).unwrap(), ["10.0.0.0/8"]);
        // Nothing valid left: still restricted, to nobody.
        let (d, errors) = build(&with("[bad]"));
        assert_eq!(errors.len(), 1);
        assert_eq!(ranges(&d, lb), Some(vec![]));
    }

    #[test]
    fn proxy_mode_load_balancer_ips_are_not_served_locally() {
        let yaml = web_load_balancer("Cluster").replace(
            "      - ip: 198.51.100.7",
            "      - ip: 198.51.100.7\n        ipMode: Proxy\n      - ip: 198.51.100.8\n        ipMode: VIP",
        );
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty(), "{errors:?}");
        assert!(!d
            .frontends
            .contains_key(&fe("198.51.100.7", 80, Protocol::Tcp)));
        assert!(d
            .frontends
            .contains_key(&fe("198.51.100.8", 80, Protocol::Tcp)));
        // The load balancer in Proxy mode reaches the Service through its NodePort.
        assert!(d
            .frontends
            .contains_key(&fe("192.168.50.2", 30080, Protocol::Tcp)));
    }

    #[test]
    fn node_ports_outside_the_range_are_refused() {
        let yaml = web_load_balancer("Cluster").replace("nodePort: 30080", "nodePort: 22");
        let (d, errors) = build(&yaml);
        let text = messages(&errors).join("\n");
        assert!(
            text.contains("nodePort 22 of port 80 is outside the NodePort range 30000-32767"),
            "{text}"
        );
        assert!(!d
            .frontends
            .contains_key(&fe("192.168.50.2", 22, Protocol::Tcp)));
        // The rest of the Service still applies.
        assert!(d
            .frontends
            .contains_key(&fe("192.0.2.10", 80, Protocol::Tcp)));
    }

    #[test]
    fn node_port_ranges_parse() {
        assert_eq!(
            "30000-32767".parse::<NodePortRange>().unwrap(),
            NodePortRange::default()
        );
        assert_eq!(
            "20000-20010".parse::<NodePortRange>().unwrap(),
            NodePortRange {
                first: 20000,
                last: 20010
            }
        );
        for bad in ["30000", "0-10", "40000-30000", "1-70000", "a-b"] {
            assert!(bad.parse::<NodePortRange>().is_err(), "{bad}");
        }
    }

    #[test]
    fn etp_local_without_local_endpoints_has_an_empty_external_entry() {
        let yaml = web_load_balancer("Local").replace("nodeName: node-a", "nodeName: node-c");
        let (d, _) = build(&yaml);
        let external = fe("192.168.50.2", 30080, Protocol::Tcp).with_scope(Scope::External);
        assert!(backends(&d, external).is_empty());
        assert_eq!(
            backends(&d, fe("192.168.50.2", 30080, Protocol::Tcp)).len(),
            2
        );
    }

    #[test]
    fn bad_node_ports_and_external_addresses_are_reported() {
        let yaml = web_load_balancer("Cluster")
            .replace("nodePort: 30080", "nodePort: 70000")
            .replace("192.0.2.10,", "not-an-ip,");
        let (d, errors) = build(&yaml);
        let text = messages(&errors).join("\n");
        assert!(
            text.contains("Service default/web: nodePort 70000 of port 80 is out of range"),
            "{text}"
        );
        assert!(
            text.contains("spec.externalIPs \"not-an-ip\" is not an IP address"),
            "{text}"
        );
        // The rest of the Service still applies.
        assert!(d
            .frontends
            .contains_key(&fe("10.96.0.10", 80, Protocol::Tcp)));
        assert!(d
            .frontends
            .contains_key(&fe("198.51.100.7", 80, Protocol::Tcp)));
    }

    #[test]
    fn internal_traffic_policy_local_keeps_this_nodes_endpoints() {
        let yaml = WEB.replace(
            "internalTrafficPolicy: Cluster",
            "internalTrafficPolicy: Local",
        );
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty());
        assert_eq!(
            backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)),
            [local_be("10.244.1.5", 8080)]
        );
        // No local endpoint: the frontend stays and refuses connections.
        let (d, _) = build_node(&yaml, "node-z");
        assert!(backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)).is_empty());
    }

    fn service(name: &str, spec: &str) -> String {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n{spec}\n")
    }

    fn slice(name: &str, svc: &str, body: &str) -> String {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata:\n  name: {name}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {svc}}}\n{body}\n"
        )
    }

    #[test]
    fn skipped_services_produce_nothing_and_their_slices_are_fine() {
        let body = "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 80}]";
        let yaml = [
            service("headless", "  clusterIP: None\n  ports: [{port: 80}]"),
            slice("headless-1", "headless", body),
            service("ext", "  type: ExternalName\n  externalName: example.com"),
            slice("ext-1", "ext", body),
            "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: other\n  namespace: default\n  \
             labels: {service.kubernetes.io/service-proxy-name: cilium}\nspec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}\n"
                .to_owned(),
            "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: hl\n  namespace: default\n  \
             labels: {service.kubernetes.io/headless: \"\"}\nspec: {clusterIP: 10.96.0.6, ports: [{port: 80}]}\n"
                .to_owned(),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty(), "{:?}", messages(&errors));
        assert!(d.frontends.is_empty());
    }

    #[test]
    fn address_families() {
        let v6_slice = |name: &str, svc: &str, ip: &str| {
            slice(
                name,
                svc,
                &format!("addressType: IPv6\nendpoints: [{{addresses: [\"{ip}\"]}}]\nports: [{{port: 8080}}]"),
            )
        };
        let v4_slice = |name: &str, svc: &str, ip: &str| {
            slice(
                name,
                svc,
                &format!("addressType: IPv4\nendpoints: [{{addresses: [{ip}]}}]\nports: [{{port: 8080}}]"),
            )
        };
        let yaml = [
            service("v6", "  clusterIP: fd00::10\n  clusterIPs: [fd00::10]\n  ports: [{port: 80}]"),
            v6_slice("v6-1", "v6", "fd00:1::1"),
            // An IPv4 slice of an IPv6-only Service serves nothing.
            v4_slice("v6-2", "v6", "10.0.0.9"),
            service(
                "dual",
                "  clusterIP: fd00::11\n  clusterIPs: [fd00::11, 10.96.0.11]\n  \
                 ipFamilies: [IPv6, IPv4]\n  ipFamilyPolicy: RequireDualStack\n  ports: [{port: 80}]",
            ),
            v6_slice("dual-1", "dual", "fd00:1::2"),
            v4_slice("dual-2", "dual", "10.0.0.2"),
            // An address of the other family in a slice is refused like a bad one.
            v6_slice("dual-3", "dual", "10.0.0.3"),
            service(
                "mismatch",
                "  clusterIPs: [10.96.0.12]\n  ipFamilies: [IPv6]\n  ports: [{port: 80}]",
            ),
            service(
                "single",
                "  clusterIPs: [10.96.0.13, fd00::13]\n  ipFamilyPolicy: SingleStack\n  ports: [{port: 80}]",
            ),
            service(
                "require",
                "  clusterIPs: [10.96.0.14]\n  ipFamilyPolicy: RequireDualStack\n  ports: [{port: 80}]",
            ),
            service("twov4", "  clusterIPs: [10.96.0.15, 10.96.0.16]\n  ports: [{port: 80}]"),
            service("noip", "  ports: [{port: 80}]"),
            service("badip", "  clusterIP: 10.96.0.300\n  ports: [{port: 80}]"),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert_eq!(
            messages(&errors),
            [
                "Service default/badip: cluster IP \"10.96.0.300\" is not an IP address",
                "Service default/mismatch: spec.ipFamilies [IPv6] contradicts spec.clusterIPs \
                 [10.96.0.12]; the Service is not proxied until they name the same families in \
                 the same order",
                "Service default/noip: has no spec.clusterIP; set one, or `clusterIP: None` for a headless Service",
                "Service default/require: spec.ipFamilyPolicy RequireDualStack is not met by \
                 spec.clusterIPs; serving 10.96.0.14",
                "Service default/single: spec.ipFamilyPolicy SingleStack is not met by \
                 spec.clusterIPs; serving 10.96.0.13",
                "Service default/twov4: spec.clusterIPs [10.96.0.15, 10.96.0.16] must hold one \
                 address, or one of each family; the Service is not proxied",
                "EndpointSlice default/dual-3: endpoints[0]: address \"10.0.0.3\" is not an IPv6 \
                 address (the slice's addressType); that endpoint is skipped",
            ]
        );
        assert_eq!(
            d.frontends.keys().copied().collect::<Vec<_>>(),
            [
                fe("10.96.0.11", 80, Protocol::Tcp),
                fe("10.96.0.13", 80, Protocol::Tcp),
                fe("10.96.0.14", 80, Protocol::Tcp),
                fe("fd00::10", 80, Protocol::Tcp),
                fe("fd00::11", 80, Protocol::Tcp),
            ]
        );
        // Each family's frontend gets its own family's endpoints only.
        assert_eq!(
            backends(&d, fe("fd00::10", 80, Protocol::Tcp)),
            [be("fd00:1::1", 8080)]
        );
        assert_eq!(
            backends(&d, fe("fd00::11", 80, Protocol::Tcp)),
            [be("fd00:1::2", 8080)]
        );
        assert_eq!(
            backends(&d, fe("10.96.0.11", 80, Protocol::Tcp)),
            [be("10.0.0.2", 8080)]
        );
        assert_eq!(
            &*d.frontends[&fe("fd00::11", 80, Protocol::Tcp)].service,
            "default/dual"
        );
    }

    /// NodePorts on the node's addresses of both families, external and
    /// load-balancer IPs of either, each with its family's endpoints (local ones for
    /// `externalTrafficPolicy: Local`) and its family's source ranges.
    #[test]
    fn dual_stack_external_frontends() {
        let yaml = [
            service(
                "web",
                "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  \
                 clusterIPs: [10.96.0.20, fd00::20]\n  externalIPs: [198.51.100.20, 2001:db8::20]\n  \
                 loadBalancerSourceRanges: [203.0.113.0/24]\n  ports: [{port: 80, nodePort: 30080}]\n\
                 status:\n  loadBalancer:\n    ingress: [{ip: 198.51.100.21}, {ip: \"2001:db8::21\"}]",
            ),
            slice(
                "web-4",
                "web",
                "addressType: IPv4\nports: [{port: 8080}]\nendpoints:\n\
                 - {addresses: [10.0.0.1], nodeName: node-a}\n- {addresses: [10.0.0.2], nodeName: node-b}",
            ),
            slice(
                "web-6",
                "web",
                "addressType: IPv6\nports: [{port: 8080}]\nendpoints:\n\
                 - {addresses: [\"fd00:1::1\"], nodeName: node-a}\n- {addresses: [\"fd00:1::2\"], nodeName: node-b}",
            ),
        ]
        .concat();
        let objects = parse_str(Path::new("t.yaml"), &yaml);
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        let opts = SourceOptions {
            node_name: "node-a".into(),
            node_ips: vec![
                "192.168.50.2".parse().unwrap(),
                "2001:db8:50::2".parse().unwrap(),
            ],
            ..SourceOptions::default()
        };
        let (d, errors) = build_desired(&objects.services, &objects.slices, &opts);
        assert!(errors.is_empty(), "{:?}", messages(&errors));
        let local = |ip: &str| BackendAddr {
            local: true,
            ..be(ip, 8080)
        };
        for (v4, v6) in [
            ("10.96.0.20", "fd00::20"),
            ("198.51.100.20", "2001:db8::20"),
            ("198.51.100.21", "2001:db8::21"),
            ("192.168.50.2", "2001:db8:50::2"),
        ] {
            let port = if v4.starts_with("192.") { 30080 } else { 80 };
            let f4 = fe(v4, port, Protocol::Tcp);
            let f6 = fe(v6, port, Protocol::Tcp);
            assert_eq!(
                backends(&d, f4),
                [local("10.0.0.1"), be("10.0.0.2", 8080)],
                "{f4}"
            );
            assert_eq!(
                backends(&d, f6),
                [local("fd00:1::1"), be("fd00:1::2", 8080)],
                "{f6}"
            );
            if !v4.starts_with("10.96") {
                let external = |f: Frontend| backends(&d, f.with_scope(Scope::External));
                assert_eq!(external(f4), [local("10.0.0.1")], "{f4}");
                assert_eq!(external(f6), [local("fd00:1::1")], "{f6}");
            }
        }
        // Only IPv4 ranges are given: the IPv4 LB IP is guarded, the IPv6 one is open,
        // as kube-proxy's IPv6 proxier sees no range of its own family.
        assert_eq!(
            ranges(&d, fe("198.51.100.21", 80, Protocol::Tcp)),
            Some(vec!["203.0.113.0/24".to_owned()])
        );
        assert_eq!(ranges(&d, fe("2001:db8::21", 80, Protocol::Tcp)), None);
        // One ready local endpoint of the primary family, not one per family.
        assert_eq!(d.health_checks[&32000].local_endpoints, 1);
    }

    #[test]
    fn port_and_protocol_errors_drop_only_that_port() {
        let yaml = service(
            "web",
            "  clusterIP: 10.96.0.10\n  ports:\n  - {name: zero, port: 0}\n  - {name: big, port: 70000}\n  \
             - {name: sctp, port: 7, protocol: SCTP}\n  - {name: dns, port: 53, protocol: UDP}\n  - {name: dnstcp, port: 53}",
        );
        let (d, errors) = build(&yaml);
        assert_eq!(
            messages(&errors),
            [
                "Service default/web: port 0 is out of range (1-65535)",
                "Service default/web: port 70000 is out of range (1-65535)",
                "Service default/web: port 7/SCTP: protocol SCTP is not supported (only TCP and UDP); \
                 that port is not proxied",
            ]
        );
        let keys: Vec<_> = d.frontends.keys().copied().collect();
        assert_eq!(
            keys,
            [
                fe("10.96.0.10", 53, Protocol::Tcp),
                fe("10.96.0.10", 53, Protocol::Udp)
            ]
        );
    }

    #[test]
    fn udp_ports_match_udp_slice_ports() {
        let yaml = [
            service("dns", "  clusterIP: 10.96.0.10\n  ports:\n  - {name: dns, port: 53, protocol: UDP}\n  - {name: dns-tcp, port: 53, protocol: TCP}"),
            slice(
                "dns-1",
                "dns",
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\n\
                 ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5354, protocol: TCP}]",
            ),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty());
        assert_eq!(
            backends(&d, fe("10.96.0.10", 53, Protocol::Udp)),
            [be("10.0.0.1", 5353)]
        );
        assert_eq!(
            backends(&d, fe("10.96.0.10", 53, Protocol::Tcp)),
            [be("10.0.0.1", 5354)]
        );
        assert_eq!(
            &*d.frontends[&fe("10.96.0.10", 53, Protocol::Udp)].service,
            "default/dns:dns"
        );
    }

    #[test]
    fn session_affinity() {
        let yaml = [
            service(
                "default-timeout",
                "  clusterIP: 10.96.0.1\n  sessionAffinity: ClientIP\n  ports: [{port: 80}]",
            ),
            service(
                "custom",
                "  clusterIP: 10.96.0.2\n  sessionAffinity: ClientIP\n  \
                 sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  ports: [{port: 80}]",
            ),
            service(
                "too-long",
                "  clusterIP: 10.96.0.3\n  sessionAffinity: ClientIP\n  \
                 sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}\n  ports: [{port: 80}]",
            ),
            service(
                "zero",
                "  clusterIP: 10.96.0.4\n  sessionAffinity: ClientIP\n  \
                 sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}\n  ports: [{port: 80}]",
            ),
            service(
                "none",
                "  clusterIP: 10.96.0.5\n  sessionAffinity: None\n  \
                 sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}\n  ports: [{port: 80}]",
            ),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        let timeout = |ip| d.frontends[&fe(ip, 80, Protocol::Tcp)].affinity_timeout_sec;
        assert_eq!(timeout("10.96.0.1"), Some(10_800));
        assert_eq!(timeout("10.96.0.2"), Some(60));
        assert_eq!(timeout("10.96.0.5"), None);
        assert_eq!(d.frontends.len(), 3);
        assert_eq!(
            messages(&errors),
            [
                "Service default/too-long: sessionAffinityConfig.clientIP.timeoutSeconds 86401 is out \
                 of range (1-86400); the Service is not proxied until it is fixed",
                "Service default/zero: sessionAffinityConfig.clientIP.timeoutSeconds 0 is out of range \
                 (1-86400); the Service is not proxied until it is fixed",
            ]
        );
    }

    const SVC: &str = "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]";

    fn endpoints_yaml(endpoints: &str) -> String {
        [
            service("web", SVC),
            slice(
                "web-1",
                "web",
                &format!("addressType: IPv4\nports: [{{port: 8080}}]\nendpoints:\n{endpoints}"),
            ),
        ]
        .concat()
    }

    fn web_backends(yaml: &str) -> Vec<BackendAddr> {
        let (d, errors) = build(yaml);
        assert!(errors.is_empty(), "{:?}", messages(&errors));
        backends(&d, fe("10.96.0.10", 80, Protocol::Tcp))
    }

    #[test]
    fn conditions_pick_ready_then_serving_terminating() {
        let mixed = endpoints_yaml(
            "- {addresses: [10.0.0.1], conditions: {ready: true}}\n\
             - {addresses: [10.0.0.2]}\n\
             - {addresses: [10.0.0.3], conditions: {ready: false}}\n\
             - {addresses: [10.0.0.4], conditions: {ready: false, serving: true, terminating: true}}",
        );
        assert_eq!(
            web_backends(&mixed),
            [be("10.0.0.1", 8080), be("10.0.0.2", 8080)]
        );

        let terminating = endpoints_yaml(
            "- {addresses: [10.0.0.3], conditions: {ready: false}}\n\
             - {addresses: [10.0.0.4], conditions: {ready: false, serving: true, terminating: true}}\n\
             - {addresses: [10.0.0.5], conditions: {ready: false, serving: false, terminating: true}}\n\
             - {addresses: [10.0.0.6], conditions: {ready: false, terminating: true}}",
        );
        assert_eq!(web_backends(&terminating), [be("10.0.0.4", 8080)]);

        let none =
            endpoints_yaml("- {addresses: [10.0.0.3], conditions: {ready: false, serving: true}}");
        assert!(web_backends(&none).is_empty());
    }

    #[test]
    fn local_policy_falls_back_among_local_endpoints_only() {
        let yaml = endpoints_yaml(
            "- {addresses: [10.0.0.1], nodeName: node-b}\n\
             - {addresses: [10.0.0.2], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}}",
        )
        .replace("ports: [{port: 80}]", "ports: [{port: 80}]\n  internalTrafficPolicy: Local");
        assert_eq!(web_backends(&yaml), [local_be("10.0.0.2", 8080)]);
    }

    #[test]
    fn service_without_endpoints_keeps_its_frontend() {
        let (d, errors) = build(&service("web", SVC));
        assert!(errors.is_empty());
        assert!(backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)).is_empty());
        let (d, _) = build(&endpoints_yaml("  []"));
        assert!(backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)).is_empty());
    }

    #[test]
    fn duplicate_endpoints_across_slices_merge() {
        let body = |ip: &str| {
            format!("addressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [{ip}]}}, {{addresses: [10.0.0.9]}}]")
        };
        let yaml = [
            service("web", SVC),
            slice("web-1", "web", &body("10.0.0.1")),
            slice("web-2", "web", &body("10.0.0.2")),
        ]
        .concat();
        assert_eq!(
            web_backends(&yaml),
            [
                be("10.0.0.1", 8080),
                be("10.0.0.2", 8080),
                be("10.0.0.9", 8080)
            ]
        );
    }

    #[test]
    fn slice_problems() {
        let yaml = [
            service("web", SVC),
            slice("orphan-1", "gone", "addressType: IPv4\nendpoints: []"),
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: nolabel, namespace: default}\n\
             addressType: IPv4\nendpoints: []\n"
                .to_owned(),
            slice(
                "web-1",
                "web",
                "addressType: IPv4\nports: [{port: 8080}, {name: x}, {name: y, port: 0}]\nendpoints:\n\
                 - {addresses: [10.0.0.1]}\n- {addresses: [not-an-ip]}\n- {addresses: []}",
            ),
            slice("fqdn", "web", "addressType: FQDN\nendpoints: [{addresses: [example.com]}]"),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert_eq!(
            messages(&errors),
            [
                "EndpointSlice default/nolabel: has no label kubernetes.io/service-name; add it to tie \
                 the slice to its Service",
                "EndpointSlice default/orphan-1: Service default/gone not found; load the Service \
                 together with its EndpointSlices",
                "EndpointSlice default/web-1: port \"x\" has no port number; its endpoints are not used for that port",
                "EndpointSlice default/web-1: port \"y\": port 0 is out of range (1-65535); its endpoints \
                 are not used for that port",
                "EndpointSlice default/web-1: endpoints[1]: address \"not-an-ip\" is not an IPv4 address \
                 (the slice's addressType); that endpoint is skipped",
                "EndpointSlice default/web-1: endpoints[2] has no address; that endpoint is skipped",
            ]
        );
        assert_eq!(
            backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)),
            [be("10.0.0.1", 8080)]
        );
    }

    #[test]
    fn named_ports_match_by_name_and_protocol() {
        let yaml = [
            service(
                "web",
                "  clusterIP: 10.96.0.10\n  ports:\n  - {name: http, port: 80}\n  - {name: admin, port: 81}\n  \
                 - {name: dns, port: 53, protocol: UDP}",
            ),
            slice(
                "web-1",
                "web",
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\n\
                 ports: [{name: http, port: 8080}, {name: dns, port: 53, protocol: TCP}, {port: 9999}]",
            ),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert!(errors.is_empty());
        assert_eq!(
            backends(&d, fe("10.96.0.10", 80, Protocol::Tcp)),
            [be("10.0.0.1", 8080)]
        );
        // No slice port named admin, and dns is only published for TCP.
        assert!(backends(&d, fe("10.96.0.10", 81, Protocol::Tcp)).is_empty());
        assert!(backends(&d, fe("10.96.0.10", 53, Protocol::Udp)).is_empty());
        assert_eq!(
            &*d.frontends[&fe("10.96.0.10", 81, Protocol::Tcp)].service,
            "default/web:admin"
        );
    }

    #[test]
    fn duplicate_frontends_first_by_name_wins() {
        let yaml = [
            service(
                "zeta",
                "  clusterIP: 10.96.0.10\n  ports: [{port: 80}, {port: 443}]",
            ),
            service("alpha", "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]"),
        ]
        .concat();
        let (d, errors) = build(&yaml);
        assert_eq!(
            messages(&errors),
            ["Service default/zeta: frontend 10.96.0.10:80/TCP is already used by Service default/alpha, \
              which keeps it; give one of them another cluster IP or port"]
        );
        assert_eq!(
            &*d.frontends[&fe("10.96.0.10", 80, Protocol::Tcp)].service,
            "default/alpha"
        );
        assert_eq!(
            &*d.frontends[&fe("10.96.0.10", 443, Protocol::Tcp)].service,
            "default/zeta"
        );
    }

    /// A Service and its slice as a real API server sends them interpret as the
    /// same objects written with only the fields read.
    #[test]
    fn api_objects_as_served_interpret_without_errors() {
        let (service, slice) = crate::source::lean::tests::full_api_objects();
        let mut service: Service = serde_json::from_value(service).unwrap();
        let slice: EndpointSlice = serde_json::from_value(slice).unwrap();
        // Without the proxy-name label the Service is ours.
        service.metadata.labels = None;
        let opts = SourceOptions {
            node_name: "node-a".into(),
            node_ips: vec!["192.168.50.2".parse().unwrap()],
            ..SourceOptions::default()
        };
        let (state, errors) = build_desired(
            std::slice::from_ref(&service),
            std::slice::from_ref(&slice),
            &opts,
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert!(!state.frontends.is_empty());
    }

    /// A huge name is logged as its start and its length.
    #[test]
    fn huge_names_are_cut_in_messages() {
        let huge = "x".repeat(10 << 20);
        let text = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {huge}\n  namespace: default\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: 70000\n"
        );
        let o = parse_str(std::path::Path::new("x.yaml"), &text);
        let (_, errors) = build_desired(&o.services, &o.slices, &SourceOptions::default());
        let message = errors[0].to_string();
        assert!(message.len() < 1000, "{} bytes logged", message.len());
        assert!(
            message.contains(&format!("({} bytes)", huge.len())),
            "{message}"
        );
    }
}
