//! The pin directory's layout, and what lb pins and unpins there.
//!
//! Under `<pin-dir>` (default `/sys/fs/bpf/lb`):
//! - `v<N>/<MAP>`: the maps, `N` = [`lb_common::PIN_LAYOUT_VERSION`], so an agent never
//!   opens a map whose key/value layout it does not know;
//! - `links/<program>`: one bpf_link per hook; replacing the pin detaches the old link.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use lb_common::{map_names, program_names, PIN_LAYOUT_VERSION};

/// Where everything of one agent is pinned.
#[derive(Clone, Debug)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.root.join(format!("v{PIN_LAYOUT_VERSION}"))
    }

    pub fn map_path(&self, map: &str) -> PathBuf {
        self.maps_dir().join(map)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }
}

/// Map directories of other layout versions under the pin directory: what an agent
/// with another kernel object left.
pub fn other_layouts(layout: &PinLayout) -> io::Result<Vec<PathBuf>> {
    let current = layout.maps_dir();
    let mut found = Vec::new();
    for entry in fs::read_dir(layout.root())? {
        let path = entry?.path();
        let is_layout = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_layout_dir);
        if is_layout && path != current {
            found.push(path);
        }
    }
    Ok(found)
}

/// Unpins the maps of a retired layout; the kernel frees them once no program
/// uses them.
pub fn remove_layout(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        fs::remove_file(entry?.path())?;
    }
    fs::remove_dir(dir)
}

/// What `lb cleanup` removed, and what it found but left.
#[derive(Debug, Default)]
pub struct CleanupReport {
    pub removed: Vec<PathBuf>,
    /// Entries lb did not pin (another tool's, or a user's): never removed.
    pub left: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error(
        "{} is not on a bpf filesystem: lb pins only under bpffs, so this is not a pin \
         directory of lb's; nothing was removed (pass the --pin-dir the agent used, \
         default /sys/fs/bpf/lb)",
        path.display()
    )]
    NotBpffs { path: PathBuf },
    #[error(transparent)]
    Locked(#[from] super::lock::PinLockError),
    #[error("cleaning up {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Which names of a directory lb pinned.
type NameFilter = fn(&str) -> bool;

/// Whether `name` is a link pin lb makes under `links/`.
fn is_link_pin(name: &str) -> bool {
    let name = name.strip_suffix("_new").unwrap_or(name);
    program_names::ALL.contains(&name)
        || name == program_names::SOCK_OPS
        || [
            program_names::TC_EXTERNAL,
            program_names::TC_INTERNAL,
            program_names::XDP,
        ]
        .iter()
        .any(|p| {
            name.strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('_'))
        })
}

/// Whether `name` is a map-layout directory (`v<N>`).
fn is_layout_dir(name: &str) -> bool {
    name.len() > 1 && name.starts_with('v') && name[1..].bytes().all(|b| b.is_ascii_digit())
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> CleanupError {
    let path = path.to_path_buf();
    move |source| CleanupError::Io { path, source }
}

/// The right to clean a pin directory: it is on bpffs and no agent holds it.
pub struct CleanupLock {
    _lock: super::lock::PinLock,
}

/// Checks that `layout` is lb's to clean and locks it against an agent starting
/// meanwhile; `None` when there is nothing to clean.
pub fn lock_for_cleanup(layout: &PinLayout) -> Result<Option<CleanupLock>, CleanupError> {
    let root = layout.root();
    if !root.exists() {
        return Ok(None);
    }
    let on_bpffs = rustix::fs::statfs(root)
        .map_err(|e| io_error(root)(e.into()))?
        .f_type
        == libc::BPF_FS_MAGIC;
    if !on_bpffs {
        return Err(CleanupError::NotBpffs {
            path: root.to_path_buf(),
        });
    }
    let lock = super::lock::PinLock::acquire(root, super::lock::Wait::No)?;
    Ok(Some(CleanupLock { _lock: lock }))
}

/// Unpins lb's links (which detaches the hooks) and the maps of every layout
/// version, then removes the directories they leave empty. Only names lb pins are
/// touched ([`lock_for_cleanup`] checked they are on bpffs); anything else is
/// reported in `left` and stays, with its directory. Missing pieces are fine:
/// cleanup is idempotent.
pub fn cleanup(layout: &PinLayout, _lock: &CleanupLock) -> Result<CleanupReport, CleanupError> {
    let mut report = CleanupReport::default();
    let root = layout.root();
    // Links first, so no hook runs against maps that are about to go.
    let mut dirs: Vec<(PathBuf, NameFilter)> = vec![(layout.links_dir(), is_link_pin)];
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let path = entry.map_err(io_error(root))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path == layout.links_dir() {
            continue;
        }
        if is_layout_dir(name) && path.is_dir() {
            dirs.push((path, |n: &str| map_names::ALL.contains(&n)));
        } else {
            report.left.push(path);
        }
    }
    for (dir, ours) in dirs {
        if !dir.exists() {
            continue;
        }
        for entry in fs::read_dir(&dir).map_err(io_error(&dir))? {
            let path = entry.map_err(io_error(&dir))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if ours(name) && !path.is_dir() {
                fs::remove_file(&path).map_err(io_error(&path))?;
                report.removed.push(path);
            } else {
                report.left.push(path);
            }
        }
        if fs::read_dir(&dir).map_err(io_error(&dir))?.next().is_none() {
            fs::remove_dir(&dir).map_err(io_error(&dir))?;
        }
    }
    if report.left.is_empty() {
        fs::remove_dir(root).map_err(io_error(root))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_layout_versions_are_found_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let layout = PinLayout::new(&root);
        let current = format!("v{}", lb_common::PIN_LAYOUT_VERSION);
        for dir in ["v0", "v1", "v17", &current, "links", "vx", "v"] {
            fs::create_dir_all(root.join(dir)).unwrap();
        }
        fs::write(root.join("v0/LB_SERVICES"), b"").unwrap();
        let mut found = other_layouts(&layout).unwrap();
        found.sort();
        let mut expected = vec![root.join("v0"), root.join("v1"), root.join("v17")];
        expected.retain(|d| !d.ends_with(&current));
        assert_eq!(found, expected);
        remove_layout(&root.join("v0")).unwrap();
        assert!(!root.join("v0").exists());
        assert!(layout.maps_dir().exists(), "the current layout stays");
    }
}
