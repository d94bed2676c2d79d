//! Ctrl-C handling for the demo: a signal only sets a flag; every wait of the testbed
//! checks it and returns an error, so the caller unwinds normally and the RAII guards
//! remove namespaces, cgroups and pins. Tests never install the handler.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Route SIGINT and SIGTERM to the flag instead of killing the process.
pub fn install_handler() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a valid handler and empty mask is valid; the
        // handler only touches an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            bail!(
                "sigaction({sig}) failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// True once SIGINT/SIGTERM arrived (after [`install_handler`]).
pub fn requested() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fail if interrupted; called by every bounded wait.
pub fn check() -> Result<()> {
    if requested() {
        bail!("interrupted");
    }
    Ok(())
}
