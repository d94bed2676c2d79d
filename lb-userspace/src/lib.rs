//! The agent: loads the kernel programs, turns Kubernetes objects into a desired
//! service table, and reconciles the pinned maps to it.

pub mod model;
pub mod reconcile;
pub mod source;
