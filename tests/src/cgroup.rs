//! A child cgroup (v2) per test: the agent attaches the socket programs here and the
//! probes run here, so nothing else on the machine is ever translated.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::util::poll_to_completion;

/// Where cgroup v2 is mounted: `/sys/fs/cgroup` on a pure v2 host,
/// `/sys/fs/cgroup/unified` on a hybrid one. Read from /proc/mounts, not assumed.
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir))
        })
        .next()
        .context("no cgroup2 filesystem in /proc/mounts; the socket hooks need cgroup v2")
}

/// A cgroup this test created; on drop its processes are killed and it is removed.
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// Create `<cgroup2 mount>/<name>`; `name` must be unique.
    pub fn create(name: &str) -> Result<Self> {
        let path = cgroup2_mount()?.join(name);
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Cgroup { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids currently in the cgroup.
    pub fn pids(&self) -> Result<Vec<i32>> {
        let procs = fs::read_to_string(self.path.join("cgroup.procs"))?;
        Ok(procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    /// Kill whatever is still inside. Only processes the test started can be here:
    /// the cgroup is unique to this test.
    fn kill_all(&self) -> Result<()> {
        let kill_file = self.path.join("cgroup.kill");
        if kill_file.exists() {
            fs::write(&kill_file, "1")?;
        } else {
            for pid in self.pids()? {
                // SAFETY: kill(2) on a pid read from our own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        poll_to_completion("the test cgroup to empty", Duration::from_secs(5), || {
            Ok(self.pids()?.is_empty().then_some(()))
        })
    }

    fn remove(&self) -> Result<()> {
        if !self.pids()?.is_empty() {
            self.kill_all()?;
        }
        // rmdir can briefly report EBUSY while killed tasks finish exiting.
        poll_to_completion(
            "the test cgroup to be removable",
            Duration::from_secs(5),
            || match fs::remove_dir(&self.path) {
                Ok(()) => Ok(Some(())),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(None),
                Err(e) => bail!("rmdir {}: {e}", self.path.display()),
            },
        )
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!(
                "warning: cannot remove cgroup {}: {e:#}",
                self.path.display()
            );
        }
    }
}
