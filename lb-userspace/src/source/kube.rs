//! Following the Kubernetes API server: Services, EndpointSlices and Nodes are kept
//! in kube-runtime reflector caches, and every change publishes a fresh [`Objects`]
//! snapshot on the same kind of channel as [`super::files::watch`].
//!
//! The caches are filled by list+watch with kube-proxy's label selectors. A watch
//! that ends is resumed from the last resourceVersion; one answered with `410 Gone`
//! is replaced by a fresh list, whose result replaces the cache at once. Failed
//! requests are retried with client-go's backoff (0.8 s doubling to 30 s, jittered)
//! while the caches, and so the last published snapshot, stay as they were: an API
//! server outage freezes the service table instead of emptying it.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, BoxStream};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::config::{Config, InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tracing::{debug, info, warn};

use super::yaml::Objects;

/// kube-proxy's selector for Services: those claimed by another proxy
/// (`service.kubernetes.io/service-proxy-name`) and headless ones are not proxied.
pub const SERVICE_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// EndpointSlices that belong to a Service (`kubernetes.io/service-name`), with
/// kube-proxy's selector on top: the EndpointSlice controller copies the Service's
/// labels onto its slices and marks those of headless Services.
pub const SLICE_LABEL_SELECTOR: &str = "kubernetes.io/service-name,\
     !service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// How the API server is followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeWatchOptions {
    /// Changes arriving within this long of the first unpublished one are published
    /// together as one snapshot.
    pub debounce: Duration,
    /// Objects per list request (`limit`); `None` lists everything in one response.
    pub page_size: Option<u32>,
    /// Only this Node is cached (`fieldSelector=metadata.name=NAME`, as kube-proxy
    /// does); `None` caches every Node.
    pub node_name: Option<String>,
}

impl Default for KubeWatchOptions {
    fn default() -> Self {
        KubeWatchOptions {
            debounce: Duration::from_millis(100),
            page_size: Some(500),
            node_name: None,
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

/// Spawns the watchers. The receiver holds `None` until Services, EndpointSlices and
/// Nodes have each been listed once; after that, changes publish a fresh snapshot,
/// at most one per [`KubeWatchOptions::debounce`]. A relist that finds nothing new
/// publishes nothing. Objects come sorted by namespace and name, with
/// `metadata.managedFields` dropped; `errors` stays empty. Call it inside a Tokio
/// runtime; the tasks stop when the receiver is dropped.
pub fn watch(client: Client, options: KubeWatchOptions) -> watch::Receiver<Option<Arc<Objects>>> {
    let (tx, rx) = watch::channel(None);
    let paged = watcher::Config {
        page_size: options.page_size,
        ..watcher::Config::default()
    };
    let list = |selector: &str| paged.clone().labels(selector);
    let mut node_config = paged.clone();
    if let Some(name) = &options.node_name {
        node_config = node_config.fields(&format!("metadata.name={name}"));
    }

    let (services, services_writer) = reflector::store();
    let (slices, slices_writer) = reflector::store();
    let (nodes, nodes_writer) = reflector::store();
    let events = stream::select_all([
        cache(
            Kind::Services,
            Api::<Service>::all(client.clone()),
            list(SERVICE_LABEL_SELECTOR),
            services_writer,
        ),
        cache(
            Kind::EndpointSlices,
            Api::<EndpointSlice>::all(client.clone()),
            list(SLICE_LABEL_SELECTOR),
            slices_writer,
        ),
        cache(
            Kind::Nodes,
            Api::<Node>::all(client),
            node_config,
            nodes_writer,
        ),
    ]);
    let caches = Caches {
        services,
        slices,
        nodes,
    };
    tokio::spawn(follow(events, caches, tx, options.debounce));
    rx
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Services,
    EndpointSlices,
    Nodes,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Services, Kind::EndpointSlices, Kind::Nodes];

    fn index(self) -> usize {
        self as usize
    }
}

/// What a watcher event did to its cache.
#[derive(Debug)]
enum Step {
    /// Nothing visible yet (a relist started or is under way).
    Nothing,
    /// An object was added, changed or deleted.
    Changed,
    /// A (re)list finished and replaced the cache.
    Listed,
}

type Events = BoxStream<'static, (Kind, Result<Step, watcher::Error>)>;

/// A watcher for one kind whose events keep `writer`'s store up to date, retried with
/// backoff; it yields what each event did, the objects themselves stay in the store.
fn cache<K>(
    kind: Kind,
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
) -> Events
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    watcher(api, config)
        .modify(|object: &mut K| object.meta_mut().managed_fields = None)
        .default_backoff()
        .reflect(writer)
        .map(move |event| {
            let step = event.map(|event| match event {
                watcher::Event::Apply(_) | watcher::Event::Delete(_) => Step::Changed,
                watcher::Event::InitDone => Step::Listed,
                watcher::Event::Init | watcher::Event::InitApply(_) => Step::Nothing,
            });
            (kind, step)
        })
        .boxed()
}

struct Caches {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
}

/// Identifies the cached state: every object's identity and resourceVersion.
type Fingerprint = Vec<(Kind, String, String, String)>;

impl Caches {
    fn fingerprint(&self) -> Fingerprint {
        fn add<K: Resource + Clone>(kind: Kind, store: &Store<K>, out: &mut Fingerprint)
        where
            K::DynamicType: Eq + std::hash::Hash + Clone,
        {
            out.extend(store.state().iter().map(|o| {
                let meta = o.meta();
                (
                    kind,
                    meta.namespace.clone().unwrap_or_default(),
                    meta.name.clone().unwrap_or_default(),
                    meta.resource_version.clone().unwrap_or_default(),
                )
            }));
        }
        let mut out = Vec::new();
        add(Kind::Services, &self.services, &mut out);
        add(Kind::EndpointSlices, &self.slices, &mut out);
        add(Kind::Nodes, &self.nodes, &mut out);
        out.sort_by(|a, b| (a.0.index(), &a.1, &a.2).cmp(&(b.0.index(), &b.1, &b.2)));
        out
    }

    fn snapshot(&self) -> Objects {
        Objects {
            services: sorted(&self.services),
            slices: sorted(&self.slices),
            nodes: sorted(&self.nodes),
            ..Objects::default()
        }
    }
}

fn sorted<K>(store: &Store<K>) -> Vec<Arc<K>>
where
    K: Resource + Clone,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let mut objects: Vec<Arc<K>> = store.state();
    objects.sort_by_cached_key(|o| (o.namespace(), o.name_any()));
    objects
}

/// Drives the watchers and publishes snapshots until the receiver is gone.
async fn follow(
    mut events: stream::SelectAll<Events>,
    caches: Caches,
    tx: watch::Sender<Option<Arc<Objects>>>,
    debounce: Duration,
) {
    let mut listed = [false; Kind::ALL.len()];
    let mut published: Option<Fingerprint> = None;
    // Set while changes wait to be published.
    let mut due: Option<Pin<Box<Sleep>>> = None;
    loop {
        let ready = listed.iter().all(|&l| l);
        tokio::select! {
            event = events.next() => {
                let Some((kind, step)) = event else { return };
                match step {
                    Ok(Step::Nothing) => continue,
                    Ok(Step::Changed) => {}
                    Ok(Step::Listed) => {
                        if !listed[kind.index()] {
                            debug!(?kind, "initial list complete");
                        }
                        listed[kind.index()] = true;
                    }
                    Err(e) => {
                        report(kind, &e);
                        continue;
                    }
                }
                if due.is_none() {
                    due = Some(Box::pin(tokio::time::sleep_until(Instant::now() + debounce)));
                }
            }
            () = async { due.as_mut().expect("guarded").await }, if ready && due.is_some() => {
                due = None;
                let fingerprint = caches.fingerprint();
                if published.as_ref() == Some(&fingerprint) {
                    debug!("no change after relist; nothing published");
                    continue;
                }
                published = Some(fingerprint);
                if tx.send(Some(Arc::new(caches.snapshot()))).is_err() {
                    return;
                }
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
        let dir = std::env::temp_dir().join(format!("lb-kubeconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
        std::fs::remove_dir_all(&dir).unwrap();
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
