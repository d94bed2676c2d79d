//! NetworkPolicy in the agent (`--network-policy on`): the source's
//! NetworkPolicies, Pods and Namespaces go to the compiler by key, only those that
//! changed; the map operations it answers are written in its order (allows before
//! the endpoints that enforce them, removals last), so a pod is never enforced
//! before its allows are in.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::control::policy::{MapOps, PolicyChange, PolicyCompiler};
use crate::datapath::maps::MapsError;
use crate::datapath::pins::PinLayout;
use crate::datapath::policy::{PolicyKeys, PolicyMaps};
use crate::model::policy::{NetworkPolicy, PolicyNamespace, PolicyPod, Text};
use crate::ops::AgentStatus;
use crate::source::changes::PolicyObjects;

/// The objects as last given to the compiler, by key.
#[derive(Default)]
struct Known {
    policies: HashMap<(Text, Text), Arc<NetworkPolicy>>,
    pods: HashMap<(Text, Text), Arc<PolicyPod>>,
    namespaces: HashMap<Text, Arc<PolicyNamespace>>,
}

pub(super) struct Policy {
    /// Shared with the ops listener, which asks it about a pod for `lb policy
    /// POD` (rarely: the lock is the agent's alone otherwise).
    compiler: Arc<Mutex<PolicyCompiler>>,
    maps: PolicyMaps,
    known: Known,
    /// A write failed: the maps may lack what the compiler holds; the next
    /// change rewrites everything it knows.
    dirty: bool,
}

/// The changes that turn `known` into `now`, by key; `known` becomes `now`.
fn diff<K: Hash + Eq + Clone, T: PartialEq>(
    known: &mut HashMap<K, Arc<T>>,
    now: impl IntoIterator<Item = (K, Arc<T>)>,
    upsert: impl Fn(Arc<T>) -> PolicyChange,
    delete: impl Fn(K) -> PolicyChange,
    out: &mut Vec<PolicyChange>,
) {
    let mut next: HashMap<K, Arc<T>> = HashMap::new();
    for (key, object) in now {
        let same = known
            .get(&key)
            .is_some_and(|old| Arc::ptr_eq(old, &object) || **old == *object);
        if !same {
            out.push(upsert(object.clone()));
        }
        next.insert(key, object);
    }
    for key in known.keys() {
        if !next.contains_key(key) {
            out.push(delete(key.clone()));
        }
    }
    *known = next;
}

impl Policy {
    pub(super) fn open(layout: &PinLayout, node_name: &str) -> Result<Self, MapsError> {
        Ok(Policy {
            compiler: Arc::new(Mutex::new(PolicyCompiler::new(node_name))),
            maps: PolicyMaps::open(layout)?,
            known: Known::default(),
            dirty: false,
        })
    }

    /// The source's objects as they stand now: what changed is compiled and
    /// written. Namespaces first, then pods, then policies, so a policy never
    /// meets a namespace it selects by labels before the namespace's labels.
    pub(super) fn sync(&mut self, objects: &PolicyObjects) {
        let started = Instant::now();
        let mut changes = Vec::new();
        diff(
            &mut self.known.namespaces,
            objects
                .namespaces
                .iter()
                .map(|n| (n.name.clone(), n.clone())),
            PolicyChange::UpsertNamespace,
            |name| PolicyChange::DeleteNamespace { name },
            &mut changes,
        );
        diff(
            &mut self.known.pods,
            objects
                .pods
                .iter()
                .map(|p| ((p.namespace.clone(), p.name.clone()), p.clone())),
            PolicyChange::UpsertPod,
            |(namespace, name)| PolicyChange::DeletePod { namespace, name },
            &mut changes,
        );
        diff(
            &mut self.known.policies,
            objects
                .policies
                .iter()
                .map(|p| ((p.namespace.clone(), p.name.clone()), p.clone())),
            PolicyChange::UpsertPolicy,
            |(namespace, name)| PolicyChange::DeletePolicy { namespace, name },
            &mut changes,
        );
        if changes.is_empty() && !self.dirty {
            return;
        }
        let count = changes.len();
        let ops = self.compiler.lock().apply_all(changes);
        let written = self.write(&ops);
        debug!(
            changes = count,
            entries = written,
            elapsed_us = started.elapsed().as_micros() as u64,
            "network policy applied"
        );
    }

    /// Lets `status` answer `/policy/NS/NAME` from the compiler, and fill each
    /// scrape's per-pod drops (`lb_policy_drops_total`) from the drop counters
    /// (read through a handle of their own, `maps`).
    pub(super) fn serve_queries(&self, status: &AgentStatus, maps: PolicyMaps) {
        let compiler = self.compiler.clone();
        status
            .on_policy_query(move |namespace, name| compiler.lock().pod_policies(namespace, name));
        let compiler = self.compiler.clone();
        status.on_scrape(move |status| {
            // The names under the lock, the counters after it.
            let pods = compiler.lock().local_pods();
            let mut rows = Vec::with_capacity(pods.len());
            for (id, pod) in pods {
                match maps.drops(id) {
                    Ok(drops) => {
                        let d = drops.unwrap_or_default();
                        rows.push((pod, d.ingress_drops, d.egress_drops));
                    }
                    Err(e) => {
                        debug!("reading the policy drop counters: {e}");
                        return;
                    }
                }
            }
            status.set_policy_drops(&rows);
        });
    }

    /// This node's addresses: ingress from them is always admitted.
    pub(super) fn set_node_addresses(&mut self, addrs: impl IntoIterator<Item = IpAddr>) {
        let ops = self.compiler.lock().set_node_addresses(addrs);
        self.write(&ops);
    }

    /// Writes `ops` (or, after a failed write, everything the compiler holds);
    /// how many entries were written or removed.
    fn write(&mut self, ops: &MapOps) -> usize {
        let result = if self.dirty {
            self.rewrite()
        } else {
            self.apply(ops)
        };
        match result {
            Ok(n) => {
                self.dirty = false;
                n
            }
            Err(e) => {
                warn!(
                    "writing the network policy maps failed (rewritten with the next change): {e}"
                );
                self.dirty = true;
                0
            }
        }
    }

    /// The compiler's order: inserts and updates of identities, CIDR classes and
    /// allows; then endpoints; then removals of allows, classes and identities.
    fn apply(&mut self, ops: &MapOps) -> Result<usize, MapsError> {
        let m = &mut self.maps;
        for (addr, id) in ops.identities.inserts.iter().chain(&ops.identities.updates) {
            m.put_identity(*addr, *id)?;
        }
        for (k, class) in ops.cidrs.inserts.iter().chain(&ops.cidrs.updates) {
            m.put_cidr(k.prefix_len, k.data, *class)?;
        }
        for (k, allow) in ops.policy.inserts.iter().chain(&ops.policy.updates) {
            m.put_allow(k.prefix_len, k.data, *allow)?;
        }
        for (addr, endpoint) in ops.endpoints.inserts.iter().chain(&ops.endpoints.updates) {
            m.put_endpoint(*addr, *endpoint)?;
        }
        for addr in &ops.endpoints.deletes {
            m.delete_endpoint(*addr)?;
        }
        for k in &ops.policy.deletes {
            m.delete_allow(k.prefix_len, k.data)?;
        }
        for k in &ops.cidrs.deletes {
            m.delete_cidr(k.prefix_len, k.data)?;
        }
        for addr in &ops.identities.deletes {
            m.delete_identity(*addr)?;
        }
        Ok(ops.len())
    }

    /// Everything the compiler holds, written over what the maps hold, then every
    /// entry it does not hold removed (a failed write may have left some behind).
    fn rewrite(&mut self) -> Result<usize, MapsError> {
        let all = self.compiler.lock().maps();
        let keep = PolicyKeys {
            endpoints: all.endpoints.keys().copied().collect(),
            identities: all.identities.keys().copied().collect(),
            cidrs: all.cidrs.keys().map(|k| (k.prefix_len, k.data)).collect(),
            allows: all.policy.keys().map(|k| (k.prefix_len, k.data)).collect(),
        };
        let m = &mut self.maps;
        for (addr, id) in &all.identities {
            m.put_identity(*addr, *id)?;
        }
        for (k, class) in &all.cidrs {
            m.put_cidr(k.prefix_len, k.data, *class)?;
        }
        for (k, allow) in &all.policy {
            m.put_allow(k.prefix_len, k.data, *allow)?;
        }
        for (addr, endpoint) in &all.endpoints {
            m.put_endpoint(*addr, *endpoint)?;
        }
        let removed = m.remove_others(&keep)?;
        Ok(all.identities.len()
            + all.cidrs.len()
            + all.policy.len()
            + all.endpoints.len()
            + removed)
    }
}
