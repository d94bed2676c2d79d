//! The per-packet programs on the node's devices, kept equal to what
//! [`node_net::attachments`] asks for as devices come and go. Every attachment is
//! recorded in the pinned `LB_ATTACHMENTS` map (device, role, reason, mode): `lb
//! status` shows it, and `lb cleanup` detaches exactly those, never a filter or
//! TCX program of another owner on the same device.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use aya::maps::{HashMap, Map, MapData};
use aya::programs::links::Link as _;
use aya::programs::tc::{SchedClassifierLink, TcAttachType};
use aya::Ebpf;
use lb_common::{
    map_names, program_names, ATTACH_MODE_NETLINK, ATTACH_MODE_TCX, ATTACH_REASON_AUTO,
    ATTACH_REASON_FLAG, ATTACH_ROLE_NODE, ATTACH_ROLE_POD, IFNAMSIZ,
};
use serde::Serialize;
use tracing::{info, warn};

use crate::datapath::loader::{self, LoadError, TcAttach, TcLink};
use crate::datapath::pins::PinLayout;
use crate::node::{Attachment, Reason, Role};

#[derive(Debug, thiserror::Error)]
pub enum TcLinksError {
    #[error("cannot open the attachment record {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot read the attachment record: {0}")]
    Read(#[source] aya::maps::MapError),
}

/// The program of a role.
pub fn program_of(role: Role) -> &'static str {
    match role {
        Role::NodeFacing => program_names::TC_EXTERNAL,
        Role::PodFacing => program_names::TC_INTERNAL,
    }
}

/// The record of the devices the agent attached to.
pub struct AttachmentRecord {
    map: HashMap<MapData, u32, lb_common::Attachment>,
}

impl AttachmentRecord {
    pub fn open(layout: &PinLayout) -> Result<Self, TcLinksError> {
        let path = layout.map_path(map_names::ATTACHMENTS);
        let wrap = |source| TcLinksError::Open {
            path: path.clone(),
            source,
        };
        let data = MapData::from_pin(&path).map_err(wrap)?;
        let map = HashMap::try_from(Map::HashMap(data)).map_err(wrap)?;
        Ok(Self { map })
    }

    /// Every recorded device, by ifindex.
    pub fn entries(&self) -> Result<BTreeMap<u32, RecordedLink>, TcLinksError> {
        self.map
            .iter()
            .map(|entry| {
                let (index, value) = entry.map_err(TcLinksError::Read)?;
                Ok((index, RecordedLink::decode(index, &value)))
            })
            .collect()
    }

    fn insert(&mut self, index: u32, value: &lb_common::Attachment) {
        if let Err(e) = self.map.insert(index, value, 0) {
            warn!(ifindex = index, "cannot record the attachment: {e}");
        }
    }

    fn remove(&mut self, index: u32) {
        // Missing is fine: it was never recorded.
        let _ = self.map.remove(&index);
    }
}

/// One device of the record, as `lb status` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedLink {
    pub ifindex: u32,
    pub name: String,
    /// `node-facing` or `pod-facing`.
    pub role: &'static str,
    pub program: &'static str,
    /// `auto` (from the device's addresses) or `flag` (`--iface`/`--pod-iface`).
    pub reason: &'static str,
    /// `tcx` or `netlink`.
    pub mode: &'static str,
    /// Inode of the network namespace the device is in.
    pub netns: u64,
}

impl RecordedLink {
    fn decode(ifindex: u32, value: &lb_common::Attachment) -> Self {
        let end = value.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
        let role = if value.role == ATTACH_ROLE_NODE {
            Role::NodeFacing
        } else {
            Role::PodFacing
        };
        RecordedLink {
            ifindex,
            name: String::from_utf8_lossy(&value.name[..end]).into_owned(),
            role: match role {
                Role::NodeFacing => "node-facing",
                Role::PodFacing => "pod-facing",
            },
            program: program_of(role),
            reason: if value.reason == ATTACH_REASON_FLAG {
                "flag"
            } else {
                "auto"
            },
            mode: if value.mode == ATTACH_MODE_NETLINK {
                "netlink"
            } else {
                "tcx"
            },
            netns: value.netns,
        }
    }

    fn is_netlink(&self) -> bool {
        self.mode == "netlink"
    }
}

/// `lb status`'s table of attached devices.
pub fn render_text(links: &[RecordedLink]) -> String {
    let mut out = format!(
        "{:<8} {:<16} {:<12} {:<16} {:<7} {}\n",
        "IFINDEX", "DEVICE", "ROLE", "PROGRAM", "REASON", "MODE"
    );
    for l in links {
        out += &format!(
            "{:<8} {:<16} {:<12} {:<16} {:<7} {}\n",
            l.ifindex, l.name, l.role, l.program, l.reason, l.mode
        );
    }
    out
}

/// Inode of the calling thread's network namespace (0 if /proc cannot say).
pub fn current_netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net").map_or(0, |m| m.ino())
}

fn encode(attachment: &Attachment, netlink: bool, netns: u64) -> lb_common::Attachment {
    let mut name = [0u8; IFNAMSIZ];
    let bytes = attachment.name.as_bytes();
    let len = bytes.len().min(IFNAMSIZ - 1);
    name[..len].copy_from_slice(&bytes[..len]);
    lb_common::Attachment {
        name,
        role: match attachment.role {
            Role::NodeFacing => ATTACH_ROLE_NODE,
            Role::PodFacing => ATTACH_ROLE_POD,
        },
        reason: match attachment.reason {
            Reason::Auto => ATTACH_REASON_AUTO,
            Reason::Flag => ATTACH_REASON_FLAG,
        },
        mode: if netlink {
            ATTACH_MODE_NETLINK
        } else {
            ATTACH_MODE_TCX
        },
        _pad: [0; 5],
        netns,
    }
}

/// A device as attached now.
struct Attached {
    want: Attachment,
    /// The TCX link's pin, if TCX.
    pin: Option<PathBuf>,
}

/// Keeps the programs on the devices equal to a wanted set.
pub struct TcLinks {
    tcx: bool,
    mode: TcAttach,
    links_dir: PathBuf,
    record: AttachmentRecord,
    current: BTreeMap<u32, Attached>,
    netns: u64,
}

impl TcLinks {
    pub fn new(layout: &PinLayout, mode: TcAttach) -> Result<Self, TcLinksError> {
        Ok(Self {
            tcx: loader::uses_tcx(mode),
            mode,
            links_dir: layout.links_dir(),
            record: AttachmentRecord::open(layout)?,
            current: BTreeMap::new(),
            netns: current_netns(),
        })
    }

    /// The pins of the TCX links attached now (kept when stale pins are swept).
    pub fn pins(&self) -> BTreeSet<PathBuf> {
        self.current
            .values()
            .filter_map(|a| a.pin.clone())
            .collect()
    }

    /// Attaches what `wanted` adds or changes and lets go of what it drops. A
    /// device that fails (it vanished meanwhile, or refuses) is logged and left
    /// out, so the next change tries it again; the others are unaffected.
    pub fn sync(&mut self, ebpf: &mut Ebpf, wanted: &BTreeMap<u32, Attachment>) {
        let gone: Vec<u32> = self
            .current
            .keys()
            .filter(|index| !wanted.contains_key(index))
            .copied()
            .collect();
        for index in gone {
            let Some(old) = self.current.remove(&index) else {
                continue;
            };
            // The device is gone with its filter or TCX link; only our pin and
            // record remain.
            if let Some(pin) = &old.pin {
                let _ = std::fs::remove_file(pin);
            }
            self.record.remove(index);
            info!(device = %old.want.name, ifindex = index, "device gone; detached");
        }
        for (&index, want) in wanted {
            if self.current.get(&index).is_some_and(|a| a.want == *want) {
                continue;
            }
            match self.attach(ebpf, want) {
                Ok(pin) => {
                    let old = self.current.insert(
                        index,
                        Attached {
                            want: want.clone(),
                            pin: pin.clone(),
                        },
                    );
                    // A new role or name pins elsewhere: the old link goes only now
                    // that the new program is in place.
                    if let Some(old_pin) = old.and_then(|o| o.pin) {
                        if Some(&old_pin) != pin.as_ref() {
                            let _ = std::fs::remove_file(old_pin);
                        }
                    }
                    self.record
                        .insert(index, &encode(want, !self.tcx, self.netns));
                    info!(
                        device = %want.name,
                        ifindex = index,
                        program = program_of(want.role),
                        reason = ?want.reason,
                        "per-packet program attached"
                    );
                }
                Err(e) => {
                    warn!(device = %want.name, "not attached (retried on the next device change): {e}")
                }
            }
        }
    }

    fn attach(&self, ebpf: &mut Ebpf, want: &Attachment) -> Result<Option<PathBuf>, LoadError> {
        let program = program_of(want.role);
        match loader::attach_tc_device(ebpf, program, &want.name, self.mode)? {
            TcLink::Tcx(link) => {
                let name = loader::tc_pin_name(program, &want.name);
                loader::pin_link(link, program, &self.links_dir, &name).map(Some)
            }
            TcLink::Netlink => Ok(None),
        }
    }

    /// Forgets record entries of an earlier agent that this one did not attach
    /// (devices since deleted, or no longer wanted); a netlink filter of ours left
    /// on a device that still exists is removed. Run after the first [`sync`].
    pub fn retire_stale_records(&mut self) {
        let Ok(entries) = self.record.entries() else {
            return;
        };
        for (index, recorded) in entries {
            if self.current.contains_key(&index) {
                continue;
            }
            if recorded.is_netlink() && recorded.netns == self.netns {
                detach_netlink_slot(&recorded.name);
            }
            self.record.remove(index);
        }
    }
}

/// Removes lb's filter slot on `device` if the device still exists; a missing
/// device or filter is fine.
fn detach_netlink_slot(device: &str) -> bool {
    match SchedClassifierLink::attached(
        device,
        TcAttachType::Ingress,
        loader::NETLINK_PRIORITY,
        loader::NETLINK_HANDLE,
        None,
    ) {
        Ok(link) => link.detach().is_ok(),
        Err(_) => false,
    }
}

/// What `lb cleanup` did about the recorded netlink filters (TCX links go with
/// their pins, wherever cleanup runs).
#[derive(Debug, Default)]
pub struct NetlinkCleanup {
    /// `device/program` of each filter removed.
    pub removed: Vec<String>,
    /// Filters in another network namespace, left in place (`device`, netns inode).
    pub elsewhere: Vec<(String, u64)>,
}

/// Removes the netlink filters the record names, in this network namespace only;
/// filters recorded in another one are reported, not touched: a device name here
/// may be another device altogether.
pub fn cleanup(layout: &PinLayout) -> NetlinkCleanup {
    let mut report = NetlinkCleanup::default();
    let Ok(mut record) = AttachmentRecord::open(layout) else {
        return report;
    };
    let Ok(entries) = record.entries() else {
        return report;
    };
    let here = current_netns();
    for (index, recorded) in entries {
        if recorded.is_netlink() {
            if recorded.netns != here {
                report
                    .elsewhere
                    .push((recorded.name.clone(), recorded.netns));
                continue;
            }
            if detach_netlink_slot(&recorded.name) {
                report
                    .removed
                    .push(format!("{}/{}", recorded.name, recorded.program));
            }
        }
        record.remove(index);
    }
    report
}

/// The devices recorded under `layout`, for `lb status`.
pub fn recorded(layout: &PinLayout) -> Result<Vec<RecordedLink>, TcLinksError> {
    Ok(AttachmentRecord::open(layout)?
        .entries()?
        .into_values()
        .collect())
}
