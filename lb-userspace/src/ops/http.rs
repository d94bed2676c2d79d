//! The HTTP glue of the agent's listeners: hyper's HTTP/1 server on tokio, one
//! request per connection, GET and HEAD only.
//!
//! hyper parses the requests and answers malformed (400), oversized (431) ones
//! itself. What is added here is what a health endpoint on a network-facing port
//! needs against slow or hostile clients:
//! - a request head must arrive within the request timeout (hyper's
//!   `header_read_timeout`; answered 408 here), and the whole exchange within twice
//!   that;
//! - at most [`ServeConfig::max_connections`](super::ServeConfig) connections are
//!   held. A connection over the limit is still accepted: it evicts the oldest one
//!   that has not delivered a request head, so clients that connect and stall
//!   cannot keep a health probe out;
//! - the connection is closed gracefully (FIN, then what the client still sends is
//!   read and dropped for a moment), so an error answer to a client that is still
//!   sending is not destroyed by a reset before the client reads it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// Longest request head (request line and headers) accepted; longer ones get 431.
/// hyper's smallest read buffer limit.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;

/// Bytes of an unread request still taken after the response, so that closing the
/// socket does not reset the connection before the client read the response.
const DRAIN_BYTES: usize = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(1);
/// Pause after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What hyper cannot send for us: its header timeout closes the connection
/// without an answer, and a client deserves to know why.
fn request_timeout_response() -> String {
    let body = "request head not received in time\n";
    format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// An answer for a known path; the glue adds the method check and the headers.
pub(super) struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    pub fn new(status: StatusCode, content_type: &'static str, body: String) -> Self {
        Self {
            status,
            content_type,
            body,
        }
    }

    pub fn text(status: StatusCode, body: &str) -> Self {
        Self::new(status, "text/plain; charset=utf-8", format!("{body}\n"))
    }
}

/// Answers the path of a request, `None` for 404.
pub(super) type Answer = Arc<dyn Fn(&str) -> Option<Reply> + Send + Sync>;

#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub request_timeout: Duration,
    pub max_connections: usize,
}

struct Held {
    /// Set once hyper handed the request head to the service.
    head_seen: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

/// Serves `listener` until the future is dropped; the connections it spawned are
/// aborted with it.
pub(super) async fn serve(listener: TcpListener, limits: Limits, answer: Answer) {
    let mut held = HeldConnections::default();
    let held = &mut held.0;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                warn!(addr = ?listener.local_addr().ok(), "accepting a connection failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        held.retain(|c| !c.task.is_finished());
        if held.len() >= limits.max_connections.max(1) {
            let victim = held
                .iter()
                .position(|c| !c.head_seen.load(Ordering::Relaxed))
                .unwrap_or(0);
            if let Some(evicted) = held.remove(victim) {
                debug!("connection limit reached: closing the oldest idle connection");
                evicted.task.abort();
            }
        }
        let head_seen = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(connection(
            stream,
            limits,
            answer.clone(),
            head_seen.clone(),
        ));
        held.push_back(Held { head_seen, task });
    }
}

/// The connections of one listener, aborted when its server's future is dropped.
#[derive(Default)]
struct HeldConnections(VecDeque<Held>);

impl Drop for HeldConnections {
    fn drop(&mut self) {
        for held in &self.0 {
            held.task.abort();
        }
    }
}

async fn connection(mut stream: TcpStream, limits: Limits, answer: Answer, head: Arc<AtomicBool>) {
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        head.store(true, Ordering::Relaxed);
        let response = respond(&request, &answer);
        debug!(status = %response.status(), "ops request answered");
        std::future::ready(Ok::<_, Infallible>(response))
    });
    let served = {
        let conn = hyper::server::conn::http1::Builder::new()
            .keep_alive(false)
            .max_buf_size(MAX_REQUEST_BYTES)
            .timer(TokioTimer::new())
            .header_read_timeout(limits.request_timeout)
            .serve_connection(TokioIo::new(&mut stream), service);
        tokio::time::timeout(limits.request_timeout * 2, conn).await
    };
    match served {
        Ok(Err(e)) if e.is_timeout() => {
            let _ = tokio::time::timeout(
                limits.request_timeout,
                stream.write_all(request_timeout_response().as_bytes()),
            )
            .await;
        }
        Ok(Err(e)) => debug!("ops connection: {e}"),
        Ok(Ok(())) => {}
        // The client did not take the answer in time.
        Err(_) => return,
    }
    linger(&mut stream).await;
}

/// Sends FIN, then reads what the client still sends (bounded in bytes and time):
/// closing with unread data makes the kernel send a reset, which can destroy the
/// response before the client reads it.
async fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let mut left = DRAIN_BYTES;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// Why a GET to an agent listener got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("HTTP exchange with {addr} failed: {source}")]
    Http {
        addr: SocketAddr,
        #[source]
        source: hyper::Error,
    },
}

/// `GET path` from `addr` with hyper's HTTP/1 client: the status and the body,
/// all within `timeout`.
pub(super) async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), GetError> {
    let exchange = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| GetError::Connect { addr, source })?;
        let http = |source| GetError::Http { addr, source };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http)?;
        let driver = tokio::spawn(conn);
        let request = Request::get(path)
            .header(HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .expect("a path and a socket address make a valid request");
        let response = sender.send_request(request).await.map_err(http)?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(http)?;
        driver.abort();
        Ok((status, body.to_bytes()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| GetError::Timeout { addr, timeout })?
}

fn respond(request: &Request<Incoming>, answer: &Answer) -> Response<Full<Bytes>> {
    let Some(reply) = answer(request.uri().path()) else {
        return response(Reply::text(StatusCode::NOT_FOUND, "not found"));
    };
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut refused = response(Reply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are allowed",
        ));
        refused
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return refused;
    }
    // hyper leaves the body out of a HEAD answer and keeps its Content-Length.
    response(reply)
}

fn response(reply: Reply) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(reply.body)));
    *response.status_mut() = reply.status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
