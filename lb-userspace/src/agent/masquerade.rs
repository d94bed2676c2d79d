//! Masquerading's part of the agent: the address sets in `LB_MASQ_CIDRS` kept
//! equal to what the Nodes, `--cluster-cidr` and the ip-masq-agent file say. The
//! cluster set (kube-proxy's cluster-IP rule) is kept always; egress
//! masquerading's sets with `--masquerade bpf`, its file followed for changes (a
//! bad one is reported, naming the file and the field, and the last good one
//! kept). The translations in `LB_MASQ` expire with their flows on the
//! collector's thread (`ct_gc`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use tracing::{info, warn};

use crate::control::masquerade::{self as rules, MasqueradeMode};
use crate::datapath::maps::MapsError;
use crate::datapath::masquerade::{MasqCidrs, MasqMaps};
use crate::datapath::pins::PinLayout;
use crate::source::masq_config::{self, MasqConfig};

/// What identifies one content of the file without reading it: a ConfigMap
/// update swaps a symlink (new inode), an editor rewrites (new mtime or size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: meta.modified().ok(),
        len: meta.len(),
        inode: meta.ino(),
    })
}

pub(super) struct Masquerade {
    mode: MasqueradeMode,
    maps: MasqMaps,
    file: Option<PathBuf>,
    /// The last good content of the file (the defaults until one is read).
    config: MasqConfig,
    /// The file as last looked at (`None`: missing or unreadable).
    seen: Option<Stamp>,
    /// The last problem reported, so it is said once per change of the file.
    problem: Option<String>,
    cluster_cidrs: Vec<IpNet>,
    node_name: String,
    /// What `LB_MASQ_CIDRS` holds, as this agent wrote it.
    written: Option<MasqCidrs>,
}

impl Masquerade {
    /// With `--masquerade off` the file is not read: only the cluster set is kept.
    pub(super) fn start(
        mode: MasqueradeMode,
        layout: &PinLayout,
        file: Option<PathBuf>,
        cluster_cidrs: Vec<IpNet>,
        node_name: String,
    ) -> Result<Self, MapsError> {
        let mut masquerade = Masquerade {
            mode,
            maps: MasqMaps::open(layout)?,
            file: file.filter(|_| mode == MasqueradeMode::Bpf),
            config: MasqConfig::default(),
            seen: None,
            problem: None,
            cluster_cidrs,
            node_name,
            written: None,
        };
        masquerade.reload();
        Ok(masquerade)
    }

    /// Whether there is an ip-masq-agent file to follow.
    pub(super) fn follows_file(&self) -> bool {
        self.file.is_some()
    }

    /// Reads the file again when it changed; true when the configuration did.
    pub(super) fn reload(&mut self) -> bool {
        let Some(path) = &self.file else {
            return false;
        };
        let now = stamp(path);
        if now.is_some() && now == self.seen {
            return false;
        }
        self.seen = now;
        match masq_config::read(path) {
            Ok(config) => {
                self.problem = None;
                if config == self.config {
                    return false;
                }
                info!(file = %path.display(), ?config, "ip-masq-agent config read");
                self.config = config;
                true
            }
            Err(e) => {
                let text = e.to_string();
                if self.problem.as_ref() != Some(&text) {
                    warn!("{text}; keeping the last good configuration");
                    self.problem = Some(text);
                }
                false
            }
        }
    }

    /// Writes the address sets if what they derive from changed.
    pub(super) fn sync(&mut self, nodes: &[Arc<Node>]) {
        let wanted = rules::derive(
            self.mode,
            &self.config,
            nodes,
            &self.node_name,
            &self.cluster_cidrs,
        );
        if self.written.as_ref() == Some(&wanted) {
            return;
        }
        if self.mode == MasqueradeMode::Bpf && wanted.pod_sources.is_empty() {
            warn!(
                "masquerading: this node's pod CIDRs are not known (no Node object with \
                 spec.podCIDRs named --node-name, and no --cluster-cidr): nothing is \
                 masqueraded until they are"
            );
        }
        match self.maps.sync_cidrs(&wanted) {
            Ok(changed) => {
                info!(
                    changed,
                    sources = ?wanted.pod_sources,
                    exempt = wanted.exempt.len(),
                    cluster = ?wanted.cluster,
                    "masquerading address sets written"
                );
                self.written = Some(wanted);
            }
            Err(e) => {
                warn!(
                    "masquerading address sets not written (tried again with the next change): {e}"
                );
                self.written = None;
            }
        }
    }
}
