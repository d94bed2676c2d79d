//! `cargo xtask validate-manifests`: every Kubernetes manifest under deploy/ and
//! examples/ is checked against the API's schemas by `kubernetes-validate` (PyPI),
//! strictly (unknown fields fail), for the oldest and the newest Kubernetes version
//! we claim. Then deliberately broken copies must be rejected, so that the step
//! cannot pass by checking nothing.
//!
//! The validator lives in a virtualenv under target/, installed with pinned
//! versions on first use and reused while the pins are unchanged. It has no schema
//! for `kind: List` (it only warns), so Lists are first expanded into their items
//! by a few lines of Python with the virtualenv's PyYAML, and the items validated.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run::{self, is_executable, is_root, which};

const VALIDATOR: &str = "kubernetes-validate";
/// Everything the validator's virtualenv holds, pinned: `pip freeze` of a fresh
/// install of kubernetes-validate 1.37.0 on Debian 12's Python 3.11.
const REQUIREMENTS: &[&str] = &[
    "kubernetes-validate==1.37.0",
    "attrs==26.1.0",
    "importlib_resources==7.1.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "packaging==26.3",
    "PyYAML==6.0.3",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "typing_extensions==4.16.0",
];
/// Checked against each: the oldest Kubernetes we support and the newest whose
/// schemas the pinned validator ships.
const KUBERNETES_VERSIONS: &[&str] = &["1.31.0", "1.37.0"];
/// Directories of manifests, relative to the workspace; files by extension.
const MANIFEST_DIRS: &[&str] = &["deploy", "examples"];
const MANIFEST_EXTENSIONS: &[&str] = &["yaml", "yml", "json"];
/// The manifest the broken copies are made from.
const BROKEN_SOURCE: &str = "deploy/daemonset.yaml";
/// kustomize's own file: no Kubernetes resource, so no schema; checked instead to
/// list every manifest beside it (a new one that is not listed is not applied by
/// `kubectl apply -k`).
const KUSTOMIZATION: &str = "deploy/kustomization.yaml";

/// Copies each file (relative to a source directory) to the same relative path in
/// a destination directory, with every `List` replaced by its items. Loads YAML as
/// the validator does (safe loader, `=` as a plain string); JSON is YAML.
const EXPAND_LISTS: &str = r#"import os, sys, yaml

yaml.SafeLoader.add_constructor(
    "tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node)
)


def expand(doc):
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
        for item in doc["items"]:
            yield from expand(item)
    elif doc:
        yield doc


src, dst = sys.argv[1], sys.argv[2]
for rel in sys.argv[3:]:
    with open(os.path.join(src, rel)) as f:
        try:
            docs = [d for doc in yaml.safe_load_all(f) for d in expand(doc)]
        except yaml.YAMLError as e:
            sys.exit("Couldn't parse YAML from file %s: %s" % (rel, e))
    out = os.path.join(dst, rel)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
"#;

pub fn validate_manifests(workspace: &Path) -> Result<()> {
    let files = manifest_files(workspace)?;
    check_kustomization(workspace, &files)?;
    let validator = install(workspace)?;
    for version in KUBERNETES_VERSIONS {
        let resources = validator.check(workspace, version, &files)?;
        println!(
            "ok {} manifest file(s), {resources} resource(s) valid for Kubernetes {version}",
            files.len()
        );
    }
    negative_checks(&validator, workspace)?;
    Ok(())
}

/// Where the workspace's build output goes.
fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace.join(dir),
        None => workspace.join("target"),
    }
}

/// The manifests, relative to the workspace, sorted.
fn manifest_files(workspace: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    for dir in MANIFEST_DIRS {
        let entries = std::fs::read_dir(workspace.join(dir))
            .with_context(|| format!("cannot list {}", workspace.join(dir).display()))?;
        for entry in entries {
            let path = entry?.path();
            let manifest = path.is_file()
                && path
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| MANIFEST_EXTENSIONS.contains(&e));
            if manifest {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let file = format!("{dir}/{name}");
                if file != KUSTOMIZATION {
                    files.push(file);
                }
            }
        }
    }
    files.sort();
    if files.is_empty() {
        bail!("no manifests (*.yaml, *.yml, *.json) in {MANIFEST_DIRS:?}");
    }
    Ok(files)
}

/// The entries of the top-level `resources:` list of a kustomization.
fn kustomization_resources(text: &str) -> Vec<String> {
    let mut resources = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') && !line.starts_with('-') {
            inside = line.trim_end() == "resources:";
            continue;
        }
        if inside {
            if let Some(item) = line.trim().strip_prefix("- ") {
                resources.push(item.trim().trim_matches('"').to_string());
            }
        }
    }
    resources
}

/// deploy/kustomization.yaml lists exactly the manifests of deploy/ (`files`: all
/// manifests, relative to the workspace), each once.
fn check_kustomization(workspace: &Path, files: &[String]) -> Result<()> {
    let path = workspace.join(KUSTOMIZATION);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut listed = kustomization_resources(&text);
    listed.sort();
    let dir = Path::new(KUSTOMIZATION)
        .parent()
        .and_then(Path::to_str)
        .unwrap_or_default();
    let mut present: Vec<String> = files
        .iter()
        .filter_map(|f| f.strip_prefix(&format!("{dir}/")))
        .map(str::to_string)
        .collect();
    present.sort();
    if listed != present {
        bail!(
            "{KUSTOMIZATION} lists resources {listed:?}, but {dir}/ holds {present:?}: \
             list every manifest once"
        );
    }
    println!("ok {KUSTOMIZATION} lists {}", listed.join(", "));
    Ok(())
}

/// The installed validator and where it works.
struct Validator {
    /// The `kubernetes-validate` executable.
    bin: PathBuf,
    /// The virtualenv's Python, for the List expansion.
    python: PathBuf,
    /// Scratch space: target/validate-manifests.
    work: PathBuf,
}

/// The validator, installing it if the virtualenv is missing or was made with
/// other pins.
fn install(workspace: &Path) -> Result<Validator> {
    let work = target_dir(workspace).join("validate-manifests");
    let venv = work.join("venv");
    let validator = venv.join("bin").join(VALIDATOR);
    let found = Validator {
        bin: validator.clone(),
        python: venv.join("bin").join("python3"),
        work: work.clone(),
    };
    let stamp = venv.join("lb-requirements.txt");
    let wanted = format!("{}\n", REQUIREMENTS.join("\n"));
    if is_executable(&validator) && std::fs::read_to_string(&stamp).ok() == Some(wanted.clone()) {
        println!("ok {} ({})", REQUIREMENTS[0], venv.display());
        return Ok(found);
    }
    println!("installing {} into {}", REQUIREMENTS[0], venv.display());
    let can_apt = is_root() && which("apt-get").is_some();
    if which("python3").is_none() {
        if !can_apt {
            bail!(
                "python3 is not on PATH; install it (Debian: apt-get install python3 python3-venv)"
            );
        }
        apt_install(&["python3", "python3-venv"])?;
    }
    if let Err(first) = create_venv(&venv) {
        // Debian's python3 lacks ensurepip (and so venv) without python3-venv.
        if !can_apt {
            bail!(
                "{first}\nDebian ships `python3 -m venv` in python3-venv: \
                 apt-get install python3-venv (as root), then run this again"
            );
        }
        println!("python3 -m venv failed; installing python3-venv");
        apt_install(&["python3-venv"])?;
        create_venv(&venv)?;
    }
    run::run(
        Command::new(venv.join("bin").join("pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-input",
                "--timeout",
                "60",
                "--retries",
                "3",
            ])
            .args(REQUIREMENTS),
    )?;
    if !is_executable(&validator) {
        bail!("pip finished but {} is missing", validator.display());
    }
    std::fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(found)
}

fn apt_install(packages: &[&str]) -> Result<()> {
    run::run(Command::new("apt-get").arg("update"))?;
    run::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y"])
            .args(packages),
    )
}

/// A fresh virtualenv at `venv` (an old or half-made one is removed first).
fn create_venv(venv: &Path) -> Result<()> {
    if venv.exists() {
        std::fs::remove_dir_all(venv)
            .with_context(|| format!("cannot remove the old {}", venv.display()))?;
    }
    let mut cmd = Command::new("python3");
    cmd.arg("-m").arg("venv").arg(venv);
    let shown = run::display(&cmd);
    eprintln!("+ {shown}");
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(venv);
        bail!(
            "`{shown}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Validator {
    /// Runs the validator on `files` (relative to `dir`), Lists expanded, for one
    /// Kubernetes version, echoing its output; returns the command line, whether
    /// it exited 0, and the output. Output lines name the files as given.
    fn run(&self, dir: &Path, version: &str, files: &[String]) -> Result<(String, bool, String)> {
        let expanded = self.work.join("expanded");
        if expanded.exists() {
            std::fs::remove_dir_all(&expanded)
                .with_context(|| format!("removing {}", expanded.display()))?;
        }
        let script = self.work.join("expand_lists.py");
        std::fs::write(&script, EXPAND_LISTS)
            .with_context(|| format!("writing {}", script.display()))?;
        let mut expand = Command::new(&self.python);
        expand.arg(&script).arg(dir).arg(&expanded).args(files);
        let shown = run::display(&expand);
        let out = expand
            .output()
            .with_context(|| format!("could not start `{shown}`"))?;
        if !out.status.success() {
            let output = String::from_utf8_lossy(&out.stderr).into_owned();
            print!("{output}");
            return Ok((shown, false, output));
        }

        let mut cmd = Command::new(&self.bin);
        cmd.current_dir(&expanded)
            .args(["--strict", "--kubernetes-version", version])
            .args(files);
        let shown = run::display(&cmd);
        eprintln!("+ {shown}");
        let out = cmd
            .output()
            .with_context(|| format!("could not start `{shown}`"))?;
        let output = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        print!("{output}");
        Ok((shown, out.status.success(), output))
    }

    /// Validates `files` for one Kubernetes version and returns how many resources
    /// passed; fails saying why (the validator's output is shown above).
    fn check(&self, dir: &Path, version: &str, files: &[String]) -> Result<usize> {
        let (shown, success, output) = self.run(dir, version, files)?;
        judge(success, &output, files).with_context(|| format!("`{shown}` rejected the manifests"))
    }
}

/// The verdict on one run of the validator. Stricter than its exit code, which is 0
/// for a kind or API version it has no schema for (only a warning) and for a file
/// holding no resource at all: every warning or error fails, and every file must
/// have at least one resource that passed.
fn judge(success: bool, output: &str, files: &[String]) -> Result<usize> {
    if let Some(line) = output
        .lines()
        .find(|l| l.starts_with("WARN") || l.starts_with("ERROR"))
    {
        bail!("the validator reported: {line}");
    }
    if !success {
        // E.g. a YAML syntax error, reported without a prefix.
        let first = output.lines().find(|l| !l.starts_with("INFO "));
        bail!(
            "the validator exited with an error: {}",
            first.unwrap_or("(no output)")
        );
    }
    let mut resources = 0;
    for file in files {
        let passed = format!("INFO {file} passed for resource ");
        let count = output.lines().filter(|l| l.starts_with(&passed)).count();
        if count == 0 {
            bail!("no resource in {file} was validated");
        }
        resources += count;
    }
    Ok(resources)
}

/// A broken copy of a manifest and what the rejection must mention.
struct Broken {
    name: &'static str,
    what: &'static str,
    text: String,
    mentions: &'static str,
}

fn broken_copies(original: &str) -> Result<Vec<Broken>> {
    let replace = |from: &str, to: &str| -> Result<String> {
        if !original.contains(from) {
            bail!("{BROKEN_SOURCE} no longer contains `{from}`; update the negative checks in xtask/src/validate.rs");
        }
        Ok(original.replacen(from, to, 1))
    };
    Ok(vec![
        Broken {
            name: "wrong-type.yaml",
            what: "a boolean field holding a string",
            text: replace("hostNetwork: true", "hostNetwork: \"yes\"")?,
            mentions: "hostNetwork",
        },
        Broken {
            name: "unknown-field.yaml",
            what: "an unknown field in the pod spec",
            text: insert_sibling(original, "hostNetwork: true", "notAPodSpecField: true")
                .with_context(|| {
                    format!(
                        "{BROKEN_SOURCE} has no `hostNetwork: true` line to add a field next to"
                    )
                })?,
            mentions: "notAPodSpecField",
        },
        Broken {
            name: "unknown-api-version.yaml",
            what: "an API version that does not exist",
            text: replace("apiVersion: apps/v1\n", "apiVersion: apps/v1beta9\n")?,
            mentions: "apps/v1beta9",
        },
        Broken {
            name: "list-item.yaml",
            what: "an unknown field in an item of a List",
            text: "apiVersion: v1\nkind: List\nitems:\n  - apiVersion: v1\n    kind: ServiceAccount\n    \
                   metadata:\n      name: lb-agent\n      namespace: kube-system\n    \
                   notAServiceAccountField: true\n"
                .to_string(),
            mentions: "notAServiceAccountField",
        },
        Broken {
            name: "no-resources.yaml",
            what: "a file without any resource",
            text: "# nothing but a comment\n".to_string(),
            mentions: "no resource",
        },
    ])
}

/// `text` with `line` added after the first line that is `anchor` once trimmed,
/// indented like it.
fn insert_sibling(text: &str, anchor: &str, line: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len() + line.len() + 16);
    let mut done = false;
    for current in text.split_inclusive('\n') {
        out.push_str(current);
        if !done && current.trim() == anchor {
            let indent = &current[..current.len() - current.trim_start().len()];
            if !current.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(indent);
            out.push_str(line);
            out.push('\n');
            done = true;
        }
    }
    done.then_some(out)
}

fn negative_checks(validator: &Validator, workspace: &Path) -> Result<()> {
    let original = std::fs::read_to_string(workspace.join(BROKEN_SOURCE))
        .with_context(|| format!("reading {BROKEN_SOURCE}"))?;
    let dir = target_dir(workspace)
        .join("validate-manifests")
        .join("broken");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let newest = KUBERNETES_VERSIONS[KUBERNETES_VERSIONS.len() - 1];
    for broken in broken_copies(&original)? {
        std::fs::write(dir.join(broken.name), &broken.text)
            .with_context(|| format!("writing {}", dir.join(broken.name).display()))?;
        println!(
            "negative check: {} ({}) must be rejected",
            broken.name, broken.what
        );
        let files = [broken.name.to_string()];
        let (_, success, output) = validator.run(&dir, newest, &files)?;
        match judge(success, &output, &files) {
            Ok(_) => bail!(
                "the validation accepted {} ({}): it would pass without checking anything",
                dir.join(broken.name).display(),
                broken.what
            ),
            Err(reason) => {
                if !format!("{output}{reason:#}").contains(broken.mentions) {
                    bail!(
                        "{} was rejected, but not for {} (no mention of `{}`): {reason}",
                        broken.name,
                        broken.what,
                        broken.mentions
                    );
                }
                println!("ok rejected: {}", broken.what);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn judge_needs_a_passed_resource_per_file_and_no_warnings() {
        let files = names(&["deploy/a.yaml", "deploy/b.yaml"]);
        let ok = "INFO deploy/a.yaml passed for resource daemonset/x against version 1.37\n\
                  INFO deploy/b.yaml passed for resource serviceaccount/y against version 1.37\n\
                  INFO deploy/b.yaml passed for resource clusterrole/y against version 1.37\n";
        assert_eq!(judge(true, ok, &files).unwrap(), 3);
        assert!(judge(false, ok, &files).is_err());
        let warned = format!("{ok}WARN deploy/b.yaml Couldn't find schema for kind Widget\n");
        assert!(judge(true, &warned, &files).is_err());
        let missing = "INFO deploy/a.yaml passed for resource daemonset/x against version 1.37\n";
        let err = judge(true, missing, &files).unwrap_err().to_string();
        assert!(err.contains("deploy/b.yaml"), "{err}");
        // A file name that merely starts like another does not count for it.
        let prefix = "INFO deploy/a.yaml.bak passed for resource daemonset/x\n\
                      INFO deploy/b.yaml passed for resource daemonset/x\n";
        assert!(judge(true, prefix, &files).is_err());
    }

    #[test]
    fn sibling_line_takes_the_anchor_indentation() {
        let text = "spec:\n  template:\n    hostNetwork: true\n    dnsPolicy: X\n";
        assert_eq!(
            insert_sibling(text, "hostNetwork: true", "extra: 1").unwrap(),
            "spec:\n  template:\n    hostNetwork: true\n    extra: 1\n    dnsPolicy: X\n"
        );
        assert_eq!(
            insert_sibling("a: 1", "a: 1", "b: 2").unwrap(),
            "a: 1\nb: 2\n"
        );
        assert!(insert_sibling(text, "hostPID: true", "extra: 1").is_none());
    }

    #[test]
    fn broken_copies_differ_from_the_original() {
        let workspace = crate::workspace_root();
        let original = std::fs::read_to_string(workspace.join(BROKEN_SOURCE)).unwrap();
        for broken in broken_copies(&original).unwrap() {
            assert_ne!(broken.text, original, "{}", broken.name);
        }
    }

    #[test]
    fn manifests_are_found() {
        let files = manifest_files(&crate::workspace_root()).unwrap();
        assert!(files.iter().any(|f| f == BROKEN_SOURCE), "{files:?}");
        assert!(files.iter().all(|f| !f.ends_with("Containerfile")));
        assert!(files.iter().all(|f| f != KUSTOMIZATION), "{files:?}");
        check_kustomization(&crate::workspace_root(), &files).unwrap();
    }

    #[test]
    fn kustomization_resources_are_read_from_their_list_only() {
        let text = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
                    resources:\n  - rbac.yaml\n  # - old.yaml\n  - \"daemonset.yaml\"\n\
                    images:\n  - name: lb\n";
        assert_eq!(
            kustomization_resources(text),
            ["rbac.yaml", "daemonset.yaml"]
        );
    }
}
