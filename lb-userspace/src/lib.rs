//! The agent: loads the kernel programs, turns Kubernetes objects into a desired
//! service table, and reconciles the pinned maps to it.

pub mod agent;
pub mod codec;
pub mod conntrack;
pub mod loader;
pub mod maglev;
pub mod maps;
pub mod model;
pub mod netlink;
pub mod node_net;
pub mod ops;
pub mod pin_lock;
pub mod pins;
pub mod reconcile;
pub mod snapshot;
pub mod source;
pub mod source_ranges;
pub mod stale_sockets;
pub mod sys;
pub mod table;
pub mod tc_links;
