//! A small fake Kubernetes API server for tests of the API-server source.
//!
//! It speaks HTTP/1.1 on 127.0.0.1 (or, [`FakeApiServer::start_tls`], HTTPS with
//! a certificate authority of its own on a listener the test bound, as a pod's
//! in-cluster configuration needs) and serves list and watch of Services
//! (`/api/v1/services`), EndpointSlices (`/apis/discovery.k8s.io/v1/endpointslices`),
//! Nodes (`/api/v1/nodes`), and for NetworkPolicy Pods (`/api/v1/pods`), Namespaces
//! (`/api/v1/namespaces`) and NetworkPolicies
//! (`/apis/networking.k8s.io/v1/networkpolicies`), the way the real one does for a
//! client that lists all namespaces:
//! - one resourceVersion counter for everything, stamped on each write;
//! - lists honour `labelSelector`, `fieldSelector` (`metadata.name`,
//!   `metadata.namespace`), `limit` and `continue` (pages come from the snapshot
//!   of the first one);
//! - watches (`watch=true`) replay the changes after `resourceVersion` and then
//!   stream new ones as chunked JSON lines `{"type": ..., "object": ...}`; an
//!   object that stops (starts) matching the selector arrives as DELETED (ADDED);
//!   `resourceVersion` older than the compaction point gets an ERROR event with a
//!   410 Expired Status; BOOKMARKs go only to watches with `allowWatchBookmarks`.
//!
//! Tests script it: write objects, send bookmarks, expire or drop watches, hold
//! lists or watches back, stop and restart listening, and read the requests seen.
//! Not covered: `timeoutSeconds` (watches stay open until the test ends them),
//! `resourceVersion`/`resourceVersionMatch` on lists (always the latest state),
//! namespaced paths, other verbs, and authentication (the `Authorization` header
//! of each request is recorded, not checked).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Map, Value};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// The resources served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Res {
    Services,
    EndpointSlices,
    Nodes,
    Pods,
    Namespaces,
    NetworkPolicies,
}

impl Res {
    pub const ALL: [Res; 6] = [
        Res::Services,
        Res::EndpointSlices,
        Res::Nodes,
        Res::Pods,
        Res::Namespaces,
        Res::NetworkPolicies,
    ];
    /// What every agent follows.
    pub const PROXY: [Res; 3] = [Res::Services, Res::EndpointSlices, Res::Nodes];
    /// What an agent follows only with `--network-policy on`.
    pub const POLICY: [Res; 3] = [Res::Pods, Res::Namespaces, Res::NetworkPolicies];

    fn index(self) -> usize {
        self as usize
    }

    fn path(self) -> &'static str {
        match self {
            Res::Services => "/api/v1/services",
            Res::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Res::Nodes => "/api/v1/nodes",
            Res::Pods => "/api/v1/pods",
            Res::Namespaces => "/api/v1/namespaces",
            Res::NetworkPolicies => "/apis/networking.k8s.io/v1/networkpolicies",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Res::Services => "Service",
            Res::EndpointSlices => "EndpointSlice",
            Res::Nodes => "Node",
            Res::Pods => "Pod",
            Res::Namespaces => "Namespace",
            Res::NetworkPolicies => "NetworkPolicy",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Res::EndpointSlices => "discovery.k8s.io/v1",
            Res::NetworkPolicies => "networking.k8s.io/v1",
            Res::Services | Res::Nodes | Res::Pods | Res::Namespaces => "v1",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Res::Nodes | Res::Namespaces)
    }

    fn from_path(path: &str) -> Option<Res> {
        Res::ALL.into_iter().find(|r| r.path() == path)
    }
}

/// One request the server received (recorded before it is answered).
#[derive(Clone, Debug)]
pub struct Call {
    pub res: Res,
    pub watch: bool,
    pub query: BTreeMap<String, String>,
    /// The request's `Authorization` header, if it had one.
    pub authorization: Option<String>,
}

impl Call {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.get(name).map(String::as_str)
    }
}

/// What a watch stream is told to do next.
enum Msg {
    Line(Bytes),
    /// End the response properly (the last chunk), as the server does on timeout.
    End,
    /// Break the connection in the middle of the response.
    Abort,
}

struct Watcher {
    tx: mpsc::UnboundedSender<Msg>,
    labels: Selector,
    fields: Selector,
    bookmarks: bool,
}

/// One write: the object before and after (`None` when created / deleted).
struct Change {
    rv: u64,
    old: Option<Value>,
    new: Option<Value>,
}

#[derive(Default)]
struct Store {
    objects: BTreeMap<(String, String), Value>,
    /// Each object as a list item (JSON without kind and apiVersion), encoded when
    /// it is written, as the real API server's watch cache keeps objects encoded:
    /// a list is then a concatenation, not a serialization of every object.
    encoded: BTreeMap<(String, String), Bytes>,
    history: Vec<Change>,
    /// Watches from a resourceVersion older than this get 410 Expired.
    compacted: u64,
    watchers: Vec<Watcher>,
    /// Remaining items of paged lists, by continue token: (list rv, items).
    pages: HashMap<String, (u64, VecDeque<Bytes>)>,
}

#[derive(Default)]
struct State {
    rv: u64,
    stores: [Store; Res::ALL.len()],
    calls: Vec<Call>,
    /// (resource, event type, object name) for each event put on a watch stream.
    delivered: Vec<(Res, String, String)>,
    next_uid: u64,
    next_token: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Bumped whenever a request arrives or a watch starts, for waiters.
    activity: watch::Sender<u64>,
    hold_lists: [watch::Sender<bool>; Res::ALL.len()],
    hold_watches: [watch::Sender<bool>; Res::ALL.len()],
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.activity.send_modify(|n| *n += 1);
    }
}

pub struct FakeApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    serving: Mutex<Option<JoinHandle<()>>>,
    /// Set when serving HTTPS.
    tls: Option<TlsAcceptor>,
}

/// A certificate authority made for one test, and a server certificate it signed:
/// what a cluster's service account `ca.crt` and its API server's certificate are.
pub struct ServingCert {
    /// The authority's certificate (PEM): the `ca.crt` a client trusts.
    pub ca_pem: String,
    ca_der: Vec<u8>,
    acceptor: TlsAcceptor,
}

impl ServingCert {
    /// An authority and a certificate for the address `ip` (its only subject
    /// alternative name, so a client reaching the server by that address accepts it).
    pub fn for_ip(ip: IpAddr) -> ServingCert {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
            KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec![ip.to_string()]).expect("server params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &issuer).expect("server certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("server TLS configuration");
        ServingCert {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().to_vec(),
            acceptor: TlsAcceptor::from(Arc::new(config)),
        }
    }

    /// The authority's certificate (DER), as kube's `Config::root_cert` takes it.
    pub fn ca_der(&self) -> &[u8] {
        &self.ca_der
    }
}

type Body = BoxBody<Bytes, io::Error>;

impl FakeApiServer {
    /// Starts listening on a free loopback port.
    pub async fn start() -> FakeApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::serve_on(listener, None)
    }

    /// Serves HTTPS with `cert` on `listener`, which the caller bound: in the network
    /// namespace its clients are in, at the address `cert` names. ([`Self::resume`]
    /// would bind in the caller's own namespace: use `stop` and `resume` with
    /// [`Self::start`] only.)
    pub async fn start_tls(listener: std::net::TcpListener, cert: &ServingCert) -> FakeApiServer {
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let listener = TcpListener::from_std(listener).expect("listener");
        Self::serve_on(listener, Some(cert.acceptor.clone()))
    }

    /// Serves plain HTTP on `listener`, which the caller bound (in the network
    /// namespace its clients are in). Use `stop` and `resume` with
    /// [`Self::start`] only, as for [`Self::start_tls`].
    pub async fn start_on(listener: std::net::TcpListener) -> FakeApiServer {
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let listener = TcpListener::from_std(listener).expect("listener");
        Self::serve_on(listener, None)
    }

    fn serve_on(listener: TcpListener, tls: Option<TlsAcceptor>) -> FakeApiServer {
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            activity: watch::channel(0).0,
            hold_lists: std::array::from_fn(|_| watch::channel(false).0),
            hold_watches: std::array::from_fn(|_| watch::channel(false).0),
        });
        let serving = tokio::spawn(serve(listener, shared.clone(), tls.clone()));
        FakeApiServer {
            shared,
            addr,
            serving: Mutex::new(Some(serving)),
            tls,
        }
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// A kubeconfig naming this server (plain HTTP, no credentials), as a file's text.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             contexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\n\
             clusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\n\
             users:\n- name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    /// A client for this server: plain HTTP, no credentials.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().expect("url"));
        kube::Client::try_from(config).expect("client")
    }

    /// Stops listening and breaks every open connection: connecting is refused
    /// until [`FakeApiServer::resume`].
    pub async fn stop(&self) {
        let serving = self.serving.lock().unwrap().take();
        if let Some(serving) = serving {
            serving.abort();
            let _ = serving.await; // the listener and connections are gone after this
        }
        let mut state = self.shared.lock();
        for store in &mut state.stores {
            store.watchers.clear();
        }
    }

    /// Listens again on the same port.
    pub async fn resume(&self) {
        let socket = TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket.bind(self.addr).expect("bind the same port again");
        let listener = socket.listen(128).expect("listen");
        let serving = tokio::spawn(serve(listener, self.shared.clone(), self.tls.clone()));
        *self.serving.lock().unwrap() = Some(serving);
    }

    /// Creates or replaces an object (namespace `default` when unset for namespaced
    /// kinds); watches see ADDED or MODIFIED. Returns the new resourceVersion.
    pub fn apply(&self, res: Res, mut object: Value) -> u64 {
        let mut state = self.shared.lock();
        state.rv += 1;
        let rv = state.rv;
        let meta = object["metadata"]
            .as_object_mut()
            .expect("object has metadata");
        if res.namespaced() && !meta.contains_key("namespace") {
            meta.insert("namespace".into(), json!("default"));
        }
        let key = key_of(&object);
        let old = state.stores[res.index()].objects.get(&key).cloned();
        let uid = match &old {
            Some(old) => old["metadata"]["uid"].clone(),
            None => {
                state.next_uid += 1;
                json!(format!("uid-{}", state.next_uid))
            }
        };
        let meta = object["metadata"].as_object_mut().expect("metadata");
        meta.insert("uid".into(), uid);
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.entry("creationTimestamp")
            .or_insert(json!("2024-01-01T00:00:00Z"));
        let fields = object.as_object_mut().expect("object");
        fields.insert("kind".into(), json!(res.kind()));
        fields.insert("apiVersion".into(), json!(res.api_version()));

        let mut item = object.clone();
        let fields = item.as_object_mut().expect("object");
        // Items of typed lists carry no kind and apiVersion.
        fields.remove("kind");
        fields.remove("apiVersion");
        let item = Bytes::from(serde_json::to_vec(&item).expect("serializable"));
        let store = &mut state.stores[res.index()];
        store.encoded.insert(key.clone(), item);
        store.objects.insert(key, object.clone());
        record(&mut state, res, rv, old, Some(object));
        rv
    }

    /// Deletes an object; watches see DELETED with the deletion's resourceVersion.
    pub fn delete(&self, res: Res, namespace: &str, name: &str) -> u64 {
        let mut state = self.shared.lock();
        state.rv += 1;
        let rv = state.rv;
        let key = (namespace.to_owned(), name.to_owned());
        state.stores[res.index()].encoded.remove(&key);
        let mut old = state.stores[res.index()]
            .objects
            .remove(&key)
            .unwrap_or_else(|| panic!("no {} {namespace}/{name} to delete", res.kind()));
        old["metadata"]["resourceVersion"] = json!(rv.to_string());
        record(&mut state, res, rv, Some(old), None);
        rv
    }

    /// Writes to other resources move the resourceVersion on without events here.
    pub fn advance(&self, by: u64) -> u64 {
        let mut state = self.shared.lock();
        state.rv += by;
        state.rv
    }

    /// Sends a BOOKMARK at the current resourceVersion to the watches of `res` that
    /// asked for bookmarks; returns that resourceVersion.
    pub fn bookmark(&self, res: Res) -> u64 {
        let mut state = self.shared.lock();
        let rv = state.rv;
        let line = watch_line(
            "BOOKMARK",
            &json!({
                "kind": res.kind(),
                "apiVersion": res.api_version(),
                "metadata": {"resourceVersion": rv.to_string()},
            }),
        );
        let mut sent = 0;
        state.stores[res.index()].watchers.retain(|w| {
            if !w.bookmarks {
                return true;
            }
            let ok = w.tx.send(Msg::Line(line.clone())).is_ok();
            sent += usize::from(ok);
            ok
        });
        for _ in 0..sent {
            state
                .delivered
                .push((res, "BOOKMARK".into(), String::new()));
        }
        rv
    }

    /// Ends every watch of `res` with an ERROR event 410 Expired, as the API server
    /// does when a watch fell too far behind, and compacts history up to now.
    pub fn expire_watches(&self, res: Res) {
        let mut state = self.shared.lock();
        let rv = state.rv;
        let line = watch_line("ERROR", &expired_status(rv, rv));
        let store = &mut state.stores[res.index()];
        for w in store.watchers.drain(..) {
            let _ = w.tx.send(Msg::Line(line.clone()));
            let _ = w.tx.send(Msg::End);
        }
        compact(store, rv);
    }

    /// Forgets the history of `res` up to now: watches from an older
    /// resourceVersion get 410 Expired.
    pub fn compact(&self, res: Res) {
        let mut state = self.shared.lock();
        let rv = state.rv;
        compact(&mut state.stores[res.index()], rv);
    }

    /// Ends the watches of `res`: cleanly (the last chunk, as on a server-side
    /// timeout) or by breaking the connection mid-response.
    pub fn drop_watches(&self, res: Res, abort: bool) {
        let mut state = self.shared.lock();
        for w in state.stores[res.index()].watchers.drain(..) {
            let _ = w.tx.send(if abort { Msg::Abort } else { Msg::End });
        }
    }

    /// Holds list requests of `res` (received and recorded, but not answered) while
    /// `held`.
    pub fn hold_lists(&self, res: Res, held: bool) {
        self.shared.hold_lists[res.index()].send_replace(held);
    }

    /// Holds watch requests of `res` while `held`; they are answered from the state
    /// at release.
    pub fn hold_watches(&self, res: Res, held: bool) {
        self.shared.hold_watches[res.index()].send_replace(held);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.shared.lock().calls.clone()
    }

    /// Waits (at most `limit`) for a request that `pred` accepts, seen at any time.
    pub async fn wait_call(&self, limit: Duration, pred: impl Fn(&Call) -> bool) -> Call {
        let calls = self
            .wait_calls(limit, |calls| calls.iter().any(&pred))
            .await;
        calls.into_iter().find(pred).expect("found")
    }

    /// Waits (at most `limit`) until the requests seen so far satisfy `pred`.
    pub async fn wait_calls(&self, limit: Duration, pred: impl Fn(&[Call]) -> bool) -> Vec<Call> {
        let mut activity = self.shared.activity.subscribe();
        let found = tokio::time::timeout(limit, async {
            loop {
                activity.borrow_and_update();
                let calls = self.calls();
                if pred(&calls) {
                    return calls;
                }
                activity.changed().await.expect("server state lives");
            }
        })
        .await;
        found.unwrap_or_else(|_| panic!("requests not seen within {limit:?}: {:#?}", self.calls()))
    }

    /// The requests for `res` seen so far: lists (`watch == false`) or watches.
    pub fn calls_of(&self, res: Res, watch: bool) -> Vec<Call> {
        let calls = self.calls();
        calls
            .into_iter()
            .filter(|c| c.res == res && c.watch == watch)
            .collect()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits (at most `limit`) until `res` has `count` watches open.
    pub async fn wait_watching(&self, res: Res, count: usize, limit: Duration) {
        let mut activity = self.shared.activity.subscribe();
        let done = tokio::time::timeout(limit, async {
            loop {
                activity.borrow_and_update();
                let open = {
                    let mut state = self.shared.lock();
                    let store = &mut state.stores[res.index()];
                    store.watchers.retain(|w| !w.tx.is_closed());
                    store.watchers.len()
                };
                if open >= count {
                    return;
                }
                activity.changed().await.expect("server state lives");
            }
        })
        .await;
        done.unwrap_or_else(|_| panic!("{res:?} not watched by {count} within {limit:?}"));
    }

    /// How many events of `event_type` for the object `name` were put on watches.
    pub fn delivered(&self, res: Res, event_type: &str, name: &str) -> usize {
        self.shared
            .lock()
            .delivered
            .iter()
            .filter(|(r, t, n)| *r == res && t == event_type && n == name)
            .count()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(serving) = self.serving.lock().unwrap().take() {
            serving.abort();
        }
    }
}

fn key_of(object: &Value) -> (String, String) {
    let meta = &object["metadata"];
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    (text(&meta["namespace"]), text(&meta["name"]))
}

fn compact(store: &mut Store, rv: u64) {
    store.compacted = rv;
    store.history.retain(|c| c.rv > rv);
}

/// Records a write and tells the watches of `res` about it.
fn record(state: &mut State, res: Res, rv: u64, old: Option<Value>, new: Option<Value>) {
    let change = Change { rv, old, new };
    let mut delivered = Vec::new();
    state.stores[res.index()].watchers.retain(|w| {
        let Some((event_type, object)) = event_for(w, &change) else {
            return true;
        };
        let ok = w.tx.send(Msg::Line(watch_line(event_type, object))).is_ok();
        if ok {
            delivered.push((res, event_type.to_owned(), key_of(object).1));
        }
        ok
    });
    state.delivered.extend(delivered);
    state.stores[res.index()].history.push(change);
}

/// What a watch with these selectors sees of a change, if anything.
fn event_for<'a>(w: &Watcher, change: &'a Change) -> Option<(&'static str, &'a Value)> {
    let matches = |o: &Option<Value>| {
        o.as_ref()
            .is_some_and(|o| w.labels.matches_labels(o) && w.fields.matches_fields(o))
    };
    match (matches(&change.old), matches(&change.new)) {
        (false, true) => Some(("ADDED", change.new.as_ref()?)),
        (true, true) => Some(("MODIFIED", change.new.as_ref()?)),
        // Deleted, or changed so that it left the selection.
        (true, false) => Some(("DELETED", change.new.as_ref().or(change.old.as_ref())?)),
        (false, false) => None,
    }
}

fn watch_line(event_type: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": event_type, "object": object})).expect("serializable");
    line.push(b'\n');
    Bytes::from(line)
}

fn expired_status(requested: u64, oldest: u64) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("too old resource version: {requested} ({oldest})"),
        "reason": "Expired",
        "code": 410,
    })
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    let bytes = Bytes::from(serde_json::to_vec(body).expect("serializable"));
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(bytes).map_err(|never| match never {}).boxed())
        .expect("response")
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, tls: Option<TlsAcceptor>) {
    // Dropping this task (stop) drops the set, which aborts every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                // As the real API server (Go sets TCP_NODELAY on every connection):
                // a watch event is a small write that must not wait for the ACK of
                // the one before (Nagle with delayed ACKs held events up to 40 ms).
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let tls = tls.clone();
                connections.spawn(async move {
                    let service = service_fn(move |req| handle(shared.clone(), req));
                    let http = http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Some(tls) => {
                            // A client that gives up on the handshake just goes away.
                            let Ok(stream) = tls.accept(stream).await else { return };
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let Some(res) = Res::from_path(req.uri().path()) else {
        let message = format!(
            "the server could not find the requested resource ({})",
            req.uri()
        );
        return Ok(status(StatusCode::NOT_FOUND, "NotFound", &message));
    };
    if req.method() != Method::GET {
        return Ok(status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "only list and watch are served",
        ));
    }
    let query = parse_query(req.uri().query().unwrap_or(""));
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    shared.lock().calls.push(Call {
        res,
        watch,
        query: query.clone(),
        authorization,
    });
    shared.bump();

    let gate = if watch {
        &shared.hold_watches[res.index()]
    } else {
        &shared.hold_lists[res.index()]
    };
    let _ = gate.subscribe().wait_for(|held| !*held).await;

    let labels = match Selector::labels(query.get("labelSelector").map_or("", String::as_str)) {
        Ok(s) => s,
        Err(e) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &e)),
    };
    let fields = match Selector::fields(query.get("fieldSelector").map_or("", String::as_str)) {
        Ok(s) => s,
        Err(e) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &e)),
    };
    Ok(if watch {
        start_watch(&shared, res, &query, labels, fields)
    } else {
        list(&shared, res, &query, &labels, &fields)
    })
}

fn list(
    shared: &Shared,
    res: Res,
    query: &BTreeMap<String, String>,
    labels: &Selector,
    fields: &Selector,
) -> Response<Body> {
    let mut state = shared.lock();
    let current = state.rv;
    let (rv, items) = match query.get("continue").filter(|t| !t.is_empty()) {
        Some(token) => match state.stores[res.index()].pages.remove(token) {
            Some(page) => page,
            None => {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "the provided continue parameter is too old",
                )
            }
        },
        None => {
            let store = &state.stores[res.index()];
            let items = store
                .objects
                .iter()
                .filter(|(_, o)| labels.matches_labels(o) && fields.matches_fields(o))
                .map(|(key, _)| store.encoded[key].clone())
                .collect();
            (current, items)
        }
    };
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|&l| l > 0)
        .unwrap_or(usize::MAX);
    let mut rest: VecDeque<Bytes> = items;
    let page: Vec<Bytes> = rest.drain(..limit.min(rest.len())).collect();
    let mut metadata = Map::new();
    metadata.insert("resourceVersion".into(), json!(rv.to_string()));
    if !rest.is_empty() {
        state.next_token += 1;
        let token = format!("page-{}", state.next_token);
        metadata.insert("continue".into(), json!(token));
        metadata.insert("remainingItemCount".into(), json!(rest.len()));
        state.stores[res.index()].pages.insert(token, (rv, rest));
    }
    let head = json!({
        "kind": format!("{}List", res.kind()),
        "apiVersion": res.api_version(),
        "metadata": metadata,
    });
    // `{...head, "items": [page...]}`, from the items' stored encodings.
    let mut body = serde_json::to_vec(&head).expect("serializable");
    body.pop();
    body.extend_from_slice(b",\"items\":[");
    for (i, item) in page.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
    body.extend_from_slice(b"]}");
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("response")
}

fn start_watch(
    shared: &Shared,
    res: Res,
    query: &BTreeMap<String, String>,
    labels: Selector,
    fields: Selector,
) -> Response<Body> {
    let from = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(v) => match v.parse::<u64>() {
            Ok(v) => Some(v),
            Err(_) => {
                let message = format!("invalid resourceVersion {v:?}");
                return status(StatusCode::BAD_REQUEST, "BadRequest", &message);
            }
        },
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let watcher = Watcher {
        tx,
        labels,
        fields,
        bookmarks: query.get("allowWatchBookmarks").map(String::as_str) == Some("true"),
    };
    {
        let mut state = shared.lock();
        let State {
            stores, delivered, ..
        } = &mut *state;
        let store = &mut stores[res.index()];
        let mut send = |event_type: &str, object: &Value| {
            let _ = watcher.tx.send(Msg::Line(watch_line(event_type, object)));
            delivered.push((res, event_type.to_owned(), key_of(object).1));
        };
        match from {
            // From "now": the current objects as ADDED first.
            None => {
                for object in store.objects.values() {
                    if watcher.labels.matches_labels(object)
                        && watcher.fields.matches_fields(object)
                    {
                        send("ADDED", object);
                    }
                }
                store.watchers.push(watcher);
            }
            Some(from) if from < store.compacted => {
                let _ = watcher.tx.send(Msg::Line(watch_line(
                    "ERROR",
                    &expired_status(from, store.compacted),
                )));
                let _ = watcher.tx.send(Msg::End);
            }
            Some(from) => {
                for change in store.history.iter().filter(|c| c.rv > from) {
                    if let Some((event_type, object)) = event_for(&watcher, change) {
                        send(event_type, object);
                    }
                }
                store.watchers.push(watcher);
            }
        }
    }
    shared.bump();

    let stream = futures::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await? {
            Msg::Line(line) => Some((Ok(Frame::data(line)), rx)),
            Msg::Abort => Some((Err(io::Error::other("connection broken by the test")), rx)),
            Msg::End => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("response")
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A label or field selector: requirements that must all hold.
#[derive(Clone, Debug, Default)]
pub struct Selector(Vec<Requirement>);

#[derive(Clone, Debug)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Selector {
    /// Kubernetes label selector syntax: `k`, `!k`, `k=v`, `k==v`, `k!=v`,
    /// `k in (a,b)`, `k notin (a,b)`, joined by commas.
    pub fn labels(text: &str) -> Result<Selector, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let bad = || format!("unable to parse requirement: {part:?}");
            let requirement = if let Some(key) = part.strip_prefix('!') {
                Requirement::NotExists(key.trim().to_owned())
            } else if let Some((key, set)) = part.split_once(" notin ") {
                Requirement::NotIn(key.trim().to_owned(), parse_set(set).ok_or_else(bad)?)
            } else if let Some((key, set)) = part.split_once(" in ") {
                Requirement::In(key.trim().to_owned(), parse_set(set).ok_or_else(bad)?)
            } else if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = part.split_once("==") {
                Requirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = part.split_once('=') {
                Requirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else {
                Requirement::Exists(part.to_owned())
            };
            let key = match &requirement {
                Requirement::Exists(k)
                | Requirement::NotExists(k)
                | Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _) => k,
            };
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(bad());
            }
            requirements.push(requirement);
        }
        Ok(Selector(requirements))
    }

    /// Field selectors: `metadata.name` and `metadata.namespace` with `=`, `==`, `!=`.
    pub fn fields(text: &str) -> Result<Selector, String> {
        let selector = Selector::labels(text)?;
        for requirement in &selector.0 {
            match requirement {
                Requirement::Equals(k, _) | Requirement::NotEquals(k, _)
                    if k == "metadata.name" || k == "metadata.namespace" => {}
                other => return Err(format!("field selector {other:?} is not supported")),
            }
        }
        Ok(selector)
    }

    fn matches_labels(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.matches(|key| labels.get(key).and_then(Value::as_str))
    }

    fn matches_fields(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        self.matches(|key| match key {
            "metadata.name" => Some(meta["name"].as_str().unwrap_or("")),
            "metadata.namespace" => Some(meta["namespace"].as_str().unwrap_or("")),
            _ => None,
        })
    }

    fn matches<'a>(&self, value: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => value(k).is_some(),
            Requirement::NotExists(k) => value(k).is_none(),
            Requirement::Equals(k, v) => value(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => value(k) != Some(v.as_str()),
            Requirement::In(k, set) => value(k).is_some_and(|v| set.iter().any(|s| s == v)),
            Requirement::NotIn(k, set) => !value(k).is_some_and(|v| set.iter().any(|s| s == v)),
        })
    }
}

/// Splits at commas outside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_set(text: &str) -> Option<Vec<String>> {
    let inner = text.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

/// A ClusterIP Service with one TCP port 80 named `http`.
pub fn service(name: &str, cluster_ip: &str, labels: &[(&str, &str)]) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "default", "labels": label_map(labels)},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    })
}

/// An IPv4 EndpointSlice of `service` with ready endpoints on port 8080 `http`.
pub fn slice(name: &str, service: &str, addresses: &[&str], labels: &[(&str, &str)]) -> Value {
    let mut all = vec![("kubernetes.io/service-name", service)];
    all.extend_from_slice(labels);
    slice_with_labels(name, addresses, &all)
}

/// An EndpointSlice with exactly these labels.
pub fn slice_with_labels(name: &str, addresses: &[&str], labels: &[(&str, &str)]) -> Value {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
        .collect();
    json!({
        "metadata": {"name": name, "namespace": "default", "labels": label_map(labels)},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

pub fn node(name: &str) -> Value {
    json!({
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "z1"},
            "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1"}],
        },
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]},
    })
}

/// A running Pod `namespace/name` on node `node` with address `ip` (also its
/// `podIPs`), these labels, and one container serving TCP `port` under the name
/// `serve`.
pub fn pod(
    namespace: &str,
    name: &str,
    labels: &[(&str, &str)],
    node: &str,
    ip: &str,
    port: u16,
) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace, "labels": label_map(labels)},
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "app",
                "image": "lb-echo",
                "ports": [{"name": "serve", "containerPort": port, "protocol": "TCP"}],
            }],
        },
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    })
}

/// A Namespace `name` with the label the API server sets
/// (`kubernetes.io/metadata.name`) and `labels`.
pub fn namespace(name: &str, labels: &[(&str, &str)]) -> Value {
    let mut all = vec![("kubernetes.io/metadata.name", name)];
    all.extend_from_slice(labels);
    json!({
        "metadata": {"name": name, "labels": label_map(&all)},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    })
}

/// A NetworkPolicy `namespace/name` whose spec is `spec` (NetworkPolicySpec JSON).
pub fn network_policy(namespace: &str, name: &str, spec: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    })
}

fn label_map(labels: &[(&str, &str)]) -> Value {
    Value::Object(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect(),
    )
}

#[test]
fn selector_syntax() {
    let s = Selector::labels("a,!b,c=1,d!=2,e in (x, y),f notin (z)").unwrap();
    let obj = |labels: Value| json!({"metadata": {"labels": labels}});
    assert!(s.matches_labels(&obj(json!({"a": "", "c": "1", "e": "y"}))));
    assert!(!s.matches_labels(&obj(json!({"a": "", "b": "", "c": "1", "e": "y"}))));
    assert!(!s.matches_labels(&obj(json!({"a": "", "c": "1", "e": "y", "f": "z"}))));
    assert!(!s.matches_labels(&obj(json!({"a": "", "c": "1", "d": "2", "e": "x"}))));
    assert!(Selector::labels("a b").is_err());
    assert_eq!(percent_decode("%21a%2Cb+c"), "!a,b c");
}

/// Over HTTPS, a client that trusts the test's authority lists as over HTTP, the
/// request is recorded with its credentials, and one that does not trust it gets
/// nothing.
#[tokio::test]
async fn https_with_the_tests_own_authority() {
    use k8s_openapi::api::core::v1::Service;
    let ip: IpAddr = "127.0.0.1".parse().unwrap();
    let cert = ServingCert::for_ip(ip);
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let server = FakeApiServer::start_tls(listener, &cert).await;
    server.apply(Res::Services, service("web", "10.96.0.10", &[]));
    assert!(
        server.url().starts_with("https://127.0.0.1:"),
        "{}",
        server.url()
    );

    let mut config = kube::Config::new(server.url().parse().unwrap());
    config.root_cert = Some(vec![cert.ca_der().to_vec()]);
    config.headers = vec![(
        hyper::header::AUTHORIZATION,
        "Bearer test-token".parse().unwrap(),
    )];
    let client = kube::Client::try_from(config).unwrap();
    let list = kube::Api::<Service>::all(client)
        .list(&Default::default())
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    let calls = server.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].authorization.as_deref(), Some("Bearer test-token"));

    let other = ServingCert::for_ip(ip);
    let mut config = kube::Config::new(server.url().parse().unwrap());
    config.root_cert = Some(vec![other.ca_der().to_vec()]);
    let client = kube::Client::try_from(config).unwrap();
    let refused = kube::Api::<Service>::all(client)
        .list(&Default::default())
        .await;
    assert!(
        refused.is_err(),
        "a client trusting another authority got {refused:?}"
    );
    assert_eq!(server.calls().len(), 1);
}

/// Pods, Namespaces and NetworkPolicies are listed and watched as the other kinds:
/// typed lists decode, and a watch from the list's resourceVersion sees a label
/// change as MODIFIED and a deletion as DELETED.
#[tokio::test]
async fn policy_kinds_list_and_watch() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{Namespace, Pod};
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::api::{Api, ListParams, WatchEvent, WatchParams};

    let server = FakeApiServer::start().await;
    server.apply(Res::Namespaces, namespace("prod", &[("team", "a")]));
    server.apply(
        Res::Pods,
        pod("prod", "db", &[("app", "db")], "node-1", "10.244.1.5", 5432),
    );
    server.apply(
        Res::NetworkPolicies,
        network_policy(
            "prod",
            "db-ingress",
            json!({"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]}),
        ),
    );
    let client = server.client();

    let namespaces = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    let labels = namespaces.items[0].metadata.labels.clone().unwrap();
    assert_eq!(labels["kubernetes.io/metadata.name"], "prod");
    assert_eq!(namespaces.items[0].metadata.namespace, None);

    let policies = Api::<NetworkPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(policies.items.len(), 1);
    let spec = policies.items[0].spec.clone().unwrap();
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));

    let pods = Api::<Pod>::all(client.clone());
    let list = pods
        .list(&ListParams::default().labels("app=db"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    let status = list.items[0].status.clone().unwrap();
    assert_eq!(status.pod_ip.as_deref(), Some("10.244.1.5"));
    let rv = list.metadata.resource_version.unwrap();

    let mut events = pods
        .watch(&WatchParams::default().labels("app=db"), &rv)
        .await
        .unwrap()
        .boxed();
    server.apply(
        Res::Pods,
        pod(
            "prod",
            "db",
            &[("app", "db"), ("tier", "data")],
            "node-1",
            "10.244.1.5",
            5432,
        ),
    );
    server.delete(Res::Pods, "prod", "db");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let event = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .expect("a watch event within 10 s")
            .expect("the watch is open")
            .unwrap();
        seen.push(match event {
            WatchEvent::Modified(p) => format!("MODIFIED {:?}", p.metadata.labels.unwrap()),
            WatchEvent::Deleted(p) => format!("DELETED {}", p.metadata.name.unwrap()),
            other => format!("{other:?}"),
        });
    }
    assert_eq!(
        seen,
        [
            r#"MODIFIED {"app": "db", "tier": "data"}"#.to_string(),
            "DELETED db".to_string()
        ]
    );
    let calls = server.calls();
    let paths: Vec<(Res, bool)> = calls.iter().map(|c| (c.res, c.watch)).collect();
    assert_eq!(
        paths,
        [
            (Res::Namespaces, false),
            (Res::NetworkPolicies, false),
            (Res::Pods, false),
            (Res::Pods, true)
        ]
    );
}
