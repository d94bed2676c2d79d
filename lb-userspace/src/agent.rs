//! The agent loop: attach once, then follow the manifest files and keep the maps equal
//! to what they describe. Reads happen at the edges; deciding what to write is the
//! pure reconciler's job.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tracing::{info, warn};

use crate::loader::{self, LoadError, MapSizes, PinLayout};
use crate::maps::{MapsError, PinnedMaps};
use crate::model::DesiredState;
use crate::reconcile;
use crate::source::{self, SourceOptions};
use crate::sys::{self, SysError};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// A YAML/JSON manifest file or a directory of them.
    pub services_file: PathBuf,
    /// cgroup v2 directory the socket hooks attach to.
    pub cgroup: PathBuf,
    pub pin: PinLayout,
    /// Endpoints on this node are "local" (internalTrafficPolicy: Local).
    pub node_name: String,
    /// Kernel object to load instead of the embedded one.
    pub bpf_object: Option<PathBuf>,
    pub sizes: MapSizes,
    /// How often the manifest files are checked for changes.
    pub poll_interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("cannot install signal handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// What the files looked like when last applied: names, sizes, mtimes, inodes.
/// Editors and `kubectl`-style tools replace files by rename, which changes the
/// inode even when size and mtime happen to match.
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
        Ok(entries) => {
            for entry in entries.flatten() {
                push(&entry.path());
            }
        }
        Err(_) => push(path),
    }
    files.sort();
    Fingerprint(files)
}

/// Runs until SIGINT/SIGTERM. The hooks and maps stay pinned afterwards: stopping the
/// agent must not stop the datapath.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    sys::ensure_bpffs(config.pin.root())?;
    let object = loader::kernel_object(config.bpf_object.as_deref())?;
    loader::load_and_attach(&object, &config.pin, config.sizes, &config.cgroup)?;
    let mut maps = PinnedMaps::open(&config.pin)?;
    info!(
        cgroup = %config.cgroup.display(),
        pin_dir = %config.pin.root().display(),
        "socket hooks attached"
    );

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(AgentError::Signal)?;
    let mut ticker = tokio::time::interval(config.poll_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let options = SourceOptions {
        node_name: config.node_name.clone(),
    };
    let mut applied: Option<Fingerprint> = None;
    let mut ready = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        }
        let seen = fingerprint(&config.services_file);
        if applied.as_ref() == Some(&seen) {
            continue;
        }
        let Some(desired) = read_desired(&config.services_file, &options) else {
            // The whole source is unreadable: keep the datapath as it is and retry on
            // the next change rather than flushing every Service.
            applied = Some(seen);
            continue;
        };
        match sync(&mut maps, &desired) {
            Ok(()) => {
                applied = Some(seen);
                if !ready {
                    ready = true;
                    info!(
                        frontends = desired.frontends.len(),
                        backends = desired.backend_count(),
                        "ready and serving"
                    );
                }
            }
            // Kernel write failures are retried on the next tick from a fresh snapshot.
            Err(e) => warn!("applying the service table failed, will retry: {e}"),
        }
    }
    info!("stopping; hooks and maps stay pinned (`lb cleanup` removes them)");
    Ok(())
}

/// Reads the manifests and applies kube-proxy's semantics; bad objects are logged and
/// skipped so the rest still applies.
fn read_desired(path: &Path, options: &SourceOptions) -> Option<DesiredState> {
    let objects = match source::yaml::load_path(path) {
        Ok(objects) => objects,
        Err(e) => {
            warn!("{e}");
            return None;
        }
    };
    for error in &objects.errors {
        warn!("skipped: {error}");
    }
    let (desired, errors) = source::build_desired(&objects.services, &objects.slices, options);
    for error in &errors {
        warn!("skipped: {error}");
    }
    Some(desired)
}

fn sync(maps: &mut PinnedMaps, desired: &DesiredState) -> Result<(), MapsError> {
    let current = maps.snapshot()?;
    let plan = reconcile::plan(desired, &current, maps.capacity());
    for rejected in &plan.rejected {
        warn!("{rejected}");
    }
    if !plan.is_empty() {
        maps.apply(&plan.ops)?;
        info!(
            operations = plan.ops.len(),
            frontends = desired.frontends.len(),
            backends = desired.backend_count(),
            "service table applied"
        );
    }
    Ok(())
}
