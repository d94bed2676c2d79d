//! The API-server source (`source::kube::watch`) with the real kube client over real
//! HTTP, against the fake API server (`lb-fake-apiserver`).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lb_fake_apiserver::{
    namespace, network_policy, node, pod, service, slice, slice_with_labels, Call, FakeApiServer,
    Res,
};
use lb_userspace::source::changes::{ChangeReceiver, ObjectView};
use lb_userspace::source::kube::{self as kube_source, KubeWatchOptions};
use tokio::time::timeout;

/// What a consumer holds after one hand-on, and the keys that hand-on changed.
#[derive(Debug)]
struct Objects {
    view: ObjectView,
    changed: Vec<String>,
}

impl std::ops::Deref for Objects {
    type Target = ObjectView;
    fn deref(&self) -> &ObjectView {
        &self.view
    }
}

/// The source's hand-ons, applied as the agent applies them.
struct Snapshots {
    rx: ChangeReceiver,
    view: ObjectView,
}

impl Snapshots {
    fn new(rx: ChangeReceiver) -> Self {
        Snapshots {
            rx,
            view: ObjectView::default(),
        }
    }

    /// The next hand-on, applied.
    async fn changed(&mut self) -> Option<Arc<Objects>> {
        let changes = self.rx.next().await?;
        self.view.apply(&changes);
        let mut changed: Vec<String> = changes
            .services
            .keys()
            .map(|k| format!("service {k}"))
            .chain(changes.slices.keys().map(|k| format!("slice {k}")))
            .collect();
        changed.sort();
        Some(Arc::new(Objects {
            view: self.view.clone(),
            changed,
        }))
    }

    /// Nothing handed on that was not taken yet.
    fn nothing_handed_on(&mut self) -> bool {
        self.rx.next().now_or_never().is_none()
    }

    /// What the consumer holds now.
    fn current(&self) -> Objects {
        Objects {
            view: self.view.clone(),
            changed: Vec::new(),
        }
    }
}

/// Upper bound for anything expected to happen; tests normally take far less.
const WAIT: Duration = Duration::from_secs(8);
/// Long enough for a snapshot to show up if one were coming (the debounce is 100 ms).
const QUIET: Duration = Duration::from_millis(400);

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const HEADLESS: &str = "service.kubernetes.io/headless";

/// Names in namespace/name order: the source publishes Services and slices in
/// shards, whose order is not the names'.
fn names<'a>(metas: impl IntoIterator<Item = &'a lb_userspace::source::lean::Meta>) -> Vec<String> {
    let mut names: Vec<String> = metas
        .into_iter()
        .map(|m| {
            let name = m.name.as_deref().unwrap_or_default();
            match &m.namespace {
                Some(ns) => format!("{ns}/{name}"),
                None => name.to_owned(),
            }
        })
        .collect();
    names.sort();
    names
}

fn services(o: &Objects) -> Vec<String> {
    names(o.services.values().map(|s| &s.metadata))
}

fn slices(o: &Objects) -> Vec<String> {
    names(o.slices.values().map(|s| &s.metadata))
}

fn nodes(o: &Objects) -> Vec<String> {
    let mut names: Vec<String> = o
        .nodes
        .iter()
        .map(|n| kube::ResourceExt::name_any(&**n))
        .collect();
    names.sort();
    names
}

/// The endpoint addresses of slice `name`, `None` when there is no such slice.
fn addresses(o: &Objects, name: &str) -> Option<Vec<String>> {
    let slice = o
        .slices
        .values()
        .find(|s| s.metadata.name.as_deref() == Some(name))?;
    Some(
        slice
            .endpoints
            .iter()
            .flatten()
            .flat_map(|e| e.address().map(|a| a.to_string()))
            .collect(),
    )
}

/// The next hand-on.
async fn next(rx: &mut Snapshots) -> Arc<Objects> {
    timeout(WAIT, rx.changed())
        .await
        .expect("a hand-on within the time limit")
        .expect("the source is running")
}

/// Snapshots up to and including the first that `pred` accepts.
async fn until(
    rx: &mut Snapshots,
    what: &str,
    pred: impl Fn(&Objects) -> bool,
) -> Vec<Arc<Objects>> {
    let mut seen = Vec::new();
    let result = timeout(WAIT, async {
        loop {
            let snapshot = rx.changed().await.expect("the source is running");
            let done = pred(&snapshot);
            seen.push(snapshot);
            if done {
                return;
            }
        }
    })
    .await;
    if result.is_err() {
        let last = seen.last().map(|o| (services(o), slices(o)));
        panic!("no snapshot with {what} within {WAIT:?}; last: {last:?}");
    }
    seen
}

/// Asserts that nothing is published for a while.
async fn quiet(rx: &mut Snapshots, why: &str) {
    if let Ok(o) = timeout(QUIET, rx.changed()).await {
        let o = o
            .as_deref()
            .map(|o| (services(o), slices(o), nodes(o), o.changed.clone()));
        panic!("unexpected hand-on ({why}): {o:?}");
    }
}

/// A Service `a` with slice `a-1` (10.0.0.1), and Node `node-1`.
fn seed(server: &FakeApiServer) {
    server.apply(Res::Services, service("a", "10.96.0.1", &[]));
    server.apply(Res::EndpointSlices, slice("a-1", "a", &["10.0.0.1"], &[]));
    server.apply(Res::Nodes, node("node-1"));
}

/// Starts the source and returns its first snapshot.
async fn started(server: &FakeApiServer, options: KubeWatchOptions) -> (Snapshots, Arc<Objects>) {
    let mut rx = Snapshots::new(kube_source::watch(server.client(), options));
    let first = next(&mut rx).await;
    for res in Res::PROXY {
        server.wait_watching(res, 1, WAIT).await;
    }
    (rx, first)
}

fn count(calls: &[Call], res: Res, watch: bool) -> usize {
    calls
        .iter()
        .filter(|c| c.res == res && c.watch == watch)
        .count()
}

#[tokio::test]
async fn nothing_is_published_until_every_initial_list_completes() {
    let server = FakeApiServer::start().await;
    for (name, ip) in [("c", "10.96.0.3"), ("a", "10.96.0.1"), ("b", "10.96.0.2")] {
        server.apply(Res::Services, service(name, ip, &[]));
    }
    server.apply(Res::EndpointSlices, slice("a-1", "a", &["10.0.0.1"], &[]));
    server.apply(Res::Nodes, node("node-1"));
    server.hold_lists(Res::Nodes, true);

    let options = KubeWatchOptions {
        page_size: Some(2),
        ..KubeWatchOptions::default()
    };
    let mut rx = Snapshots::new(kube_source::watch(server.client(), options));
    // Services and slices are fully listed once their watches start; Nodes are held.
    server
        .wait_call(WAIT, |c| c.res == Res::Services && c.watch)
        .await;
    server
        .wait_call(WAIT, |c| c.res == Res::EndpointSlices && c.watch)
        .await;
    server
        .wait_call(WAIT, |c| c.res == Res::Nodes && !c.watch)
        .await;
    assert!(rx.nothing_handed_on());
    quiet(&mut rx, "the Node list is still held").await;
    assert!(rx.nothing_handed_on());

    server.hold_lists(Res::Nodes, false);
    let first = next(&mut rx).await;
    assert_eq!(services(&first), ["default/a", "default/b", "default/c"]);
    assert_eq!(slices(&first), ["default/a-1"]);
    assert_eq!(addresses(&first, "a-1").unwrap(), ["10.0.0.1"]);
    assert_eq!(nodes(&first), ["node-1"]);
    assert!(first.errors.is_empty());
    assert!(
        first.nodes[0].metadata.managed_fields.is_none(),
        "managedFields are dropped"
    );

    // The three Services came in two pages.
    let lists = server.calls_of(Res::Services, false);
    assert_eq!(lists.len(), 2, "{lists:#?}");
    assert_eq!(lists[0].param("limit"), Some("2"));
    assert_eq!(lists[0].param("continue"), None);
    assert!(lists[1].param("continue").is_some(), "{lists:#?}");
    quiet(&mut rx, "nothing changed after the first snapshot").await;
}

#[tokio::test]
async fn changes_are_published_in_order_and_bursts_are_debounced() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (mut rx, first) = started(&server, KubeWatchOptions::default()).await;
    assert_eq!(services(&first), ["default/a"]);

    // ADDED
    server.apply(Res::Services, service("b", "10.96.0.2", &[]));
    server.apply(Res::EndpointSlices, slice("b-1", "b", &["10.0.1.1"], &[]));
    until(&mut rx, "Service b and slice b-1", |o| {
        services(o) == ["default/a", "default/b"] && addresses(o, "b-1").is_some()
    })
    .await;

    // MODIFIED
    server.apply(
        Res::EndpointSlices,
        slice("b-1", "b", &["10.0.1.1", "10.0.1.2"], &[]),
    );
    let seen = until(&mut rx, "two endpoints in b-1", |o| {
        addresses(o, "b-1").is_some_and(|a| a == ["10.0.1.1", "10.0.1.2"])
    })
    .await;
    assert_eq!(seen.len(), 1);

    // DELETED
    server.delete(Res::Services, "default", "b");
    let seen = until(&mut rx, "Service b gone", |o| services(o) == ["default/a"]).await;
    assert_eq!(seen.len(), 1);
    assert_eq!(slices(&seen[0]), ["default/a-1", "default/b-1"]);

    // A burst of 20 changes to one slice.
    for i in 1..=20 {
        let address = format!("10.0.2.{i}");
        server.apply(
            Res::EndpointSlices,
            slice("a-1", "a", &[address.as_str()], &[]),
        );
    }
    let seen = until(&mut rx, "the last change of the burst", |o| {
        addresses(o, "a-1").is_some_and(|a| a == ["10.0.2.20"])
    })
    .await;
    assert!(
        seen.len() <= 4,
        "20 changes made {} snapshots; expected them coalesced",
        seen.len()
    );
    // Ordered: intermediate snapshots only ever move forward through the burst.
    let steps: Vec<u32> = seen
        .iter()
        .map(|o| {
            let a = addresses(o, "a-1").unwrap();
            a[0].rsplit('.').next().unwrap().parse().unwrap()
        })
        .collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
    let last = seen.last().unwrap();
    assert_eq!(services(last), ["default/a"]);
    assert_eq!(slices(last), ["default/a-1", "default/b-1"]);
    quiet(&mut rx, "the burst is over").await;
}

#[tokio::test]
async fn watch_expired_410_relists_and_sees_changes_made_in_the_gap() {
    let server = FakeApiServer::start().await;
    seed(&server);
    server.apply(Res::EndpointSlices, slice("a-2", "a", &["10.0.0.2"], &[]));
    let (mut rx, first) = started(&server, KubeWatchOptions::default()).await;
    assert_eq!(slices(&first), ["default/a-1", "default/a-2"]);

    // The slice watch ends with 410 Gone; the client must list again. Hold that list
    // until the gap's changes are made, so no watch can have seen them.
    server.hold_lists(Res::EndpointSlices, true);
    server.expire_watches(Res::EndpointSlices);
    server
        .wait_calls(WAIT, |calls| count(calls, Res::EndpointSlices, false) == 2)
        .await;
    server.delete(Res::EndpointSlices, "default", "a-2");
    server.apply(Res::EndpointSlices, slice("a-3", "a", &["10.0.0.3"], &[]));
    quiet(&mut rx, "the relist is held; the last snapshot stays").await;
    assert_eq!(slices(&rx.current()), ["default/a-1", "default/a-2"]);

    server.hold_lists(Res::EndpointSlices, false);
    let seen = until(&mut rx, "a-2 gone and a-3 there", |o| {
        slices(o) == ["default/a-1", "default/a-3"]
    })
    .await;
    assert_eq!(seen.len(), 1, "the relist replaces the cache at once");
    assert_eq!(services(&seen[0]), ["default/a"]);
    assert_eq!(nodes(&seen[0]), ["node-1"]);
    assert_eq!(server.delivered(Res::EndpointSlices, "DELETED", "a-2"), 0);
    assert_eq!(server.delivered(Res::EndpointSlices, "ADDED", "a-3"), 0);
    // Only slices were listed again.
    let calls = server.calls();
    assert_eq!(count(&calls, Res::Services, false), 1);
    assert_eq!(count(&calls, Res::Nodes, false), 1);

    // Changes flow again on the new watch.
    server.wait_watching(Res::EndpointSlices, 1, WAIT).await;
    server.delete(Res::EndpointSlices, "default", "a-3");
    until(&mut rx, "a-3 deleted", |o| slices(o) == ["default/a-1"]).await;
}

#[tokio::test]
async fn resuming_from_a_compacted_version_gets_410_and_relists() {
    let server = FakeApiServer::start().await;
    seed(&server);
    server.apply(Res::EndpointSlices, slice("a-2", "a", &["10.0.0.2"], &[]));
    let (mut rx, _) = started(&server, KubeWatchOptions::default()).await;
    let listed_at = server.calls_of(Res::EndpointSlices, true)[0]
        .param("resourceVersion")
        .map(str::to_owned);

    // The watch ends as on a server-side timeout; the client resumes from its
    // resourceVersion, but meanwhile a-2 was deleted and history compacted.
    server.hold_watches(Res::EndpointSlices, true);
    server.drop_watches(Res::EndpointSlices, false);
    let calls = server
        .wait_calls(WAIT, |calls| count(calls, Res::EndpointSlices, true) == 2)
        .await;
    let resumed = calls
        .iter()
        .filter(|c| c.res == Res::EndpointSlices && c.watch)
        .nth(1)
        .unwrap();
    assert_eq!(resumed.param("resourceVersion"), listed_at.as_deref());
    server.delete(Res::EndpointSlices, "default", "a-2");
    server.compact(Res::EndpointSlices);
    server.hold_watches(Res::EndpointSlices, false);

    let seen = until(&mut rx, "a-2 gone", |o| slices(o) == ["default/a-1"]).await;
    assert_eq!(seen.len(), 1);
    assert_eq!(count(&server.calls(), Res::EndpointSlices, false), 2);
    assert_eq!(server.delivered(Res::EndpointSlices, "DELETED", "a-2"), 0);
}

#[tokio::test]
async fn a_broken_watch_connection_resumes_without_losing_changes() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (mut rx, _) = started(&server, KubeWatchOptions::default()).await;

    server.drop_watches(Res::Services, true);
    server.apply(Res::Services, service("b", "10.96.0.2", &[]));
    let seen = until(&mut rx, "Service b", |o| {
        services(o) == ["default/a", "default/b"]
    })
    .await;
    assert!(seen.iter().all(|o| slices(o) == ["default/a-1"]));

    // Resumed from the last resourceVersion, not listed again.
    let calls = server.calls();
    assert_eq!(count(&calls, Res::Services, false), 1);
    let watches = server.calls_of(Res::Services, true);
    assert_eq!(watches.len(), 2, "{watches:#?}");
    assert_eq!(
        watches[0].param("resourceVersion"),
        watches[1].param("resourceVersion")
    );
}

#[tokio::test]
async fn an_api_server_outage_keeps_the_last_snapshot() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (mut rx, first) = started(&server, KubeWatchOptions::default()).await;

    server.stop().await;
    assert!(
        tokio::net::TcpStream::connect(server.addr()).await.is_err(),
        "connections are refused"
    );
    // Written while no client can connect.
    server.apply(Res::Services, service("b", "10.96.0.2", &[]));
    // About a second of outage: nothing is published, the last snapshot stays.
    assert!(
        timeout(Duration::from_secs(1), rx.changed()).await.is_err(),
        "published during the outage"
    );
    assert_eq!(services(&rx.current()), services(&first));

    server.resume().await;
    let seen = until(&mut rx, "Service b after the outage", |o| {
        services(o) == ["default/a", "default/b"]
    })
    .await;
    for o in &seen {
        assert_eq!(slices(o), ["default/a-1"], "never an emptied snapshot");
        assert_eq!(nodes(o), ["node-1"]);
    }
    // Changes flow again.
    server.wait_watching(Res::EndpointSlices, 1, WAIT).await;
    server.apply(Res::EndpointSlices, slice("a-1", "a", &["10.0.0.9"], &[]));
    until(&mut rx, "the new endpoint", |o| {
        addresses(o, "a-1").is_some_and(|a| a == ["10.0.0.9"])
    })
    .await;
}

#[tokio::test]
async fn requests_use_kube_proxys_label_selectors() {
    let server = FakeApiServer::start().await;
    server.apply(Res::Services, service("a", "10.96.0.1", &[]));
    let other = [(PROXY_NAME, "other-proxy")];
    server.apply(Res::Services, service("other", "10.96.0.5", &other));
    server.apply(
        Res::Services,
        service("marked", "10.96.0.6", &[(HEADLESS, "")]),
    );
    server.apply(Res::EndpointSlices, slice("a-1", "a", &["10.0.0.1"], &[]));
    server.apply(
        Res::EndpointSlices,
        slice("other-1", "other", &["10.0.0.5"], &other),
    );
    server.apply(
        Res::EndpointSlices,
        slice("h-1", "h", &["10.0.0.6"], &[(HEADLESS, "")]),
    );
    server.apply(
        Res::EndpointSlices,
        slice_with_labels("orphan", &["10.0.0.7"], &[]),
    );
    server.apply(Res::Nodes, node("node-1"));
    server.apply(Res::Nodes, node("node-2"));

    let options = KubeWatchOptions {
        node_name: Some("node-1".into()),
        ..KubeWatchOptions::default()
    };
    let (mut rx, first) = started(&server, options).await;
    assert_eq!(services(&first), ["default/a"]);
    assert_eq!(slices(&first), ["default/a-1"]);
    assert_eq!(nodes(&first), ["node-1"]);

    // A Service labelled for another proxy later leaves the selection.
    server.apply(Res::Services, service("a", "10.96.0.1", &other));
    let seen = until(&mut rx, "Service a gone", |o| o.services.is_empty()).await;
    assert_eq!(slices(seen.last().unwrap()), ["default/a-1"]);
    assert_eq!(server.delivered(Res::Services, "DELETED", "a"), 1);

    let calls = server.calls();
    assert!(count(&calls, Res::Services, true) >= 1);
    for call in &calls {
        let (labels, fields) = (call.param("labelSelector"), call.param("fieldSelector"));
        match call.res {
            Res::Services => assert_eq!(
                (labels, fields),
                (
                    Some(
                        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
                    ),
                    None
                ),
                "{call:?}"
            ),
            Res::EndpointSlices => assert_eq!(
                (labels, fields),
                (
                    Some(
                        "kubernetes.io/service-name,!service.kubernetes.io/service-proxy-name,\
                         !service.kubernetes.io/headless"
                    ),
                    None
                ),
                "{call:?}"
            ),
            Res::Nodes => assert_eq!(
                (labels, fields),
                (None, Some("metadata.name=node-1")),
                "{call:?}"
            ),
            Res::Pods | Res::Namespaces | Res::NetworkPolicies => {
                panic!("followed without --network-policy on: {call:?}")
            }
        }
    }
    assert_eq!(
        lb_userspace::source::labels::SERVICE_LABEL_SELECTOR,
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    );
}

/// Names of what NetworkPolicy reads, as the consumer holds them.
fn policy_objects(o: &Objects) -> (Vec<String>, Vec<String>, Vec<String>) {
    (
        o.policies
            .values()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect(),
        o.pods
            .values()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect(),
        o.namespaces.values().map(|n| n.name.to_string()).collect(),
    )
}

/// With `--network-policy on`, NetworkPolicies, Pods and Namespaces are listed
/// and watched whole (no selector: every pod of the cluster is a peer), decoded
/// with the Pod's address, node and labels, and their changes handed on.
#[tokio::test]
async fn policy_kinds_are_followed_whole_with_network_policy_on() {
    let server = FakeApiServer::start().await;
    seed(&server);
    server.apply(Res::Namespaces, namespace("x", &[("team", "a")]));
    server.apply(
        Res::Pods,
        pod("x", "a", &[("app", "a")], "node-2", "10.244.2.11", 80),
    );
    let deny = serde_json::json!({"podSelector": {}, "policyTypes": ["Ingress"]});
    server.apply(Res::NetworkPolicies, network_policy("x", "deny", deny));
    let options = KubeWatchOptions {
        network_policy: true,
        node_name: Some("node-1".into()),
        ..KubeWatchOptions::default()
    };
    let mut rx = Snapshots::new(kube_source::watch(server.client(), options));
    let listed = |o: &Objects| policy_objects(o).0.len() == 1 && o.pods.len() == 1;
    let seen = until(&mut rx, "the policy and the pod", listed).await;
    let last = seen.last().unwrap();
    assert_eq!(
        policy_objects(last),
        (
            vec!["x/deny".to_string()],
            vec!["x/a".to_string()],
            vec!["x".to_string()]
        )
    );
    let a = last.pods.values().next().unwrap();
    assert_eq!(a.ips, ["10.244.2.11".parse::<std::net::IpAddr>().unwrap()]);
    assert_eq!(&*a.node_name, "node-2");
    for res in Res::ALL {
        server.wait_watching(res, 1, WAIT).await;
    }

    server.apply(
        Res::Pods,
        pod("x", "b", &[("app", "b")], "node-1", "10.244.1.12", 80),
    );
    server.delete(Res::NetworkPolicies, "x", "deny");
    until(&mut rx, "pod b and no policy", |o| {
        policy_objects(o) == (vec![], vec!["x/a".into(), "x/b".into()], vec!["x".into()])
    })
    .await;

    let calls = server.calls();
    for res in Res::POLICY {
        assert_eq!(count(&calls, res, false), 1, "{res:?} lists: {calls:#?}");
        assert_eq!(count(&calls, res, true), 1, "{res:?} watches: {calls:#?}");
    }
    for call in calls.iter().filter(|c| Res::POLICY.contains(&c.res)) {
        let (labels, fields) = (call.param("labelSelector"), call.param("fieldSelector"));
        assert_eq!((labels, fields), (None, None), "{call:?}");
    }
}

#[tokio::test]
async fn bookmarks_publish_nothing_but_move_the_resume_point() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (mut rx, _) = started(&server, KubeWatchOptions::default()).await;
    assert!(server
        .calls_of(Res::Services, true)
        .iter()
        .all(|c| c.param("allowWatchBookmarks") == Some("true")));

    // Other resources moved the resourceVersion on; bookmarks say so.
    server.advance(5);
    let at = server.bookmark(Res::Services);
    server.bookmark(Res::EndpointSlices);
    server.bookmark(Res::Nodes);
    assert_eq!(server.delivered(Res::Services, "BOOKMARK", ""), 1);
    quiet(&mut rx, "bookmarks change no object").await;

    // The watch ends cleanly; the client resumes from the bookmark's version.
    server.drop_watches(Res::Services, false);
    let at = at.to_string();
    server
        .wait_call(WAIT, |c| {
            c.res == Res::Services && c.watch && c.param("resourceVersion") == Some(at.as_str())
        })
        .await;
    quiet(&mut rx, "resuming a watch changes no object").await;

    server.apply(Res::Services, service("b", "10.96.0.2", &[]));
    let seen = until(&mut rx, "Service b", |o| {
        services(o) == ["default/a", "default/b"]
    })
    .await;
    assert_eq!(seen.len(), 1);
}

#[tokio::test]
async fn a_relist_that_finds_nothing_new_publishes_nothing() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (mut rx, _) = started(&server, KubeWatchOptions::default()).await;

    server.expire_watches(Res::Services);
    // The watch after the relist starts once the relist has been taken in.
    server
        .wait_calls(WAIT, |calls| count(calls, Res::Services, true) == 2)
        .await;
    assert_eq!(server.calls_of(Res::Services, false).len(), 2);
    quiet(&mut rx, "the relist found the same objects").await;
}

/// A change hands on its own object only, with what it replaced: the agent
/// derives that object's Service and looks at nothing else.
#[tokio::test]
async fn a_change_hands_on_only_its_object() {
    let server = FakeApiServer::start().await;
    seed(&server);
    for i in 0..200 {
        let name = format!("s{i}");
        server.apply(
            Res::Services,
            service(&name, &format!("10.96.1.{}", i % 250), &[]),
        );
    }
    let (mut rx, first) = started(&server, KubeWatchOptions::default()).await;
    assert_eq!(services(&first).len(), 201);
    assert_eq!(first.changed.len(), 202, "the first hand-on is everything");

    server.apply(Res::EndpointSlices, slice("a-1", "a", &["10.0.0.9"], &[]));
    let seen = until(&mut rx, "a-1 changed", |o| {
        addresses(o, "a-1").is_some_and(|a| a == ["10.0.0.9"])
    })
    .await;
    let last = seen.last().expect("until returns what it saw");
    assert_eq!(last.changed, ["slice default/a-1"]);
}
