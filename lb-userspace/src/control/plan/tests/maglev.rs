//! The planner's Maglev tables: one per distinct backend set, shared by frontends
//! and ports; counted by the masters that name them; freed extents reused only by
//! a later plan; a full arena falls back to random, reported; a full plan over the
//! kernel's table keeps the extents it finds (and rewrites them in place when the
//! seed changed). Checked against a model of the `LB_MAGLEV` array that the ops
//! are applied to one by one.

use std::collections::BTreeMap;
use std::net::IpAddr;

use lb_common::maglev::extent_slots;

use super::*;
use crate::control::maglev::{build, identities, table_size};

const SEED: u64 = 0x005e_ed0f_4d61_676c;

fn cap(slots: u32) -> Capacity {
    Capacity {
        maglev_slots: slots,
        maglev_seed: SEED,
        ..ROOMY
    }
}

/// A NodePort-like frontend `node:port`.
fn np(node: u8, port: u16) -> Frontend {
    Frontend::internal(Ipv4Addr::new(192, 0, 2, node).into(), port, Protocol::Tcp)
}

/// A Maglev frontend's spec: backends `10.0.0.b` on `port`.
fn maglev_spec(backends: &[u8], port: u16) -> FrontendSpec {
    FrontendSpec {
        backends: std::sync::Arc::new(backends.iter().map(|&b| be(b, port)).collect()),
        maglev: true,
        cluster_ip: false,
        ..spec(&[], None)
    }
}

fn desired(frontends: &[(Frontend, FrontendSpec)]) -> DesiredState {
    DesiredState {
        frontends: frontends.iter().cloned().collect(),
        ..DesiredState::default()
    }
}

/// The kernel's `LB_MAGLEV`, slot by slot (the header's seed apart).
#[derive(Clone, Default)]
struct Arena {
    slots: BTreeMap<u32, u16>,
}

impl Arena {
    fn write(&mut self, first: u32, positions: &[u16]) {
        for (i, &p) in positions.iter().enumerate() {
            self.slots.insert(first + i as u32, p);
        }
    }

    fn table(&self, first: u32, size: u32) -> Vec<u16> {
        (first..first + size)
            .map(|s| *self.slots.get(&s).expect("a slot never written"))
            .collect()
    }
}

/// The tables the masters of `s` name: first slot -> (size, masters naming it).
fn named(s: &MapSnapshot) -> BTreeMap<u32, (u32, u32)> {
    let mut out: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
    for (_, group) in s.services.groups() {
        if let Some((first, size)) = group.master.and_then(|m| m.maglev()) {
            let entry = out.entry(first).or_insert((size, 0));
            assert_eq!(entry.0, size, "one table named with two sizes");
            entry.1 += 1;
        }
    }
    out
}

/// Applies `ops` one by one to the maps and the arena model, checking after each
/// that no write lands in a table a master names (at that moment, or when the
/// plan began: a packet may still be reading a table its master has just
/// stopped naming) unless it is a rewrite of the same table, and that every
/// master's table then answers only positions of its own slots.
fn apply_checked(s: &mut MapSnapshot, arena: &mut Arena, ops: &[MapOp]) {
    let at_start = named(s);
    for (i, op) in ops.iter().enumerate() {
        if let MapOp::PutMaglev {
            first_slot,
            positions,
        } = op
        {
            let end = first_slot + positions.len() as u32;
            for (first, (size, _)) in at_start.iter().chain(named(s).iter()) {
                let overlaps = *first_slot < first + extent_slots(*size) && *first < end;
                if overlaps {
                    assert_eq!(
                        (*first_slot, positions.len() as u32),
                        (*first, *size),
                        "op {i} writes into the table at {first} while a master names it"
                    );
                    // Rewritten whole with the same set: only with another seed.
                    assert_eq!(&arena.table(*first, *size)[..], &positions[..]);
                }
            }
            assert_eq!(first_slot % 4, 0, "tables start at an entry");
            assert!(*first_slot >= 4, "entry 0 is the header");
            arena.write(*first_slot, positions);
        }
        s.apply(std::slice::from_ref(op));
        // Only a master or a table changes what a master's table answers.
        let master_or_table = match op {
            MapOp::PutService { key, .. } => key.backend_slot == 0,
            MapOp::PutMaglev { .. } => true,
            _ => false,
        };
        if !master_or_table {
            continue;
        }
        for (key, group) in s.services.groups() {
            let Some(master) = group.master else { continue };
            if let Some((first, size)) = master.maglev() {
                let table = arena.table(first, size);
                assert!(
                    table.iter().all(|&p| p < master.count),
                    "after op {i}: {key:?}'s table names a position past its {} slots",
                    master.count
                );
            }
        }
    }
}

/// Every Maglev master names the table Maglev builds for its slots' backends, and
/// the tables the planner keeps are exactly the ones named, each counted once per
/// master, with one table per distinct set.
fn assert_tables(s: &MapSnapshot, arena: &Arena, tables: &MaglevTables, seed: u64) {
    let mut sets: BTreeMap<Vec<crate::control::maglev::Identity>, u32> = BTreeMap::new();
    for (key, group) in s.services.groups() {
        let Some(master) = group.master else { continue };
        let Some((first, size)) = master.maglev() else {
            continue;
        };
        let backends: Vec<(IpAddr, u16)> = (1..=master.count)
            .map(|slot| {
                let value = s.services[&ServiceKey {
                    backend_slot: slot,
                    ..*key
                }];
                let b = crate::datapath::codec::backend_addr(
                    s.backends.get(&value.backend_id).unwrap(),
                );
                (b.ip, b.port)
            })
            .collect();
        let ids = identities(backends).unwrap();
        assert_eq!(size, table_size(ids.len()).unwrap());
        assert_eq!(
            arena.table(first, size),
            build(&ids, size, seed).unwrap(),
            "{key:?}'s table"
        );
        if let Some(other) = sets.insert(ids, first) {
            assert_eq!(other, first, "one backend set, two tables");
        }
    }
    let named = named(s);
    assert_eq!(tables.len(), named.len(), "tables kept but not named");
    for (first, (_, refs)) in named {
        assert_eq!(
            tables.refs(first),
            refs,
            "references of the table at {first}"
        );
    }
}

/// One change planned against the kept table and applied.
fn change(
    known: &mut KnownTable,
    arena: &mut Arena,
    to: &DesiredState,
    changed: &[Frontend],
    capacity: Capacity,
) -> Plan {
    let changed: BTreeSet<Frontend> = changed.iter().copied().collect();
    let plan = plan_changes(to, &changed, known, capacity);
    let mut s = known.snapshot().clone();
    apply_checked(&mut s, arena, &plan.ops);
    known.apply(&plan.ops);
    assert_eq!(known.snapshot(), &s);
    plan
}

fn tables_written(ops: &[MapOp]) -> Vec<u32> {
    ops.iter()
        .filter_map(|op| match op {
            MapOp::PutMaglev { first_slot, .. } => Some(*first_slot),
            _ => None,
        })
        .collect()
}

fn maglev_of(s: &MapSnapshot, f: Frontend) -> Option<(u32, u32)> {
    s.services.get(&service_key(&f, 0))?.maglev()
}

/// Two Services' NodePorts on two node addresses, and a second port of the first
/// Service with other target ports on the same pods: one backend set, one table,
/// written once, named by all five masters. Another set gets its own.
#[test]
fn frontends_and_ports_with_one_backend_set_share_one_table() {
    let web = maglev_spec(&[1, 2, 3], 8080);
    let web_admin = maglev_spec(&[3, 2, 1], 9090);
    let other = maglev_spec(&[4, 5], 8080);
    let d = desired(&[
        (np(1, 30080), web.clone()),
        (np(2, 30080), web.clone()),
        (np(1, 30081), web_admin.clone()),
        (np(2, 30081), web_admin),
        (np(1, 30090), web),
        (np(1, 30100), other),
    ]);
    let mut known = KnownTable::new(MapSnapshot::default(), cap(1 << 16));
    let mut arena = Arena::default();
    let all: Vec<Frontend> = d.frontends.keys().copied().collect();
    let plan = change(&mut known, &mut arena, &d, &all, cap(1 << 16));
    assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
    assert_eq!(tables_written(&plan.ops).len(), 2, "one table per set");
    let shared = maglev_of(known.snapshot(), np(1, 30080)).unwrap();
    assert_eq!(shared.1, 509, "3 backends: 509 slots");
    for f in [np(2, 30080), np(1, 30081), np(2, 30081), np(1, 30090)] {
        assert_eq!(maglev_of(known.snapshot(), f), Some(shared), "{f}");
    }
    let own = maglev_of(known.snapshot(), np(1, 30100)).unwrap();
    assert_ne!(own.0, shared.0);
    assert_eq!(known.maglev().refs(shared.0), 5);
    assert_eq!(known.maglev().refs(own.0), 1);
    assert_tables(known.snapshot(), &arena, known.maglev(), SEED);
    // The header names the seed once a table is written.
    assert_eq!(known.snapshot().maglev_seed, SEED);
    assert!(matches!(
        plan.ops.last(),
        Some(MapOp::PutMaglevSeed { seed: SEED })
    ));
    // A full plan against what was written has nothing to do.
    assert!(plan_full(&d, known.snapshot(), cap(1 << 16)).is_empty());
}

fn plan_full(desired: &DesiredState, current: &MapSnapshot, capacity: Capacity) -> Plan {
    super::super::plan(desired, current, capacity)
}

/// A table lives while a master names it; the last one leaving frees it, and its
/// extent goes to a new table only in a later plan, never in the plan that freed
/// it.
#[test]
fn a_freed_table_is_reused_only_by_a_later_plan() {
    let (a, b, c) = (np(1, 30080), np(2, 30080), np(1, 30081));
    let capacity = cap(4 + 512);
    let mut known = KnownTable::new(MapSnapshot::default(), capacity);
    let mut arena = Arena::default();
    let three = maglev_spec(&[1, 2, 3], 8080);
    let d = desired(&[(a, three.clone()), (b, three.clone())]);
    change(&mut known, &mut arena, &d, &[a, b], capacity);
    let (first, _) = maglev_of(known.snapshot(), a).unwrap();
    assert_eq!(known.maglev().refs(first), 2);

    // One sharer goes: the table stays.
    let d = desired(&[(a, three)]);
    let plan = change(&mut known, &mut arena, &d, &[b], capacity);
    assert!(tables_written(&plan.ops).is_empty());
    assert_eq!(known.maglev().refs(first), 1);

    // The last one moves to another set in the same plan as a new frontend asks
    // for one: the arena holds one table, and the old one is not free yet.
    let d = desired(&[
        (a, maglev_spec(&[4, 5, 6], 8080)),
        (c, maglev_spec(&[7, 8, 9], 8080)),
    ]);
    let plan = change(&mut known, &mut arena, &d, &[a, c], capacity);
    assert_eq!(plan.rejected.len(), 2, "{:?}", plan.rejected);
    assert!(plan
        .rejected
        .iter()
        .all(|e| matches!(e, ReconcileError::MaglevFull { .. })));
    assert!(tables_written(&plan.ops).is_empty());
    // Both fall back to random: programmed, no table.
    assert_eq!(maglev_of(known.snapshot(), a), None);
    assert_eq!(maglev_of(known.snapshot(), c), None);
    assert_eq!(known.snapshot().services[&service_key(&a, 0)].count, 3);
    assert!(
        known.maglev().is_empty(),
        "the old table is freed once written"
    );
    assert_tables(known.snapshot(), &arena, known.maglev(), SEED);

    // The next plan may use the room.
    let plan = change(&mut known, &mut arena, &d, &[a], capacity);
    assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
    assert_eq!(tables_written(&plan.ops), [first]);
    assert_eq!(maglev_of(known.snapshot(), a).unwrap().0, first);
    assert_tables(known.snapshot(), &arena, known.maglev(), SEED);
}

/// A full arena: the frontend is programmed with random picks, and the error names
/// the Service, the map and the flag; the others keep their tables.
#[test]
fn a_full_arena_falls_back_to_random_and_says_which_flag() {
    let (a, b) = (np(1, 30080), np(1, 30081));
    // Room for one 252-slot table (1 or 2 backends), not for a 512-slot one.
    let capacity = cap(4 + 500);
    let d = desired(&[
        (a, maglev_spec(&[1, 2], 8080)),
        (b, maglev_spec(&[1, 2, 3], 8080)),
    ]);
    let plan = plan_full(&d, &MapSnapshot::default(), capacity);
    assert_eq!(plan.rejected.len(), 1);
    let message = plan.rejected[0].to_string();
    for part in [
        "default/web:http",
        "192.0.2.1:30081/TCP",
        "LB_MAGLEV",
        "512 slots",
        "--maglev-table-slots",
        "at random",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    let mut s = MapSnapshot::default();
    let mut arena = Arena::default();
    apply_checked(&mut s, &mut arena, &plan.ops);
    assert!(maglev_of(&s, a).is_some());
    assert_eq!(maglev_of(&s, b), None);
    assert_eq!(s.services[&service_key(&b, 0)].count, 3, "still programmed");
    let tables = MaglevTables::from_snapshot(&s, capacity.maglev_slots, SEED);
    assert_tables(&s, &arena, &tables, SEED);
}

/// The agent restarted (or repairs): the tables are rebuilt from the masters and
/// their slots, every extent kept where it is, counted, and nothing rewritten; a
/// new set's table goes to free room.
#[test]
fn a_full_plan_after_a_restart_keeps_the_tables_where_they_are() {
    let capacity = cap(1 << 14);
    let d = desired(&[
        (np(1, 30080), maglev_spec(&[1, 2, 3], 8080)),
        (np(2, 30080), maglev_spec(&[1, 2, 3], 8080)),
        (np(1, 30081), maglev_spec(&[4], 8080)),
        (np(1, 30082), maglev_spec(&[5, 6, 7, 8, 9, 10], 8080)),
    ]);
    let mut s = MapSnapshot::default();
    let mut arena = Arena::default();
    let first = plan_full(&d, &s, capacity);
    apply_checked(&mut s, &mut arena, &first.ops);
    let before = named(&s);

    // A new agent with the same seed: nothing to write.
    assert!(plan_full(&d, &s, capacity).is_empty());
    let known = KnownTable::new(s.clone(), capacity);
    assert_tables(&s, &arena, known.maglev(), SEED);
    assert_eq!(known.maglev().stale(), 0);

    // A new set goes to room no table holds.
    let mut more = d.clone();
    more.frontends
        .insert(np(1, 30083), maglev_spec(&[11, 12], 8080));
    let plan = plan_full(&more, &s, capacity);
    let written = tables_written(&plan.ops);
    assert_eq!(written.len(), 1);
    for (first, (size, _)) in &before {
        assert!(
            written[0] >= first + extent_slots(*size) || written[0] + 252 <= *first,
            "the new table overlaps the one at {first}"
        );
    }
    let mut known = KnownTable::new(s.clone(), capacity);
    apply_checked(&mut s, &mut arena, &plan.ops);
    // What the agent does after a full plan: the table as read, then the ops.
    known.apply(&plan.ops);
    assert_eq!(known.snapshot(), &s);
    assert_tables(&s, &arena, known.maglev(), SEED);
}

/// The agent restarted with another `--maglev-seed`: the tables found were built
/// with the old one, and each is rewritten in place (same extent, same set: its
/// positions stay valid while it is rewritten); the header names the new seed only
/// once none is left.
#[test]
fn a_new_seed_rewrites_every_table_in_place() {
    let old = cap(1 << 14);
    let d = desired(&[
        (np(1, 30080), maglev_spec(&[1, 2, 3], 8080)),
        (np(2, 30080), maglev_spec(&[1, 2, 3], 8080)),
        (np(1, 30081), maglev_spec(&[4, 5], 8080)),
    ]);
    let mut s = MapSnapshot::default();
    let mut arena = Arena::default();
    let first = plan_full(&d, &s, old);
    apply_checked(&mut s, &mut arena, &first.ops);
    assert_eq!(s.maglev_seed, SEED);
    let before = named(&s);

    let new = Capacity {
        maglev_seed: SEED ^ 1,
        ..old
    };
    let plan = plan_full(&d, &s, new);
    let written = tables_written(&plan.ops);
    assert_eq!(
        written,
        before.keys().copied().collect::<Vec<_>>(),
        "each table rewritten where it is"
    );
    assert!(
        !plan
            .ops
            .iter()
            .any(|op| matches!(op, MapOp::PutService { .. })),
        "no master changes: {:?}",
        plan.ops
    );
    assert!(
        !plan
            .ops
            .iter()
            .any(|op| matches!(op, MapOp::PutMaglevSeed { .. })),
        "no header while tables of the old seed were found"
    );
    // Written without the overlap check (a rewrite in place is the point).
    for op in &plan.ops {
        if let MapOp::PutMaglev {
            first_slot,
            positions,
        } = op
        {
            arena.write(*first_slot, positions);
        }
    }
    let mut known = KnownTable::new(s.clone(), new);
    assert_eq!(known.maglev().stale(), 2);
    known.apply(&plan.ops);
    assert_eq!(known.maglev().stale(), 0);
    assert_tables(known.snapshot(), &arena, known.maglev(), SEED ^ 1);
    // The next plan brings the header up to date, and then there is nothing.
    let plan = plan_changes(&d, &BTreeSet::new(), &mut known, new);
    assert_eq!(plan.ops, [MapOp::PutMaglevSeed { seed: SEED ^ 1 }]);
    known.apply(&plan.ops);
    assert!(plan_full(&d, known.snapshot(), new).is_empty());
}

/// Maglev switched off (the annotation removed): the master goes random and the
/// table is freed; backends that cannot be told apart in a table (one address
/// and port twice, on this node and another) are reported and picked at random.
#[test]
fn switching_maglev_off_frees_the_table_and_unusable_sets_go_random() {
    let a = np(1, 30080);
    let capacity = cap(1 << 12);
    let mut known = KnownTable::new(MapSnapshot::default(), capacity);
    let mut arena = Arena::default();
    change(
        &mut known,
        &mut arena,
        &desired(&[(a, maglev_spec(&[1, 2], 8080))]),
        &[a],
        capacity,
    );
    assert_eq!(known.maglev().len(), 1);
    let random = FrontendSpec {
        maglev: false,
        cluster_ip: false,
        ..maglev_spec(&[1, 2], 8080)
    };
    change(
        &mut known,
        &mut arena,
        &desired(&[(a, random)]),
        &[a],
        capacity,
    );
    assert_eq!(maglev_of(known.snapshot(), a), None);
    assert!(known.maglev().is_empty());

    let mut twice = maglev_spec(&[1], 8080);
    let mut backends = (*twice.backends).clone();
    backends.insert(BackendAddr {
        local: true,
        ..be(1, 8080)
    });
    twice.backends = std::sync::Arc::new(backends);
    let plan = change(
        &mut known,
        &mut arena,
        &desired(&[(a, twice)]),
        &[a],
        capacity,
    );
    assert_eq!(plan.rejected.len(), 1, "{:?}", plan.rejected);
    assert!(matches!(
        plan.rejected[0],
        ReconcileError::MaglevUnusable { .. }
    ));
    assert_eq!(known.snapshot().services[&service_key(&a, 0)].count, 2);
    assert_eq!(maglev_of(known.snapshot(), a), None);
}

/// Random changes of Maglev and random frontends over a small arena, planned per
/// change (and now and then whole, as a restart or repair does): after every op no
/// master names a table with a position past its slots, and no table a master
/// named since the plan began is written over; after every change each Maglev
/// master names the table of its backends, one per set, counted right.
/// Fallbacks for want of room are the only rejections, and they leave the
/// frontend random.
#[test]
fn random_changes_keep_every_table_right() {
    let mut rng = Rng(0x6d61_676c_6576_0001);
    // Room for about six small tables: a tight arena exercises reuse.
    let capacity = cap(4 + 6 * 512);
    let mut known = KnownTable::new(MapSnapshot::default(), capacity);
    let mut arena = Arena::default();
    let mut current = DesiredState::default();
    let (mut fallbacks, mut reused, mut shared) = (0, 0, 0);
    let mut ever_written: BTreeSet<u32> = BTreeSet::new();
    let frontends: Vec<Frontend> = (1..=3u8)
        .flat_map(|node| [30080u16, 30081, 30082, 30083].map(|port| np(node, port)))
        .collect();
    for step in 0..400 {
        let mut next = current.clone();
        for f in &frontends {
            if rng.below(4) != 0 {
                continue;
            }
            if rng.below(5) == 0 {
                next.frontends.remove(f);
                continue;
            }
            // Few distinct sets, so they are shared often.
            let backends: Vec<u8> = (1..=6).filter(|_| rng.below(2) == 0).collect();
            let port = [8080, 9090][rng.below(2) as usize];
            let mut spec = maglev_spec(&backends, port);
            spec.maglev = rng.below(5) != 0;
            next.frontends.insert(*f, spec);
        }
        let changed = changed_between(&current, &next);
        let plan = if step % 41 == 40 {
            let full = plan_full(&next, known.snapshot(), capacity);
            let mut s = known.snapshot().clone();
            apply_checked(&mut s, &mut arena, &full.ops);
            known = KnownTable::new(known.snapshot().clone(), capacity);
            known.apply(&full.ops);
            assert_eq!(known.snapshot(), &s);
            full
        } else {
            let changed: Vec<Frontend> = changed.iter().copied().collect();
            change(&mut known, &mut arena, &next, &changed, capacity)
        };
        for e in &plan.rejected {
            assert!(
                matches!(e, ReconcileError::MaglevFull { .. }),
                "step {step}: {e}"
            );
            fallbacks += 1;
        }
        for first in tables_written(&plan.ops) {
            reused += u32::from(!ever_written.insert(first));
        }
        shared += named(known.snapshot())
            .values()
            .filter(|(_, refs)| *refs > 1)
            .count();
        assert_programs(known.snapshot(), &next);
        assert_tables(known.snapshot(), &arena, known.maglev(), SEED);
        let stuck: BTreeSet<Frontend> = plan
            .rejected
            .iter()
            .filter_map(|e| match e {
                ReconcileError::MaglevFull { frontend, .. } => Some(*frontend),
                _ => None,
            })
            .collect();
        for (f, spec) in &next.frontends {
            let has = maglev_of(known.snapshot(), *f).is_some();
            let wants = spec.maglev && !spec.backends.is_empty();
            if stuck.contains(f) {
                assert!(!has, "step {step}: {f} has a table though none had room");
            } else if changed.contains(f) {
                assert_eq!(has, wants, "step {step}: {f}");
            }
        }
        current = next;
    }
    // The run tested what it is about: full arenas, extents used again, sharing.
    assert!(
        fallbacks > 0 && reused > 0 && shared > 0,
        "fallbacks {fallbacks}, extents reused {reused}, shared tables {shared}"
    );
}
