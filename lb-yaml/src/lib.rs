//! Reading Kubernetes manifests written as YAML, fast: the document split and a
//! strict reader for block-style YAML (what `kubectl get -o yaml` writes) that
//! deserializes straight into typed objects. Whatever the block reader leaves is for a
//! full YAML parser; the tests hold the two to reading the same values.
//!
//! Its own crate, without the agent's dependencies, so the reader, its differential
//! tests, the fuzz target and the benchmark against YAML libraries
//! (`examples/yaml_bench.rs`) build and run quickly on their own.

pub mod block;
mod kinded;
mod split;

pub use kinded::Kinded;
pub use split::{split_documents, Document};

#[cfg(test)]
mod fuzz;
