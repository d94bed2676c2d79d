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

pub mod files;
pub mod intern;
pub mod kube;
pub mod labels;
pub mod lean;
pub mod problem;
mod shards;
pub mod yaml;

pub use lean::{EndpointSlice, Service};
pub use problem::{Capped, Location, ObjectError, Problem};
pub use yaml::{FileError, FileProblem};

/// Everything one load found. Objects that could not be read are in `errors`; the
/// rest still load, so one broken document does not take the others down with it.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    /// Shared, not copied: a snapshot is built from per-file (or per-cache) parts
    /// that stay alive next to it, and a copy would double the agent's memory.
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// The API-server source caches this node's Node; files may hold Nodes too
    /// (their zone label and addresses are read).
    pub nodes: Vec<Arc<Node>>,
    pub errors: Vec<ObjectError>,
    /// Manifest files that could not be read (files only). Their objects are not
    /// in this snapshot unless an earlier read of the same file put them there.
    pub unreadable: Vec<FileError>,
    /// More Services and EndpointSlices, held in parts shared with the source's
    /// cache (the file source: one part per file). A part that is the same
    /// allocation as in the previous snapshot holds the same objects, so a
    /// consumer skips it whole: a change costs the files it touched, not a walk
    /// over every object. Only the services and slices of a part count; its
    /// nodes, errors and unreadable files are already in the lists above.
    pub parts: Vec<Arc<Objects>>,
}

impl Objects {
    /// Every Service: the flat list, then each part's.
    pub fn all_services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services
            .iter()
            .chain(self.parts.iter().flat_map(|p| p.services.iter()))
    }

    /// Every EndpointSlice: the flat list, then each part's.
    pub fn all_slices(&self) -> impl Iterator<Item = &Arc<EndpointSlice>> {
        self.slices
            .iter()
            .chain(self.parts.iter().flat_map(|p| p.slices.iter()))
    }
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
