//! NetworkPolicy conformance, end to end: the cases of Kubernetes' netpol e2e
//! suite (network_policy.go), each on its own two-node cluster of nine pods
//! (namespaces x, y, z; pods a, b, c; see `lb_tests::netpol`), plus cases that
//! suite lacks (endPort, ipBlock on ingress, policyTypes, named ports of either
//! protocol, labels removed, established connections across a policy change).
//!
//! Every case asserts the whole reachability matrix (every client pod to every
//! other pod, TCP and UDP on ports 80 and 81, by pod address and through the
//! server's Service) after each step, polling until it matches or a bounded
//! deadline passes. The agents run with `--network-policy on`, except in the
//! first test, which shows that a policy changes nothing while the flag is left
//! at its default.
//!
//! SCTP: lb-echo and lb-probe speak TCP and UDP only, so no SCTP traffic is
//! probed; the two upstream cases about SCTP rules check what such a rule does
//! to TCP and UDP (nothing must be let through by it).
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use anyhow::{ensure, Result};
use lb_tests::netpol::{
    ns, pod, policy, Family, Netpol, PodRef, Policy, Reachability, Setup, Via, ANY, TCP80, TCP81,
    UDP80, UDP81,
};
use lb_tests::{cargo_tools, lb_binary};
use serde_json::{json, Value};

fn start(setup: Setup) -> Result<Netpol> {
    Netpol::start(cargo_tools!(), &lb_binary()?, setup)
}

/// A cluster whose agents enforce policy, probed over IPv4.
fn enforcing() -> Result<Netpol> {
    start(Setup::enforcing())
}

/// `matchLabels: {pod: <name>}`.
fn pod_labelled(name: &str) -> Value {
    json!({ "matchLabels": { "pod": name } })
}

/// `matchLabels: {kubernetes.io/metadata.name: <name>}`: the label the API
/// server gives every namespace.
fn ns_named(name: &str) -> Value {
    json!({ "matchLabels": { "kubernetes.io/metadata.name": name } })
}

/// `matchLabels: {ns: <name>}`: the model's own namespace label.
fn ns_labelled(name: &str) -> Value {
    json!({ "matchLabels": { "ns": name } })
}

/// Every pod of `namespace` denies all ingress.
fn deny_ingress(namespace: &str) -> Policy {
    policy(
        namespace,
        "deny-ingress",
        json!({ "podSelector": {}, "policyTypes": ["Ingress"] }),
    )
}

/// Every pod of `namespace` denies all ingress and egress.
fn deny_all(namespace: &str) -> Policy {
    policy(
        namespace,
        "deny-all",
        json!({ "podSelector": {}, "policyTypes": ["Ingress", "Egress"] }),
    )
}

/// x/a admits ingress from `from` (a list of peers) on every port.
fn x_a_ingress_from(name: &str, from: Value) -> Policy {
    policy(
        "x",
        name,
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Ingress"],
            "ingress": [{ "from": from }],
        }),
    )
}

/// x/a admits egress to `to` (a list of peers) on every port.
fn x_a_egress_to(name: &str, to: Value) -> Policy {
    policy(
        "x",
        name,
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Egress"],
            "egress": [{ "to": to }],
        }),
    )
}

/// x/a reached from nobody (every protocol and port).
fn x_a_isolated() -> Reachability {
    Reachability::all_allowed().expect_all_ingress(pod("x/a"), false)
}

// --- the flag -------------------------------------------------------------------

/// `--network-policy` left at its default (off): a deny-all policy in namespace
/// x, present before the agents start, changes nothing; every pod reaches every
/// other, by address and through its Service, in both families. (Also the proof
/// that the harness probes correctly.)
#[test]
fn policy_is_not_enforced_while_the_flag_is_off() -> Result<()> {
    let np = start(
        Setup::default_flags()
            .dual_stack()
            .with_policy(deny_all("x"))
            .with_policy(deny_ingress("y")),
    )?;
    np.expect(&Reachability::all_allowed())
}

// --- ingress ---------------------------------------------------------------------

/// A policy selecting every pod of x with no ingress rule: nothing reaches x;
/// x still reaches y and z.
#[test]
fn default_deny_ingress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_ingress("x"))?;
    np.expect(&Reachability::all_allowed().expect(ANY, ns("x"), false))?;
    // `lb policy` on each node: x's pods there enforced for ingress only, with
    // the probes they turned away counted; the node's other pods not enforced.
    for node in 0..2 {
        let rows = np.cluster().node(node).agent().policy()?;
        let mut x_pods: Vec<String> = PodRef::all()
            .filter(|p| p.namespace() == "x" && p.node() == node)
            .map(|p| {
                np.cluster()
                    .pod(&p.host_name())
                    .map(|pod| pod.ip().to_string())
            })
            .collect::<Result<_>>()?;
        x_pods.sort();
        let enforced = |r: &&Value| r["ingress_enforced"] == true || r["egress_enforced"] == true;
        let mut listed: Vec<String> = rows
            .iter()
            .filter(enforced)
            .map(|r| r["address"].as_str().unwrap_or_default().to_owned())
            .filter(|a| !a.contains(':'))
            .collect();
        listed.sort();
        ensure!(
            listed == x_pods,
            "node {node}: lb policy lists {listed:?}, x's pods are {x_pods:?}"
        );
        for row in rows.iter().filter(enforced) {
            ensure!(
                row["ingress_enforced"] == true
                    && row["egress_enforced"] == false
                    && row["ingress_drops"].as_u64().unwrap_or(0) > 0,
                "node {node}: {row}"
            );
        }
    }
    Ok(())
}

/// Ingress and egress denied in x: nothing in or out of x, y and z untouched.
#[test]
fn default_deny_all() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_all("x"))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ANY, ns("x"), false)
            .expect(ns("x"), ANY, false),
    )
}

/// x/a admits pods labelled `pod: b` of its own namespace (a podSelector alone
/// means the policy's namespace): x/b only, not y/b or z/b.
#[test]
fn allow_ingress_from_pod_in_same_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "x-a-from-x-b",
        json!([{ "podSelector": pod_labelled("b") }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true))?;
    // `lb policy x/a` on x/a's node: the policy selecting it, and the verdicts
    // the datapath gives, naming the rule that admits x/b.
    let (x_b, y_b) = (
        np.pod_ip("x/b", Family::V4)?.to_string(),
        np.pod_ip("y/b", Family::V4)?.to_string(),
    );
    let from_x_b = np.lb_policy("x/a", &["--from", &x_b, "--port", "80"])?;
    let selecting = &from_x_b["pod"]["policies"];
    ensure!(
        selecting.as_array().map(Vec::len) == Some(1)
            && selecting[0]["name"] == "x-a-from-x-b"
            && selecting[0]["ingress"] == true
            && selecting[0]["egress"] == false,
        "{from_x_b:#}"
    );
    let verdict = &from_x_b["verdict"];
    ensure!(
        verdict["allowed"] == true
            && verdict["reason"] == "rule"
            && verdict["rule"]["policy"] == "x-a-from-x-b"
            && verdict["rule"]["direction"] == "ingress"
            && verdict["rule"]["index"] == 0,
        "{from_x_b:#}"
    );
    let from_y_b = np.lb_policy(
        "x/a",
        &["--from", &y_b, "--port", "80", "--protocol", "udp"],
    )?;
    ensure!(
        from_y_b["verdict"]["allowed"] == false
            && from_y_b["verdict"]["reason"] == "denied"
            && from_y_b["ingress_drops"].as_u64().unwrap_or(0) > 0,
        "{from_y_b:#}"
    );
    let to_y_b = np.lb_policy("x/a", &["--to", &y_b, "--port", "81"])?;
    ensure!(
        to_y_b["verdict"]["allowed"] == true && to_y_b["verdict"]["reason"] == "open",
        "egress is not isolated: {to_y_b:#}"
    );
    // The agent's /metrics on x/a's node counts the same drops for x/a.
    let node = np.cluster().node(PodRef::parse("x/a").node());
    let metrics = node.netns().run_in(|| {
        let mut reply = ureq::get("http://127.0.0.1:10249/metrics").call()?;
        Ok(reply.body_mut().read_to_string()?)
    })?;
    let sample = |direction: &str| {
        let prefix = format!("lb_policy_drops_total{{pod=\"x/a\",direction=\"{direction}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let ingress = sample("ingress");
    ensure!(
        ingress.is_some_and(|n| n > 0) && sample("egress") == Some(0),
        "lb_policy_drops_total for x/a: ingress {ingress:?}:\n{metrics}"
    );
    Ok(())
}

/// x denies all ingress; a second policy opens x/a to every pod of every
/// namespace (both selectors empty in one peer): x/a reached by all, x/b and
/// x/c by none.
#[test]
fn allow_ingress_to_one_target_in_a_denied_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_ingress("x"))?;
    np.apply(&x_a_ingress_from(
        "allow-all-to-a",
        json!([{ "podSelector": {}, "namespaceSelector": {} }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ANY, ns("x"), false)
            .expect(ANY, pod("x/a"), true),
    )
}

/// An empty namespaceSelector alone selects every pod of every namespace:
/// beside a deny of all ingress in x, x/a stays open to all.
#[test]
fn allow_ingress_from_pods_in_all_namespaces() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_ingress("x"))?;
    np.apply(&x_a_ingress_from(
        "allow-from-all-ns",
        json!([{ "namespaceSelector": {} }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ANY, ns("x"), false)
            .expect(ANY, pod("x/a"), true),
    )
}

/// x/a admits namespace y only (by the model's `ns: y` label): pods of x and z
/// are turned away, x/a's own namespace included.
#[test]
fn allow_ingress_only_from_another_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-ns-y",
        json!([{ "namespaceSelector": ns_labelled("y") }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ns("x"), pod("x/a"), false)
            .expect(ns("z"), pod("x/a"), false),
    )
}

/// The same through the label the API server sets on every namespace
/// (`kubernetes.io/metadata.name`).
#[test]
fn allow_ingress_by_the_default_namespace_name_label() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-ns-y-by-name",
        json!([{ "namespaceSelector": ns_named("y") }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ns("x"), pod("x/a"), false)
            .expect(ns("z"), pod("x/a"), false),
    )
}

/// A podSelector by matchExpressions (`pod In [b]`).
#[test]
fn pod_selector_match_expressions() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "x-a-from-pod-in-b",
        json!([{ "podSelector": { "matchExpressions": [
            { "key": "pod", "operator": "In", "values": ["b"] }
        ] } }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true))
}

/// `pod NotIn [a, c]` in x/a's namespace leaves x/b.
#[test]
fn pod_selector_not_in() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "x-a-from-not-a-or-c",
        json!([{ "podSelector": { "matchExpressions": [
            { "key": "pod", "operator": "NotIn", "values": ["a", "c"] }
        ] } }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true))
}

/// A namespaceSelector by matchExpressions (`kubernetes.io/metadata.name In [y]`).
#[test]
fn namespace_selector_match_expressions() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-ns-in-y",
        json!([{ "namespaceSelector": { "matchExpressions": [
            { "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["y"] }
        ] } }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ns("x"), pod("x/a"), false)
            .expect(ns("z"), pod("x/a"), false),
    )
}

/// Two peers are an OR: namespaces other than x, or pod b of x. Only x/c is
/// turned away.
#[test]
fn pod_selector_or_namespace_selector() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-other-ns-or-x-b",
        json!([
            { "namespaceSelector": { "matchExpressions": [
                { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["x"] }
            ] } },
            { "podSelector": pod_labelled("b") },
        ]),
    ))?;
    np.expect(&Reachability::all_allowed().expect(pod("x/c"), pod("x/a"), false))
}

/// Both selectors in one peer are an AND: pods `b` of namespaces other than x:
/// y/b and z/b, not x/b, not y/a.
#[test]
fn pod_selector_and_namespace_selector() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-b-in-other-ns",
        json!([{
            "namespaceSelector": { "matchExpressions": [
                { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["x"] }
            ] },
            "podSelector": pod_labelled("b"),
        }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("y/b"), pod("x/a"), true).expect(
        pod("z/b"),
        pod("x/a"),
        true,
    ))
}

/// Pods `b` or `c` (matchExpressions) of namespaces other than x.
#[test]
fn multiple_pod_selectors_and_namespace_selectors() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-b-c-in-other-ns",
        json!([{
            "namespaceSelector": { "matchExpressions": [
                { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["x"] }
            ] },
            "podSelector": { "matchExpressions": [
                { "key": "pod", "operator": "In", "values": ["b", "c"] }
            ] },
        }]),
    ))?;
    let mut want = x_a_isolated();
    for client in ["y/b", "y/c", "z/b", "z/c"] {
        want = want.expect(pod(client), pod("x/a"), true);
    }
    np.expect(&want)
}

/// Two podSelector peers (`pod: b`, `pod: c`) of x/a's namespace.
#[test]
fn any_of_several_pod_selectors() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-x-b-or-x-c",
        json!([
            { "podSelector": pod_labelled("b") },
            { "podSelector": pod_labelled("c") },
        ]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true).expect(
        pod("x/c"),
        pod("x/a"),
        true,
    ))
}

/// One pod of another namespace, by both selectors: y/a only.
#[test]
fn allow_ingress_from_one_pod_of_another_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-y-a",
        json!([{ "namespaceSelector": ns_named("y"), "podSelector": pod_labelled("a") }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("y/a"), pod("x/a"), true))
}

/// `podSelector: {}` in `from` is every pod of the policy's own namespace: x
/// talks within itself, y and z are turned away.
#[test]
fn deny_ingress_from_other_namespaces() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "only-from-x",
        json!({
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [{ "from": [{ "podSelector": {} }] }],
        }),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ns("y"), ns("x"), false)
            .expect(ns("z"), ns("x"), false),
    )
}

// --- ports and protocols -------------------------------------------------------

/// x/a admits namespace y on TCP 81 only: TCP 80 and UDP are closed to all.
#[test]
fn ingress_on_one_port_from_one_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&port_81_from_y())?;
    np.expect(&port_81_from_y_reachability())
}

fn port_81_from_y() -> Policy {
    policy(
        "x",
        "tcp-81-from-y",
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{ "namespaceSelector": ns_named("y") }],
                "ports": [{ "port": 81, "protocol": "TCP" }],
            }],
        }),
    )
}

fn port_81_from_y_reachability() -> Reachability {
    x_a_isolated().expect_on(&[TCP81], ns("y"), pod("x/a"), true)
}

/// Policies add up: TCP 81 from y, then a second policy for TCP 80 from y opens
/// that port too (UDP stays closed).
#[test]
fn stacked_policies_add_up() -> Result<()> {
    let np = enforcing()?;
    np.apply(&port_81_from_y())?;
    np.expect(&port_81_from_y_reachability())?;
    np.apply(&policy(
        "x",
        "tcp-80-from-y",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{
                "from": [{ "namespaceSelector": ns_named("y") }],
                "ports": [{ "port": 80, "protocol": "TCP" }],
            }],
        }),
    ))?;
    np.expect(&x_a_isolated().expect_on(&[TCP80, TCP81], ns("y"), pod("x/a"), true))
}

/// An ingress rule that is empty (`- {}`) admits everything: after a deny of all
/// ingress in x, an allow-all policy there opens x again.
#[test]
fn allow_all_ingress_after_deny_all() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_ingress("x"))?;
    np.expect(&Reachability::all_allowed().expect(ANY, ns("x"), false))?;
    np.apply(&policy(
        "x",
        "allow-all",
        json!({ "podSelector": {}, "ingress": [{}] }),
    ))?;
    np.expect(&Reachability::all_allowed())
}

/// Every pod of x admits anyone on the named port `serve-81-tcp` only.
#[test]
fn named_port_ingress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "named-81",
        json!({
            "podSelector": {},
            "ingress": [{ "ports": [{ "port": "serve-81-tcp" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP80, UDP80, UDP81], ANY, ns("x"), false))
}

/// x/a admits namespace y on the named port `serve-80-tcp`.
#[test]
fn named_port_ingress_from_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&named_80_from_y())?;
    np.expect(&x_a_isolated().expect_on(&[TCP80], ns("y"), pod("x/a"), true))
}

fn named_80_from_y() -> Policy {
    policy(
        "x",
        "named-80-from-y",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{
                "from": [{ "namespaceSelector": ns_named("y") }],
                "ports": [{ "port": "serve-80-tcp", "protocol": "TCP" }],
            }],
        }),
    )
}

/// A named port without a protocol is TCP: `serve-80-udp` names no TCP port of
/// x/a, so the rule admits nothing and x/a is closed on every port.
#[test]
fn named_port_without_protocol_means_tcp() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "udp-name-as-tcp",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "port": "serve-80-udp" }] }],
        }),
    ))?;
    np.expect(&x_a_isolated())
}

/// Every pod of x may send to the named port `serve-80-tcp` only: resolved on
/// each destination pod.
#[test]
fn named_port_egress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "egress-named-80",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{ "ports": [{ "port": "serve-80-tcp" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP81, UDP80, UDP81], ns("x"), ANY, false))
}

/// The same for a UDP port, named with its protocol.
#[test]
fn named_udp_port_egress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "egress-named-81-udp",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{ "ports": [{ "port": "serve-81-udp", "protocol": "UDP" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP80, TCP81, UDP80], ns("x"), ANY, false))
}

/// A port entry with a protocol and no port: x/a admits TCP on any port, no UDP.
#[test]
fn ingress_any_port_of_one_protocol() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "tcp-only",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "protocol": "TCP" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[UDP80, UDP81], ANY, pod("x/a"), false))
}

/// A UDP-only rule lets no TCP through: x/a admits UDP 81 and nothing else.
#[test]
fn udp_only_rule_denies_tcp() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "udp-81-only",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "port": 81, "protocol": "UDP" }] }],
        }),
    ))?;
    np.expect(&x_a_isolated().expect_on(&[UDP81], ANY, pod("x/a"), true))
}

/// A rule for SCTP 81 beside a deny of all ingress in x must not open TCP (or
/// UDP) 81.
#[test]
fn sctp_rule_is_not_tcp() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_ingress("x"))?;
    np.apply(&policy(
        "x",
        "sctp-81-only",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "port": 81, "protocol": "SCTP" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect(ANY, ns("x"), false))
}

/// A policy whose only rule is for SCTP still isolates the pods it selects.
#[test]
fn sctp_only_policy_isolates_its_pods() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "sctp-80-only",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "port": 80, "protocol": "SCTP" }] }],
        }),
    ))?;
    np.expect(&x_a_isolated())
}

/// `endPort`: x/a admits TCP 81-1000 (a range that is no single prefix): TCP 81
/// opens, TCP 80 and UDP stay closed.
#[test]
fn end_port_range_ingress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "tcp-81-1000",
        json!({
            "podSelector": pod_labelled("a"),
            "ingress": [{ "ports": [{ "port": 81, "endPort": 1000, "protocol": "TCP" }] }],
        }),
    ))?;
    np.expect(&x_a_isolated().expect_on(&[TCP81], ANY, pod("x/a"), true))
}

/// `endPort` on egress: pods of x may send UDP to ports 20-80 only.
#[test]
fn end_port_range_egress() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "udp-20-80",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{ "ports": [{ "port": 20, "endPort": 80, "protocol": "UDP" }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP80, TCP81, UDP81], ns("x"), ANY, false))
}

/// A policy for port 80 closes 81 (and UDP) to every pod of x; a second one
/// allowing all ingress wins, since policies only add.
#[test]
fn ingress_allow_all_policy_takes_precedence() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "ingress-80",
        json!({ "podSelector": {}, "ingress": [{ "ports": [{ "port": 80 }] }] }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP81, UDP80, UDP81], ANY, ns("x"), false))?;
    np.apply(&policy(
        "x",
        "ingress-all",
        json!({ "podSelector": {}, "ingress": [{}] }),
    ))?;
    np.expect(&Reachability::all_allowed())
}

/// The same for egress.
#[test]
fn egress_allow_all_policy_takes_precedence() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "egress-80",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{ "ports": [{ "port": 80 }] }],
        }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_on(&[TCP81, UDP80, UDP81], ns("x"), ANY, false))?;
    np.apply(&policy(
        "x",
        "egress-all",
        json!({ "podSelector": {}, "policyTypes": ["Egress"], "egress": [{}] }),
    ))?;
    np.expect(&Reachability::all_allowed())
}

// --- egress --------------------------------------------------------------------

/// x/a with an empty egress list reaches nobody; others reach it.
#[test]
fn deny_egress_of_one_pod() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "deny-egress-x-a",
        json!({ "podSelector": pod_labelled("a"), "policyTypes": ["Egress"] }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_all_egress(pod("x/a"), false))
}

/// Every pod of x reaches nobody, within x too.
#[test]
fn deny_egress_of_a_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "deny-egress-x",
        json!({ "podSelector": {}, "policyTypes": ["Egress"] }),
    ))?;
    np.expect(&Reachability::all_allowed().expect_all_egress(ns("x"), false))
}

/// x/a may send to y/a only (both selectors).
#[test]
fn egress_to_one_pod_of_another_namespace() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_egress_to(
        "to-y-a",
        json!([{ "namespaceSelector": ns_named("y"), "podSelector": pod_labelled("a") }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect(pod("x/a"), pod("y/a"), true),
    )
}

/// The client's egress policy wins over the server's ingress policy: x/a may
/// send to y/a only; y/a and y/b admit x/a only. x/a reaches y/a; nobody else
/// reaches y/a or y/b; x/a reaches nothing else.
#[test]
fn egress_denied_at_the_client_even_if_the_server_admits_it() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_egress_to(
        "to-y-a",
        json!([{ "namespaceSelector": ns_named("y"), "podSelector": pod_labelled("a") }]),
    ))?;
    for server in ["a", "b"] {
        np.apply(&policy(
            "y",
            &format!("y-{server}-from-x-a"),
            json!({
                "podSelector": pod_labelled(server),
                "ingress": [{ "from": [
                    { "namespaceSelector": ns_named("x"), "podSelector": pod_labelled("a") }
                ] }],
            }),
        ))?;
    }
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect_all_ingress(pod("y/a"), false)
            .expect_all_ingress(pod("y/b"), false)
            .expect(pod("x/a"), pod("y/a"), true),
    )
}

/// x/a may send anywhere except namespace y (`NotIn`, default namespace label).
#[test]
fn egress_namespace_selector_not_in() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_egress_to(
        "not-to-y",
        json!([{ "namespaceSelector": { "matchExpressions": [
            { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["y"] }
        ] } }]),
    ))?;
    np.expect(&Reachability::all_allowed().expect(pod("x/a"), ns("y"), false))
}

/// One policy with both directions: x/a admits x/b (any port) and may send to
/// port 80 (TCP: a numeric port without protocol) only.
#[test]
fn ingress_and_egress_in_one_policy() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "both-ways",
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{ "from": [{ "podSelector": pod_labelled("b") }] }],
            "egress": [{ "ports": [{ "port": 80 }] }],
        }),
    ))?;
    np.expect(
        &x_a_isolated()
            .expect_on(&[TCP81, UDP80, UDP81], pod("x/a"), ANY, false)
            .expect(pod("x/b"), pod("x/a"), true),
    )
}

/// Ingress and egress isolation are independent: x/a with an allow-all egress
/// policy reaches everything; a second policy denying its ingress closes x/a
/// without touching its egress.
#[test]
fn ingress_and_egress_are_controlled_independently() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "egress-all-x-a",
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Egress"],
            "egress": [{}],
        }),
    ))?;
    np.expect(&Reachability::all_allowed())?;
    np.apply(&policy(
        "x",
        "deny-ingress-x-a",
        json!({ "podSelector": pod_labelled("a"), "policyTypes": ["Ingress"] }),
    ))?;
    np.expect(&x_a_isolated())
}

// --- policyTypes ---------------------------------------------------------------

/// `policyTypes: [Ingress]` makes the policy ignore its egress section: x/a's
/// egress stays open although the policy lists an empty egress rule set.
#[test]
fn policy_types_ingress_ignores_the_egress_section() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "ingress-type-only",
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Ingress"],
            "ingress": [{ "from": [{ "podSelector": pod_labelled("b") }] }],
            "egress": [],
        }),
    ))?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true))
}

/// `policyTypes: [Egress]` leaves ingress open, even with an empty ingress list.
#[test]
fn policy_types_egress_leaves_ingress_open() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "egress-type-only",
        json!({
            "podSelector": pod_labelled("a"),
            "policyTypes": ["Egress"],
            "ingress": [],
            "egress": [{ "to": [{ "namespaceSelector": ns_labelled("y") }] }],
        }),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect(pod("x/a"), ns("y"), true),
    )
}

/// Without `policyTypes`, Ingress is always implied and Egress is implied by an
/// egress section: a policy with egress rules only also closes x/a's ingress.
#[test]
fn implied_policy_types() -> Result<()> {
    let np = enforcing()?;
    np.apply(&policy(
        "x",
        "implied-types",
        json!({
            "podSelector": pod_labelled("a"),
            "egress": [{ "to": [{ "namespaceSelector": ns_labelled("y") }] }],
        }),
    ))?;
    np.expect(&x_a_isolated().expect_all_egress(pod("x/a"), false).expect(
        pod("x/a"),
        ns("y"),
        true,
    ))
}

// --- ipBlock -------------------------------------------------------------------

/// x/a may send to y/b's address (/32) only. Through y/b's Service too: egress
/// is judged on the backend's address after translation.
#[test]
fn egress_to_a_pod_cidr() -> Result<()> {
    egress_to_pod_cidr(Setup::enforcing(), Family::V4)
}

fn egress_to_pod_cidr(setup: Setup, family: Family) -> Result<()> {
    let np = start(setup)?;
    let cidr = np.pod_cidr("y/b", family)?;
    np.apply(&x_a_egress_to(
        "to-y-b-cidr",
        json!([{ "ipBlock": { "cidr": cidr } }]),
    ))?;
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect(pod("x/a"), pod("y/b"), true),
    )
}

/// x/a may send to a /4 holding every pod, except x/b's address.
#[test]
fn egress_cidr_except_a_pod() -> Result<()> {
    egress_cidr_except_pod(Setup::enforcing(), Family::V4)
}

fn egress_cidr_except_pod(setup: Setup, family: Family) -> Result<()> {
    let np = start(setup)?;
    np.apply(&wide_except_x_b(&np, family)?)?;
    np.expect(&Reachability::all_allowed().expect(pod("x/a"), pod("x/b"), false))
}

fn wide_except_x_b(np: &Netpol, family: Family) -> Result<Policy> {
    Ok(x_a_egress_to(
        "wide-except-x-b",
        json!([{ "ipBlock": {
            "cidr": np.wide_cidr_around("x/b", family)?,
            "except": [np.pod_cidr("x/b", family)?],
        } }]),
    ))
}

/// An address in one ipBlock's except list is still admitted by another rule:
/// beside the /4-except-x/b policy, a second policy for x/b's /32 lets x/a reach
/// everything; the first policy deleted, x/a reaches x/b only.
#[test]
fn address_in_an_except_is_admitted_by_another_policy() -> Result<()> {
    let np = enforcing()?;
    np.apply(&wide_except_x_b(&np, Family::V4)?)?;
    np.expect(&Reachability::all_allowed().expect(pod("x/a"), pod("x/b"), false))?;
    np.apply(&x_a_egress_to(
        "to-x-b-cidr",
        json!([{ "ipBlock": { "cidr": np.pod_cidr("x/b", Family::V4)? } }]),
    ))?;
    np.expect(&Reachability::all_allowed())?;
    np.delete("x", "wide-except-x-b")?;
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect(pod("x/a"), pod("x/b"), true),
    )
}

/// ipBlock on ingress: x/a admits y/a's address only. Pods keep their address
/// towards a Service's backend, so through the Service too.
#[test]
fn ingress_from_a_pod_cidr() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-y-a-cidr",
        json!([{ "ipBlock": { "cidr": np.pod_cidr("y/a", Family::V4)? } }]),
    ))?;
    np.expect(&x_a_isolated().expect(pod("y/a"), pod("x/a"), true))
}

/// ipBlock with except on ingress: everyone but y/a.
#[test]
fn ingress_cidr_except_a_pod() -> Result<()> {
    let np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-wide-except-y-a",
        json!([{ "ipBlock": {
            "cidr": np.wide_cidr_around("y/a", Family::V4)?,
            "except": [np.pod_cidr("y/a", Family::V4)?],
        } }]),
    ))?;
    np.expect(&Reachability::all_allowed().expect(pod("y/a"), pod("x/a"), false))
}

// --- changes while probing -----------------------------------------------------

/// A policy rewritten in place: allow-all ingress in x, then the same policy
/// with no ingress rule.
#[test]
fn updated_policy_is_enforced() -> Result<()> {
    let np = enforcing()?;
    let spec = |ingress: Value| json!({ "podSelector": {}, "policyTypes": ["Ingress"], "ingress": ingress });
    np.apply(&policy("x", "mutating", spec(json!([{}]))))?;
    np.expect(&Reachability::all_allowed())?;
    np.apply(&policy("x", "mutating", spec(json!([]))))?;
    np.expect(&Reachability::all_allowed().expect(ANY, ns("x"), false))
}

/// A deleted policy stops being enforced.
#[test]
fn deleted_policy_stops_being_enforced() -> Result<()> {
    let np = enforcing()?;
    np.apply(&deny_all("x"))?;
    np.expect(
        &Reachability::all_allowed()
            .expect(ANY, ns("x"), false)
            .expect(ns("x"), ANY, false),
    )?;
    np.delete("x", "deny-all")?;
    np.expect(&Reachability::all_allowed())
}

/// x/a admits namespaces labelled `ns2: updated`: none at first; once y gets the
/// label, y's pods get in; once it loses it again, they are turned away again.
#[test]
fn namespace_label_changes_are_followed() -> Result<()> {
    let mut np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-updated-ns",
        json!([{ "namespaceSelector": { "matchLabels": { "ns2": "updated" } } }]),
    ))?;
    np.expect(&x_a_isolated())?;
    np.set_namespace_labels("y", &[("ns2", "updated")])?;
    np.expect(&x_a_isolated().expect(ns("y"), pod("x/a"), true))?;
    np.set_namespace_labels("y", &[])?;
    np.expect(&x_a_isolated())
}

/// `Exists` on a namespace label: x/a admits namespaces with a `team` label;
/// z gets one.
#[test]
fn namespace_selector_exists() -> Result<()> {
    let mut np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-any-team",
        json!([{ "namespaceSelector": { "matchExpressions": [
            { "key": "team", "operator": "Exists" }
        ] } }]),
    ))?;
    np.expect(&x_a_isolated())?;
    np.set_namespace_labels("z", &[("team", "blue")])?;
    np.expect(&x_a_isolated().expect(ns("z"), pod("x/a"), true))
}

/// x/a admits pods labelled `pod: b, pod2: updated`: none at first; x/b gets in
/// once it carries `pod2: updated`.
#[test]
fn pod_label_added_admits_the_pod() -> Result<()> {
    let mut np = enforcing()?;
    np.apply(&x_a_ingress_from(
        "from-updated-pod",
        json!([{ "podSelector": { "matchLabels": { "pod": "b", "pod2": "updated" } } }]),
    ))?;
    np.expect(&x_a_isolated())?;
    np.set_pod_labels("x/b", &[("pod2", "updated")])?;
    np.expect(&x_a_isolated().expect(pod("x/b"), pod("x/a"), true))
}

/// A policy selecting `target: isolated` isolates x/a once it gets that label,
/// and lets go of it when the label goes.
#[test]
fn pod_label_change_isolates_and_releases_the_pod() -> Result<()> {
    let mut np = enforcing()?;
    np.apply(&policy(
        "x",
        "deny-isolated",
        json!({
            "podSelector": { "matchLabels": { "target": "isolated" } },
            "policyTypes": ["Ingress"],
        }),
    ))?;
    np.expect(&Reachability::all_allowed())?;
    np.set_pod_labels("x/a", &[("target", "isolated")])?;
    np.expect(&x_a_isolated())?;
    np.set_pod_labels("x/a", &[])?;
    np.expect(&Reachability::all_allowed())
}

/// Established connections that stay allowed are not cut by policy changes:
/// y/a holds a connection to x/a by address and one through its Service; a
/// policy closing x/a to all but namespace y, then an unrelated policy in z, and
/// both connections still echo.
#[test]
fn allowed_established_connections_survive_policy_changes() -> Result<()> {
    let np = enforcing()?;
    let mut direct = np.hold("y/a", "x/a", 80, Via::PodIp)?;
    let mut service = np.hold("y/a", "x/a", 80, Via::Service)?;
    for hold in [&direct, &service] {
        anyhow::ensure!(hold.backend == "x-a", "greeted by {}", hold.backend);
    }
    np.apply(&x_a_ingress_from(
        "from-ns-y",
        json!([{ "namespaceSelector": ns_labelled("y") }]),
    ))?;
    let want = Reachability::all_allowed()
        .expect(ns("x"), pod("x/a"), false)
        .expect(ns("z"), pod("x/a"), false);
    np.expect(&want)?;
    anyhow::ensure!(direct.echo("one")? == "x-a one");
    anyhow::ensure!(service.echo("one")? == "x-a one");
    np.apply(&deny_ingress("z"))?;
    np.expect(&want.expect(ANY, ns("z"), false))?;
    anyhow::ensure!(direct.echo("two")? == "x-a two");
    anyhow::ensure!(service.echo("two")? == "x-a two");
    direct.close()?;
    service.close()
}

// --- IPv6 ----------------------------------------------------------------------

/// [`default_deny_ingress`] probed over IPv6.
#[test]
fn ipv6_default_deny_ingress() -> Result<()> {
    let np = start(Setup::enforcing().ipv6())?;
    np.apply(&deny_ingress("x"))?;
    np.expect(&Reachability::all_allowed().expect(ANY, ns("x"), false))
}

/// [`egress_to_a_pod_cidr`] with y/b's IPv6 address (/128).
#[test]
fn ipv6_egress_to_a_pod_cidr() -> Result<()> {
    egress_to_pod_cidr(Setup::enforcing().ipv6(), Family::V6)
}

/// [`egress_cidr_except_a_pod`] with an IPv6 /4 and x/b's /128.
#[test]
fn ipv6_egress_cidr_except_a_pod() -> Result<()> {
    egress_cidr_except_pod(Setup::enforcing().ipv6(), Family::V6)
}

/// [`named_port_ingress_from_namespace`] probed over IPv6.
#[test]
fn ipv6_named_port_ingress_from_namespace() -> Result<()> {
    let np = start(Setup::enforcing().ipv6())?;
    np.apply(&named_80_from_y())?;
    np.expect(&x_a_isolated().expect_on(&[TCP80], ns("y"), pod("x/a"), true))
}

/// [`egress_denied_at_the_client_even_if_the_server_admits_it`]'s selectors,
/// and a deny of all in z, probed over both families at once.
#[test]
fn dual_stack_selectors_and_deny_all() -> Result<()> {
    let np = start(Setup::enforcing().dual_stack())?;
    np.apply(&x_a_egress_to(
        "to-y-a",
        json!([{ "namespaceSelector": ns_named("y"), "podSelector": pod_labelled("a") }]),
    ))?;
    np.apply(&deny_all("z"))?;
    np.expect(
        &Reachability::all_allowed()
            .expect_all_egress(pod("x/a"), false)
            .expect(pod("x/a"), pod("y/a"), true)
            .expect(ANY, ns("z"), false)
            .expect(ns("z"), ANY, false),
    )
}
