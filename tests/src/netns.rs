//! Named network namespaces (`ip netns add`), deleted on drop.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::util::ip;

/// A network namespace this test created. Deleting the name on drop frees the
/// namespace (and destroys its veth ends) once no process is left in it.
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Create `name`; it must be unique (see [`crate::util::unique_name`]).
    pub fn create(name: &str) -> Result<Self> {
        ip(&["netns", "add", name]).with_context(|| format!("creating netns {name}"))?;
        let ns = NetNs {
            name: name.to_string(),
        };
        // Loopback is down in a new namespace; servers and probes expect it up.
        ns.ip(&["link", "set", "lo", "up"])?;
        // Every IPv6 address usable at once, the link-local ones too (global ones
        // are added `nodad`): no test waits out duplicate address detection.
        ns.sysctls(&[
            ("net/ipv6/conf/all/accept_dad", "0"),
            ("net/ipv6/conf/default/accept_dad", "0"),
        ])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind mount `ip netns add` made; `setns` takes a descriptor of it.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    pub fn open(&self) -> Result<File> {
        File::open(self.path()).with_context(|| format!("cannot open {}", self.path().display()))
    }

    /// Runs `work` on a thread of its own that joined only this network namespace
    /// (the sockets it creates belong here, and stay here); no other thread moves.
    pub fn run_in<T: Send>(&self, work: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        let ns = self.open()?;
        let name = &self.name;
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: setns on a descriptor we own; it only changes this
                    // thread's network namespace, and the thread ends after `work`.
                    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        bail!("setns into {name}: {}", std::io::Error::last_os_error());
                    }
                    work()
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the thread in {name} panicked"))?
        })
    }

    /// `ip -n NAME ARGS...`: configuration only (ip needs neither bpffs nor cgroups,
    /// so its private mount namespace does not matter here).
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// A veth pair: `local` here, its peer `peer_name` in `peer` (both down).
    pub fn veth_to(&self, local: &str, peer: &NetNs, peer_name: &str) -> Result<()> {
        self.ip(&[
            "link",
            "add",
            local,
            "type",
            "veth",
            "peer",
            "name",
            peer_name,
            "netns",
            peer.name(),
        ])
        .map(drop)
    }
}

/// Where a namespace's IPv4 interface settings live, relative to /proc/sys.
const IPV4_CONF: &str = "net/ipv4/conf";

impl NetNs {
    /// Write sysctls of this namespace: `(path below /proc/sys, value)`, e.g.
    /// `("net/ipv4/ip_forward", "1")`. A `*` as the interface part of a path
    /// (`net/ipv4/conf/*/rp_filter`) means every interface present now, `all` and
    /// `default` included.
    ///
    /// /proc/sys/net shows the network namespace of the thread that opens it, so the
    /// writes run on a short-lived thread that joined only this namespace (no external
    /// tool, no other namespace touched).
    pub fn sysctls(&self, settings: &[(&str, &str)]) -> Result<()> {
        let ns = self.open()?;
        let settings: Vec<(String, String)> = settings
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        let name = self.name.clone();
        std::thread::spawn(move || -> Result<()> {
            // SAFETY: setns on a descriptor we own; it only changes this thread's
            // network namespace, and the thread ends right after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("setns into {name}: {}", std::io::Error::last_os_error());
            }
            for (key, value) in &settings {
                for path in expand_sysctl(key)? {
                    std::fs::write(&path, value)
                        .with_context(|| format!("writing {value} to {path} in {name}"))?;
                }
            }
            Ok(())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("sysctl thread panicked"))?
    }
}

/// `/proc/sys/<key>`, with `conf/*/` expanded to every interface of the calling
/// thread's namespace.
fn expand_sysctl(key: &str) -> Result<Vec<String>> {
    let wildcard = format!("{IPV4_CONF}/*/");
    let Some(setting) = key.strip_prefix(&wildcard) else {
        return Ok(vec![format!("/proc/sys/{key}")]);
    };
    let dir = format!("/proc/sys/{IPV4_CONF}");
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
        let entry = entry?;
        paths.push(format!(
            "{dir}/{}/{setting}",
            entry.file_name().to_string_lossy()
        ));
    }
    paths.sort();
    Ok(paths)
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("warning: cannot delete netns {}: {e:#}", self.name);
        }
    }
}
