//! Operator mistakes through the real `lb` binary: unreadable manifest files, flags
//! out of range, a closed stdout, a missing source, a directory that is not a cgroup,
//! a start that fails half-way, a map size that differs from the pinned maps'. Each
//! test checks what the operator sees: the exit code, one line naming the problem and
//! the fix, the table still exact, the pins still (or no longer) there.
//!
//! No traffic: an agent here only needs a child cgroup and a pin dir of its own.
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use lb_tests::agent::{find_frontend, ServiceEntry, READY_TIMEOUT, SYNC_TIMEOUT};
use lb_tests::agent_proc::{cgroup_programs, PinDir};
use lb_tests::cgroup::Cgroup;
use lb_tests::lb_binary;
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, ManifestDir, Service, ServicePort};
use lb_tests::process::{Child, Output, Spawner};
use lb_tests::util::{poll, unique_name};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE: &str = "node-1";

/// Service `web` (VIP:80 -> 8080) with endpoints at these addresses. Nothing is
/// connected to: the table is what is checked.
fn web(backends: &[Ipv4Addr]) -> String {
    let svc = Service::new("web", VIP, vec![ServicePort::tcp("http", 80, 8080)]);
    let endpoints = backends
        .iter()
        .enumerate()
        .map(|(i, ip)| Endpoint::ready(&format!("web-{i}"), *ip))
        .collect();
    let slice = EndpointSlice::for_service(&svc, endpoints);
    documents([svc.to_yaml(), slice.to_yaml()])
}

/// A cgroup, a pin dir and a manifest directory of the test's own. Field order is
/// teardown order: pins (detaching the hooks) before the cgroup.
struct Bed {
    pins: PinDir,
    cgroup: Cgroup,
    manifests: ManifestDir,
    lb: PathBuf,
}

impl Bed {
    fn new() -> Result<Self> {
        let lb = lb_binary()?;
        Ok(Bed {
            pins: PinDir::create(&lb)?,
            cgroup: Cgroup::create(&unique_name("lb-test-operr"))?,
            manifests: ManifestDir::create()?,
            lb,
        })
    }

    /// `lb agent` on the manifest directory with health and metrics on one ephemeral
    /// loopback port, plus `extra` flags.
    fn agent(&self, extra: &[&str]) -> Spawner {
        self.agent_on(self.manifests.path(), self.cgroup.path(), extra)
    }

    fn agent_on(&self, services: &Path, cgroup: &Path, extra: &[&str]) -> Spawner {
        // In the test's own (the host's) namespace: socket hooks only, never a
        // program on the host's devices (a test that needs the per-packet path
        // gives its own --tc-attach and a namespace of its own).
        let tc: &[&str] = if extra.contains(&"--tc-attach") {
            &[]
        } else {
            &["--tc-attach", "off"]
        };
        Spawner::new(&self.lb)
            .label("lb agent")
            .arg("agent")
            .arg("--services-file")
            .arg(services)
            .arg("--cgroup")
            .arg(cgroup)
            .arg("--pin-dir")
            .arg(self.pins.path())
            .args(["--node-name", NODE])
            .args(["--healthz-bind-address", "127.0.0.1:0"])
            .args(["--metrics-bind-address", "127.0.0.1:0"])
            .args(tc)
            .args(extra)
            .env("NO_COLOR", "1")
            // The error line, not a backtrace, is what the operator reads.
            .env("RUST_BACKTRACE", "0")
    }

    /// Names in the pin dir, sorted.
    fn pinned(&self) -> Result<Vec<String>> {
        pinned_under(self.pins.path())
    }
}

fn pinned_under(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.strip_prefix(dir)?.display().to_string();
        if path.is_dir() {
            names.extend(
                pinned_under(&path)?
                    .into_iter()
                    .map(|n| format!("{name}/{n}")),
            );
        }
        names.push(name);
    }
    names.sort();
    Ok(names)
}

fn wait_ready(agent: &Child) -> Result<()> {
    agent
        .stderr
        .wait_for(READY_TIMEOUT, |l| l.contains("ready and serving"))
        .with_context(|| format!("agent log:\n{}", agent.stderr.text()))
        .map(drop)
}

/// The address the agent's health/metrics listener bound, from its log.
fn ops_addr(agent: &Child) -> Result<SocketAddrV4> {
    let line = agent
        .stderr
        .wait_for(READY_TIMEOUT, |l| l.contains("serving health/metrics"))?;
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .with_context(|| format!("no addr= in {line:?}"))?;
    Ok(addr.parse()?)
}

/// GET /metrics over loopback; the value of an unlabelled sample.
fn metric(addr: SocketAddrV4, name: &str) -> Result<u64> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .with_context(|| format!("{name} missing from /metrics:\n{text}"))?;
    Ok(value.trim().parse()?)
}

/// `lb status` (text, or `--json`) asking the agent at `addr`; it must succeed.
fn lb_status(bed: &Bed, addr: SocketAddrV4, json: bool) -> Result<String> {
    let json: &[&str] = if json { &["--json"] } else { &[] };
    Spawner::new(&bed.lb)
        .label("lb status")
        .arg("status")
        .arg("--pin-dir")
        .arg(bed.pins.path())
        .arg("--metrics-address")
        .arg(addr.to_string())
        .args(json)
        .env("RUST_BACKTRACE", "0")
        .output(Duration::from_secs(10))?
        .checked_stdout()
}

/// The `path: reason` lines `lb status` prints for unreadable manifest files.
fn unreadable_in_status(text: &str, dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with(&dir))
        .map(str::to_owned)
        .collect()
}

/// The one `Error: ...` line a failed `lb` prints, with its exit code checked.
fn error_line(out: &Output, code: i32) -> Result<String> {
    ensure!(
        out.status.code() == Some(code),
        "exit {} instead of {code}; stderr:\n{}",
        out.status,
        out.stderr
    );
    ensure!(!out.stderr.contains("panicked"), "{}", out.stderr);
    let prefix = if code == 2 { "error: " } else { "Error: " };
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with(prefix))
        .collect();
    match lines[..] {
        [line] => Ok(line.to_string()),
        _ => bail!("expected one `{prefix}` line in:\n{}", out.stderr),
    }
}

fn backends_of(entries: &[ServiceEntry]) -> Vec<SocketAddrV4> {
    find_frontend(entries, VIP, 80, "TCP")
        .map(|e| {
            e.backend_addrs()
                .into_iter()
                .filter_map(|a| match a {
                    std::net::SocketAddr::V4(v4) => Some(v4),
                    std::net::SocketAddr::V6(_) => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Item 1: a binary file, a dangling symlink, a symlink loop, a FIFO and a file whose
/// read fails with EIO sit next to the good manifest. The good Service is
/// programmed at start and its edits apply at run time; each bad file is logged once
/// with its cause, counted in /metrics and listed by `lb status` until it is removed.
#[test]
fn unreadable_files_do_not_stop_the_directory() -> Result<()> {
    use std::os::unix::fs::symlink;
    let bed = Bed::new()?;
    let dir = bed.manifests.path();
    let a = Ipv4Addr::new(10, 0, 0, 1);
    let b = Ipv4Addr::new(10, 0, 0, 2);
    bed.manifests.write("web.yaml", &web(&[a]))?;
    std::fs::write(
        dir.join("binary.yaml"),
        b"\x7fELF\x02\x01\x01\x00\xff\xfe garbage",
    )?;
    symlink(dir.join("gone.yaml"), dir.join("dangling.yaml"))?;
    symlink(dir.join("loop-b.yaml"), dir.join("loop-a.yaml"))?;
    symlink(dir.join("loop-a.yaml"), dir.join("loop-b.yaml"))?;
    // Fails with EIO at offset 0, also for root (permissions would not).
    symlink("/proc/self/mem", dir.join("io-error.yaml"))?;
    let fifo = std::ffi::CString::new(dir.join("fifo.yaml").into_os_string().into_encoded_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    ensure!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) } == 0, "mkfifo");

    let agent = bed.agent(&[]).spawn()?;
    let addr = ops_addr(&agent)?;
    wait_ready(&agent)?;
    let entries = bed.pins.services_json()?;
    ensure!(
        backends_of(&entries) == [SocketAddrV4::new(a, 8080)],
        "{entries:#?}"
    );
    let bad = [
        ("binary.yaml", "not UTF-8 text"),
        ("dangling.yaml", "a symlink to"),
        ("loop-a.yaml", "symbolic links"),
        ("loop-b.yaml", "symbolic links"),
        ("io-error.yaml", "Input/output error"),
        ("fifo.yaml", "a FIFO, not a regular file"),
    ];
    for (file, cause) in bad {
        let path = dir.join(file).display().to_string();
        agent.stderr.wait_for(SYNC_TIMEOUT, |l| {
            l.contains("WARN") && l.contains(&path) && l.contains(cause)
        })?;
    }
    ensure!(metric(addr, "lb_manifest_files_unreadable")? == 6);
    // `lb status` shows each of them with its reason, next to the attachments.
    let status = lb_status(&bed, addr, false)?;
    ensure!(status.starts_with("IFINDEX"), "{status}");
    let listed = unreadable_in_status(&status, dir);
    ensure!(listed.len() == bad.len(), "{status}");
    for (file, cause) in bad {
        let path = dir.join(file).display().to_string();
        ensure!(
            listed
                .iter()
                .any(|l| l.starts_with(&format!("{path}: ")) && l.contains(cause)),
            "{file} ({cause}) not listed by lb status:\n{status}"
        );
    }
    let json: serde_json::Value = serde_json::from_str(&lb_status(&bed, addr, true)?)?;
    ensure!(json["links"].is_array(), "{json}");
    let files = json["agent"]["unreadableFiles"]
        .as_array()
        .with_context(|| format!("no agent.unreadableFiles in {json}"))?;
    ensure!(files.len() == bad.len(), "{json}");
    let fifo = dir.join("fifo.yaml").display().to_string();
    ensure!(
        files
            .iter()
            .any(|f| f["path"] == fifo.as_str() && f["reason"] == "a FIFO, not a regular file"),
        "{json}"
    );

    // Edits of the good file still apply while the bad ones are there.
    bed.manifests.write("web.yaml", &web(&[a, b]))?;
    bed.pins
        .wait_services("web with both backends", SYNC_TIMEOUT, |e| {
            backends_of(e) == [SocketAddrV4::new(a, 8080), SocketAddrV4::new(b, 8080)]
        })?;
    let binary = dir.join("binary.yaml").display().to_string();
    let warned = agent
        .stderr
        .snapshot()
        .iter()
        .filter(|l| l.contains("WARN") && l.contains(&binary))
        .count();
    ensure!(
        warned == 1,
        "binary.yaml warned {warned} times, not once per change"
    );

    // Fixed files leave the count.
    std::fs::remove_file(dir.join("fifo.yaml"))?;
    std::fs::remove_file(dir.join("dangling.yaml"))?;
    poll("the unreadable count to drop to 4", SYNC_TIMEOUT, || {
        Ok((metric(addr, "lb_manifest_files_unreadable")? == 4).then_some(()))
    })?;
    let status = lb_status(&bed, addr, false)?;
    let listed = unreadable_in_status(&status, dir);
    ensure!(listed.len() == 4, "{status}");
    ensure!(
        !status.contains("fifo.yaml") && !status.contains("dangling.yaml"),
        "fixed files still listed:\n{status}"
    );
    ensure!(status.contains(&binary), "{status}");

    // An agent that does not answer: the attachments are still shown, and why the
    // rest is missing.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?;
    let nobody = match closed.local_addr()? {
        std::net::SocketAddr::V4(a) => a,
        other => bail!("not IPv4: {other}"),
    };
    drop(closed);
    let status = lb_status(&bed, nobody, false)?;
    ensure!(status.starts_with("IFINDEX"), "{status}");
    ensure!(
        status.contains(&format!("agent: not reachable at {nobody}")),
        "{status}"
    );
    let json: serde_json::Value = serde_json::from_str(&lb_status(&bed, nobody, true)?)?;
    ensure!(json["agent"]["reachable"] == false, "{json}");
    ensure!(json["links"].is_array(), "{json}");
    Ok(())
}

/// Item 4: every numeric flag of `lb agent` is checked while parsing: exit code 2
/// and one line naming the flag and the range, before anything is loaded.
#[test]
fn numeric_flags_out_of_range_are_refused_at_parse_time() -> Result<()> {
    let bed = Bed::new()?;
    bed.manifests
        .write("web.yaml", &web(&[Ipv4Addr::new(10, 0, 0, 1)]))?;
    let cases = [
        ("--ct-gc-interval-ms", "0"),
        ("--services-map-size", "0"),
        ("--backends-map-size", "0"),
        ("--sock-revnat-map-size", "0"),
        ("--affinity-map-size", "0"),
        ("--conntrack-map-size", "4294967295"),
        ("--ct-tcp-syn-timeout", "0"),
        ("--ct-tcp-timeout", "0"),
        ("--ct-tcp-closing-timeout", "0"),
        ("--ct-udp-timeout", "0"),
        ("--healthz-timeout-secs", "0"),
    ];
    for (flag, value) in cases {
        let out = bed.agent(&[flag, value]).output(READY_TIMEOUT)?;
        let line = error_line(&out, 2).with_context(|| format!("{flag} {value}"))?;
        ensure!(
            line.starts_with(&format!("error: invalid value '{value}' for '{flag} <"))
                && line.contains("is not in 1..="),
            "{flag} {value}: {line}"
        );
    }
    ensure!(bed.pinned()?.is_empty(), "pinned: {:?}", bed.pinned()?);
    Ok(())
}

/// Item 4: `lb services --json | head -c1` and the like: a reader that is gone ends
/// the command with exit 0 and no panic message.
#[test]
fn a_closed_stdout_ends_the_cli_quietly() -> Result<()> {
    let bed = Bed::new()?;
    bed.manifests
        .write("web.yaml", &web(&[Ipv4Addr::new(10, 0, 0, 1)]))?;
    let agent = bed.agent(&[]).spawn()?;
    wait_ready(&agent)?;
    let commands: [&[&str]; 7] = [
        &["services", "--json"],
        &["services"],
        &["conntrack", "--json"],
        &["conntrack"],
        &["stats", "--json"],
        &["stats"],
        &["stats", "--per-service"],
    ];
    for args in commands {
        // The read end is closed before the command starts: its first write fails.
        let (reader, writer) = std::io::pipe()?;
        drop(reader);
        let out = std::process::Command::new(&bed.lb)
            .args(&args[..1])
            .arg("--pin-dir")
            .arg(bed.pins.path())
            .args(&args[1..])
            .env("RUST_BACKTRACE", "0")
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.success() && stderr.trim().is_empty(),
            "lb {args:?} with a closed stdout: {}\n{stderr}",
            out.status
        );
    }
    Ok(())
}

/// Item 6: a --services-file that does not exist fails the start at once, naming it.
#[test]
fn a_missing_services_file_fails_the_start() -> Result<()> {
    let bed = Bed::new()?;
    let missing = bed.manifests.path().join("no-such.yaml");
    let out = bed
        .agent_on(&missing, bed.cgroup.path(), &[])
        .output(SYNC_TIMEOUT)?;
    let line = error_line(&out, 1)?;
    ensure!(
        line == format!(
            "Error: {}: no such file or directory; pass a YAML/JSON file or a directory \
             holding them",
            missing.display()
        ),
        "{line}"
    );
    ensure!(bed.pinned()?.is_empty(), "pinned: {:?}", bed.pinned()?);
    Ok(())
}

/// Item 6: --cgroup naming a directory that is not a cgroup v2 directory fails before
/// anything is loaded, naming the path and the cause.
#[test]
fn a_cgroup_that_is_not_cgroup2_fails_the_start() -> Result<()> {
    let bed = Bed::new()?;
    bed.manifests
        .write("web.yaml", &web(&[Ipv4Addr::new(10, 0, 0, 1)]))?;
    // A plain directory of the test's own (the manifest directory).
    let plain = bed.manifests.path();
    let out = bed.agent_on(plain, plain, &[]).output(READY_TIMEOUT)?;
    let line = error_line(&out, 1)?;
    ensure!(
        line.starts_with(&format!(
            "Error: cgroup {}: not a cgroup v2 directory (not on a cgroup filesystem); pass a \
             directory of the cgroup2 mount",
            plain.display()
        )),
        "{line}"
    );
    ensure!(bed.pinned()?.is_empty(), "pinned: {:?}", bed.pinned()?);
    Ok(())
}

/// Item 6: a start that fails after the maps were written (here: attaching to an
/// interface that does not exist, after the socket hooks were attached) removes the
/// maps and links it pinned, so no hook is left running on a table nobody updates.
#[test]
fn a_start_failing_after_the_maps_were_written_removes_its_pins() -> Result<()> {
    let bed = Bed::new()?;
    bed.manifests
        .write("web.yaml", &web(&[Ipv4Addr::new(10, 0, 0, 1)]))?;
    // A namespace of the test's own, so the per-packet path may be on: the start
    // fails at the first attach, on a device the flag names and the namespace
    // lacks, after the first table was written.
    let ns = lb_tests::netns::NetNs::create(&unique_name("lb-operr"))?;
    let out = bed
        .agent(&["--tc-attach", "auto", "--iface", "lbnosuch0"])
        .netns(&ns)?
        .output(READY_TIMEOUT)?;
    let line = error_line(&out, 1)?;
    ensure!(
        line.contains("--iface lbnosuch0: no such device") && line.contains("leave the flag out"),
        "{line}"
    );
    ensure!(
        out.stderr.contains("service table applied"),
        "the maps were not written before the failure, so this tests nothing:\n{}",
        out.stderr
    );
    ensure!(bed.pinned()?.is_empty(), "left pinned: {:?}", bed.pinned()?);
    let attached = cgroup_programs(&bed.cgroup)?;
    ensure!(attached.is_empty(), "still attached: {attached:#?}");
    Ok(())
}

/// Item 7: maps pinned with one size are not silently reused with another: the
/// second start is refused with the map, both sizes and the fix, and the pins (and
/// the table in them) are untouched.
#[test]
fn a_changed_map_size_on_existing_pins_is_refused() -> Result<()> {
    let bed = Bed::new()?;
    let a = Ipv4Addr::new(10, 0, 0, 1);
    bed.manifests.write("web.yaml", &web(&[a]))?;
    let mut first = bed.agent(&["--services-map-size", "4096"]).spawn()?;
    wait_ready(&first)?;
    let status = first.terminate(Duration::from_secs(10))?;
    ensure!(status.success(), "first agent exited with {status}");
    let before = bed.pinned()?;
    let table = bed.pins.services_json()?;

    let out = bed
        .agent(&["--services-map-size", "8192"])
        .output(READY_TIMEOUT)?;
    let line = error_line(&out, 1)?;
    let pin_dir = bed.pins.path().display();
    ensure!(
        line.starts_with(&format!(
            "Error: pinned map LB_SERVICES in {pin_dir}/v{} has 4096 entries, but \
             --services-map-size asks for 8192",
            lb_common::PIN_LAYOUT_VERSION
        )) && line.contains("Start with --services-map-size 4096")
            && line.contains(&format!("`lb cleanup --pin-dir {pin_dir}`")),
        "{line}"
    );
    ensure!(bed.pinned()? == before, "pins changed: {:?}", bed.pinned()?);
    ensure!(bed.pins.services_json()? == table, "the table changed");
    ensure!(backends_of(&table) == [SocketAddrV4::new(a, 8080)]);

    // The same size as pinned starts as before.
    let again = bed.agent(&["--services-map-size", "4096"]).spawn()?;
    wait_ready(&again)?;
    Ok(())
}

/// `lb cleanup` output of a run: exit status and stderr.
fn lb_cleanup(bed: &Bed, pin_dir: &Path) -> Result<Output> {
    Spawner::new(&bed.lb)
        .label("lb cleanup")
        .args(["cleanup", "--pin-dir"])
        .arg(pin_dir)
        .env("RUST_BACKTRACE", "0")
        .output(Duration::from_secs(30))
}

/// Issue 15 item 3: `lb cleanup --pin-dir` on an ordinary directory refuses and
/// deletes nothing; on a pin directory it removes only what lb pinned, says what it
/// left, and refuses while an agent holds the directory.
#[test]
fn cleanup_removes_only_lbs_own_pins() -> Result<()> {
    let bed = Bed::new()?;
    // An ordinary directory with the user's files (and names lb would pin).
    let user_dir = std::env::temp_dir().join(unique_name("lb-not-bpffs"));
    std::fs::create_dir_all(user_dir.join("links"))?;
    std::fs::write(user_dir.join("notes.txt"), "mine")?;
    std::fs::write(user_dir.join("links/lb_connect4"), "also mine")?;
    let out = lb_cleanup(&bed, &user_dir)?;
    let kept = user_dir.join("notes.txt").exists() && user_dir.join("links/lb_connect4").exists();
    let _ = std::fs::remove_dir_all(&user_dir);
    let line = error_line(&out, 1)?;
    ensure!(
        line.contains("is not on a bpf filesystem") && line.contains("nothing was removed"),
        "{line}"
    );
    ensure!(kept, "lb cleanup removed files of an ordinary directory");

    bed.manifests
        .write("web.yaml", &web(&[Ipv4Addr::new(10, 0, 0, 1)]))?;
    let mut agent = bed.agent(&[]).spawn()?;
    wait_ready(&agent)?;
    // While the agent runs: refused, naming it, nothing removed.
    let before = bed.pinned()?;
    let out = lb_cleanup(&bed, bed.pins.path())?;
    let line = error_line(&out, 1)?;
    ensure!(
        line.contains(&format!("in use by another lb agent (pid {})", agent.pid())),
        "{line}"
    );
    ensure!(bed.pinned()? == before, "pins changed: {:?}", bed.pinned()?);
    let status = agent.terminate(Duration::from_secs(10))?;
    ensure!(status.success(), "agent exited with {status}");

    // Another tool's entries beside lb's (bpffs holds pins and directories only).
    std::fs::create_dir(bed.pins.path().join("other-tool"))?;
    std::fs::create_dir(bed.pins.path().join("links/other-link"))?;
    let out = lb_cleanup(&bed, bed.pins.path())?;
    ensure!(out.status.success(), "lb cleanup failed: {}", out.stderr);
    ensure!(
        out.stderr.contains("left in place") && out.stderr.contains("other-tool"),
        "{}",
        out.stderr
    );
    let left = bed.pinned()?;
    ensure!(
        left == ["links", "links/other-link", "other-tool"],
        "only the foreign entries stay: {left:?}"
    );
    ensure!(
        cgroup_programs(&bed.cgroup)?.is_empty(),
        "lb's hooks are detached"
    );
    Ok(())
}

/// Issue 12 (drift repair): an entry deleted from the maps behind the agent's back
/// is restored by the periodic consistency check and counted in /metrics.
#[test]
fn a_map_entry_deleted_behind_the_agents_back_is_restored_and_counted() -> Result<()> {
    let bed = Bed::new()?;
    let backends = [Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)];
    bed.manifests.write("web.yaml", &web(&backends))?;
    let agent = bed
        .agent(&["--consistency-check-interval-secs", "1"])
        .spawn()?;
    wait_ready(&agent)?;
    let addr = ops_addr(&agent)?;
    let before = bed.pins.services_json()?;
    let entry = find_frontend(&before, VIP, 80, "TCP").context("the web frontend")?;
    ensure!(entry.backends.len() == 2, "{before:#?}");
    ensure!(metric(addr, "lb_drift_repairs_total")? == 0);

    // Another tool deletes one backend entry (ids are host-order u32 keys).
    let id = entry.backends[0].id;
    let map = bed
        .pins
        .path()
        .join(format!("v{}/LB_BACKENDS", lb_common::PIN_LAYOUT_VERSION));
    let key: Vec<String> = id.to_ne_bytes().iter().map(|b| b.to_string()).collect();
    let out = std::process::Command::new("bpftool")
        .args(["map", "delete", "pinned"])
        .arg(&map)
        .arg("key")
        .args(&key)
        .output()?;
    ensure!(out.status.success(), "bpftool map delete: {out:?}");
    ensure!(
        bed.pins.services_json()? != before,
        "the deletion did not change the table"
    );

    // Restored: both backends served again (a new backend id may be used), and
    // the listing shows no problem left.
    let want = entry.backend_addrs();
    bed.pins
        .wait_services("the deleted backend to be restored", SYNC_TIMEOUT, |e| {
            find_frontend(e, VIP, 80, "TCP")
                .is_some_and(|f| f.backend_addrs() == want && f.problems.is_empty())
        })?;
    let repairs = poll("the repair to be counted", SYNC_TIMEOUT, || {
        let n = metric(addr, "lb_drift_repairs_total")?;
        Ok((n >= 1).then_some(n))
    })?;
    ensure!(repairs == 1, "one deletion, {repairs} repairs");
    Ok(())
}
