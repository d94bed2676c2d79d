//! The kernel object, loading it with its pinned maps, and having the verifier
//! check the programs.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::programs::{CgroupSockAddr, ProgramError, SchedClassifier, SockOps, Xdp};
use aya::{Ebpf, EbpfLoader};
use lb_common::{map_names, program_names};

use super::{program_error, LoadError, TcAttach, XdpAttach};
use crate::datapath::forwarding::Forwarding;
use crate::datapath::pins::{MapSizes, PinLayout};
use lb_common::{IpAddrBe, MasqSettings, PolicySettings, QuarantineSettings};

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
/// `settings` are those the object was loaded with: the egress side's programs
/// are verified when masquerading or NetworkPolicy will attach them.
pub fn verify(
    ebpf: &mut Ebpf,
    tc: TcAttach,
    xdp: XdpAttach,
    settings: &ProgramSettings,
) -> Result<(), LoadError> {
    for program in program_names::ALL {
        cgroup_program(ebpf, program)?;
    }
    sock_ops_program(ebpf)?;
    if tc != TcAttach::Off {
        for program in [program_names::TC_EXTERNAL, program_names::TC_INTERNAL] {
            tc_program(ebpf, program)?;
        }
        if settings.masquerade.enabled != 0 {
            tc_program(ebpf, program_names::TC_EGRESS)?;
        }
        if settings.policy.is_enabled() {
            tc_program(ebpf, program_names::TC_TO_POD)?;
        }
        if xdp != XdpAttach::Off {
            xdp_program(ebpf)?;
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

impl LoadOnce for SockOps {
    fn load_once(&mut self) -> Result<(), ProgramError> {
        self.fd().map(|_| ()).or_else(|_| self.load())
    }
}

impl LoadOnce for Xdp {
    fn load_once(&mut self) -> Result<(), ProgramError> {
        self.fd().map(|_| ()).or_else(|_| self.load())
    }
}

/// Loads the kernel refused with EAGAIN before giving up: a signal arriving during a
/// long verification (lb_xdp's takes about half a second) makes BPF_PROG_LOAD fail
/// that way, and libbpf retries it as well.
const LOAD_ATTEMPTS: usize = 5;

fn is_eagain(error: &ProgramError) -> bool {
    matches!(error, ProgramError::LoadError { io_error, .. }
        if io_error.raw_os_error() == Some(libc::EAGAIN))
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
    let mut attempt = 1;
    loop {
        match prog.load_once() {
            Ok(()) => return Ok(prog),
            Err(e) if is_eagain(&e) && attempt < LOAD_ATTEMPTS => attempt += 1,
            Err(e) => return Err(verifier_error(program, e)),
        }
    }
}

pub(super) fn cgroup_program<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut CgroupSockAddr, LoadError> {
    loaded_program(ebpf, program)
}

pub(super) fn tc_program<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, LoadError> {
    loaded_program(ebpf, program)
}

/// `lb_sock_ops`, the fate of the hooks' TCP connects (passive health).
pub(super) fn sock_ops_program(ebpf: &mut Ebpf) -> Result<&mut SockOps, LoadError> {
    loaded_program(ebpf, program_names::SOCK_OPS)
}

/// `lb_xdp`; its `xdp.frags` section makes aya load it with `BPF_F_XDP_HAS_FRAGS`,
/// so it also runs on multi-buffer (jumbo) frames.
pub(super) fn xdp_program(ebpf: &mut Ebpf) -> Result<&mut Xdp, LoadError> {
    loaded_program(ebpf, program_names::XDP)
}

/// What the per-packet programs are told at load time, beyond the map sizes: each
/// field becomes a read-only global of the kernel object, so a new agent's programs
/// carry new settings and the verifier walks only the branches they enable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramSettings {
    /// `--maglev-seed`: the seed Maglev frontends hash flows with.
    pub maglev_seed: u64,
    /// `--lb-mode`, `--dsr-dispatch`: how remote backends are reached (SNAT by
    /// default).
    pub forwarding: Forwarding,
    /// `--masquerade` and the NodePort range its ports stay out of (off by
    /// default).
    pub masquerade: MasqSettings,
    /// `--backend-quarantine` (off by default here, so that fixtures see the
    /// datapath without it unless they ask; the agent's flag defaults to on).
    pub quarantine: QuarantineSettings,
    /// `--network-policy` (off by default).
    pub policy: PolicySettings,
}

/// Creates (or reopens, keeping their contents across restarts) the pinned maps and
/// prepares the programs without loading them into the kernel or attaching them;
/// `node_ips` name the SNAT sources of the per-packet path, `maglev_seed` the seed
/// its Maglev frontends hash flows with. Tests use this to run programs through
/// BPF_PROG_TEST_RUN. Remote backends are reached by SNAT and nothing is
/// masqueraded; see [`load_with`] for the other settings.
pub fn load(
    object: &[u8],
    layout: &PinLayout,
    sizes: MapSizes,
    node_ips: &[IpAddr],
    maglev_seed: u64,
) -> Result<Ebpf, LoadError> {
    let settings = ProgramSettings {
        maglev_seed,
        ..ProgramSettings::default()
    };
    load_with(object, layout, sizes, node_ips, &settings)
}

/// [`load`], with every load-time setting of the programs (`settings`).
pub fn load_with(
    object: &[u8],
    layout: &PinLayout,
    sizes: MapSizes,
    node_ips: &[IpAddr],
    settings: &ProgramSettings,
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
        .map_max_entries(map_names::MAGLEV, sizes.maglev_entries())
        .map_max_entries(map_names::MASQ, sizes.masquerade)
        // One counter entry per frontend at most.
        .map_max_entries(map_names::SVC_STATS, sizes.services);
    // The first address of each family; none (zero): the kernel's FIB picks one.
    let first = |v6: bool| {
        node_ips
            .iter()
            .find(|ip| ip.is_ipv6() == v6)
            .map_or(IpAddrBe::default(), |ip| IpAddrBe::from(*ip))
    };
    let node_ipv4 = first(false).v4();
    loader.override_global("LB_NODE_IPV4", &node_ipv4, true);
    let node_ipv6 = first(true);
    loader.override_global("LB_NODE_IPV6", &node_ipv6, true);
    loader.override_global("LB_MAGLEV_SEED", &settings.maglev_seed, true);
    let dsr = settings.forwarding.kernel_config();
    loader.override_global("LB_DSR", &dsr, true);
    loader.override_global("LB_MASQ_SETTINGS", &settings.masquerade, true);
    loader.override_global("LB_QUARANTINE_SETTINGS", &settings.quarantine, true);
    loader.override_global("LB_POLICY_SETTINGS", &settings.policy, true);
    loader.load(object).map_err(|source| {
        let maps_dir = layout.maps_dir();
        match errno_in(&source) {
            Some(errno) if errno.raw_os_error() == Some(libc::EPERM) => LoadError::LoadRefused {
                maps_dir,
                detail: errno.to_string(),
            },
            _ => LoadError::Load {
                maps_dir,
                source: Box::new(source),
            },
        }
    })
}

/// The first OS error in `error`'s chain of sources.
fn errno_in<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.raw_os_error().is_some() {
                return Some(io);
            }
        }
        current = e.source();
    }
    None
}

/// What the verifier's log says is missing, as advice; empty when it says nothing
/// the agent can name.
fn verifier_hint(log: &str) -> &'static str {
    // The verifier treats a program loaded without CAP_PERFMON as unprivileged and
    // refuses what could leak pointers or speculate past bounds.
    if log.contains("for !root") {
        " (the verifier allows this only with CAP_PERFMON, or CAP_SYS_ADMIN: add it)"
    } else {
        ""
    }
}

fn verifier_error(program: &'static str, error: ProgramError) -> LoadError {
    match &error {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            // Refused before any verification: the caller lacks a capability.
            if io_error.raw_os_error() == Some(libc::EPERM) {
                return LoadError::ProgramRefused {
                    program,
                    error: io_error.to_string(),
                };
            }
            let log = verifier_log.to_string();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            LoadError::Verifier {
                program,
                error: io_error.to_string(),
                hint: verifier_hint(&log),
                log_tail: tail,
            }
        }
        _ => LoadError::Program {
            program,
            source: Box::new(error),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_map_is_found_under_aya_s_wrapping() {
        let error = aya::EbpfError::MapError(aya::maps::MapError::CreateError {
            name: "LB_BACKENDS".into(),
            io_error: std::io::Error::from_raw_os_error(libc::EPERM),
        });
        let errno = errno_in(&error).expect("the OS error");
        assert_eq!(errno.raw_os_error(), Some(libc::EPERM));
        let other = aya::EbpfError::MapError(aya::maps::MapError::InvalidName { name: "x".into() });
        assert!(errno_in(&other).is_none());
    }

    #[test]
    fn the_verifier_s_unprivileged_refusal_names_cap_perfmon() {
        let log = "692: (0f) r5 += r4\nR5 tried to add from different maps, paths or \
                   scalars, pointer arithmetic with it prohibited for !root\n";
        assert!(verifier_hint(log).contains("CAP_PERFMON"));
        assert_eq!(verifier_hint("invalid mem access 'scalar'"), "");
    }
}
