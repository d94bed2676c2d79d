//! One agent per pin directory. Two agents writing the same maps from different
//! views would leave frontends with missing slots, so the agent holds an exclusive
//! `flock` on the pin directory itself for as long as it runs: the kernel drops it
//! when the process dies, however it dies, and it works on bpffs (which holds no
//! regular files to lock). `lb cleanup` takes the same lock, so it never pulls the
//! maps from under a running agent.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

#[derive(Debug, thiserror::Error)]
pub enum PinLockError {
    #[error("cannot open the pin directory {} to lock it: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the pin directory {} is in use by another lb agent{}; stop that agent first, or \
         start this one with --wait-for-lock to take over when it stops",
        path.display(),
        holder_text(*holder)
    )]
    Held { path: PathBuf, holder: Option<i32> },
    #[error("cannot lock the pin directory {}: {source}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
}

fn holder_text(holder: Option<i32>) -> String {
    holder.map_or_else(String::new, |pid| format!(" (pid {pid})"))
}

/// The lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct PinLock {
    _lock: Flock<File>,
}

/// Whether to wait for the holder or fail at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    No,
    Yes,
}

impl PinLock {
    /// Locks `dir` (which must exist). `Wait::Yes` blocks until the holder is gone.
    pub fn acquire(dir: &Path, wait: Wait) -> Result<Self, PinLockError> {
        let file = File::open(dir).map_err(|source| PinLockError::Open {
            path: dir.to_owned(),
            source,
        })?;
        let arg = match wait {
            Wait::No => FlockArg::LockExclusiveNonblock,
            Wait::Yes => FlockArg::LockExclusive,
        };
        match Flock::lock(file, arg) {
            Ok(lock) => Ok(Self { _lock: lock }),
            Err((_, nix::Error::EWOULDBLOCK)) => Err(PinLockError::Held {
                path: dir.to_owned(),
                holder: holder(dir),
            }),
            Err((_, source)) => Err(PinLockError::Lock {
                path: dir.to_owned(),
                source,
            }),
        }
    }

    /// Who holds the lock on `dir`, if anyone does.
    pub fn holder_of(dir: &Path) -> Option<i32> {
        holder(dir)
    }
}

/// The pid holding a `flock` on `dir`, from /proc/locks (by device and inode).
fn holder(dir: &Path) -> Option<i32> {
    let meta = std::fs::metadata(dir).ok()?;
    let (major, minor) = (
        nix::sys::stat::major(meta.dev()),
        nix::sys::stat::minor(meta.dev()),
    );
    procfs::locks().ok()?.into_iter().find_map(|lock| {
        let same = lock.inode == meta.ino()
            && u64::from(lock.devmaj) == major
            && u64::from(lock.devmin) == minor;
        (same && lock.lock_type == procfs::LockType::FLock)
            .then_some(lock.pid)
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_and_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let first = PinLock::acquire(&dir, Wait::No).unwrap();
        let err = PinLock::acquire(&dir, Wait::No).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("another lb agent (pid {})", std::process::id())),
            "{text}"
        );
        assert!(text.contains("--wait-for-lock"), "{text}");
        drop(first);
        let again = PinLock::acquire(&dir, Wait::No);
        assert!(again.is_ok(), "released when dropped");
        drop(again);
    }
}
