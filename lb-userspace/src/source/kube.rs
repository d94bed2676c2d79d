//! Following the Kubernetes API server: Services, EndpointSlices and Nodes are kept
//! in caches ([`Store`]) filled by kube-runtime watchers, and every change is handed
//! on keyed by the object's namespace and name, with what it replaced (see
//! [`super::changes`]), as the file source hands on its own.
//!
//! The caches are filled by list+watch with kube-proxy's label selectors. A watch
//! that ends is resumed from the last resourceVersion; one answered with `410 Gone`
//! is replaced by a fresh list, whose result replaces the cache at once. Failed
//! requests are retried with a bounded backoff (0.1 s doubling to 1 s, jittered, see
//! [`RecoveryBackoff`]) while the caches, and so what was handed on, stay as they
//! were: an API server outage freezes the service table instead of emptying
//! it, and a change made during the outage is seen within about a second of the
//! server answering again.
//!
//! A change is handed on at once when changes are rare; only while they follow
//! each other closely are they coalesced, for a wait that doubles with each busy
//! hand-on up to [`KubeWatchOptions::coalesce_max`] (see [`Coalescer`]).

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, BoxStream};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::Api;
use kube::config::{Config, InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::time::{Instant, Sleep};
use tracing::{debug, info, warn};

use super::changes::{ChangeReceiver, ChangeSender, Changes, ObjectKey};
use super::labels::{SERVICE_LABEL_SELECTOR, SLICE_LABEL_SELECTOR};
use super::lean::{trim_node, trim_pod, EndpointSlice, Meta, Service, Wire};
use super::store::{Cached, Replaced, Store};
use crate::model::policy::{NetworkPolicy as PolicyModel, PolicyNamespace, PolicyPod};

/// How the API server is followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeWatchOptions {
    /// Longest a change waits to be published while changes keep coming (a burst);
    /// a change after a quiet spell is published at once.
    pub coalesce_max: Duration,
    /// Objects per list request (`limit`); `None` lists everything in one response.
    pub page_size: Option<u32>,
    /// Only this Node is cached (`fieldSelector=metadata.name=NAME`, as kube-proxy
    /// does); `None` caches every Node.
    pub node_name: Option<String>,
    /// Follow what NetworkPolicy reads: NetworkPolicies, Pods and Namespaces
    /// (`--network-policy on`).
    pub network_policy: bool,
}

impl Default for KubeWatchOptions {
    fn default() -> Self {
        KubeWatchOptions {
            coalesce_max: Duration::from_millis(100),
            page_size: Some(500),
            node_name: None,
            network_policy: false,
        }
    }
}

/// No API server could be configured.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error(
        "cannot read kubeconfig {}: {source}; pass the path of a readable kubeconfig file, \
         or leave it out to use the in-cluster service account",
        path.display()
    )]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "kubeconfig {}: {source}; check its current-context and that context's cluster \
         and user (`kubectl --kubeconfig {} config view`)",
        path.display(),
        path.display()
    )]
    BadKubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no Kubernetes API server configured: not in a cluster ({in_cluster}), and the \
         default kubeconfig {location} is not usable ({kubeconfig}); pass a kubeconfig \
         path, set KUBECONFIG, or run the agent in a pod with a service account"
    )]
    NoConfig {
        in_cluster: InClusterError,
        location: String,
        #[source]
        kubeconfig: KubeconfigError,
    },
    #[error(
        "cannot set up a client for the API server {url} (from {origin}): {source}; check \
         the certificate authority and client credentials it names"
    )]
    Client {
        url: String,
        origin: String,
        #[source]
        source: kube::Error,
    },
}

/// A client for the API server: from `kubeconfig` when given (its current context),
/// else from the pod's service account when running in a cluster, else from the
/// default kubeconfig (`KUBECONFIG`, or `~/.kube/config`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, KubeSourceError> {
    let (config, origin) = match kubeconfig {
        Some(path) => {
            let file =
                Kubeconfig::read_from(path).map_err(|source| KubeSourceError::ReadKubeconfig {
                    path: path.to_owned(),
                    source,
                })?;
            let config = Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|source| KubeSourceError::BadKubeconfig {
                    path: path.to_owned(),
                    source,
                })?;
            (config, format!("kubeconfig {}", path.display()))
        }
        None => match Config::incluster() {
            Ok(config) => (config, "the in-cluster service account".to_owned()),
            Err(in_cluster) => {
                let location = default_kubeconfig_location();
                match Config::from_kubeconfig(&KubeConfigOptions::default()).await {
                    Ok(config) => (config, format!("kubeconfig {location}")),
                    Err(kubeconfig) => {
                        return Err(KubeSourceError::NoConfig {
                            in_cluster,
                            location,
                            kubeconfig,
                        })
                    }
                }
            }
        },
    };
    let url = config.cluster_url.to_string();
    info!(api_server = %url, from = %origin, "Kubernetes API client configured");
    Client::try_from(config).map_err(|source| KubeSourceError::Client {
        url,
        origin,
        source,
    })
}

/// Where kube looks for a kubeconfig when none is given, for error messages.
fn default_kubeconfig_location() -> String {
    match std::env::var_os("KUBECONFIG") {
        Some(v) if !v.is_empty() => format!("KUBECONFIG={}", v.to_string_lossy()),
        _ => "~/.kube/config".to_owned(),
    }
}

/// Spawns the watchers. Nothing is handed on until Services, EndpointSlices and
/// Nodes have each been listed once; then everything is, and after that each change
/// (coalesced only under bursts, see [`Coalescer`]). A relist hands on only what it
/// found changed. Objects hold only what the agent reads (see [`super::lean`]).
/// Call it inside a Tokio runtime; the tasks stop when the receiver is dropped.
pub fn watch(client: Client, options: KubeWatchOptions) -> ChangeReceiver {
    let (tx, rx) = super::changes::channel();
    let paged = watcher::Config {
        page_size: options.page_size,
        ..watcher::Config::default()
    };
    let list = |selector: &str| paged.clone().labels(selector);
    let mut node_config = paged.clone();
    if let Some(name) = &options.node_name {
        node_config = node_config.fields(&format!("metadata.name={name}"));
    }
    let mut watched = vec![
        events(
            Api::<Wire<Service>>::all(client.clone()),
            list(SERVICE_LABEL_SELECTOR),
        ),
        events(
            Api::<Wire<EndpointSlice>>::all(client.clone()),
            list(SLICE_LABEL_SELECTOR),
        ),
        events(Api::<Node>::all(client.clone()), node_config),
    ];
    if options.network_policy {
        watched.push(events(Api::<Pod>::all(client.clone()), paged.clone()));
        watched.push(events(Api::<Namespace>::all(client.clone()), paged.clone()));
        watched.push(events(Api::<NetworkPolicy>::all(client), paged.clone()));
    }
    let events = stream::select_all(watched);
    tokio::spawn(follow(
        events,
        tx,
        options.coalesce_max,
        options.network_policy,
    ));
    rx
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Services,
    EndpointSlices,
    Nodes,
    Pods,
    Namespaces,
    NetworkPolicies,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Services,
        Kind::EndpointSlices,
        Kind::Nodes,
        Kind::Pods,
        Kind::Namespaces,
        Kind::NetworkPolicies,
    ];

    /// Followed only with `--network-policy on`.
    fn for_policy(self) -> bool {
        matches!(self, Kind::Pods | Kind::Namespaces | Kind::NetworkPolicies)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One watcher event, of any kind.
enum Update {
    // Boxed: the three differ in size by up to 4x (a Node is 1.5 KiB on the stack).
    Service(Box<watcher::Event<Service>>),
    Slice(Box<watcher::Event<EndpointSlice>>),
    Node(Box<watcher::Event<Node>>),
    Pod(Box<watcher::Event<Pod>>),
    Namespace(Box<watcher::Event<Namespace>>),
    Policy(Box<watcher::Event<NetworkPolicy>>),
}

impl Update {
    fn kind(&self) -> Kind {
        match self {
            Update::Service(_) => Kind::Services,
            Update::Slice(_) => Kind::EndpointSlices,
            Update::Node(_) => Kind::Nodes,
            Update::Pod(_) => Kind::Pods,
            Update::Namespace(_) => Kind::Namespaces,
            Update::Policy(_) => Kind::NetworkPolicies,
        }
    }
}

type Events = BoxStream<'static, Result<Update, (Kind, watcher::Error)>>;

/// A watcher for one kind, retried with backoff.
fn events<K>(api: Api<K>, config: watcher::Config) -> Events
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: Watched + 'static,
{
    watcher(api, config)
        .backoff(RecoveryBackoff::default())
        .map(|event| event.map(K::update).map_err(|e| (K::KIND, e)))
        .boxed()
}

/// The kinds followed: which cache each one's events go to.
trait Watched: Sized {
    const KIND: Kind;
    fn update(event: watcher::Event<Self>) -> Update;
}

/// The object a watcher event carries, without its wire form's `ObjectMeta`.
fn unwrap<T>(event: watcher::Event<Wire<T>>) -> watcher::Event<T> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(o.into_inner()),
        watcher::Event::Delete(o) => watcher::Event::Delete(o.into_inner()),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(o.into_inner()),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

impl Watched for Wire<Service> {
    const KIND: Kind = Kind::Services;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Service(Box::new(unwrap(event)))
    }
}

impl Watched for Wire<EndpointSlice> {
    const KIND: Kind = Kind::EndpointSlices;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Slice(Box::new(unwrap(event)))
    }
}

/// Nodes come whole (k8s-openapi's type) and are trimmed as they arrive; Services
/// and slices are decoded lean.
impl Watched for Node {
    const KIND: Kind = Kind::Nodes;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Node(Box::new(event.modify(trim_node)))
    }
}

/// Pods come trimmed to what NetworkPolicy reads.
impl Watched for Pod {
    const KIND: Kind = Kind::Pods;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Pod(Box::new(event.modify(trim_pod)))
    }
}

impl Watched for Namespace {
    const KIND: Kind = Kind::Namespaces;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Namespace(Box::new(event.modify(|ns| {
            ns.metadata.managed_fields = None;
            ns.metadata.annotations = None;
            ns.spec = None;
            ns.status = None;
        })))
    }
}

impl Watched for NetworkPolicy {
    const KIND: Kind = Kind::NetworkPolicies;
    fn update(event: watcher::Event<Self>) -> Update {
        Update::Policy(Box::new(event.modify(|p| {
            p.metadata.managed_fields = None;
            p.metadata.annotations = None;
        })))
    }
}

/// Retry delays of a failed list or watch: 0.1 s doubling to at most 1 s, each
/// jittered down by up to half. client-go's 30 s cap made a change made during a
/// 20 s outage wait a minute after the server was back; with a 1 s cap it waits at
/// most a second, for one request per watcher and second while the server is down
/// (three per node, spread by the jitter).
#[derive(Debug)]
pub struct RecoveryBackoff {
    next: Duration,
    /// xorshift state for the jitter (no cryptographic quality needed).
    seed: u64,
}

impl RecoveryBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(1);
}

impl Default for RecoveryBackoff {
    fn default() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64)
            | 1;
        Self {
            next: Self::FIRST,
            seed,
        }
    }
}

impl Iterator for RecoveryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let base = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        // Down by up to half of the delay: in [base/2, base].
        let jitter = base.as_micros() as u64 / 2;
        let cut = if jitter == 0 { 0 } else { self.seed % jitter };
        Some(base - Duration::from_micros(cut))
    }
}

impl kube::runtime::utils::Backoff for RecoveryBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// When to publish: at once, unless changes come in a burst (each within
/// [`Self::BURST_GAP`] of the one before, as when a Deployment's pods all move),
/// during which, once [`Self::BURST_MIN`] close changes followed its first, the wait grows
/// from `BURST_GAP`, doubling with each change, bounded by `max`. A steady churn of
/// a few hundred changes a second is not a burst: each of its changes is handed on
/// at once (it costs its own objects). Nor is the handful that queued while this
/// task could not run: they are read back to back, as a burst's are, and with a
/// wait from the second on, a hiccup of a few ms under a 50/s churn grew into
/// waits of 40-100 ms (the bench at 100k Services). Changes the agent has not taken
/// yet merge with the next ones, so a slow sync coalesces further on its own.
#[derive(Debug)]
struct Coalescer {
    max: Duration,
    last_change: Option<Instant>,
    last_publish: Option<Instant>,
    /// Changes of the current burst after its first.
    burst: u32,
}

impl Coalescer {
    const BURST_GAP: Duration = Duration::from_millis(2);
    /// Close changes published at once before a burst makes them wait.
    const BURST_MIN: u32 = 8;

    fn new(max: Duration) -> Self {
        Self {
            max,
            last_change: None,
            last_publish: None,
            burst: 0,
        }
    }

    /// A change arrived at `now`.
    fn changed(&mut self, now: Instant) {
        let close = self
            .last_change
            .is_some_and(|last| now.duration_since(last) < Self::BURST_GAP);
        self.burst = if close {
            self.burst.saturating_add(1)
        } else {
            0
        };
        self.last_change = Some(now);
    }

    /// When the changes pending since `now` are to be published.
    fn due(&self, now: Instant) -> Instant {
        match (self.burst, self.last_publish) {
            (n, Some(last)) if n >= Self::BURST_MIN => {
                let wait = Self::BURST_GAP
                    .saturating_mul(1 << (n - Self::BURST_MIN).min(16))
                    .min(self.max);
                (last + wait).max(now)
            }
            _ => now,
        }
    }

    fn published(&mut self, at: Instant) {
        self.last_publish = Some(at);
    }
}

/// When the changes held are to be published.
enum Due {
    /// Nothing is held.
    Never,
    /// As soon as the events already queued are in the cache.
    Now,
    At(Pin<Box<Sleep>>),
}

impl Due {
    async fn elapsed(&mut self) {
        match self {
            Due::Never => std::future::pending().await,
            Due::Now => {}
            Due::At(sleep) => sleep.await,
        }
    }
}

/// What a watcher event did to its cache.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Nothing visible yet (a relist started or is under way), or nothing new.
    Nothing,
    /// Objects were added, changed or deleted.
    Changed,
    /// A (re)list finished and replaced the cache.
    Listed,
}

/// Applies `event` to `store`; what it replaced goes to `changed`.
fn apply<K: Cached>(
    store: &mut Store<K>,
    event: watcher::Event<K>,
    changed: &mut Vec<Replaced<K>>,
) -> Step {
    let mut one = |replaced: Option<Replaced<K>>| match replaced {
        Some(r) => {
            changed.push(r);
            Step::Changed
        }
        None => Step::Nothing,
    };
    match event {
        watcher::Event::Apply(object) => one(store.apply(object)),
        watcher::Event::Delete(object) => one(store.delete(&object)),
        watcher::Event::Init => {
            store.relist_begin();
            Step::Nothing
        }
        watcher::Event::InitApply(object) => {
            store.relist_item(object);
            Step::Nothing
        }
        watcher::Event::InitDone => {
            changed.extend(store.relist_done());
            Step::Listed
        }
    }
}

#[derive(Default)]
struct Caches {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    policies: Store<NetworkPolicy>,
    /// What NetworkPolicy reads of them, decoded once per change of an object.
    decoded: DecodedPolicy,
}

/// The policy kinds' objects as decoded and handed on, by key: the `previous` side
/// of each change, so the consumer keeps no copy of its own to find what changed.
/// A malformed object is reported and left out (to the consumer, it is gone).
#[derive(Default)]
struct DecodedPolicy {
    pods: foldhash::HashMap<ObjectKey, Arc<PolicyPod>>,
    namespaces: foldhash::HashMap<ObjectKey, Arc<PolicyNamespace>>,
    policies: foldhash::HashMap<ObjectKey, Arc<PolicyModel>>,
}

/// A namespaced object's key by its metadata, as [`ObjectKey::of`] keys the lean
/// kinds.
fn namespaced_key(meta: &kube::api::ObjectMeta) -> ObjectKey {
    let namespace = meta.namespace.as_deref().map(super::intern::intern);
    ObjectKey::new(namespace.as_ref(), meta.name.as_deref().unwrap_or_default())
}

/// A Namespace's key: it is cluster-scoped (see [`ObjectKey::cluster`]).
fn namespace_key(meta: &kube::api::ObjectMeta) -> ObjectKey {
    ObjectKey::cluster(meta.name.as_deref().unwrap_or_default())
}

/// Keeps `decoded` equal to the changed objects' decoding, and hands each on to
/// `record` as `previous -> current` of the decoded value.
fn decode_changed<K: kube::Resource, D: PartialEq>(
    changed: Vec<Replaced<K>>,
    decoded: &mut foldhash::HashMap<ObjectKey, Arc<D>>,
    key_of: fn(&kube::api::ObjectMeta) -> ObjectKey,
    decode: impl Fn(&K) -> Result<D, Box<super::ObjectError>>,
    mut record: impl FnMut(ObjectKey, Option<Arc<D>>, Option<Arc<D>>),
) {
    for (previous, current) in changed {
        let object = current
            .as_ref()
            .or(previous.as_ref())
            .expect("a change has one side");
        let key = key_of(object.meta());
        let handed_on = decoded.get(&key).cloned();
        let now = match current.as_deref().map(&decode) {
            // Decoded the same (a Pod's status moved, not what policy reads): the
            // value handed on stays, one allocation for the source and the
            // compiler, and the change cancels out.
            Some(Ok(d)) if handed_on.as_deref() == Some(&d) => handed_on.clone(),
            Some(Ok(d)) => Some(Arc::new(d)),
            Some(Err(e)) => {
                warn!("skipped: {e}");
                None
            }
            None => None,
        };
        match &now {
            Some(d) => decoded.insert(key.clone(), d.clone()),
            None => decoded.remove(&key),
        };
        record(key, handed_on, now);
    }
}

impl Caches {
    /// Applies a watcher event; its changes go to `changes` when `handing_on`
    /// (every cache listed once), else they stay in the cache only.
    fn apply(&mut self, update: Update, changes: &mut Changes, handing_on: bool) -> Step {
        match update {
            Update::Service(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.services, *event, &mut changed);
                if handing_on {
                    for (previous, current) in changed {
                        let key = key_of(&previous, &current, |s| &s.metadata);
                        changes.service(key, previous, current);
                    }
                }
                step
            }
            Update::Slice(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.slices, *event, &mut changed);
                if handing_on {
                    for (previous, current) in changed {
                        let key = key_of(&previous, &current, |s| &s.metadata);
                        changes.slice(key, previous, current);
                    }
                }
                step
            }
            Update::Node(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.nodes, *event, &mut changed);
                if handing_on && !changed.is_empty() {
                    changes.nodes = Some(self.all_nodes());
                }
                step
            }
            // The policy kinds are decoded as they change, handing on or not
            // (the first hand-on is what was decoded); each decoded change is
            // recorded once handing on.
            Update::Pod(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.pods, *event, &mut changed);
                let decoded = &mut self.decoded.pods;
                decode_changed(
                    changed,
                    decoded,
                    namespaced_key,
                    super::policy::pod,
                    |k, p, c| {
                        if handing_on {
                            changes.pod(k, p, c);
                        }
                    },
                );
                step
            }
            Update::Namespace(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.namespaces, *event, &mut changed);
                let decoded = &mut self.decoded.namespaces;
                decode_changed(
                    changed,
                    decoded,
                    namespace_key,
                    super::policy::namespace,
                    |k, p, c| {
                        if handing_on {
                            changes.namespace(k, p, c);
                        }
                    },
                );
                step
            }
            Update::Policy(event) => {
                let mut changed = Vec::new();
                let step = apply(&mut self.policies, *event, &mut changed);
                let decoded = &mut self.decoded.policies;
                decode_changed(
                    changed,
                    decoded,
                    namespaced_key,
                    super::policy::network_policy,
                    |k, p, c| {
                        if handing_on {
                            changes.policy(k, p, c);
                        }
                    },
                );
                step
            }
        }
    }

    /// Everything cached, as changes from nothing: the first hand-on.
    fn everything(&self) -> Changes {
        let mut changes = Changes::default();
        for service in self.services.all() {
            changes.service(
                ObjectKey::of(&service.metadata),
                None,
                Some(service.clone()),
            );
        }
        for slice in self.slices.all() {
            changes.slice(ObjectKey::of(&slice.metadata), None, Some(slice.clone()));
        }
        changes.nodes = Some(self.all_nodes());
        let decoded = &self.decoded;
        for (key, namespace) in &decoded.namespaces {
            changes.namespace(key.clone(), None, Some(namespace.clone()));
        }
        for (key, pod) in &decoded.pods {
            changes.pod(key.clone(), None, Some(pod.clone()));
        }
        for (key, policy) in &decoded.policies {
            changes.policy(key.clone(), None, Some(policy.clone()));
        }
        changes
    }

    fn all_nodes(&self) -> Vec<Arc<Node>> {
        let mut nodes: Vec<Arc<Node>> = self.nodes.all().cloned().collect();
        nodes.sort_by_cached_key(|n| n.name_any());
        nodes
    }
}

/// The key of a changed object, from whichever side of the change is there.
fn key_of<K>(
    previous: &Option<Arc<K>>,
    current: &Option<Arc<K>>,
    meta: fn(&K) -> &Meta,
) -> ObjectKey {
    let object = current
        .as_ref()
        .or(previous.as_ref())
        .expect("a change has one side");
    ObjectKey::of(meta(object))
}

/// Drives the watchers and hands changes on until the consumer is gone.
async fn follow(
    mut events: stream::SelectAll<Events>,
    tx: ChangeSender,
    coalesce_max: Duration,
    network_policy: bool,
) {
    let mut caches = Caches::default();
    // The kinds not followed count as listed.
    let mut listed = Kind::ALL.map(|kind| kind.for_policy() && !network_policy);
    let mut handing_on = false;
    let mut coalescer = Coalescer::new(coalesce_max);
    // Set while changes wait to be handed on: at once (`Now`), or at a time.
    // Handing on at once must not go through a timer: tokio's timers round a
    // deadline up to the next millisecond tick, which held every change for about
    // a millisecond more (the API source's change p50 sat 1 ms above the file
    // source's in the bench).
    let mut due = Due::Never;
    loop {
        tokio::select! {
            // Events already queued go into the cache before a hand-on that is due.
            biased;
            event = events.next() => {
                let Some(event) = event else { return };
                let arrived = std::time::Instant::now();
                let update = match event {
                    Ok(update) => update,
                    Err((kind, e)) => {
                        report(kind, &e);
                        continue;
                    }
                };
                let kind = update.kind();
                let mut changes = Changes::default();
                match caches.apply(update, &mut changes, handing_on) {
                    Step::Nothing => continue,
                    Step::Changed => {}
                    Step::Listed => {
                        if !listed[kind.index()] {
                            debug!(?kind, "initial list complete");
                        }
                        listed[kind.index()] = true;
                    }
                }
                if !handing_on {
                    // Nothing is handed on until every cache has listed once: the
                    // first hand-on is everything.
                    if !listed.iter().all(|&l| l) {
                        continue;
                    }
                    handing_on = true;
                    changes = caches.everything();
                    changes.since = Some(arrived);
                    tx.record(changes);
                    due = Due::Now;
                    continue;
                }
                if changes.is_empty() {
                    // A relist that found nothing new, or a new version that reads
                    // the same (a Pod's status moved, say).
                    debug!(?kind, "nothing that lb reads changed; nothing handed on");
                    continue;
                }
                changes.since = Some(arrived);
                tx.record(changes);
                let now = Instant::now();
                coalescer.changed(now);
                let at = coalescer.due(now);
                if at <= now {
                    due = Due::Now;
                } else if matches!(due, Due::Never) {
                    due = Due::At(Box::pin(tokio::time::sleep_until(at)));
                }
            }
            () = due.elapsed(), if !matches!(due, Due::Never) => {
                due = Due::Never;
                tx.publish();
                coalescer.published(Instant::now());
            }
            () = tx.closed() => return,
        }
    }
}

fn report(kind: Kind, error: &watcher::Error) {
    match error {
        watcher::Error::WatchError(status) if status.code == 410 => {
            info!(?kind, "watch expired (410 Gone); listing again");
        }
        _ => warn!(
            ?kind,
            "Kubernetes API: {error}; retrying with backoff, keeping the current service table"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_kubeconfig_names_the_path() {
        let path = Path::new("/nonexistent/lb-kubeconfig");
        let Err(err) = client(Some(path)).await else {
            panic!("a missing kubeconfig must be an error")
        };
        assert!(matches!(err, KubeSourceError::ReadKubeconfig { .. }));
        let text = err.to_string();
        assert!(text.contains("/nonexistent/lb-kubeconfig"), "{text}");
        assert!(
            text.contains("pass the path of a readable kubeconfig"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn kubeconfig_without_context_is_explained() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let path = dir.join("config");
        std::fs::write(&path, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        let Err(err) = client(Some(&path)).await else {
            panic!("a kubeconfig without contexts must be an error")
        };
        let text = err.to_string();
        assert!(
            matches!(err, KubeSourceError::BadKubeconfig { .. }),
            "{text}"
        );
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("current-context"), "{text}");

        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             contexts: [{name: c, context: {cluster: k, user: u}}]\n\
             clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n\
             users: [{name: u, user: {}}]\n",
        )
        .unwrap();
        let client = client(Some(&path)).await.unwrap();
        assert_eq!(client.default_namespace(), "default");
    }

    #[test]
    fn retries_are_bounded_and_jittered() {
        let delays: Vec<Duration> = RecoveryBackoff::default().take(12).collect();
        assert!(
            delays.iter().all(|d| *d <= RecoveryBackoff::MAX),
            "{delays:?}"
        );
        assert!(delays[0] >= RecoveryBackoff::FIRST / 2, "{delays:?}");
        // Past the doubling, every delay is in [0.5 s, 1 s].
        assert!(
            delays[5..].iter().all(|d| *d >= RecoveryBackoff::MAX / 2),
            "{delays:?}"
        );
        let mut backoff = RecoveryBackoff::default();
        backoff.by_ref().take(8).for_each(drop);
        kube::runtime::utils::Backoff::reset(&mut backoff);
        assert!(backoff.next().unwrap() <= RecoveryBackoff::FIRST);
    }

    #[test]
    fn changes_wait_only_during_bursts() {
        let max = Duration::from_millis(100);
        let ms = Duration::from_millis;
        let mut c = Coalescer::new(max);
        let t0 = Instant::now();
        // Quiet: at once.
        c.changed(t0);
        assert_eq!(c.due(t0), t0);
        c.published(t0);
        // A steady churn of 50 changes a second is not a burst.
        let mut now = t0;
        for _ in 0..10 {
            now += ms(20);
            c.changed(now);
            assert_eq!(c.due(now), now);
            c.published(now);
        }
        // A burst (changes 0.1 ms apart): its changes go at once until BURST_MIN
        // close ones followed the first (a few changes read back to back after a
        // hiccup are no burst), then the wait after the last publish doubles from
        // 2 ms with each change, bounded by max.
        let start = now;
        let mut waits = Vec::new();
        for _ in 0..20 {
            now += Duration::from_micros(100);
            c.changed(now);
            waits.push(c.due(now).saturating_duration_since(start));
        }
        let at_once = Coalescer::BURST_MIN as usize - 1;
        assert!(
            waits[..at_once]
                .iter()
                .enumerate()
                .all(|(i, w)| *w == Duration::from_micros(100 * (i as u64 + 1))),
            "{waits:?}"
        );
        assert_eq!(waits[at_once], ms(2));
        assert_eq!(waits[at_once + 1], ms(4));
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(*waits.last().unwrap(), max);
        // The first change after a gap is published at once again.
        now += ms(30);
        c.changed(now);
        assert_eq!(c.due(now), now);
    }

    #[test]
    fn selectors_are_kube_proxys() {
        assert_eq!(
            SLICE_LABEL_SELECTOR,
            "kubernetes.io/service-name,!service.kubernetes.io/service-proxy-name,\
             !service.kubernetes.io/headless"
        );
        assert!(SERVICE_LABEL_SELECTOR
            .split(',')
            .all(|r| SLICE_LABEL_SELECTOR.contains(r)));
    }
}

#[cfg(test)]
mod policy_tests {
    use k8s_openapi::api::core::v1::{PodIP, PodSpec, PodStatus};
    use k8s_openapi::api::networking::v1::NetworkPolicySpec;
    use kube::api::ObjectMeta;

    use super::*;

    fn meta(namespace: Option<&str>, name: &str, version: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: namespace.map(str::to_owned),
            name: Some(name.to_owned()),
            resource_version: Some(version.to_owned()),
            labels: Some([("app".to_owned(), name.to_owned())].into()),
            ..ObjectMeta::default()
        }
    }

    fn pod(name: &str, ip: &str, version: &str) -> Pod {
        Pod {
            metadata: meta(Some("x"), name, version),
            spec: Some(PodSpec {
                node_name: Some("node1".to_owned()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                pod_ip: Some(ip.to_owned()),
                pod_ips: Some(vec![PodIP { ip: ip.to_owned() }]),
                ..PodStatus::default()
            }),
        }
    }

    fn keys<T>(
        changes: &foldhash::HashMap<ObjectKey, crate::source::changes::Change<T>>,
    ) -> Vec<String> {
        let mut keys: Vec<String> = changes.keys().map(ToString::to_string).collect();
        keys.sort();
        keys
    }

    fn apply_pod(caches: &mut Caches, event: watcher::Event<Pod>) -> Changes {
        let mut changes = Changes::default();
        caches.apply(Pod::update(event), &mut changes, true);
        changes
    }

    /// Pods, Namespaces and NetworkPolicies from the API server reach the agent
    /// decoded, as keyed changes once every kind has listed: an unrelated pod's
    /// change hands on that pod alone, a delete hands on a delete, a malformed
    /// object is reported and left out (to the agent, gone), and a change that
    /// ends where it started, by what policy reads, hands on nothing.
    #[test]
    fn policy_kinds_are_decoded_and_handed_on_by_key() {
        let mut caches = Caches::default();
        let mut changes = Changes::default();
        // Before the lists are done nothing is handed on: the first hand-on is
        // everything decoded by then.
        let a = pod("a", "10.244.1.11", "1");
        caches.apply(
            Pod::update(watcher::Event::Apply(a.clone())),
            &mut changes,
            false,
        );
        let ns = Namespace {
            metadata: meta(None, "x", "1"),
            ..Namespace::default()
        };
        let deny = NetworkPolicy {
            metadata: meta(Some("x"), "deny", "1"),
            spec: Some(NetworkPolicySpec::default()),
        };
        caches.apply(
            Namespace::update(watcher::Event::Apply(ns.clone())),
            &mut changes,
            false,
        );
        caches.apply(
            NetworkPolicy::update(watcher::Event::Apply(deny)),
            &mut changes,
            false,
        );
        assert!(changes.is_empty(), "nothing recorded before handing on");
        let first = caches.everything();
        assert_eq!(keys(&first.pods), ["x/a"]);
        // A Namespace is cluster-scoped: keyed by its name alone.
        assert_eq!(keys(&first.namespaces), ["x"]);
        assert_eq!(keys(&first.policies), ["x/deny"]);
        let a_first = first.pods.values().next().unwrap().current.clone().unwrap();
        assert_eq!(&*a_first.name, "a");
        assert_eq!(
            a_first.ips,
            vec!["10.244.1.11".parse::<std::net::IpAddr>().unwrap()]
        );

        // Another pod comes: it alone is handed on.
        let changes = apply_pod(
            &mut caches,
            watcher::Event::Apply(pod("c", "10.244.1.13", "1")),
        );
        assert_eq!(keys(&changes.pods), ["x/c"]);
        assert!(changes.namespaces.is_empty() && changes.policies.is_empty());

        // A new version of a that policy reads the same (its status moved): no
        // change, and the value handed on before stays.
        let changes = apply_pod(
            &mut caches,
            watcher::Event::Apply(pod("a", "10.244.1.11", "2")),
        );
        assert!(changes.is_empty(), "{changes:?}");
        let key = ObjectKey::new(Some(&crate::source::intern::intern("x")), "a");
        assert!(Arc::ptr_eq(&caches.decoded.pods[&key], &a_first));

        // Relabelled: previous -> current; relabelled back before the change was
        // taken: it cancels out.
        let mut relabelled = pod("a", "10.244.1.11", "3");
        relabelled.metadata.labels = Some([("app".to_owned(), "other".to_owned())].into());
        let mut changes = apply_pod(&mut caches, watcher::Event::Apply(relabelled));
        let change = &changes.pods[&key];
        assert!(Arc::ptr_eq(change.previous.as_ref().unwrap(), &a_first));
        assert_eq!(
            change.current.as_ref().unwrap().labels.get("app"),
            Some("other")
        );
        caches.apply(
            Pod::update(watcher::Event::Apply(pod("a", "10.244.1.11", "4"))),
            &mut changes,
            true,
        );
        assert!(changes.is_empty(), "back where it started: {changes:?}");

        // A new pod whose address is no address is reported and left out: nothing
        // is handed on.
        let mut bad = pod("b", "not-an-ip", "1");
        bad.status.as_mut().unwrap().pod_ips = Some(vec![PodIP {
            ip: "not-an-ip".to_owned(),
        }]);
        assert!(apply_pod(&mut caches, watcher::Event::Apply(bad)).is_empty());
        // A known pod turned malformed is gone for the agent: a delete.
        let mut broken = pod("c", "not-an-ip", "2");
        broken.status.as_mut().unwrap().pod_ips = None;
        let changes = apply_pod(&mut caches, watcher::Event::Apply(broken));
        assert_eq!(keys(&changes.pods), ["x/c"]);
        let change = changes.pods.values().next().unwrap();
        assert!(change.previous.is_some() && change.current.is_none());

        // Deleted: a delete of that pod alone.
        let changes = apply_pod(&mut caches, watcher::Event::Delete(a));
        assert_eq!(keys(&changes.pods), ["x/a"]);
        let change = changes.pods.values().next().unwrap();
        assert_eq!(&*change.previous.as_ref().unwrap().name, "a");
        assert!(change.current.is_none());
        let mut changes = Changes::default();
        caches.apply(
            Namespace::update(watcher::Event::Delete(ns)),
            &mut changes,
            true,
        );
        assert_eq!(keys(&changes.namespaces), ["x"]);
        assert!(changes.namespaces.values().all(|c| c.current.is_none()));
    }
}
