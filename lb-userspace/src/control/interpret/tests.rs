use super::*;
use crate::source::yaml::parse_str;
use std::path::Path;

fn build(yaml: &str) -> (DesiredState, Vec<ObjectError>) {
    build_node(yaml, "node-a")
}

fn build_node(yaml: &str, node: &str) -> (DesiredState, Vec<ObjectError>) {
    build_with(yaml, node, Algorithm::Random)
}

fn build_with(yaml: &str, node: &str, lb_algorithm: Algorithm) -> (DesiredState, Vec<ObjectError>) {
    let objects = parse_str(Path::new("t.yaml"), yaml);
    assert!(objects.errors.is_empty(), "{:?}", objects.errors);
    let opts = SourceOptions {
        node_name: node.to_owned(),
        node_ips: vec!["192.168.50.2".parse().unwrap()],
        node_port_range: NodePortRange::default(),
        zone: String::new(),
        lb_algorithm,
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
const WEB: &str = include_str!("../../source/testdata/kubectl-web-list.yaml");

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

/// Maglev is for external traffic: NodePorts, externalIPs and load-balancer IPs
/// (both entries under externalTrafficPolicy: Local) get it from the agent's
/// default or the Service's annotation, which wins; cluster IPs never do. An
/// annotation that names no algorithm is reported and the default applies.
#[test]
fn maglev_applies_to_external_frontends_by_flag_or_annotation() {
    let annotated = |value: &str| {
        web_load_balancer("Local").replace(
            "    labels:\n      app: web\n    name: web\n",
            &format!(
                "    annotations:\n      service.lb/algorithm: {value}\n    labels:\n      app: web\n    name: web\n"
            ),
        )
    };
    let maglev_of = |d: &DesiredState| -> Vec<(String, bool)> {
        d.frontends
            .iter()
            .filter(|(f, _)| f.port != 9090)
            .map(|(f, spec)| (f.to_string(), spec.maglev))
            .collect()
    };
    let external = [
        "192.0.2.10:80/TCP",
        "192.0.2.10:80/TCP (external)",
        "192.168.50.2:30080/TCP",
        "192.168.50.2:30080/TCP (external)",
        "198.51.100.7:80/TCP",
        "198.51.100.7:80/TCP (external)",
        "[2001:db8::1]:80/TCP",
        "[2001:db8::1]:80/TCP (external)",
    ];
    let expect = |on: bool| -> Vec<(String, bool)> {
        let mut all: Vec<(String, bool)> = external.iter().map(|f| (f.to_string(), on)).collect();
        all.push(("10.96.0.10:80/TCP".into(), false));
        all.sort();
        all
    };
    let sorted = |mut v: Vec<(String, bool)>| {
        v.sort();
        v
    };
    for (yaml, default, on) in [
        (web_load_balancer("Local"), Algorithm::Random, false),
        (web_load_balancer("Local"), Algorithm::Maglev, true),
        (annotated("maglev"), Algorithm::Random, true),
        (annotated("random"), Algorithm::Maglev, false),
    ] {
        let (d, errors) = build_with(&yaml, "node-a", default);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(sorted(maglev_of(&d)), expect(on), "{default:?}");
    }
    let (d, errors) = build_with(&annotated("consistent"), "node-a", Algorithm::Maglev);
    assert_eq!(
        messages(&errors),
        [
            "Service default/web: annotation service.lb/algorithm: \"consistent\" is neither \
          `maglev` nor `random`; its NodePort, LoadBalancer and externalIP frontends use the \
          agent's --lb-algorithm (maglev)"
        ]
    );
    assert_eq!(sorted(maglev_of(&d)), expect(true));
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
            &format!(
                "addressType: IPv4\nendpoints: [{{addresses: [{ip}]}}]\nports: [{{port: 8080}}]"
            ),
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
