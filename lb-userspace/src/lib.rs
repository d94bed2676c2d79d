//! The agent: loads the kernel programs, turns Kubernetes objects into a desired
//! service table, and reconciles the pinned maps to it.
//!
//! One room per concern, each importing only from the rooms listed before it:
//! a change flows from [`source`] (objects as they arrive) through [`control`]
//! (kube-proxy's rules, then the plan) into [`datapath`] (the maps), driven by
//! [`agent`].

pub mod agent;
pub mod control;
pub mod datapath;
pub mod model;
pub mod node;
pub mod ops;
pub mod source;
pub mod stale_sockets;
