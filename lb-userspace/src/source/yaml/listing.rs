//! Which files of a source are manifests, decided without reading them: by name,
//! and by being regular files. The watcher asks the same questions of single
//! changed entries ([`manifest_entry`], [`is_manifest_name`]) as the listing asks
//! of a whole directory, so a file counts the same whichever way it is found.

use std::fs;
use std::path::{Path, PathBuf};

use super::{FileError, FileProblem};
use crate::source::SourceError;

const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// The manifest files at `path` (the file itself, or every `*.yaml`, `*.yml` and
/// `*.json` file directly in the directory), in file name order so that "first one
/// wins" rules are reproducible, each with the reason it cannot be read where that
/// is known without reading it (a dangling symlink, a FIFO). Directories are not
/// manifests and are passed over; only a path that cannot be read at all is an
/// error.
pub fn manifest_files(path: &Path) -> Result<Vec<Result<PathBuf, FileError>>, SourceError> {
    let meta = fs::metadata(path).map_err(|e| SourceError::from_io(path, e))?;
    if !meta.is_dir() {
        return Ok(vec![regular_file(path, &meta)]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(|e| SourceError::from_io(path, e))? {
        let entry = entry.map_err(|e| SourceError::from_io(path, e))?;
        if let Some(file) = manifest_entry(&entry.path()) {
            files.push(file);
        }
    }
    files.sort_by(|a, b| entry_path(a).cmp(entry_path(b)));
    Ok(files)
}

/// Whether a directory entry's name makes it a manifest file: dot files are editor
/// swap files and the `..data` links of ConfigMap mounts.
pub fn is_manifest_name(file: &Path) -> bool {
    let hidden = file
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'));
    !hidden && has_extension(file, &EXTENSIONS)
}

/// One directory entry as [`manifest_files`] lists it: `None` when it is no manifest
/// (its name, or a directory) or no longer exists at all; an error when it cannot
/// be read as one (a dangling symlink, a FIFO, ...).
pub fn manifest_entry(file: &Path) -> Option<Result<PathBuf, FileError>> {
    if !is_manifest_name(file) {
        return None;
    }
    // Follows symlinks, as ConfigMap volumes are made of them.
    match fs::metadata(file) {
        Ok(m) if m.is_dir() => None,
        Ok(m) => Some(regular_file(file, &m)),
        // Gone, not even a dangling link left: nothing to report.
        Err(_) if fs::symlink_metadata(file).is_err() => None,
        Err(e) => Some(Err(FileError::io(file, e))),
    }
}

/// JSON is read whole and as a stream of values; anything else as YAML.
pub(super) fn is_json(file: &Path) -> bool {
    has_extension(file, &["json"])
}

fn has_extension(path: &Path, wanted: &[&str]) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| wanted.iter().any(|w| e.eq_ignore_ascii_case(w)))
}

fn entry_path(entry: &Result<PathBuf, FileError>) -> &Path {
    match entry {
        Ok(path) => path,
        Err(e) => &e.path,
    }
}

/// Reading a FIFO would block the poller until a writer comes; devices and sockets
/// hold no manifests either.
fn regular_file(path: &Path, meta: &fs::Metadata) -> Result<PathBuf, FileError> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    let kind = if t.is_file() {
        return Ok(path.to_owned());
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else {
        "special file"
    };
    Err(FileError {
        path: path.to_owned(),
        problem: FileProblem::NotAFile { kind },
    })
}
