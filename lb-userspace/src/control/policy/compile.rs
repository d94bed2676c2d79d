//! The incremental compiler: the objects, what they compile to, and the bookkeeping
//! that lets one change rewrite only the entries it affects.
//!
//! `LB_POLICY` is a union of contributions: for a local pod (endpoint) `P` and a
//! policy `Q` selecting it, every rule `R` of `Q` gives entries per peer (the rule's
//! matching identities, CIDR classes, or `POLICY_PEER_ANY`). These are kept per
//! (P, Q), grouped by (peer, rule), so that
//! - an identity appearing or going (a pod with new labels, a namespace relabelled)
//!   adds or removes exactly the (identity, rule) groups of the rules it matches;
//! - a pod or policy change recomputes only the (P, Q) pairs it touches;
//! - a key several rules give stays until the last one goes, valued with the first
//!   rule by (namespace, policy, direction, index).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use lb_common::policy::{
    PolicyAllow, PolicyCidrKey, PolicyEndpoint, PolicyKey, POLICY_DIR_EGRESS, POLICY_DIR_INGRESS,
    POLICY_DROPS_MAX, POLICY_ENFORCE_EGRESS, POLICY_ENFORCE_INGRESS, POLICY_ID_FIRST_POD,
    POLICY_ID_HOST, POLICY_PEER_ANY,
};
use lb_common::IpAddrBe;

use super::cidr::{Block, Partition};
use super::ports::{self, NamedOn, PortEntry};
use super::tracked::Tracked;
use super::view::{direction_name, PodPolicies, RuleName, SelectingPolicy};
use super::{Lpm, MapOps, PolicyMaps};
use crate::model::policy::{
    Labels, NamedPort, NetworkPolicy, Peer, PolicyNamespace, PolicyPod, PolicyRule, Text,
};

/// One change of the objects.
#[derive(Clone, Debug)]
pub enum PolicyChange {
    UpsertPolicy(Arc<NetworkPolicy>),
    DeletePolicy { namespace: Text, name: Text },
    UpsertPod(Arc<PolicyPod>),
    DeletePod { namespace: Text, name: Text },
    UpsertNamespace(Arc<PolicyNamespace>),
    DeleteNamespace { name: Text },
}

/// Which rule a `PolicyAllow::rule` id names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleRef {
    pub namespace: Text,
    pub policy: Text,
    /// `POLICY_DIR_INGRESS` or `POLICY_DIR_EGRESS`.
    pub direction: u8,
    /// Index in the policy's `ingress` or `egress` list.
    pub index: usize,
}

/// (namespace, name) of a pod or policy.
type ObjectKey = (Text, Text);

/// What makes a pod's identity: pods with equal ones are the same peer to every rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdentityDesc {
    pub namespace: Text,
    pub namespace_labels: Labels,
    pub labels: Labels,
    pub named_ports: Arc<[NamedPort]>,
}

#[derive(Default)]
struct Identities {
    ids: HashMap<Arc<IdentityDesc>, u32>,
    by_id: BTreeMap<u32, (Arc<IdentityDesc>, usize)>,
    free: BTreeSet<u32>,
    next: u32,
}

/// A small id allocator: the lowest free id at or above `first`.
fn allocate(free: &mut BTreeSet<u32>, next: &mut u32, first: u32) -> u32 {
    if let Some(id) = free.pop_first() {
        return id;
    }
    let id = (*next).max(first);
    *next = id + 1;
    id
}

struct RuleState {
    id: u32,
    direction: u8,
    rule: PolicyRule,
    /// No `from`/`to`: every peer.
    any: bool,
    /// Egress with named ports: per destination identity (also when `any`).
    named_egress: bool,
    identities: BTreeSet<u32>,
    blocks: Vec<Arc<Block>>,
    classes: BTreeSet<u32>,
}

impl RuleState {
    /// Whether the rule gives entries for identity `desc` (a pod peer).
    fn matches(&self, policy_ns: &Text, desc: &IdentityDesc) -> bool {
        if self.any {
            return self.named_egress;
        }
        self.rule.peers.iter().any(|peer| match peer {
            Peer::Pods { namespaces, pods } => {
                let ns_ok = match namespaces {
                    None => desc.namespace == *policy_ns,
                    Some(sel) => sel.matches(&desc.namespace_labels),
                };
                ns_ok && pods.as_ref().is_none_or(|sel| sel.matches(&desc.labels))
            }
            Peer::Block(_) => false,
        })
    }
}

struct PolicyState {
    policy: Arc<NetworkPolicy>,
    rules: Vec<RuleState>,
    /// Local endpoints the policy selects.
    selected: BTreeSet<u32>,
}

impl PolicyState {
    fn flags(&self) -> u32 {
        let mut flags = 0;
        if self.policy.ingress.is_some() {
            flags |= POLICY_ENFORCE_INGRESS;
        }
        if self.policy.egress.is_some() {
            flags |= POLICY_ENFORCE_EGRESS;
        }
        flags
    }
}

struct LocalPod {
    key: ObjectKey,
    /// Policies selecting it.
    policies: BTreeSet<u32>,
    /// Addresses written to `LB_POLICY_ENDPOINTS`.
    ips: Vec<IpAddr>,
}

/// The peer one group of entries is for.
#[derive(Clone, Copy)]
enum PeerOf<'a> {
    Any,
    Identity(u32, &'a IdentityDesc),
    Class(u32),
}

/// One (endpoint, policy) pair's entries, by (peer, rule id).
type PairEntries = BTreeMap<(u32, u32), Vec<Lpm<PolicyKey>>>;

/// The objects, and the maps they compile to for the pods of one node.
pub struct PolicyCompiler {
    node_name: Text,
    node_addrs: BTreeSet<IpAddr>,
    namespaces: HashMap<Text, Labels>,
    pods: HashMap<ObjectKey, (Arc<PolicyPod>, Option<u32>)>,
    pods_of_ns: HashMap<Text, BTreeSet<Text>>,
    ip_owners: BTreeMap<IpAddr, BTreeSet<ObjectKey>>,
    identities: Identities,
    policy_index: HashMap<ObjectKey, u32>,
    policies: HashMap<u32, PolicyState>,
    policies_of_ns: HashMap<Text, BTreeSet<u32>>,
    free_policy: BTreeSet<u32>,
    next_policy: u32,
    rule_refs: HashMap<u32, RuleRef>,
    free_rule: BTreeSet<u32>,
    next_rule: u32,
    local: HashMap<u32, LocalPod>,
    endpoint_of: HashMap<ObjectKey, u32>,
    free_endpoint: BTreeSet<u32>,
    next_endpoint: u32,
    partition: Partition,
    pairs: HashMap<(u32, u32), PairEntries>,
    contributors: HashMap<Lpm<PolicyKey>, Vec<u32>>,
    out_endpoints: Tracked<IpAddrBe, PolicyEndpoint>,
    out_identities: Tracked<IpAddrBe, u32>,
    out_cidrs: Tracked<Lpm<PolicyCidrKey>, u32>,
    out_policy: Tracked<Lpm<PolicyKey>, PolicyAllow>,
    /// Endpoints whose flags may have changed.
    dirty_flags: BTreeSet<u32>,
}

/// The first rule by (namespace, policy, direction, index): which one a key several
/// rules give is shown with.
fn first_rule(refs: &HashMap<u32, RuleRef>, rules: &[u32]) -> u32 {
    *rules
        .iter()
        .min_by(|a, b| refs.get(a).cmp(&refs.get(b)))
        .expect("a key has at least one rule")
}

impl PolicyCompiler {
    /// A compiler for the pods whose `spec.nodeName` is `node_name`.
    pub fn new(node_name: &str) -> Self {
        PolicyCompiler {
            node_name: Text::from(node_name),
            node_addrs: BTreeSet::new(),
            namespaces: HashMap::new(),
            pods: HashMap::new(),
            pods_of_ns: HashMap::new(),
            ip_owners: BTreeMap::new(),
            identities: Identities::default(),
            policy_index: HashMap::new(),
            policies: HashMap::new(),
            policies_of_ns: HashMap::new(),
            free_policy: BTreeSet::new(),
            next_policy: 0,
            rule_refs: HashMap::new(),
            free_rule: BTreeSet::new(),
            next_rule: 1,
            local: HashMap::new(),
            endpoint_of: HashMap::new(),
            free_endpoint: BTreeSet::new(),
            next_endpoint: 1,
            partition: Partition::default(),
            pairs: HashMap::new(),
            contributors: HashMap::new(),
            out_endpoints: Tracked::default(),
            out_identities: Tracked::default(),
            out_cidrs: Tracked::default(),
            out_policy: Tracked::default(),
            dirty_flags: BTreeSet::new(),
        }
    }

    /// A compiler holding every object at once (what a restart builds).
    pub fn full(
        node_name: &str,
        node_addrs: impl IntoIterator<Item = IpAddr>,
        namespaces: impl IntoIterator<Item = Arc<PolicyNamespace>>,
        pods: impl IntoIterator<Item = Arc<PolicyPod>>,
        policies: impl IntoIterator<Item = Arc<NetworkPolicy>>,
    ) -> Self {
        let mut c = PolicyCompiler::new(node_name);
        c.set_node_addresses(node_addrs);
        for ns in namespaces {
            c.apply(PolicyChange::UpsertNamespace(ns));
        }
        for pod in pods {
            c.apply(PolicyChange::UpsertPod(pod));
        }
        for policy in policies {
            c.apply(PolicyChange::UpsertPolicy(policy));
        }
        c
    }

    /// The maps' desired content now.
    pub fn maps(&self) -> PolicyMaps {
        PolicyMaps {
            endpoints: self.out_endpoints.current().clone(),
            identities: self.out_identities.current().clone(),
            cidrs: self.out_cidrs.current().clone(),
            policy: self.out_policy.current().clone(),
        }
    }

    /// Entries per map: (endpoints, identities, cidrs, policy).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (
            self.out_endpoints.current().len(),
            self.out_identities.current().len(),
            self.out_cidrs.current().len(),
            self.out_policy.current().len(),
        )
    }

    /// Distinct pod identities in use.
    pub fn identity_count(&self) -> usize {
        self.identities.by_id.len()
    }

    /// Which rule an allow's `rule` id names.
    pub fn rule(&self, id: u32) -> Option<&RuleRef> {
        self.rule_refs.get(&id)
    }

    /// The identity an id names (pod identities only).
    pub fn identity(&self, id: u32) -> Option<&IdentityDesc> {
        self.identities.by_id.get(&id).map(|(d, _)| &**d)
    }

    /// The `(cidr, excepts)` blocks a CIDR class id stands for, as text.
    pub fn class_blocks(&self, id: u32) -> Option<Vec<String>> {
        self.partition.blocks_of_class(id).map(|set| {
            set.iter()
                .map(|b| {
                    let ex: Vec<String> = b.except.iter().map(|e| e.to_string()).collect();
                    format!("{} except [{}]", b.cidr, ex.join(", "))
                })
                .collect()
        })
    }

    /// The local pod an endpoint id names.
    pub fn endpoint_pod(&self, id: u32) -> Option<(&str, &str)> {
        self.local.get(&id).map(|l| (&*l.key.0, &*l.key.1))
    }

    /// The policies selecting a local pod, as (namespace, name).
    pub fn policies_selecting(&self, namespace: &str, name: &str) -> Vec<(Text, Text)> {
        let key = (Text::from(namespace), Text::from(name));
        let Some(local) = self.endpoint_of.get(&key).and_then(|ep| self.local.get(ep)) else {
            return Vec::new();
        };
        let mut out: Vec<(Text, Text)> = local
            .policies
            .iter()
            .filter_map(|q| self.policies.get(q))
            .map(|q| (q.policy.namespace.clone(), q.policy.name.clone()))
            .collect();
        out.sort();
        out
    }

    /// Every local pod's endpoint id and `namespace/name`, for the per-pod drop
    /// metrics.
    pub fn local_pods(&self) -> Vec<(u32, String)> {
        self.local
            .iter()
            .map(|(id, l)| (*id, format!("{}/{}", l.key.0, l.key.1)))
            .collect()
    }

    /// Pod `namespace/name` as `lb policy POD` shows it (`None`: no such pod).
    pub fn pod_policies(&self, namespace: &str, name: &str) -> Option<PodPolicies> {
        let key = (Text::from(namespace), Text::from(name));
        let (pod, _) = self.pods.get(&key)?;
        let endpoint = self.endpoint_of.get(&key).copied();
        let selecting = endpoint
            .and_then(|ep| self.local.get(&ep))
            .map(|local| &local.policies);
        let mut policies = Vec::new();
        let mut rules = Vec::new();
        for q in selecting.into_iter().flatten() {
            let Some(state) = self.policies.get(q) else {
                continue;
            };
            let (ns, policy) = (&state.policy.namespace, &state.policy.name);
            policies.push(SelectingPolicy {
                namespace: ns.to_string(),
                name: policy.to_string(),
                ingress: state.policy.ingress.is_some(),
                egress: state.policy.egress.is_some(),
            });
            for rule in &state.rules {
                if let Some(r) = self.rule_refs.get(&rule.id) {
                    rules.push(RuleName {
                        id: rule.id,
                        namespace: r.namespace.to_string(),
                        policy: r.policy.to_string(),
                        direction: direction_name(r.direction).to_owned(),
                        index: r.index,
                    });
                }
            }
        }
        policies.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        rules.sort_by_key(|r| r.id);
        Some(PodPolicies {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            node: pod.node_name.to_string(),
            local: *pod.node_name == *self.node_name,
            host_network: pod.host_network,
            addresses: pod.ips.clone(),
            endpoint,
            policies,
            rules,
        })
    }

    fn take_ops(&mut self) -> MapOps {
        self.flush_flags();
        MapOps {
            endpoints: self.out_endpoints.take(),
            identities: self.out_identities.take(),
            cidrs: self.out_cidrs.take(),
            policy: self.out_policy.take(),
        }
    }

    /// This node's addresses: ingress from them is always allowed.
    pub fn set_node_addresses(&mut self, addrs: impl IntoIterator<Item = IpAddr>) -> MapOps {
        let new: BTreeSet<IpAddr> = addrs.into_iter().collect();
        let old = std::mem::replace(&mut self.node_addrs, new);
        for ip in old.symmetric_difference(&self.node_addrs.clone()) {
            self.refresh_ip(*ip);
        }
        self.take_ops()
    }

    /// Applies one change; the map operations it causes.
    pub fn apply(&mut self, change: PolicyChange) -> MapOps {
        self.apply_one(change);
        self.take_ops()
    }

    /// Applies several changes; the map operations they cause together.
    pub fn apply_all(&mut self, changes: impl IntoIterator<Item = PolicyChange>) -> MapOps {
        for change in changes {
            self.apply_one(change);
        }
        self.take_ops()
    }

    fn apply_one(&mut self, change: PolicyChange) {
        match change {
            PolicyChange::UpsertPolicy(p) => {
                self.set_policy((p.namespace.clone(), p.name.clone()), Some(p))
            }
            PolicyChange::DeletePolicy { namespace, name } => {
                self.set_policy((namespace, name), None)
            }
            PolicyChange::UpsertPod(p) => {
                self.set_pod((p.namespace.clone(), p.name.clone()), Some(p))
            }
            PolicyChange::DeletePod { namespace, name } => self.set_pod((namespace, name), None),
            PolicyChange::UpsertNamespace(ns) => {
                let name = ns.name.clone();
                self.set_namespace(name, Some(ns.labels.clone()))
            }
            PolicyChange::DeleteNamespace { name } => self.set_namespace(name, None),
        }
    }

    // ---- namespaces and pods ----

    fn namespace_labels(&self, ns: &Text) -> Labels {
        match self.namespaces.get(ns) {
            Some(labels) => labels.clone(),
            None => PolicyNamespace::implied(ns).labels,
        }
    }

    fn set_namespace(&mut self, name: Text, labels: Option<Labels>) {
        let before = self.namespace_labels(&name);
        match labels {
            Some(l) => {
                self.namespaces.insert(name.clone(), l);
            }
            None => {
                self.namespaces.remove(&name);
            }
        }
        if self.namespace_labels(&name) == before {
            return;
        }
        let pods: Vec<Text> = self
            .pods_of_ns
            .get(&name)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        for pod in pods {
            let key = (name.clone(), pod);
            self.refresh_identity(&key);
        }
    }

    fn identity_desc(&self, pod: &PolicyPod) -> Option<IdentityDesc> {
        if pod.host_network || pod.ips.is_empty() {
            return None;
        }
        Some(IdentityDesc {
            namespace: pod.namespace.clone(),
            namespace_labels: self.namespace_labels(&pod.namespace),
            labels: pod.labels.clone(),
            named_ports: pod.named_ports.clone(),
        })
    }

    fn set_pod(&mut self, key: ObjectKey, pod: Option<Arc<PolicyPod>>) {
        let old = self.pods.remove(&key);
        let old_ips: Vec<IpAddr> = old
            .as_ref()
            .filter(|(p, _)| !p.host_network)
            .map(|(p, _)| p.ips.clone())
            .unwrap_or_default();
        let old_identity = old.as_ref().and_then(|(_, id)| *id);
        match &pod {
            Some(p) => {
                self.pods.insert(key.clone(), (p.clone(), None));
                self.pods_of_ns
                    .entry(key.0.clone())
                    .or_default()
                    .insert(key.1.clone());
            }
            None => {
                if let Some(set) = self.pods_of_ns.get_mut(&key.0) {
                    set.remove(&key.1);
                    if set.is_empty() {
                        self.pods_of_ns.remove(&key.0);
                    }
                }
            }
        }
        // The new identity is taken before the old one is let go, so that a pod
        // keeping its identity does not make it disappear and come back.
        let new_identity = pod
            .as_deref()
            .and_then(|p| self.identity_desc(p))
            .map(|desc| self.hold_identity(desc));
        if let Some(entry) = self.pods.get_mut(&key) {
            entry.1 = new_identity;
        }
        if let Some(id) = old_identity {
            self.release_identity(id);
        }
        let new_ips: Vec<IpAddr> = pod
            .as_ref()
            .filter(|p| !p.host_network)
            .map(|p| p.ips.clone())
            .unwrap_or_default();
        for ip in &old_ips {
            if let Some(owners) = self.ip_owners.get_mut(ip) {
                owners.remove(&key);
                if owners.is_empty() {
                    self.ip_owners.remove(ip);
                }
            }
        }
        for ip in &new_ips {
            self.ip_owners.entry(*ip).or_default().insert(key.clone());
        }
        let mut ips: BTreeSet<IpAddr> = old_ips.into_iter().collect();
        ips.extend(new_ips);
        for ip in ips {
            self.refresh_ip(ip);
        }
        self.refresh_local(&key);
    }

    /// The pod's identity again (its namespace's labels changed).
    fn refresh_identity(&mut self, key: &ObjectKey) {
        let Some((pod, old)) = self.pods.get(key).cloned() else {
            return;
        };
        let new = self
            .identity_desc(&pod)
            .map(|desc| self.hold_identity(desc));
        if let Some(entry) = self.pods.get_mut(key) {
            entry.1 = new;
        }
        if let Some(id) = old {
            self.release_identity(id);
        }
        for ip in pod.ips.clone() {
            self.refresh_ip(ip);
        }
    }

    /// `LB_POLICY_IDENTITY[ip]` from the node's addresses and the pods claiming it.
    fn refresh_ip(&mut self, ip: IpAddr) {
        let value = if self.node_addrs.contains(&ip) {
            Some(POLICY_ID_HOST)
        } else {
            self.ip_owners
                .get(&ip)
                .and_then(|owners| owners.first())
                .and_then(|owner| self.pods.get(owner))
                .and_then(|(_, id)| *id)
        };
        self.out_identities.set(IpAddrBe::from(ip), value);
    }

    fn hold_identity(&mut self, desc: IdentityDesc) -> u32 {
        if let Some(id) = self.identities.ids.get(&desc) {
            let id = *id;
            if let Some(entry) = self.identities.by_id.get_mut(&id) {
                entry.1 += 1;
            }
            return id;
        }
        let ids = &mut self.identities;
        let id = allocate(&mut ids.free, &mut ids.next, POLICY_ID_FIRST_POD);
        let desc = Arc::new(desc);
        ids.ids.insert(desc.clone(), id);
        ids.by_id.insert(id, (desc.clone(), 1));
        self.identity_appeared(id, &desc);
        id
    }

    fn release_identity(&mut self, id: u32) {
        let Some(entry) = self.identities.by_id.get_mut(&id) else {
            return;
        };
        entry.1 -= 1;
        if entry.1 > 0 {
            return;
        }
        let (desc, _) = self.identities.by_id.remove(&id).expect("present");
        self.identities.ids.remove(&desc);
        self.identity_gone(id);
        self.identities.free.insert(id);
    }

    /// A new identity: the rules it matches gain its entries on every endpoint their
    /// policy selects.
    fn identity_appeared(&mut self, id: u32, desc: &IdentityDesc) {
        let mut work = Vec::new();
        for (q, state) in self.policies.iter_mut() {
            for (r, rule) in state.rules.iter_mut().enumerate() {
                if rule.matches(&state.policy.namespace, desc) {
                    rule.identities.insert(id);
                    work.extend(state.selected.iter().map(|ep| (*ep, *q, r)));
                }
            }
        }
        for (ep, q, r) in work {
            let Some(pod) = self.local_pod(ep) else {
                continue;
            };
            let rule = &self.policies[&q].rules[r];
            let keys = keys_for(ep, &pod, rule, PeerOf::Identity(id, desc));
            let rule_id = rule.id;
            self.replace_group(ep, q, (id, rule_id), keys);
        }
    }

    /// An identity gone: its groups go with it.
    fn identity_gone(&mut self, id: u32) {
        let mut work = Vec::new();
        for (q, state) in self.policies.iter_mut() {
            for rule in state.rules.iter_mut() {
                if rule.identities.remove(&id) {
                    work.extend(state.selected.iter().map(|ep| (*ep, *q, rule.id)));
                }
            }
        }
        for (ep, q, rule_id) in work {
            self.replace_group(ep, q, (id, rule_id), Vec::new());
        }
    }

    fn local_pod(&self, ep: u32) -> Option<Arc<PolicyPod>> {
        let local = self.local.get(&ep)?;
        self.pods.get(&local.key).map(|(p, _)| p.clone())
    }

    /// Whether the pod is enforced here: on this node, not host-network, addressed.
    fn is_local(&self, pod: &PolicyPod) -> bool {
        pod.node_name == self.node_name && !pod.host_network && !pod.ips.is_empty()
    }

    /// The pod's endpoint: allocated, updated or freed, and its pairs recomputed.
    fn refresh_local(&mut self, key: &ObjectKey) {
        let pod = self.pods.get(key).map(|(p, _)| p.clone());
        let ep = self.endpoint_of.get(key).copied();
        match (pod.filter(|p| self.is_local(p)), ep) {
            (None, None) => {}
            (None, Some(ep)) => {
                let local = self.local.remove(&ep).expect("endpoint has its pod");
                for q in &local.policies {
                    if let Some(state) = self.policies.get_mut(q) {
                        state.selected.remove(&ep);
                    }
                    self.set_pair(ep, *q, PairEntries::new());
                }
                for ip in &local.ips {
                    self.out_endpoints.set(IpAddrBe::from(*ip), None);
                }
                self.endpoint_of.remove(key);
                self.free_endpoint.insert(ep);
                self.dirty_flags.remove(&ep);
            }
            (Some(pod), ep) => {
                let ep = match ep {
                    Some(ep) => ep,
                    None => {
                        let ep = allocate(&mut self.free_endpoint, &mut self.next_endpoint, 1);
                        // The drop counters are indexed by endpoint id.
                        debug_assert!(ep < POLICY_DROPS_MAX, "more local pods than ids");
                        self.endpoint_of.insert(key.clone(), ep);
                        self.local.insert(
                            ep,
                            LocalPod {
                                key: key.clone(),
                                policies: BTreeSet::new(),
                                ips: Vec::new(),
                            },
                        );
                        ep
                    }
                };
                let selecting: BTreeSet<u32> = self
                    .policies_of_ns
                    .get(&pod.namespace)
                    .into_iter()
                    .flatten()
                    .filter(|q| self.policies[q].policy.pod_selector.matches(&pod.labels))
                    .copied()
                    .collect();
                let local = self.local.get_mut(&ep).expect("allocated above");
                let before = std::mem::replace(&mut local.policies, selecting.clone());
                let old_ips = std::mem::replace(&mut local.ips, pod.ips.clone());
                for q in before.difference(&selecting) {
                    if let Some(state) = self.policies.get_mut(q) {
                        state.selected.remove(&ep);
                    }
                    self.set_pair(ep, *q, PairEntries::new());
                }
                for q in &selecting {
                    if let Some(state) = self.policies.get_mut(q) {
                        state.selected.insert(ep);
                    }
                    let entries = self.compute_pair(ep, &pod, *q);
                    self.set_pair(ep, *q, entries);
                }
                for ip in old_ips {
                    if !pod.ips.contains(&ip) {
                        self.out_endpoints.set(IpAddrBe::from(ip), None);
                    }
                }
                self.dirty_flags.insert(ep);
            }
        }
    }

    /// Writes the endpoints' entries with their current flags.
    fn flush_flags(&mut self) {
        for ep in std::mem::take(&mut self.dirty_flags) {
            let Some(local) = self.local.get(&ep) else {
                continue;
            };
            let flags = local
                .policies
                .iter()
                .filter_map(|q| self.policies.get(q))
                .fold(0, |f, q| f | q.flags());
            for ip in &local.ips {
                self.out_endpoints
                    .set(IpAddrBe::from(*ip), Some(PolicyEndpoint { id: ep, flags }));
            }
        }
    }

    // ---- policies ----

    fn set_policy(&mut self, key: ObjectKey, policy: Option<Arc<NetworkPolicy>>) {
        let q = match self.policy_index.get(&key) {
            Some(q) => *q,
            None => {
                if policy.is_none() {
                    return;
                }
                let q = allocate(&mut self.free_policy, &mut self.next_policy, 0);
                self.policy_index.insert(key.clone(), q);
                self.policies_of_ns
                    .entry(key.0.clone())
                    .or_default()
                    .insert(q);
                q
            }
        };
        // What the old version selected and named.
        let (old_selected, old_blocks, old_rule_ids) = match self.policies.remove(&q) {
            Some(state) => (
                state.selected,
                state
                    .rules
                    .iter()
                    .flat_map(|r| r.blocks.iter().cloned())
                    .collect::<Vec<_>>(),
                state.rules.iter().map(|r| r.id).collect::<Vec<_>>(),
            ),
            None => Default::default(),
        };
        for block in &old_blocks {
            self.partition.remove(block);
        }
        let Some(policy) = policy else {
            for ep in &old_selected {
                self.set_pair(*ep, q, PairEntries::new());
                if let Some(local) = self.local.get_mut(ep) {
                    local.policies.remove(&q);
                }
                self.dirty_flags.insert(*ep);
            }
            for id in old_rule_ids {
                self.rule_refs.remove(&id);
                self.free_rule.insert(id);
            }
            self.policy_index.remove(&key);
            if let Some(set) = self.policies_of_ns.get_mut(&key.0) {
                set.remove(&q);
                if set.is_empty() {
                    self.policies_of_ns.remove(&key.0);
                }
            }
            self.free_policy.insert(q);
            self.rebuild_classes();
            return;
        };
        // Rule ids follow (direction, index): an edit keeps the ids of the rules
        // still there.
        let mut old_ids: BTreeMap<(u8, usize), u32> = old_rule_ids
            .iter()
            .filter_map(|id| {
                self.rule_refs
                    .get(id)
                    .map(|r| ((r.direction, r.index), *id))
            })
            .collect();
        let mut rules = Vec::new();
        let directions = [
            (POLICY_DIR_INGRESS, policy.ingress.as_deref()),
            (POLICY_DIR_EGRESS, policy.egress.as_deref()),
        ];
        for (direction, list) in directions {
            for (index, rule) in list.into_iter().flatten().enumerate() {
                let id = match old_ids.remove(&(direction, index)) {
                    Some(id) => id,
                    None => allocate(&mut self.free_rule, &mut self.next_rule, 1),
                };
                self.rule_refs.insert(
                    id,
                    RuleRef {
                        namespace: policy.namespace.clone(),
                        policy: policy.name.clone(),
                        direction,
                        index,
                    },
                );
                let blocks: Vec<Arc<Block>> = rule
                    .peers
                    .iter()
                    .filter_map(|p| match p {
                        Peer::Block(b) => Some(Arc::new(Block::new(b))),
                        Peer::Pods { .. } => None,
                    })
                    .collect();
                for block in &blocks {
                    self.partition.add(block);
                }
                let mut state = RuleState {
                    id,
                    direction,
                    rule: rule.clone(),
                    any: rule.peers.is_empty(),
                    named_egress: direction == POLICY_DIR_EGRESS && ports::has_named(&rule.ports),
                    identities: BTreeSet::new(),
                    blocks,
                    classes: BTreeSet::new(),
                };
                state.identities = self
                    .identities
                    .by_id
                    .iter()
                    .filter(|(_, (desc, _))| state.matches(&policy.namespace, desc))
                    .map(|(id, _)| *id)
                    .collect();
                rules.push(state);
            }
        }
        for (_, id) in old_ids {
            self.rule_refs.remove(&id);
            self.free_rule.insert(id);
        }
        let selected: BTreeSet<u32> = self
            .pods_of_ns
            .get(&policy.namespace)
            .into_iter()
            .flatten()
            .filter_map(|name| {
                let key = (policy.namespace.clone(), name.clone());
                let ep = *self.endpoint_of.get(&key)?;
                let (pod, _) = self.pods.get(&key)?;
                policy.pod_selector.matches(&pod.labels).then_some(ep)
            })
            .collect();
        self.policies.insert(
            q,
            PolicyState {
                policy,
                rules,
                selected: selected.clone(),
            },
        );
        for ep in old_selected.difference(&selected) {
            self.set_pair(*ep, q, PairEntries::new());
            if let Some(local) = self.local.get_mut(ep) {
                local.policies.remove(&q);
            }
            self.dirty_flags.insert(*ep);
        }
        // Classes first: the pairs below read them.
        let class_changed = self.partition.rebuild(&mut self.out_cidrs);
        if class_changed {
            self.refresh_rule_classes(Some(q));
        }
        if let Some(state) = self.policies.get_mut(&q) {
            for rule in state.rules.iter_mut() {
                rule.classes = self.partition.classes_of(&rule.blocks);
            }
        }
        for ep in &selected {
            if let Some(local) = self.local.get_mut(ep) {
                local.policies.insert(q);
            }
            if let Some(pod) = self.local_pod(*ep) {
                let entries = self.compute_pair(*ep, &pod, q);
                self.set_pair(*ep, q, entries);
            }
            self.dirty_flags.insert(*ep);
        }
    }

    /// The classes changed: every other policy whose rules' classes moved has its
    /// pairs recomputed (`skip` is recomputed by its caller).
    fn refresh_rule_classes(&mut self, skip: Option<u32>) {
        let mut dirty = Vec::new();
        for (q, state) in self.policies.iter_mut() {
            let mut changed = false;
            for rule in state.rules.iter_mut() {
                if rule.blocks.is_empty() {
                    continue;
                }
                let classes = self.partition.classes_of(&rule.blocks);
                if classes != rule.classes {
                    rule.classes = classes;
                    changed = true;
                }
            }
            if changed && Some(*q) != skip {
                dirty.extend(state.selected.iter().map(|ep| (*ep, *q)));
            }
        }
        for (ep, q) in dirty {
            if let Some(pod) = self.local_pod(ep) {
                let entries = self.compute_pair(ep, &pod, q);
                self.set_pair(ep, q, entries);
            }
        }
    }

    fn rebuild_classes(&mut self) {
        if self.partition.rebuild(&mut self.out_cidrs) {
            self.refresh_rule_classes(None);
        }
    }

    // ---- entries ----

    /// Every entry of endpoint `ep` (pod `pod`) that policy `q` gives.
    fn compute_pair(&self, ep: u32, pod: &PolicyPod, q: u32) -> PairEntries {
        let mut out = PairEntries::new();
        let Some(state) = self.policies.get(&q) else {
            return out;
        };
        let mut add = |peer: u32, rule: u32, keys: Vec<Lpm<PolicyKey>>| {
            if !keys.is_empty() {
                out.insert((peer, rule), keys);
            }
        };
        for rule in &state.rules {
            if rule.any {
                add(
                    POLICY_PEER_ANY,
                    rule.id,
                    keys_for(ep, pod, rule, PeerOf::Any),
                );
            }
            for id in &rule.identities {
                if let Some((desc, _)) = self.identities.by_id.get(id) {
                    add(
                        *id,
                        rule.id,
                        keys_for(ep, pod, rule, PeerOf::Identity(*id, desc)),
                    );
                }
            }
            for class in &rule.classes {
                add(
                    *class,
                    rule.id,
                    keys_for(ep, pod, rule, PeerOf::Class(*class)),
                );
            }
        }
        out
    }

    /// Replaces the pair's entries, adding and removing contributions.
    fn set_pair(&mut self, ep: u32, q: u32, entries: PairEntries) {
        let old = if entries.is_empty() {
            self.pairs.remove(&(ep, q)).unwrap_or_default()
        } else {
            self.pairs
                .insert((ep, q), entries.clone())
                .unwrap_or_default()
        };
        for (group, keys) in &old {
            if entries.get(group) != Some(keys) {
                for k in keys {
                    self.remove_contribution(*k, group.1);
                }
            }
        }
        for (group, keys) in &entries {
            if old.get(group) != Some(keys) {
                for k in keys {
                    self.add_contribution(*k, group.1);
                }
            }
        }
    }

    /// Replaces one (peer, rule) group of a pair.
    fn replace_group(&mut self, ep: u32, q: u32, group: (u32, u32), keys: Vec<Lpm<PolicyKey>>) {
        let pair = self.pairs.entry((ep, q)).or_default();
        let old = if keys.is_empty() {
            pair.remove(&group).unwrap_or_default()
        } else {
            pair.insert(group, keys.clone()).unwrap_or_default()
        };
        if pair.is_empty() {
            self.pairs.remove(&(ep, q));
        }
        for k in old {
            self.remove_contribution(k, group.1);
        }
        for k in keys {
            self.add_contribution(k, group.1);
        }
    }

    fn add_contribution(&mut self, key: Lpm<PolicyKey>, rule: u32) {
        let rules = self.contributors.entry(key).or_default();
        rules.push(rule);
        let first = first_rule(&self.rule_refs, rules);
        self.out_policy.set(
            key,
            Some(PolicyAllow {
                rule: first,
                _pad: 0,
            }),
        );
    }

    fn remove_contribution(&mut self, key: Lpm<PolicyKey>, rule: u32) {
        let Some(rules) = self.contributors.get_mut(&key) else {
            return;
        };
        if let Some(i) = rules.iter().position(|r| *r == rule) {
            rules.swap_remove(i);
        }
        if rules.is_empty() {
            self.contributors.remove(&key);
            self.out_policy.set(key, None);
        } else {
            let first = first_rule(&self.rule_refs, rules);
            self.out_policy.set(
                key,
                Some(PolicyAllow {
                    rule: first,
                    _pad: 0,
                }),
            );
        }
    }
}

/// The `LB_POLICY` keys rule `rule` gives endpoint `ep` (pod `pod`) for one peer.
fn keys_for(ep: u32, pod: &PolicyPod, rule: &RuleState, peer: PeerOf) -> Vec<Lpm<PolicyKey>> {
    let ingress = rule.direction == POLICY_DIR_INGRESS;
    let (peer_id, named, named_only) = match peer {
        PeerOf::Any => (
            POLICY_PEER_ANY,
            if ingress {
                NamedOn::Pod(&pod.named_ports)
            } else {
                NamedOn::Nothing
            },
            false,
        ),
        PeerOf::Identity(id, desc) => (
            id,
            if ingress {
                NamedOn::Pod(&pod.named_ports)
            } else {
                NamedOn::Peer(&desc.named_ports)
            },
            // A rule for every peer has its numeric ports under POLICY_PEER_ANY.
            rule.any,
        ),
        PeerOf::Class(class) => (
            class,
            if ingress {
                NamedOn::Pod(&pod.named_ports)
            } else {
                NamedOn::Nothing
            },
            false,
        ),
    };
    let mut entries = Vec::new();
    ports::entries(&rule.rule.ports, named, named_only, &mut entries);
    let mut keys: Vec<Lpm<PolicyKey>> = entries
        .into_iter()
        .map(|e: PortEntry| Lpm {
            prefix_len: e.prefix_len,
            data: PolicyKey {
                endpoint: ep,
                peer: peer_id,
                direction: rule.direction,
                proto: e.proto,
                port_be: e.port.to_be_bytes(),
            },
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}
