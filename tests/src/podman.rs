//! A podman of the test's own, for running the agent's image (tests/tests/image.rs).
//!
//! Everything podman keeps or reads lives in one directory the test creates and
//! removes: its image and container storage (the `vfs` driver: plain directories, so
//! a test that dies leaves no overlay mount behind), its state and locks, and its
//! configuration, handed over through `CONTAINERS_CONF`, `CONTAINERS_STORAGE_CONF`
//! and `CONTAINERS_REGISTRIES_CONF` (which replace the machine's files): no hand edit
//! of /etc is needed, the machine's own images and containers are never seen, and
//! tests running at the same time do not share anything.
//!
//! The configuration says what this kind of machine needs:
//! - `runc` as the OCI runtime: crun refuses a hybrid (v1 + v2) cgroup layout;
//! - `default_ulimits` within the limits the test itself runs under: podman's own
//!   defaults raise `nofile` above the hard limit, which needs CAP_SYS_RESOURCE
//!   (`setrlimit ... Operation not permitted` where root lacks it);
//! - no registry for short names: the image comes from `podman load`, and a name
//!   that is not loaded fails instead of being looked up.
//!
//! Containers run below a cgroup parent named like the directory (in every cgroup
//! hierarchy of the machine, v1 and v2), removed with it, rather than in podman's
//! shared `libpod_parent`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::{Child, Spawner};
use crate::util::unique_name;

/// Bound for a podman command that does not run a container (load, exec, rm).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// A podman configured and stored under a directory of its own (see the module
/// doc). Dropping it removes every container and image it holds, then the directory.
pub struct Podman {
    dir: PathBuf,
}

impl Podman {
    pub fn create() -> Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("lb-podman"));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let podman = Podman { dir };
        podman.write_config()?;
        Ok(podman)
    }

    fn write_config(&self) -> Result<()> {
        let d = self.dir.display();
        // nproc: the agent runs a handful of threads. Not the test's own hard
        // limit: podman's conmon, the container's parent, runs with a lower one
        // here (pid_max), and a container cannot be given more than its parent has.
        let nofile = hard_limit(libc::RLIMIT_NOFILE)?;
        let nproc = hard_limit(libc::RLIMIT_NPROC)?.min(4096);
        let files = [
            (
                "containers.conf",
                format!(
                    "[containers]\n\
                     default_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc={nproc}:{nproc}\"]\n\
                     log_driver = \"k8s-file\"\n\
                     [engine]\n\
                     runtime = \"runc\"\n\
                     cgroup_manager = \"cgroupfs\"\n\
                     events_logger = \"none\"\n\
                     lock_type = \"file\"\n\
                     tmp_dir = \"{d}/tmp\"\n\
                     static_dir = \"{d}/root/libpod\"\n\
                     volume_path = \"{d}/root/volumes\"\n"
                ),
            ),
            (
                "storage.conf",
                format!(
                    "[storage]\ndriver = \"vfs\"\ngraphroot = \"{d}/root\"\nrunroot = \"{d}/run\"\n"
                ),
            ),
            (
                "registries.conf",
                "unqualified-search-registries = []\n".into(),
            ),
        ];
        for (name, text) in files {
            let path = self.dir.join(name);
            fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// `podman ARGS...` with this configuration.
    pub fn spawner<I, S>(&self, args: I) -> Spawner
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        configured(&self.dir).args(args)
    }

    /// Runs `podman ARGS...` to completion; its stdout (an error with its stderr if
    /// it fails).
    pub fn output<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.spawner(args).output(COMMAND_TIMEOUT)?.checked_stdout()
    }

    /// `podman load -i ARCHIVE`; the names it loaded.
    pub fn load(&self, archive: &Path) -> Result<Vec<String>> {
        let out = self
            .spawner(["load", "--input"])
            .arg(archive)
            .output(COMMAND_TIMEOUT)?
            .checked_stdout()?;
        let names: Vec<String> = out
            .lines()
            .filter_map(|l| l.strip_prefix("Loaded image"))
            .filter_map(|l| l.split_once(':').map(|(_, names)| names))
            .flat_map(|names| names.split(','))
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            bail!(
                "`podman load` of {} printed no image name:\n{out}",
                archive.display()
            );
        }
        Ok(names)
    }

    /// `podman run --name NAME ARGS...`, attached: the container's output arrives
    /// on the returned child's stdout and stderr, and the child exits with the
    /// container. The container is removed when the handle is dropped.
    pub fn run(&self, name: &str, args: &[String]) -> Result<Container> {
        let child = self
            .spawner(["run", "--name", name])
            .arg(format!("--cgroup-parent=/{}", self.cgroup_parent()))
            .args(args)
            .label(format!("container {name}"))
            .spawn()?;
        Ok(Container {
            name: name.to_string(),
            child,
            dir: self.dir.clone(),
        })
    }

    /// The cgroup (below each hierarchy's root) the containers' cgroups go in.
    fn cgroup_parent(&self) -> String {
        self.dir
            .file_name()
            .expect("a directory of its own")
            .to_string_lossy()
            .into_owned()
    }

    fn teardown(&self) -> Result<()> {
        self.output(["rm", "--all", "--force", "--time", "0"])?;
        self.output(["rmi", "--all", "--force"])?;
        Ok(())
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("warning: podman teardown in {}: {e:#}", self.dir.display());
        }
        // A container whose runtime died can leave a mount (its /dev/shm) below
        // the state directory: unmount whatever is still there, deepest first.
        for mount in mounts_below(&self.dir).into_iter().rev() {
            // SAFETY: umount2 with a NUL-terminated path we own; MNT_DETACH only
            // affects that mount point, which lies in this test's own directory.
            let c = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes()).ok();
            if let Some(c) = c {
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("warning: cannot remove {}: {e}", self.dir.display());
        }
        for hierarchy in cgroup_mounts() {
            let parent = hierarchy.join(self.cgroup_parent());
            if parent.exists() {
                if let Err(e) = remove_cgroup_tree(&parent) {
                    eprintln!("warning: cannot remove cgroup {}: {e:#}", parent.display());
                }
            }
        }
    }
}

/// Mount points of every cgroup hierarchy (v1 controllers and v2).
fn cgroup_mounts() -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (_, after) = l.split_once(" - ")?;
            let fstype = after.split_whitespace().next()?;
            let point = l.split_whitespace().nth(4)?;
            matches!(fstype, "cgroup" | "cgroup2").then(|| PathBuf::from(point))
        })
        .collect()
}

/// Removes the cgroup `dir` and those below it, deepest first. Its processes are
/// gone with the containers; a cgroup whose last task is still exiting is busy for
/// a moment, hence the bounded retry.
fn remove_cgroup_tree(dir: &Path) -> Result<()> {
    let mut dirs = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        for entry in fs::read_dir(&dirs[i])? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            }
        }
        i += 1;
    }
    for d in dirs.iter().rev() {
        crate::util::poll_to_completion(
            &format!("cgroup {} to be removable", d.display()),
            Duration::from_secs(5),
            || match fs::remove_dir(d) {
                Ok(()) => Ok(Some(())),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(None),
                Err(e) => bail!("rmdir {}: {e}", d.display()),
            },
        )?;
    }
    Ok(())
}

/// `podman` configured by the files in `dir`.
fn configured(dir: &Path) -> Spawner {
    Spawner::new("podman")
        .env("CONTAINERS_CONF", dir.join("containers.conf"))
        .env("CONTAINERS_STORAGE_CONF", dir.join("storage.conf"))
        .env("CONTAINERS_REGISTRIES_CONF", dir.join("registries.conf"))
}

/// Mount points at or below `dir`, in the order /proc/self/mountinfo lists them.
fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// The hard limit of `resource` this process runs under.
fn hard_limit(resource: libc::__rlimit_resource_t) -> Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass; no other effect.
    if unsafe { libc::getrlimit(resource, &mut limit) } != 0 {
        bail!("getrlimit: {}", std::io::Error::last_os_error());
    }
    Ok(limit.rlim_max)
}

/// A container started by [`Podman::run`]; removed (`podman rm --force`) on drop.
pub struct Container {
    name: String,
    /// The attached `podman run`.
    child: Child,
    /// The owner's configuration directory, for commands about this container.
    dir: PathBuf,
}

impl Container {
    pub fn name(&self) -> &str {
        &self.name
    }

    fn podman(&self) -> Spawner {
        configured(&self.dir)
    }

    /// Everything the container wrote to stderr so far (the agent logs there).
    pub fn log(&self) -> String {
        self.child.stderr.text()
    }

    pub fn logged(&self, needle: &str) -> bool {
        self.child
            .stderr
            .snapshot()
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Waits for a line of the container's stderr containing `needle`; fails early
    /// if the container ends.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> Result<String> {
        self.child
            .stderr
            .wait_for(timeout, |l| l.contains(needle))
            .with_context(|| format!("waiting for `{needle}` from container {}", self.name))
    }

    /// The container's exit status if it has ended.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits for the container to end by itself; its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        self.child.wait_timeout(timeout)?.with_context(|| {
            format!(
                "container {} still running after {timeout:?}; its log:\n{}",
                self.name,
                self.log()
            )
        })
    }

    /// `podman stop --time GRACE NAME`: SIGTERM, SIGKILL after `grace` (what the
    /// kubelet does with terminationGracePeriodSeconds); the container's status.
    pub fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        let out = self
            .podman()
            .args(["stop", "--time", &grace.as_secs().to_string(), &self.name])
            .output(grace + COMMAND_TIMEOUT)?;
        out.checked_stdout()?;
        self.wait_exit(COMMAND_TIMEOUT)
    }

    /// `podman exec NAME ARGS...`: its output, whatever its exit status.
    pub fn exec(&self, args: &[&str]) -> Result<crate::process::Output> {
        self.podman()
            .args(["exec", &self.name])
            .args(args)
            .output(COMMAND_TIMEOUT)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let removed = self
            .podman()
            .args(["rm", "--force", "--time", "0", &self.name])
            .output(COMMAND_TIMEOUT);
        if let Err(e) = removed.and_then(|o| o.checked_stdout()) {
            eprintln!("warning: cannot remove container {}: {e:#}", self.name);
        }
        self.child.kill();
    }
}
