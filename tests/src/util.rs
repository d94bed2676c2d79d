//! Small helpers every other module uses: unique names, root check, running commands,
//! bounded polling and errno names.

use std::io;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A name no other test of this or any concurrent test process uses: the pid keeps
/// processes apart, the counter keeps the tests (threads) of one process apart.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

/// The testbed creates namespaces, cgroups and BPF pins: it needs root.
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the lb testbed needs root (it creates network namespaces, cgroups and BPF \
             pins); run as root, e.g. `sudo -E cargo test -p lb-tests`"
        );
    }
    Ok(())
}

/// Run a command to completion; fail with its stderr if it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Run `ip ARGS...`.
pub fn ip(args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(args))
}

/// Poll `check` until it returns `Some`, at most `timeout` and a bounded number of
/// rounds. Used to wait on a condition (never as a fixed sleep): the short pause only
/// keeps the loop from spinning. An error from `check` is retried (and reported if
/// the time runs out). Stops early when the demo was interrupted (Ctrl-C).
pub fn poll<T>(
    what: &str,
    timeout: Duration,
    check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    poll_impl(what, timeout, true, check)
}

/// [`poll`] for teardown: never cut short by an interrupt, so cleanup completes.
pub fn poll_to_completion<T>(
    what: &str,
    timeout: Duration,
    check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    poll_impl(what, timeout, false, check)
}

fn poll_impl<T>(
    what: &str,
    timeout: Duration,
    interruptible: bool,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    const PAUSE: Duration = Duration::from_millis(50);
    let deadline = Instant::now() + timeout;
    let max_rounds = timeout.as_millis() / PAUSE.as_millis() + 2;
    let mut last_err = None;
    for _ in 0..max_rounds {
        if interruptible {
            crate::interrupt::check()?;
        }
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(PAUSE);
    }
    match last_err {
        Some(e) => Err(e.context(format!("timed out after {timeout:?} waiting for {what}"))),
        None => bail!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// The symbolic name of an errno (`ECONNREFUSED`), which is what the tests assert on.
pub fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::EACCES => "EACCES",
        libc::EINVAL => "EINVAL",
        libc::EPIPE => "EPIPE",
        libc::EMSGSIZE => "EMSGSIZE",
        libc::EDESTADDRREQ => "EDESTADDRREQ",
        libc::EPROTOTYPE => "EPROTOTYPE",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENETDOWN => "ENETDOWN",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::ENOBUFS => "ENOBUFS",
        libc::EISCONN => "EISCONN",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTDOWN => "EHOSTDOWN",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EINPROGRESS => "EINPROGRESS",
        _ => return format!("E#{errno}"),
    };
    name.to_string()
}

/// Name an I/O error like an errno. Some std errors carry no errno (the connect
/// timeout of `TcpStream::connect_timeout`, an early EOF): name those by kind.
pub fn io_error_name(e: &io::Error) -> String {
    if let Some(errno) = e.raw_os_error() {
        return errno_name(errno);
    }
    match e.kind() {
        io::ErrorKind::TimedOut => "ETIMEDOUT".into(),
        io::ErrorKind::WouldBlock => "EAGAIN".into(),
        io::ErrorKind::UnexpectedEof => "EOF".into(),
        kind => format!("{kind:?}"),
    }
}

/// Pins the calling thread to `cpu` (benchmarks: a sender and the softirq work it
/// causes share that CPU).
pub fn pin_to_cpu(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it and
    // sched_setaffinity only reads it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    anyhow::ensure!(
        rc == 0,
        "sched_setaffinity({cpu}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}
