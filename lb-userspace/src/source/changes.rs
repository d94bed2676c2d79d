//! What a source hands on: its objects' changes keyed by namespace and name, as
//! kube-proxy's change trackers (`ServiceChangeTracker`, `EndpointsChangeTracker`)
//! keep them. A change stays recorded until the consumer takes it; a later change
//! of the same object replaces the earlier one's outcome, and one that undoes it
//! drops it. The consumer so derives exactly the objects that changed, whichever
//! source they came from, and never looks at the others.

use std::collections::hash_map::Entry;

// foldhash, not std's SipHash: at 100k Services the start hashed every key
// several times, and SipHash was 5% of its CPU (perf). foldhash is seeded per map,
// so names a tenant chooses cannot be made to collide in advance.
use foldhash::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::intern::{intern, Shared};
use super::lean::{EndpointSlice, Meta, Service};
use super::problem::ObjectError;
use super::yaml::FileError;
use crate::model::policy::{NetworkPolicy, PolicyNamespace, PolicyPod};

/// `(namespace, name)`; objects without a namespace are in `default`. Allocated
/// once per arriving object and shared by the source and every map of the index
/// that keys by it. Compared, hashed and ordered by its text: namespace, then name.
#[derive(Clone, Debug)]
pub struct ObjectKey(Arc<(Shared, Box<str>)>);

impl ObjectKey {
    /// `namespace` as the object holds it (already shared).
    pub fn new(namespace: Option<&Shared>, name: &str) -> Self {
        let namespace = namespace.cloned().unwrap_or_else(|| intern("default"));
        ObjectKey(Arc::new((namespace, name.into())))
    }

    /// The key of an object by its metadata.
    pub fn of(meta: &Meta) -> Self {
        Self::new(
            meta.namespace.as_ref(),
            meta.name.as_deref().unwrap_or_default(),
        )
    }

    /// The key of a cluster-scoped object (a Namespace): its name, with an empty
    /// namespace. Not `default`, as [`ObjectKey::new`] would give: Namespace
    /// `default` and a namespaced object `default/default` are different objects,
    /// and an empty namespace is one no namespaced object has.
    pub fn cluster(name: &str) -> Self {
        ObjectKey(Arc::new((intern(""), name.into())))
    }

    pub fn namespace(&self) -> &str {
        &self.0 .0
    }

    pub fn name(&self) -> &str {
        &self.0 .1
    }

    fn parts(&self) -> (&str, &str) {
        (self.namespace(), self.name())
    }
}

impl PartialEq for ObjectKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.parts() == other.parts()
    }
}

impl Eq for ObjectKey {}

impl Hash for ObjectKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.parts().hash(state);
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        if self.namespace().is_empty() {
            // Cluster-scoped: named as kubectl names it.
            return write!(f, "{}", self.name());
        }
        write!(f, "{}/{}", self.namespace(), self.name())
    }
}

/// One object's change since changes were last taken: as the consumer last saw it,
/// and as it is now (`None`: absent).
#[derive(Clone, Debug)]
pub struct Change<T> {
    pub previous: Option<Arc<T>>,
    pub current: Option<Arc<T>>,
}

/// How a kind's two sides of a change are found to be the same object.
type Unchanged<T> = fn(&T, &T) -> bool;

/// Services and EndpointSlices: only the same allocation. A source that replaced
/// one hands on a new allocation, so this is exactly "nothing happened", and
/// comparing their content would cost at 100k of them for changes that are real.
fn identical<T>(_: &T, _: &T) -> bool {
    false
}

/// Both absent, the same allocation, or (by `unchanged`) the same content.
fn same<T>(a: &Option<Arc<T>>, b: &Option<Arc<T>>, unchanged: Unchanged<T>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || unchanged(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// Records `previous -> current` for `key`, merged with what is recorded already:
/// the first `previous` stays (what the consumer saw), the last `current` wins,
/// and a change that ends where it started is dropped.
fn merge<T>(
    map: &mut HashMap<ObjectKey, Change<T>>,
    key: ObjectKey,
    previous: Option<Arc<T>>,
    current: Option<Arc<T>>,
    unchanged: Unchanged<T>,
) {
    match map.entry(key) {
        Entry::Vacant(e) => {
            if !same(&previous, &current, unchanged) {
                e.insert(Change { previous, current });
            }
        }
        Entry::Occupied(mut e) => {
            e.get_mut().current = current;
            if same(&e.get().previous, &e.get().current, unchanged) {
                e.remove();
            }
        }
    }
}

/// Changes recorded since they were last taken.
#[derive(Debug, Default)]
pub struct Changes {
    pub services: HashMap<ObjectKey, Change<Service>>,
    pub slices: HashMap<ObjectKey, Change<EndpointSlice>>,
    /// Every Node the source holds (this node's, or the files'), when they changed:
    /// few, and read whole.
    pub nodes: Option<Vec<Arc<Node>>>,
    /// What NetworkPolicy reads, keyed like Services: NetworkPolicies and Pods by
    /// namespace and name. Their sides are compared by content too (they are small,
    /// and an API source sees a Pod change with every status update, most of which
    /// change nothing policy reads), so a change that ends where it started, by
    /// content, is dropped.
    pub policies: HashMap<ObjectKey, Change<NetworkPolicy>>,
    pub pods: HashMap<ObjectKey, Change<PolicyPod>>,
    /// Namespaces, which are cluster-scoped: keyed by [`ObjectKey::cluster`] (an
    /// empty namespace and the Namespace's name).
    pub namespaces: HashMap<ObjectKey, Change<PolicyNamespace>>,
    /// Problems found while reading the objects (the file source), whole, when
    /// they changed.
    pub errors: Option<Vec<ObjectError>>,
    /// Manifest files that cannot be read (the file source), whole, when they
    /// changed.
    pub unreadable: Option<Vec<FileError>>,
    /// When the oldest change here reached the source.
    pub since: Option<Instant>,
}

impl Changes {
    pub fn service(
        &mut self,
        key: ObjectKey,
        previous: Option<Arc<Service>>,
        current: Option<Arc<Service>>,
    ) {
        merge(&mut self.services, key, previous, current, identical);
    }

    pub fn slice(
        &mut self,
        key: ObjectKey,
        previous: Option<Arc<EndpointSlice>>,
        current: Option<Arc<EndpointSlice>>,
    ) {
        merge(&mut self.slices, key, previous, current, identical);
    }

    pub fn policy(
        &mut self,
        key: ObjectKey,
        previous: Option<Arc<NetworkPolicy>>,
        current: Option<Arc<NetworkPolicy>>,
    ) {
        merge(&mut self.policies, key, previous, current, PartialEq::eq);
    }

    pub fn pod(
        &mut self,
        key: ObjectKey,
        previous: Option<Arc<PolicyPod>>,
        current: Option<Arc<PolicyPod>>,
    ) {
        merge(&mut self.pods, key, previous, current, PartialEq::eq);
    }

    /// `key`: [`ObjectKey::cluster`] of the Namespace's name.
    pub fn namespace(
        &mut self,
        key: ObjectKey,
        previous: Option<Arc<PolicyNamespace>>,
        current: Option<Arc<PolicyNamespace>>,
    ) {
        merge(&mut self.namespaces, key, previous, current, PartialEq::eq);
    }

    /// Nothing at all: no object, node, problem or file changed.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.slices.is_empty()
            && self.nodes.is_none()
            && self.policies.is_empty()
            && self.pods.is_empty()
            && self.namespaces.is_empty()
            && self.errors.is_none()
            && self.unreadable.is_none()
    }

    /// `later` recorded after these: merged as if recorded here one by one.
    fn absorb(&mut self, later: Changes) {
        for (key, change) in later.services {
            self.service(key, change.previous, change.current);
        }
        for (key, change) in later.slices {
            self.slice(key, change.previous, change.current);
        }
        for (key, change) in later.policies {
            self.policy(key, change.previous, change.current);
        }
        for (key, change) in later.pods {
            self.pod(key, change.previous, change.current);
        }
        for (key, change) in later.namespaces {
            self.namespace(key, change.previous, change.current);
        }
        if later.nodes.is_some() {
            self.nodes = later.nodes;
        }
        if later.errors.is_some() {
            self.errors = later.errors;
        }
        if later.unreadable.is_some() {
            self.unreadable = later.unreadable;
        }
        self.since = match (self.since, later.since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

struct Pending {
    changes: Changes,
    /// The source asked for the changes to be handed on.
    published: bool,
    /// It did so before.
    ever_published: bool,
    /// The source is gone; what it published is still handed on.
    closed: bool,
    /// The consumer is gone.
    receiver_gone: bool,
}

struct Tracker {
    pending: Mutex<Pending>,
    notify: Notify,
    /// Told when the receiver is dropped.
    receiver_gone: Notify,
}

/// A source's end: records changes, and says when they are to be handed on.
pub struct ChangeSender(Arc<Tracker>);

/// The consumer's end.
pub struct ChangeReceiver(Arc<Tracker>);

/// A change tracker between one source and its consumer.
pub fn channel() -> (ChangeSender, ChangeReceiver) {
    let tracker = Arc::new(Tracker {
        pending: Mutex::new(Pending {
            changes: Changes::default(),
            published: false,
            ever_published: false,
            closed: false,
            receiver_gone: false,
        }),
        notify: Notify::new(),
        receiver_gone: Notify::new(),
    });
    (ChangeSender(tracker.clone()), ChangeReceiver(tracker))
}

impl ChangeSender {
    /// Merges `changes` into what is pending, without handing it on yet (a source
    /// coalescing a burst records as events come and publishes when due).
    pub fn record(&self, changes: Changes) {
        if changes.is_empty() {
            return;
        }
        self.0.pending.lock().changes.absorb(changes);
    }

    /// Hands on what is pending. Nothing pending is handed on only the first time:
    /// a first, empty read of the source is news; later, an empty hand-on is not.
    pub fn publish(&self) {
        let mut pending = self.0.pending.lock();
        if pending.ever_published && pending.changes.is_empty() {
            return;
        }
        pending.ever_published = true;
        pending.published = true;
        drop(pending);
        self.0.notify.notify_one();
    }

    /// Returns once the consumer is gone: a source stops following then.
    pub async fn closed(&self) {
        loop {
            // Registered before looking, so a drop in between is not missed.
            let gone = self.0.receiver_gone.notified();
            if self.0.pending.lock().receiver_gone {
                return;
            }
            gone.await;
        }
    }
}

impl Drop for ChangeSender {
    fn drop(&mut self) {
        self.0.pending.lock().closed = true;
        self.0.notify.notify_one();
    }
}

impl ChangeReceiver {
    /// The changes published since the last call, once there are any; `None` once
    /// the source is gone and everything it published was taken.
    pub async fn next(&mut self) -> Option<Changes> {
        loop {
            // Registered before looking, so a publish in between is not missed.
            let notified = self.0.notify.notified();
            {
                let mut pending = self.0.pending.lock();
                if pending.published {
                    pending.published = false;
                    return Some(std::mem::take(&mut pending.changes));
                }
                if pending.closed {
                    return None;
                }
            }
            notified.await;
        }
    }
}

impl Drop for ChangeReceiver {
    fn drop(&mut self) {
        self.0.pending.lock().receiver_gone = true;
        self.0.receiver_gone.notify_waiters();
    }
}

/// The objects a consumer holds after applying every change it took: for tests and
/// tools that want a source's state rather than its changes.
#[derive(Clone, Debug, Default)]
pub struct ObjectView {
    pub services: std::collections::BTreeMap<ObjectKey, Arc<Service>>,
    pub slices: std::collections::BTreeMap<ObjectKey, Arc<EndpointSlice>>,
    pub policies: std::collections::BTreeMap<ObjectKey, Arc<NetworkPolicy>>,
    pub pods: std::collections::BTreeMap<ObjectKey, Arc<PolicyPod>>,
    pub namespaces: std::collections::BTreeMap<ObjectKey, Arc<PolicyNamespace>>,
    pub nodes: Vec<Arc<Node>>,
    pub errors: Vec<ObjectError>,
    pub unreadable: Vec<FileError>,
}

impl ObjectView {
    pub fn apply(&mut self, changes: &Changes) {
        fn apply<T>(
            held: &mut std::collections::BTreeMap<ObjectKey, Arc<T>>,
            changes: &HashMap<ObjectKey, Change<T>>,
        ) {
            for (key, change) in changes {
                match &change.current {
                    Some(current) => held.insert(key.clone(), current.clone()),
                    None => held.remove(key),
                };
            }
        }
        apply(&mut self.services, &changes.services);
        apply(&mut self.slices, &changes.slices);
        apply(&mut self.policies, &changes.policies);
        apply(&mut self.pods, &changes.pods);
        apply(&mut self.namespaces, &changes.namespaces);
        if let Some(nodes) = &changes.nodes {
            self.nodes = nodes.clone();
        }
        if let Some(errors) = &changes.errors {
            self.errors = errors.clone();
        }
        if let Some(unreadable) = &changes.unreadable {
            self.unreadable = unreadable.clone();
        }
    }

    /// Service names in key order.
    pub fn service_names(&self) -> Vec<String> {
        self.services.keys().map(|k| k.name().to_owned()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str) -> Arc<Service> {
        Arc::new(Service {
            metadata: Meta {
                namespace: Some(intern("default")),
                name: Some(name.into()),
                ..Meta::default()
            },
            ..Service::default()
        })
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new(None, name)
    }

    #[test]
    fn keys_compare_by_text() {
        let a = ObjectKey::new(Some(&intern("default")), "web");
        let b = key("web");
        assert_eq!(a, b);
        let hash = |k: &ObjectKey| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            k.hash(&mut h);
            h.finish()
        };
        assert_eq!(hash(&a), hash(&b));
        assert!(ObjectKey::new(Some(&intern("a")), "z") < ObjectKey::new(Some(&intern("b")), "a"));
        assert_eq!(a.to_string(), "default/web");
    }

    /// kube-proxy's tracker rules: the first previous stays, the last current
    /// wins, and a change undone before it was taken is no change.
    #[test]
    fn changes_of_one_object_merge_until_taken() {
        let (v1, v2, v3) = (svc("web"), svc("web"), svc("web"));
        let mut c = Changes::default();
        c.service(key("web"), Some(v1.clone()), Some(v2.clone()));
        c.service(key("web"), Some(v2.clone()), Some(v3.clone()));
        let change = &c.services[&key("web")];
        assert!(Arc::ptr_eq(change.previous.as_ref().unwrap(), &v1));
        assert!(Arc::ptr_eq(change.current.as_ref().unwrap(), &v3));
        c.service(key("web"), Some(v3), Some(v1.clone()));
        assert!(c.services.is_empty(), "back where it started");
        c.service(key("new"), None, Some(v2.clone()));
        c.service(key("new"), Some(v2), None);
        assert!(c.is_empty(), "added and deleted before it was taken");
    }

    /// A Namespace's key is its name alone: not the key of an object named like
    /// it in namespace `default`.
    #[test]
    fn cluster_scoped_keys_are_their_own() {
        let namespace = ObjectKey::cluster("default");
        assert_ne!(namespace, key("default"));
        assert_eq!(namespace, ObjectKey::cluster("default"));
        assert_eq!(namespace.to_string(), "default");
        assert_eq!(key("default").to_string(), "default/default");
    }

    /// Policy's kinds are compared by content too: a pod decoded again the same
    /// (a new allocation) is no change, and one changed and changed back before
    /// it was taken is none either.
    #[test]
    fn policy_kinds_merge_by_content() {
        use crate::model::policy::Labels;
        let pod = |app: &str| {
            Arc::new(PolicyPod {
                namespace: intern("x"),
                name: intern("a"),
                ips: vec!["10.244.1.11".parse().unwrap()],
                labels: Labels::new([("app", app)]),
                named_ports: Arc::new([]),
                host_network: false,
                node_name: intern("node-1"),
            })
        };
        let a = ObjectKey::new(Some(&intern("x")), "a");
        let mut c = Changes::default();
        c.pod(a.clone(), Some(pod("a")), Some(pod("a")));
        assert!(c.is_empty(), "decoded again the same");
        let seen = pod("a");
        c.pod(a.clone(), Some(seen.clone()), Some(pod("b")));
        assert_eq!(c.pods.len(), 1);
        c.pod(a.clone(), Some(pod("b")), Some(pod("a")));
        assert!(c.is_empty(), "changed back");
        // Services are told apart by allocation only (see `identical`).
        c.service(key("web"), Some(svc("web")), Some(svc("web")));
        assert_eq!(c.services.len(), 1);
        // Namespaces merge under their own key.
        let ns = |team: &str| Arc::new(PolicyNamespace::new("x", Labels::new([("team", team)])));
        c.namespace(ObjectKey::cluster("x"), None, Some(ns("a")));
        c.namespace(ObjectKey::cluster("x"), Some(ns("a")), None);
        assert!(c.namespaces.is_empty(), "added and deleted before taken");
    }

    #[tokio::test]
    async fn published_changes_are_taken_once_and_the_end_is_seen() {
        let (tx, mut rx) = channel();
        let mut c = Changes::default();
        c.service(key("a"), None, Some(svc("a")));
        tx.record(c);
        let mut c = Changes::default();
        c.service(key("b"), None, Some(svc("b")));
        tx.record(c);
        tx.publish();
        let taken = rx.next().await.unwrap();
        assert_eq!(taken.services.len(), 2);
        // Recorded but not yet published: not handed on.
        let mut c = Changes::default();
        c.service(key("c"), None, Some(svc("c")));
        tx.record(c);
        use futures::FutureExt;
        assert!(rx.next().now_or_never().is_none(), "nothing published");
        tx.publish();
        drop(tx);
        assert_eq!(rx.next().await.unwrap().services.len(), 1);
        assert!(rx.next().await.is_none());
    }
}
