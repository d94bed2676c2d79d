//! The network namespaces a cgroup's processes live in, and running work inside one.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Processes whose network namespace the agent may not open: their sockets stay.
#[derive(Debug, Default)]
pub struct Refused {
    pub count: usize,
    /// The first refusal.
    pub first: Option<std::io::Error>,
}

/// One handle per network namespace that a process in `cgroup` (or a cgroup below
/// it) is in, and the processes whose namespace the agent may not open (another
/// user's, or one holding capabilities the agent lacks, without CAP_SYS_PTRACE).
/// Processes that exit while the tree is read are skipped; a cgroup the agent
/// cannot read is skipped too (its sockets stay as they are).
pub fn of_cgroup(cgroup: &Path) -> (Vec<File>, Refused) {
    let mut seen = HashSet::new();
    let mut namespaces = Vec::new();
    let mut refused = Refused::default();
    let mut dirs = vec![cgroup.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let ns = match File::open(format!("/proc/{pid}/ns/net")) {
                Ok(ns) => ns,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => {
                    refused.count += 1;
                    refused.first.get_or_insert(e);
                    continue;
                }
                Err(_) => continue,
            };
            let Ok(meta) = ns.metadata() else { continue };
            if seen.insert((meta.dev(), meta.ino())) {
                namespaces.push(ns);
            }
        }
        if let Ok(children) = std::fs::read_dir(&dir) {
            dirs.extend(
                children
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    (namespaces, refused)
}

/// Runs `work` on a thread of its own that first enters `netns`, so the agent's
/// other threads stay where they are; sockets `work` opens belong to `netns`.
pub fn run_in<T: Send>(netns: &File, work: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                rustix::thread::move_into_link_name_space(
                    netns.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                Ok(work())
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the namespace thread panicked")))
    })
}
