//! Host facts the agent depends on: where bpffs and cgroup v2 are mounted.

use std::fs;
use std::path::{Path, PathBuf};

/// The default bpffs mount point, the one `lb` mounts when nothing is there.
pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("cannot read /proc/self/mountinfo: {0}")]
    Mounts(#[source] procfs::ProcError),
    #[error(
        "bpffs not mounted at {path} and mounting it failed ({source}): \
         run `mount -t bpf bpf {path}` as root"
    )]
    BpffsMount {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pin directory {pin_dir} is not on a bpffs mount: \
         choose a directory under a bpf filesystem (default {BPFFS_ROOT})"
    )]
    NotOnBpffs { pin_dir: PathBuf },
    #[error(
        "no cgroup v2 mount found in /proc/self/mountinfo: mount one \
         (`mount -t cgroup2 none /sys/fs/cgroup`) or pass --cgroup"
    )]
    NoCgroup2,
    #[error("cgroup {}: {source}; pass an existing cgroup v2 directory with --cgroup", path.display())]
    CgroupUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cgroup {}: not a cgroup v2 directory ({found}); pass a directory of the cgroup2 \
         mount (e.g. under {}) with --cgroup",
        path.display(),
        cgroup2_root().map_or_else(|_| "/sys/fs/cgroup".to_string(), |p| p.display().to_string())
    )]
    NotCgroup2 { path: PathBuf, found: &'static str },
}

/// Checks that `path` is a directory of a cgroup v2 mount before anything is loaded:
/// the kernel's answer to attaching there is only `bpf_link_create: Bad file
/// descriptor`, long after the maps were written.
pub fn check_cgroup2_dir(path: &Path) -> Result<(), SysError> {
    use libc::{CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    let unreadable = |source| SysError::CgroupUnreadable {
        path: path.to_owned(),
        source,
    };
    let meta = fs::metadata(path).map_err(unreadable)?;
    let fs_type = rustix::fs::statfs(path)
        .map_err(|errno| unreadable(std::io::Error::from(errno)))?
        .f_type;
    let found = if fs_type == CGROUP2_SUPER_MAGIC {
        if meta.is_dir() {
            return Ok(());
        }
        "a file in a cgroup, not its directory"
    } else if fs_type == CGROUP_SUPER_MAGIC {
        "a cgroup v1 hierarchy"
    } else {
        "not on a cgroup filesystem"
    };
    Err(SysError::NotCgroup2 {
        path: path.to_owned(),
        found,
    })
}

struct Mount {
    fstype: String,
    target: PathBuf,
}

fn mounts() -> Result<Vec<Mount>, SysError> {
    let infos = procfs::process::Process::myself()
        .and_then(|me| me.mountinfo())
        .map_err(SysError::Mounts)?;
    Ok(infos
        .into_iter()
        .map(|m| Mount {
            fstype: m.fs_type,
            target: m.mount_point,
        })
        .collect())
}

/// The cgroup v2 root: `/sys/fs/cgroup` on a pure v2 host, `/sys/fs/cgroup/unified`
/// on a hybrid one. The shortest cgroup2 mount point wins.
pub fn cgroup2_root() -> Result<PathBuf, SysError> {
    mounts()?
        .into_iter()
        .filter(|m| m.fstype == "cgroup2")
        .map(|m| m.target)
        .min_by_key(|p| p.as_os_str().len())
        .ok_or(SysError::NoCgroup2)
}

/// Makes sure `pin_dir` lives on bpffs, mounting bpffs at /sys/fs/bpf if the pin
/// directory is under it and nothing is mounted there yet (fresh machines).
pub fn ensure_bpffs(pin_dir: &Path) -> Result<(), SysError> {
    let on_bpffs = |mounts: &[Mount]| {
        mounts
            .iter()
            .any(|m| m.fstype == "bpf" && pin_dir.starts_with(&m.target))
    };
    if on_bpffs(&mounts()?) {
        return Ok(());
    }
    if !pin_dir.starts_with(BPFFS_ROOT) {
        return Err(SysError::NotOnBpffs {
            pin_dir: pin_dir.to_path_buf(),
        });
    }
    rustix::mount::mount(
        "bpf",
        BPFFS_ROOT,
        "bpf",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .map_err(|errno| SysError::BpffsMount {
        path: BPFFS_ROOT.to_string(),
        source: errno.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cgroup2_directories_pass() {
        let root = cgroup2_root().unwrap();
        check_cgroup2_dir(&root).unwrap();
        let e = check_cgroup2_dir(Path::new("/tmp")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cgroup /tmp: not a cgroup v2 directory (not on a cgroup filesystem)"),
            "{e}"
        );
        let e = check_cgroup2_dir(&root.join("cgroup.procs")).unwrap_err();
        assert!(e.to_string().contains("a file in a cgroup"), "{e}");
        let e = check_cgroup2_dir(Path::new("/nonexistent/cg")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cgroup /nonexistent/cg: No such file"),
            "{e}"
        );
    }
}
