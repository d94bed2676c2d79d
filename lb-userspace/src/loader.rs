//! Loading the kernel object, attaching the socket hooks and pinning everything so
//! the datapath outlives the agent process.
//!
//! Pin layout under `<pin-dir>` (default `/sys/fs/bpf/lb`):
//! - `v<N>/<MAP>`: the maps, `N` = [`lb_common::PIN_LAYOUT_VERSION`], so an agent never
//!   opens a map whose key/value layout it does not know;
//! - `links/<program>`: one bpf_link per hook; replacing the pin detaches the old link.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use aya::programs::{
    links::{FdLink, LinkOrder},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType, TcHandle},
    CgroupAttachMode, CgroupSockAddr, ProgramError, SchedClassifier,
};
use aya::{Ebpf, EbpfLoader};
use lb_common::{map_names, program_names, PIN_LAYOUT_VERSION};

/// Where everything of one agent is pinned.
#[derive(Clone, Debug)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.root.join(format!("v{PIN_LAYOUT_VERSION}"))
    }

    pub fn map_path(&self, map: &str) -> PathBuf {
        self.maps_dir().join(map)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }
}

/// `max_entries` of the maps the agent sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub sock_revnat: u32,
    pub affinity: u32,
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: lb_common::DEFAULT_SERVICES_MAX,
            backends: lb_common::DEFAULT_BACKENDS_MAX,
            sock_revnat: lb_common::DEFAULT_SOCK_REVNAT_MAX,
            affinity: lb_common::DEFAULT_AFFINITY_MAX,
            conntrack: lb_common::DEFAULT_CT_MAX,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "this lb binary was built without the kernel object: run `cargo xtask build-ebpf` \
         and rebuild, or pass --bpf-object PATH"
    )]
    NoObject,
    #[error("cannot read kernel object {path}: {source}")]
    ReadObject {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("loading the kernel object (maps pinned under {maps_dir}) failed: {source}")]
    Load {
        maps_dir: PathBuf,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("program {program} is missing from the kernel object; rebuild it with `cargo xtask build-ebpf`")]
    MissingProgram { program: &'static str },
    #[error("the verifier rejected {program}: {error}\nverifier log (tail):\n{log_tail}")]
    Verifier {
        program: &'static str,
        error: String,
        log_tail: String,
    },
    #[error("{program}: {source}")]
    Program {
        program: &'static str,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("cannot open cgroup {path}: {source} (is it a cgroup v2 directory?)")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "attaching {program} to {iface} needs TCX (kernel >= 6.6); this kernel only has \
         netlink clsact, which lb does not drive yet"
    )]
    NoTcx {
        program: &'static str,
        iface: String,
    },
    #[error("cannot attach {program} to interface {iface}: {message} (does the interface exist in the agent's network namespace?)")]
    TcAttach {
        program: &'static str,
        iface: String,
        message: String,
    },
    #[error(
        "{flag} {device}: no such device in the agent's network namespace (devices: \
         {present}); fix the name, or leave the flag out: the agent finds node- and \
         pod-facing devices itself"
    )]
    MissingDevice {
        flag: &'static str,
        device: String,
        present: String,
    },
    #[error("cannot list or remove stale link pins in {path}: {source}")]
    StaleLinks {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot pin link of {program} at {path}: {message}")]
    PinLink {
        program: &'static str,
        path: PathBuf,
        message: String,
    },
}

/// The kernel object embedded at build time (empty when it was not built).
static EMBEDDED_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf.o"));

/// The kernel object to load: a file given on the command line, else the embedded one.
pub fn kernel_object(path: Option<&Path>) -> Result<Vec<u8>, LoadError> {
    match path {
        Some(path) => fs::read(path).map_err(|source| LoadError::ReadObject {
            path: path.to_path_buf(),
            source,
        }),
        None if EMBEDDED_OBJECT.is_empty() => Err(LoadError::NoObject),
        None => Ok(EMBEDDED_OBJECT.to_vec()),
    }
}

/// Has the kernel verify every program the agent will attach, without attaching
/// any: the agent does this while the first sync is still being read, so the
/// verifier's time is off the path to serving, and a rejection stops the start
/// before a single map write. `attach` loads whatever this did not.
pub fn verify(ebpf: &mut Ebpf, tc: TcAttach) -> Result<(), LoadError> {
    for program in program_names::ALL {
        cgroup_program(ebpf, program)?;
    }
    if tc != TcAttach::Off {
        for program in [program_names::TC_EXTERNAL, program_names::TC_INTERNAL] {
            tc_program(ebpf, program)?;
        }
    }
    Ok(())
}

/// Program types the agent loads, each once however often it is asked for.
trait LoadOnce {
    fn load_once(&mut self) -> Result<(), ProgramError>;
}

impl LoadOnce for CgroupSockAddr {
    fn load_once(&mut self) -> Result<(), ProgramError> {
        self.fd().map(|_| ()).or_else(|_| self.load())
    }
}

impl LoadOnce for SchedClassifier {
    fn load_once(&mut self) -> Result<(), ProgramError> {
        self.fd().map(|_| ()).or_else(|_| self.load())
    }
}

/// A program of the object, loaded into the kernel unless it already is.
fn loaded_program<'a, P: LoadOnce>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut P, LoadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let prog: &mut P = ebpf
        .program_mut(program)
        .ok_or(LoadError::MissingProgram { program })?
        .try_into()
        .map_err(|e| program_error(program, e))?;
    prog.load_once().map_err(|e| verifier_error(program, e))?;
    Ok(prog)
}

fn cgroup_program<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut CgroupSockAddr, LoadError> {
    loaded_program(ebpf, program)
}

fn tc_program<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, LoadError> {
    loaded_program(ebpf, program)
}

/// Attaches the socket hooks of a loaded object to `cgroup` and pins the links;
/// returns the pins. Links of a previous agent are replaced only after the new ones
/// are attached: both translate identically, and a socket already rewritten to a
/// backend is not a frontend to the second program, so the overlap is harmless
/// while a gap would not be. The per-packet programs go on devices through
/// [`crate::tc_links`].
pub fn attach_cgroup_hooks(
    ebpf: &mut Ebpf,
    layout: &PinLayout,
    cgroup: &Path,
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
    Ok(pinned)
}

/// The pin name of a TCX link of `program` on `device`.
pub(crate) fn tc_pin_name(program: &str, device: &str) -> String {
    // bpffs names cannot contain '.', which VLAN devices have.
    format!("{program}_{}", device.replace('.', "_"))
}

/// Attaches `program` (loading it if needed) to `device`'s ingress.
pub(crate) fn attach_tc_device(
    ebpf: &mut Ebpf,
    program: &'static str,
    device: &str,
    mode: TcAttach,
) -> Result<TcLink, LoadError> {
    let prog = tc_program(ebpf, program)?;
    attach_tc(prog, program, device, mode)
}

/// Creates (or reopens, keeping their contents across restarts) the pinned maps and
/// prepares the programs without loading them into the kernel or attaching them;
/// `node_ip` is the SNAT source of the per-packet path. Tests use this to run
/// programs through BPF_PROG_TEST_RUN.
pub fn load(
    object: &[u8],
    layout: &PinLayout,
    sizes: MapSizes,
    node_ip: Option<Ipv4Addr>,
) -> Result<Ebpf, LoadError> {
    for dir in [layout.maps_dir(), layout.links_dir()] {
        fs::create_dir_all(&dir).map_err(|source| LoadError::PinDir { path: dir, source })?;
    }
    let map_paths: Vec<(&str, PathBuf)> = map_names::ALL
        .iter()
        .map(|name| (*name, layout.map_path(name)))
        .collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &map_paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .map_max_entries(map_names::SERVICES, sizes.services)
        .map_max_entries(map_names::BACKENDS, sizes.backends)
        .map_max_entries(map_names::SOCK_REVNAT, sizes.sock_revnat)
        .map_max_entries(map_names::AFFINITY, sizes.affinity)
        .map_max_entries(map_names::CT, sizes.conntrack)
        // One counter entry per frontend at most.
        .map_max_entries(map_names::SVC_STATS, sizes.services);
    let node_ip = node_ip.map_or(0, |ip| u32::from_ne_bytes(ip.octets()));
    loader.override_global("LB_NODE_IPV4", &node_ip, true);
    loader.load(object).map_err(|source| LoadError::Load {
        maps_dir: layout.maps_dir(),
        source: Box::new(source),
    })
}

fn program_error(program: &'static str, source: ProgramError) -> LoadError {
    LoadError::Program {
        program,
        source: Box::new(source),
    }
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
) -> Result<TcLink, LoadError> {
    let tc_error = |message: String| LoadError::TcAttach {
        program,
        iface: iface.to_owned(),
        message,
    };
    if uses_tcx(mode) {
        let options = TcAttachOptions::TcxOrder(LinkOrder::default());
        let link_id = prog
            .attach_with_options(iface, TcAttachType::Ingress, options)
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
        let text = error_chain(&e);
        if !text.contains("File exists") {
            return Err(tc_error(format!("adding the clsact qdisc: {text}")));
        }
    }
    let options = TcAttachOptions::Netlink(NlOptions {
        priority: NETLINK_PRIORITY,
        handle: NETLINK_HANDLE,
        ..NlOptions::default()
    });
    let link_id = match prog.attach_with_options(iface, TcAttachType::Ingress, options) {
        Ok(id) => id,
        // Our slot is taken by a previous agent's filter: replace its program in
        // place, so no packet meets an empty slot.
        Err(e) if error_chain(&e).contains("File exists") => {
            let existing = SchedClassifierLink::attached(
                iface,
                TcAttachType::Ingress,
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

/// aya's errors keep the errno in their source; a message without it is useless.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn verifier_error(program: &'static str, error: ProgramError) -> LoadError {
    match &error {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            LoadError::Verifier {
                program,
                error: io_error.to_string(),
                log_tail: tail,
            }
        }
        _ => LoadError::Program {
            program,
            source: Box::new(error),
        },
    }
}

/// Map directories of other layout versions under the pin directory: what an agent
/// with another kernel object left.
pub fn other_layouts(layout: &PinLayout) -> io::Result<Vec<PathBuf>> {
    let current = layout.maps_dir();
    let mut found = Vec::new();
    for entry in fs::read_dir(layout.root())? {
        let path = entry?.path();
        let is_layout = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
            n.len() > 1 && n.starts_with('v') && n[1..].bytes().all(|b| b.is_ascii_digit())
        });
        if is_layout && path != current {
            found.push(path);
        }
    }
    Ok(found)
}

/// Unpins the maps of a retired layout; the kernel frees them once no program
/// uses them.
pub fn remove_layout(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        fs::remove_file(entry?.path())?;
    }
    fs::remove_dir(dir)
}

/// What `lb cleanup` removed, and what it found but left.
#[derive(Debug, Default)]
pub struct CleanupReport {
    pub removed: Vec<PathBuf>,
    /// Entries lb did not pin (another tool's, or a user's): never removed.
    pub left: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error(
        "{} is not on a bpf filesystem: lb pins only under bpffs, so this is not a pin \
         directory of lb's; nothing was removed (pass the --pin-dir the agent used, \
         default /sys/fs/bpf/lb)",
        path.display()
    )]
    NotBpffs { path: PathBuf },
    #[error(transparent)]
    Locked(#[from] crate::pin_lock::PinLockError),
    #[error("cleaning up {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Which names of a directory lb pinned.
type NameFilter = fn(&str) -> bool;

/// Whether `name` is a link pin lb makes under `links/`.
fn is_link_pin(name: &str) -> bool {
    let name = name.strip_suffix("_new").unwrap_or(name);
    program_names::ALL.contains(&name)
        || [program_names::TC_EXTERNAL, program_names::TC_INTERNAL]
            .iter()
            .any(|p| {
                name.strip_prefix(p)
                    .is_some_and(|rest| rest.starts_with('_'))
            })
}

/// Whether `name` is a map-layout directory (`v<N>`).
fn is_layout_dir(name: &str) -> bool {
    name.len() > 1 && name.starts_with('v') && name[1..].bytes().all(|b| b.is_ascii_digit())
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> CleanupError {
    let path = path.to_path_buf();
    move |source| CleanupError::Io { path, source }
}

/// The right to clean a pin directory: it is on bpffs and no agent holds it.
pub struct CleanupLock {
    _lock: crate::pin_lock::PinLock,
}

/// Checks that `layout` is lb's to clean and locks it against an agent starting
/// meanwhile; `None` when there is nothing to clean.
pub fn lock_for_cleanup(layout: &PinLayout) -> Result<Option<CleanupLock>, CleanupError> {
    let root = layout.root();
    if !root.exists() {
        return Ok(None);
    }
    let on_bpffs = nix::sys::statfs::statfs(root)
        .map_err(|e| io_error(root)(e.into()))?
        .filesystem_type()
        == nix::sys::statfs::BPF_FS_MAGIC;
    if !on_bpffs {
        return Err(CleanupError::NotBpffs {
            path: root.to_path_buf(),
        });
    }
    let lock = crate::pin_lock::PinLock::acquire(root, crate::pin_lock::Wait::No)?;
    Ok(Some(CleanupLock { _lock: lock }))
}

/// Unpins lb's links (which detaches the hooks) and the maps of every layout
/// version, then removes the directories they leave empty. Only names lb pins are
/// touched ([`lock_for_cleanup`] checked they are on bpffs); anything else is
/// reported in `left` and stays, with its directory. Missing pieces are fine:
/// cleanup is idempotent.
pub fn cleanup(layout: &PinLayout, _lock: &CleanupLock) -> Result<CleanupReport, CleanupError> {
    let mut report = CleanupReport::default();
    let root = layout.root();
    // Links first, so no hook runs against maps that are about to go.
    let mut dirs: Vec<(PathBuf, NameFilter)> = vec![(layout.links_dir(), is_link_pin)];
    for entry in fs::read_dir(root).map_err(io_error(root))? {
        let path = entry.map_err(io_error(root))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path == layout.links_dir() {
            continue;
        }
        if is_layout_dir(name) && path.is_dir() {
            dirs.push((path, |n: &str| map_names::ALL.contains(&n)));
        } else {
            report.left.push(path);
        }
    }
    for (dir, ours) in dirs {
        if !dir.exists() {
            continue;
        }
        for entry in fs::read_dir(&dir).map_err(io_error(&dir))? {
            let path = entry.map_err(io_error(&dir))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if ours(name) && !path.is_dir() {
                fs::remove_file(&path).map_err(io_error(&path))?;
                report.removed.push(path);
            } else {
                report.left.push(path);
            }
        }
        if fs::read_dir(&dir).map_err(io_error(&dir))?.next().is_none() {
            fs::remove_dir(&dir).map_err(io_error(&dir))?;
        }
    }
    if report.left.is_empty() {
        fs::remove_dir(root).map_err(io_error(root))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_layout_versions_are_found_and_removed() {
        let root = std::env::temp_dir().join(format!("lb-layouts-{}", std::process::id()));
        let layout = PinLayout::new(&root);
        let current = format!("v{}", lb_common::PIN_LAYOUT_VERSION);
        for dir in ["v0", "v1", "v17", &current, "links", "vx", "v"] {
            fs::create_dir_all(root.join(dir)).unwrap();
        }
        fs::write(root.join("v0/LB_SERVICES"), b"").unwrap();
        let mut found = other_layouts(&layout).unwrap();
        found.sort();
        let mut expected = vec![root.join("v0"), root.join("v1"), root.join("v17")];
        expected.retain(|d| !d.ends_with(&current));
        assert_eq!(found, expected);
        remove_layout(&root.join("v0")).unwrap();
        assert!(!root.join("v0").exists());
        assert!(layout.maps_dir().exists(), "the current layout stays");
        fs::remove_dir_all(&root).unwrap();
    }
}
