//! Settings that change how objects are read, not what they say: this node's
//! name, addresses and zone, the cluster's NodePort range, and the default
//! algorithm of external frontends.

use std::net::IpAddr;

use crate::model::Algorithm;

/// Settings that change how objects are read, not what they say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceOptions {
    /// This node's name as EndpointSlices spell it in `endpoints[].nodeName`, for
    /// `internalTrafficPolicy: Local`.
    pub node_name: String,
    /// This node's addresses, both families: NodePorts are served on each of them.
    pub node_ips: Vec<IpAddr>,
    /// The cluster's `--service-node-port-range`; NodePorts outside it are refused
    /// so a Service cannot take over a port the node itself uses.
    pub node_port_range: NodePortRange,
    /// This node's zone (its Node's `topology.kubernetes.io/zone` label, else
    /// `--zone`), for endpoints hinted `forZones`; empty when unknown.
    pub zone: String,
    /// `--lb-algorithm`: how NodePort, LoadBalancer and externalIP frontends pick a
    /// backend, unless the Service's `service.lb/algorithm` annotation says.
    pub lb_algorithm: Algorithm,
}

/// An inclusive port range, `30000-32767` unless the cluster says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodePortRange {
    pub first: u16,
    pub last: u16,
}

impl Default for NodePortRange {
    fn default() -> Self {
        NodePortRange {
            first: 30000,
            last: 32767,
        }
    }
}

impl std::str::FromStr for NodePortRange {
    type Err = String;

    /// `FIRST-LAST`, as kube-apiserver's `--service-node-port-range` takes it.
    fn from_str(s: &str) -> Result<Self, String> {
        let (first, last) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected FIRST-LAST, e.g. 30000-32767"))?;
        let port = |p: &str| {
            p.trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("{p:?} is not a port (1-65535)"))
        };
        let range = NodePortRange {
            first: port(first)?,
            last: port(last)?,
        };
        if range.first > range.last {
            return Err(format!("{s:?}: the first port is above the last"));
        }
        Ok(range)
    }
}

impl std::fmt::Display for NodePortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}
