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

use aya::programs::{links::FdLink, CgroupAttachMode, CgroupSockAddr, ProgramError};
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
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: lb_common::DEFAULT_SERVICES_MAX,
            backends: lb_common::DEFAULT_BACKENDS_MAX,
            sock_revnat: lb_common::DEFAULT_SOCK_REVNAT_MAX,
            affinity: lb_common::DEFAULT_AFFINITY_MAX,
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

/// Loads the programs against the pinned maps (creating them on first start, reusing
/// them afterwards so their contents survive restarts), attaches every hook to
/// `cgroup`, and pins the links. Links of a previous agent are replaced only after
/// the new ones are attached: both translate identically, and a socket already
/// rewritten to a backend is not a frontend to the second program, so the overlap is
/// harmless while a gap would not be.
pub fn load_and_attach(
    object: &[u8],
    layout: &PinLayout,
    sizes: MapSizes,
    cgroup: &Path,
) -> Result<(), LoadError> {
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
        .map_max_entries(map_names::AFFINITY, sizes.affinity);
    let mut ebpf: Ebpf = loader.load(object).map_err(|source| LoadError::Load {
        maps_dir: layout.maps_dir(),
        source: Box::new(source),
    })?;

    let cgroup_file = File::open(cgroup).map_err(|source| LoadError::Cgroup {
        path: cgroup.to_path_buf(),
        source,
    })?;
    for program in program_names::ALL {
        attach_one(&mut ebpf, program, &cgroup_file, &layout.links_dir())?;
    }
    Ok(())
}

fn attach_one(
    ebpf: &mut Ebpf,
    program: &'static str,
    cgroup: &File,
    links_dir: &Path,
) -> Result<(), LoadError> {
    let as_program_error = |source| LoadError::Program {
        program,
        source: Box::new(source),
    };
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(program)
        .ok_or(LoadError::MissingProgram { program })?
        .try_into()
        .map_err(as_program_error)?;
    prog.load().map_err(|e| verifier_error(program, e))?;
    // With bpf_link the kernel always allows several programs per cgroup and rejects
    // the legacy BPF_F_ALLOW_MULTI flag, so "Single" (flags 0) is the right mode.
    let link_id = prog
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(as_program_error)?;
    let link: FdLink = prog
        .take_link(link_id)
        .map_err(as_program_error)?
        .try_into()
        .map_err(|e: aya::programs::links::LinkError| LoadError::PinLink {
            program,
            path: links_dir.join(program),
            message: e.to_string(),
        })?;

    // Pin under a temporary name, then rename over the old pin: the old link loses its
    // last reference (and detaches) only once the new one is live.
    let final_path = links_dir.join(program);
    // bpffs refuses names containing '.', hence the underscore.
    let staging = links_dir.join(format!("{program}_new"));
    let _ = fs::remove_file(&staging);
    let pin_error = |message: String| LoadError::PinLink {
        program,
        path: final_path.clone(),
        message,
    };
    link.pin(&staging).map_err(|e| pin_error(error_chain(&e)))?;
    fs::rename(&staging, &final_path).map_err(|e| pin_error(e.to_string()))?;
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

/// What `lb cleanup` removed.
#[derive(Debug, Default)]
pub struct CleanupReport {
    pub removed: Vec<PathBuf>,
}

/// Unpins links (which detaches the hooks) and maps of every layout version, then
/// removes the pin directory. Missing pieces are fine: cleanup is idempotent.
pub fn cleanup(layout: &PinLayout) -> io::Result<CleanupReport> {
    let mut report = CleanupReport::default();
    let root = layout.root();
    if !root.exists() {
        return Ok(report);
    }
    // Links first, so no hook runs against maps that are about to go.
    let mut dirs = vec![layout.links_dir()];
    for entry in fs::read_dir(root)? {
        let path = entry?.path();
        if path != layout.links_dir() && path.is_dir() {
            dirs.push(path);
        }
    }
    for dir in dirs {
        if !dir.exists() {
            continue;
        }
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            fs::remove_file(&path)?;
            report.removed.push(path);
        }
        fs::remove_dir(&dir)?;
    }
    fs::remove_dir(root)?;
    Ok(report)
}
