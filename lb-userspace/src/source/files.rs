//! Following manifest files: inotify (through `notify`) says which entries of the
//! directory changed, only those are read again, and the objects are published.
//! No polling: an idle agent does nothing until a file changes.
//!
//! What is watched: the directory (or, for a single file, its parent), so a file
//! an editor replaces by rename, or a ConfigMap mount whose `..data` symlink is
//! swapped, is seen like an in-place write. A change of a manifest file re-reads
//! that file; a change of anything else there that can stand for many files (the
//! directory itself, a `..data`-style link) or a lost event (the kernel's queue
//! overflowed) re-lists the directory, and still parses only files whose size,
//! mtime or inode moved.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use notify::{RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::yaml;
use super::{FileError, Objects, SourceError};

/// What a file looked like when last read: size, mtime, inode. Tools replace files
/// by rename, which changes the inode even when size and mtime match.
type Stamp = (u64, Option<SystemTime>, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok(), meta.ino()))
}

/// One file of the source as last read.
struct Cached {
    /// `None` while the file cannot be read: every look tries it again.
    stamp: Option<Stamp>,
    /// The last good read, kept while the file is broken (see [`FileCache`]).
    objects: Option<Arc<Objects>>,
    /// Why the file cannot be read now.
    error: Option<FileError>,
}

/// The files' objects as last read, in path order, so a change re-reads only the
/// files it touched: with one big file and one small one, editing the small one
/// costs only that.
///
/// A file that cannot be read keeps the objects of its last good read, as the whole
/// source does when the path cannot be read at all: a transient I/O error or a
/// botched copy must not withdraw its Services.
#[derive(Default)]
struct FileCache(BTreeMap<PathBuf, Cached>);

/// Which entries of the source changed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Changed {
    /// List the source again (start, the directory itself, a ConfigMap `..data`
    /// swap, lost events).
    All,
    /// Only these paths.
    Files(BTreeSet<PathBuf>),
}

impl Changed {
    fn merge(self, other: Changed) -> Changed {
        match (self, other) {
            (Changed::Files(mut a), Changed::Files(b)) => {
                a.extend(b);
                Changed::Files(a)
            }
            _ => Changed::All,
        }
    }
}

impl FileCache {
    /// Reads `file` (as [`yaml::manifest_entry`] found it) unless its stamp says it
    /// is unchanged.
    fn update(&mut self, file: PathBuf, entry: Result<PathBuf, FileError>) {
        // Stamped before reading: a file that changes during the read differs from
        // its stamp at the next look and is read again.
        let before = stamp(&file);
        let cached = self.0.remove(&file);
        let unchanged = cached
            .as_ref()
            .filter(|c| before.is_some() && c.stamp == before && c.error.is_none())
            .and_then(|c| c.objects.clone());
        let read = match (entry, unchanged) {
            (Ok(_), Some(objects)) => Ok(objects),
            (Ok(file), None) => yaml::load_file(&file).map(Arc::new),
            (Err(e), _) => Err(e),
        };
        let entry = match read {
            Ok(objects) => Cached {
                stamp: before,
                objects: Some(objects),
                error: None,
            },
            Err(e) => Cached {
                stamp: None,
                objects: cached.and_then(|c| c.objects),
                error: Some(e),
            },
        };
        self.0.insert(file, entry);
    }

    /// Lists the source and brings every file up to date.
    fn load(&mut self, path: &Path) -> Result<Objects, SourceError> {
        let files = yaml::manifest_files(path)?;
        let listed: HashSet<PathBuf> = files.iter().map(|e| entry_path(e).to_owned()).collect();
        self.0.retain(|file, _| listed.contains(file));
        for entry in files {
            self.update(entry_path(&entry).to_owned(), entry);
        }
        Ok(self.objects())
    }

    /// Brings only `changed` up to date: each is read again, dropped (gone, or no
    /// manifest any more) or left alone (not a manifest name).
    fn load_files(&mut self, changed: &BTreeSet<PathBuf>) -> Objects {
        for file in changed {
            match yaml::manifest_entry(file) {
                Some(entry) => self.update(file.clone(), entry),
                None => {
                    self.0.remove(file);
                }
            }
        }
        self.objects()
    }

    /// Everything cached, in path order, each file's objects as one shared part
    /// (an unchanged file is the same part as before); `unreadable` lists the
    /// broken files.
    fn objects(&self) -> Objects {
        let mut all = Objects::default();
        for cached in self.0.values() {
            if let Some(e) = &cached.error {
                all.unreadable.push(e.clone());
            }
            if let Some(objects) = &cached.objects {
                all.nodes.extend(objects.nodes.iter().cloned());
                all.errors.extend(objects.errors.iter().cloned());
                all.parts.push(objects.clone());
            }
        }
        all
    }
}

fn entry_path(entry: &Result<PathBuf, FileError>) -> &Path {
    match entry {
        Ok(path) => path,
        Err(e) => &e.path,
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

#[derive(Debug, thiserror::Error)]
#[error(
    "cannot watch {} for changes: {source}; if inotify limits are reached, raise \
     fs.inotify.max_user_watches / max_user_instances",
    path.display()
)]
pub struct WatchError {
    pub path: PathBuf,
    #[source]
    pub source: notify::Error,
}

/// What a notification means for the source at `root` (`dir`: the directory
/// watched; `root == dir` for a directory source).
fn classify(root: &Path, dir: &Path, event: notify::Result<notify::Event>) -> Option<Changed> {
    let event = match event {
        Ok(event) => event,
        Err(e) => {
            debug!("file notification error, listing again: {e}");
            return Some(Changed::All);
        }
    };
    if event.need_rescan() {
        return Some(Changed::All);
    }
    // Opens and reads (ours among them) change nothing; a write being closed does.
    use notify::event::{AccessKind, AccessMode, EventKind};
    if matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write))
    {
        return None;
    }
    let single_file = root != dir;
    let mut files = BTreeSet::new();
    for path in event.paths {
        if path == dir || path == root && !single_file {
            return Some(Changed::All);
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        if name.starts_with("..") {
            // A ConfigMap mount swaps `..data` to switch every file at once.
            return Some(Changed::All);
        }
        if single_file {
            // The file itself (written, or replaced by rename): read it as at start.
            if path == root {
                return Some(Changed::All);
            }
        } else if yaml::is_manifest_name(&path) {
            files.insert(path);
        }
    }
    (!files.is_empty()).then_some(Changed::Files(files))
}

/// Spawns the watcher. The receiver holds `None` until the files were read once;
/// after that, every change publishes a fresh snapshot. A source that cannot be
/// read at all publishes nothing, so the datapath keeps its last state instead of
/// being flushed.
pub fn watch(path: PathBuf) -> Result<watch::Receiver<Option<Arc<Objects>>>, WatchError> {
    let (tx, rx) = watch::channel(None);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let dir = if path.is_dir() {
        path.clone()
    } else {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    };
    let watch_error = |source| WatchError {
        path: dir.clone(),
        source,
    };
    let (root, watched) = (path.clone(), dir.clone());
    let mut watcher = notify::recommended_watcher(move |event| {
        if let Some(changed) = classify(&root, &watched, event) {
            let _ = events_tx.send(changed);
        }
    })
    .map_err(watch_error)?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(watch_error)?;
    tokio::spawn(async move {
        // Watching as long as the source is followed.
        let _watcher = watcher;
        let mut cache = FileCache::default();
        let mut unreadable = Vec::new();
        let mut changed = Changed::All;
        loop {
            // Parsing takes the CPUs for a while at scale: off the async workers,
            // so /healthz and the agent loop stay responsive.
            let started = Instant::now();
            let load = tokio::task::spawn_blocking({
                let path = path.clone();
                move || {
                    let loaded = match &changed {
                        Changed::All => cache.load(&path),
                        Changed::Files(files) => Ok(cache.load_files(files)),
                    };
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
                        services = objects
                            .parts
                            .iter()
                            .map(|p| p.services.len())
                            .sum::<usize>(),
                        endpoint_slices =
                            objects.parts.iter().map(|p| p.slices.len()).sum::<usize>(),
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
            // Whatever arrived meanwhile is handled in one go.
            let Some(next) = events.recv().await else {
                return;
            };
            changed = next;
            while let Ok(more) = events.try_recv() {
                changed = changed.merge(more);
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: NAME\n  namespace: default\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: 80\n";

    fn names(objects: &Objects) -> Vec<String> {
        objects
            .all_services()
            .filter_map(|s| Some(s.metadata.name.as_deref()?.to_owned()))
            .collect()
    }

    #[test]
    fn only_changed_files_are_read_again_and_order_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let write = |file: &str, name: &str| {
            let tmp = dir.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, SERVICE.replace("NAME", name)).unwrap();
            std::fs::rename(&tmp, dir.join(file)).unwrap();
        };
        write("a.yaml", "a");
        write("b.yaml", "b");
        let mut cache = FileCache::default();
        assert_eq!(names(&cache.load(&dir).unwrap()), ["a", "b"]);
        let a_before = cache.0[&dir.join("a.yaml")].objects.clone().unwrap();

        write("b.yaml", "b2");
        assert_eq!(names(&cache.load(&dir).unwrap()), ["a", "b2"]);
        // a.yaml was not read again: the same parsed objects are reused.
        let a_after = cache.0[&dir.join("a.yaml")].objects.clone().unwrap();
        assert!(Arc::ptr_eq(&a_before, &a_after));

        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        write("c.yaml", "c");
        assert_eq!(names(&cache.load(&dir).unwrap()), ["b2", "c"]);
        assert_eq!(cache.0.len(), 2, "a removed file leaves the cache");
    }

    /// One unreadable file must not stop the others: each kind of failure that
    /// happens as root is reported with its file and cause, the rest load.
    #[test]
    fn unreadable_files_are_reported_and_the_others_load() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        std::fs::write(dir.join("good.yaml"), SERVICE.replace("NAME", "good")).unwrap();
        std::fs::write(dir.join("binary.yaml"), b"kind: \xff\xfe\x00garbage").unwrap();
        symlink(dir.join("gone.yaml"), dir.join("dangling.yaml")).unwrap();
        symlink(dir.join("loop-b.yaml"), dir.join("loop-a.yaml")).unwrap();
        symlink(dir.join("loop-a.yaml"), dir.join("loop-b.yaml")).unwrap();
        // Reading /proc/self/mem at offset 0 fails with EIO, root or not.
        symlink("/proc/self/mem", dir.join("io-error.yaml")).unwrap();
        nix::unistd::mkfifo(
            &dir.join("fifo.yaml"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();

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
    }

    fn event(kind: notify::EventKind, paths: &[&Path]) -> notify::Result<notify::Event> {
        let mut e = notify::Event::new(kind);
        for p in paths {
            e = e.add_path(p.to_path_buf());
        }
        Ok(e)
    }

    #[test]
    fn notifications_name_what_to_read_again() {
        use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind};
        use notify::EventKind;
        let dir = Path::new("/m");
        let modify = EventKind::Modify(ModifyKind::Any);
        let one = |f: &str| Some(Changed::Files([dir.join(f)].into()));
        assert_eq!(
            classify(dir, dir, event(modify, &[&dir.join("a.yaml")])),
            one("a.yaml")
        );
        // Our own reads, swap files and other names change nothing.
        let read = EventKind::Access(AccessKind::Close(AccessMode::Read));
        assert_eq!(
            classify(dir, dir, event(read, &[&dir.join("a.yaml")])),
            None
        );
        assert_eq!(
            classify(dir, dir, event(modify, &[&dir.join(".a.yaml.swp")])),
            None
        );
        assert_eq!(
            classify(dir, dir, event(modify, &[&dir.join("notes.txt")])),
            None
        );
        // A write being finished counts.
        let closed = EventKind::Access(AccessKind::Close(AccessMode::Write));
        assert_eq!(
            classify(dir, dir, event(closed, &[&dir.join("a.yaml")])),
            one("a.yaml")
        );
        // A ConfigMap swap, the directory itself, a lost event: list again.
        let create = EventKind::Create(CreateKind::Any);
        assert_eq!(
            classify(dir, dir, event(create, &[&dir.join("..data")])),
            Some(Changed::All)
        );
        assert_eq!(
            classify(dir, dir, event(modify, &[dir])),
            Some(Changed::All)
        );
        let lost = notify::Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan);
        assert_eq!(classify(dir, dir, Ok(lost)), Some(Changed::All));
        // A single-file source: only that file, whatever else changes beside it.
        let file = dir.join("svc.yaml");
        assert_eq!(
            classify(&file, dir, event(modify, &[&dir.join("other.yaml")])),
            None
        );
        assert_eq!(
            classify(&file, dir, event(modify, &[&file])),
            Some(Changed::All)
        );
    }

    /// The watcher sees a ConfigMap-style `..data` swap and an editor's rename-over,
    /// with no polling: each publishes the new objects.
    #[tokio::test]
    async fn configmap_swaps_and_renames_are_followed() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let svc = |name: &str| SERVICE.replace("NAME", name);
        std::fs::create_dir(dir.join("..v1")).unwrap();
        std::fs::write(dir.join("..v1/svc.yaml"), svc("one")).unwrap();
        symlink("..v1", dir.join("..data")).unwrap();
        symlink("..data/svc.yaml", dir.join("svc.yaml")).unwrap();
        let mut rx = watch(dir.clone()).unwrap();
        let wait_for = |rx: &mut watch::Receiver<Option<Arc<Objects>>>, want: Vec<&str>| {
            let want: Vec<String> = want.into_iter().map(String::from).collect();
            let mut rx = rx.clone();
            async move {
                let found = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                    loop {
                        if let Some(o) = rx.borrow_and_update().as_ref() {
                            if names(o) == want {
                                return;
                            }
                        }
                        rx.changed().await.unwrap();
                    }
                })
                .await;
                assert!(
                    found.is_ok(),
                    "never saw {want:?}: {:?}",
                    rx.borrow().as_ref().map(|o| names(o))
                );
            }
        };
        wait_for(&mut rx, vec!["one"]).await;

        // kubelet's atomic update: a new timestamped dir, `..data` swapped by rename.
        std::fs::create_dir(dir.join("..v2")).unwrap();
        std::fs::write(dir.join("..v2/svc.yaml"), svc("two")).unwrap();
        symlink("..v2", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        wait_for(&mut rx, vec!["two"]).await;

        // An editor writes a temporary file and renames it over the target.
        std::fs::write(dir.join(".extra.yaml.tmp"), svc("three")).unwrap();
        std::fs::rename(dir.join(".extra.yaml.tmp"), dir.join("extra.yaml")).unwrap();
        wait_for(&mut rx, vec!["three", "two"]).await;
        std::fs::remove_file(dir.join("extra.yaml")).unwrap();
        wait_for(&mut rx, vec!["two"]).await;
    }
}
