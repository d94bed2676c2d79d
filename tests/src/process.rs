//! Spawning the testbed's processes inside a network namespace and/or the test cgroup,
//! and a child handle that is always killed and reaped.
//!
//! Why not `ip netns exec`: it also unshares the mount namespace and remounts /sys,
//! which hides /sys/fs/bpf and the cgroup mounts from the command. Instead the child
//! joins only the network namespace with `setns(CLONE_NEWNET)` between fork and exec,
//! and joins the cgroup by writing "0" (itself) to `cgroup.procs` — before exec, so that
//! not a single socket of the program is created outside the cgroup.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cgroup::Cgroup;
use crate::lines::Lines;
use crate::netns::NetNs;

/// Builder for a child placed in a namespace and/or cgroup. stdout and stderr are
/// always piped and collected line by line; stdin is /dev/null unless asked for.
pub struct Spawner {
    cmd: Command,
    label: String,
    /// Opened before fork: the child only calls async-signal-safe `setns`/`write`.
    netns: Option<File>,
    cgroup_procs: Option<File>,
    stdin: bool,
}

impl Spawner {
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        let program = program.as_ref();
        let label = std::path::Path::new(program)
            .file_name()
            .unwrap_or(program)
            .to_string_lossy()
            .into_owned();
        Spawner {
            cmd: Command::new(program),
            label,
            netns: None,
            cgroup_procs: None,
            stdin: false,
        }
    }

    /// Name used in error messages (default: the program's file name).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.cmd.arg(arg);
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.cmd.args(args);
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    /// Run the child in this network namespace.
    pub fn netns(mut self, ns: &NetNs) -> Result<Self> {
        self.netns = Some(ns.open()?);
        self.label = format!("{} in {}", self.label, ns.name());
        Ok(self)
    }

    /// Run the child in this cgroup (where the socket programs are attached).
    pub fn cgroup(mut self, cgroup: &Cgroup) -> Result<Self> {
        let procs = cgroup.path().join("cgroup.procs");
        let file = OpenOptions::new()
            .write(true)
            .open(&procs)
            .with_context(|| format!("cannot open {}", procs.display()))?;
        self.cgroup_procs = Some(file);
        Ok(self)
    }

    /// Give the child a pipe on stdin (see [`Child::write_stdin`]).
    pub fn stdin_piped(mut self) -> Self {
        self.stdin = true;
        self
    }

    pub fn spawn(mut self) -> Result<Child> {
        let netns_fd = self.netns.as_ref().map(|f| f.as_raw_fd());
        let cgroup_fd = self.cgroup_procs.as_ref().map(|f| f.as_raw_fd());
        self.cmd
            .stdin(if self.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs between fork and exec and only makes
        // async-signal-safe system calls on descriptors opened before the fork; it
        // allocates nothing (`last_os_error` only stores the errno).
        unsafe {
            self.cmd.pre_exec(move || {
                // If the test process dies without running its destructors, take the
                // child with it rather than leaving it in a namespace nobody deletes.
                // (The signal follows the spawning *thread*; every testbed child is
                // spawned and dropped on the test's own thread.)
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = cgroup_fd {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(fd) = netns_fd {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        crate::interrupt::check()?;
        let mut child = self
            .cmd
            .spawn()
            .with_context(|| format!("cannot start {} ({:?})", self.label, self.cmd))?;
        // The descriptors were only needed until exec; they close here.
        drop(self.netns.take());
        drop(self.cgroup_procs.take());
        let stdout = Lines::collect(
            &format!("{} (stdout)", self.label),
            child.stdout.take().expect("piped"),
        );
        let stderr = Lines::collect(
            &format!("{} (stderr)", self.label),
            child.stderr.take().expect("piped"),
        );
        Ok(Child {
            stdin: child.stdin.take(),
            child,
            label: self.label,
            status: None,
            stdout,
            stderr,
        })
    }

    /// Run to completion within `timeout` (the child is killed if it takes longer).
    pub fn output(self, timeout: Duration) -> Result<Output> {
        let mut child = self.spawn()?;
        let status = child.wait_interruptible(timeout)?;
        let Some(status) = status else {
            bail!(
                "{} did not finish within {timeout:?}; stderr:\n{}",
                child.label,
                child.stderr.text()
            );
        };
        // The pipes close with the process; the readers see EOF right after.
        let grace = Duration::from_secs(5);
        child.stdout.wait_closed(grace)?;
        child.stderr.wait_closed(grace)?;
        Ok(Output {
            label: child.label.clone(),
            status,
            stdout: child.stdout.text(),
            stderr: child.stderr.text(),
        })
    }
}

/// What a finished child printed.
#[derive(Debug)]
pub struct Output {
    pub label: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stdout, or an error carrying stderr when the child failed.
    pub fn checked_stdout(self) -> Result<String> {
        if !self.status.success() {
            bail!(
                "{} failed ({}):\nstdout:\n{}\nstderr:\n{}",
                self.label,
                self.status,
                self.stdout,
                self.stderr
            );
        }
        Ok(self.stdout)
    }
}

/// A running child. Dropping it kills (SIGKILL) and reaps it, so no test leaves a
/// process behind, whatever path it leaves by.
pub struct Child {
    child: std::process::Child,
    stdin: Option<ChildStdin>,
    label: String,
    status: Option<ExitStatus>,
    pub stdout: Lines,
    pub stderr: Lines,
}

impl Child {
    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Exit status if the child has exited (reaps it).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait()?;
        }
        Ok(self.status)
    }

    /// Send a signal, unless the child has already been reaped (its pid may be reused).
    pub fn signal(&mut self, sig: libc::c_int) -> Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = libc::pid_t::try_from(self.child.id())?;
        // SAFETY: plain kill(2) on our own, not yet reaped child.
        if unsafe { libc::kill(pid, sig) } != 0 {
            bail!("kill({pid}, {sig}): {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait at most `timeout` for the child to exit (also during teardown: not cut
    /// short by an interrupt).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        self.wait_until(timeout, false)
    }

    /// [`Child::wait_timeout`] that fails as soon as the demo is interrupted.
    pub fn wait_interruptible(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        self.wait_until(timeout, true)
    }

    fn wait_until(&mut self, timeout: Duration, interruptible: bool) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        // Bounded: at most timeout / 10 ms rounds.
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            if interruptible {
                crate::interrupt::check()?;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then SIGKILL if it is still running after `grace`.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        self.signal(libc::SIGTERM)?;
        if let Some(status) = self.wait_timeout(grace)? {
            return Ok(status);
        }
        self.kill();
        Ok(self.try_wait()?.expect("killed child was reaped"))
    }

    /// SIGKILL and reap. Never fails: used from destructors.
    pub fn kill(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
    }

    /// Write to the child's stdin (the child must have been spawned with
    /// [`Spawner::stdin_piped`]).
    pub fn write_stdin(&mut self, data: &str) -> Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .with_context(|| format!("{} has no stdin pipe", self.label))?;
        stdin.write_all(data.as_bytes())?;
        stdin.flush()?;
        Ok(())
    }

    /// Close stdin (the child sees EOF).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stdin = None;
        self.kill();
    }
}
