//! The desired state kept per Service, so that a change to one object costs that
//! object's Service, not every Service: each Service's frontends and health check
//! are derived from it and its own EndpointSlices alone (by [`build_desired`] on
//! that one Service), and the claims of all Services on each frontend and health
//! check node port are kept, so the winner of a conflict (the first Service by
//! namespace/name, as in a full derivation) is known without looking at the rest.
//!
//! [`DesiredIndex::sync`] takes the sources' changes, keyed by namespace/name with
//! what each object was and is (see [`crate::source::changes`]), and derives again
//! exactly the Services they touch: a changed Service, and the Service a changed
//! slice names (before and after the change). It returns the frontends whose entry
//! changed, which is what `plan::plan_changes` plans. A full derivation stays the
//! reference: the property test below holds the two to the same state over random
//! changes.

use std::collections::BTreeSet;

// Seeded per map and far cheaper than SipHash (see source/changes.rs).
use foldhash::HashMap;
use std::sync::Arc;

use litemap::LiteMap;

use super::{build_desired, SourceOptions};
use crate::model::{DesiredState, Frontend, FrontendSpec, HealthCheck, Scope};
use crate::source::changes::{Changes, ObjectKey};
use crate::source::lean::{EndpointSlice, Service};
use crate::source::{ObjectError, Problem};

/// The Service a slice belongs to, by its `kubernetes.io/service-name` label.
fn owner_of(slice: &EndpointSlice) -> Option<ObjectKey> {
    let name = slice.service_name.as_ref()?;
    Some(ObjectKey::new(slice.metadata.namespace.as_ref(), name))
}

/// What one Service contributes, from itself and its slices.
#[derive(Default)]
struct Derived {
    /// Few per Service (often one): a sorted vector, where a B-tree's first node
    /// alone holds room for eleven.
    frontends: LiteMap<Frontend, FrontendSpec>,
    /// Boxed, as are the errors: few Services have either, and inline they made
    /// this record (one per Service, in the index's largest table) 112 bytes
    /// instead of 48.
    health_check: Option<Box<(u16, HealthCheck)>>,
    errors: Box<[ObjectError]>,
}
const _: () = assert!(std::mem::size_of::<Derived>() <= 48);

/// What one [`DesiredIndex::sync`] changed.
#[derive(Debug, Default)]
pub struct Delta {
    /// Frontends whose entry (winner's spec, or presence) changed, with the
    /// internal twin of every external one (its master's flag follows).
    pub frontends: BTreeSet<Frontend>,
    /// Health check node ports whose entry changed.
    pub health_checks: BTreeSet<u16>,
    /// Problems found in the objects derived by this sync (each is reported once,
    /// when its object changes).
    pub new_errors: Vec<ObjectError>,
    /// Services derived again (for the log).
    pub services: usize,
    /// EndpointSlices as they are now (new or changed), and as they were (changed
    /// or gone), in this sync.
    pub slices: Vec<Arc<EndpointSlice>>,
    pub gone_slices: Vec<Arc<EndpointSlice>>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.health_checks.is_empty()
    }

    /// What a later sync changed, added to this one's.
    pub fn absorb(&mut self, later: Delta) {
        self.frontends.extend(later.frontends);
        self.health_checks.extend(later.health_checks);
        self.new_errors.extend(later.new_errors);
        self.services += later.services;
        self.slices.extend(later.slices);
        self.gone_slices.extend(later.gone_slices);
    }
}

#[derive(Default)]
pub struct DesiredIndex {
    opts: SourceOptions,
    services: HashMap<ObjectKey, Arc<Service>>,
    /// The slices naming each Service, in name order (as a full derivation reads
    /// them), whether or not the Service exists.
    slices_of: HashMap<ObjectKey, LiteMap<ObjectKey, Arc<EndpointSlice>>>,
    derived: HashMap<ObjectKey, Derived>,
    /// Every Service's claim on each frontend, by Service key: the first wins.
    claims: HashMap<Frontend, LiteMap<ObjectKey, FrontendSpec>>,
    health_claims: HashMap<u16, LiteMap<ObjectKey, HealthCheck>>,
    desired: DesiredState,
    /// The problem count, kept as objects change (recounting walks everything):
    /// Services' own problems, conflict losers, slices naming a missing Service
    /// (by the Service they name) and slices naming none.
    own_errors: usize,
    losers: usize,
    orphans: usize,
    orphans_of: HashMap<ObjectKey, usize>,
    unlabeled: usize,
    /// Backends over all desired frontends, and the frontends with source ranges:
    /// what the agent reports and syncs after each change, kept as they change.
    backends: usize,
    restricted: BTreeSet<Frontend>,
}

/// How many conflict losers a claim list of `len` has.
fn losers(len: usize) -> usize {
    len.saturating_sub(1)
}

impl DesiredIndex {
    /// An empty index for `opts`; [`DesiredIndex::sync`] fills it.
    pub fn new(opts: SourceOptions) -> Self {
        DesiredIndex {
            opts,
            ..DesiredIndex::default()
        }
    }

    pub fn options(&self) -> &SourceOptions {
        &self.opts
    }

    /// The desired state of everything synced so far.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// [`DesiredState::backend_count`], without counting.
    pub fn backend_count(&self) -> usize {
        self.backends
    }

    /// The desired frontends that have `loadBalancerSourceRanges`.
    pub fn restricted(&self) -> impl Iterator<Item = (&Frontend, &FrontendSpec)> {
        self.restricted
            .iter()
            .filter_map(|f| self.desired.frontends.get_key_value(f))
    }

    /// Problems of the objects as they stand: each Service's own, the losers of
    /// frontend and health check node port conflicts, and slices that name no
    /// Service or one that does not exist.
    pub fn error_count(&self) -> usize {
        self.own_errors + self.losers + self.orphans + self.unlabeled
    }

    /// [`DesiredIndex::error_count`] the long way, for the tests.
    #[cfg(test)]
    fn error_count_by_walking(&self) -> usize {
        let own: usize = self.derived.values().map(|d| d.errors.len()).sum();
        let losers: usize = self.claims.values().map(|c| losers(c.len())).sum::<usize>()
            + self
                .health_claims
                .values()
                .map(|c| losers(c.len()))
                .sum::<usize>();
        let orphans: usize = self
            .slices_of
            .iter()
            .filter(|(owner, _)| !self.services.contains_key(*owner))
            .map(|(_, slices)| slices.len())
            .sum();
        own + losers + orphans + self.unlabeled
    }

    /// Reads every Service again under `opts` (this node's addresses or zone
    /// moved): the frontends whose entry that changes.
    pub fn set_options(&mut self, opts: SourceOptions) -> Delta {
        let mut delta = Delta::default();
        if opts == self.opts {
            return delta;
        }
        self.opts = opts;
        let keys: BTreeSet<ObjectKey> = self
            .services
            .keys()
            .chain(self.slices_of.keys())
            .cloned()
            .collect();
        let mut new_errors = Vec::new();
        delta.services = keys.len();
        for key in keys {
            self.derive(&key, &mut delta, &mut new_errors);
        }
        self.finish(delta, new_errors)
    }

    /// Applies the sources' `changes`: the Services they touch are derived again.
    pub fn sync(&mut self, changes: &Changes) -> Delta {
        // Derived in name order; sorted once (a BTreeSet's inserts compared names
        // 17 times each at 100k Services, a fifth of the start's derivation).
        let mut touched: Vec<ObjectKey> = Vec::with_capacity(changes.services.len());
        let mut new_errors = Vec::new();
        let mut delta = Delta::default();
        for (key, change) in &changes.services {
            match &change.current {
                Some(service) => self.services.insert(key.clone(), service.clone()),
                None => self.services.remove(key),
            };
            touched.push(key.clone());
        }
        for (key, change) in &changes.slices {
            if let Some(before) = &change.previous {
                match owner_of(before) {
                    Some(owner) => {
                        self.unlink_slice(&owner, key);
                        touched.push(owner);
                    }
                    None => self.unlabeled -= 1,
                }
                delta.gone_slices.push(before.clone());
            }
            let Some(slice) = &change.current else {
                continue;
            };
            match owner_of(slice) {
                Some(owner) => {
                    // The owner's key as the index holds it already, if it does.
                    let owner = match self.slices_of.get_key_value(&owner) {
                        Some((held, _)) => held.clone(),
                        None => self
                            .services
                            .get_key_value(&owner)
                            .map_or(owner, |(held, _)| held.clone()),
                    };
                    self.slices_of
                        .entry(owner.clone())
                        .or_insert_with(|| LiteMap::with_capacity(1))
                        .insert(key.clone(), slice.clone());
                    touched.push(owner);
                }
                None => {
                    self.unlabeled += 1;
                    new_errors.push(ObjectError::new(
                        "EndpointSlice",
                        key.namespace(),
                        key.name(),
                        Problem::MissingServiceName,
                    ));
                }
            }
            delta.slices.push(slice.clone());
        }
        touched.sort_unstable();
        touched.dedup();
        delta.services = touched.len();
        for key in touched {
            self.derive(&key, &mut delta, &mut new_errors);
        }
        self.finish(delta, new_errors)
    }

    /// Every changed external frontend brings its internal twin (its master's flag
    /// follows it).
    fn finish(&self, mut delta: Delta, new_errors: Vec<ObjectError>) -> Delta {
        let twins: Vec<Frontend> = delta
            .frontends
            .iter()
            .filter(|f| f.scope == Scope::External)
            .map(|f| f.with_scope(Scope::Internal))
            .collect();
        delta.frontends.extend(twins);
        delta.new_errors = new_errors;
        delta
    }

    fn unlink_slice(&mut self, owner: &ObjectKey, slice: &ObjectKey) {
        if let Some(slices) = self.slices_of.get_mut(owner) {
            slices.remove(slice);
            if slices.is_empty() {
                self.slices_of.remove(owner);
            }
        }
    }

    /// Derives Service `key` again (or drops it, gone) and moves its claims.
    fn derive(&mut self, key: &ObjectKey, changes: &mut Delta, new_errors: &mut Vec<ObjectError>) {
        let old = self.derived.remove(key).unwrap_or_default();
        let new = match self.services.get(key) {
            Some(svc) => {
                let slices: Vec<Arc<EndpointSlice>> = self
                    .slices_of
                    .get(key)
                    .map(|s| s.values().cloned().collect())
                    .unwrap_or_default();
                let (desired, errors) =
                    build_desired(std::slice::from_ref(svc), &slices, &self.opts);
                let health_check = desired.health_checks.into_iter().next().map(Box::new);
                Derived {
                    // Sorted already: stored as it comes, in a vector of its length.
                    frontends: LiteMap::from_sorted_store_unchecked(
                        desired.frontends.into_iter().collect(),
                    ),
                    health_check,
                    errors: errors.into_boxed_slice(),
                }
            }
            None => {
                // Slices naming a Service that does not exist (yet, or any more).
                for slice in self.slices_of.get(key).into_iter().flat_map(|s| s.keys()) {
                    new_errors.push(ObjectError::new(
                        "EndpointSlice",
                        slice.namespace(),
                        slice.name(),
                        Problem::ServiceNotFound {
                            service: key.to_string(),
                        },
                    ));
                }
                Derived::default()
            }
        };
        new_errors.extend(new.errors.iter().cloned());
        self.own_errors = self.own_errors - old.errors.len() + new.errors.len();
        let orphans = match self.services.contains_key(key) {
            true => 0,
            false => self.slices_of.get(key).map_or(0, LiteMap::len),
        };
        let before = match orphans {
            0 => self.orphans_of.remove(key),
            n => self.orphans_of.insert(key.clone(), n),
        };
        self.orphans = self.orphans - before.unwrap_or(0) + orphans;

        for frontend in old.frontends.keys() {
            if !new.frontends.contains_key(frontend) {
                if let Some(claims) = self.claims.get_mut(frontend) {
                    let len = claims.len();
                    claims.remove(key);
                    self.losers = self.losers - losers(len) + losers(claims.len());
                }
                self.settle(*frontend, changes, new_errors);
            }
        }
        for (frontend, spec) in &new.frontends {
            if old.frontends.get(frontend) == Some(spec) {
                continue;
            }
            let claims = self
                .claims
                .entry(*frontend)
                .or_insert_with(|| LiteMap::with_capacity(1));
            let len = claims.len();
            claims.insert(key.clone(), spec.clone());
            self.losers = self.losers - losers(len) + losers(claims.len());
            self.settle(*frontend, changes, new_errors);
        }

        let old_port = old.health_check.as_deref().map(|(p, _)| *p);
        if let Some(port) =
            old_port.filter(|p| new.health_check.as_deref().map(|(n, _)| n) != Some(p))
        {
            if let Some(claims) = self.health_claims.get_mut(&port) {
                let len = claims.len();
                claims.remove(key);
                self.losers = self.losers - losers(len) + losers(claims.len());
            }
            self.settle_health_check(port, changes);
        }
        if let Some((port, check)) = new.health_check.as_deref() {
            if old.health_check.as_deref() != Some(&(*port, check.clone())) {
                let claims = self.health_claims.entry(*port).or_default();
                let len = claims.len();
                claims.insert(key.clone(), check.clone());
                self.losers = self.losers - losers(len) + losers(claims.len());
                self.settle_health_check(*port, changes);
            }
        }
        if self.services.contains_key(key) {
            self.derived.insert(key.clone(), new);
        }
    }

    /// Puts the first claim on `frontend` (if any) in the desired state.
    fn settle(&mut self, frontend: Frontend, changes: &mut Delta, errors: &mut Vec<ObjectError>) {
        let winner = self.claims.get(&frontend).and_then(|c| c.first());
        let now = winner.map(|(_, spec)| spec.clone());
        if let Some(claims) = self.claims.get(&frontend) {
            if let Some((owner, _)) = claims.first() {
                for loser in claims.keys().skip(1) {
                    errors.push(ObjectError::new(
                        "Service",
                        loser.namespace(),
                        loser.name(),
                        Problem::DuplicateFrontend {
                            frontend,
                            owner: owner.to_string(),
                        },
                    ));
                }
            }
        }
        if self.claims.get(&frontend).is_some_and(|c| c.is_empty()) {
            self.claims.remove(&frontend);
        }
        let before = match &now {
            Some(spec) => self.desired.frontends.insert(frontend, spec.clone()),
            None => self.desired.frontends.remove(&frontend),
        };
        let count = |spec: &Option<FrontendSpec>| spec.as_ref().map_or(0, |s| s.backends.len());
        self.backends = self.backends - count(&before) + count(&now);
        match now.as_ref().is_some_and(|s| s.source_ranges.is_some()) {
            true => self.restricted.insert(frontend),
            false => self.restricted.remove(&frontend),
        };
        if before != now {
            changes.frontends.insert(frontend);
        }
    }

    fn settle_health_check(&mut self, port: u16, changes: &mut Delta) {
        let now = self
            .health_claims
            .get(&port)
            .and_then(|c| c.first().map(|(_, check)| check.clone()));
        if self.health_claims.get(&port).is_some_and(|c| c.is_empty()) {
            self.health_claims.remove(&port);
        }
        let before = match &now {
            Some(check) => self.desired.health_checks.insert(port, check.clone()),
            None => self.desired.health_checks.remove(&port),
        };
        if before != now {
            changes.health_checks.insert(port);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    fn service(ns: &str, name: &str, ip: u8, ports: &[u16], node_port: Option<u16>) -> Service {
        let ports: Vec<_> = ports
            .iter()
            .map(|p| {
                let mut port = json!({"name": format!("p{p}"), "port": p, "protocol": "TCP", "targetPort": 8000 + p});
                if let Some(np) = node_port {
                    port["nodePort"] = json!(np);
                }
                port
            })
            .collect();
        let mut spec = json!({
            "clusterIP": format!("10.96.0.{ip}"),
            "ports": ports,
            "type": if node_port.is_some() { "NodePort" } else { "ClusterIP" },
        });
        if node_port.is_some() && ip.is_multiple_of(3) {
            spec["externalTrafficPolicy"] = json!("Local");
            spec["type"] = json!("LoadBalancer");
            spec["healthCheckNodePort"] = json!(32000 + u16::from(ip % 2));
        }
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": ns, "name": name},
            "spec": spec,
        }))
        .unwrap()
    }

    fn slice(
        ns: &str,
        name: &str,
        owner: Option<&str>,
        pods: &[u8],
        ports: &[u16],
    ) -> EndpointSlice {
        let mut labels = serde_json::Map::new();
        if let Some(owner) = owner {
            labels.insert(
                crate::source::labels::LABEL_SERVICE_NAME.into(),
                json!(owner),
            );
        }
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": ns, "name": name, "labels": labels},
            "addressType": "IPv4",
            "endpoints": pods.iter().map(|p| json!({
                "addresses": [format!("10.244.0.{p}")],
                "conditions": {"ready": true},
                "nodeName": if p % 2 == 0 { "node-1" } else { "node-2" },
            })).collect::<Vec<_>>(),
            "ports": ports.iter().map(|p| json!({"name": format!("p{p}"), "port": 8000 + p, "protocol": "TCP"})).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    fn opts() -> SourceOptions {
        SourceOptions {
            node_name: "node-1".into(),
            node_ips: vec!["192.168.0.1".parse().unwrap()],
            ..SourceOptions::default()
        }
    }

    /// One change to the object set.
    #[derive(Clone, Debug)]
    enum Event {
        /// Service `s` (of a few names, in two namespaces) with cluster IP `ip`
        /// (few values, so Services collide), ports, maybe a node port.
        PutService {
            s: u8,
            ip: u8,
            ports: Vec<u16>,
            node_port: Option<u16>,
        },
        DeleteService {
            s: u8,
        },
        /// Slice `n` of Service `s` (or of no Service), with these pods.
        PutSlice {
            n: u8,
            s: Option<u8>,
            pods: Vec<u8>,
            ports: Vec<u16>,
        },
        DeleteSlice {
            n: u8,
        },
    }

    fn names(s: u8) -> (&'static str, String) {
        (
            if s.is_multiple_of(2) {
                "default"
            } else {
                "team"
            },
            format!("svc-{}", s / 2),
        )
    }

    fn event() -> impl Strategy<Value = Event> {
        let ports = proptest::collection::vec(prop_oneof![Just(80u16), Just(443), Just(53)], 0..3);
        prop_oneof![
            4 => (0..6u8, 1..5u8, ports.clone(), proptest::option::of(30000..30003u16))
                .prop_map(|(s, ip, ports, node_port)| Event::PutService { s, ip, ports, node_port }),
            1 => (0..6u8).prop_map(|s| Event::DeleteService { s }),
            4 => (0..8u8, proptest::option::of(0..7u8), proptest::collection::vec(1..9u8, 0..4), ports)
                .prop_map(|(n, s, pods, ports)| Event::PutSlice { n, s, pods, ports }),
            1 => (0..8u8).prop_map(|n| Event::DeleteSlice { n }),
        ]
    }

    /// One event as recorded: a Service (true) or slice, its id, and what it is now.
    type Recorded = (bool, u8, Option<Arc<Service>>, Option<Arc<EndpointSlice>>);

    /// The object set as a source holds it, and the changes it hands on.
    #[derive(Default, Clone)]
    struct World {
        services: BTreeMap<u8, Arc<Service>>,
        slices: BTreeMap<u8, Arc<EndpointSlice>>,
        /// Recorded since last taken, as a source's tracker holds them.
        pending: Vec<Recorded>,
    }

    impl World {
        fn apply(&mut self, e: &Event) {
            match e {
                Event::PutService {
                    s,
                    ip,
                    ports,
                    node_port,
                } => {
                    let (ns, name) = names(*s);
                    let svc = Arc::new(service(ns, &name, *ip, ports, *node_port));
                    self.services.insert(*s, svc.clone());
                    self.pending.push((true, *s, Some(svc), None));
                }
                Event::DeleteService { s } => {
                    self.services.remove(s);
                    self.pending.push((true, *s, None, None));
                }
                Event::PutSlice { n, s, pods, ports } => {
                    // Slices live in the namespace of the Service they name.
                    let (ns, owner) = match s {
                        Some(s) => {
                            let (ns, name) = names(*s);
                            (ns, Some(name))
                        }
                        None => ("default", None),
                    };
                    let sl = Arc::new(slice(
                        ns,
                        &format!("slice-{n}"),
                        owner.as_deref(),
                        pods,
                        ports,
                    ));
                    self.slices.insert(*n, sl.clone());
                    self.pending.push((false, *n, None, Some(sl)));
                }
                Event::DeleteSlice { n } => {
                    self.slices.remove(n);
                    self.pending.push((false, *n, None, None));
                }
            }
        }

        /// Everything recorded since the last call, keyed as a source keys it,
        /// with what the consumer saw before (`seen`, updated).
        fn changes(&mut self, seen: &mut World) -> Changes {
            let mut changes = Changes::default();
            for (is_service, id, svc, sl) in std::mem::take(&mut self.pending) {
                // A source keys by namespace and name: an object that moved to
                // another namespace is one object gone and another come.
                if is_service {
                    let before = seen.services.get(&id).cloned();
                    match &svc {
                        Some(s) => seen.services.insert(id, s.clone()),
                        None => seen.services.remove(&id),
                    };
                    record(
                        before,
                        svc,
                        |k, b, c| changes.service(k, b, c),
                        |s| &s.metadata,
                    );
                } else {
                    let before = seen.slices.get(&id).cloned();
                    match &sl {
                        Some(s) => seen.slices.insert(id, s.clone()),
                        None => seen.slices.remove(&id),
                    };
                    record(
                        before,
                        sl,
                        |k, b, c| changes.slice(k, b, c),
                        |s| &s.metadata,
                    );
                }
            }
            changes
        }
    }

    /// Records `before -> now` as keyed changes.
    fn record<T>(
        before: Option<Arc<T>>,
        now: Option<Arc<T>>,
        mut put: impl FnMut(ObjectKey, Option<Arc<T>>, Option<Arc<T>>),
        meta: fn(&T) -> &crate::source::lean::Meta,
    ) {
        let key = |o: &Option<Arc<T>>| o.as_deref().map(|o| ObjectKey::of(meta(o)));
        match (key(&before), key(&now)) {
            (Some(a), Some(b)) if a != b => {
                put(a, before, None);
                put(b, None, now);
            }
            (Some(k), _) | (None, Some(k)) => put(k, before, now),
            (None, None) => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// After every change, the per-Service index holds the desired state a full
        /// derivation of all objects gives, and what it reports as changed is
        /// exactly where the two consecutive full derivations differ.
        #[test]
        fn the_index_agrees_with_a_full_derivation(
            events in proptest::collection::vec(event(), 1..40),
            batch in 1..4usize,
        ) {
            let mut world = World::default();
            let mut seen = World::default();
            let mut index = DesiredIndex::new(opts());
            let mut before = DesiredState::default();
            // Several events may be recorded before the consumer takes them.
            for events in events.chunks(batch) {
                for e in events {
                    world.apply(e);
                }
                let e = events.last().expect("chunks are not empty");
                let changes = index.sync(&world.changes(&mut seen));
                let services: Vec<Arc<Service>> = world.services.values().cloned().collect();
                let slices: Vec<Arc<EndpointSlice>> = world.slices.values().cloned().collect();
                let (full, _) = build_desired(&services, &slices, &opts());
                prop_assert_eq!(&index.desired().frontends, &full.frontends, "after {:?}", e);
                prop_assert_eq!(&index.desired().health_checks, &full.health_checks, "after {:?}", e);
                prop_assert_eq!(index.error_count(), index.error_count_by_walking(), "after {:?}", e);
                prop_assert_eq!(index.backend_count(), full.backend_count(), "after {:?}", e);
                for (f, spec) in full.frontends.iter() {
                    if before.frontends.get(f) != Some(spec) {
                        prop_assert!(changes.frontends.contains(f), "{:?} changed but not reported after {:?}", f, e);
                    }
                }
                for f in before.frontends.keys() {
                    if !full.frontends.contains_key(f) {
                        prop_assert!(changes.frontends.contains(f), "{:?} gone but not reported after {:?}", f, e);
                    }
                }
                before = full;
            }
        }
    }

    /// A change to one slice derives its Service only; the others are untouched.
    #[test]
    fn a_slice_change_derives_only_its_service() {
        let mut world = World::default();
        let mut seen = World::default();
        for s in 0..6 {
            world.apply(&Event::PutService {
                s,
                ip: s + 1,
                ports: vec![80],
                node_port: None,
            });
            world.apply(&Event::PutSlice {
                n: s,
                s: Some(s),
                pods: vec![1],
                ports: vec![80],
            });
        }
        let mut index = DesiredIndex::new(opts());
        assert_eq!(index.sync(&world.changes(&mut seen)).services, 6);
        world.apply(&Event::PutSlice {
            n: 2,
            s: Some(2),
            pods: vec![1, 2],
            ports: vec![80],
        });
        let changes = index.sync(&world.changes(&mut seen));
        assert_eq!(changes.services, 1);
        assert_eq!(changes.frontends.len(), 1);
        assert_eq!(changes.slices.len(), 1);
        assert_eq!(changes.gone_slices.len(), 1);
        assert!(
            index.sync(&world.changes(&mut seen)).is_empty(),
            "nothing changed"
        );

        // A slice moving to another Service derives both.
        world.apply(&Event::PutSlice {
            n: 2,
            s: Some(3),
            pods: vec![1, 2],
            ports: vec![80],
        });
        assert_eq!(index.sync(&world.changes(&mut seen)).services, 2);
    }

    /// New node addresses read every Service again; only the frontends they move
    /// are reported.
    #[test]
    fn new_options_report_only_what_they_change() {
        let mut world = World::default();
        let mut seen = World::default();
        for s in 0..4 {
            world.apply(&Event::PutService {
                s,
                ip: s + 1,
                ports: vec![80],
                node_port: (s == 0).then_some(30000),
            });
        }
        let mut index = DesiredIndex::new(opts());
        index.sync(&world.changes(&mut seen));
        let moved = SourceOptions {
            node_ips: vec!["192.168.0.9".parse().unwrap()],
            ..opts()
        };
        let delta = index.set_options(moved.clone());
        assert_eq!(delta.services, 4);
        let services: Vec<Arc<Service>> = world.services.values().cloned().collect();
        let (full, _) = build_desired(&services, &[] as &[Arc<EndpointSlice>], &moved);
        assert_eq!(index.desired().frontends, full.frontends);
        // The NodePort's frontends on the old and the new address, with twins; no
        // cluster IP frontend.
        assert!(!delta.frontends.is_empty());
        assert!(delta
            .frontends
            .iter()
            .all(|f| f.port == 30000 || f.scope == Scope::Internal));
        assert!(
            index.set_options(moved).is_empty(),
            "the same options again"
        );
    }
}
