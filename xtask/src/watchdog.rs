//! A time budget for a whole task. CI gives a run 90 minutes and the project aims
//! at 40: a step that hangs (a test waiting on something that never comes, a
//! registry that stops answering) must end the run with a report of what was
//! still running, not run out the CI clock with no word of where it stood.

use std::collections::BTreeMap;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use procfs::Current;

/// Starts a thread that, `budget` from now, prints this process's descendants
/// (the stuck step and its children, with their ages), ends them and exits 124,
/// as `timeout(1)` does.
pub fn arm(task: &'static str, budget: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(budget);
        let me = std::process::id() as i32;
        let tree = descendants(me);
        eprintln!(
            "xtask {task}: over its budget of {} s; still running:",
            budget.as_secs()
        );
        for p in &tree {
            eprintln!("  {p}");
        }
        end(&tree);
        std::process::exit(124);
    });
}

/// One process below us, as `ps` would show it.
struct Proc {
    pid: i32,
    depth: usize,
    age_secs: u64,
    cmdline: String,
}

impl std::fmt::Display for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let indent = "  ".repeat(self.depth);
        write!(
            f,
            "{indent}{} ({} s) {}",
            self.pid, self.age_secs, self.cmdline
        )
    }
}

/// Every descendant of `root`, parents before their children.
fn descendants(root: i32) -> Vec<Proc> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    let ticks = procfs::ticks_per_second().max(1);
    let uptime = procfs::Uptime::current()
        .map(|u| u.uptime)
        .unwrap_or_default();
    let mut children: BTreeMap<i32, Vec<(i32, u64, String)>> = BTreeMap::new();
    for p in all.flatten() {
        let Ok(stat) = p.stat() else { continue };
        let started = stat.starttime / ticks;
        let age = (uptime as u64).saturating_sub(started);
        let cmdline = p
            .cmdline()
            .ok()
            .filter(|c| !c.is_empty())
            .map(|c| c.join(" "))
            .unwrap_or_else(|| format!("[{}]", stat.comm));
        children
            .entry(stat.ppid)
            .or_default()
            .push((stat.pid, age, cmdline));
    }
    let mut out = Vec::new();
    walk(root, 0, &mut children, &mut out);
    out
}

fn walk(
    pid: i32,
    depth: usize,
    children: &mut BTreeMap<i32, Vec<(i32, u64, String)>>,
    out: &mut Vec<Proc>,
) {
    for (child, age_secs, cmdline) in children.remove(&pid).unwrap_or_default() {
        out.push(Proc {
            pid: child,
            depth,
            age_secs,
            cmdline,
        });
        walk(child, depth + 1, children, out);
    }
}

/// SIGTERM to every process (their cleanup runs where they have one), then
/// SIGKILL to whatever is left after a grace period.
fn end(procs: &[Proc]) {
    for p in procs {
        let _ = kill(Pid::from_raw(p.pid), Signal::SIGTERM);
    }
    std::thread::sleep(Duration::from_secs(10));
    for p in procs {
        let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_found_with_its_command_line() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        // Between fork and exec the child has no command line of its own yet
        // (read then, it showed as "[sleep]"): wait until it has, bounded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read(format!("/proc/{}/cmdline", child.id()))
            .is_ok_and(|c| c != b"sleep\x0030\x00")
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
        let tree = descendants(std::process::id() as i32);
        let _ = child.kill();
        let _ = child.wait();
        let found = tree
            .iter()
            .find(|p| p.pid == child.id() as i32)
            .expect("the child is listed");
        assert_eq!(found.cmdline, "sleep 30");
        assert_eq!(found.depth, 0);
    }
}
