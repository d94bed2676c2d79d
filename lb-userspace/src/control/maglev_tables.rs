//! The Maglev tables in the kernel's `LB_MAGLEV` arena, as the planner sees them:
//! which backend identity set has a table, where it lies, how many masters name it,
//! and which slots are free. Pure: the planner asks it for a set's table (one per
//! distinct set, shared by every frontend and every port with that set), and
//! [`MaglevTables::record`] follows the masters a written plan changed.
//!
//! - A table is a contiguous extent of the arena: its size rounded up to whole
//!   4-slot entries ([`lb_common::maglev::extent_slots`]), starting at a multiple of
//!   four, never in entry 0 (the seed header).
//! - Extents come from a best-fit allocator over the free runs of the arena, which
//!   merges neighbouring runs as they are freed: a table of any size can use the
//!   room any other left, where one free list per size would strand the room of
//!   sizes no longer asked for (and reuse an exact fit just the same).
//! - A table is freed when the last master naming it is rewritten or deleted, once
//!   the plan that did so was written ([`MaglevTables::record`]): its extent is
//!   reused from the next plan on, never within the plan that released it, so a
//!   packet that read the old master a moment before never finds its table
//!   rewritten under it by the same plan's writes.
//! - Rebuilt from the kernel's table ([`MaglevTables::from_snapshot`], a start or a
//!   repair): each master's extent is taken as it is and its identity set derived
//!   from the master's slots. The array's content is trusted, not read back
//!   (100k tables are 200 MB): it was written by an agent from those same slots.
//!   What the agent cannot vouch for is a table built with another seed
//!   (`--maglev-seed` changed): the arena's header says which seed its tables have,
//!   and when it is not this agent's every table found is marked stale and
//!   rewritten in place by the plan that next uses it (same set, same size, so its
//!   positions stay valid for its masters while it is rewritten).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use lb_common::maglev::extent_slots;
use lb_common::MAGLEV_FIRST_TABLE_SLOT;
use rustc_hash::FxHashMap as HashMap;

use super::maglev::{identities, Identity, TABLE_SIZES};
use crate::datapath::codec::backend_addr;
use crate::datapath::snapshot::MapSnapshot;

/// A backend identity set, shared by the table's entry and the index by set.
pub type IdentitySet = Arc<[Identity]>;

/// A master written or deleted by a plan: its key, and its table (first slot and
/// size) before and after.
pub type MasterChange = (
    lb_common::ServiceKey,
    Option<(u32, u32)>,
    Option<(u32, u32)>,
);

/// One table in the arena.
#[derive(Clone, Debug)]
struct Table {
    /// Index of its size in [`TABLE_SIZES`].
    rung: usize,
    /// Masters naming it, as written.
    refs: u32,
    /// The identities it was built from; `None` for a table whose masters' slots
    /// did not give a valid set (a damaged table): it is kept while named, never
    /// shared.
    set: Option<IdentitySet>,
    /// Built with another seed than this agent's: rewritten before it is used.
    stale: bool,
}

impl Table {
    fn slots(&self) -> u32 {
        extent_slots(TABLE_SIZES[self.rung])
    }
}

/// The Maglev tables of one arena, and its free room.
#[derive(Clone, Debug)]
pub struct MaglevTables {
    /// `--maglev-seed`: what tables are built with.
    seed: u64,
    /// Tables by first slot.
    tables: HashMap<u32, Table>,
    /// The first slot of each shareable set's table.
    by_set: HashMap<IdentitySet, u32>,
    /// Tables marked stale (counted, to know when the header may say this seed).
    stale: usize,
    /// Tables placed since the last [`MaglevTables::record`], which then checks
    /// that a master names them.
    placed: Vec<u32>,
    arena: Arena,
}

/// What the planner gets for a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// First arena slot of the table.
    pub first: u32,
    /// Index of the table's size in [`TABLE_SIZES`].
    pub rung: usize,
    /// The table must be written (new, or stale) before a master names it.
    pub write: bool,
}

impl MaglevTables {
    /// An empty arena of `slots` slots (the map's entries times four).
    pub fn new(slots: u32, seed: u64) -> Self {
        MaglevTables {
            seed,
            tables: HashMap::default(),
            by_set: HashMap::default(),
            stale: 0,
            placed: Vec::new(),
            arena: Arena::new(slots),
        }
    }

    /// The tables the masters of `snapshot` name, their sets from the masters'
    /// slots; stale when the arena's header names another seed than `seed`.
    pub fn from_snapshot(snapshot: &MapSnapshot, slots: u32, seed: u64) -> Self {
        let mut tables = MaglevTables::new(slots, seed);
        let stale = snapshot.maglev_seed != seed;
        for (key, group) in snapshot.services.groups() {
            let Some(master) = group.master else { continue };
            let Some((first, size)) = master.maglev() else {
                continue;
            };
            let Some(rung) = TABLE_SIZES.iter().position(|&s| s == size) else {
                continue;
            };
            let set = set_of_slots(snapshot, key, master.count);
            if tables.adopt(first, rung, set) && stale {
                tables.mark_stale(first);
            }
        }
        tables
    }

    /// Takes note of a table found in the maps, named by one more master; false
    /// when its extent cannot be (out of the arena, misaligned, overlapping another
    /// table of another size).
    fn adopt(&mut self, first: u32, rung: usize, set: Option<IdentitySet>) -> bool {
        if let Some(table) = self.tables.get_mut(&first) {
            if table.rung != rung {
                return false;
            }
            table.refs += 1;
            return true;
        }
        let len = extent_slots(TABLE_SIZES[rung]);
        if !first.is_multiple_of(lb_common::MAGLEV_SLOTS_PER_ENTRY)
            || first < MAGLEV_FIRST_TABLE_SLOT
            || !self.arena.take(first, len)
        {
            return false;
        }
        let set = set.filter(|s| !self.by_set.contains_key(s));
        if let Some(set) = &set {
            self.by_set.insert(set.clone(), first);
        }
        self.tables.insert(
            first,
            Table {
                rung,
                refs: 1,
                set,
                stale: false,
            },
        );
        true
    }

    fn mark_stale(&mut self, first: u32) {
        if let Some(table) = self.tables.get_mut(&first) {
            if !table.stale {
                table.stale = true;
                self.stale += 1;
            }
        }
    }

    /// The table of `set` (`rung` is its size's index): the one the arena has, a
    /// new extent for it, or `None` when the arena has no room left. A table handed
    /// out with `write` must be written (in full: [`super::maglev::build`]) before
    /// the master that names it; it is then not stale any more.
    pub fn place(&mut self, set: &[Identity], rung: usize) -> Option<Placed> {
        if let Some(&first) = self.by_set.get(set) {
            let table = self.tables.get_mut(&first).expect("indexed tables exist");
            let write = table.stale;
            if write {
                table.stale = false;
                self.stale -= 1;
            }
            return Some(Placed {
                first,
                rung: table.rung,
                write,
            });
        }
        let first = self.arena.alloc(extent_slots(TABLE_SIZES[rung]))?;
        let set: IdentitySet = set.into();
        self.by_set.insert(set.clone(), first);
        self.placed.push(first);
        // No master names it yet: `record` counts the ones the plan writes.
        self.tables.insert(
            first,
            Table {
                rung,
                refs: 0,
                set: Some(set),
                stale: false,
            },
        );
        Some(Placed {
            first,
            rung,
            write: true,
        })
    }

    /// Whether the table at `first` is stale (the planner keeps a rejected
    /// frontend's master as it is, table and all).
    pub fn is_stale(&self, first: u32) -> bool {
        self.tables.get(&first).is_some_and(|t| t.stale)
    }

    /// Tables built with another seed, not rewritten yet.
    pub fn stale(&self) -> usize {
        self.stale
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Follows a written plan: `changes` are its masters' tables before and after
    /// (`(old, new)` first slot and size of each master written or deleted),
    /// `rewritten` the first slots of the tables it wrote, `after` the maps once it
    /// was applied. A table no master names any more is freed, its extent reusable
    /// by the next plan.
    pub fn record(&mut self, changes: &[MasterChange], rewritten: &[u32], after: &MapSnapshot) {
        for &first in rewritten {
            if let Some(table) = self.tables.get_mut(&first) {
                if table.stale {
                    table.stale = false;
                    self.stale -= 1;
                }
            }
        }
        let mut released = BTreeSet::new();
        for (key, old, new) in changes {
            if old == new {
                continue;
            }
            if let Some((first, size)) = *new {
                let known = self.tables.get_mut(&first);
                match known {
                    Some(table) if TABLE_SIZES[table.rung] == size => table.refs += 1,
                    Some(_) => {}
                    // Placed by a plan that did not ask these tables (a full plan
                    // into maps read from the kernel).
                    None => {
                        if let Some(rung) = TABLE_SIZES.iter().position(|&s| s == size) {
                            let count = after.services.get(key).map_or(0, |m| m.count);
                            let set = set_of_slots(after, key, count);
                            self.adopt(first, rung, set);
                        }
                    }
                }
            }
            if let Some((first, size)) = *old {
                if let Some(table) = self.tables.get_mut(&first) {
                    if TABLE_SIZES[table.rung] == size {
                        table.refs = table.refs.saturating_sub(1);
                        released.insert(first);
                    }
                }
            }
        }
        for first in released {
            if self.tables.get(&first).is_some_and(|t| t.refs == 0) {
                self.free(first);
            }
        }
        // A table placed for a master that was then not written (the planner
        // places one only for a master it writes, so none; but an unnamed table
        // must not hold its room for ever).
        for first in std::mem::take(&mut self.placed) {
            if self.tables.get(&first).is_some_and(|t| t.refs == 0) {
                self.free(first);
            }
        }
    }

    fn free(&mut self, first: u32) {
        let Some(table) = self.tables.remove(&first) else {
            return;
        };
        if let Some(set) = &table.set {
            if self.by_set.get(set) == Some(&first) {
                self.by_set.remove(set);
            }
        }
        if table.stale {
            self.stale -= 1;
        }
        self.arena.release(first, table.slots());
    }

    /// Tables in the arena.
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Masters naming the table at `first` (0: no such table).
    pub fn refs(&self, first: u32) -> u32 {
        self.tables.get(&first).map_or(0, |t| t.refs)
    }

    /// Slots of the arena no table holds.
    pub fn free_slots(&self) -> u64 {
        self.arena.free_slots
    }

    /// Slots of the arena (the header's included).
    pub fn capacity(&self) -> u32 {
        self.arena.slots
    }
}

/// The identity set of the frontend whose master is `key`, from its slots
/// `1..=count` and the backends they name; `None` when a slot or backend is
/// missing or the backends are not in table order.
fn set_of_slots(
    snapshot: &MapSnapshot,
    key: &lb_common::ServiceKey,
    count: u16,
) -> Option<IdentitySet> {
    let group = snapshot.services.group(key)?;
    let mut backends = Vec::with_capacity(usize::from(count));
    for slot in 1..=count {
        let at = group.slots.binary_search_by_key(&slot, |(s, _)| *s).ok()?;
        let backend = snapshot.backends.get(&group.slots[at].1.backend_id)?;
        let addr = backend_addr(backend);
        backends.push((addr.ip, addr.port));
    }
    if backends.is_empty() {
        return None;
    }
    identities(backends).ok().map(Into::into)
}

/// The free runs of the arena: best fit, neighbours merged as they are freed.
#[derive(Clone, Debug)]
struct Arena {
    slots: u32,
    /// Free runs by first slot -> length.
    free: BTreeMap<u32, u32>,
    /// The same runs by (length, first slot), for the best fit.
    by_len: BTreeSet<(u32, u32)>,
    free_slots: u64,
}

impl Arena {
    fn new(slots: u32) -> Self {
        let mut arena = Arena {
            slots,
            free: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_slots: 0,
        };
        // Whole entries only; entry 0 is the header.
        let usable = slots - slots % lb_common::MAGLEV_SLOTS_PER_ENTRY;
        if usable > MAGLEV_FIRST_TABLE_SLOT {
            arena.insert(MAGLEV_FIRST_TABLE_SLOT, usable - MAGLEV_FIRST_TABLE_SLOT);
        }
        arena
    }

    fn insert(&mut self, start: u32, len: u32) {
        self.free.insert(start, len);
        self.by_len.insert((len, start));
        self.free_slots += u64::from(len);
    }

    fn remove(&mut self, start: u32, len: u32) {
        self.free.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_slots -= u64::from(len);
    }

    /// The start of the smallest free run of at least `len` slots (the lowest of
    /// equal ones), its head taken.
    fn alloc(&mut self, len: u32) -> Option<u32> {
        let &(run, start) = self.by_len.range((len, 0)..).next()?;
        self.remove(start, run);
        if run > len {
            self.insert(start + len, run - len);
        }
        Some(start)
    }

    /// Takes `start..start + len` if it is free; false if any of it is not.
    fn take(&mut self, start: u32, len: u32) -> bool {
        let Some((&run_start, &run)) = self.free.range(..=start).next_back() else {
            return false;
        };
        let (end, run_end) = (
            u64::from(start) + u64::from(len),
            u64::from(run_start) + u64::from(run),
        );
        if end > run_end {
            return false;
        }
        self.remove(run_start, run);
        if start > run_start {
            self.insert(run_start, start - run_start);
        }
        if run_end > end {
            self.insert(start + len, (run_end - end) as u32);
        }
        true
    }

    /// Gives `start..start + len` back, merged with the free runs next to it.
    fn release(&mut self, mut start: u32, mut len: u32) {
        if let Some((&before, &before_len)) = self.free.range(..start).next_back() {
            if before + before_len == start {
                self.remove(before, before_len);
                start = before;
                len += before_len;
            }
        }
        if let Some(&after_len) = self.free.get(&(start + len)) {
            self.remove(start + len, after_len);
            len += after_len;
        }
        self.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arena_fits_best_and_merges_what_is_freed() {
        // 4 header slots + 1024.
        let mut arena = Arena::new(1028);
        assert_eq!(arena.free_slots, 1024);
        let a = arena.alloc(252).unwrap();
        let b = arena.alloc(512).unwrap();
        let c = arena.alloc(252).unwrap();
        assert_eq!((a, b, c), (4, 256, 768));
        assert_eq!(arena.alloc(252), None, "8 slots left");
        arena.release(a, 252);
        arena.release(c, 252);
        // Two runs of 252 and 260 (c merged with the tail): the best fit for 252
        // is the first, exactly.
        assert_eq!(arena.alloc(252), Some(4));
        arena.release(4, 252);
        arena.release(b, 512);
        assert_eq!(arena.free_slots, 1024);
        assert_eq!(arena.free.len(), 1, "all merged into one run");
        assert_eq!(arena.alloc(1024), Some(4));
    }

    #[test]
    fn the_arena_takes_only_free_runs() {
        let mut arena = Arena::new(4 + 2048);
        assert!(arena.take(1028, 1024));
        assert!(!arena.take(1028, 4), "taken");
        assert!(!arena.take(1000, 256), "overlaps the taken run");
        assert!(arena.take(4, 1024));
        assert_eq!(arena.free_slots, 0);
        assert!(!arena.take(0, 4), "the header is never free");
    }
}
