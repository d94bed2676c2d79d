//! The per-packet programs on the node's devices, kept equal to what
//! [`crate::node::attachments`] asks for as devices come and go: `lb_tc_external`
//! or `lb_tc_internal` at TC ingress, and with `--xdp`, `lb_xdp` in front of the
//! external one on node-facing devices (never on pod veths). Every attachment is
//! recorded in the pinned `LB_ATTACHMENTS` map (device, role, reason, mode, XDP):
//! `lb status` shows it, and `lb cleanup` detaches exactly those, never a filter or
//! program of another owner on the same device.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use aya::maps::{DevMapHash, HashMap, Map, MapData};
use aya::programs::links::Link as _;
use aya::programs::tc::{SchedClassifierLink, TcAttachType};
use aya::Ebpf;
use lb_common::{
    map_names, program_names, ATTACH_MODE_NETLINK, ATTACH_MODE_TCX, ATTACH_REASON_AUTO,
    ATTACH_REASON_FLAG, ATTACH_ROLE_NODE, ATTACH_ROLE_POD, ATTACH_XDP_GENERIC, ATTACH_XDP_NATIVE,
    ATTACH_XDP_NONE, ATTACH_XDP_REFUSED, IFNAMSIZ,
};
use serde::Serialize;
use tracing::{info, warn};

use crate::datapath::loader::{self, LoadError, TcAttach, TcLink, XdpAttach};
use crate::datapath::pins::PinLayout;
use crate::node::{Attachment, NodeNet, Reason, Role};

#[derive(Debug, thiserror::Error)]
pub enum DeviceLinksError {
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
    pub fn open(layout: &PinLayout) -> Result<Self, DeviceLinksError> {
        let path = layout.map_path(map_names::ATTACHMENTS);
        let wrap = |source| DeviceLinksError::Open {
            path: path.clone(),
            source,
        };
        let data = MapData::from_pin(&path).map_err(wrap)?;
        let map = HashMap::try_from(Map::HashMap(data)).map_err(wrap)?;
        Ok(Self { map })
    }

    /// Every recorded device, by ifindex.
    pub fn entries(&self) -> Result<BTreeMap<u32, RecordedLink>, DeviceLinksError> {
        self.map
            .iter()
            .map(|entry| {
                let (index, value) = entry.map_err(DeviceLinksError::Read)?;
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
    /// `lb_xdp` in front: `native`, `generic`, `refused (<errno>)`, or `-`.
    pub xdp: String,
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
            xdp: match value.xdp {
                ATTACH_XDP_NATIVE => "native".into(),
                ATTACH_XDP_GENERIC => "generic".into(),
                ATTACH_XDP_REFUSED => format!(
                    "refused ({})",
                    std::io::Error::from_raw_os_error(value.xdp_errno.into())
                ),
                _ => "-".into(),
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
        "{:<8} {:<16} {:<12} {:<16} {:<7} {:<8} {}\n",
        "IFINDEX", "DEVICE", "ROLE", "PROGRAM", "REASON", "MODE", "XDP"
    );
    for l in links {
        out += &format!(
            "{:<8} {:<16} {:<12} {:<16} {:<7} {:<8} {}\n",
            l.ifindex, l.name, l.role, l.program, l.reason, l.mode, l.xdp
        );
    }
    out
}

/// Inode of the calling thread's network namespace (0 if /proc cannot say).
pub fn current_netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net").map_or(0, |m| m.ino())
}

fn encode(
    attachment: &Attachment,
    netlink: bool,
    xdp: &XdpState,
    netns: u64,
) -> lb_common::Attachment {
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
        xdp: match xdp {
            XdpState::None => ATTACH_XDP_NONE,
            XdpState::Attached { mode, .. } if *mode == XdpAttach::Native => ATTACH_XDP_NATIVE,
            XdpState::Attached { .. } => ATTACH_XDP_GENERIC,
            XdpState::Refused { .. } => ATTACH_XDP_REFUSED,
        },
        xdp_errno: match xdp {
            XdpState::Refused { errno, .. } => (*errno).clamp(0, 255) as u8,
            _ => 0,
        },
        _pad: [0; 3],
        netns,
    }
}

/// `lb_xdp` on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
enum XdpState {
    /// Not wanted (off, or not node-facing).
    None,
    Attached {
        mode: XdpAttach,
        pin: PathBuf,
    },
    /// The device refused; it keeps the TC path alone until its next change.
    Refused {
        errno: i32,
        reason: String,
    },
}

/// A device as attached now.
struct Attached {
    want: Attachment,
    /// The TCX link's pin, if TCX.
    pin: Option<PathBuf>,
    xdp: XdpState,
    /// The egress side: `lb_tc_egress` (masquerading) on node-facing devices,
    /// `lb_tc_to_pod` (NetworkPolicy) on pod-facing ones.
    egress: Egress,
}

/// The egress side's program on one device ([`egress_program`]).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Egress {
    None,
    /// A TCX link, pinned here.
    Tcx(PathBuf),
    /// lb's netlink filter slot on the egress side.
    Netlink,
}

/// The egress side's program for a device of `role`: `lb_tc_egress` on a
/// node-facing one when masquerading, `lb_tc_to_pod` on a pod-facing one when
/// enforcing NetworkPolicy.
fn egress_program(role: Role, masquerade: bool, policy: bool) -> Option<&'static str> {
    match role {
        Role::NodeFacing if masquerade => Some(program_names::TC_EGRESS),
        Role::PodFacing if policy => Some(program_names::TC_TO_POD),
        _ => None,
    }
}

/// One device's `lb_xdp` as `lb status` and the agent's log report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct XdpReport {
    pub device: String,
    /// `native`, `generic`, or `refused`.
    pub state: String,
    /// Why it was refused (the driver or device kind and the kernel's answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Keeps the programs on the devices equal to a wanted set.
pub struct DeviceLinks {
    tcx: bool,
    mode: TcAttach,
    xdp: XdpAttach,
    links_dir: PathBuf,
    record: AttachmentRecord,
    /// The devices `lb_xdp` may redirect to: those it runs on.
    devmap: Option<DevMapHash<MapData>>,
    current: BTreeMap<u32, Attached>,
    netns: u64,
    /// `--masquerade bpf`: `lb_tc_egress` on node-facing devices too.
    masquerade: bool,
    /// `--network-policy on`: `lb_tc_to_pod` on pod-facing devices too.
    policy: bool,
}

impl DeviceLinks {
    pub fn new(
        layout: &PinLayout,
        mode: TcAttach,
        xdp: XdpAttach,
        masquerade: bool,
        policy: bool,
    ) -> Result<Self, DeviceLinksError> {
        let xdp = if mode == TcAttach::Off {
            XdpAttach::Off
        } else {
            xdp
        };
        let devmap = match xdp {
            XdpAttach::Off => None,
            _ => {
                let path = layout.map_path(map_names::XDP_DEVMAP);
                let wrap = |source| DeviceLinksError::Open {
                    path: path.clone(),
                    source,
                };
                let data = MapData::from_pin(&path).map_err(wrap)?;
                Some(DevMapHash::try_from(Map::DevMapHash(data)).map_err(wrap)?)
            }
        };
        Ok(Self {
            tcx: loader::uses_tcx(mode),
            mode,
            xdp,
            links_dir: layout.links_dir(),
            record: AttachmentRecord::open(layout)?,
            devmap,
            current: BTreeMap::new(),
            netns: current_netns(),
            masquerade: masquerade && mode != TcAttach::Off,
            policy: policy && mode != TcAttach::Off,
        })
    }

    /// The pins of the links attached now (kept when stale pins are swept).
    pub fn pins(&self) -> BTreeSet<PathBuf> {
        self.current
            .values()
            .flat_map(|a| {
                let xdp = match &a.xdp {
                    XdpState::Attached { pin, .. } => Some(pin.clone()),
                    _ => None,
                };
                let egress = match &a.egress {
                    Egress::Tcx(pin) => Some(pin.clone()),
                    _ => None,
                };
                a.pin.clone().into_iter().chain(xdp).chain(egress)
            })
            .collect()
    }

    /// `lb_xdp` on each node-facing device, for the agent's status.
    pub fn xdp_reports(&self) -> Vec<XdpReport> {
        self.current
            .values()
            .filter_map(|a| {
                let (state, reason) = match &a.xdp {
                    XdpState::None => return None,
                    XdpState::Attached { mode, .. } if *mode == XdpAttach::Native => {
                        ("native", None)
                    }
                    XdpState::Attached { .. } => ("generic", None),
                    XdpState::Refused { reason, .. } => ("refused", Some(reason.clone())),
                };
                Some(XdpReport {
                    device: a.want.name.clone(),
                    state: state.to_owned(),
                    reason,
                })
            })
            .collect()
    }

    /// Attaches what `wanted` adds or changes and lets go of what it drops. A
    /// device that fails (it vanished meanwhile, or refuses) is logged and left
    /// out, so the next change tries it again; the others are unaffected. `net`
    /// says what kind of device refused XDP.
    /// Returns false when a device could not get its program; the caller tries
    /// again later (a link just unpinned is detached by the kernel asynchronously,
    /// so a device that changes role twice in a row can find the program it wants
    /// still attached from the first time: EEXIST until the kernel lets it go).
    pub fn sync(
        &mut self,
        ebpf: &mut Ebpf,
        wanted: &BTreeMap<u32, Attachment>,
        net: &NodeNet,
    ) -> bool {
        let mut all = true;
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
            // The device is gone with its filter or links; only our pins, the
            // record and the redirect entry remain.
            if let Some(pin) = &old.pin {
                let _ = std::fs::remove_file(pin);
            }
            if let Egress::Tcx(pin) = &old.egress {
                let _ = std::fs::remove_file(pin);
            }
            self.drop_xdp(index, &old.xdp);
            self.record.remove(index);
            info!(device = %old.want.name, ifindex = index, "device gone; detached");
        }
        for (&index, want) in wanted {
            if self.current.get(&index).is_some_and(|a| a.want == *want) {
                all &= self.sync_egress(ebpf, index);
                continue;
            }
            match self.attach(ebpf, want) {
                Ok(pin) => {
                    let old = self.current.remove(&index);
                    // A new role or name pins elsewhere: the old link goes only now
                    // that the new program is in place.
                    if let Some(old_pin) = old.as_ref().and_then(|o| o.pin.clone()) {
                        if Some(&old_pin) != pin.as_ref() {
                            let _ = std::fs::remove_file(old_pin);
                        }
                    }
                    if let Some(old) = &old {
                        self.drop_xdp(index, &old.xdp);
                        self.drop_egress(&old.want.name, &old.egress);
                    }
                    let xdp = self.attach_xdp(ebpf, index, want, net);
                    self.record
                        .insert(index, &encode(want, !self.tcx, &xdp, self.netns));
                    info!(
                        device = %want.name,
                        ifindex = index,
                        program = program_of(want.role),
                        reason = ?want.reason,
                        "per-packet program attached"
                    );
                    self.current.insert(
                        index,
                        Attached {
                            want: want.clone(),
                            pin,
                            xdp,
                            egress: Egress::None,
                        },
                    );
                    all &= self.sync_egress(ebpf, index);
                }
                Err(e) => {
                    all = false;
                    warn!(device = %want.name, "not attached (tried again in a second): {e}")
                }
            }
        }
        all
    }

    fn attach(&self, ebpf: &mut Ebpf, want: &Attachment) -> Result<Option<PathBuf>, LoadError> {
        let program = program_of(want.role);
        match loader::attach_tc_device(ebpf, program, &want.name, self.mode, TcAttachType::Ingress)?
        {
            TcLink::Tcx(link) => {
                let name = loader::tc_pin_name(program, &want.name);
                loader::pin_link(link, program, &self.links_dir, &name).map(Some)
            }
            TcLink::Netlink => Ok(None),
        }
    }

    /// Puts the egress side's program on the device `index` when its role wants
    /// one ([`egress_program`]) and takes it off otherwise; false when it could
    /// not be attached (tried again with the device's next sync).
    fn sync_egress(&mut self, ebpf: &mut Ebpf, index: u32) -> bool {
        let (masquerade, policy) = (self.masquerade, self.policy);
        let (mode, links_dir) = (self.mode, self.links_dir.clone());
        let Some(attached) = self.current.get_mut(&index) else {
            return true;
        };
        let program = egress_program(attached.want.role, masquerade, policy);
        let wanted = program.is_some();
        let name = attached.want.name.clone();
        match (&attached.egress, wanted) {
            (Egress::None, false) => true,
            (Egress::Tcx(_) | Egress::Netlink, true) => true,
            (Egress::Tcx(_) | Egress::Netlink, false) => {
                let old = std::mem::replace(&mut attached.egress, Egress::None);
                self.drop_egress(&name, &old);
                true
            }
            (Egress::None, true) => {
                let program = program.unwrap_or(program_names::TC_EGRESS);
                let attached_now =
                    loader::attach_tc_device(ebpf, program, &name, mode, TcAttachType::Egress)
                        .and_then(|link| match link {
                            TcLink::Tcx(link) => {
                                let pin_name = loader::tc_pin_name(program, &name);
                                loader::pin_link(link, program, &links_dir, &pin_name)
                                    .map(Egress::Tcx)
                            }
                            TcLink::Netlink => Ok(Egress::Netlink),
                        });
                match attached_now {
                    Ok(egress) => {
                        info!(device = %name, ifindex = index, program, "egress program attached");
                        if let Some(a) = self.current.get_mut(&index) {
                            a.egress = egress;
                        }
                        true
                    }
                    Err(e) => {
                        warn!(device = %name, program, "not attached on egress (tried again in a second): {e}");
                        false
                    }
                }
            }
        }
    }

    /// Lets go of the egress side's program on a device.
    fn drop_egress(&self, device: &str, egress: &Egress) {
        match egress {
            Egress::None => {}
            Egress::Tcx(pin) => {
                let _ = std::fs::remove_file(pin);
            }
            Egress::Netlink => {
                detach_netlink_side(device, TcAttachType::Egress);
            }
        }
    }

    /// `lb_xdp` in front of the external program of a node-facing device, in the
    /// mode asked for and no other: a device that refuses keeps the TC path alone,
    /// and the refusal is said with what the device is.
    fn attach_xdp(
        &mut self,
        ebpf: &mut Ebpf,
        index: u32,
        want: &Attachment,
        net: &NodeNet,
    ) -> XdpState {
        if self.xdp == XdpAttach::Off || want.role != Role::NodeFacing {
            return XdpState::None;
        }
        match loader::attach_xdp_device(ebpf, index, self.xdp, &self.links_dir, &want.name) {
            Ok(pin) => {
                if let Some(devmap) = &mut self.devmap {
                    if let Err(e) = devmap.insert(index, index, None, 0) {
                        warn!(device = %want.name, "lb_xdp attached, but redirects to it cannot be enabled: {e}");
                    }
                }
                info!(device = %want.name, ifindex = index, mode = ?self.xdp, "lb_xdp attached");
                XdpState::Attached {
                    mode: self.xdp,
                    pin,
                }
            }
            Err(refused) => {
                let what = net
                    .links
                    .get(&index)
                    .and_then(|l| l.kind.clone())
                    .map_or_else(|| driver_of(&want.name), |kind| format!("a {kind} device"));
                let reason = format!(
                    "{what} refused {} XDP: {}; it keeps the TC path alone",
                    match self.xdp {
                        XdpAttach::Native => "native",
                        _ => "generic",
                    },
                    refused.message
                );
                warn!(device = %want.name, "{reason}");
                XdpState::Refused {
                    errno: refused.errno,
                    reason,
                }
            }
        }
    }

    /// Lets go of `lb_xdp` on a device: its pin (which detaches it) and its
    /// redirect entry.
    fn drop_xdp(&mut self, index: u32, xdp: &XdpState) {
        if let XdpState::Attached { pin, .. } = xdp {
            let _ = std::fs::remove_file(pin);
            if let Some(devmap) = &mut self.devmap {
                // Missing is fine: the kernel drops entries of devices that left.
                let _ = devmap.remove(index);
            }
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

/// The driver of a physical device, from sysfs (`the virtio_net driver`), or what
/// little is known.
fn driver_of(device: &str) -> String {
    std::fs::read_link(format!("/sys/class/net/{device}/device/driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .map_or_else(|| "the device".to_owned(), |d| format!("the {d} driver"))
}

/// Removes lb's filter slots on `device` (ingress, and egress where masquerading
/// or NetworkPolicy put one) if the device still exists; a missing device or filter is fine.
/// True when the ingress one was there.
fn detach_netlink_slot(device: &str) -> bool {
    detach_netlink_side(device, TcAttachType::Egress);
    detach_netlink_side(device, TcAttachType::Ingress)
}

fn detach_netlink_side(device: &str, side: TcAttachType) -> bool {
    match SchedClassifierLink::attached(
        device,
        side,
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
pub fn recorded(layout: &PinLayout) -> Result<Vec<RecordedLink>, DeviceLinksError> {
    Ok(AttachmentRecord::open(layout)?
        .entries()?
        .into_values()
        .collect())
}
