//! What `lb policy POD` asks the agent (its ops listener's `/policy/NS/NAME`): the
//! pod as NetworkPolicy knows it, the policies selecting it, and what the rule ids
//! of their allows name. The verdict for a peer is not here: the CLI reads it from
//! the pinned maps through the kernel programs' own rule
//! (`lb_common::policy::verdict`), so it shows what the datapath does.

use std::net::IpAddr;

use lb_common::policy::{POLICY_DIR_EGRESS, POLICY_DIR_INGRESS};
use serde::{Deserialize, Serialize};

/// One pod, as the agent's policy compiler holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPolicies {
    pub namespace: String,
    pub name: String,
    /// `spec.nodeName`.
    pub node: String,
    /// The pod runs on this agent's node: its policies are enforced here (a pod
    /// elsewhere is only a peer to this node).
    pub local: bool,
    /// `spec.hostNetwork`: never subject to policy.
    pub host_network: bool,
    /// `status.podIPs`.
    pub addresses: Vec<IpAddr>,
    /// The endpoint id of a local pod (its drop counters' index).
    pub endpoint: Option<u32>,
    /// The policies selecting it, by (namespace, name).
    pub policies: Vec<SelectingPolicy>,
    /// The rules of those policies, by id (`PolicyAllow::rule`).
    pub rules: Vec<RuleName>,
}

/// A policy selecting the pod, and the directions it isolates the pod for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectingPolicy {
    pub namespace: String,
    pub name: String,
    pub ingress: bool,
    pub egress: bool,
}

/// What a rule id names: `spec.ingress[index]` or `spec.egress[index]` of a policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleName {
    pub id: u32,
    pub namespace: String,
    pub policy: String,
    /// `ingress` or `egress`.
    pub direction: String,
    pub index: usize,
}

/// `ingress` or `egress`, as the policy's spec names the list.
pub fn direction_name(direction: u8) -> &'static str {
    match direction {
        POLICY_DIR_EGRESS => "egress",
        POLICY_DIR_INGRESS => "ingress",
        _ => "?",
    }
}

impl RuleName {
    /// `x/allow-db spec.ingress[0]`.
    pub fn describe(&self) -> String {
        format!(
            "{}/{} spec.{}[{}]",
            self.namespace, self.policy, self.direction, self.index
        )
    }
}
