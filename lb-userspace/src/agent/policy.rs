//! NetworkPolicy in the agent (`--network-policy on`): the source's keyed
//! changes of NetworkPolicies, Pods and Namespaces go to the compiler as they are,
//! so a change costs its own objects, not every object the source holds; the map
//! operations it answers are written in its order (allows before the endpoints
//! that enforce them, removals last), so a pod is never enforced before its allows
//! are in.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::control::policy::{MapOps, PolicyChange, PolicyCompiler};
use crate::datapath::maps::MapsError;
use crate::datapath::pins::PinLayout;
use crate::datapath::policy::{PolicyKeys, PolicyMaps};
use crate::ops::AgentStatus;
use crate::source::changes::{Change, Changes, ObjectKey};

pub(super) struct Policy {
    /// Shared with the ops listener, which asks it about a pod for `lb policy
    /// POD` (rarely: the lock is the agent's alone otherwise).
    compiler: Arc<Mutex<PolicyCompiler>>,
    maps: PolicyMaps,
    /// A write failed: the maps may lack what the compiler holds; the next
    /// change of what policy reads rewrites everything it knows.
    dirty: bool,
}

/// One kind's keyed changes as the compiler's: an upsert of what is there now,
/// or, when it is gone, a delete named by what was there (the compiler's own key
/// of it, whatever key the source filed it under). Upserts before deletes, as the
/// compiler was given them when the agent compared whole lists.
fn compile_changes<T>(
    changes: &foldhash::HashMap<ObjectKey, Change<T>>,
    upsert: impl Fn(Arc<T>) -> PolicyChange,
    delete: impl Fn(&T) -> PolicyChange,
    out: &mut Vec<PolicyChange>,
) {
    out.extend(
        changes
            .values()
            .filter_map(|c| c.current.clone())
            .map(upsert),
    );
    out.extend(
        changes
            .values()
            .filter(|c| c.current.is_none())
            .filter_map(|c| c.previous.as_deref())
            .map(delete),
    );
}

impl Policy {
    pub(super) fn open(layout: &PinLayout, node_name: &str) -> Result<Self, MapsError> {
        Ok(Policy {
            compiler: Arc::new(Mutex::new(PolicyCompiler::new(node_name))),
            maps: PolicyMaps::open(layout)?,
            dirty: false,
        })
    }

    /// The source's changes of what policy reads: compiled and written.
    /// Namespaces first, then pods, then policies, so a policy never meets a
    /// namespace it selects by labels before the namespace's labels.
    pub(super) fn sync(&mut self, source: &Changes) {
        // Only a change of these is the occasion to write (and, after a failed
        // write, to rewrite): other changes leave the maps as they are.
        if source.namespaces.is_empty() && source.pods.is_empty() && source.policies.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut changes = Vec::new();
        compile_changes(
            &source.namespaces,
            PolicyChange::UpsertNamespace,
            |n| PolicyChange::DeleteNamespace {
                name: n.name.clone(),
            },
            &mut changes,
        );
        compile_changes(
            &source.pods,
            PolicyChange::UpsertPod,
            |p| PolicyChange::DeletePod {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
            },
            &mut changes,
        );
        compile_changes(
            &source.policies,
            PolicyChange::UpsertPolicy,
            |p| PolicyChange::DeletePolicy {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
            },
            &mut changes,
        );
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
