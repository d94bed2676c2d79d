//! `cargo xtask build-ebpf`: builds the kernel crate `lb-ebpf/` for
//! bpfel-unknown-none, with Debian's rustc (prebuilt `core`) or a rustup
//! nightly with rust-src (`-Z build-std=core`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run::{self, which};
use crate::setup::{bpf_linker_install_hint, bpf_linker_version, find_bpf_linker};

const TARGET: &str = "bpfel-unknown-none";
const RUSTFLAGS: &str = "-C debuginfo=2 -C link-arg=--btf";
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_CARGO: &str = "/usr/bin/cargo";
const DEBIAN_BPF_CORE: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
/// Set to `debian` or `upstream` to skip the detection and use that route.
const ROUTE_ENV: &str = "XTASK_EBPF_ROUTE";

#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    /// Debian's /usr/bin/cargo and /usr/bin/rustc with the packaged `core`.
    Debian,
    /// A rustup nightly toolchain (its exact name) with rust-src.
    Upstream(String),
}

/// What each route lacks on this machine (empty: usable).
#[derive(Debug)]
struct Probe {
    debian_missing: Vec<String>,
    upstream: std::result::Result<String, Vec<String>>,
}

fn probe() -> Probe {
    let mut debian_missing = Vec::new();
    for (path, package) in [
        (DEBIAN_RUSTC, "rustc-web"),
        (DEBIAN_CARGO, "cargo-web"),
        (DEBIAN_BPF_CORE, "libstd-rust-web-dev-bpf"),
    ] {
        if !Path::new(path).exists() {
            debian_missing.push(format!("{path} (Debian package {package})"));
        }
    }
    Probe {
        debian_missing,
        upstream: probe_upstream(),
    }
}

/// The rustup nightly toolchain to use, or what is missing for one.
fn probe_upstream() -> std::result::Result<String, Vec<String>> {
    if which("rustup").is_none() {
        return Err(vec!["rustup (not on PATH)".into()]);
    }
    let list = run::output(Command::new("rustup").args(["toolchain", "list"]))
        .map_err(|e| vec![format!("a working rustup ({e:#})")])?;
    let Some(toolchain) = pick_nightly(&list) else {
        return Err(vec!["a rustup nightly toolchain".into()]);
    };
    let sysroot = run::output(
        Command::new("rustup").args(["run", &toolchain, "rustc", "--print", "sysroot"]),
    )
    .map_err(|e| vec![format!("a working rustc in {toolchain} ({e:#})")])?;
    let src = Path::new(sysroot.trim()).join("lib/rustlib/src/rust");
    if !src.is_dir() {
        return Err(vec![format!(
            "the rust-src component of {toolchain} ({} does not exist)",
            src.display()
        )]);
    }
    Ok(toolchain)
}

/// The nightly in `rustup toolchain list` output: plain `nightly-<host>` if
/// there is one, else the first dated nightly.
fn pick_nightly(list: &str) -> Option<String> {
    let names: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("nightly"))
        .collect();
    let undated = names.iter().find(|n| {
        n.strip_prefix("nightly")
            .is_some_and(|rest| !rest.chars().nth(1).is_some_and(|c| c.is_ascii_digit()))
    });
    undated.or(names.first()).map(|n| n.to_string())
}

fn choose(probe: &Probe, forced: Option<&str>) -> Result<Route> {
    let debian = || {
        if probe.debian_missing.is_empty() {
            Ok(Route::Debian)
        } else {
            bail!(
                "{ROUTE_ENV}=debian, but this is missing: {}; run `cargo xtask setup` as root",
                probe.debian_missing.join(", ")
            )
        }
    };
    let upstream = || match &probe.upstream {
        Ok(t) => Ok(Route::Upstream(t.clone())),
        Err(missing) => bail!(
            "{ROUTE_ENV}=upstream, but this is missing: {}; run \
             `rustup toolchain install nightly --component rust-src`",
            missing.join(", ")
        ),
    };
    match forced {
        Some("debian") => return debian(),
        Some("upstream") => return upstream(),
        Some(other) if !other.is_empty() && other != "auto" => {
            bail!("{ROUTE_ENV}={other}: expected debian, upstream or auto")
        }
        _ => {}
    }
    if probe.debian_missing.is_empty() {
        return Ok(Route::Debian);
    }
    if let Ok(t) = &probe.upstream {
        return Ok(Route::Upstream(t.clone()));
    }
    let upstream_missing = probe.upstream.as_ref().err().cloned().unwrap_or_default();
    bail!(
        "no Rust compiler here can build the eBPF crate for {TARGET}.\n\
         Debian route: missing {}.\n\
         Upstream route: missing {}.\n\
         Fix either one:\n  \
         - on Debian 12, as root: `cargo xtask setup` (installs rustc-web, cargo-web, \
         libstd-rust-web-dev-bpf, LLVM 22 and bpf-linker)\n  \
         - elsewhere: `rustup toolchain install nightly --component rust-src`\n\
         Both routes also need bpf-linker {} built for the compiler's LLVM major; for LLVM 22 (Debian 12):\n  {}",
        probe.debian_missing.join(", "),
        upstream_missing.join(", "),
        crate::setup::BPF_LINKER_VERSION,
        bpf_linker_install_hint()
    )
}

/// Builds lb-ebpf and returns the absolute path of the object.
pub fn build(workspace: &Path, debug: bool) -> Result<PathBuf> {
    let forced = std::env::var(ROUTE_ENV).ok();
    let route = choose(&probe(), forced.as_deref())?;
    match &route {
        Route::Debian => {
            let version = run::output(Command::new(DEBIAN_RUSTC).arg("--version"))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|_| "unknown version".into());
            println!(
                "eBPF build route: Debian ({DEBIAN_CARGO}, {version}, prebuilt core in {DEBIAN_BPF_CORE})"
            );
        }
        Route::Upstream(t) => {
            println!("eBPF build route: upstream (rustup {t} with rust-src, -Z build-std=core)")
        }
    }

    let linker = find_bpf_linker().with_context(|| {
        format!(
            "bpf-linker is not on PATH nor in ~/.cargo/bin; the eBPF crate links with it.\n\
             On Debian 12 run `cargo xtask setup` as root, or install it yourself:\n  {}",
            bpf_linker_install_hint()
        )
    })?;
    let linker_dir = linker.parent().unwrap_or(Path::new("/")).to_path_buf();
    println!(
        "bpf-linker: {} ({})",
        linker.display(),
        bpf_linker_version(&linker).unwrap_or_else(|| "unknown version".into())
    );

    let crate_dir = workspace.join("lb-ebpf");
    if !crate_dir.join("Cargo.toml").is_file() {
        bail!(
            "{} does not exist: the kernel crate is not there yet",
            crate_dir.join("Cargo.toml").display()
        );
    }

    let mut cmd = route_cargo(&route, workspace, "build");
    cmd.current_dir(&crate_dir).env("RUSTFLAGS", RUSTFLAGS);
    if which("bpf-linker").is_none() {
        cmd.env("PATH", run::path_with(&[&linker_dir]));
    }
    if !debug {
        cmd.arg("--release");
    }
    cmd.args(["--target", TARGET]);
    run::run(&mut cmd)?;

    let profile = if debug { "debug" } else { "release" };
    let object = crate_dir
        .join("target")
        .join(TARGET)
        .join(profile)
        .join("lb-ebpf");
    let size = std::fs::metadata(&object)
        .with_context(|| format!("the build succeeded but {} is missing", object.display()))?
        .len();
    println!("eBPF object: {} ({size} bytes)", object.display());
    Ok(object)
}

/// `cargo SUBCOMMAND` of the route's toolchain, for the eBPF crate.
fn route_cargo(route: &Route, workspace: &Path, subcommand: &str) -> Command {
    match route {
        Route::Debian => {
            let mut cmd = Command::new(DEBIAN_CARGO);
            run::scrub_cargo_env(&mut cmd, workspace);
            cmd.env("RUSTC_BOOTSTRAP", "1").env("RUSTC", DEBIAN_RUSTC);
            if subcommand == "clippy" {
                // Debian's cargo-clippy (rust-web-clippy) matches its rustc and
                // knows the prebuilt core; rustup's proxy earlier on PATH would not.
                cmd.env("PATH", run::path_with(&[Path::new("/usr/bin")]));
            }
            cmd.arg(subcommand);
            cmd
        }
        Route::Upstream(toolchain) => {
            // `rustup run` rather than `cargo +nightly`: it works even when the
            // cargo on PATH is not rustup's proxy.
            let mut cmd = Command::new("rustup");
            run::scrub_cargo_env(&mut cmd, workspace);
            cmd.args([
                "run",
                toolchain,
                "cargo",
                subcommand,
                "-Z",
                "build-std=core",
            ]);
            cmd
        }
    }
}

/// `cargo clippy -D warnings` on the eBPF crate, with the compiler that builds it.
pub fn clippy(workspace: &Path) -> Result<()> {
    let forced = std::env::var(ROUTE_ENV).ok();
    let route = choose(&probe(), forced.as_deref())?;
    let mut cmd = route_cargo(&route, workspace, "clippy");
    cmd.current_dir(workspace.join("lb-ebpf")).args([
        "--release",
        "--target",
        TARGET,
        "--",
        "-D",
        "warnings",
    ]);
    run::run(&mut cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(debian_missing: &[&str], upstream: std::result::Result<&str, &[&str]>) -> Probe {
        Probe {
            debian_missing: debian_missing.iter().map(|s| s.to_string()).collect(),
            upstream: upstream
                .map(str::to_string)
                .map_err(|m| m.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn prefers_debian_then_upstream() {
        let both = probe(&[], Ok("nightly-x86_64-unknown-linux-gnu"));
        assert_eq!(choose(&both, None).unwrap(), Route::Debian);
        let only_up = probe(&["/usr/bin/rustc"], Ok("nightly"));
        assert_eq!(
            choose(&only_up, None).unwrap(),
            Route::Upstream("nightly".into())
        );
        assert_eq!(
            choose(&both, Some("upstream")).unwrap(),
            Route::Upstream("nightly-x86_64-unknown-linux-gnu".into())
        );
    }

    #[test]
    fn neither_route_names_what_is_missing_and_both_fixes() {
        let none = probe(
            &["/usr/bin/rustc (Debian package rustc-web)"],
            Err(&["the rust-src component of nightly"]),
        );
        let msg = format!("{:#}", choose(&none, None).unwrap_err());
        for needle in [
            "/usr/bin/rustc",
            "rust-src component of nightly",
            "cargo xtask setup",
            "rustup toolchain install nightly --component rust-src",
            "bpf-linker",
        ] {
            assert!(msg.contains(needle), "{needle:?} not in {msg}");
        }
    }

    #[test]
    fn forced_route_that_is_missing_fails() {
        let only_debian = probe(&[], Err(&["a rustup nightly toolchain"]));
        let msg = format!("{:#}", choose(&only_debian, Some("upstream")).unwrap_err());
        assert!(msg.contains("a rustup nightly toolchain"), "{msg}");
        assert!(choose(&only_debian, Some("bogus")).is_err());
    }

    #[test]
    fn picks_the_undated_nightly() {
        let list = "stable-x86_64-unknown-linux-gnu (active, default)\n\
                    nightly-2026-05-01-x86_64-unknown-linux-gnu\n\
                    nightly-x86_64-unknown-linux-gnu\n";
        assert_eq!(
            pick_nightly(list).as_deref(),
            Some("nightly-x86_64-unknown-linux-gnu")
        );
        let dated = "nightly-2026-05-01-x86_64-unknown-linux-gnu\n";
        assert_eq!(
            pick_nightly(dated).as_deref(),
            Some("nightly-2026-05-01-x86_64-unknown-linux-gnu")
        );
        assert_eq!(pick_nightly("stable-x86_64-unknown-linux-gnu\n"), None);
    }
}
