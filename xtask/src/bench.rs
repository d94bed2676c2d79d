//! `cargo xtask bench [--quick]`: build everything like `demo` does (the eBPF object
//! embedded in `lb`), build `lb-bench` and `lb` in release (the client's own cost and
//! the agent's sync time are measured), then run it; results go to docs/benchmarks/.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Result};

use crate::run::{self, is_root};
use crate::tasks::{target_dir, workspace_cargo};
use crate::{ebpf, setup};

pub fn bench(workspace: &Path, quick: bool, extra: &[String]) -> Result<()> {
    setup::setup(workspace)?;
    setup::bench_packages()?;
    let object = ebpf::build(workspace, false)?;
    run::run(workspace_cargo(workspace, &object).args(["build", "--workspace", "--bins"]))?;
    // Release builds of what is measured: the client/server (their own cost is in every
    // figure) and the agent (its start-up and sync times are control-plane figures).
    for (package, bin) in [("lb-bench", "lb-bench"), ("lb-userspace", "lb")] {
        run::run(workspace_cargo(workspace, &object).args([
            "build",
            "--release",
            "-p",
            package,
            "--bin",
            bin,
        ]))?;
    }
    let target = target_dir(workspace);
    let lb = target.join("release").join("lb");
    let lb_bench = target.join("release").join("lb-bench");
    for bin in [&lb, &lb_bench] {
        if !bin.is_file() {
            bail!("{} was not built", bin.display());
        }
    }
    if !is_root() {
        bail!("the benchmark needs root (network namespaces, cgroups, BPF, iptables/nft in its namespaces)");
    }
    let mut cmd = Command::new(&lb_bench);
    cmd.current_dir(workspace)
        .arg("run")
        .arg("--lb")
        .arg(&lb)
        .arg("--out")
        .arg(workspace.join("docs").join("benchmarks"));
    if quick {
        cmd.arg("--quick");
    }
    run::run(cmd.args(extra))
}
