//! Named network namespaces (`ip netns add`), deleted on drop.

use std::fs::File;
use std::path::PathBuf;

use anyhow::{Context, Result};

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

    /// `ip -n NAME ARGS...`: configuration only (ip needs neither bpffs nor cgroups,
    /// so its private mount namespace does not matter here).
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        ip(&full)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("warning: cannot delete netns {}: {e:#}", self.name);
        }
    }
}
