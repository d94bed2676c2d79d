//! Between the kernel object and a running datapath: [`load`] (the kernel object,
//! `EbpfLoader`, the verifier) and [`attach`] (the cgroup socket hooks and the
//! per-packet programs on devices, and their link pins). Where things are pinned is
//! [`crate::datapath::pins`].

use std::io;
use std::path::PathBuf;

use aya::programs::ProgramError;

pub mod attach;
pub mod load;

pub use attach::{attach_cgroup_hooks, remove_stale_links, TcAttach, XdpAttach};
pub(crate) use attach::{
    attach_tc_device, attach_xdp_device, pin_link, tc_pin_name, uses_tcx, TcLink, NETLINK_HANDLE,
    NETLINK_PRIORITY,
};
pub use load::{kernel_object, load, load_with, verify, ProgramSettings};

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
    #[error(
        "the kernel refused to create the maps under {maps_dir} ({detail}): lb needs CAP_BPF \
         (or CAP_SYS_ADMIN), and a seccomp profile that admits bpf(): containerd's \
         RuntimeDefault admits it with CAP_BPF, podman's and CRI-O's only with \
         CAP_SYS_ADMIN (deploy/daemonset.yaml lists what lb needs and why)"
    )]
    LoadRefused { maps_dir: PathBuf, detail: String },
    #[error("program {program} is missing from the kernel object; rebuild it with `cargo xtask build-ebpf`")]
    MissingProgram { program: &'static str },
    #[error("the verifier rejected {program}: {error}{hint}\nverifier log (tail):\n{log_tail}")]
    Verifier {
        program: &'static str,
        error: String,
        /// What to do, when the log says what was missing; else empty.
        hint: &'static str,
        log_tail: String,
    },
    #[error(
        "the kernel refused to load {program} ({error}): lb's cgroup and TC programs need \
         CAP_NET_ADMIN beside CAP_BPF (or CAP_SYS_ADMIN instead of both)"
    )]
    ProgramRefused {
        program: &'static str,
        error: String,
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

pub(crate) fn program_error(program: &'static str, source: ProgramError) -> LoadError {
    LoadError::Program {
        program,
        source: Box::new(source),
    }
}
