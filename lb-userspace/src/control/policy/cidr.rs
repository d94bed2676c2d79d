//! The CIDR classes: every `ipBlock` of every policy (its cidr and excepts) cuts the
//! address space, and a class is the set of blocks an address lies in.
//!
//! Prefixes are nested or disjoint, so for every prefix `p` of the blocks, the
//! addresses whose longest matching prefix is `p` all lie in the same blocks: those
//! whose cidr holds `p` and none of whose excepts does. One `LB_POLICY_CIDRS` entry per
//! distinct prefix, valued with that set's class id, is then exact under longest-prefix
//! match; an address under no prefix has no class.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use lb_common::policy::{PolicyCidrKey, POLICY_CIDR_CLASS};

use super::tracked::Tracked;
use super::Lpm;
use crate::model::policy::{IpBlock, Prefix};

/// The IPv4-mapped range, `::ffff:0:0/96`.
const V4_MAPPED: Prefix = Prefix {
    bits: 0xffff << 32,
    len: 96,
};

/// An `ipBlock` over the 128-bit address space the maps use.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Block {
    pub cidr: Prefix,
    /// Sorted. An IPv6 block that spans the IPv4-mapped range has it as an except: in
    /// the API an IPv6 block holds no IPv4 address.
    pub except: Vec<Prefix>,
}

impl Block {
    pub fn new(block: &IpBlock) -> Self {
        let cidr = Prefix::from_net(&block.cidr);
        let mut except: Vec<Prefix> = block.except.iter().map(Prefix::from_net).collect();
        if block.cidr.addr().is_ipv6() && (cidr.contains(&V4_MAPPED) || V4_MAPPED.contains(&cidr)) {
            except.push(V4_MAPPED);
        }
        except.sort();
        except.dedup();
        Block { cidr, except }
    }

    fn holds(&self, p: &Prefix) -> bool {
        self.cidr.contains(p) && !self.except.iter().any(|e| e.contains(p))
    }
}

/// The blocks in use and the classes they make.
#[derive(Default)]
pub(super) struct Partition {
    /// Every distinct block, with the number of policy peers naming it.
    blocks: BTreeMap<Arc<Block>, usize>,
    /// Set when `blocks` gained or lost a distinct block since the last `rebuild`.
    stale: bool,
    /// Class id (with `POLICY_CIDR_CLASS`) of each set of blocks in use.
    ids: HashMap<Vec<Arc<Block>>, u32>,
    sets: BTreeMap<u32, Vec<Arc<Block>>>,
    /// The classes each block is in.
    classes_of_block: HashMap<Arc<Block>, BTreeSet<u32>>,
    next_id: u32,
    free_ids: BTreeSet<u32>,
}

impl Partition {
    pub fn add(&mut self, block: &Arc<Block>) {
        let count = self.blocks.entry(block.clone()).or_insert(0);
        *count += 1;
        self.stale |= *count == 1;
    }

    pub fn remove(&mut self, block: &Arc<Block>) {
        if let Some(count) = self.blocks.get_mut(block) {
            *count -= 1;
            if *count == 0 {
                self.blocks.remove(block);
                self.stale = true;
            }
        }
    }

    /// The class set of `id`, for tests and `lb policy`.
    pub fn blocks_of_class(&self, id: u32) -> Option<&[Arc<Block>]> {
        self.sets.get(&id).map(Vec::as_slice)
    }

    /// The classes whose addresses lie in one of `blocks`.
    pub fn classes_of(&self, blocks: &[Arc<Block>]) -> BTreeSet<u32> {
        blocks
            .iter()
            .filter_map(|b| self.classes_of_block.get(b))
            .flatten()
            .copied()
            .collect()
    }

    /// Recomputes the classes if the blocks changed, writing `LB_POLICY_CIDRS`' new
    /// content into `out`; false when nothing changed.
    pub fn rebuild(&mut self, out: &mut Tracked<Lpm<PolicyCidrKey>, u32>) -> bool {
        if !std::mem::take(&mut self.stale) {
            return false;
        }
        let mut by_cidr: HashMap<Prefix, Vec<&Arc<Block>>> = HashMap::new();
        let mut prefixes = BTreeSet::new();
        for block in self.blocks.keys() {
            by_cidr.entry(block.cidr).or_default().push(block);
            prefixes.insert(block.cidr);
            prefixes.extend(block.except.iter().copied());
        }
        let mut wanted: BTreeMap<Prefix, Vec<Arc<Block>>> = BTreeMap::new();
        for p in &prefixes {
            let mut set: Vec<Arc<Block>> = (0..=p.len)
                .filter_map(|len| by_cidr.get(&Prefix::new(p.bits, len)))
                .flatten()
                .filter(|b| b.holds(p))
                .map(|b| Arc::clone(b))
                .collect();
            set.sort();
            wanted.insert(*p, set);
        }
        // Class ids of sets still in use are kept, so their allows stay as they are.
        let in_use: BTreeSet<&Vec<Arc<Block>>> = wanted.values().collect();
        let gone: Vec<u32> = self
            .sets
            .iter()
            .filter(|(_, set)| !in_use.contains(set))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some(set) = self.sets.remove(&id) {
                self.ids.remove(&set);
            }
            self.free_ids.insert(id);
        }
        let mut entries: HashMap<Lpm<PolicyCidrKey>, u32> = HashMap::new();
        for (p, set) in wanted {
            let id = match self.ids.get(&set) {
                Some(id) => *id,
                None => {
                    let id = match self.free_ids.pop_first() {
                        Some(id) => id,
                        None => {
                            self.next_id += 1;
                            POLICY_CIDR_CLASS | self.next_id
                        }
                    };
                    self.ids.insert(set.clone(), id);
                    self.sets.insert(id, set);
                    id
                }
            };
            entries.insert(lpm_of(&p), id);
        }
        self.classes_of_block.clear();
        for (id, set) in &self.sets {
            for b in set {
                self.classes_of_block
                    .entry(b.clone())
                    .or_default()
                    .insert(*id);
            }
        }
        let old: Vec<Lpm<PolicyCidrKey>> = out
            .current()
            .keys()
            .filter(|k| !entries.contains_key(k))
            .copied()
            .collect();
        for k in old {
            out.set(k, None);
        }
        for (k, v) in entries {
            out.set(k, Some(v));
        }
        true
    }
}

/// The `LB_POLICY_CIDRS` key of a prefix.
fn lpm_of(p: &Prefix) -> Lpm<PolicyCidrKey> {
    Lpm {
        prefix_len: u32::from(p.len),
        data: PolicyCidrKey {
            address: lb_common::IpAddrBe::from(std::net::IpAddr::V6(p.bits.into())),
        },
    }
}
