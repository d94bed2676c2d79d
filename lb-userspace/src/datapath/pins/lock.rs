//! One agent per pin directory. Two agents writing the same maps from different
//! views would leave frontends with missing slots, so the agent holds an exclusive
//! `flock` on the pin directory itself for as long as it runs: the kernel drops it
//! when the process dies, however it dies, and it works on bpffs (which holds no
//! regular files to lock). `lb cleanup` takes the same lock, so it never pulls the
//! maps from under a running agent.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

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
        source: std::io::Error,
    },
}

fn holder_text(holder: Option<i32>) -> String {
    holder.map_or_else(String::new, |pid| format!(" (pid {pid})"))
}

/// The lock; dropping it (closing the file, or the process ending) releases it.
#[derive(Debug)]
pub struct PinLock {
    locked: File,
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
        loop {
            let lock = Self::lock_once(dir, wait)?;
            // While we waited, `lb cleanup` may have taken the lock first and removed
            // the directory, and the path may name a new one by now: a lock on the
            // removed inode would guard nothing, and a second agent could lock the
            // new directory beside us. Lock what the path names now.
            if same_inode(&lock.locked, dir) {
                return Ok(lock);
            }
            drop(lock);
            if let Err(source) = std::fs::create_dir_all(dir) {
                return Err(PinLockError::Open {
                    path: dir.to_owned(),
                    source,
                });
            }
        }
    }

    fn lock_once(dir: &Path, wait: Wait) -> Result<Self, PinLockError> {
        let file = File::open(dir).map_err(|source| PinLockError::Open {
            path: dir.to_owned(),
            source,
        })?;
        let operation = match wait {
            Wait::No => FlockOperation::NonBlockingLockExclusive,
            Wait::Yes => FlockOperation::LockExclusive,
        };
        match flock(&file, operation) {
            Ok(()) => Ok(Self { locked: file }),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(PinLockError::Held {
                path: dir.to_owned(),
                holder: holder(dir),
            }),
            Err(errno) => Err(PinLockError::Lock {
                path: dir.to_owned(),
                source: errno.into(),
            }),
        }
    }

    /// Who holds the lock on `dir`, if anyone does.
    pub fn holder_of(dir: &Path) -> Option<i32> {
        holder(dir)
    }
}

/// Whether the locked directory is still the one `path` names.
fn same_inode(locked: &File, path: &Path) -> bool {
    match (locked.metadata(), std::fs::metadata(path)) {
        (Ok(locked), Ok(now)) => locked.dev() == now.dev() && locked.ino() == now.ino(),
        _ => false,
    }
}

/// The pid holding a `flock` on `dir`, from /proc/locks (by device and inode).
fn holder(dir: &Path) -> Option<i32> {
    let meta = std::fs::metadata(dir).ok()?;
    let (major, minor) = (
        u64::from(rustix::fs::major(meta.dev())),
        u64::from(rustix::fs::minor(meta.dev())),
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

    /// A waiter whose directory was removed (and created anew) while it waited ends
    /// up holding the new directory, so nobody else can take it beside the waiter.
    #[test]
    fn a_waiter_locks_the_directory_the_path_names_when_it_gets_the_lock() {
        let dir = std::env::temp_dir().join(format!("lb-pinlock-moved-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let holder = PinLock::acquire(&dir, Wait::No).unwrap();
        let waiter = {
            let dir = dir.clone();
            std::thread::spawn(move || PinLock::acquire(&dir, Wait::Yes).unwrap())
        };
        // Wait until the waiter is blocked in flock: /proc/locks lists its request.
        let me = std::process::id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while procfs::locks()
            .unwrap()
            .iter()
            .filter(|l| l.pid == Some(me) && l.lock_type == procfs::LockType::FLock)
            .count()
            < 2
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never blocked"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // What `lb cleanup` and a new agent's create_dir_all do meanwhile.
        std::fs::remove_dir(&dir).unwrap();
        std::fs::create_dir(&dir).unwrap();
        drop(holder);
        let waiter = waiter.join().unwrap();
        let second = PinLock::acquire(&dir, Wait::No);
        assert!(
            matches!(second, Err(PinLockError::Held { .. })),
            "the new directory could be locked beside the waiter: {second:?}"
        );
        drop(second);
        drop(waiter);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
