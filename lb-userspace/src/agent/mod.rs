//! The agent loop: load the programs, then follow the objects (manifest files or the
//! API server) and the node's devices and addresses, and keep the maps and the
//! per-packet attachments equal to what they describe. Reads happen at the edges;
//! deciding what to write is the pure reconciler's job.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use lb_common::map_names;
use tracing::{debug, info, warn};

use crate::control::index::{Changes, DesiredIndex};
use crate::control::known::KnownTable;
use crate::control::plan;
use crate::control::{NodePortRange, SourceOptions};
use crate::datapath::conntrack;
use crate::datapath::loader::{self, LoadError, TcAttach};
use crate::datapath::maps::{MapsError, PinnedMaps};
use crate::datapath::pins::{self, MapSizes, PinLayout};
use crate::datapath::pins::{PinLock, PinLockError, Wait};
use crate::datapath::source_ranges;
use crate::datapath::table;
use crate::datapath::tc_links::{TcLinks, TcLinksError};
use crate::model::{DesiredState, Frontend};
use crate::node::host::{self, SysError};
use crate::node::netlink::{self, NetlinkError};
use crate::node::{self, NodeNet, NodePortAddresses, Overrides};
use crate::ops::{
    self, AgentStatus, BindAddress, HealthCheckServers, OpsServer, Routes, ServeConfig,
};
use crate::source::{self, files, kube, Objects};
use crate::stale_sockets;

/// How long to wait before retrying a service table the kernel refused.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Where Services and EndpointSlices come from.
#[derive(Clone, Debug)]
pub enum ObjectSource {
    /// A YAML/JSON manifest file or a directory of them, followed for changes.
    Files(PathBuf),
    /// The API server: this kubeconfig, else in-cluster config, else the default
    /// kubeconfig.
    Kubernetes { kubeconfig: Option<PathBuf> },
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub source: ObjectSource,
    /// cgroup v2 directory the socket hooks attach to.
    pub cgroup: PathBuf,
    pub pin: PinLayout,
    /// Endpoints on this node are "local" (internalTrafficPolicy: Local).
    pub node_name: String,
    /// `--node-ip`: NodePorts are served on these (unless `nodeport_addresses`
    /// selects otherwise), and the first one is the source address for traffic
    /// SNATed to backends on other nodes. Empty: found from the node's devices.
    pub node_ips: Vec<std::net::IpAddr>,
    /// kube-proxy's `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// NodePorts outside this range are refused.
    pub node_port_range: NodePortRange,
    /// `--zone`: this node's zone when its Node object (from the API server or
    /// the files) has no `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
    /// Kernel object to load instead of the embedded one.
    pub bpf_object: Option<PathBuf>,
    pub sizes: MapSizes,
    /// How the per-packet programs attach (`Off`: socket hooks only).
    pub tc_mode: TcAttach,
    /// Devices whose role the operator fixed (`--iface`, `--pod-iface`).
    pub tc_overrides: Overrides,
    /// Conntrack idle timeouts of the per-packet path.
    pub ct_timeouts: conntrack::Timeouts,
    /// How often idle conntrack entries are collected.
    pub ct_gc_interval: Duration,
    /// Where /healthz and /metrics listen (None: not served; equal: one listener).
    pub healthz_addr: BindAddress,
    pub metrics_addr: BindAddress,
    /// /healthz answers 503 once a change has waited longer than this to be applied.
    pub healthz_timeout: Duration,
    /// How often the maps are compared with what the agent wrote, and repaired.
    pub consistency_interval: Duration,
    /// Wait for another agent holding the pin directory to stop, instead of
    /// failing (a rolling update's new agent).
    pub wait_for_lock: bool,
    /// Close TCP connections to endpoints that left their Service (UDP sockets
    /// always are).
    pub terminate_tcp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Ops(#[from] ops::OpsError),
    #[error(transparent)]
    Kube(#[from] kube::KubeSourceError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Watch(#[from] files::WatchError),
    #[error(transparent)]
    PinLock(#[from] PinLockError),
    #[error(transparent)]
    TcLinks(#[from] TcLinksError),
    #[error(transparent)]
    Source(#[from] source::SourceError),
    #[error(transparent)]
    Pins(#[from] pins::PinsError),
    #[error(transparent)]
    Reaper(#[from] stale_sockets::ReaperError),
    #[error("cannot install signal handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// Runs until SIGINT/SIGTERM. The hooks and maps stay pinned afterwards: stopping the
/// agent must not stop the datapath.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    // Mistakes on the command line fail the start before anything is bound or loaded.
    if let ObjectSource::Files(path) = &config.source {
        files::check_source(path)?;
    }
    host::check_cgroup2_dir(&config.cgroup)?;
    // One agent per pin directory, before anything is bound, read or written: a
    // rolling update's new agent waits here (--wait-for-lock) while the old one
    // still has the ports.
    host::ensure_bpffs(config.pin.root())?;
    let pin_lock = lock_pin_dir(&config).await?;
    let status = Arc::new(AgentStatus::new());
    // Bound before anything is loaded: a taken port fails the start, not later.
    let mut listeners = Vec::new();
    for server in ops_servers(&config, &status).await? {
        info!(addr = %server.local_addr(), "serving health/metrics");
        listeners.push(tokio::spawn(async move {
            let _ = server.run().await;
        }));
    }
    // The source first: a bad kubeconfig fails the start before anything attaches.
    let mut objects = match &config.source {
        ObjectSource::Files(path) => files::watch(path.clone())?,
        ObjectSource::Kubernetes { kubeconfig } => {
            let client = kube::client(kubeconfig.as_deref()).await?;
            // Nothing is written to the maps until every cache has listed once: the
            // receiver stays empty until then.
            kube::watch(
                client,
                kube::KubeWatchOptions {
                    node_name: Some(config.node_name.clone()),
                    ..Default::default()
                },
            )
        }
    };
    // The runtime is single-threaded: the source's task first runs when this one
    // yields. Yield once so it starts reading (on a blocking thread) while this task
    // loads the programs, instead of after.
    tokio::task::yield_now().await;
    // The node's devices and addresses: where NodePorts are served and which
    // devices get the per-packet programs, followed from here on.
    let mut node_net = netlink::watch().await?;
    let mut net = node_net.borrow_and_update().clone();
    let object = loader::kernel_object(config.bpf_object.as_deref())?;
    // Maps first, hooks only after the first sync filled them: a first start, or an
    // upgrade to a new map layout (fresh maps in a new `v<N>` directory), never has a
    // moment where the new programs see an empty table.
    let retired = pins::other_layouts(&config.pin).unwrap_or_default();
    let loading = Instant::now();
    pins::check_map_sizes(&config.pin, config.sizes)?;
    let mut created_pins = pins::CreatedPins::before_load(&config.pin);
    let mut ebpf = loader::load(&object, &config.pin, config.sizes, &config.node_ips)?;
    loader::verify(&mut ebpf, config.tc_mode)?;
    info!(
        load_ms = loading.elapsed().as_millis() as u64,
        "datapath programs loaded"
    );
    let mut attached = false;
    let mut maps = PinnedMaps::open(&config.pin)?;
    let reaper = stale_sockets::Reaper::spawn(
        stale_sockets::ReaperConfig {
            pin: config.pin.clone(),
            cgroup: config.cgroup.clone(),
            close_tcp: config.terminate_tcp,
        },
        status.clone(),
    )?;
    // Frontend names by id, as of the last sync: a scrape reads only the counter
    // maps, never the whole service table.
    let frontend_names: Arc<Mutex<BTreeMap<u32, Frontend>>> = Arc::default();
    // A second handle for scrapes, so /metrics reads fresh datapath counters.
    let stats_maps = PinnedMaps::open(&config.pin)?;
    let names = frontend_names.clone();
    status.on_scrape(move |status| {
        match stats_maps.stats() {
            Ok(counters) => status.set_datapath_counters(&counters),
            Err(e) => debug!("reading the datapath counters: {e}"),
        }
        match stats_maps.service_stats() {
            Ok(counters) => {
                let names = names.lock();
                let rows: Vec<(String, u64, u64)> = counters
                    .iter()
                    .filter_map(|(id, c)| {
                        Some((names.get(id)?.to_string(), c.connections, c.no_backend))
                    })
                    .collect();
                status.set_service_counters(&rows);
            }
            Err(e) => debug!("reading the per-service counters: {e}"),
        }
    });

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(AgentError::Signal)?;
    let mut options = SourceOptions {
        node_name: config.node_name.clone(),
        node_ips: config.node_ips.clone(),
        node_port_range: config.node_port_range,
        zone: String::new(),
    };
    let overrides = Overrides {
        off: config.tc_mode == TcAttach::Off,
        ..config.tc_overrides.clone()
    };
    let mut tc_links = TcLinks::new(&config.pin, config.tc_mode)?;
    // The objects of the last sync: a change of the node's addresses re-derives
    // the table from them.
    let mut last: Option<Arc<Objects>> = None;
    let mut net_followed = true;
    // Set while the kernel rejected a write; the same objects are retried from a
    // fresh snapshot until they apply.
    let mut retry: Option<Arc<Objects>> = None;
    let mut known_table: Option<KnownTable> = None;
    // The desired state per Service: a change derives only its own Service.
    let mut index = DesiredIndex::new(options.clone());
    let mut health_checks = HealthCheckServers::default();
    let mut gc_ticker = tokio::time::interval(config.ct_gc_interval);
    gc_ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut consistency_ticker = tokio::time::interval_at(
        tokio::time::Instant::now() + config.consistency_interval,
        config.consistency_interval,
    );
    consistency_ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let current = tokio::select! {
            _ = gc_ticker.tick() => {
                match collect_idle_flows(&mut maps, &config.ct_timeouts) {
                    Ok(0) => {}
                    Ok(n) => debug!(entries = n, "conntrack entries expired"),
                    Err(e) => warn!("conntrack garbage collection failed: {e}"),
                }
                continue;
            }
            _ = consistency_ticker.tick(), if attached => {
                // The agent plans against what it remembers writing; an entry
                // changed behind its back (bpftool, another tool, a bug) would stay
                // wrong until the Service changed. Compare, and on a difference
                // forget the memory and sync from the kernel's table.
                let Some(known) = &known_table else { continue };
                match maps.holds(known.snapshot()) {
                    Ok(true) => continue,
                    Ok(false) => {
                        warn!("the service table in the kernel differs from what this agent wrote; repairing");
                        status.record_drift_repair();
                        known_table = None;
                        last.clone()
                    }
                    Err(e) => {
                        warn!("consistency check could not read the maps: {e}");
                        continue;
                    }
                }
            }
            changed = objects.changed() => {
                if changed.is_err() {
                    break;
                }
                objects.borrow_and_update().clone()
            }
            changed = node_net.changed(), if net_followed => {
                if changed.is_err() {
                    // The watcher logged why; what is attached stays attached.
                    net_followed = false;
                    continue;
                }
                net = node_net.borrow_and_update().clone();
                if attached {
                    tc_links.sync(&mut ebpf, &node::attachments(&net, &overrides));
                }
                // Only a change of the served addresses needs a new table.
                let served = served_addresses(&net, &config, last.as_deref());
                if served == options.node_ips {
                    continue;
                }
                info!(addresses = ?served, "node addresses changed");
                last.clone()
            }
            _ = tokio::time::sleep(RETRY_INTERVAL), if retry.is_some() => retry.take(),
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        };
        let Some(current) = current else { continue };
        status.record_pending();
        let started = Instant::now();
        options.node_ips = served_addresses(&net, &config, Some(&current));
        let zone = node_zone(&current.nodes, &config.node_name)
            .or_else(|| config.zone.clone())
            .unwrap_or_default();
        if zone != options.zone {
            info!(zone = %zone, "node zone for topology-aware routing");
            options.zone = zone;
        }
        last = Some(current.clone());
        if *index.options() != options {
            // Node addresses or zone: every Service reads differently.
            index = DesiredIndex::new(options.clone());
            known_table = None;
        }
        let changes = interpret(&current, &mut index, &status);
        let derived = started.elapsed();
        let desired = index.desired();
        // Starts, relists and bulk changes; single changes are in the debug line below.
        if known_table.is_none() || changes.services >= 1000 {
            info!(
                desired_ms = started.elapsed().as_millis() as u64,
                services = changes.services,
                frontends = desired.frontends.len(),
                "desired state built"
            );
        }
        // The hooks attach as soon as the first table is in the kernel; the
        // agent's own bookkeeping of what it wrote comes after.
        let ranges_first = match &known_table {
            Some(table) => maps
                .sync_source_ranges(
                    &source_ranges::wanted(index.restricted(), table.snapshot()),
                    false,
                )
                .map(|_| ()),
            None => Ok(()),
        };
        let ranged = started.elapsed();
        let written = ranges_first
            .and_then(|()| write_table(&mut maps, desired, &changes.frontends, &mut known_table))
            .map_err(SyncError::from);
        let wrote = started.elapsed();
        let recorded = written.and_then(|written| {
            if !attached {
                // A device named by a flag that is not there is a typo, not a device
                // to wait for: fail before anything attaches.
                if let Some((flag, device)) = node::missing_override(&net, &overrides) {
                    let present: Vec<&str> = net.links.values().map(|l| l.name.as_str()).collect();
                    return Err(SyncError::Attach(LoadError::MissingDevice {
                        flag,
                        device: device.to_owned(),
                        present: present.join(", "),
                    }));
                }
                let mut pins = loader::attach_cgroup_hooks(&mut ebpf, &config.pin, &config.cgroup)
                    .map_err(SyncError::Attach)?;
                tc_links.sync(&mut ebpf, &node::attachments(&net, &overrides));
                pins.extend(tc_links.pins());
                loader::remove_stale_links(&config.pin, &pins).map_err(SyncError::Attach)?;
                tc_links.retire_stale_records();
                attached = true;
                info!(
                    cgroup = %config.cgroup.display(),
                    pin_dir = %config.pin.root().display(),
                    "hooks attached"
                );
                retire_layouts(&retired);
                status.mark_initial_sync();
                info!(
                    frontends = desired.frontends.len(),
                    backends = index.backend_count(),
                    "ready and serving"
                );
            }
            let outcome = record_table(&mut maps, written, &mut known_table)?;
            if let Some(table) = &known_table {
                maps.sync_source_ranges(
                    &source_ranges::wanted(index.restricted(), table.snapshot()),
                    true,
                )?;
            }
            Ok(outcome)
        });
        if attached {
            created_pins.keep();
        }
        match recorded {
            Ok(outcome) => {
                retry = None;
                debug!(
                    derive_us = derived.as_micros() as u64,
                    ranges_us = (ranged - derived).as_micros() as u64,
                    write_us = (wrote - ranged).as_micros() as u64,
                    total_us = started.elapsed().as_micros() as u64,
                    services = changes.services,
                    frontends = changes.frontends.len(),
                    "change applied"
                );
                for e in health_checks.update(&desired.health_checks).await {
                    warn!("healthCheckNodePort not served: {e}");
                }
                let mut names = frontend_names.lock();
                match outcome.frontend_names {
                    NamesUpdate::Unchanged => {}
                    NamesUpdate::Replace(all) => *names = all,
                    NamesUpdate::Patch(patch) => {
                        for (id, name) in patch {
                            match name {
                                Some(name) => names.insert(id, name),
                                None => names.remove(&id),
                            };
                        }
                    }
                }
                drop(names);
                let capacity = maps.capacity();
                status.set_map_usage(
                    map_names::SERVICES,
                    outcome.services_used,
                    capacity.services,
                );
                status.set_map_usage(
                    map_names::BACKENDS,
                    outcome.backends_used,
                    capacity.backends,
                );
                status.record_sync(
                    started.elapsed(),
                    desired.frontends.len(),
                    index.backend_count(),
                );
                status.record_programmed(&changes.slices, &changes.gone_slices);
                reaper.send(outcome.departed);
            }
            Err(SyncError::Attach(e)) => return Err(e.into()),
            Err(SyncError::Maps(e)) => {
                status.record_sync_error();
                warn!("applying the service table failed, retrying: {e}");
                retry = Some(current);
            }
        }
    }
    info!("stopping; hooks and maps stay pinned (`lb cleanup` removes them)");
    // The ports go before the lock: a rolling update's next agent, waiting for the
    // lock, binds them as soon as it has it.
    health_checks.shutdown().await;
    ops::stop_all(listeners).await;
    drop(pin_lock);
    Ok(())
}

/// Takes the pin directory's lock (creating the directory if needed): at once, or
/// after the holder stopped when `--wait-for-lock` says so.
async fn lock_pin_dir(config: &AgentConfig) -> Result<PinLock, AgentError> {
    let root = config.pin.root().to_path_buf();
    std::fs::create_dir_all(&root).map_err(|source| LoadError::PinDir {
        path: root.clone(),
        source,
    })?;
    match PinLock::acquire(&root, Wait::No) {
        Err(PinLockError::Held { holder, .. }) if config.wait_for_lock => {
            info!(
                pin_dir = %root.display(),
                holder = ?holder,
                "waiting for the agent holding the pin directory to stop"
            );
            let lock = tokio::task::spawn_blocking(move || PinLock::acquire(&root, Wait::Yes))
                .await
                .expect("the lock wait does not panic")?;
            info!("pin directory lock taken over");
            Ok(lock)
        }
        other => Ok(other?),
    }
}

/// Unpins the maps of other layout versions once this agent's programs replaced
/// the ones that used them. Their conntrack and affinity state is not carried over:
/// established sockets keep working (the socket LB needs no per-packet state), flows
/// of the per-packet path are picked up anew.
fn retire_layouts(retired: &[PathBuf]) {
    for dir in retired {
        match pins::remove_layout(dir) {
            Ok(()) => info!(dir = %dir.display(), "retired maps of another layout version"),
            Err(e) => warn!("cannot remove old maps in {}: {e}", dir.display()),
        }
    }
}

/// Applies kube-proxy's semantics to the objects; bad objects are logged and skipped
/// so the rest still applies.
/// Brings the per-Service index to `objects`; logs the problems of what changed
/// and counts all of them.
fn interpret(objects: &Objects, index: &mut DesiredIndex, status: &AgentStatus) -> Changes {
    for error in &objects.errors {
        warn!("skipped: {error}");
    }
    let changes = index.sync(objects);
    for error in &changes.new_errors {
        warn!("skipped: {error}");
    }
    status.record_object_errors(objects.errors.len() + index.error_count());
    status.set_unreadable_files(
        objects
            .unreadable
            .iter()
            .map(|e| (e.path.clone(), e.problem.to_string()))
            .collect(),
    );
    changes
}

/// Where NodePorts are served now: kube-proxy's `--nodeport-addresses` over the
/// node's addresses, `--node-ip`, and the Node object's (for `primary`).
fn served_addresses(
    net: &NodeNet,
    config: &AgentConfig,
    objects: Option<&Objects>,
) -> Vec<std::net::IpAddr> {
    let from_node = objects
        .map(|o| node_addresses(&o.nodes, &config.node_name))
        .unwrap_or_default();
    node::nodeport_addresses(
        net,
        &config.nodeport_addresses,
        &config.node_ips,
        &from_node,
    )
}

/// This node's InternalIP/ExternalIP addresses (both families) from its Node
/// object: its primary addresses when `--node-ip` does not say.
fn node_addresses(
    nodes: &[Arc<k8s_openapi::api::core::v1::Node>],
    node_name: &str,
) -> Vec<std::net::IpAddr> {
    nodes
        .iter()
        .filter(|n| n.metadata.name.as_deref() == Some(node_name))
        .filter_map(|n| n.status.as_ref()?.addresses.as_ref())
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// This node's `topology.kubernetes.io/zone` label from its Node object.
fn node_zone(nodes: &[Arc<k8s_openapi::api::core::v1::Node>], node_name: &str) -> Option<String> {
    nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node_name))?
        .metadata
        .labels
        .as_ref()?
        .get(crate::source::labels::LABEL_ZONE)
        .filter(|zone| !zone.is_empty())
        .cloned()
}

/// The health/metrics listeners: one serving both when the addresses are equal.
async fn ops_servers(
    config: &AgentConfig,
    status: &Arc<AgentStatus>,
) -> Result<Vec<OpsServer>, ops::OpsError> {
    let serve = ServeConfig::new(config.healthz_timeout);
    let wanted = match (config.healthz_addr.0, config.metrics_addr.0) {
        (Some(h), Some(m)) if h == m => vec![(h, Routes::ALL)],
        (h, m) => h
            .map(|a| (a, Routes::HEALTHZ))
            .into_iter()
            .chain(m.map(|a| (a, Routes::METRICS)))
            .collect(),
    };
    let mut servers = Vec::new();
    for (addr, routes) in wanted {
        servers.push(OpsServer::bind(addr, status.clone(), serve.clone().routes(routes)).await?);
    }
    Ok(servers)
}

/// Deletes the entries of flows idle past their timeout. An entry is re-read just
/// before its deletion and kept if a packet touched it since the scan, so a flow
/// that came back to life at the last moment keeps its backend.
fn collect_idle_flows(
    maps: &mut PinnedMaps,
    timeouts: &conntrack::Timeouts,
) -> Result<usize, MapsError> {
    let entries = maps.conntrack()?;
    let idle = conntrack::expired(&entries, conntrack::monotonic_now_ns(), timeouts);
    drop(entries);
    let mut removed = 0;
    for (key, seen) in idle {
        let Some(current) = maps.conntrack_entry(&key)? else {
            continue;
        };
        // Seen again since it was read: the flow is alive.
        if current.last_seen_ns != seen {
            continue;
        }
        maps.remove_conntrack(&key)?;
        removed += 1;
    }
    Ok(removed)
}

/// Why a sync did not complete: the maps (retried with the same objects), or
/// attaching the hooks after the first one (fatal).
#[derive(Debug, thiserror::Error)]
enum SyncError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Attach(LoadError),
}

/// The first half of a sync: the desired table planned against what the maps hold
/// and written to the kernel.
struct Written {
    /// The table before the plan; `record_table` applies the plan to it.
    table: KnownTable,
    plan: plan::Plan,
    /// Only the changed frontends were planned, against the kept table.
    incremental: bool,
    /// The table was read from the kernel, not remembered.
    read_kernel: bool,
    /// Writes made and recorded in `table` piece by piece (into empty maps), so
    /// `plan` holds none of them.
    written_ahead: usize,
}

/// Frontends planned and written at a time into empty maps: the plan of a start
/// then never holds all its writes (at 100k Services x 10 endpoints, 2.1 million
/// writes, 92 MB); a piece of 1024 frontends is about 21k writes at 10 endpoints.
const START_PIECE: usize = 1024;

/// Writes the difference between `desired` and the maps. With a kept table (`known`,
/// what the last sync left) only the `changed` frontends are planned; without one
/// (start, after a failure or a repair, new options) the kernel's table is read and
/// planned whole. `known` is taken, so a failure makes the next sync read the
/// kernel again.
fn write_table(
    maps: &mut PinnedMaps,
    desired: &DesiredState,
    changed: &std::collections::BTreeSet<crate::model::Frontend>,
    known: &mut Option<KnownTable>,
) -> Result<Written, MapsError> {
    let started = Instant::now();
    let capacity = maps.capacity();
    let (table, plan, incremental, read_kernel) = match known.take() {
        Some(mut table) => {
            let plan = plan::plan_changes(desired, changed, &mut table, capacity);
            (table, plan, true, false)
        }
        None => {
            let current = maps.snapshot()?;
            if current.services.is_empty() && current.backends.is_empty() {
                return write_in_pieces(maps, desired, KnownTable::new(current, capacity));
            }
            let plan = plan::plan(desired, &current, capacity);
            (KnownTable::new(current, capacity), plan, false, true)
        }
    };
    let planned = started.elapsed();
    for rejected in &plan.rejected {
        warn!("{rejected}");
    }
    if !plan.is_empty() {
        maps.apply(&plan.ops)?;
        let fields = (
            planned.as_micros() as u64,
            (started.elapsed() - planned).as_micros() as u64,
        );
        if incremental {
            debug!(
                plan_us = fields.0,
                apply_us = fields.1,
                operations = plan.ops.len(),
                frontends = changed.len(),
                "changed frontends applied"
            );
        } else {
            info!(
                plan_ms = fields.0 / 1000,
                apply_ms = fields.1 / 1000,
                operations = plan.ops.len(),
                frontends = desired.frontends.len(),
                backends = desired.backend_count(),
                "service table applied"
            );
        }
    }
    Ok(Written {
        table,
        plan,
        incremental,
        read_kernel,
        written_ahead: 0,
    })
}

/// Writes `desired` into empty maps [`START_PIECE`] frontends at a time, each
/// piece planned against what the pieces before it wrote (as one change is), so
/// that every prefix of the writes is a consistent table, as with one plan.
fn write_in_pieces(
    maps: &mut PinnedMaps,
    desired: &DesiredState,
    mut table: KnownTable,
) -> Result<Written, MapsError> {
    let capacity = maps.capacity();
    let (mut planning, mut applying) = (Duration::ZERO, Duration::ZERO);
    let mut operations = 0;
    let mut started = Instant::now();
    plan::plan_in_pieces(desired, &mut table, capacity, START_PIECE, |plan| {
        let planned = Instant::now();
        planning += planned - started;
        for rejected in &plan.rejected {
            warn!("{rejected}");
        }
        maps.apply(&plan.ops)?;
        operations += plan.ops.len();
        started = Instant::now();
        applying += started - planned;
        Ok(())
    })?;
    if operations > 0 {
        info!(
            plan_ms = planning.as_millis() as u64,
            apply_ms = applying.as_millis() as u64,
            operations,
            frontends = desired.frontends.len(),
            backends = desired.backend_count(),
            "service table applied"
        );
    }
    Ok(Written {
        table,
        plan: plan::Plan::default(),
        incremental: false,
        read_kernel: true,
        written_ahead: operations,
    })
}

/// The second half: remembers what was written and drops the counters of
/// frontends that are gone.
fn record_table(
    maps: &mut PinnedMaps,
    written: Written,
    known: &mut Option<KnownTable>,
) -> Result<SyncOutcome, MapsError> {
    let Written {
        mut table,
        plan,
        incremental,
        read_kernel,
        written_ahead,
    } = written;
    let mut frontend_names = NamesUpdate::Unchanged;
    let touched = stale_sockets::Touched::before(table.snapshot(), &plan.ops);
    if incremental {
        let patch = table::frontend_names_patch(table.snapshot(), &plan.ops);
        let gone: Vec<u32> = patch
            .iter()
            .filter(|(_, name)| name.is_none())
            .map(|(id, _)| *id)
            .collect();
        table.apply(&plan.ops);
        maps.remove_service_stats(&gone)?;
        if !patch.is_empty() {
            frontend_names = NamesUpdate::Patch(patch);
        }
    } else {
        if !plan.is_empty() || written_ahead > 0 {
            table.apply(&plan.ops);
            let live = table
                .snapshot()
                .services
                .iter()
                .filter(|(key, _)| key.backend_slot == 0)
                .map(|(_, master)| master.rev_nat_id)
                .collect();
            maps.prune_service_stats(&live)?;
        }
        if !plan.is_empty() || read_kernel {
            frontend_names = NamesUpdate::Replace(table::frontend_names(table.snapshot()));
        }
    }
    let outcome = SyncOutcome {
        services_used: table.snapshot().services.len(),
        backends_used: table.snapshot().backends.len(),
        frontend_names,
        departed: touched.departed(table.snapshot()),
    };
    *known = Some(table);
    Ok(outcome)
}

/// How the frontend names (by id, for the per-Service metrics) change.
enum NamesUpdate {
    Unchanged,
    Replace(BTreeMap<u32, Frontend>),
    /// Ids whose name is now this, or gone (`None`).
    Patch(Vec<(u32, Option<Frontend>)>),
}

/// What a successful sync left in the maps.
struct SyncOutcome {
    services_used: usize,
    backends_used: usize,
    frontend_names: NamesUpdate,
    /// Backends that left frontends of the socket hooks.
    departed: Vec<stale_sockets::Departed>,
}
