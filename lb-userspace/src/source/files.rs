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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::changes::{self, ChangeReceiver, Changes, ObjectKey};
use super::lean::{EndpointSlice, Service};
use super::yaml;
use super::{FileError, ObjectError, Objects, Problem, SourceError};
use crate::model::policy::{NetworkPolicy, PolicyNamespace, PolicyPod};
use k8s_openapi::api::core::v1::Node;

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

/// The objects one kind's key stands for, across the files: the first definition
/// by file name, then by document, is used (the API server holds one object per
/// name; a second definition is a mistake, reported, not applied).
struct Defined<T> {
    /// The definition used, per key.
    used: HashMap<ObjectKey, Arc<T>>,
    /// Keys defined more than once, with how many definitions: only these need the
    /// files searched when one definition goes.
    repeated: HashMap<ObjectKey, usize>,
}

impl<T> Default for Defined<T> {
    fn default() -> Self {
        Defined {
            used: HashMap::new(),
            repeated: HashMap::new(),
        }
    }
}

/// A kind of object the file source keys: where a file holds them, and their keys.
trait Keyed: PartialEq + Sized {
    fn of(objects: &Objects) -> &[Arc<Self>];
    fn key(&self) -> ObjectKey;
}

impl Keyed for Service {
    fn of(objects: &Objects) -> &[Arc<Self>] {
        &objects.services
    }
    fn key(&self) -> ObjectKey {
        ObjectKey::of(&self.metadata)
    }
}

impl Keyed for EndpointSlice {
    fn of(objects: &Objects) -> &[Arc<Self>] {
        &objects.slices
    }
    fn key(&self) -> ObjectKey {
        ObjectKey::of(&self.metadata)
    }
}

/// Policy's kinds are keyed by the namespace and name they were decoded with (a
/// document without a namespace is already in `default`).
impl Keyed for NetworkPolicy {
    fn of(objects: &Objects) -> &[Arc<Self>] {
        &objects.network_policies
    }
    fn key(&self) -> ObjectKey {
        ObjectKey::new(Some(&self.namespace), &self.name)
    }
}

impl Keyed for PolicyPod {
    fn of(objects: &Objects) -> &[Arc<Self>] {
        &objects.pods
    }
    fn key(&self) -> ObjectKey {
        ObjectKey::new(Some(&self.namespace), &self.name)
    }
}

impl Keyed for PolicyNamespace {
    fn of(objects: &Objects) -> &[Arc<Self>] {
        &objects.namespaces
    }
    fn key(&self) -> ObjectKey {
        ObjectKey::cluster(&self.name)
    }
}

/// A file whose objects changed: what it held before and holds now.
struct Reread<'a> {
    before: Option<&'a Objects>,
    after: Option<&'a Objects>,
}

impl<T: Keyed> Defined<T> {
    /// Brings the definitions to what the files hold after `reread` (the files
    /// whose objects changed, with their objects before and after), and records
    /// each key whose object changed. An object read again unchanged keeps the
    /// allocation handed on before, so it is no change.
    fn settle(
        &mut self,
        files: &BTreeMap<PathBuf, Cached>,
        reread: &[Reread],
        record: &mut impl FnMut(ObjectKey, Option<Arc<T>>, Option<Arc<T>>),
    ) {
        // How many definitions each touched key gains (or loses) in the re-read files.
        let mut delta: HashMap<ObjectKey, (isize, Option<Arc<T>>)> = HashMap::new();
        for file in reread {
            for object in file.before.map(T::of).unwrap_or_default() {
                delta.entry(object.key()).or_default().0 -= 1;
            }
            for object in file.after.map(T::of).unwrap_or_default() {
                let entry = delta.entry(object.key()).or_default();
                entry.0 += 1;
                entry.1.get_or_insert_with(|| object.clone());
            }
        }
        for (key, (gained, fresh)) in delta {
            let before = self
                .repeated
                .get(&key)
                .copied()
                .unwrap_or(usize::from(self.used.contains_key(&key)));
            let count = (before as isize + gained).max(0) as usize;
            let previous = self.used.get(&key).cloned();
            let current = match (count, before) {
                (0, _) => None,
                // One definition before and after, and it was re-read: the new one.
                (1, 1) | (1, 0) if gained >= 0 && fresh.is_some() => fresh,
                // The one left is in a file that was not re-read: as before.
                (1, _) if fresh.is_none() && before <= 1 => previous.clone(),
                // Several: the first in the files' order.
                _ => first_definition(files, &key),
            };
            // Unchanged content keeps what was handed on.
            let current = match (&previous, current) {
                (Some(p), Some(c)) if **p == *c => Some(p.clone()),
                (_, c) => c,
            };
            match count {
                0 | 1 => self.repeated.remove(&key),
                n => self.repeated.insert(key.clone(), n),
            };
            match &current {
                Some(c) => self.used.insert(key.clone(), c.clone()),
                None => self.used.remove(&key),
            };
            record(key, previous, current);
        }
    }

    /// The repeated definitions, named for the operator.
    fn problems(&self, kind: &str, files: &BTreeMap<PathBuf, Cached>) -> Vec<ObjectError> {
        let mut problems = Vec::new();
        let mut keys: Vec<&ObjectKey> = self.repeated.keys().collect();
        keys.sort();
        for key in keys {
            let holders = holders::<T>(files, key);
            let Some((kept_in, _)) = holders.first() else {
                continue;
            };
            for (file, _) in &holders[1..] {
                problems.push(ObjectError::new(
                    kind,
                    key.namespace(),
                    key.name(),
                    Problem::DuplicateObject {
                        file: file.to_path_buf(),
                        kept_in: kept_in.to_path_buf(),
                    },
                ));
            }
        }
        problems
    }
}

/// Every definition of `key` in the files, in order.
fn holders<'a, T: Keyed>(
    files: &'a BTreeMap<PathBuf, Cached>,
    key: &ObjectKey,
) -> Vec<(&'a Path, &'a Arc<T>)> {
    files
        .iter()
        .filter_map(|(path, cached)| Some((path, cached.objects.as_deref()?)))
        .flat_map(|(path, objects)| T::of(objects).iter().map(move |o| (path.as_path(), o)))
        .filter(|(_, o)| o.key() == *key)
        .collect()
}

fn first_definition<T: Keyed>(
    files: &BTreeMap<PathBuf, Cached>,
    key: &ObjectKey,
) -> Option<Arc<T>> {
    holders::<T>(files, key).first().map(|(_, o)| Arc::clone(o))
}

/// The files' objects as last read, in path order, so a change re-reads only the
/// files it touched: with one big file and one small one, editing the small one
/// costs only that; and what it hands on is only the objects whose definition
/// changed, keyed by namespace and name.
///
/// A file that cannot be read keeps the objects of its last good read, as the whole
/// source does when the path cannot be read at all: a transient I/O error or a
/// botched copy must not withdraw its Services.
#[derive(Default)]
struct FileCache {
    files: BTreeMap<PathBuf, Cached>,
    services: Defined<Service>,
    slices: Defined<EndpointSlice>,
    policies: Defined<NetworkPolicy>,
    pods: Defined<PolicyPod>,
    namespaces: Defined<PolicyNamespace>,
    /// The nodes, problems and unreadable files last handed on (`None`: never).
    handed_on: Option<HandedOn>,
}

/// The nodes, the problems, and the unreadable files (path, problem) as handed on.
type HandedOn = (Vec<Arc<Node>>, Vec<ObjectError>, Vec<(PathBuf, String)>);

/// Which entries of the source changed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Changed {
    /// List the source again (start, the directory itself, a ConfigMap `..data`
    /// swap, lost events).
    All,
    /// Only these paths.
    Files(BTreeSet<PathBuf>),
}

/// Bytes of changed files read on the agent's own thread rather than handed to a
/// blocking one: a few hundred microseconds of parsing at most.
const INLINE_READ_BYTES: u64 = 64 << 10;

impl Changed {
    /// A few files, small enough to read without leaving the runtime's thread.
    fn is_small(&self) -> bool {
        let Changed::Files(files) = self else {
            return false;
        };
        let mut total = 0u64;
        for file in files {
            // A file gone has nothing to read.
            if let Ok(meta) = std::fs::metadata(file) {
                total += meta.len();
            }
            if total > INLINE_READ_BYTES {
                return false;
            }
        }
        true
    }

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

/// The objects a file held before a look and holds after it (`None`: none).
type Contribution = (Option<Arc<Objects>>, Option<Arc<Objects>>);

impl FileCache {
    /// Reads `file` (as [`yaml::manifest_entry`] found it) unless its stamp says it
    /// is unchanged; returns its objects before and after when they changed.
    fn update(&mut self, file: PathBuf, entry: Result<PathBuf, FileError>) -> Option<Contribution> {
        // Stamped before reading: a file that changes during the read differs from
        // its stamp at the next look and is read again.
        let before = stamp(&file);
        let cached = self.files.remove(&file);
        let held = cached.as_ref().and_then(|c| c.objects.clone());
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
                objects: held.clone(),
                error: Some(e),
            },
        };
        let now = entry.objects.clone();
        self.files.insert(file, entry);
        let same = match (&held, &now) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        (!same).then_some((held, now))
    }

    /// A file gone (or no manifest any more): the objects it held.
    fn forget(&mut self, file: &Path) -> Option<Contribution> {
        let cached = self.files.remove(file)?;
        cached.objects.map(|objects| (Some(objects), None))
    }

    /// Lists the source and brings every file up to date.
    fn load(&mut self, path: &Path) -> Result<Changes, SourceError> {
        let files = yaml::manifest_files(path)?;
        let listed: HashSet<PathBuf> = files.iter().map(|e| entry_path(e).to_owned()).collect();
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|f| !listed.contains(*f))
            .cloned()
            .collect();
        let mut reread: Vec<Contribution> = gone.iter().filter_map(|f| self.forget(f)).collect();
        for entry in files {
            reread.extend(self.update(entry_path(&entry).to_owned(), entry));
        }
        Ok(self.changes(&reread))
    }

    /// Brings only `changed` up to date: each is read again, dropped (gone, or no
    /// manifest any more) or left alone (not a manifest name).
    fn load_files(&mut self, changed: &BTreeSet<PathBuf>) -> Changes {
        let mut reread = Vec::new();
        for file in changed {
            reread.extend(match yaml::manifest_entry(file) {
                Some(entry) => self.update(file.clone(), entry),
                None => self.forget(file),
            });
        }
        self.changes(&reread)
    }

    /// What the re-read files changed, keyed by object, with the source's nodes,
    /// problems and unreadable files as they now stand.
    fn changes(&mut self, reread: &[Contribution]) -> Changes {
        let reread: Vec<Reread> = reread
            .iter()
            .map(|(before, after)| Reread {
                before: before.as_deref(),
                after: after.as_deref(),
            })
            .collect();
        let mut changes = Changes::default();
        self.services.settle(&self.files, &reread, &mut |k, p, c| {
            changes.service(k, p, c)
        });
        self.slices
            .settle(&self.files, &reread, &mut |k, p, c| changes.slice(k, p, c));
        self.policies
            .settle(&self.files, &reread, &mut |k, p, c| changes.policy(k, p, c));
        self.pods
            .settle(&self.files, &reread, &mut |k, p, c| changes.pod(k, p, c));
        self.namespaces
            .settle(&self.files, &reread, &mut |k, p, c| {
                changes.namespace(k, p, c)
            });
        let (mut nodes, mut errors, mut unreadable) = (Vec::new(), Vec::new(), Vec::new());
        for cached in self.files.values() {
            if let Some(e) = &cached.error {
                unreadable.push(e.clone());
            }
            if let Some(objects) = &cached.objects {
                nodes.extend(objects.nodes.iter().cloned());
                errors.extend(objects.errors.iter().cloned());
            }
        }
        errors.extend(self.services.problems("Service", &self.files));
        errors.extend(self.slices.problems("EndpointSlice", &self.files));
        errors.extend(self.policies.problems("NetworkPolicy", &self.files));
        errors.extend(self.pods.problems("Pod", &self.files));
        errors.extend(self.namespaces.problems("Namespace", &self.files));
        // Handed on when they changed, so that a file saved unchanged is no news.
        let files: Vec<(PathBuf, String)> = unreadable
            .iter()
            .map(|e| (e.path.clone(), e.problem.to_string()))
            .collect();
        let last = self.handed_on.take();
        let (last_nodes, last_errors, last_files) = match &last {
            Some((n, e, f)) => (Some(n), Some(e), Some(f)),
            None => (None, None, None),
        };
        let same_nodes = last_nodes.is_some_and(|n| {
            n.len() == nodes.len() && n.iter().zip(&nodes).all(|(a, b)| Arc::ptr_eq(a, b))
        });
        if !same_nodes {
            changes.nodes = Some(nodes.clone());
        }
        if last_errors != Some(&errors) {
            changes.errors = Some(errors.clone());
        }
        if last_files != Some(&files) {
            changes.unreadable = Some(unreadable);
        }
        self.handed_on = Some((nodes, errors, files));
        changes
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

/// Spawns the watcher. Nothing is handed on until the files were read once; then
/// everything is, and after each change what it changed. A source that cannot be
/// read at all hands on nothing, so the datapath keeps its last state instead of
/// being flushed.
pub fn watch(path: PathBuf) -> Result<ChangeReceiver, WatchError> {
    let (tx, rx) = changes::channel();
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
            let _ = events_tx.send((changed, Instant::now()));
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
        let (mut changed, mut since) = (Changed::All, Instant::now());
        loop {
            let started = Instant::now();
            let loaded = if changed.is_small() {
                // A few small files (the usual change: one object edited) are read
                // here: a hand-over to a blocking thread and back is two more
                // wake-ups, and on a busy node each can wait for a CPU far longer
                // than the read takes (a 32 ms "read" of an 890-byte manifest).
                let Changed::Files(files) = &changed else {
                    unreachable!("only files are small")
                };
                Ok(cache.load_files(files))
            } else {
                // Parsing takes the CPUs for a while at scale: off the async
                // workers, so /healthz and the agent loop stay responsive.
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
                loaded
            };
            match loaded {
                Ok(mut found) => {
                    let now_unreadable = found.unreadable.clone().unwrap_or_default();
                    report_unreadable(&unreadable, &now_unreadable);
                    unreadable = now_unreadable;
                    info!(
                        services = cache.services.used.len(),
                        endpoint_slices = cache.slices.used.len(),
                        changed = found.services.len() + found.slices.len(),
                        policy_objects_changed =
                            found.policies.len() + found.pods.len() + found.namespaces.len(),
                        problems = found.errors.as_ref().map_or(0, Vec::len),
                        unreadable_files = unreadable.len(),
                        read_ms = started.elapsed().as_millis() as u64,
                        "manifests read"
                    );
                    found.since = Some(since);
                    tx.record(found);
                    tx.publish();
                }
                Err(e) => warn!("{e}; keeping the current service table"),
            }
            // Whatever arrived meanwhile is handled in one go.
            let next = tokio::select! {
                next = events.recv() => next,
                () = tx.closed() => return,
            };
            let Some((next, at)) = next else {
                return;
            };
            (changed, since) = (next, at);
            while let Ok((more, _)) = events.try_recv() {
                changed = changed.merge(more);
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::changes::ObjectView;

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: NAME\n  namespace: default\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: 80\n";

    /// A cache and what a consumer applying its changes holds.
    #[derive(Default)]
    struct Seen {
        cache: FileCache,
        view: ObjectView,
    }

    impl Seen {
        fn load(&mut self, path: &Path) -> &ObjectView {
            let changes = self.cache.load(path).unwrap();
            self.view.apply(&changes);
            &self.view
        }
    }

    fn names(view: &ObjectView) -> Vec<String> {
        view.service_names()
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
        let mut seen = Seen::default();
        assert_eq!(names(seen.load(&dir)), ["a", "b"]);
        let a_before = seen.cache.files[&dir.join("a.yaml")]
            .objects
            .clone()
            .unwrap();

        write("b.yaml", "b2");
        let changes = seen.cache.load(&dir).unwrap();
        // Only what changed is handed on: b gone, b2 come.
        let mut changed: Vec<String> = changes
            .services
            .keys()
            .map(|k| k.name().to_owned())
            .collect();
        changed.sort();
        assert_eq!(changed, ["b", "b2"]);
        seen.view.apply(&changes);
        assert_eq!(names(&seen.view), ["a", "b2"]);
        // a.yaml was not read again: the same parsed objects are reused.
        let a_after = seen.cache.files[&dir.join("a.yaml")]
            .objects
            .clone()
            .unwrap();
        assert!(Arc::ptr_eq(&a_before, &a_after));

        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        write("c.yaml", "c");
        assert_eq!(names(seen.load(&dir)), ["b2", "c"]);
        assert_eq!(seen.cache.files.len(), 2, "a removed file leaves the cache");
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
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join("fifo.yaml"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();

        let mut seen = Seen::default();
        let loaded = seen.load(&dir);
        assert_eq!(names(loaded), ["good"]);
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
        let loaded = seen.load(&dir);
        assert_eq!(names(loaded), ["good", "was-binary"]);
        assert_eq!(loaded.unreadable.len(), 5);
        std::fs::write(dir.join("binary.yaml"), b"\xff").unwrap();
        let loaded = seen.load(&dir);
        assert_eq!(names(loaded), ["good", "was-binary"]);
        assert_eq!(loaded.unreadable.len(), 6);
        std::fs::write(dir.join("binary.yaml"), b"\xfe").unwrap();
        let loaded = seen.load(&dir);
        assert_eq!(
            names(loaded),
            ["good", "was-binary"],
            "still the last good read"
        );
        std::fs::remove_file(dir.join("binary.yaml")).unwrap();
        let loaded = seen.load(&dir);
        assert_eq!(
            names(loaded),
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
        let mut view = ObjectView::default();
        async fn wait_for(rx: &mut ChangeReceiver, view: &mut ObjectView, want: Vec<&str>) {
            let found = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while names(view) != want {
                    view.apply(&rx.next().await.expect("the source goes on"));
                }
            })
            .await;
            assert!(found.is_ok(), "never saw {want:?}: {:?}", names(view));
        }
        wait_for(&mut rx, &mut view, vec!["one"]).await;

        // kubelet's atomic update: a new timestamped dir, `..data` swapped by rename.
        std::fs::create_dir(dir.join("..v2")).unwrap();
        std::fs::write(dir.join("..v2/svc.yaml"), svc("two")).unwrap();
        symlink("..v2", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        wait_for(&mut rx, &mut view, vec!["two"]).await;

        // An editor writes a temporary file and renames it over the target.
        std::fs::write(dir.join(".extra.yaml.tmp"), svc("three")).unwrap();
        std::fs::rename(dir.join(".extra.yaml.tmp"), dir.join("extra.yaml")).unwrap();
        wait_for(&mut rx, &mut view, vec!["three", "two"]).await;
        std::fs::remove_file(dir.join("extra.yaml")).unwrap();
        wait_for(&mut rx, &mut view, vec!["two"]).await;
    }

    /// One name defined in two files: the first file by name is used and the other
    /// reported; when the first drops it, the other takes over. An object read again
    /// unchanged (another object of its file changed) is not handed on.
    #[test]
    fn a_name_defined_twice_is_used_once_and_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let svc = |name: &str, ip: &str| SERVICE.replace("NAME", name).replace("10.96.0.10", ip);
        std::fs::write(dir.join("a.yaml"), svc("web", "10.96.0.1")).unwrap();
        std::fs::write(
            dir.join("b.yaml"),
            svc("web", "10.96.0.2") + "---\n" + &svc("other", "10.96.0.3"),
        )
        .unwrap();
        let mut seen = Seen::default();
        let ip = |view: &ObjectView, name: &str| {
            let key = ObjectKey::new(None, name);
            view.services[&key]
                .spec
                .as_ref()
                .unwrap()
                .cluster_ip
                .clone()
                .unwrap()
        };
        let view = seen.load(&dir);
        assert_eq!(names(view), ["other", "web"]);
        assert_eq!(ip(view, "web"), "10.96.0.1");
        assert_eq!(view.errors.len(), 1, "{:?}", view.errors);
        let message = view.errors[0].to_string();
        assert!(
            message.starts_with("Service default/web: is defined again in")
                && message.contains("b.yaml")
                && message.contains("a.yaml"),
            "{message}"
        );

        // b.yaml changes its other object only: web's definition there is read
        // again unchanged and is no change; `other` is.
        std::fs::write(
            dir.join("b.yaml"),
            svc("web", "10.96.0.2") + "---\n" + &svc("other", "10.96.0.4"),
        )
        .unwrap();
        let changes = seen.cache.load(&dir).unwrap();
        let changed: Vec<&str> = changes.services.keys().map(|k| k.name()).collect();
        assert_eq!(changed, ["other"]);
        seen.view.apply(&changes);

        // a.yaml drops it: b.yaml's definition is used, and nothing is reported.
        std::fs::write(dir.join("a.yaml"), "").unwrap();
        let view = seen.load(&dir);
        assert_eq!(ip(view, "web"), "10.96.0.2");
        assert!(view.errors.is_empty(), "{:?}", view.errors);
        std::fs::remove_file(dir.join("b.yaml")).unwrap();
        assert!(names(seen.load(&dir)).is_empty());
    }

    const NAMESPACE: &str =
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  labels: {team: a}\n";
    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: NAME\n  namespace: x\n  labels: {app: LABEL}\nspec:\n  nodeName: node-1\nstatus:\n  podIP: IP\n";
    const DENY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny\n  namespace: x\nspec:\n  podSelector: {}\n";

    fn keys<T>(changes: &foldhash::HashMap<ObjectKey, changes::Change<T>>) -> Vec<String> {
        let mut keys: Vec<String> = changes.keys().map(ToString::to_string).collect();
        keys.sort();
        keys
    }

    /// NetworkPolicies, Pods and Namespaces are handed on by key, as Services
    /// are: a change of one pod's file hands on that pod alone, a file removed
    /// hands on a delete, a change undone before it was taken hands on nothing,
    /// and a name defined twice is used once and reported.
    #[tokio::test]
    async fn policy_kinds_are_handed_on_by_key() {
        use futures::FutureExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let pod = |name: &str, label: &str, ip: &str| {
            POD.replace("NAME", name)
                .replace("LABEL", label)
                .replace("IP", ip)
        };
        std::fs::write(dir.join("ns.yaml"), NAMESPACE).unwrap();
        std::fs::write(dir.join("pod-a.yaml"), pod("a", "a", "10.244.1.11")).unwrap();
        std::fs::write(dir.join("pod-b.yaml"), pod("b", "b", "10.244.1.12")).unwrap();
        std::fs::write(dir.join("deny.yaml"), DENY).unwrap();
        let mut cache = FileCache::default();
        let first = cache.load(&dir).unwrap();
        assert_eq!(keys(&first.pods), ["x/a", "x/b"]);
        // A Namespace is cluster-scoped: keyed by its name alone.
        assert_eq!(keys(&first.namespaces), ["x"]);
        assert_eq!(keys(&first.policies), ["x/deny"]);
        let b_first = first.pods[&ObjectKey::new(Some(&crate::source::intern::intern("x")), "b")]
            .current
            .clone()
            .unwrap();

        // b relabelled: b alone, from what was handed on to what is there now.
        std::fs::write(dir.join("pod-b.yaml"), pod("b", "other", "10.244.1.12")).unwrap();
        let changes = cache.load(&dir).unwrap();
        assert_eq!(keys(&changes.pods), ["x/b"]);
        assert!(changes.namespaces.is_empty() && changes.policies.is_empty());
        let change = changes.pods.values().next().unwrap();
        assert!(Arc::ptr_eq(change.previous.as_ref().unwrap(), &b_first));
        assert_eq!(
            change.current.as_ref().unwrap().labels.get("app"),
            Some("other")
        );

        // Relabelled and back before the agent took the change: nothing. (Each
        // write changes the file's size: written in place within one clock tick,
        // size is what tells the stamps apart.)
        let (tx, mut rx) = changes::channel();
        tx.record(changes);
        tx.publish();
        rx.next().await.unwrap();
        std::fs::write(dir.join("pod-b.yaml"), pod("b", "thirdx", "10.244.1.12")).unwrap();
        tx.record(cache.load(&dir).unwrap());
        std::fs::write(dir.join("pod-b.yaml"), pod("b", "other", "10.244.1.12")).unwrap();
        tx.record(cache.load(&dir).unwrap());
        tx.publish();
        assert!(rx.next().now_or_never().is_none(), "nothing handed on");

        // A file removed: a delete of its pod alone.
        std::fs::remove_file(dir.join("pod-a.yaml")).unwrap();
        let changes = cache.load(&dir).unwrap();
        assert_eq!(keys(&changes.pods), ["x/a"]);
        let change = changes.pods.values().next().unwrap();
        assert_eq!(&*change.previous.as_ref().unwrap().name, "a");
        assert!(change.current.is_none());

        // b defined again in a later file: the first is used, the other reported.
        std::fs::write(dir.join("pod-z.yaml"), pod("b", "z", "10.244.1.99")).unwrap();
        let changes = cache.load(&dir).unwrap();
        assert!(changes.pods.is_empty(), "{:?}", changes.pods);
        let errors = changes.errors.expect("the duplicate is reported");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let message = errors[0].to_string();
        assert!(
            message.starts_with("Pod x/b: is defined again in") && message.contains("pod-z.yaml"),
            "{message}"
        );
        // The first goes: the other takes over.
        std::fs::remove_file(dir.join("pod-b.yaml")).unwrap();
        let changes = cache.load(&dir).unwrap();
        assert_eq!(keys(&changes.pods), ["x/b"]);
        let current = changes
            .pods
            .values()
            .next()
            .unwrap()
            .current
            .clone()
            .unwrap();
        assert_eq!(current.labels.get("app"), Some("z"));
        assert_eq!(changes.errors.as_deref(), Some(&[][..]));
    }
}
