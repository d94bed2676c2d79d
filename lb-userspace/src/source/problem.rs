//! What can be wrong with one object, said so that the operator knows which object
//! and what to do: every source and every rule reports through these, and the rest
//! of the objects still apply.

use std::fmt;
use std::path::PathBuf;

use crate::model::Frontend;

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
            write!(f, "{}", Capped(&self.kind))?;
            let name = if self.name.is_empty() {
                "<unnamed>"
            } else {
                &self.name
            };
            if self.namespace.is_empty() {
                write!(f, " {}: ", Capped(name))?;
            } else {
                write!(f, " {}/{}: ", Capped(&self.namespace), Capped(name))?;
            }
        }
        write!(f, "{}", self.reason)
    }
}

/// A value from a manifest as it goes into a message: whole when short, else its
/// start and its length. Every rebuild logs every problem again, and one 10 MB field
/// would otherwise be copied into the log each time.
pub struct Capped<'a>(pub &'a str);

impl Capped<'_> {
    /// Bytes of a value shown whole; longer ones are cut at a character boundary.
    pub const MAX: usize = 200;

    fn parts(&self) -> (&str, Option<usize>) {
        if self.0.len() <= Self::MAX {
            return (self.0, None);
        }
        let mut end = Self::MAX;
        while !self.0.is_char_boundary(end) {
            end -= 1;
        }
        (&self.0[..end], Some(self.0.len()))
    }
}

impl fmt::Display for Capped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.parts() {
            (whole, None) => f.write_str(whole),
            (start, Some(len)) => write!(f, "{start}... ({len} bytes)"),
        }
    }
}

/// Quoted like `{:?}` of a string; a cut value's quote stays open before the length.
impl fmt::Debug for Capped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.parts() {
            (whole, None) => write!(f, "{whole:?}"),
            (start, Some(len)) => {
                let quoted = format!("{start:?}");
                write!(f, "{}... ({len} bytes)", &quoted[..quoted.len() - 1])
            }
        }
    }
}

/// What is wrong with an object, and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("not valid YAML: {}", Capped(.message))]
    InvalidYaml { message: String },
    #[error("not valid JSON: {}", Capped(.message))]
    InvalidJson { message: String },
    #[error("not a Kubernetes object (expected a mapping with apiVersion and kind)")]
    NotAnObject,
    #[error("has no kind; save objects with `kubectl get -o yaml`")]
    MissingKind,
    #[error("has no metadata.name; name it (the API server refuses an object without one)")]
    MissingName,
    #[error("`items` is not a list")]
    ItemsNotAList,
    #[error("apiVersion {:?} is not supported for {}; export it as {expected}", Capped(.found), Capped(.kind))]
    UnsupportedApiVersion {
        kind: String,
        found: String,
        expected: &'static str,
    },
    #[error("cannot be read as a {kind}: {}", Capped(.message))]
    Schema { kind: &'static str, message: String },

    #[error("has no spec.clusterIP; set one, or `clusterIP: None` for a headless Service")]
    MissingClusterIp,
    #[error("cluster IP {:?} is not an IP address", Capped(.value))]
    InvalidClusterIp { value: String },
    #[error(
        "spec.ipFamilies [{}] contradicts spec.clusterIPs [{}]; the Service is not \
         proxied until they name the same families in the same order",
        Capped(.families),
        Capped(.addresses)
    )]
    IpFamiliesMismatch { families: String, addresses: String },
    #[error(
        "spec.clusterIPs [{}] must hold one address, or one of each family; \
         the Service is not proxied",
        Capped(.addresses)
    )]
    ClusterIpsNotOnePerFamily { addresses: String },
    #[error(
        "spec.ipFamilyPolicy {policy} is not met by spec.clusterIPs; serving {}",
        Capped(.served)
    )]
    IpFamilyPolicyNotMet {
        policy: &'static str,
        served: String,
    },
    #[error("port {port} is out of range (1-65535)")]
    PortOutOfRange { port: i32 },
    #[error("port {port}/{}: protocol {} is not supported (only TCP and UDP); that port is not proxied", Capped(.protocol), Capped(.protocol))]
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
    #[error("healthCheckNodePort {port} is already used by Service {}, which keeps it", Capped(.owner))]
    DuplicateHealthCheckNodePort { port: u16, owner: String },
    #[error("{field} {:?} is not an IP address; that address is not proxied", Capped(.value))]
    InvalidExternalAddress { field: &'static str, value: String },
    #[error(
        "spec.loadBalancerSourceRanges {:?} is not a CIDR (e.g. 203.0.113.0/24); it \
         admits no client to the load-balancer IPs until it is fixed",
        Capped(.value)
    )]
    InvalidSourceRange { value: String },
    #[error(
        "annotation {annotation}: {:?} is neither `maglev` nor `random`; its NodePort, \
         LoadBalancer and externalIP frontends use the agent's --lb-algorithm ({default})",
        Capped(.value)
    )]
    InvalidAlgorithm {
        annotation: &'static str,
        value: String,
        default: crate::model::Algorithm,
    },
    #[error("frontend {frontend} is already used by Service {}, which keeps it; give one of them another cluster IP or port", Capped(.owner))]
    DuplicateFrontend { frontend: Frontend, owner: String },
    #[error(
        "is defined again in {}; the definition in {} (the first by file name, then \
         document) is the one used; remove the other",
        .file.display(),
        .kept_in.display()
    )]
    DuplicateObject { file: PathBuf, kept_in: PathBuf },

    #[error("has no label kubernetes.io/service-name; add it to tie the slice to its Service")]
    MissingServiceName,
    #[error("Service {} not found; load the Service together with its EndpointSlices", Capped(.service))]
    ServiceNotFound { service: String },
    #[error("port {:?} has no port number; its endpoints are not used for that port", Capped(.name))]
    EndpointPortMissing { name: String },
    #[error("port {:?}: port {port} is out of range (1-65535); its endpoints are not used for that port", Capped(.name))]
    EndpointPortOutOfRange { name: String, port: i32 },
    #[error("endpoints[{index}] has no address; that endpoint is skipped")]
    EndpointWithoutAddress { index: usize },
    #[error(
        "endpoints[{index}]: address {:?} is not an {family} address (the slice's \
         addressType); that endpoint is skipped",
        Capped(.address)
    )]
    InvalidEndpointAddress {
        index: usize,
        address: String,
        family: &'static str,
    },

    #[error(
        "{field}: {}; the NetworkPolicy is not enforced until it is fixed (the pods it \
         selects are judged by the other policies only)",
        Capped(.message)
    )]
    InvalidNetworkPolicy { field: String, message: String },
    #[error("{field}: {}; the Pod is left out of network policy until it is fixed", Capped(.message))]
    InvalidPod { field: String, message: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_capped_at_a_character_boundary() {
        assert_eq!(Capped("short").to_string(), "short");
        assert_eq!(format!("{:?}", Capped("a\"b")), "\"a\\\"b\"");
        let long = "é".repeat(1000);
        let shown = Capped(&long).to_string();
        assert!(shown.ends_with("... (2000 bytes)"), "{shown}");
        assert!(shown.len() <= Capped::MAX + 20, "{shown}");
        let quoted = format!("{:?}", Capped(&long));
        assert!(quoted.starts_with("\"éé") && quoted.ends_with("é... (2000 bytes)"));
        let e = Problem::InvalidClusterIp {
            value: "1".repeat(10 << 20),
        };
        assert!(e.to_string().len() < 400, "{}", e.to_string().len());
    }

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
