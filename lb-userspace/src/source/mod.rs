//! Where Services and EndpointSlices come from, and kube-proxy's rules for turning
//! them into a [`crate::model::DesiredState`].
//!
//! Loading ([`yaml`]) and interpreting ([`build_desired`]) are separate so that a
//! future API-server watch can feed the same rules. Both report problems with single
//! objects as [`ObjectError`]s and carry on: one bad Service must not stop the others
//! from being proxied.

use std::fmt;
use std::path::PathBuf;

use crate::model::Frontend;

mod block_yaml;
mod desired;
pub mod files;
pub mod kube;
pub mod yaml;

pub use desired::{build_desired, NodePortRange, SourceOptions, LABEL_ZONE};

/// Where a loaded document came from; only set for errors found while loading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    /// 1-based, counting the documents of the file as `---` separates them.
    pub document: usize,
    /// 1-based line of the file where the document starts.
    pub line: usize,
    /// 0-based index into `items` when the document is a `List`.
    pub item: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} document {} (line {})",
            self.file.display(),
            self.document,
            self.line
        )?;
        if let Some(item) = self.item {
            write!(f, " items[{item}]")?;
        }
        Ok(())
    }
}

/// A problem with one object (or one part of it). The rest of the source still applies.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ObjectError {
    /// `Service`, `EndpointSlice`, another kind as written, or empty when the document
    /// could not be read far enough to tell.
    pub kind: String,
    /// Empty when unknown.
    pub namespace: String,
    /// Empty when unknown.
    pub name: String,
    pub reason: Problem,
    /// Set for errors found while loading files.
    pub location: Option<Location>,
}

impl ObjectError {
    pub(crate) fn new(kind: &str, namespace: &str, name: &str, reason: Problem) -> Self {
        ObjectError {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            reason,
            location: None,
        }
    }
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(location) = &self.location {
            write!(f, "{location}: ")?;
        }
        if !self.kind.is_empty() {
            f.write_str(&self.kind)?;
            let name = if self.name.is_empty() {
                "<unnamed>"
            } else {
                &self.name
            };
            if self.namespace.is_empty() {
                write!(f, " {name}: ")?;
            } else {
                write!(f, " {}/{name}: ", self.namespace)?;
            }
        }
        write!(f, "{}", self.reason)
    }
}

/// What is wrong with an object, and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("not valid YAML: {message}")]
    InvalidYaml { message: String },
    #[error("not valid JSON: {message}")]
    InvalidJson { message: String },
    #[error("not a Kubernetes object (expected a mapping with apiVersion and kind)")]
    NotAnObject,
    #[error("has no kind; save objects with `kubectl get -o yaml`")]
    MissingKind,
    #[error("`items` is not a list")]
    ItemsNotAList,
    #[error("apiVersion {found:?} is not supported for {kind}; export it as {expected}")]
    UnsupportedApiVersion {
        kind: String,
        found: String,
        expected: &'static str,
    },
    #[error("cannot be read as a {kind}: {message}")]
    Schema { kind: &'static str, message: String },

    #[error("has no spec.clusterIP; set one, or `clusterIP: None` for a headless Service")]
    MissingClusterIp,
    #[error("cluster IP {value:?} is not an IP address")]
    InvalidClusterIp { value: String },
    #[error(
        "unsupported address family: cluster IPs {addresses} have no IPv4 address; \
         only IPv4 Services are proxied"
    )]
    UnsupportedAddressFamily { addresses: String },
    #[error("port {port} is out of range (1-65535)")]
    PortOutOfRange { port: i32 },
    #[error("port {port}/{protocol}: protocol {protocol} is not supported (only TCP and UDP); that port is not proxied")]
    UnsupportedProtocol { port: i32, protocol: String },
    #[error(
        "sessionAffinityConfig.clientIP.timeoutSeconds {seconds} is out of range (1-86400); \
         the Service is not proxied until it is fixed"
    )]
    AffinityTimeoutOutOfRange { seconds: i32 },
    #[error("nodePort {port} of port {service_port} is out of range (1-65535); that NodePort is not proxied")]
    NodePortOutOfRange { service_port: i32, port: i32 },
    #[error("nodePort {port} of port {service_port} is outside the NodePort range {range}; that NodePort is not proxied (see --nodeport-range)")]
    NodePortOutsideRange {
        service_port: i32,
        port: u16,
        range: String,
    },
    #[error("healthCheckNodePort {port} is out of range (1-65535); no health check is served")]
    HealthCheckNodePortOutOfRange { port: i32 },
    #[error("healthCheckNodePort {port} is already used by Service {owner}, which keeps it")]
    DuplicateHealthCheckNodePort { port: u16, owner: String },
    #[error("{field} {value:?} is not an IP address; that address is not proxied")]
    InvalidExternalAddress { field: &'static str, value: String },
    #[error(
        "spec.loadBalancerSourceRanges {value:?} is not a CIDR (e.g. 203.0.113.0/24); it \
         admits no client to the load-balancer IPs until it is fixed"
    )]
    InvalidSourceRange { value: String },
    #[error("frontend {frontend} is already used by Service {owner}, which keeps it; give one of them another cluster IP or port")]
    DuplicateFrontend { frontend: Frontend, owner: String },

    #[error("has no label kubernetes.io/service-name; add it to tie the slice to its Service")]
    MissingServiceName,
    #[error("Service {service} not found; load the Service together with its EndpointSlices")]
    ServiceNotFound { service: String },
    #[error("port {name:?} has no port number; its endpoints are not used for that port")]
    EndpointPortMissing { name: String },
    #[error("port {name:?}: port {port} is out of range (1-65535); its endpoints are not used for that port")]
    EndpointPortOutOfRange { name: String, port: i32 },
    #[error("endpoints[{index}] has no address; that endpoint is skipped")]
    EndpointWithoutAddress { index: usize },
    #[error(
        "endpoints[{index}]: address {address:?} is not an IPv4 address; that endpoint is skipped"
    )]
    InvalidEndpointAddress { index: usize, address: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_object_and_location() {
        let e = ObjectError::new(
            "Service",
            "default",
            "web",
            Problem::PortOutOfRange { port: 70000 },
        );
        assert_eq!(
            e.to_string(),
            "Service default/web: port 70000 is out of range (1-65535)"
        );

        let e = ObjectError {
            location: Some(Location {
                file: "svc.yaml".into(),
                document: 2,
                line: 14,
                item: Some(3),
            }),
            ..ObjectError::new("", "", "", Problem::NotAnObject)
        };
        assert_eq!(
            e.to_string(),
            "svc.yaml document 2 (line 14) items[3]: not a Kubernetes object \
             (expected a mapping with apiVersion and kind)"
        );

        let e = ObjectError::new("EndpointSlice", "", "", Problem::MissingServiceName);
        assert!(e
            .to_string()
            .starts_with("EndpointSlice <unnamed>: has no label"));
    }
}
