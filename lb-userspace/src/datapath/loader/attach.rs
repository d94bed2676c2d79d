//! Attaching loaded programs: the socket hooks to a cgroup, the per-packet
//! programs to devices (TCX links, or lb's netlink filter slot on clsact).

use std::collections::BTreeSet;
use std::fs;
use std::fs::File;
use std::path::{Path, PathBuf};

use aya::programs::{
    links::{FdLink, LinkOrder, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType, TcError, TcHandle},
    xdp::XdpLink,
    CgroupAttachMode, ProgramError, SchedClassifier, XdpMode,
};
use aya::Ebpf;
use lb_common::program_names;

use super::load::{cgroup_program, sock_ops_program, tc_program, xdp_program};
use super::{program_error, LoadError};
use crate::datapath::error_chain;
use crate::datapath::pins::PinLayout;

/// Attaches the socket hooks of a loaded object to `cgroup` and pins the links;
/// returns the pins. Links of a previous agent are replaced only after the new ones
/// are attached: both translate identically, and a socket already rewritten to a
/// backend is not a frontend to the second program, so the overlap is harmless
/// while a gap would not be. The per-packet programs go on devices through
/// [`crate::datapath::device_links`].
///
/// With `sock_ops` (`--backend-quarantine on`) `lb_sock_ops` goes on the same
/// cgroup, to see which of the connects the hooks translated fail; without it a
/// previous agent's is left for [`remove_stale_links`] to detach.
pub fn attach_cgroup_hooks(
    ebpf: &mut Ebpf,
    layout: &PinLayout,
    cgroup: &Path,
    sock_ops: bool,
) -> Result<BTreeSet<PathBuf>, LoadError> {
    let cgroup_file = File::open(cgroup).map_err(|source| LoadError::Cgroup {
        path: cgroup.to_path_buf(),
        source,
    })?;
    let links_dir = layout.links_dir();
    let mut pinned = BTreeSet::new();
    for program in program_names::ALL {
        let link = attach_cgroup(ebpf, program, &cgroup_file)?;
        pinned.insert(pin_link(link, program, &links_dir, program)?);
    }
    if sock_ops {
        let program = program_names::SOCK_OPS;
        let link = attach_sock_ops(ebpf, &cgroup_file)?;
        pinned.insert(pin_link(link, program, &links_dir, program)?);
    }
    Ok(pinned)
}

fn attach_sock_ops(ebpf: &mut Ebpf, cgroup: &File) -> Result<FdLink, LoadError> {
    let program = program_names::SOCK_OPS;
    let prog = sock_ops_program(ebpf)?;
    // As for the socket hooks: a bpf_link, "Single" (flags 0).
    let link_id = prog
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(|e| program_error(program, e))?;
    let link = prog
        .take_link(link_id)
        .map_err(|e| program_error(program, e))?;
    link.try_into()
        .map_err(|e: aya::programs::links::LinkError| LoadError::PinLink {
            program,
            path: PathBuf::from(program),
            message: e.to_string(),
        })
}

/// The pin name of a TCX link of `program` on `device`.
pub(crate) fn tc_pin_name(program: &str, device: &str) -> String {
    // bpffs names cannot contain '.', which VLAN devices have.
    format!("{program}_{}", device.replace('.', "_"))
}

/// Attaches `program` (loading it if needed) to `device`'s ingress, or with
/// `TcAttachType::Egress` its egress (masquerading).
pub(crate) fn attach_tc_device(
    ebpf: &mut Ebpf,
    program: &'static str,
    device: &str,
    mode: TcAttach,
    direction: TcAttachType,
) -> Result<TcLink, LoadError> {
    let prog = tc_program(ebpf, program)?;
    attach_tc(prog, program, device, mode, direction)
}

fn attach_cgroup(
    ebpf: &mut Ebpf,
    program: &'static str,
    cgroup: &File,
) -> Result<FdLink, LoadError> {
    let prog = cgroup_program(ebpf, program)?;
    // With bpf_link the kernel always allows several programs per cgroup and rejects
    // the legacy BPF_F_ALLOW_MULTI flag, so "Single" (flags 0) is the right mode.
    let link_id = prog
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(|e| program_error(program, e))?;
    let link = prog
        .take_link(link_id)
        .map_err(|e| program_error(program, e))?;
    link.try_into()
        .map_err(|e: aya::programs::links::LinkError| LoadError::PinLink {
            program,
            path: PathBuf::from(program),
            message: e.to_string(),
        })
}

/// How the per-packet programs attach to devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// TCX where the kernel has it (>= 6.6), netlink clsact otherwise.
    #[default]
    Auto,
    /// bpf_link based TCX, pinned like the cgroup hooks.
    Tcx,
    /// A direct-action cls_bpf filter on the clsact qdisc, for older kernels.
    Netlink,
    /// No per-packet path: socket hooks only (another component handles NodePort,
    /// LoadBalancer and externalIPs).
    Off,
}

/// Whether and how `lb_xdp` goes in front of `lb_tc_external` on node-facing devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpAttach {
    /// No XDP: the per-packet path is TC alone.
    #[default]
    Off,
    /// Native XDP, in the driver, on every node-facing device whose driver takes
    /// it; a device that refuses keeps the TC path alone (never generic).
    Native,
    /// Generic XDP, in the stack: for testing only (no faster than TC).
    Generic,
}

impl XdpAttach {
    fn mode(self) -> XdpMode {
        match self {
            XdpAttach::Native => XdpMode::Driver,
            _ => XdpMode::Skb,
        }
    }
}

/// The pin name of the XDP link on `device`.
pub(crate) fn xdp_pin_name(device: &str) -> String {
    tc_pin_name(program_names::XDP, device)
}

/// Why a device did not take `lb_xdp`.
#[derive(Debug)]
pub(crate) struct XdpRefused {
    /// The kernel's errno, 0 when the refusal was not the kernel's.
    pub errno: i32,
    pub message: String,
}

/// Attaches `lb_xdp` to the device `ifindex` (`device`) in `mode` and pins the link
/// at `pin`. A link pinned there by an earlier agent is replaced in place
/// (`BPF_LINK_UPDATE`), so a restart never leaves the device without XDP; a
/// device refusing it (its driver has no native XDP, another program is there)
/// is the caller's to report.
pub(crate) fn attach_xdp_device(
    ebpf: &mut Ebpf,
    ifindex: u32,
    mode: XdpAttach,
    links_dir: &Path,
    device: &str,
) -> Result<PathBuf, XdpRefused> {
    let refused = |e: &dyn std::error::Error, errno: Option<i32>| XdpRefused {
        errno: errno.unwrap_or(0),
        message: error_chain(e),
    };
    let prog = xdp_program(ebpf).map_err(|e| refused(&e, None))?;
    let name = xdp_pin_name(device);
    let pinned = links_dir.join(&name);
    let earlier = PinnedLink::from_pin(&pinned)
        .ok()
        .map(FdLink::from)
        .and_then(|link| XdpLink::try_from(link).ok());
    let id = match earlier {
        Some(link) => prog.attach_to_link(link),
        None => prog.attach_to_if_index(ifindex, mode.mode()),
    }
    .map_err(|e| refused(&e, os_error(&e)))?;
    let link = prog.take_link(id).map_err(|e| refused(&e, None))?;
    let link: FdLink = link
        .try_into()
        .map_err(|e: aya::programs::links::LinkError| XdpRefused {
            errno: 0,
            message: format!("attached through netlink, not a bpf_link that can be pinned: {e}"),
        })?;
    pin_link(link, program_names::XDP, links_dir, &name).map_err(|e| refused(&e, None))
}

/// The errno behind a program error, if the kernel gave one.
fn os_error(error: &ProgramError) -> Option<i32> {
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        source = e.source();
    }
    None
}

/// Whether `mode` attaches through TCX on this kernel.
pub(crate) fn uses_tcx(mode: TcAttach) -> bool {
    match mode {
        TcAttach::Auto => aya::util::KernelVersion::current()
            .is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0)),
        TcAttach::Tcx => true,
        TcAttach::Netlink | TcAttach::Off => false,
    }
}

/// The netlink filter slot lb owns on each device: a fixed priority and handle, so a
/// restarted agent finds its filter and swaps the program in place (no gap), and
/// `lb cleanup` can find it without state.
pub(crate) const NETLINK_PRIORITY: u16 = 0x4c42; // "LB"
pub(crate) const NETLINK_HANDLE: TcHandle = TcHandle::new(0, 1);

/// An attached per-packet program: a link to pin, or a netlink filter that lives on
/// with the device.
pub(crate) enum TcLink {
    Tcx(FdLink),
    Netlink,
}

fn attach_tc(
    prog: &mut SchedClassifier,
    program: &'static str,
    iface: &str,
    mode: TcAttach,
    direction: TcAttachType,
) -> Result<TcLink, LoadError> {
    let tc_error = |message: String| LoadError::TcAttach {
        program,
        iface: iface.to_owned(),
        message,
    };
    if uses_tcx(mode) {
        let options = TcAttachOptions::TcxOrder(LinkOrder::default());
        let link_id = prog
            .attach_with_options(iface, direction, options)
            .map_err(|e| tc_error(error_chain(&e)))?;
        let link = prog
            .take_link(link_id)
            .map_err(|e| tc_error(error_chain(&e)))?;
        return link
            .try_into()
            .map(TcLink::Tcx)
            .map_err(|_| LoadError::NoTcx {
                program,
                iface: iface.to_owned(),
            });
    }

    // clsact may be there already (another tool, an earlier agent): that is fine.
    if let Err(e) = tc::qdisc_add_clsact(iface) {
        if tc_errno(&e) != Some(libc::EEXIST) {
            return Err(tc_error(format!(
                "adding the clsact qdisc: {}",
                error_chain(&e)
            )));
        }
    }
    let options = TcAttachOptions::Netlink(NlOptions {
        priority: NETLINK_PRIORITY,
        handle: NETLINK_HANDLE,
        ..NlOptions::default()
    });
    let link_id = match prog.attach_with_options(iface, direction, options) {
        Ok(id) => id,
        // Our slot is taken by a previous agent's filter: replace its program in
        // place, so no packet meets an empty slot.
        Err(e) if program_errno(&e) == Some(libc::EEXIST) => {
            let existing = SchedClassifierLink::attached(
                iface,
                direction,
                NETLINK_PRIORITY,
                NETLINK_HANDLE,
                None,
            )
            .map_err(|e| tc_error(e.to_string()))?;
            prog.attach_to_link(existing)
                .map_err(|e| tc_error(error_chain(&e)))?
        }
        Err(e) => return Err(tc_error(error_chain(&e))),
    };
    let link = prog
        .take_link(link_id)
        .map_err(|e| tc_error(error_chain(&e)))?;
    // Dropping the link would remove the filter; the filter must outlive the agent
    // like a pinned link does.
    std::mem::forget(link);
    Ok(TcLink::Netlink)
}

/// The errno a TC operation failed with, where aya keeps one (netlink answers
/// carry it as an `io::Error` inside [`aya::sys::NetlinkError`]).
fn tc_errno(error: &TcError) -> Option<i32> {
    match error {
        TcError::NetlinkError(e) => e.raw_os_error(),
        TcError::IoError(e) => e.raw_os_error(),
        _ => None,
    }
}

/// [`tc_errno`] for the errors of attaching a program.
fn program_errno(error: &ProgramError) -> Option<i32> {
    match error {
        ProgramError::TcError(e) => tc_errno(e),
        ProgramError::NetlinkError(e) => e.raw_os_error(),
        ProgramError::IOError(e) => e.raw_os_error(),
        ProgramError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    }
}

/// Pins `link` as `links_dir/name` and returns the path. The pin goes to a
/// temporary name first and is renamed over the old one: the old link loses its
/// last reference (and detaches) only once the new one is live.
pub(crate) fn pin_link(
    link: FdLink,
    program: &'static str,
    links_dir: &Path,
    name: &str,
) -> Result<PathBuf, LoadError> {
    let final_path = links_dir.join(name);
    // bpffs refuses names containing '.', hence the underscore.
    let staging = links_dir.join(format!("{name}_new"));
    let _ = fs::remove_file(&staging);
    let pin_error = |message: String| LoadError::PinLink {
        program,
        path: final_path.clone(),
        message,
    };
    link.pin(&staging).map_err(|e| pin_error(error_chain(&e)))?;
    fs::rename(&staging, &final_path).map_err(|e| pin_error(e.to_string()))?;
    Ok(final_path)
}

/// Unpins (and so detaches) links of a previous agent that this one did not
/// replace, e.g. a device since deleted.
pub fn remove_stale_links(layout: &PinLayout, keep: &BTreeSet<PathBuf>) -> Result<(), LoadError> {
    let links_dir = &layout.links_dir();
    let stale_error = |source| LoadError::StaleLinks {
        path: links_dir.to_path_buf(),
        source,
    };
    for entry in fs::read_dir(links_dir).map_err(stale_error)? {
        let path = entry.map_err(stale_error)?.path();
        if !keep.contains(&path) {
            fs::remove_file(&path).map_err(stale_error)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn an_existing_qdisc_or_filter_is_told_by_its_errno_not_its_words() {
        let errno = |n| io::Error::from_raw_os_error(n);
        assert_eq!(
            tc_errno(&TcError::IoError(errno(libc::EEXIST))),
            Some(libc::EEXIST)
        );
        assert_eq!(
            program_errno(&ProgramError::TcError(TcError::IoError(errno(
                libc::EEXIST
            )))),
            Some(libc::EEXIST)
        );
        assert_eq!(
            program_errno(&ProgramError::IOError(errno(libc::ENODEV))),
            Some(libc::ENODEV)
        );
        // Words that merely read like the errno (a device named so, a message of
        // another layer) are not the errno: attaching then fails as it should.
        let words = ProgramError::TcError(TcError::IoError(io::Error::other("File exists")));
        assert_eq!(program_errno(&words), None);
        assert_eq!(tc_errno(&TcError::AlreadyAttached), None);
    }
}
