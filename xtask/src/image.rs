//! `cargo xtask image`: the agent's container image, built on this machine without a
//! container registry.
//!
//! - The base is Debian 12 made from Debian's packages by mmdebstrap: bpftool and
//!   iproute2 (what `kubectl exec` users reach for on a node) with the libraries they
//!   and `lb` link against, nothing else (no shell, no package manager; the
//!   packages are extracted, not configured). Documentation and translations are
//!   left out.
//! - On top, `lb` (a release build with the eBPF object embedded, symbols stripped)
//!   as `/usr/local/bin/lb`, the entry point.
//! - buildah assembles the two layers in a storage of its own under
//!   `target/image/` (the machine's own images are never touched) and writes
//!   `target/image/lb-image.tar`, an OCI archive tagged `lb:<workspace version>`.
//!   Beside the OCI index it carries a `manifest.json` naming the same blobs, as
//!   `docker save` of Docker 25 writes it, for `docker load -i`, which reads that
//!   file (there is no docker on the project's machines to try it with).
//! - Both readings are checked before the command succeeds: the archive is loaded
//!   as an OCI archive (`podman load`) and, separately, read as a docker archive
//!   (`podman pull docker-archive:`, containers/image's reader of what `docker
//!   save` writes), into a scratch storage, and must give the same image under the
//!   expected name.
//!
//! deploy/Containerfile describes the same image for those who build with a registry.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::run::{self, is_root, which};
use crate::tasks::{target_dir, workspace_cargo};
use crate::{ebpf, setup};

/// The archive's file name, in `target/image/`.
pub const ARCHIVE: &str = "lb-image.tar";
/// The image's name; its tag is the workspace version.
const NAME: &str = "lb";
/// The workspace version (xtask shares it).
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The Debian release of the base: the one `cargo xtask setup` builds `lb` on, so the
/// binary finds the glibc it was linked against.
const SUITE: &str = "bookworm";
/// Debian packages of the base; apt adds their dependencies (libc6 among them).
/// libgcc-s1 is `lb`'s own (unwinding).
const BASE_PACKAGES: &[&str] = &["bpftool", "iproute2", "libgcc-s1"];
/// Paths of the base nobody reads in a container, removed before it is packed.
/// (apt's own directories stay: mmdebstrap still works in them after the hooks, and
/// empties its lists and cache itself.)
const PRUNED: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bash-completion",
];
/// The image's PATH: Debian's, so `kubectl exec POD -- lb services` and
/// `-- bpftool ...` work by name.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The host's Debian sources, in the order apt itself prefers them; the first that
/// exists is handed to mmdebstrap, so the base comes from the mirror (or proxy) this
/// machine is configured for.
const HOST_SOURCES: &[&str] = &[
    "/etc/apt/sources.list.d/debian.sources",
    "/etc/apt/sources.list",
];

pub fn image(workspace: &Path) -> Result<()> {
    setup::setup(workspace)?;
    let object = ebpf::build(workspace, false)?;
    build(workspace, &object).map(drop)
}

/// The image's reference as podman names a loaded short name (`localhost/lb:0.1.0`).
pub fn local_reference() -> String {
    format!("localhost/{NAME}:{VERSION}")
}

/// Builds the image with `lb` built from `object`; returns the archive.
pub fn build(workspace: &Path, object: &Path) -> Result<PathBuf> {
    if !is_root() {
        bail!(
            "building the image needs root (mmdebstrap extracts Debian packages as root, \
             buildah writes image layers): run `cargo xtask image` as root"
        );
    }
    for tool in ["mmdebstrap", "buildah", "podman", "tar", "strip"] {
        which(tool).with_context(|| {
            format!(
                "`{tool}` is not on PATH: `cargo xtask setup` installs what the image build needs"
            )
        })?;
    }
    let dir = target_dir(workspace).join("image");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let epoch = source_date_epoch(workspace);
    let lb = build_lb(workspace, object, &dir)?;
    let base = base_layer(&dir, epoch)?;

    let store = Store::create(&dir.join("build-storage"))?;
    let reference = local_reference();
    assemble(&store, &base, &lb, &reference, epoch)?;
    let archive = dir.join(ARCHIVE);
    let partial = dir.join(format!("{ARCHIVE}.partial"));
    remove_if_present(&partial)?;
    run::run(
        store
            .buildah()
            .args(["push", "--quiet", &reference])
            .arg(format!(
                "oci-archive:{}:{NAME}:{VERSION}",
                partial.display()
            )),
    )?;
    drop(store);
    let manifest = add_docker_manifest(&partial, &dir)?;
    fs::rename(&partial, &archive)
        .with_context(|| format!("renaming {} to {}", partial.display(), archive.display()))?;

    let uncompressed = check_archive(&archive, &dir)?;
    let compressed: u64 = manifest.layers.iter().map(|l| l.size).sum();
    let file = fs::metadata(&archive)?.len();
    println!(
        "image {NAME}:{VERSION}: {} ({}, layers {} compressed, {} unpacked)",
        archive.display(),
        mib(file),
        mib(compressed),
        mib(uncompressed)
    );
    println!("  podman load -i {}", archive.display());
    println!("  docker load -i {}", archive.display());
    Ok(archive)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Seconds since the epoch that stand for this build: `SOURCE_DATE_EPOCH` if set,
/// else the time of the commit checked out, else 0. The image's creation time and
/// the base's file times come from it, not from the clock, so two builds of one
/// commit from the same packages give the same image.
fn source_date_epoch(workspace: &Path) -> u64 {
    if let Some(epoch) = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        return epoch;
    }
    run::output(
        Command::new("git")
            .current_dir(workspace)
            .args(["log", "-1", "--format=%ct"]),
    )
    .ok()
    .and_then(|s| s.trim().parse().ok())
    .unwrap_or(0)
}

/// `lb`, a release build with `object` embedded, stripped into `dir/lb`.
fn build_lb(workspace: &Path, object: &Path, dir: &Path) -> Result<PathBuf> {
    run::run(workspace_cargo(workspace, object).args([
        "build",
        "--release",
        "-p",
        "lb-userspace",
        "--bin",
        "lb",
    ]))?;
    let built = target_dir(workspace).join("release").join("lb");
    let stripped = dir.join("lb");
    run::run(Command::new("strip").arg("-o").arg(&stripped).arg(&built))?;
    Ok(stripped)
}

/// The mmdebstrap command that makes the base into `target`.
fn mmdebstrap(target: &Path, sources: Option<&Path>, epoch: u64) -> Command {
    let prune = PRUNED
        .iter()
        .map(|p| format!("\"$1\"/{p}"))
        .collect::<Vec<_>>()
        .join(" ");
    let mut cmd = Command::new("mmdebstrap");
    // The extract variant runs no package scripts and no customize hooks: the
    // extract hooks are where the tree is finished.
    cmd.env("SOURCE_DATE_EPOCH", epoch.to_string())
        .args(["--mode=root", "--variant=extract", "--format=tar"])
        .arg(format!("--include={}", BASE_PACKAGES.join(",")))
        .arg(format!("--extract-hook=rm -rf {prune}"))
        // Directories every container runtime mounts over, and Debian's /var/run.
        .arg(
            "--extract-hook=mkdir -p \"$1\"/proc \"$1\"/sys \"$1\"/dev \"$1\"/run \
             \"$1\"/tmp \"$1\"/var && ln -sfn /run \"$1\"/var/run",
        )
        // The dynamic loader's cache, which no package script wrote (none ran).
        .arg("--extract-hook=ldconfig -r \"$1\"")
        .arg(SUITE)
        .arg(target);
    if let Some(sources) = sources {
        cmd.arg(sources);
    }
    cmd
}

/// What the base is made of, written beside it: the command line and the sources it
/// reads. A base made otherwise is made again.
fn base_recipe(cmd: &Command, sources: Option<&Path>) -> String {
    let sources_text = sources
        .and_then(|p| fs::read_to_string(p).ok())
        .unwrap_or_default();
    format!("{}\n{sources_text}", run::display(cmd))
}

/// The base layer, `dir/base.tar`, made by mmdebstrap unless the one there was made
/// by the same recipe.
fn base_layer(dir: &Path, epoch: u64) -> Result<PathBuf> {
    let base = dir.join("base.tar");
    let stamp = dir.join("base.recipe");
    let partial = dir.join("base.tar.partial");
    let sources = HOST_SOURCES.iter().map(Path::new).find(|p| p.is_file());
    let mut cmd = mmdebstrap(&partial, sources, epoch);
    // The date is left out: a later commit does not need a new base.
    let recipe = base_recipe(&mmdebstrap(&partial, sources, 0), sources);
    if base.is_file() && fs::read_to_string(&stamp).ok().as_deref() == Some(recipe.as_str()) {
        println!("ok image base ({}, same recipe)", base.display());
        return Ok(base);
    }
    remove_if_present(&partial)?;
    run::run(&mut cmd)?;
    fs::rename(&partial, &base)?;
    fs::write(&stamp, recipe).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(base)
}

/// The base layer, then `lb` in a layer of its own (a new lb is a small layer on a
/// base users already have), with the entry point and labels.
fn assemble(store: &Store, base: &Path, lb: &Path, reference: &str, epoch: u64) -> Result<()> {
    let timestamp = epoch.to_string();
    let base_ref = format!("localhost/{NAME}-base:{VERSION}");
    let working = run::output(store.buildah().args(["from", "--quiet", "scratch"]))?;
    let working = working.trim();
    run::run(
        store
            .buildah()
            .args(["add", "--quiet", working])
            .arg(base)
            .arg("/"),
    )?;
    run::run(store.buildah().args([
        "commit",
        "--quiet",
        "--format",
        "oci",
        "--timestamp",
        &timestamp,
        "--rm",
        working,
        &base_ref,
    ]))?;
    let working = run::output(store.buildah().args(["from", "--quiet", &base_ref]))?;
    let working = working.trim();
    run::run(
        store
            .buildah()
            .args(["copy", "--quiet", "--chmod", "0755", working])
            .arg(lb)
            .arg("/usr/local/bin/lb"),
    )?;
    run::run(store.buildah().args([
        "config",
        "--entrypoint",
        r#"["/usr/local/bin/lb"]"#,
        "--cmd",
        "",
        "--env",
        &format!("PATH={PATH}"),
        "--workingdir",
        "/",
        "--label",
        "org.opencontainers.image.title=lb",
        "--label",
        "org.opencontainers.image.description=eBPF kube-proxy replacement: the lb agent (deploy/daemonset.yaml runs it)",
        "--label",
        &format!("org.opencontainers.image.version={VERSION}"),
        "--label",
        "org.opencontainers.image.licenses=Apache-2.0",
        working,
    ]))?;
    run::run(store.buildah().args([
        "commit",
        "--quiet",
        "--format",
        "oci",
        "--timestamp",
        &timestamp,
        "--rm",
        working,
        reference,
    ]))?;
    Ok(())
}

/// A layer of an image manifest.
struct Layer {
    digest: String,
    size: u64,
}

/// What the OCI archive's only image is made of.
struct OciManifest {
    config: String,
    layers: Vec<Layer>,
}

/// One member of a tar archive, read with tar(1).
fn tar_member(archive: &Path, member: &str) -> Result<Vec<u8>> {
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg(member)
        .output()
        .with_context(|| format!("running tar on {}", archive.display()))?;
    ensure!(
        out.status.success(),
        "cannot read {member} from {}: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(out.stdout)
}

/// `blobs/sha256/<hex>` for `sha256:<hex>`.
fn blob_path(digest: &str) -> Result<String> {
    let hex = digest
        .strip_prefix("sha256:")
        .with_context(|| format!("digest {digest} is not sha256"))?;
    ensure!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "digest {digest} is malformed"
    );
    Ok(format!("blobs/sha256/{hex}"))
}

/// The image manifest the OCI index names.
fn read_oci_manifest(archive: &Path) -> Result<OciManifest> {
    let index: Value = serde_json::from_slice(&tar_member(archive, "index.json")?)
        .context("index.json of the OCI archive")?;
    let manifests = index["manifests"]
        .as_array()
        .context("index.json has no manifests")?;
    ensure!(
        manifests.len() == 1,
        "the OCI archive holds {} images, not one",
        manifests.len()
    );
    let digest = manifests[0]["digest"]
        .as_str()
        .context("manifest without digest")?;
    let manifest: Value = serde_json::from_slice(&tar_member(archive, &blob_path(digest)?)?)
        .context("the image manifest")?;
    let config = manifest["config"]["digest"]
        .as_str()
        .context("image manifest without config")?
        .to_string();
    let layers = manifest["layers"]
        .as_array()
        .context("image manifest without layers")?
        .iter()
        .map(|l| {
            Ok(Layer {
                digest: l["digest"]
                    .as_str()
                    .context("layer without digest")?
                    .to_string(),
                size: l["size"].as_u64().context("layer without size")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(OciManifest { config, layers })
}

/// The `manifest.json` of a docker archive naming the OCI archive's blobs.
fn docker_manifest(manifest: &OciManifest) -> Result<String> {
    let layers = manifest
        .layers
        .iter()
        .map(|l| blob_path(&l.digest))
        .collect::<Result<Vec<_>>>()?;
    let docker = serde_json::json!([{
        "Config": blob_path(&manifest.config)?,
        "RepoTags": [format!("{NAME}:{VERSION}")],
        "Layers": layers,
    }]);
    Ok(docker.to_string())
}

/// Appends the docker `manifest.json` to the OCI archive; returns the OCI manifest.
fn add_docker_manifest(archive: &Path, dir: &Path) -> Result<OciManifest> {
    let manifest = read_oci_manifest(archive)?;
    let staging = dir.join("docker-manifest");
    remove_if_present(&staging)?;
    fs::create_dir_all(&staging)?;
    fs::write(staging.join("manifest.json"), docker_manifest(&manifest)?)?;
    run::run(
        Command::new("tar")
            .arg("--append")
            .arg("--file")
            .arg(archive)
            .arg("--owner=0")
            .arg("--group=0")
            .arg("--mtime=@0")
            .arg("-C")
            .arg(&staging)
            .arg("manifest.json"),
    )?;
    fs::remove_dir_all(&staging)?;
    Ok(manifest)
}

/// Loads `archive` as podman reads an OCI archive and, separately, as a docker
/// archive (the reader that mirrors `docker load`), into scratch storage: both must
/// give one image, the same, under the expected name. Its unpacked size.
fn check_archive(archive: &Path, dir: &Path) -> Result<u64> {
    let store = Store::create(&dir.join("check-storage"))?;
    let loaded = run::output(store.podman().arg("load").arg("--input").arg(archive))?;
    let reference = local_reference();
    ensure!(
        loaded.contains(&reference),
        "`podman load` of {} named the image otherwise: {loaded}",
        archive.display()
    );
    let inspect = |store: &Store| -> Result<(String, u64, String)> {
        let out = run::output(store.podman().args([
            "image",
            "inspect",
            "--format",
            "{{.Id}} {{.Size}} {{json .Config.Entrypoint}}",
            &reference,
        ]))?;
        let mut fields = out.split_whitespace();
        let id = fields.next().unwrap_or_default().to_string();
        let size = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let entrypoint = fields.collect::<Vec<_>>().join(" ");
        Ok((id, size, entrypoint))
    };
    let (oci_id, size, entrypoint) = inspect(&store)?;
    ensure!(
        entrypoint == r#"["/usr/local/bin/lb"]"#,
        "the loaded image's entry point is {entrypoint}"
    );
    run::run(store.podman().args(["rmi", "--force", &reference]))?;
    run::run(
        store
            .podman()
            .args(["pull", "--quiet"])
            .arg(format!("docker-archive:{}", archive.display())),
    )?;
    let (docker_id, _, _) = inspect(&store)?;
    ensure!(
        docker_id == oci_id,
        "the archive's docker manifest gives image {docker_id}, its OCI index {oci_id}"
    );
    Ok(size)
}

/// A containers-storage of its own (vfs: plain directories, no mounts left behind),
/// removed on drop; buildah and podman are pointed at it through their configuration
/// variables, so nothing of the machine's configuration or images is used.
struct Store {
    dir: PathBuf,
}

impl Store {
    fn create(dir: &Path) -> Result<Self> {
        remove_if_present(dir)?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let store = Store {
            dir: dir.to_path_buf(),
        };
        fs::write(
            store.storage_conf(),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = \"{0}/root\"\nrunroot = \"{0}/run\"\n",
                dir.display()
            ),
        )?;
        // No registry is consulted for a short name, and libpod's state lives here.
        fs::write(
            store.dir.join("registries.conf"),
            "unqualified-search-registries = []\n",
        )?;
        fs::write(
            store.dir.join("containers.conf"),
            format!(
                "[engine]\nevents_logger = \"none\"\nlock_type = \"file\"\ntmp_dir = \"{0}/tmp\"\n\
                 static_dir = \"{0}/root/libpod\"\nvolume_path = \"{0}/root/volumes\"\n",
                dir.display()
            ),
        )?;
        Ok(store)
    }

    fn storage_conf(&self) -> PathBuf {
        self.dir.join("storage.conf")
    }

    fn configured(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("CONTAINERS_STORAGE_CONF", self.storage_conf())
            .env(
                "CONTAINERS_REGISTRIES_CONF",
                self.dir.join("registries.conf"),
            )
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"));
        cmd
    }

    fn buildah(&self) -> Command {
        self.configured("buildah")
    }

    fn podman(&self) -> Command {
        self.configured("podman")
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("warning: cannot remove {}: {e}", self.dir.display());
        }
    }
}

fn remove_if_present(path: &Path) -> Result<()> {
    let result = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    result.with_context(|| format!("removing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(hex: char, size: u64) -> Layer {
        Layer {
            digest: format!("sha256:{}", hex.to_string().repeat(64)),
            size,
        }
    }

    #[test]
    fn docker_manifest_names_the_oci_blobs_and_the_tag() {
        let manifest = OciManifest {
            config: format!("sha256:{}", "c".repeat(64)),
            layers: vec![layer('a', 1), layer('b', 2)],
        };
        let text = docker_manifest(&manifest).unwrap();
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            value,
            serde_json::json!([{
                "Config": format!("blobs/sha256/{}", "c".repeat(64)),
                "RepoTags": [format!("lb:{VERSION}")],
                "Layers": [
                    format!("blobs/sha256/{}", "a".repeat(64)),
                    format!("blobs/sha256/{}", "b".repeat(64)),
                ],
            }])
        );
    }

    #[test]
    fn only_well_formed_sha256_digests_become_paths() {
        assert!(blob_path("sha512:abc").is_err());
        assert!(blob_path("sha256:../../etc/passwd").is_err());
        assert!(blob_path(&format!("sha256:{}", "0".repeat(64))).is_ok());
    }

    #[test]
    fn the_recipe_changes_with_what_the_base_is_made_of() {
        let target = Path::new("/tmp/base.tar");
        let default = base_recipe(&mmdebstrap(target, None, 0), None);
        assert!(default.contains("--include=bpftool,iproute2"), "{default}");
        assert!(default.contains("--extract-hook=rm -rf"), "{default}");
        let dir = std::env::temp_dir().join(format!("xtask-recipe-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let sources = dir.join("debian.sources");
        fs::write(&sources, "URIs: http://mirror.example/debian\n").unwrap();
        let with_sources = base_recipe(&mmdebstrap(target, Some(&sources), 0), Some(&sources));
        fs::remove_dir_all(&dir).unwrap();
        assert_ne!(default, with_sources);
        assert!(with_sources.contains("mirror.example"));
    }
}
