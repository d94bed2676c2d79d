//! Following manifest files: poll their metadata, reload what changed, publish the
//! objects.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;
use tracing::{info, warn};

use super::yaml::{self, FileError, Objects, SourceError};

/// What a file looked like when last read: size, mtime, inode. Tools replace files
/// by rename, which changes the inode even when size and mtime match.
type Stamp = (u64, Option<SystemTime>, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok(), meta.ino()))
}

/// Names and stamps of everything at the path (a file, or a directory's entries):
/// cheap enough to take on every poll.
fn fingerprint(path: &Path) -> Vec<(PathBuf, Option<Stamp>)> {
    let mut files: Vec<_> = match std::fs::read_dir(path) {
        Ok(entries) => entries
            .flatten()
            .map(|entry| {
                let p = entry.path();
                let s = stamp(&p);
                (p, s)
            })
            .collect(),
        Err(_) => vec![(path.to_path_buf(), stamp(path))],
    };
    files.sort();
    files
}

/// The files' objects as last read, so a change re-reads only the files it touched:
/// with one big file and one small one, editing the small one costs only that.
///
/// A file that cannot be read keeps the objects of its last good read, as the whole
/// source does when the path cannot be read at all: a transient I/O error or a
/// botched copy must not withdraw its Services. Its entry carries no stamp then, so
/// every load tries it again.
#[derive(Default)]
struct FileCache(HashMap<PathBuf, (Option<Stamp>, Arc<Objects>)>);

impl FileCache {
    fn load(&mut self, path: &Path) -> Result<Objects, SourceError> {
        let files = yaml::manifest_files(path)?;
        let mut previous = std::mem::take(&mut self.0);
        let mut all = Objects::default();
        for entry in files {
            let file = match &entry {
                Ok(file) => file.clone(),
                Err(e) => e.path.clone(),
            };
            // Stamped before reading: a file that changes during the read differs
            // from its stamp at the next poll and is read again.
            let before = stamp(&file);
            let cached = previous.remove(&file);
            let unchanged = cached
                .as_ref()
                .filter(|(seen, _)| before.is_some() && *seen == before);
            let read = match (entry, unchanged) {
                (Ok(_), Some((_, objects))) => Ok(objects.clone()),
                (Ok(file), None) => yaml::load_file(&file).map(Arc::new),
                (Err(e), _) => Err(e),
            };
            let objects = match read {
                Ok(objects) => {
                    self.0.insert(file, (before, objects.clone()));
                    objects
                }
                Err(e) => {
                    all.unreadable.push(e);
                    let Some((_, objects)) = cached else { continue };
                    self.0.insert(file, (None, objects.clone()));
                    objects
                }
            };
            all.append(Objects::clone(&objects));
        }
        Ok(all)
    }
}

/// Logs the files that became unreadable since the last load, and those that were
/// fixed: once per change, not on every read of the directory.
fn report_unreadable(before: &[FileError], now: &[FileError]) {
    let key = |e: &FileError| (e.path.clone(), e.problem.to_string());
    let old: HashSet<_> = before.iter().map(key).collect();
    let new: HashSet<_> = now.iter().map(key).collect();
    for e in now.iter().filter(|e| !old.contains(&key(e))) {
        warn!("{e}");
    }
    for e in before.iter().filter(|e| !new.contains(&key(e))) {
        if !now.iter().any(|n| n.path == e.path) {
            info!(file = %e.path.display(), "manifest file readable again (or removed)");
        }
    }
}

/// Checks at start that the source exists: a mistyped path would otherwise leave
/// the agent waiting for it forever, neither ready nor failing.
pub fn check_source(path: &Path) -> Result<(), SourceError> {
    yaml::manifest_files(path).map(drop)
}

/// Spawns the poller./// Spawns the poller. The receiver holds `None` until the files were read once; after
/// that, every change publishes a fresh snapshot. A source that cannot be read at all
/// publishes nothing, so the datapath keeps its last state instead of being flushed.
pub fn watch(path: PathBuf, interval: Duration) -> watch::Receiver<Option<Arc<Objects>>> {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        // The first read starts at once, not at the first tick: a timer fires only
        // when the runtime's driver turns, which on a busy start (programs being
        // loaded) is after the work the read should overlap.
        let first_poll = tokio::time::Instant::now() + interval;
        let mut ticker = tokio::time::interval_at(first_poll, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = None;
        let mut cache = FileCache::default();
        let mut unreadable = Vec::new();
        loop {
            let seen = fingerprint(&path);
            if last.as_ref() == Some(&seen) {
                ticker.tick().await;
                continue;
            }
            last = Some(seen);
            // Parsing takes the CPUs for a while at scale: off the async workers,
            // so /healthz and the agent loop stay responsive.
            let started = Instant::now();
            let load = tokio::task::spawn_blocking({
                let path = path.clone();
                move || {
                    let loaded = cache.load(&path);
                    (cache, loaded)
                }
            });
            let Ok((returned, loaded)) = load.await else {
                return; // the runtime is shutting down
            };
            cache = returned;
            match loaded {
                Ok(objects) => {
                    report_unreadable(&unreadable, &objects.unreadable);
                    unreadable = objects.unreadable.clone();
                    info!(
                        services = objects.services.len(),
                        endpoint_slices = objects.slices.len(),
                        problems = objects.errors.len(),
                        unreadable_files = objects.unreadable.len(),
                        read_ms = started.elapsed().as_millis() as u64,
                        "manifests read"
                    );
                    if tx.send(Some(Arc::new(objects))).is_err() {
                        return;
                    }
                }
                Err(e) => warn!("{e}; keeping the current service table"),
            }
            ticker.tick().await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: NAME\n  namespace: default\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: 80\n";

    fn names(objects: &Objects) -> Vec<String> {
        objects
            .services
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect()
    }

    #[test]
    fn only_changed_files_are_read_again_and_order_is_kept() {
        let dir = std::env::temp_dir().join(format!("lb-files-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let write = |file: &str, name: &str| {
            let tmp = dir.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, SERVICE.replace("NAME", name)).unwrap();
            std::fs::rename(&tmp, dir.join(file)).unwrap();
        };
        write("a.yaml", "a");
        write("b.yaml", "b");
        let mut cache = FileCache::default();
        assert_eq!(names(&cache.load(&dir).unwrap()), ["a", "b"]);
        let a_before = cache.0[&dir.join("a.yaml")].1.clone();

        write("b.yaml", "b2");
        assert_eq!(names(&cache.load(&dir).unwrap()), ["a", "b2"]);
        // a.yaml was not read again: the same parsed objects are reused.
        assert!(Arc::ptr_eq(&a_before, &cache.0[&dir.join("a.yaml")].1));

        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        write("c.yaml", "c");
        assert_eq!(names(&cache.load(&dir).unwrap()), ["b2", "c"]);
        assert_eq!(cache.0.len(), 2, "a removed file leaves the cache");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// One unreadable file must not stop the others: each kind of failure that
    /// happens as root is reported with its file and cause, the rest load.
    #[test]
    fn unreadable_files_are_reported_and_the_others_load() {
        use std::os::unix::fs::symlink;
        let dir = std::env::temp_dir().join(format!("lb-files-bad-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("good.yaml"), SERVICE.replace("NAME", "good")).unwrap();
        std::fs::write(dir.join("binary.yaml"), b"kind: \xff\xfe\x00garbage").unwrap();
        symlink(dir.join("gone.yaml"), dir.join("dangling.yaml")).unwrap();
        symlink(dir.join("loop-b.yaml"), dir.join("loop-a.yaml")).unwrap();
        symlink(dir.join("loop-a.yaml"), dir.join("loop-b.yaml")).unwrap();
        // Reading /proc/self/mem at offset 0 fails with EIO, root or not.
        symlink("/proc/self/mem", dir.join("io-error.yaml")).unwrap();
        let fifo =
            std::ffi::CString::new(dir.join("fifo.yaml").into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);

        let mut cache = FileCache::default();
        let loaded = cache.load(&dir).unwrap();
        assert_eq!(names(&loaded), ["good"]);
        let problems: Vec<(String, String)> = loaded
            .unreadable
            .iter()
            .map(|e| {
                let file = e.path.file_name().unwrap().to_string_lossy().into_owned();
                (file, e.problem.to_string())
            })
            .collect();
        let expect = |file: &str, needle: &str| {
            let (_, problem) = problems
                .iter()
                .find(|(f, _)| f == file)
                .unwrap_or_else(|| panic!("{file} not reported: {problems:?}"));
            assert!(problem.contains(needle), "{file}: {problem}");
        };
        expect("binary.yaml", "not UTF-8 text (invalid byte at offset 6)");
        expect("dangling.yaml", "a symlink to");
        expect("loop-a.yaml", "symbolic links");
        expect("loop-b.yaml", "symbolic links");
        expect("io-error.yaml", "Input/output error");
        expect("fifo.yaml", "a FIFO, not a regular file");
        assert_eq!(problems.len(), 6, "{problems:?}");
        let message = loaded.unreadable[0].to_string();
        assert!(
            message.starts_with(&dir.join("binary.yaml").display().to_string())
                && message.ends_with("fix or remove the file (the other files still apply)"),
            "{message}"
        );

        // A file that was read once keeps its objects while it is broken, and is
        // reported until it is fixed.
        std::fs::write(
            dir.join("binary.yaml"),
            SERVICE.replace("NAME", "was-binary"),
        )
        .unwrap();
        let loaded = cache.load(&dir).unwrap();
        assert_eq!(names(&loaded), ["was-binary", "good"]);
        assert_eq!(loaded.unreadable.len(), 5);
        std::fs::write(dir.join("binary.yaml"), b"\xff").unwrap();
        let loaded = cache.load(&dir).unwrap();
        assert_eq!(names(&loaded), ["was-binary", "good"]);
        assert_eq!(loaded.unreadable.len(), 6);
        std::fs::write(dir.join("binary.yaml"), b"\xfe").unwrap();
        let loaded = cache.load(&dir).unwrap();
        assert_eq!(
            names(&loaded),
            ["was-binary", "good"],
            "still the last good read"
        );
        std::fs::remove_file(dir.join("binary.yaml")).unwrap();
        let loaded = cache.load(&dir).unwrap();
        assert_eq!(
            names(&loaded),
            ["good"],
            "a removed file takes its objects along"
        );
        assert_eq!(loaded.unreadable.len(), 5);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
