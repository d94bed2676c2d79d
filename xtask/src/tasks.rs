//! `cargo xtask test` and `cargo xtask demo`: the eBPF object first, then the
//! workspace built with it embedded (and, for the tests, the agent's image).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::run::{self, is_root};
use crate::{ebpf, setup};

/// The variable through which the userspace build finds the eBPF object.
const OBJECT_ENV: &str = "LB_EBPF_OBJECT";

/// The cargo that runs xtask (same toolchain for the workspace), or `cargo`.
pub(crate) fn workspace_cargo(workspace: &Path, object: &Path) -> Command {
    let program = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(program);
    cmd.current_dir(workspace).env(OBJECT_ENV, object);
    cmd
}

/// Where the workspace's binaries go.
pub(crate) fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace.join(dir),
        None => workspace.join("target"),
    }
}

/// `cargo test` arguments from what followed `cargo xtask test --`: given
/// as-is when they contain their own `--` (`-p lb-tests -- --nocapture`),
/// otherwise handed to the test binaries (`--nocapture`, a name filter).
fn cargo_test_args(extra: &[String]) -> Vec<String> {
    let mut args = vec!["test".to_string(), "--workspace".to_string()];
    if extra.iter().any(|a| a == "--") {
        args.extend(extra.iter().cloned());
    } else if !extra.is_empty() {
        args.push("--".into());
        args.extend(extra.iter().cloned());
    }
    args
}

/// What a whole `cargo xtask test` may take, set-up included; the project keeps
/// CI under 40 minutes (it gives 90), so a hang ends here with a report.
/// `XTASK_TEST_BUDGET_SECS` overrides it.
const TEST_BUDGET: Duration = Duration::from_secs(40 * 60);

pub fn test(workspace: &Path, extra: &[String]) -> Result<()> {
    let budget = std::env::var("XTASK_TEST_BUDGET_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(TEST_BUDGET, Duration::from_secs);
    crate::watchdog::arm("test", budget);
    let start = Instant::now();
    let result = test_steps(workspace, extra);
    println!(
        "xtask test: total wall time {}",
        format_duration(start.elapsed())
    );
    result
}

fn test_steps(workspace: &Path, extra: &[String]) -> Result<()> {
    setup::setup(workspace)?;
    let object = ebpf::build(workspace, false)?;
    if !is_root() {
        println!(
            "warning: not running as root: the end-to-end tests (BPF programs, cgroups, \
             network namespaces) will be skipped, and the image is not built"
        );
    }
    lint(workspace, &object)?;
    run::run(workspace_cargo(workspace, &object).args(["build", "--workspace", "--all-targets"]))?;
    // tests/tests/image.rs runs the image users deploy; it is built from this tree.
    if is_root() {
        crate::image::build(workspace, &object)?;
    }
    run::run(workspace_cargo(workspace, &object).args(cargo_test_args(extra)))?;
    crate::validate::validate_manifests(workspace)?;
    Ok(())
}

/// Formatting and clippy (warnings are errors) for the workspace and the eBPF crate,
/// before any test runs: CI fails on a lint as it does on a test.
fn lint(workspace: &Path, object: &Path) -> Result<()> {
    run::run(workspace_cargo(workspace, object).args(["fmt", "--all", "--", "--check"]))?;
    run::run(workspace_cargo(workspace, object).args([
        "fmt",
        "--manifest-path",
        "lb-ebpf/Cargo.toml",
        "--",
        "--check",
    ]))?;
    run::run(workspace_cargo(workspace, object).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    ebpf::clippy(workspace)
}

pub fn demo(workspace: &Path) -> Result<()> {
    setup::setup(workspace)?;
    let object = ebpf::build(workspace, false)?;
    run::run(workspace_cargo(workspace, &object).args(["build", "--workspace", "--bins"]))?;
    let bin = target_dir(workspace).join("debug");
    let demo = bin.join("lb-demo");
    let lb = bin.join("lb");
    if !demo.is_file() {
        bail!(
            "{} does not exist: the lb-tests crate (tests/) has no `lb-demo` binary yet",
            demo.display()
        );
    }
    if !lb.is_file() {
        bail!(
            "{} does not exist: the `lb` binary was not built",
            lb.display()
        );
    }
    if !is_root() {
        println!("warning: the demo needs root (network namespaces, cgroups, BPF)");
    }
    run::run(
        Command::new(&demo)
            .current_dir(workspace)
            .arg("--lb")
            .arg(&lb)
            .arg("--examples")
            .arg(workspace.join("examples")),
    )
}

fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn extra_args_go_to_test_binaries_unless_split_by_the_user() {
        assert_eq!(cargo_test_args(&[]), strings(&["test", "--workspace"]));
        assert_eq!(
            cargo_test_args(&strings(&["--nocapture"])),
            strings(&["test", "--workspace", "--", "--nocapture"])
        );
        assert_eq!(
            cargo_test_args(&strings(&["-p", "lb-tests", "--", "--nocapture"])),
            strings(&["test", "--workspace", "-p", "lb-tests", "--", "--nocapture"])
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(Duration::from_millis(4200)), "4.2s");
        assert_eq!(format_duration(Duration::from_secs(185)), "3m05s");
    }
}
