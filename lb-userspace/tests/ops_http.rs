//! `/healthz` and `/metrics` over real loopback HTTP.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lb_userspace::ops::{
    self, AgentStatus, ManualClock, OpsError, OpsServer, Routes, ServeConfig, MAX_REQUEST_BYTES,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every exchange must finish well within this; a hang fails the test instead.
const CLIENT_DEADLINE: Duration = Duration::from_secs(10);

struct Reply {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn parse_reply(raw: &[u8]) -> Reply {
    let text = std::str::from_utf8(raw).expect("reply is UTF-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("reply has a head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let mut parts = status_line.splitn(3, ' ');
    // hyper answers an HTTP/1.0 request in HTTP/1.0.
    assert!(
        matches!(parts.next(), Some("HTTP/1.1" | "HTTP/1.0")),
        "{status_line}"
    );
    let status = parts.next().unwrap().parse().unwrap();
    let headers: BTreeMap<String, String> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').expect("header line");
            (k.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    let length: usize = headers["content-length"].parse().unwrap();
    Reply {
        status,
        headers,
        body: body.to_string(),
    }
    .checked_length(length)
}

impl Reply {
    fn checked_length(self, length: usize) -> Self {
        // HEAD answers announce the length of the body they leave out.
        assert!(
            self.body.len() == length || self.body.is_empty(),
            "Content-Length {length}, body {} bytes",
            self.body.len()
        );
        self
    }
}

/// Sends `request` as is and reads until the server closes.
async fn exchange(addr: SocketAddr, request: &[u8]) -> Reply {
    tokio::time::timeout(CLIENT_DEADLINE, async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        parse_reply(&raw)
    })
    .await
    .expect("the server answered in time")
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n");
    exchange(addr, request.as_bytes()).await
}

async fn start(status: Arc<AgentStatus>, config: ServeConfig) -> SocketAddr {
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = OpsServer::bind(loopback, status, config).await.unwrap();
    let addr = server.local_addr();
    assert_ne!(addr.port(), 0);
    tokio::spawn(server.run());
    addr
}

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

#[tokio::test]
async fn healthz_follows_initial_sync_and_pending_changes() {
    let clock = Arc::new(ManualClock::new(at(1_714_557_600)));
    let status = Arc::new(AgentStatus::with_clock(clock.clone()));
    let timeout = Duration::from_millis(200);
    let addr = start(status.clone(), ServeConfig::new(timeout)).await;

    let before = get(addr, "/healthz").await;
    assert_eq!(before.status, 503);
    assert_eq!(before.header("content-type"), Some("application/json"));
    assert_eq!(before.header("connection"), Some("close"));
    let json = before.json();
    assert_eq!(json["lastUpdated"], "0001-01-01T00:00:00Z");
    assert_eq!(json["currentTime"], "2024-05-01T10:00:00Z");
    assert_eq!(json["nodeEligible"], true);

    // A sync before the initial one is marked does not make the agent healthy.
    status.record_pending();
    status.record_sync(Duration::from_millis(2), 3, 5);
    assert_eq!(get(addr, "/healthz").await.status, 503);
    status.mark_initial_sync();
    let synced = get(addr, "/healthz").await;
    assert_eq!(synced.status, 200, "{}", synced.body);
    assert_eq!(synced.json()["lastUpdated"], "2024-05-01T10:00:00Z");

    // A quiet cluster: nothing changes for far longer than the timeout.
    clock.advance(Duration::from_secs(3600));
    let quiet = get(addr, "/healthz").await;
    assert_eq!(quiet.status, 200, "{}", quiet.body);
    assert_eq!(quiet.json()["lastUpdated"], "2024-05-01T10:00:00Z");
    assert_eq!(quiet.json()["currentTime"], "2024-05-01T11:00:00Z");

    // A change arrives and every pass applying it fails.
    status.record_pending();
    status.record_sync_error();
    clock.advance(timeout);
    status.record_sync_error();
    assert_eq!(
        get(addr, "/healthz").await.status,
        200,
        "pending for exactly the timeout"
    );
    clock.advance(Duration::from_millis(1));
    let stuck = get(addr, "/healthz").await;
    assert_eq!(stuck.status, 503);
    let json = stuck.json();
    assert_eq!(json["lastUpdated"], "2024-05-01T10:00:00Z");
    assert_eq!(json["nodeEligible"], true);
    // More changes and more errors do not help.
    status.record_pending();
    status.record_sync_error();
    assert_eq!(get(addr, "/healthz").await.status, 503);

    // The next successful sync does.
    clock.advance(Duration::from_secs(5));
    status.record_sync(Duration::from_millis(1), 3, 5);
    let again = get(addr, "/healthz").await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["lastUpdated"], "2024-05-01T11:00:05Z");
    assert_eq!(again.json()["currentTime"], "2024-05-01T11:00:05Z");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(get(addr, "/healthz").await.status, 200);

    // A query string does not change the endpoint.
    assert_eq!(get(addr, "/healthz?verbose=1").await.status, 200);
}

#[tokio::test]
async fn a_pending_change_goes_stale_on_the_system_clock() {
    let status = Arc::new(AgentStatus::new());
    let timeout = Duration::from_millis(200);
    let addr = start(status.clone(), ServeConfig::new(timeout)).await;
    status.record_sync(Duration::from_millis(1), 0, 0);
    status.mark_initial_sync();
    assert_eq!(get(addr, "/healthz").await.status, 200);

    let pending_at = Instant::now();
    status.record_pending();
    let deadline = pending_at + Duration::from_secs(5);
    let stale_at = loop {
        let reply = get(addr, "/healthz").await;
        if reply.status == 503 {
            break Instant::now();
        }
        assert_eq!(reply.status, 200);
        assert!(Instant::now() < deadline, "never went stale");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(stale_at - pending_at > timeout);

    status.record_sync(Duration::from_millis(1), 0, 0);
    assert_eq!(get(addr, "/healthz").await.status, 200);
}

/// One sample of the text format: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_value(text: &str) -> f64 {
    match text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        _ => text
            .parse()
            .unwrap_or_else(|e| panic!("bad value {text:?}: {e}")),
    }
}

/// Parses `name{k="v",...} value` strictly; panics on anything else.
fn parse_sample(line: &str) -> Sample {
    let name_end = line
        .find(['{', ' '])
        .expect("a name then labels or a value");
    let name = &line[..name_end];
    assert!(is_metric_name(name), "bad metric name in {line:?}");
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        loop {
            let start = chars.peek().map(|(i, _)| *i).expect("unterminated labels");
            if after[start..].starts_with('}') {
                rest = &after[start + 1..];
                break;
            }
            let eq = after[start..].find("=\"").expect("label=\"value\"") + start;
            let key = &after[start..eq];
            assert!(is_metric_name(key), "bad label name {key:?} in {line:?}");
            while chars.peek().is_some_and(|(i, _)| *i < eq + 2) {
                chars.next();
            }
            let mut value = String::new();
            loop {
                match chars.next().expect("unterminated label value") {
                    (_, '\\') => match chars.next().expect("dangling escape").1 {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        c => panic!("bad escape \\{c} in {line:?}"),
                    },
                    (_, '"') => break,
                    (_, c) => value.push(c),
                }
            }
            assert!(labels.insert(key.to_string(), value).is_none());
            if chars.peek().is_some_and(|(_, c)| *c == ',') {
                chars.next();
            }
        }
    }
    let value = rest.strip_prefix(' ').expect("one space before the value");
    assert!(!value.contains(' '), "timestamps are not emitted: {line:?}");
    Sample {
        name: name.to_string(),
        labels,
        value: parse_value(value),
    }
}

/// Checks every line of the OpenMetrics text format and returns the samples.
fn parse_exposition(text: &str) -> Vec<Sample> {
    let text = text
        .strip_suffix("# EOF\n")
        .expect("the exposition ends with # EOF");
    assert!(text.ends_with('\n'));
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.trim_start().splitn(3, ' ').collect();
            match words.as_slice() {
                ["HELP", name, _help] => assert!(is_metric_name(name), "{line}"),
                ["TYPE", name, kind] => {
                    assert!(is_metric_name(name), "{line}");
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(kind),
                        "{line}"
                    );
                    assert!(types.insert(name.to_string(), kind.to_string()).is_none());
                }
                _ => panic!("unexpected comment {line:?}"),
            }
            continue;
        }
        let sample = parse_sample(line);
        // A family's samples: histograms add _bucket/_sum/_count, counters _total.
        let family = [
            ("_bucket", "histogram"),
            ("_sum", "histogram"),
            ("_count", "histogram"),
            ("_total", "counter"),
        ]
        .iter()
        .find_map(|(suffix, kind)| {
            let base = sample.name.strip_suffix(suffix)?;
            (types.get(base).map(String::as_str) == Some(*kind)).then_some(base)
        })
        .unwrap_or(&sample.name);
        assert!(types.contains_key(family), "no TYPE before {line:?}");
        samples.push(sample);
    }
    samples
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let wanted: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let found: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == name && s.labels == wanted)
        .collect();
    assert_eq!(found.len(), 1, "{name}{labels:?} in {samples:#?}");
    found[0].value
}

#[tokio::test]
async fn metrics_report_what_was_recorded() {
    let clock = Arc::new(ManualClock::new(at(1_714_557_600)));
    let status = Arc::new(AgentStatus::with_clock(clock.clone()));
    let addr = start(status.clone(), ServeConfig::new(Duration::from_secs(60))).await;

    let empty = get(addr, "/metrics").await;
    assert_eq!(empty.status, 200);
    let samples = parse_exposition(&empty.body);
    assert_eq!(value(&samples, "lb_syncs_total", &[]), 0.0);
    assert_eq!(value(&samples, "lb_last_sync_timestamp_seconds", &[]), 0.0);
    assert_eq!(value(&samples, "lb_sync_pending_seconds", &[]), 0.0);

    status.record_sync(Duration::from_micros(500), 2, 3);
    status.record_sync(Duration::from_millis(30), 4, 7);
    clock.advance(Duration::from_millis(1500));
    status.record_sync(Duration::from_secs(12), 4, 7);
    status.record_pending();
    clock.advance(Duration::from_millis(250));
    status.record_sync_error();
    status.record_sync_error();
    status.record_object_errors(3);
    status.set_map_usage("LB_SERVICES", 11, 65_536);
    status.set_map_usage("LB_BACKENDS", 7, 1024);
    status.set_datapath_counters(&[("translated", 42), ("no_backend", 1), ("slot_miss", 0)]);
    status.mark_initial_sync();

    let reply = get(addr, "/metrics").await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let samples = parse_exposition(&reply.body);
    let v = |name, labels: &[(&str, &str)]| value(&samples, name, labels);
    assert_eq!(v("lb_syncs_total", &[]), 3.0);
    assert_eq!(v("lb_sync_errors_total", &[]), 2.0);
    assert_eq!(v("lb_object_errors", &[]), 3.0);
    assert_eq!(v("lb_initial_sync_done", &[]), 1.0);
    assert_eq!(v("lb_frontends", &[]), 4.0);
    assert_eq!(v("lb_backends", &[]), 7.0);
    assert_eq!(v("lb_last_sync_timestamp_seconds", &[]), 1_714_557_601.5);
    assert_eq!(v("lb_sync_pending_seconds", &[]), 0.25);
    assert_eq!(v("lb_map_entries", &[("map", "LB_SERVICES")]), 11.0);
    assert_eq!(v("lb_map_capacity", &[("map", "LB_SERVICES")]), 65_536.0);
    assert_eq!(v("lb_map_entries", &[("map", "LB_BACKENDS")]), 7.0);
    assert_eq!(v("lb_map_capacity", &[("map", "LB_BACKENDS")]), 1024.0);
    assert_eq!(
        v("lb_datapath_events_total", &[("event", "translated")]),
        42.0
    );
    assert_eq!(
        v("lb_datapath_events_total", &[("event", "no_backend")]),
        1.0
    );
    assert_eq!(
        v("lb_datapath_events_total", &[("event", "slot_miss")]),
        0.0
    );

    // The histogram: cumulative buckets from 1 ms to 10 s, +Inf equal to the count.
    let buckets: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.name == "lb_sync_duration_seconds_bucket")
        .map(|s| (parse_value(&s.labels["le"]), s.value))
        .collect();
    assert_eq!(buckets.first().unwrap().0, 0.001);
    assert_eq!(buckets[buckets.len() - 2].0, 10.0);
    assert_eq!(*buckets.last().unwrap(), (f64::INFINITY, 3.0));
    assert!(buckets
        .windows(2)
        .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    let bucket = |le: f64| buckets.iter().find(|b| b.0 == le).unwrap().1;
    assert_eq!(bucket(0.001), 1.0);
    assert_eq!(bucket(0.025), 1.0);
    assert_eq!(bucket(0.05), 2.0);
    assert_eq!(bucket(10.0), 2.0);
    assert_eq!(v("lb_sync_duration_seconds_count", &[]), 3.0);
    let sum = v("lb_sync_duration_seconds_sum", &[]);
    assert!((sum - 12.0305).abs() < 1e-9, "{sum}");

    // Every family is declared once, and the kinds are the documented ones.
    let kinds: BTreeSet<&str> = reply
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    for declared in [
        "lb_sync_duration_seconds histogram",
        "lb_syncs counter",
        "lb_sync_errors counter",
        "lb_object_errors gauge",
        "lb_last_sync_timestamp_seconds gauge",
        "lb_sync_pending_seconds gauge",
        "lb_map_entries gauge",
        "lb_map_capacity gauge",
        "lb_datapath_events counter",
    ] {
        assert!(kinds.contains(declared), "{declared} missing");
    }
}

#[tokio::test]
async fn scrape_hook_refreshes_counters() {
    let status = Arc::new(AgentStatus::new());
    let kernel = Arc::new(AtomicU64::new(0));
    let counter = kernel.clone();
    status.on_scrape(move |status| {
        status.set_datapath_counters(&[("translated", counter.load(Ordering::SeqCst))]);
    });
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;
    for expected in [5, 9] {
        kernel.store(expected, Ordering::SeqCst);
        let samples = parse_exposition(&get(addr, "/metrics").await.body);
        let got = value(
            &samples,
            "lb_datapath_events_total",
            &[("event", "translated")],
        );
        assert_eq!(got, expected as f64);
    }
}

#[tokio::test]
async fn label_values_survive_escaping() {
    let status = Arc::new(AgentStatus::new());
    status.set_map_usage("odd \"map\"\\\nname", 1, 2);
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;
    let samples = parse_exposition(&get(addr, "/metrics").await.body);
    assert_eq!(
        value(
            &samples,
            "lb_map_entries",
            &[("map", "odd \"map\"\\\nname")]
        ),
        1.0
    );
}

#[tokio::test]
async fn other_paths_and_methods_are_refused() {
    let status = Arc::new(AgentStatus::new());
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;
    for path in ["/", "/healthz/", "/healthzz", "/metrics/x", "/livez", "*"] {
        let reply = get(addr, path).await;
        assert_eq!(reply.status, 404, "{path}");
    }
    let post = exchange(
        addr,
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), Some("GET, HEAD"));

    let head = exchange(addr, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(head.status, 503);
    assert!(head.body.is_empty());
    assert_ne!(head.header("content-length"), Some("0"));

    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /healthz\r\n\r\n",
        b"GET  /healthz HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTP/1.1 extra\r\n\r\n",
        b"GET /\xff HTTP/1.1\r\n\r\n",
    ] {
        let reply = exchange(addr, bad).await;
        assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(bad));
    }
    // hyper refuses any version but HTTP/1.x as a malformed request.
    assert_eq!(
        exchange(addr, b"GET /healthz HTTP/2.0\r\n\r\n")
            .await
            .status,
        400
    );
    // HTTP/1.0 and bare newlines are still understood.
    assert_eq!(
        exchange(addr, b"GET /metrics HTTP/1.0\n\n").await.status,
        200
    );
}

#[tokio::test]
async fn routes_limit_what_a_server_answers() {
    let status = Arc::new(AgentStatus::new());
    let timeout = Duration::from_secs(60);
    let healthz = start(
        status.clone(),
        ServeConfig::new(timeout).routes(Routes::HEALTHZ),
    )
    .await;
    let metrics = start(status, ServeConfig::new(timeout).routes(Routes::METRICS)).await;
    assert_eq!(get(healthz, "/healthz").await.status, 503);
    assert_eq!(get(healthz, "/metrics").await.status, 404);
    assert_eq!(get(metrics, "/metrics").await.status, 200);
    assert_eq!(get(metrics, "/healthz").await.status, 404);
    // kube-proxy's /proxyMode and lb's /status go with the metrics.
    let mode = get(metrics, "/proxyMode").await;
    assert_eq!((mode.status, mode.body.as_str()), (200, "ebpf"));
    assert_eq!(get(healthz, "/proxyMode").await.status, 404);
    assert_eq!(get(healthz, "/status").await.status, 404);
}

#[tokio::test]
async fn status_lists_unreadable_files_and_fetch_status_reads_it() {
    let status = Arc::new(AgentStatus::new());
    let addr = start(status.clone(), ServeConfig::new(Duration::from_secs(60))).await;
    let reply = get(addr, "/status").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.json()["unreadableFiles"], serde_json::json!([]));

    status.set_unreadable_files(vec![(
        "/m/a.yaml".into(),
        "a FIFO, not a regular file".into(),
    )]);
    let report = ops::fetch_status(addr, CLIENT_DEADLINE).await.unwrap();
    assert_eq!(
        report.unreadable_files,
        [ops::UnreadableFile {
            path: "/m/a.yaml".into(),
            reason: "a FIFO, not a regular file".into()
        }]
    );

    // Asked where nothing listens: the error names the address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = closed.local_addr().unwrap();
    drop(closed);
    let err = ops::fetch_status(nobody, CLIENT_DEADLINE)
        .await
        .unwrap_err();
    assert!(err.to_string().contains(&nobody.to_string()), "{err}");
}

#[tokio::test]
async fn oversize_requests_are_rejected() {
    let status = Arc::new(AgentStatus::new());
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;

    // A head that never ends: rejected once it passes the limit, and the client,
    // still sending, reads the answer.
    let mut request = b"GET /healthz HTTP/1.1\r\n".to_vec();
    while request.len() <= 4 * MAX_REQUEST_BYTES {
        request.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let reply = exchange(addr, &request).await;
    assert_eq!(reply.status, 431);

    // A complete head just over the limit, in one piece.
    let long_path = format!("/healthz?{}", "a".repeat(MAX_REQUEST_BYTES));
    let reply = get(addr, &long_path).await;
    assert_eq!(reply.status, 431);

    // One just under it is fine.
    let fits = format!("/healthz?{}", "a".repeat(MAX_REQUEST_BYTES - 100));
    assert_eq!(get(addr, &fits).await.status, 503);
}

#[tokio::test]
async fn silent_clients_are_timed_out() {
    let status = Arc::new(AgentStatus::new());
    let config =
        ServeConfig::new(Duration::from_secs(60)).request_timeout(Duration::from_millis(200));
    let addr = start(status, config).await;
    let started = Instant::now();
    // Half a request line, then nothing.
    let reply = exchange(addr, b"GET /hea").await;
    assert_eq!(reply.status, 408);
    assert!(started.elapsed() >= Duration::from_millis(200));
    // The server still answers others.
    assert_eq!(get(addr, "/metrics").await.status, 200);
}

#[tokio::test]
async fn concurrent_requests_are_all_answered() {
    let status = Arc::new(AgentStatus::new());
    status.mark_initial_sync();
    status.record_sync(Duration::from_millis(1), 1, 1);
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;
    let mut tasks = Vec::new();
    for i in 0..100 {
        let path = if i % 2 == 0 { "/healthz" } else { "/metrics" };
        tasks.push(tokio::spawn(async move { get(addr, path).await.status }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), 200);
    }
}

#[tokio::test]
async fn binding_a_taken_port_fails_with_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let status = Arc::new(AgentStatus::new());
    let err = ops::serve(addr, status, Duration::from_secs(1))
        .await
        .unwrap_err();
    let OpsError::Bind { addr: failed, .. } = &err;
    assert_eq!(*failed, addr);
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

/// `/healthz` must answer within this while hostile clients are connected.
const PROBE_DEADLINE: Duration = Duration::from_secs(1);

async fn probe_healthz(addr: SocketAddr, when: &str) {
    let reply = tokio::time::timeout(PROBE_DEADLINE, get(addr, "/healthz"))
        .await
        .unwrap_or_else(|_| panic!("/healthz did not answer within {PROBE_DEADLINE:?} {when}"));
    assert_eq!(reply.status, 200, "{when}: {}", reply.body);
}

/// A hostile crowd, as a kubelet probe or a load balancer's health check would meet
/// it: 200 clients that send half a request line and stall (slowloris), malformed
/// and oversized requests. `/healthz` keeps answering 200 within a second
/// throughout, with the default connection limit and with one far below the crowd
/// (where the stalled clients are closed to make room, oldest first).
#[tokio::test]
async fn healthz_survives_slow_and_malformed_clients() {
    const STALLED: usize = 200;
    let status = Arc::new(AgentStatus::new());
    status.record_sync(Duration::from_millis(1), 1, 1);
    status.mark_initial_sync();
    // A request timeout longer than the test: only the connection handling can
    // keep the probes in, not stalled clients timing out.
    let patient =
        ServeConfig::new(Duration::from_secs(60)).request_timeout(Duration::from_secs(60));
    for (config, limit) in [
        (patient.clone(), None),
        (patient.clone().max_connections(32), Some(32)),
    ] {
        let addr = start(status.clone(), config).await;
        let mut stalled = Vec::new();
        for i in 0..STALLED {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(b"GET /hea").await.unwrap();
            stalled.push(stream);
            if i % 25 == 24 {
                probe_healthz(addr, &format!("with {} stalled clients", i + 1)).await;
            }
        }
        let mut huge = b"GET /healthz HTTP/1.1\r\n".to_vec();
        while huge.len() <= 4 * MAX_REQUEST_BYTES {
            huge.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        for (request, expected) in [
            (&b"GARBAGE\r\n\r\n"[..], 400),
            (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
            (b"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n", 400),
            (&huge, 431),
        ] {
            let reply = exchange(addr, request).await;
            assert_eq!(
                reply.status,
                expected,
                "{}",
                String::from_utf8_lossy(request)
            );
            probe_healthz(addr, "after a bad request").await;
        }
        for round in 0..10 {
            probe_healthz(addr, &format!("round {round} with the crowd still there")).await;
        }
        // With the low limit, the stalled clients made room: all but the newest
        // few were closed by the server.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        let mut closed = 0;
        for stream in &mut stalled {
            let mut buf = [0u8; 64];
            if let Ok(read) = tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                assert!(
                    !matches!(read, Ok(n) if n > 0),
                    "a stalled client got an answer"
                );
                closed += 1;
            }
        }
        match limit {
            None => assert_eq!(closed, 0, "no stalled client is closed under the limit"),
            Some(limit) => assert!(
                closed >= STALLED - limit,
                "{closed} of {STALLED} stalled clients closed with a limit of {limit}"
            ),
        }
    }
}

/// Every scrape hook runs (the service counters' and NetworkPolicy's), and the
/// per-pod drops come out as `lb_policy_drops_total` by pod and direction.
#[tokio::test]
async fn every_scrape_hook_runs_and_policy_drops_are_per_pod() {
    let status = Arc::new(AgentStatus::new());
    status.on_scrape(|status| status.set_datapath_counters(&[("translated", 3)]));
    status.on_scrape(|status| status.set_policy_drops(&[("x/a".to_owned(), 7, 0)]));
    let addr = start(status, ServeConfig::new(Duration::from_secs(60))).await;
    let samples = parse_exposition(&get(addr, "/metrics").await.body);
    let event = [("event", "translated")];
    assert_eq!(value(&samples, "lb_datapath_events_total", &event), 3.0);
    let drops = |direction| {
        value(
            &samples,
            "lb_policy_drops_total",
            &[("pod", "x/a"), ("direction", direction)],
        )
    };
    assert_eq!((drops("ingress"), drops("egress")), (7.0, 0.0));
}

/// `/policy/NS/NAME` (what `lb policy POD` asks): off unless NetworkPolicy is
/// on, a pod it knows as JSON, anything else refused with the reason.
#[tokio::test]
async fn policy_queries_name_the_pod_or_say_why_not() {
    use lb_userspace::control::policy::view::PodPolicies;
    let status = Arc::new(AgentStatus::new());
    let addr = start(status.clone(), ServeConfig::new(Duration::from_secs(60))).await;
    let off = get(addr, "/policy/x/a").await;
    assert_eq!(off.status, 404);
    assert!(off.body.contains("--network-policy on"), "{}", off.body);
    status.on_policy_query(|namespace, name| {
        (namespace == "x" && name == "a").then(|| PodPolicies {
            namespace: namespace.into(),
            name: name.into(),
            node: "node1".into(),
            local: true,
            host_network: false,
            addresses: vec!["10.244.1.11".parse().unwrap()],
            endpoint: Some(4),
            policies: Vec::new(),
            rules: Vec::new(),
        })
    });
    let found = get(addr, "/policy/x/a").await;
    assert_eq!(found.status, 200);
    let pod: PodPolicies = serde_json::from_str(&found.body).unwrap();
    assert_eq!((pod.endpoint, pod.addresses.len()), (Some(4), 1));
    let unknown = get(addr, "/policy/x/zz").await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.body.contains("no pod x/zz"), "{}", unknown.body);
    for bad in ["/policy/x", "/policy//a", "/policy/x/a/b"] {
        assert_eq!(get(addr, bad).await.status, 400, "{bad}");
    }
}
