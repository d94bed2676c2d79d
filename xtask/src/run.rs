//! Running other programs: every command line is echoed before it runs, and a
//! failure names the command and how it ended.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The command as a person would type it, with the variables it sets and the
/// directory it runs in.
pub fn display(cmd: &Command) -> String {
    let mut parts = Vec::new();
    if let Some(dir) = cmd.get_current_dir() {
        parts.push(format!("(cd {} &&", dir.display()));
    }
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            parts.push(format!(
                "{}={}",
                key.to_string_lossy(),
                quote(&value.to_string_lossy())
            ));
        }
    }
    parts.push(quote(&cmd.get_program().to_string_lossy()));
    parts.extend(cmd.get_args().map(|a| quote(&a.to_string_lossy())));
    let mut line = parts.join(" ");
    if cmd.get_current_dir().is_some() {
        line.push(')');
    }
    line
}

fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=+,@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` with inherited stdin/stdout/stderr; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    eprintln!("+ {shown}");
    let start = std::time::Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    // Where a run's time goes, readable from a CI log.
    eprintln!(
        "+ ({:.1} s) {}",
        start.elapsed().as_secs_f64(),
        cmd.get_program().to_string_lossy()
    );
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout; fails (quoting its stderr)
/// unless it exits 0.
pub fn output(cmd: &mut Command) -> Result<String> {
    let shown = display(cmd);
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// True when this process runs with effective uid 0.
pub fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

/// The first executable file called `name` in the directories of PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `$CARGO_HOME/bin`, or `~/.cargo/bin`: where `cargo install` puts programs.
pub fn cargo_bin_dir() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        return Some(PathBuf::from(home).join("bin"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo").join("bin"))
}

/// Variables kept although they start with `CARGO_`: the user's own settings
/// for where cargo lives and how it reaches registries.
const KEEP_EXACT: &[&str] = &["CARGO_HOME"];
const KEEP_PREFIXES: &[&str] = &[
    "CARGO_NET_",
    "CARGO_HTTP_",
    "CARGO_REGISTRY_",
    "CARGO_REGISTRIES_",
    "CARGO_TERM_",
];
/// Variables that steer which compiler runs and how; the outer `cargo run`
/// (and rustup's proxy) set some of these for the toolchain of the workspace.
const DROP_EXACT: &[&str] = &[
    "CARGO",
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTC_BOOTSTRAP",
    "RUSTC_LINKER",
    "RUSTDOC",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "RUSTUP_TOOLCHAIN",
    "RUSTUP_TOOLCHAIN_SOURCE",
    "RUST_RECURSION_COUNT",
];

fn scrubbed(key: &str) -> bool {
    if KEEP_EXACT.contains(&key) || KEEP_PREFIXES.iter().any(|p| key.starts_with(p)) {
        return false;
    }
    DROP_EXACT.contains(&key) || key.starts_with("CARGO_") || key.starts_with("__CARGO")
}

/// Removes from `cmd` what the outer `cargo run` of xtask put in the
/// environment (CARGO_*, RUSTUP_TOOLCHAIN, RUSTFLAGS, RUSTC, wrappers, ...),
/// so that a separate cargo build starts from the user's own settings only.
/// LD_LIBRARY_PATH loses the entries cargo added for the workspace toolchain.
pub fn scrub_cargo_env(cmd: &mut Command, workspace: &Path) {
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(scrubbed) {
            cmd.env_remove(&key);
        }
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        let mut added_by_cargo = vec![workspace.join("target")];
        added_by_cargo.extend(std::env::var_os("CARGO_TARGET_DIR").map(|d| workspace.join(d)));
        added_by_cargo.extend(std::env::var_os("RUSTUP_HOME").map(PathBuf::from));
        let kept: Vec<PathBuf> = std::env::split_paths(&paths)
            .filter(|p| {
                !added_by_cargo.iter().any(|d| p.starts_with(d))
                    && !p.to_string_lossy().contains("/.rustup/")
            })
            .collect();
        if kept.is_empty() {
            cmd.env_remove("LD_LIBRARY_PATH");
        } else if let Ok(joined) = std::env::join_paths(&kept) {
            cmd.env("LD_LIBRARY_PATH", joined);
        }
    }
}

/// PATH with `dirs` put in front.
pub fn path_with(dirs: &[&Path]) -> OsString {
    let old = std::env::var_os("PATH").unwrap_or_default();
    let mut all: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
    all.extend(std::env::split_paths(&old));
    std::env::join_paths(all).unwrap_or(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubs_outer_build_vars_but_keeps_user_settings() {
        for key in [
            "CARGO",
            "CARGO_TARGET_DIR",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "CARGO_MAKEFLAGS",
            "CARGO_PKG_NAME",
            "CARGO_MANIFEST_DIR",
            "RUSTFLAGS",
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTUP_TOOLCHAIN",
            "__CARGO_FIX_PLZ",
        ] {
            assert!(scrubbed(key), "{key} should be removed");
        }
        for key in [
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "CARGO_HTTP_CAINFO",
            "CARGO_TERM_COLOR",
            "PATH",
            "HOME",
            "RUSTUP_HOME",
        ] {
            assert!(!scrubbed(key), "{key} should be kept");
        }
    }

    #[test]
    fn display_quotes_and_shows_env() {
        let mut cmd = Command::new("cargo");
        cmd.args(["build", "--target", "bpfel-unknown-none"])
            .env("RUSTFLAGS", "-C debuginfo=2")
            .env_remove("RUSTC");
        assert_eq!(
            display(&cmd),
            "RUSTFLAGS='-C debuginfo=2' cargo build --target bpfel-unknown-none"
        );
    }
}
