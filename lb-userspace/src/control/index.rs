//! The desired state kept per Service, so that a change to one object costs that
//! object's Service, not every Service: each Service's frontends and health check
//! are derived from it and its own EndpointSlices alone (by [`build_desired`] on
//! that one Service), and the claims of all Services on each frontend and health
//! check node port are kept, so the winner of a conflict (the first Service by
//! namespace/name, as in a full derivation) is known without looking at the rest.
//!
//! [`DesiredIndex::sync`] takes the sources' latest object set and finds what
//! changed by pointer: the sources share unchanged objects (`Arc`), so an object
//! that is not the same allocation is new, changed or gone. Only those are named
//! (namespace/name keys built); the rest costs a pointer lookup each. Measured on
//! 10k Services x 10 endpoints (20k objects), keying every object by name on each
//! sync took 7.5-12 ms; by pointer (Fx hashing of addresses) it is a fraction. It returns the
//! frontends whose entry changed, which is what `reconcile::plan_changes` plans.
//! A full derivation stays the reference: the property test below holds the two
//! to the same state over random changes.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use litemap::LiteMap;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::source::lean::{EndpointSlice, Meta, Service};

use super::{build_desired, SourceOptions};
use crate::model::{DesiredState, Frontend, FrontendSpec, HealthCheck, Scope};
use crate::source::intern::{intern, Shared};
use crate::source::{ObjectError, Objects, Problem};

/// `(namespace, name)`; objects without a namespace are in `default`. Allocated
/// once per arriving object and shared (a pointer) by every map here that keys by
/// it: as two `String`s it was 48 bytes and two allocations per copy, in seven
/// maps. The namespace is shared by all its objects. Ordered by namespace, then
/// name, as a full derivation reads objects.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key(Arc<(Shared, Box<str>)>);

impl Key {
    /// `namespace` as the object holds it (already shared).
    fn new(namespace: Option<&Shared>, name: &str) -> Self {
        let namespace = namespace.cloned().unwrap_or_else(|| intern("default"));
        Key(Arc::new((namespace, name.into())))
    }

    fn namespace(&self) -> &str {
        &self.0 .0
    }

    fn name(&self) -> &str {
        &self.0 .1
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace(), self.name())
    }
}

fn key_of(meta: &Meta) -> Key {
    Key::new(
        meta.namespace.as_ref(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// The Service a slice belongs to, by its `kubernetes.io/service-name` label.
fn owner_of(slice: &EndpointSlice) -> Option<Key> {
    let name = slice.service_name.as_ref()?;
    Some(Key::new(slice.metadata.namespace.as_ref(), name))
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
pub struct Changes {
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
    /// EndpointSlices new or changed, and gone, in this sync.
    pub slices: Vec<Arc<EndpointSlice>>,
    pub gone_slices: Vec<Arc<EndpointSlice>>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.health_checks.is_empty()
    }
}

#[derive(Default)]
pub struct DesiredIndex {
    opts: SourceOptions,
    services: HashMap<Key, Arc<Service>>,
    /// Every slice, with the Service its label names (`None`: no label).
    slices: HashMap<Key, (Option<Key>, Arc<EndpointSlice>)>,
    /// The slices naming each Service, in name order (as a full derivation reads
    /// them), whether or not the Service exists.
    slices_of: HashMap<Key, LiteMap<Key, Arc<EndpointSlice>>>,
    derived: HashMap<Key, Derived>,
    /// Every Service's claim on each frontend, by Service key: the first wins.
    claims: HashMap<Frontend, LiteMap<Key, FrontendSpec>>,
    health_claims: HashMap<u16, LiteMap<Key, HealthCheck>>,
    desired: DesiredState,
    /// The allocation of every object held from the flat lists, and its key.
    service_ptrs: FxHashMap<usize, Key>,
    slice_ptrs: FxHashMap<usize, Key>,
    /// The parts held, by allocation.
    parts: FxHashMap<usize, Arc<Objects>>,
    /// The problem count, kept as objects change (recounting walks everything):
    /// Services' own problems, conflict losers, slices naming a missing Service
    /// (by the Service they name) and slices naming none.
    own_errors: usize,
    losers: usize,
    orphans: usize,
    orphans_of: HashMap<Key, usize>,
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

fn ptr<T>(object: &Arc<T>) -> usize {
    Arc::as_ptr(object) as usize
}

/// What [`arrivals`] finds: (allocation, key) of the objects gone, and the
/// objects come, each with its key.
type Arrivals<'a, T> = (Vec<(usize, Key)>, Vec<(Key, &'a Arc<T>)>);

/// The objects of one kind that left (allocation, key) and that came since the
/// last sync: flat ones one by one against `held` (updated), those of parts by
/// comparing each replaced part with the parts that came. Only what came is named.
fn arrivals<'a, T>(
    held: &mut FxHashMap<usize, Key>,
    flat: &'a [Arc<T>],
    gone_parts: &'a [Arc<Objects>],
    new_parts: &'a [Arc<Objects>],
    of_part: fn(&Objects) -> &Vec<Arc<T>>,
    key: fn(&T) -> Key,
) -> Arrivals<'a, T> {
    let next: FxHashSet<usize> = flat.iter().map(ptr).collect();
    let mut gone: Vec<(usize, Key)> = held
        .iter()
        .filter(|(p, _)| !next.contains(p))
        .map(|(p, k)| (*p, k.clone()))
        .collect();
    for (p, _) in &gone {
        held.remove(p);
    }
    // A part replaced by another may share objects with it (the API source rebuilds
    // the shard of a change from the same allocations): only the difference counts.
    let in_parts = |parts: &'a [Arc<Objects>]| parts.iter().flat_map(move |p| of_part(p).iter());
    let kept_in: FxHashSet<usize> = in_parts(new_parts).map(ptr).collect();
    let held_in: FxHashSet<usize> = in_parts(gone_parts).map(ptr).collect();
    for object in in_parts(gone_parts).filter(|o| !kept_in.contains(&ptr(o))) {
        gone.push((ptr(object), key(object)));
    }
    let mut came = Vec::new();
    for object in flat {
        if let std::collections::hash_map::Entry::Vacant(e) = held.entry(ptr(object)) {
            came.push((e.insert(key(object)).clone(), object));
        }
    }
    came.extend(
        in_parts(new_parts)
            .filter(|o| !held_in.contains(&ptr(o)))
            .map(|o| (key(o), o)),
    );
    (gone, came)
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
        let orphans = self
            .slices
            .values()
            .filter(|(owner, _)| {
                owner
                    .as_ref()
                    .is_none_or(|o| !self.services.contains_key(o))
            })
            .count();
        own + losers + orphans
    }

    /// Brings the index to `objects`: what is not the same allocation as before is
    /// derived again, with every Service whose slices changed.
    pub fn sync(&mut self, objects: &Objects) -> Changes {
        let mut touched: BTreeSet<Key> = BTreeSet::new();
        let mut new_errors = Vec::new();

        // What left and what came, by allocation: parts whole, flat objects one by
        // one. Nothing is named until it is known to have changed.
        let next_parts: FxHashSet<usize> = objects.parts.iter().map(ptr).collect();
        let gone_parts: Vec<Arc<Objects>> = self
            .parts
            .iter()
            .filter(|(p, _)| !next_parts.contains(p))
            .map(|(_, part)| part.clone())
            .collect();
        for part in &gone_parts {
            self.parts.remove(&ptr(part));
        }
        let mut new_parts = Vec::new();
        for part in &objects.parts {
            if self.parts.insert(ptr(part), part.clone()).is_none() {
                new_parts.push(part.clone());
            }
        }

        let (gone_services, new_services) = arrivals(
            &mut self.service_ptrs,
            &objects.services,
            &gone_parts,
            &new_parts,
            |part| &part.services,
            |svc| key_of(&svc.metadata),
        );
        // Gone first: a changed object is a gone allocation and a new one.
        for (p, key) in gone_services {
            if self.services.get(&key).is_some_and(|held| ptr(held) == p) {
                self.services.remove(&key);
                touched.insert(key);
            }
        }
        for (key, svc) in new_services {
            // Two objects under one key: the later one is what a full derivation
            // (keyed the same way) would keep.
            self.services.insert(key.clone(), svc.clone());
            touched.insert(key);
        }

        let (gone, new_slices_in) = arrivals(
            &mut self.slice_ptrs,
            &objects.slices,
            &gone_parts,
            &new_parts,
            |part| &part.slices,
            |slice| key_of(&slice.metadata),
        );

        let mut gone_slices = Vec::new();
        for (p, key) in gone {
            if self.slices.get(&key).is_none_or(|(_, held)| ptr(held) != p) {
                continue;
            }
            match self.slices.remove(&key) {
                Some((Some(owner), old)) => {
                    self.unlink_slice(&owner, &key);
                    touched.insert(owner);
                    gone_slices.push(old);
                }
                Some((None, old)) => {
                    self.unlabeled -= 1;
                    gone_slices.push(old);
                }
                None => {}
            }
        }
        let mut new_slices = Vec::new();
        for (key, slice) in new_slices_in {
            if let Some((old_owner, _)) = self.slices.remove(&key) {
                match old_owner {
                    Some(old_owner) => {
                        self.unlink_slice(&old_owner, &key);
                        touched.insert(old_owner);
                    }
                    None => self.unlabeled -= 1,
                }
            }
            // The owner's key as the index holds it already, if it does.
            let owner = owner_of(slice).map(|o| match self.slices_of.get_key_value(&o) {
                Some((held, _)) => held.clone(),
                None => self
                    .services
                    .get_key_value(&o)
                    .map_or(o, |(held, _)| held.clone()),
            });
            match &owner {
                Some(o) => {
                    self.slices_of
                        .entry(o.clone())
                        .or_insert_with(|| LiteMap::with_capacity(1))
                        .insert(key.clone(), slice.clone());
                    touched.insert(o.clone());
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
            self.slices.insert(key, (owner, slice.clone()));
            new_slices.push(slice.clone());
        }

        let mut changes = Changes {
            services: touched.len(),
            slices: new_slices,
            gone_slices,
            ..Changes::default()
        };
        for key in touched {
            self.derive(&key, &mut changes, &mut new_errors);
        }
        let twins: Vec<Frontend> = changes
            .frontends
            .iter()
            .filter(|f| f.scope == Scope::External)
            .map(|f| f.with_scope(Scope::Internal))
            .collect();
        changes.frontends.extend(twins);
        changes.new_errors = new_errors;
        changes
    }

    fn unlink_slice(&mut self, owner: &Key, slice: &Key) {
        if let Some(slices) = self.slices_of.get_mut(owner) {
            slices.remove(slice);
            if slices.is_empty() {
                self.slices_of.remove(owner);
            }
        }
    }

    /// Derives Service `key` again (or drops it, gone) and moves its claims.
    fn derive(&mut self, key: &Key, changes: &mut Changes, new_errors: &mut Vec<ObjectError>) {
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
    fn settle(&mut self, frontend: Frontend, changes: &mut Changes, errors: &mut Vec<ObjectError>) {
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

    fn settle_health_check(&mut self, port: u16, changes: &mut Changes) {
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

    /// The object set as a source holds it: unchanged objects keep their `Arc`.
    #[derive(Default, Clone)]
    struct World {
        services: BTreeMap<u8, Arc<Service>>,
        slices: BTreeMap<u8, Arc<EndpointSlice>>,
        /// As the file source would hold them: three "files" (objects by id
        /// modulo 3), each the same part as long as none of its objects changed.
        parts: [Option<(Vec<usize>, Arc<Objects>)>; 3],
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
                    self.services
                        .insert(*s, Arc::new(service(ns, &name, *ip, ports, *node_port)));
                }
                Event::DeleteService { s } => {
                    self.services.remove(s);
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
                    let sl = slice(ns, &format!("slice-{n}"), owner.as_deref(), pods, ports);
                    self.slices.insert(*n, Arc::new(sl));
                }
                Event::DeleteSlice { n } => {
                    self.slices.remove(n);
                }
            }
        }

        fn objects(&self) -> Objects {
            Objects {
                services: self.services.values().cloned().collect(),
                slices: self.slices.values().cloned().collect(),
                ..Objects::default()
            }
        }

        fn objects_in_parts(&mut self) -> Objects {
            let mut all = Objects::default();
            for (i, cached) in self.parts.iter_mut().enumerate() {
                let part = Objects {
                    services: self
                        .services
                        .iter()
                        .filter(|(id, _)| usize::from(**id) % 3 == i)
                        .map(|(_, s)| s.clone())
                        .collect(),
                    slices: self
                        .slices
                        .iter()
                        .filter(|(id, _)| usize::from(**id) % 3 == i)
                        .map(|(_, s)| s.clone())
                        .collect(),
                    ..Objects::default()
                };
                let ptrs: Vec<usize> = part
                    .services
                    .iter()
                    .map(ptr)
                    .chain(part.slices.iter().map(ptr))
                    .collect();
                if cached.as_ref().is_none_or(|(held, _)| *held != ptrs) {
                    *cached = Some((ptrs, Arc::new(part)));
                }
                all.parts.push(cached.as_ref().expect("just set").1.clone());
            }
            all
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
            in_parts: bool,
        ) {
            let mut world = World::default();
            let mut index = DesiredIndex::new(opts());
            let mut before = DesiredState::default();
            for e in &events {
                world.apply(e);
                let objects = if in_parts { world.objects_in_parts() } else { world.objects() };
                let changes = index.sync(&objects);
                let services: Vec<Arc<Service>> = objects.all_services().cloned().collect();
                let slices: Vec<Arc<EndpointSlice>> = objects.all_slices().cloned().collect();
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
        assert_eq!(index.sync(&world.objects()).services, 6);
        world.apply(&Event::PutSlice {
            n: 2,
            s: Some(2),
            pods: vec![1, 2],
            ports: vec![80],
        });
        let changes = index.sync(&world.objects());
        assert_eq!(changes.services, 1);
        assert_eq!(changes.frontends.len(), 1);
        assert!(index.sync(&world.objects()).is_empty(), "nothing changed");

        // In parts (as the API source's shards): the replaced part shares its other
        // objects with the one before, and only the changed one counts.
        let mut index = DesiredIndex::new(opts());
        assert_eq!(index.sync(&world.objects_in_parts()).services, 6);
        world.apply(&Event::PutSlice {
            n: 4,
            s: Some(4),
            pods: vec![3],
            ports: vec![80],
        });
        let changes = index.sync(&world.objects_in_parts());
        assert_eq!(changes.services, 1);
        assert_eq!(changes.slices.len(), 1);
        assert_eq!(changes.gone_slices.len(), 1);
        assert!(index.sync(&world.objects_in_parts()).is_empty());
    }
}
