//! `cargo xtask setup`: installs what a fresh Debian 12 machine lacks to build
//! and run the project, and mounts bpffs. Safe to run again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run::{self, cargo_bin_dir, is_executable, is_root, which};

/// Debian 12 packages: a rustc (LLVM 22) with `core` prebuilt for
/// bpfel-unknown-none, what bpf-linker links against, and the tools the
/// tests use.
pub const PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    // clippy for that rustc, so the eBPF crate is linted by the compiler that builds it.
    "rust-web-clippy",
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "bpftool",
    "iproute2",
    // The XDP tests turn off transmit checksum offload on the veths that send to an
    // XDP program (a veth hands over partial checksums, which XDP cannot see).
    "ethtool",
    // The masquerade tests ping the outside host from pods, as a user would.
    "iputils-ping",
];

/// What `cargo xtask image` and the image's end-to-end test (tests/tests/image.rs) use:
/// the OCI runtime podman runs containers with (runc: crun refuses hybrid cgroup
/// layouts), podman itself, buildah (assembles the image), mmdebstrap (the image's
/// Debian base, made from Debian's packages, no registry) and gpg (mmdebstrap reads
/// the archive keys' signed-by with it). Installed without their recommends, which
/// are for rootless use (slirp4netns, fuse-overlayfs, a D-Bus user session) and
/// checkpointing (criu). runc comes first so that podman's `crun | runc` takes it.
pub const CONTAINER_PACKAGES: &[&str] = &["runc", "podman", "buildah", "mmdebstrap", "gpg"];

/// What `cargo xtask bench` needs on top: kube-proxy's iptables and nftables modes
/// are measured beside ours (iptables-restore on the nf_tables backend, nft).
pub const BENCH_PACKAGES: &[&str] = &["iptables", "nftables"];

pub const BPF_LINKER_VERSION: &str = "0.13.0";
const BPF_LINKER_SERIES: &str = "0.13.";
pub const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPFFS: &str = "/sys/fs/bpf";

/// The command line that installs bpf-linker, for messages.
pub fn bpf_linker_install_hint() -> String {
    format!(
        "PATH={LLVM_PREFIX}/bin:$PATH LLVM_PREFIX={LLVM_PREFIX} cargo install bpf-linker \
         --version {BPF_LINKER_VERSION} --locked --no-default-features --features llvm-22"
    )
}

fn apt_hint(packages: &[&str], recommends: Recommends) -> String {
    let skip = match recommends {
        Recommends::Install => "",
        Recommends::Skip => "--no-install-recommends ",
    };
    format!(
        "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y {skip}{}",
        packages.join(" ")
    )
}

pub fn setup(workspace: &Path) -> Result<()> {
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    if !is_debian_12(&os) || which("dpkg-query").is_none() {
        print_manual_steps(&os);
        return Ok(());
    }
    let root = is_root();
    packages(PACKAGES, root, Recommends::Install)?;
    packages(CONTAINER_PACKAGES, root, Recommends::Skip)?;
    bpf_linker(workspace)?;
    bpffs(root)?;
    Ok(())
}

fn os_field<'a>(os_release: &'a str, key: &str) -> Option<&'a str> {
    os_release.lines().find_map(|l| {
        l.strip_prefix(key)?
            .strip_prefix('=')
            .map(|v| v.trim().trim_matches('"'))
    })
}

fn is_debian_12(os_release: &str) -> bool {
    os_field(os_release, "ID") == Some("debian") && os_field(os_release, "VERSION_ID") == Some("12")
}

fn print_manual_steps(os_release: &str) {
    let name = os_field(os_release, "PRETTY_NAME").unwrap_or("an unknown system");
    println!("setup: this is {name}, not Debian 12; installing nothing. Install by hand:");
    println!("  - a Rust compiler that builds for bpfel-unknown-none, e.g.");
    println!("      rustup toolchain install nightly --component rust-src");
    println!("  - bpf-linker {BPF_LINKER_VERSION}, built with the feature llvm-NN matching the LLVM major");
    println!("    that `rustc +nightly -vV` reports, against that LLVM's development files, e.g.");
    println!("      cargo install bpf-linker --version {BPF_LINKER_VERSION} --locked --no-default-features --features llvm-22");
    println!("  - bpftool and iproute2 (the `ip` command)");
    println!(
        "  - for `cargo xtask image` and its test: {}",
        CONTAINER_PACKAGES.join(", ")
    );
    println!("  - bpffs, as root: mount -t bpf bpf {BPFFS}");
}

/// Installed versions of `names`, from dpkg's database.
fn installed_versions(names: &[&str]) -> Result<BTreeMap<String, String>> {
    // dpkg-query exits 1 when some name is unknown, but still lists the others.
    let out = Command::new("dpkg-query")
        .arg("-W")
        .arg("-f=${Package}\t${Status}\t${Version}\n")
        .args(names)
        .output()
        .context("could not run dpkg-query")?;
    let mut found = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut fields = line.split('\t');
        if let (Some(name), Some(status), Some(version)) =
            (fields.next(), fields.next(), fields.next())
        {
            if status == "install ok installed" {
                found.insert(name.to_string(), version.to_string());
            }
        }
    }
    Ok(found)
}

/// Installs the bench's extra packages (Debian 12 only; elsewhere they are named).
pub fn bench_packages() -> Result<()> {
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    if !is_debian_12(&os) || which("dpkg-query").is_none() {
        println!("setup: install by hand: {}", BENCH_PACKAGES.join(" "));
        return Ok(());
    }
    packages(BENCH_PACKAGES, is_root(), Recommends::Install)
}

/// Whether apt-get installs the packages' recommends too.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recommends {
    Install,
    Skip,
}

fn packages(wanted: &[&str], root: bool, recommends: Recommends) -> Result<()> {
    let installed = installed_versions(wanted)?;
    let mut missing = Vec::new();
    for name in wanted {
        match installed.get(*name) {
            Some(version) => println!("ok {name} ({version})"),
            None if root => println!("installing {name}"),
            None => println!("missing {name}"),
        }
        if !installed.contains_key(*name) {
            missing.push(*name);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    if !root {
        bail!(
            "setup must run as root to install {} Debian package(s); as root it would run:\n  {}\n\
             then build bpf-linker if needed:\n  {}\n\
             Run `cargo xtask setup` as root, or run those commands yourself.",
            missing.len(),
            apt_hint(&missing, recommends),
            bpf_linker_install_hint()
        );
    }
    // A mirror that stops answering fails the step in minutes, not the CI clock.
    const APT_NET: [&str; 4] = [
        "-o",
        "Acquire::http::Timeout=60",
        "-o",
        "Acquire::Retries=3",
    ];
    run::run(Command::new("apt-get").args(APT_NET).arg("update"))?;
    run::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(APT_NET)
            .args(["install", "-y"])
            .args((recommends == Recommends::Skip).then_some("--no-install-recommends"))
            .args(&missing),
    )?;
    let now = installed_versions(&missing)?;
    for name in &missing {
        match now.get(*name) {
            Some(version) => println!("ok {name} ({version})"),
            None => bail!("apt-get finished but {name} is still not installed"),
        }
    }
    Ok(())
}

/// Where bpf-linker is: on PATH, or in cargo's bin directory.
pub fn find_bpf_linker() -> Option<PathBuf> {
    which("bpf-linker").or_else(|| {
        cargo_bin_dir()
            .map(|d| d.join("bpf-linker"))
            .filter(|p| is_executable(p))
    })
}

/// The version `bpf-linker --version` reports ("bpf-linker 0.13.0").
pub fn bpf_linker_version(path: &Path) -> Option<String> {
    let out = Command::new(path).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .next()?
        .split_whitespace()
        .last()
        .map(str::to_string)
}

fn bpf_linker(workspace: &Path) -> Result<()> {
    let current = find_bpf_linker().map(|p| {
        let v = bpf_linker_version(&p);
        (p, v)
    });
    if let Some((path, Some(version))) = &current {
        if version.starts_with(BPF_LINKER_SERIES) {
            println!("ok bpf-linker ({version}, {})", path.display());
            return Ok(());
        }
        println!(
            "bpf-linker {version} at {} is not {BPF_LINKER_SERIES}x",
            path.display()
        );
    }
    println!(
        "installing bpf-linker {BPF_LINKER_VERSION} (built against LLVM 22; takes several minutes)"
    );
    let llvm_bin = Path::new(LLVM_PREFIX).join("bin");
    let mut cmd = Command::new("cargo");
    run::scrub_cargo_env(&mut cmd, workspace);
    cmd.current_dir(workspace)
        .env("PATH", run::path_with(&[&llvm_bin]))
        .env("LLVM_PREFIX", LLVM_PREFIX)
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args(["--locked", "--no-default-features", "--features", "llvm-22"]);
    if current.is_some() {
        cmd.arg("--force");
    }
    run::run(&mut cmd)?;
    let path = find_bpf_linker()
        .context("cargo install finished but bpf-linker is not on PATH nor in ~/.cargo/bin")?;
    let version = bpf_linker_version(&path).unwrap_or_else(|| "unknown version".into());
    println!("ok bpf-linker ({version}, {})", path.display());
    if which("bpf-linker").is_none() {
        println!(
            "note: {} is not on PATH; add it (export PATH=\"$HOME/.cargo/bin:$PATH\")",
            path.parent().unwrap_or(&path).display()
        );
    }
    Ok(())
}

pub fn bpffs_mounted() -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&BPFFS) && fields.get(2) == Some(&"bpf")
    })
}

fn bpffs(root: bool) -> Result<()> {
    if bpffs_mounted() {
        println!("ok bpffs ({BPFFS})");
        return Ok(());
    }
    if !root {
        println!(
            "warning: bpffs is not mounted at {BPFFS}; the end-to-end tests need it \
             (as root: mount -t bpf bpf {BPFFS})"
        );
        return Ok(());
    }
    println!("installing bpffs ({BPFFS})");
    std::fs::create_dir_all(BPFFS).with_context(|| format!("could not create {BPFFS}"))?;
    run::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    if !bpffs_mounted() {
        bail!("mount returned 0 but {BPFFS} is not a bpf mount in /proc/mounts");
    }
    println!("ok bpffs ({BPFFS})");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_debian_12_only() {
        let bookworm =
            "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nID=debian\nVERSION_ID=\"12\"\n";
        assert!(is_debian_12(bookworm));
        let trixie = "ID=debian\nVERSION_ID=\"13\"\n";
        assert!(!is_debian_12(trixie));
        let ubuntu = "ID=ubuntu\nID_LIKE=debian\nVERSION_ID=\"24.04\"\n";
        assert!(!is_debian_12(ubuntu));
        assert!(!is_debian_12(""));
    }
}
