//! NetworkPolicy compiled into the policy maps (issue 27; the maps and the verdict
//! rule are `lb_common::policy`'s). Pure: objects in, map contents and map operations
//! out.
//!
//! - [`PolicyCompiler`] holds the objects and the maps' desired content for one node,
//!   and turns one change (a policy, pod or namespace upserted or deleted, or the
//!   node's addresses) into the map operations it causes, touching only the entries
//!   the change affects ([`compile`]).
//! - Identities: a pod's identity is its (namespace, namespace labels, pod labels,
//!   named container ports), interned; pods that share one share their allows.
//!   Putting the named ports in the identity makes an egress rule's named port
//!   resolve exactly per destination pod, even when pods with the same labels give
//!   the name different numbers (they get different identities).
//! - CIDR classes: every `ipBlock` (cidr and excepts) of every policy partitions the
//!   address space; a class is the set of blocks an address lies in ([`cidr`]).
//! - [`evaluate`] judges a packet straight from the objects, with no maps: the
//!   reference the compiled maps are tested against.
//!
//! Semantics that are choices, not the API's letter (the evaluator makes the same):
//! - ingress from this node's own addresses is always allowed (kubelet probes);
//! - an egress named port toward an `ipBlock` peer resolves to nothing (an address
//!   range has no container ports; Cilium does the same), while toward a pod peer
//!   (`podSelector`/`namespaceSelector`, or a rule without `to`) it resolves on the
//!   destination pod;
//! - an IPv6 `ipBlock` never holds an IPv4 address (`::/0` included), although the
//!   maps store IPv4 IPv4-mapped;
//! - an address two pods claim belongs to the first by (namespace, name); host-network
//!   pods have no identity (their addresses are the node's);
//! - named ports come from `spec.containers[].ports` (not init containers).

mod cidr;
mod compile;
mod eval;
pub mod ports;
mod tracked;
pub mod view;

use std::collections::BTreeMap;

use lb_common::policy::{
    PolicyAllow, PolicyCidrKey, PolicyEndpoint, PolicyKey, PolicyLookup, POLICY_CIDR_PREFIX_FULL,
    POLICY_PREFIX_FULL,
};
use lb_common::IpAddrBe;

pub use compile::{PolicyChange, PolicyCompiler, RuleRef};
pub use eval::{evaluate, evaluate_direction, PolicyObjects};

/// An LPM trie key: its prefix length, then its data (aya's `lpm_trie::Key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lpm<K> {
    pub prefix_len: u32,
    pub data: K,
}

/// The desired content of the four maps the agent writes for policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyMaps {
    /// `LB_POLICY_ENDPOINTS`: every address of every local pod (not host-network).
    pub endpoints: BTreeMap<IpAddrBe, PolicyEndpoint>,
    /// `LB_POLICY_IDENTITY`: every pod address of the cluster, and the node's own
    /// addresses (`POLICY_ID_HOST`).
    pub identities: BTreeMap<IpAddrBe, u32>,
    /// `LB_POLICY_CIDRS`.
    pub cidrs: BTreeMap<Lpm<PolicyCidrKey>, u32>,
    /// `LB_POLICY`.
    pub policy: BTreeMap<Lpm<PolicyKey>, PolicyAllow>,
}

/// The first `len` bits of `bytes`, the rest cleared.
fn mask_bytes(bytes: &mut [u8], len: u32) {
    for (i, b) in bytes.iter_mut().enumerate() {
        let start = i as u32 * 8;
        if start >= len {
            *b = 0;
        } else if start + 8 > len {
            *b &= 0xffu8 << (8 - (len - start));
        }
    }
}

/// `data` with only its first `len` bits kept, as the trie compares it.
pub fn masked<K: bytemuck::Pod>(data: &K, len: u32) -> K {
    let mut copy = *data;
    mask_bytes(bytemuck::bytes_of_mut(&mut copy), len);
    copy
}

/// The longest-prefix match of `data` in `map`, as the kernel's LPM trie finds it:
/// the entry of the longest prefix length whose first bits equal the key's. Only the
/// prefix lengths present are tried, longest first.
fn longest_match<K: bytemuck::Pod + Ord, V: Copy>(
    map: &BTreeMap<Lpm<K>, V>,
    data: &K,
    max_len: u32,
) -> Option<V> {
    let mut below = max_len + 1;
    loop {
        let floor = Lpm {
            prefix_len: below,
            data: K::zeroed(),
        };
        let (longest, _) = map.range(..floor).next_back()?;
        let len = longest.prefix_len;
        let key = Lpm {
            prefix_len: len,
            data: masked(data, len),
        };
        if let Some(v) = map.get(&key) {
            return Some(*v);
        }
        if len == 0 {
            return None;
        }
        below = len;
    }
}

/// The maps as the kernel reads them (hash lookups exact, LPM longest match), so
/// that `lb_common::policy::verdict` can run over them in tests and in `lb policy`.
impl PolicyLookup for PolicyMaps {
    fn endpoint(&self, addr: &IpAddrBe) -> Option<PolicyEndpoint> {
        self.endpoints.get(addr).copied()
    }
    fn identity(&self, addr: &IpAddrBe) -> Option<u32> {
        self.identities.get(addr).copied()
    }
    fn cidr_class(&self, addr: &IpAddrBe) -> Option<u32> {
        let key = PolicyCidrKey { address: *addr };
        longest_match(&self.cidrs, &key, POLICY_CIDR_PREFIX_FULL)
    }
    fn allow(&self, key: &PolicyKey) -> Option<PolicyAllow> {
        longest_match(&self.policy, key, POLICY_PREFIX_FULL)
    }
}

/// What one change does to one map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapDiff<K, V> {
    /// Keys not in the map before.
    pub inserts: Vec<(K, V)>,
    /// Keys whose value changes.
    pub updates: Vec<(K, V)>,
    /// Keys to remove.
    pub deletes: Vec<K>,
}

impl<K, V> Default for MapDiff<K, V> {
    fn default() -> Self {
        MapDiff {
            inserts: Vec::new(),
            updates: Vec::new(),
            deletes: Vec::new(),
        }
    }
}

impl<K: Ord + Copy, V: Copy> MapDiff<K, V> {
    pub fn is_empty(&self) -> bool {
        self.inserts.is_empty() && self.updates.is_empty() && self.deletes.is_empty()
    }

    pub fn len(&self) -> usize {
        self.inserts.len() + self.updates.len() + self.deletes.len()
    }

    /// Applies the diff to a copy of the map.
    pub fn apply_to(&self, map: &mut BTreeMap<K, V>) {
        for (k, v) in self.inserts.iter().chain(&self.updates) {
            map.insert(*k, *v);
        }
        for k in &self.deletes {
            map.remove(k);
        }
    }
}

/// What one change does to the policy maps. Written in this order, a packet never
/// meets a pod enforced before its allows are in: first every insert and update of
/// `identities`, `cidrs` and `policy`; then `endpoints` (all three kinds); then the
/// deletes of `policy`, `cidrs` and `identities`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapOps {
    pub endpoints: MapDiff<IpAddrBe, PolicyEndpoint>,
    pub identities: MapDiff<IpAddrBe, u32>,
    pub cidrs: MapDiff<Lpm<PolicyCidrKey>, u32>,
    pub policy: MapDiff<Lpm<PolicyKey>, PolicyAllow>,
}

impl MapOps {
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
            && self.identities.is_empty()
            && self.cidrs.is_empty()
            && self.policy.is_empty()
    }

    /// Entries written or removed.
    pub fn len(&self) -> usize {
        self.endpoints.len() + self.identities.len() + self.cidrs.len() + self.policy.len()
    }

    pub fn apply_to(&self, maps: &mut PolicyMaps) {
        self.endpoints.apply_to(&mut maps.endpoints);
        self.identities.apply_to(&mut maps.identities);
        self.cidrs.apply_to(&mut maps.cidrs);
        self.policy.apply_to(&mut maps.policy);
    }
}

#[cfg(test)]
mod tests;
