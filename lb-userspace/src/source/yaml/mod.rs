//! Services, EndpointSlices and Nodes from files saved with `kubectl get -o yaml`
//! (or `-o json`). One file per job, so each can be read and changed alone:
//! [`listing`] decides which files are manifests, [`pieces`] reads a YAML file a
//! bounded piece at a time, [`parallel`] parses a piece's documents on every CPU,
//! and each document takes one of three readers: [`block`] (the fast path for what
//! kubectl writes), [`json`] (JSON, typed when clean) or [`general`] (anything,
//! and the wording of every error). All three ask [`kinds`] what an (apiVersion,
//! kind) pair is, so they cannot disagree about it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Objects;

mod block;
mod general;
mod json;
mod kinds;
mod listing;
mod parallel;
mod pieces;

pub use listing::{is_manifest_name, manifest_entry, manifest_files};

/// A manifest file that could not be read. The other files still load; this one is
/// reported (log, `/metrics`, the agent status) until it is fixed or removed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{}: {problem}; fix or remove the file (the other files still apply)", path.display())]
pub struct FileError {
    pub path: PathBuf,
    #[source]
    pub problem: FileProblem,
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum FileProblem {
    #[error("cannot read it: {0}")]
    Read(#[source] Arc<io::Error>),
    #[error("a symlink to {}, which does not exist", target.display())]
    DanglingSymlink { target: PathBuf },
    #[error("not UTF-8 text (invalid byte at offset {offset}); save it as UTF-8")]
    NotUtf8 { offset: usize },
    #[error("a {kind}, not a regular file")]
    NotAFile { kind: &'static str },
}

impl FileError {
    fn io(path: &Path, error: io::Error) -> Self {
        // Only a symlink has a link target to read.
        let problem = match fs::read_link(path) {
            Ok(target) if error.kind() == io::ErrorKind::NotFound => {
                FileProblem::DanglingSymlink { target }
            }
            _ => FileProblem::Read(Arc::new(error)),
        };
        FileError {
            path: path.to_owned(),
            problem,
        }
    }

    fn not_utf8(path: &Path, offset: usize) -> Self {
        FileError {
            path: path.to_owned(),
            problem: FileProblem::NotUtf8 { offset },
        }
    }
}

/// One manifest file's objects (a file [`manifest_files`] lists).
pub fn load_file(file: &Path) -> Result<Objects, FileError> {
    if !listing::is_json(file) {
        return pieces::load_in_pieces(file, pieces::READ_PIECE);
    }
    // A JSON file is one value (or a few): there is no place to cut it.
    let bytes = fs::read(file).map_err(|e| FileError::io(file, e))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| FileError::not_utf8(file, e.utf8_error().valid_up_to()))?;
    Ok(parse_str(file, &text))
}

/// Parse the text of one file; `file` is only used to name it in errors and to tell
/// JSON from YAML.
pub fn parse_str(file: &Path, text: &str) -> Objects {
    // Editors on Windows start files with a byte order mark; kubectl strips it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut objects = Objects::default();
    if listing::is_json(file) {
        json::parse_json(file, text, &mut objects);
    } else {
        parallel::parse_yaml(file, text, &mut parallel::Position::default(), &mut objects);
    }
    objects
}

#[cfg(test)]
mod tests;
