//! Following manifest files: poll their metadata, reload what changed, publish the
//! objects.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;
use tracing::{info, warn};

use super::yaml::{self, Objects, SourceError};

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
#[derive(Default)]
struct FileCache(HashMap<PathBuf, (Stamp, Arc<Objects>)>);

impl FileCache {
    fn load(&mut self, path: &Path) -> Result<Objects, SourceError> {
        let files = yaml::manifest_files(path)?;
        let mut previous = std::mem::take(&mut self.0);
        let mut all = Objects::default();
        for file in files {
            // Stamped before reading: a file that changes during the read differs
            // from its stamp at the next poll and is read again.
            let before = stamp(&file);
            let cached = previous
                .remove(&file)
                .filter(|(seen, _)| before == Some(*seen));
            let objects = match cached {
                Some((_, objects)) => objects,
                None => Arc::new(yaml::load_file(&file)?),
            };
            all.append(Objects::clone(&objects));
            if let Some(seen) = before {
                self.0.insert(file, (seen, objects));
            }
        }
        Ok(all)
    }
}

/// Spawns the poller. The receiver holds `None` until the files were read once; after
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
                    info!(
                        services = objects.services.len(),
                        endpoint_slices = objects.slices.len(),
                        problems = objects.errors.len(),
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
}
