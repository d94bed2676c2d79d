use std::net::Ipv4Addr;

use super::*;
use crate::datapath::codec::{service_key, MAX_REV_NAT_ID};
use crate::datapath::table;
use crate::model::{BackendAddr, Protocol};

const ROOMY: Capacity = Capacity {
    services: 1 << 20,
    backends: 1 << 20,
    frontend_ids: MAX_REV_NAT_ID,
    maglev_slots: 1 << 20,
    maglev_seed: 0,
};

fn fe(last: u8, port: u16, protocol: Protocol) -> Frontend {
    Frontend::internal(Ipv4Addr::new(10, 96, 0, last).into(), port, protocol)
}

fn tcp(last: u8) -> Frontend {
    fe(last, 80, Protocol::Tcp)
}

fn be(last: u8, port: u16) -> BackendAddr {
    BackendAddr {
        ip: Ipv4Addr::new(10, 244, 0, last).into(),
        port,
        local: false,
    }
}

fn spec(backends: &[u8], affinity: Option<u32>) -> FrontendSpec {
    FrontendSpec {
        service: "default/web:http".into(),
        backends: std::sync::Arc::new(backends.iter().map(|&b| be(b, 8080)).collect()),
        affinity_timeout_sec: affinity,
        source_ranges: None,
        maglev: false,
        cluster_ip: false,
    }
}

fn state(frontends: &[(Frontend, &[u8], Option<u32>)]) -> DesiredState {
    DesiredState {
        frontends: frontends
            .iter()
            .map(|(f, b, a)| (*f, spec(b, *a)))
            .collect(),
        ..DesiredState::default()
    }
}

/// Every master counts only slots that are present and name present backends of
/// its protocol; the first violation in words.
fn half_written(s: &MapSnapshot) -> Option<String> {
    for (key, master) in s.services.iter().filter(|(k, _)| k.backend_slot == 0) {
        for slot in 1..=master.count {
            let slot_key = ServiceKey {
                backend_slot: slot,
                ..key
            };
            let Some(value) = s.services.get(&slot_key) else {
                return Some(format!(
                    "{key:?} counts {} but slot {slot} is missing",
                    master.count
                ));
            };
            let Some(backend) = s.backends.get(&value.backend_id) else {
                return Some(format!(
                    "slot {slot} of {key:?} names missing backend {}",
                    value.backend_id
                ));
            };
            if backend.proto != key.proto || value.rev_nat_id != master.rev_nat_id {
                return Some(format!("slot {slot} of {key:?} disagrees with its master"));
            }
        }
    }
    None
}

fn assert_never_half_written(s: &MapSnapshot, context: &str) {
    if let Some(problem) = half_written(s) {
        panic!("{context}: {problem}");
    }
}

/// The snapshot holds exactly `desired`: nothing missing, nothing left over.
fn assert_programs(s: &MapSnapshot, desired: &DesiredState) {
    let table = table::decode(s);
    let got: BTreeMap<Frontend, (BTreeSet<BackendAddr>, Option<u32>)> = table
        .iter()
        .map(|f| {
            assert!(f.problems.is_empty(), "{:?}", f.problems);
            let backends: Vec<BackendAddr> = f
                .backends
                .iter()
                .map(|b| BackendAddr {
                    ip: b.ip,
                    port: b.port,
                    local: b.local,
                })
                .collect();
            assert!(
                backends.windows(2).all(|w| w[0] < w[1]),
                "slots are not in sorted order"
            );
            (
                f.frontend,
                (backends.into_iter().collect(), f.affinity_timeout_sec),
            )
        })
        .collect();
    let want: BTreeMap<Frontend, (BTreeSet<BackendAddr>, Option<u32>)> = desired
        .frontends
        .iter()
        .map(|(f, spec)| (*f, ((*spec.backends).clone(), spec.affinity_timeout_sec)))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        s.services.len(),
        desired.frontends.len() + desired.backend_count()
    );
    assert_eq!(s.backends.len(), desired.backend_count(), "backends leaked");
    let revs: BTreeSet<u32> = table.iter().map(|f| f.rev_nat_id).collect();
    assert_eq!(revs.len(), table.len(), "frontend ids shared");
    assert!(!revs.contains(&0));
}

/// Plan `to` from `from`, check the invariant after every op and the result, and
/// return the new snapshot and the ops.
fn transition(from: &MapSnapshot, to: &DesiredState) -> (MapSnapshot, Vec<MapOp>) {
    let plan = plan(to, from, ROOMY);
    assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
    let mut s = from.clone();
    assert_never_half_written(&s, "before");
    for (i, op) in plan.ops.iter().enumerate() {
        s.apply(std::slice::from_ref(op));
        if let Some(problem) = half_written(&s) {
            panic!("after op {i} {op:?} of {:#?}: {problem}", plan.ops);
        }
    }
    assert_programs(&s, to);
    let again = super::plan(to, &s, ROOMY);
    assert!(again.is_empty(), "second plan not empty: {:?}", again.ops);
    (s, plan.ops)
}

fn program(desired: &DesiredState) -> MapSnapshot {
    transition(&MapSnapshot::default(), desired).0
}

fn backend_ids(s: &MapSnapshot, f: Frontend) -> BTreeMap<BackendAddr, u32> {
    table::decode(s)
        .into_iter()
        .find(|p| p.frontend == f)
        .unwrap()
        .backends
        .iter()
        .map(|b| {
            (
                BackendAddr {
                    ip: b.ip,
                    port: b.port,
                    local: b.local,
                },
                b.id,
            )
        })
        .collect()
}

fn rev_nat_id(s: &MapSnapshot, f: Frontend) -> u32 {
    s.services[&service_key(&f, 0)].rev_nat_id
}

#[test]
fn named_transitions_are_never_half_written() {
    let (a, b, u) = (tcp(1), tcp(2), fe(3, 53, Protocol::Udp));
    let cases: Vec<(&str, DesiredState, DesiredState)> = vec![
        ("create", state(&[]), state(&[(a, &[1, 2, 3], None)])),
        (
            "add backend in the middle",
            state(&[(a, &[1, 3], None)]),
            state(&[(a, &[1, 2, 3], None)]),
        ),
        (
            "remove backend in the middle",
            state(&[(a, &[1, 2, 3], None)]),
            state(&[(a, &[1, 3], None)]),
        ),
        (
            "replace all backends",
            state(&[(a, &[1, 2], None)]),
            state(&[(a, &[3, 4, 5], None)]),
        ),
        (
            "shrink to zero",
            state(&[(a, &[1, 2, 3], None)]),
            state(&[(a, &[], None)]),
        ),
        (
            "grow from zero",
            state(&[(a, &[], None)]),
            state(&[(a, &[1, 2, 3, 4], None)]),
        ),
        (
            "remove frontend",
            state(&[(a, &[1, 2], None), (b, &[1], None)]),
            state(&[(b, &[1], None)]),
        ),
        (
            "remove everything",
            state(&[(a, &[1, 2], None), (u, &[3], None)]),
            state(&[]),
        ),
        (
            "affinity on",
            state(&[(a, &[1], None)]),
            state(&[(a, &[1], Some(10_800))]),
        ),
        (
            "affinity timeout",
            state(&[(a, &[1], Some(10_800))]),
            state(&[(a, &[1, 2], Some(60))]),
        ),
        (
            "affinity off",
            state(&[(a, &[1], Some(60))]),
            state(&[(a, &[1], None)]),
        ),
        (
            "several frontends at once",
            state(&[(a, &[1, 2], None), (b, &[3], Some(5)), (u, &[], None)]),
            state(&[
                (a, &[2, 4], Some(5)),
                (u, &[1, 2, 3], None),
                (tcp(4), &[9], None),
            ]),
        ),
        (
            "same backends in two frontends",
            state(&[(a, &[1, 2], None)]),
            state(&[(a, &[1, 2], None), (b, &[1, 2], None)]),
        ),
    ];
    for (name, from, to) in cases {
        let start = program(&from);
        let (end, ops) = transition(&start, &to);
        // And back again.
        let (_, back) = transition(&end, &from);
        assert!(!ops.is_empty() && !back.is_empty(), "{name}");
    }
}

#[test]
fn external_scope_entry_is_flagged_on_the_internal_master() {
    let internal = tcp(9);
    let external = internal.with_scope(Scope::External);
    let mut d = state(&[(internal, &[1, 2], None), (external, &[1], None)]);
    let s = program(&d);
    assert_programs(&s, &d);
    let flags = |s: &MapSnapshot, f: Frontend| s.services[&service_key(&f, 0)].flags;
    assert_ne!(flags(&s, internal) & lb_common::SVC_FLAG_EXTERNAL_SCOPE, 0);
    assert_eq!(flags(&s, external) & lb_common::SVC_FLAG_EXTERNAL_SCOPE, 0);
    assert_eq!(service_key(&external, 0).scope, lb_common::SCOPE_EXTERNAL);

    // Dropping the external entry clears the flag before the entry goes, so no
    // reader follows the flag to a missing entry.
    d.frontends.remove(&external);
    let (after, ops) = transition(&s, &d);
    assert_eq!(
        flags(&after, internal) & lb_common::SVC_FLAG_EXTERNAL_SCOPE,
        0
    );
    let flag_cleared = ops
        .iter()
        .position(
            |op| matches!(op, MapOp::PutService { key, .. } if *key == service_key(&internal, 0)),
        )
        .unwrap();
    let external_gone = ops
        .iter()
        .position(
            |op| matches!(op, MapOp::DeleteService { key } if *key == service_key(&external, 0)),
        )
        .unwrap();
    assert!(flag_cleared < external_gone);
}

#[test]
fn unchanged_state_needs_no_ops() {
    let d = state(&[(tcp(1), &[1, 2], Some(60)), (tcp(2), &[], None)]);
    let s = program(&d);
    let p = plan(&d, &s, ROOMY);
    assert!(p.is_empty() && p.rejected.is_empty());
}

#[test]
fn op_order_for_one_frontend() {
    let a = tcp(1);
    let s = program(&state(&[(a, &[1, 2, 3], None)]));
    let ids = backend_ids(&s, a);
    let rev = rev_nat_id(&s, a);
    let p = plan(&state(&[(a, &[1, 4], None)]), &s, ROOMY);
    let new_id = ids.values().max().unwrap() + 1;
    assert_eq!(
        p.ops,
        [
            MapOp::PutBackend {
                id: new_id,
                backend: backend_value(&be(4, 8080), Protocol::Tcp),
            },
            MapOp::PutService {
                key: service_key(&a, 2),
                value: slot_value(new_id, rev),
            },
            MapOp::PutService {
                key: service_key(&a, 0),
                value: master_value(&spec(&[1, 4], None), 2, rev, false, None),
            },
            MapOp::DeleteService {
                key: service_key(&a, 3),
            },
            MapOp::DeleteBackend {
                id: ids[&be(2, 8080)],
            },
            MapOp::DeleteBackend {
                id: ids[&be(3, 8080)],
            },
        ]
    );
}

#[test]
fn removals_come_after_every_upsert_master_first() {
    let (a, b, c) = (tcp(1), tcp(2), tcp(3));
    let s = program(&state(&[(a, &[1], None), (b, &[2, 3], None)]));
    let p = plan(&state(&[(c, &[4], None)]), &s, ROOMY);
    let first_delete = p
        .ops
        .iter()
        .position(|op| {
            matches!(
                op,
                MapOp::DeleteService { .. } | MapOp::DeleteBackend { .. }
            )
        })
        .unwrap();
    assert!(p.ops[..first_delete].len() == 3, "{:?}", p.ops);
    assert_eq!(
        p.ops[first_delete],
        MapOp::DeleteService {
            key: service_key(&a, 0)
        }
    );
    assert_eq!(
        p.ops[first_delete + 1],
        MapOp::DeleteService {
            key: service_key(&a, 1)
        }
    );
    assert!(matches!(
        p.ops[first_delete + 2],
        MapOp::DeleteBackend { .. }
    ));
    assert_eq!(
        p.ops[first_delete + 3],
        MapOp::DeleteService {
            key: service_key(&b, 0)
        }
    );
}

#[test]
fn ids_are_stable_and_not_reused_at_once() {
    let (a, b) = (tcp(1), tcp(2));
    let s = program(&state(&[(a, &[1, 2, 3], None), (b, &[1], None)]));
    let before = backend_ids(&s, a);
    let (rev_a, rev_b) = (rev_nat_id(&s, a), rev_nat_id(&s, b));
    // Backend ids belong to one frontend.
    assert_ne!(before[&be(1, 8080)], backend_ids(&s, b)[&be(1, 8080)]);

    let (s, _) = transition(&s, &state(&[(a, &[0, 2, 3, 9], Some(30)), (b, &[1], None)]));
    let after = backend_ids(&s, a);
    assert_eq!(after[&be(2, 8080)], before[&be(2, 8080)]);
    assert_eq!(after[&be(3, 8080)], before[&be(3, 8080)]);
    assert_eq!((rev_nat_id(&s, a), rev_nat_id(&s, b)), (rev_a, rev_b));
    assert!(after[&be(0, 8080)] > before.values().copied().max().unwrap());
    assert!(after[&be(9, 8080)] > after[&be(0, 8080)]);

    // The id of the backend just removed is not handed out again.
    let removed = before[&be(1, 8080)];
    let (s, _) = transition(
        &s,
        &state(&[(a, &[0, 2, 3, 9, 7], Some(30)), (b, &[1], None)]),
    );
    assert_ne!(backend_ids(&s, a)[&be(7, 8080)], removed);
}

#[test]
fn backend_ids_wrap_past_the_top_and_skip_used_ones() {
    let a = tcp(1);
    let mut s = MapSnapshot::default();
    s.services.insert(
        service_key(&a, 0),
        master_value(&spec(&[1, 2], None), 2, 7, false, None),
    );
    s.services
        .insert(service_key(&a, 1), slot_value(u32::MAX, 7));
    s.services.insert(service_key(&a, 2), slot_value(1, 7));
    s.backends
        .insert(u32::MAX, backend_value(&be(1, 8080), Protocol::Tcp));
    s.backends
        .insert(1, backend_value(&be(2, 8080), Protocol::Tcp));
    let (s, _) = transition(&s, &state(&[(a, &[1, 2, 3], None)]));
    let ids = backend_ids(&s, a);
    assert_eq!(ids[&be(3, 8080)], 2);
    assert_eq!(ids[&be(1, 8080)], u32::MAX);
    assert_eq!(rev_nat_id(&s, a), 7);
}

#[test]
fn repairs_an_interrupted_plan() {
    let a = tcp(1);
    let mut s = program(&state(&[(a, &[1, 2], None)]));
    // A crash after writing a backend and a slot, before the master.
    s.backends
        .insert(500, backend_value(&be(3, 8080), Protocol::Tcp));
    s.services
        .insert(service_key(&a, 3), slot_value(500, rev_nat_id(&s, a)));
    // And a backend written for a plan that never got to its slot.
    s.backends
        .insert(501, backend_value(&be(4, 8080), Protocol::Tcp));
    let (s, ops) = transition(&s, &state(&[(a, &[1, 2, 3], None)]));
    assert_eq!(backend_ids(&s, a)[&be(3, 8080)], 500);
    assert_eq!(ops.last(), Some(&MapOp::DeleteBackend { id: 501 }));
}

#[test]
fn full_services_map_leaves_the_frontend_untouched() {
    let (a, b, c) = (tcp(1), tcp(2), tcp(3));
    let s = program(&state(&[(a, &[1], None), (c, &[1, 2], None)]));
    assert_eq!(s.services.len(), 5);
    // b needs 3 new keys and a 1 more; c goes away, but only after the others.
    let want = state(&[(a, &[1, 2], None), (b, &[1, 2], None)]);
    let p = plan(
        &want,
        &s,
        Capacity {
            services: 7,
            backends: 100,
            frontend_ids: MAX_REV_NAT_ID,
            ..ROOMY
        },
    );
    assert_eq!(
        p.rejected,
        [ReconcileError::MapFull {
            service: "default/web:http".to_owned(),
            frontend: b,
            map: "LB_SERVICES",
            capacity: 7,
            flag: "services-map-size",
        }]
    );
    assert!(p.rejected[0].to_string().contains("--services-map-size"));
    let mut after = s.clone();
    after.apply(&p.ops);
    assert_never_half_written(&after, "partial plan");
    assert_programs(&after, &state(&[(a, &[1, 2], None)]));
    // With c gone there is room now.
    let p2 = plan(
        &want,
        &after,
        Capacity {
            services: 7,
            backends: 100,
            frontend_ids: MAX_REV_NAT_ID,
            ..ROOMY
        },
    );
    assert!(p2.rejected.is_empty());
}

#[test]
fn full_backends_map_leaves_the_frontend_untouched() {
    let (a, b) = (tcp(1), tcp(2));
    let s = program(&state(&[(a, &[1], None), (b, &[1], None)]));
    // a would need 3 more backends, b 1; deletions in the same plan do not count.
    let want = state(&[(a, &[2, 3, 4], None), (b, &[2], None)]);
    let p = plan(
        &want,
        &s,
        Capacity {
            services: 100,
            backends: 4,
            frontend_ids: MAX_REV_NAT_ID,
            ..ROOMY
        },
    );
    assert!(matches!(
        &p.rejected[..],
        [ReconcileError::MapFull { frontend, map: "LB_BACKENDS", flag: "backends-map-size", capacity: 4, .. }]
            if *frontend == a
    ));
    let mut after = s.clone();
    after.apply(&p.ops);
    assert_programs(&after, &state(&[(a, &[1], None), (b, &[2], None)]));
}

#[test]
fn too_many_backends() {
    let a = tcp(1);
    let mut d = state(&[(a, &[], None), (tcp(2), &[1], None)]);
    let spec = d.frontends.get_mut(&a).unwrap();
    spec.backends = (0..=MAX_BACKENDS_PER_FRONTEND as u32)
        .map(|i| BackendAddr {
            ip: Ipv4Addr::from(0x0a00_0000 + i).into(),
            port: 80,
            local: false,
        })
        .collect::<BTreeSet<_>>()
        .into();
    let p = plan(&d, &MapSnapshot::default(), ROOMY);
    assert!(matches!(
        &p.rejected[..],
        [ReconcileError::TooManyBackends {
            count: 65_535,
            max: 65_534,
            ..
        }]
    ));
    let mut s = MapSnapshot::default();
    s.apply(&p.ops);
    assert_eq!(table::decode(&s).len(), 1);
}

#[test]
fn out_of_frontend_ids() {
    // Ids are 32-bit; a small id space stands in for running out of them.
    const MAX: u32 = 300;
    let tight = Capacity {
        frontend_ids: MAX,
        ..ROOMY
    };
    let mut s = MapSnapshot::default();
    for rev in 1..=MAX {
        let f = Frontend::internal(
            Ipv4Addr::new(10, 97, (rev >> 8) as u8, rev as u8).into(),
            80,
            Protocol::Tcp,
        );
        s.services.insert(
            service_key(&f, 0),
            master_value(&spec(&[], None), 0, rev, false, None),
        );
    }
    // Everything old goes away, but only after the new frontend would need its id.
    let p = plan(&state(&[(tcp(1), &[1], None)]), &s, tight);
    assert!(matches!(
        &p.rejected[..],
        [ReconcileError::OutOfIds { max: MAX, .. }]
    ));
    assert!(p
        .ops
        .iter()
        .all(|op| matches!(op, MapOp::DeleteService { .. })));
}

#[test]
fn frontend_ids_go_past_16_bits() {
    // 70k frontends: more than a 16-bit id could number.
    let mut desired = DesiredState::default();
    for i in 0..70_000u32 {
        let f = Frontend::internal(
            Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i).into(),
            80,
            Protocol::Tcp,
        );
        desired.frontends.insert(f, spec(&[1], None));
    }
    let p = plan(&desired, &MapSnapshot::default(), ROOMY);
    assert!(p.rejected.is_empty(), "{:?}", &p.rejected[..1]);
    let mut s = MapSnapshot::default();
    s.apply(&p.ops);
    let table = table::decode(&s);
    assert_eq!(table.len(), 70_000);
    let ids: BTreeSet<u32> = table.iter().map(|f| f.rev_nat_id).collect();
    assert_eq!(ids.len(), 70_000);
    assert!(ids.last().copied().unwrap() > u32::from(u16::MAX));
}

#[test]
fn garbage_entries_are_removed_last() {
    let a = tcp(1);
    let mut s = program(&state(&[(a, &[1], None)]));
    let bad = ServiceKey {
        _pad: [1, 0],
        ..service_key(&tcp(9), 0)
    };
    s.services.insert(bad, ServiceValue::default());
    let sctp = ServiceKey {
        proto: 132,
        ..service_key(&tcp(8), 0)
    };
    s.services.insert(sctp, ServiceValue::default());
    let (_, ops) = transition(&s, &state(&[(a, &[1], None)]));
    assert_eq!(
        ops,
        [
            MapOp::DeleteService { key: sctp },
            MapOp::DeleteService { key: bad }
        ]
    );
}

/// xorshift64*: a reproducible stream without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_state(rng: &mut Rng) -> DesiredState {
    let mut d = DesiredState::default();
    for last in 1..=4u8 {
        for (port, protocol) in [
            (80, Protocol::Tcp),
            (53, Protocol::Udp),
            (53, Protocol::Tcp),
        ] {
            if rng.below(10) < 6 {
                let backends: Vec<u8> = (0..8).filter(|_| rng.below(3) == 0).collect();
                let affinity = [None, Some(10_800), Some(60)][rng.below(3) as usize];
                d.frontends
                    .insert(fe(last, port, protocol), spec(&backends, affinity));
            }
        }
    }
    d
}

#[test]
fn random_transitions_are_never_half_written_and_keep_ids() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut s = MapSnapshot::default();
    for _ in 0..300 {
        let to = random_state(&mut rng);
        let before = table::decode(&s);
        let max_before = s.backends.keys().copied().max().unwrap_or(0);
        let (next, _) = transition(&s, &to);
        for after in table::decode(&next) {
            let Some(old) = before.iter().find(|b| b.frontend == after.frontend) else {
                continue;
            };
            assert_eq!(after.rev_nat_id, old.rev_nat_id);
            for b in &after.backends {
                match old
                    .backends
                    .iter()
                    .find(|o| (o.ip, o.port) == (b.ip, b.port))
                {
                    Some(o) => assert_eq!(o.id, b.id),
                    None => assert!(b.id > max_before),
                }
            }
        }
        s = next;
    }
}

/// The frontends whose spec differs between `a` and `b`, with the internal
/// twin of each external one (its master's flag follows the external entry).
fn changed_between(a: &DesiredState, b: &DesiredState) -> BTreeSet<Frontend> {
    let mut changed: BTreeSet<Frontend> = a
        .frontends
        .keys()
        .chain(b.frontends.keys())
        .filter(|f| a.frontends.get(f) != b.frontends.get(f))
        .copied()
        .collect();
    let twins: Vec<Frontend> = changed
        .iter()
        .filter(|f| f.scope == Scope::External)
        .map(|f| f.with_scope(Scope::Internal))
        .collect();
    changed.extend(twins);
    changed
}

/// Gives about one internal frontend in `one_in` an external entry, with the
/// first `backends` of its backends.
fn add_externals(state: &mut DesiredState, rng: &mut Rng, one_in: u64, backends: usize) {
    let externals: Vec<(Frontend, FrontendSpec)> = state
        .frontends
        .iter()
        .filter(|_| rng.below(one_in) == 0)
        .map(|(f, spec)| {
            let mut spec = spec.clone();
            spec.backends =
                std::sync::Arc::new(spec.backends.iter().take(backends).copied().collect());
            (f.with_scope(Scope::External), spec)
        })
        .collect();
    state.frontends.extend(externals);
}

/// A start written in pieces: every prefix of the writes is consistent, an
/// external entry is written with its internal twin, and the table ends as one
/// plan from scratch programs it.
#[test]
fn a_start_planned_in_pieces_programs_the_whole_table() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..20 {
        let mut desired = random_state(&mut rng);
        add_externals(&mut desired, &mut rng, 3, usize::MAX);
        let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
        let mut s = MapSnapshot::default();
        let mut pieces = 0;
        plan_in_pieces(&desired, &mut known, ROOMY, 2, |plan| {
            assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
            pieces += 1;
            let planned: BTreeSet<Frontend> = table::decode(&{
                let mut after = s.clone();
                after.apply(&plan.ops);
                after
            })
            .iter()
            .map(|f| f.frontend)
            .collect();
            for f in &planned {
                let twin = f.with_scope(Scope::External);
                if f.scope == Scope::Internal && desired.frontends.contains_key(&twin) {
                    assert!(
                        planned.contains(&twin),
                        "round {round}: {f} without its twin"
                    );
                }
            }
            for op in &plan.ops {
                s.apply(std::slice::from_ref(op));
                assert_never_half_written(&s, &format!("round {round}, {op:?}"));
            }
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(known.snapshot(), &s);
        assert_programs(&s, &desired);
        let internal = desired
            .frontends
            .keys()
            .filter(|f| f.scope == Scope::Internal)
            .count();
        assert!(pieces >= internal / 2, "round {round}: {pieces} pieces");
        assert!(super::plan(&desired, &s, ROOMY).is_empty());
    }
}

/// Per-change planning against the kept table, over random transitions (with
/// external entries coming and going): the kernel's maps hold exactly the
/// desired state after each change, as a full plan from scratch would program
/// it, every prefix of the ops is consistent, and a full plan afterwards has
/// nothing left to do.
#[test]
fn planning_only_the_changed_frontends_matches_a_full_plan() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut desired = DesiredState::default();
    let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
    for step in 0..400 {
        let mut next = random_state(&mut rng);
        // Some internal frontends get an external entry of their own backends.
        add_externals(&mut next, &mut rng, 4, 1);
        let changed = changed_between(&desired, &next);
        // Now and then a full plan (start, repair), whose ids the kept table
        // must learn from its ops.
        let plan = if step % 37 == 0 {
            super::plan(&next, known.snapshot(), ROOMY)
        } else {
            plan_changes(&next, &changed, &mut known, ROOMY)
        };
        assert!(plan.rejected.is_empty(), "step {step}: {:?}", plan.rejected);
        let mut s = known.snapshot().clone();
        for (i, op) in plan.ops.iter().enumerate() {
            s.apply(std::slice::from_ref(op));
            if let Some(problem) = half_written(&s) {
                panic!("step {step}, after op {i} {op:?}: {problem}");
            }
        }
        known.apply(&plan.ops);
        assert_eq!(known.snapshot(), &s);
        assert_programs(known.snapshot(), &next);
        assert_eq!(
            table::decode(known.snapshot())
                .into_iter()
                .map(|f| (f.frontend, f.backends.len()))
                .collect::<Vec<_>>(),
            table::decode(&program(&next))
                .into_iter()
                .map(|f| (f.frontend, f.backends.len()))
                .collect::<Vec<_>>(),
            "step {step}"
        );
        let full = super::plan(&next, known.snapshot(), ROOMY);
        assert!(
            full.is_empty(),
            "step {step}: left for a full plan: {:?}",
            full.ops
        );
        desired = next;
    }
}

/// Ids freed by a change are handed out again only after the ones ahead.
#[test]
fn a_kept_table_frees_the_ids_of_what_it_deleted() {
    let a = tcp(1);
    let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
    let one = state(&[(a, &[1, 2], None)]);
    let changed: BTreeSet<Frontend> = [a].into();
    let p = plan_changes(&one, &changed, &mut known, ROOMY);
    known.apply(&p.ops);
    let ids: BTreeSet<u32> = known.snapshot().backends.keys().copied().collect();
    assert_eq!(ids, [1, 2].into());
    let p = plan_changes(&state(&[]), &changed, &mut known, ROOMY);
    known.apply(&p.ops);
    assert!(known.snapshot().services.is_empty() && known.snapshot().backends.is_empty());
    assert!(known.backend_ids.used.is_empty() && known.rev_nat_ids.used.is_empty());
    let p = plan_changes(&one, &changed, &mut known, ROOMY);
    known.apply(&p.ops);
    let ids: BTreeSet<u32> = known.snapshot().backends.keys().copied().collect();
    assert_eq!(ids, [3, 4].into(), "not the ids just freed");
}

/// A kept table that learnt a full plan's ids hands out the next one above
/// them, as the full plan's own allocator would (no search from 1 up).
#[test]
fn a_kept_table_counts_on_above_the_ids_a_full_plan_wrote() {
    let a = tcp(1);
    let full = plan(
        &state(&[(a, &[1, 2, 3], None)]),
        &MapSnapshot::default(),
        ROOMY,
    );
    let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
    known.apply(&full.ops);
    assert_eq!(known.backend_ids.next, 4);
    assert_eq!(known.rev_nat_ids.next, 2);
}

mod maglev;
