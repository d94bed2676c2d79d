//! Where Services, EndpointSlices and Nodes come from: manifest files ([`files`],
//! read by [`yaml`]) or the API server ([`kube`], cached in [`shards`]), decoded into
//! the lean types the rules read ([`lean`]). I/O and decoding only; what the objects
//! mean is [`crate::control`]'s job. Both sources report problems with single objects
//! as [`ObjectError`]s and carry on: one bad Service must not stop the others from
//! being proxied.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use crate::model::policy::{NetworkPolicy, PolicyNamespace, PolicyPod};

pub mod changes;
pub mod files;
pub mod intern;
pub mod kube;
pub mod labels;
pub mod lean;
pub mod masq_config;
pub mod policy;
pub mod problem;
mod store;
pub mod yaml;

pub use lean::{EndpointSlice, Service};
pub use problem::{Capped, Location, ObjectError, Problem};
pub use yaml::{FileError, FileProblem};

/// What one manifest file holds. Objects that could not be read are in `errors`;
/// the rest still load, so one broken document does not take the others down with
/// it.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// Nodes in the files: their zone label and addresses are read.
    pub nodes: Vec<Arc<Node>>,
    /// NetworkPolicies, Pods and Namespaces, as policy reads them.
    pub network_policies: Vec<Arc<NetworkPolicy>>,
    pub pods: Vec<Arc<PolicyPod>>,
    pub namespaces: Vec<Arc<PolicyNamespace>>,
    pub errors: Vec<ObjectError>,
}

/// The source as a whole could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{}: no such file or directory; pass a YAML/JSON file or a directory holding them", path.display())]
    NotFound { path: PathBuf },
    #[error("cannot read {}: {error}; check that it exists and is readable", path.display())]
    Read { path: PathBuf, error: io::Error },
}

impl SourceError {
    pub(crate) fn from_io(path: &Path, error: io::Error) -> Self {
        if error.kind() == io::ErrorKind::NotFound {
            SourceError::NotFound {
                path: path.to_owned(),
            }
        } else {
            SourceError::Read {
                path: path.to_owned(),
                error,
            }
        }
    }
}
