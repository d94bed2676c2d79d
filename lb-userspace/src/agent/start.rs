//! Start-up and shutdown: everything bound, read and loaded once, in the order that
//! lets a mistake fail the start before anything is attached, and a rolling
//! update's next agent take over cleanly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use aya::Ebpf;
use tokio::sync::watch;
use tracing::info;

use super::names::FrontendNames;
use super::{AgentConfig, AgentError, ObjectSource};
use crate::control::index::DesiredIndex;
use crate::control::known::KnownTable;
use crate::control::masquerade::MasqueradeMode;
use crate::control::SourceOptions;
use crate::datapath::device_links::DeviceLinks;
use crate::datapath::loader::{self, LoadError, ProgramSettings, TcAttach};
use crate::datapath::maps::{PinnedMaps, QuarantineMap};
use crate::datapath::pins::{self, CreatedPins, PinLock, PinLockError, Wait};
use crate::datapath::policy::PolicyMaps;
use crate::node::host;
use crate::node::netlink;
use crate::node::{NodeNet, Overrides};
use crate::ops::{self, AgentStatus, HealthCheckServers, OpsServer, Routes, ServeConfig};
use crate::source::changes::ChangeReceiver;
use crate::source::{files, kube, FileError, ObjectError};
use crate::stale_sockets;
use k8s_openapi::api::core::v1::Node;
use lb_common::{MasqSettings, PolicySettings, QuarantineSettings};

/// A running agent: what it holds between changes.
pub(super) struct Agent {
    pub(super) config: AgentConfig,
    pub(super) status: Arc<AgentStatus>,
    pub(super) ebpf: Ebpf,
    pub(super) maps: PinnedMaps,
    pub(super) links: DeviceLinks,
    /// The device roles the operator fixed, and whether TC is off.
    pub(super) overrides: Overrides,
    /// The node's devices and addresses, as last reported.
    pub(super) net: NodeNet,
    /// What the source said last about Nodes, and the problems of its objects and
    /// files (the file source).
    pub(super) nodes: Vec<Arc<Node>>,
    pub(super) source_errors: Vec<ObjectError>,
    pub(super) unreadable: Vec<FileError>,
    /// The desired state per Service: a change derives only its own Service.
    pub(super) index: DesiredIndex,
    /// What this agent wrote, as it remembers it; `None` makes the next change read
    /// the kernel's table and plan it whole (start, a failure, a repair).
    pub(super) known_table: Option<KnownTable>,
    /// The consistency check under way, which notes the writes made meanwhile.
    pub(super) check: Option<super::consistency::Check>,
    /// A device did not get its program at the last sync: tried again shortly.
    pub(super) devices_pending: bool,
    /// The hooks are attached (after the first table was written).
    pub(super) attached: bool,
    pub(super) health_checks: HealthCheckServers,
    pub(super) names: FrontendNames,
    pub(super) reaper: stale_sockets::Reaper,
    /// Deletes idle conntrack entries, on its own thread.
    _collector: super::ct_gc::Collector,
    /// Pins this start created; removed if the start fails before attaching.
    pub(super) created_pins: CreatedPins,
    /// Map directories of other layout versions, unpinned once the hooks attached.
    pub(super) retired: Vec<PathBuf>,
    /// The masquerading address sets (the cluster set always; egress
    /// masquerading's with `--masquerade bpf`).
    pub(super) masquerade: super::masquerade::Masquerade,
    /// NetworkPolicy's compiler and maps (`--network-policy on`).
    pub(super) policy: Option<super::policy::Policy>,
    /// Held until the listeners are closed (see [`Agent::stop`]).
    pin_lock: Option<PinLock>,
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

/// What the loop follows besides the agent's own timers.
pub(super) struct Inputs {
    pub(super) objects: ChangeReceiver,
    pub(super) node_net: watch::Receiver<NodeNet>,
}

/// Checks the configuration, takes the pin directory, binds the listeners, starts
/// the source and loads the programs; attaching waits for the first table.
pub(super) async fn start(config: AgentConfig) -> Result<(Agent, Inputs), AgentError> {
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
    status.set_modes(modes(&config));
    // Bound before anything is loaded: a taken port fails the start, not later.
    let mut listeners = Vec::new();
    for server in ops_servers(&config, &status).await? {
        info!(addr = %server.local_addr(), "serving health/metrics");
        listeners.push(tokio::spawn(async move {
            let _ = server.run().await;
        }));
    }
    // The source first: a bad kubeconfig fails the start before anything attaches.
    let objects = match &config.source {
        ObjectSource::Files(path) => files::watch(path.clone())?,
        ObjectSource::Kubernetes { kubeconfig } => {
            let client = kube::client(kubeconfig.as_deref()).await?;
            // Nothing is handed on until every cache has listed once.
            kube::watch(
                client,
                kube::KubeWatchOptions {
                    // Masquerading needs every Node's pod CIDRs; otherwise this
                    // node's object is all the agent reads, and its pod CIDRs
                    // (with --cluster-cidr) are the cluster-IP rule's local
                    // sources, as kube-proxy's --detect-local-mode=NodeCIDR.
                    node_name: (config.masquerade == MasqueradeMode::Off)
                        .then(|| config.node_name.clone()),
                    network_policy: config.network_policy,
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
    let net = node_net.borrow_and_update().clone();
    let object = loader::kernel_object(config.bpf_object.as_deref())?;
    // Maps first, hooks only after the first sync filled them: a first start, or an
    // upgrade to a new map layout (fresh maps in a new `v<N>` directory), never has a
    // moment where the new programs see an empty table.
    let retired = pins::other_layouts(&config.pin).unwrap_or_default();
    let loading = Instant::now();
    pins::check_map_sizes(&config.pin, config.sizes)?;
    let created_pins = CreatedPins::before_load(&config.pin);
    let masquerading = config.masquerade == MasqueradeMode::Bpf;
    let settings = ProgramSettings {
        maglev_seed: config.maglev_seed,
        forwarding: config.forwarding,
        masquerade: MasqSettings {
            enabled: u8::from(masquerading),
            masquerade_all: u8::from(config.masquerade_all),
            nodeport_first_host: config.node_port_range.first,
            nodeport_last_host: config.node_port_range.last,
            ..MasqSettings::default()
        },
        quarantine: QuarantineSettings {
            enabled: u32::from(config.backend_quarantine),
        },
        policy: PolicySettings {
            enabled: u32::from(config.network_policy),
        },
    };
    let mut ebpf = loader::load_with(
        &object,
        &config.pin,
        config.sizes,
        &config.node_ips,
        &settings,
    )?;
    loader::verify(&mut ebpf, config.tc_mode, config.xdp_mode, &settings)?;
    info!(
        load_ms = loading.elapsed().as_millis() as u64,
        lb_mode = ?config.forwarding.mode,
        dsr_dispatch = ?config.forwarding.dispatch,
        "datapath programs loaded"
    );
    let mut maps = PinnedMaps::open(&config.pin)?;
    maps.set_maglev_seed(config.maglev_seed);
    let reaper = stale_sockets::Reaper::spawn(
        stale_sockets::ReaperConfig {
            pin: config.pin.clone(),
            cgroup: config.cgroup.clone(),
            close_tcp: config.terminate_tcp,
        },
        status.clone(),
    )?;
    let collector = super::ct_gc::Collector::spawn(
        &config.pin,
        config.ct_timeouts,
        config.ct_gc_interval,
        masquerading,
        status.clone(),
    )?;
    let names = FrontendNames::default();
    // A second handle for scrapes, so /metrics reads fresh datapath counters.
    names.serve_scrapes(
        &status,
        PinnedMaps::open(&config.pin)?,
        QuarantineMap::open(&config.pin).ok(),
    );
    let overrides = Overrides {
        off: config.tc_mode == TcAttach::Off,
        ..config.tc_overrides.clone()
    };
    let links = DeviceLinks::new(
        &config.pin,
        config.tc_mode,
        config.xdp_mode,
        masquerading,
        settings.policy.is_enabled(),
    )?;
    let masquerade = super::masquerade::Masquerade::start(
        config.masquerade,
        &config.pin,
        config.ip_masq_agent_config.clone(),
        config.cluster_cidrs.clone(),
        config.node_name.clone(),
    )?;
    let policy = if config.network_policy {
        let mut policy = super::policy::Policy::open(&config.pin, &config.node_name)?;
        policy.set_node_addresses(net.addresses());
        policy.serve_queries(&status, PolicyMaps::open(&config.pin)?);
        Some(policy)
    } else {
        None
    };
    let index = DesiredIndex::new(SourceOptions {
        node_name: config.node_name.clone(),
        node_ips: config.node_ips.clone(),
        node_port_range: config.node_port_range,
        zone: String::new(),
        lb_algorithm: config.lb_algorithm,
    });
    let agent = Agent {
        config,
        status,
        ebpf,
        maps,
        links,
        overrides,
        net,
        nodes: Vec::new(),
        source_errors: Vec::new(),
        unreadable: Vec::new(),
        index,
        known_table: None,
        check: None,
        devices_pending: false,
        attached: false,
        health_checks: HealthCheckServers::default(),
        names,
        reaper,
        _collector: collector,
        created_pins,
        retired,
        masquerade,
        policy,
        pin_lock: Some(pin_lock),
        listeners,
    };
    Ok((agent, Inputs { objects, node_net }))
}

impl Agent {
    /// The first table is in the kernel: attach the hooks and the per-packet
    /// programs, retire what a previous agent left, and say so.
    pub(super) fn attach(&mut self) -> Result<(), LoadError> {
        // A device named by a flag that is not there is a typo, not a device to
        // wait for: fail before anything attaches.
        if let Some((flag, device)) = crate::node::missing_override(&self.net, &self.overrides) {
            let present: Vec<&str> = self.net.links.values().map(|l| l.name.as_str()).collect();
            return Err(LoadError::MissingDevice {
                flag,
                device: device.to_owned(),
                present: present.join(", "),
            });
        }
        let mut pins = loader::attach_cgroup_hooks(
            &mut self.ebpf,
            &self.config.pin,
            &self.config.cgroup,
            self.config.backend_quarantine,
        )?;
        self.sync_devices();
        pins.extend(self.links.pins());
        loader::remove_stale_links(&self.config.pin, &pins)?;
        self.links.retire_stale_records();
        self.attached = true;
        let config = &self.config;
        info!(
            cgroup = %config.cgroup.display(),
            pin_dir = %config.pin.root().display(),
            "hooks attached"
        );
        for dir in &self.retired {
            // Their conntrack and affinity state is not carried over: established
            // sockets keep working (the socket LB needs no per-packet state), flows
            // of the per-packet path are picked up anew.
            match pins::remove_layout(dir) {
                Ok(()) => info!(dir = %dir.display(), "retired maps of another layout version"),
                Err(e) => tracing::warn!("cannot remove old maps in {}: {e}", dir.display()),
            }
        }
        self.status.mark_initial_sync();
        Ok(())
    }

    /// The per-packet programs on the devices the node has now.
    /// Attaches and detaches as the node's devices now want; a device that could
    /// not get its program leaves `devices_pending` set, and the loop tries again.
    pub(super) fn sync_devices(&mut self) {
        let wanted = crate::node::attachments(&self.net, &self.overrides);
        self.devices_pending = !self.links.sync(&mut self.ebpf, &wanted, &self.net);
        self.status.set_xdp(self.links.xdp_reports());
    }

    /// Stops serving: the ports go before the lock, so a rolling update's next
    /// agent, waiting for the lock, binds them as soon as it has it. The hooks and
    /// maps stay.
    pub(super) async fn stop(mut self) {
        info!("stopping; hooks and maps stay pinned (`lb cleanup` removes them)");
        std::mem::take(&mut self.health_checks).shutdown().await;
        ops::stop_all(std::mem::take(&mut self.listeners)).await;
        drop(self.pin_lock.take());
    }
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

/// The datapath modes of `config`, each spelled as its flag's value.
fn modes(config: &AgentConfig) -> ops::Modes {
    fn flag<T: clap::ValueEnum>(value: T) -> String {
        value
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }
    ops::Modes {
        xdp: flag(config.xdp_mode),
        lb_mode: flag(config.forwarding.mode),
        dsr_dispatch: flag(config.forwarding.dispatch),
        lb_algorithm: flag(config.lb_algorithm),
        masquerade: flag(config.masquerade),
    }
}
