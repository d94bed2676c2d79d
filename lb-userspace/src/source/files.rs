//! Following manifest files: poll their metadata, reload on change, publish the objects.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;
use tracing::{info, warn};

use super::yaml::{self, Objects};

/// What the files looked like when last read: names, sizes, mtimes, inodes. Tools
/// replace files by rename, which changes the inode even when size and mtime match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Fingerprint(Vec<(PathBuf, u64, Option<SystemTime>, u64)>);

fn fingerprint(path: &Path) -> Fingerprint {
    use std::os::unix::fs::MetadataExt;
    let mut files = Vec::new();
    let mut push = |p: &Path| {
        if let Ok(meta) = std::fs::metadata(p) {
            files.push((
                p.to_path_buf(),
                meta.len(),
                meta.modified().ok(),
                meta.ino(),
            ));
        }
    };
    match std::fs::read_dir(path) {
        Ok(entries) => entries.flatten().for_each(|entry| push(&entry.path())),
        Err(_) => push(path),
    }
    files.sort();
    Fingerprint(files)
}

/// Spawns the poller. The receiver holds `None` until the files were read once; after
/// that, every change publishes a fresh snapshot. A source that cannot be read at all
/// publishes nothing, so the datapath keeps its last state instead of being flushed.
pub fn watch(path: PathBuf, interval: Duration) -> watch::Receiver<Option<Arc<Objects>>> {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<Fingerprint> = None;
        loop {
            ticker.tick().await;
            let seen = fingerprint(&path);
            if last.as_ref() == Some(&seen) {
                continue;
            }
            last = Some(seen);
            // Parsing takes the CPUs for a while at scale: off the async workers,
            // so /healthz and the agent loop stay responsive.
            let started = Instant::now();
            let load = tokio::task::spawn_blocking({
                let path = path.clone();
                move || yaml::load_path(&path)
            });
            let Ok(loaded) = load.await else {
                return; // the runtime is shutting down
            };
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
        }
    });
    rx
}
