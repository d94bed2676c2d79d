//! What one CPU spent on a block of connections, read by the client around each block
//! of the `paired-cpu` mode (see [`crate::netio`]).
//!
//! Two sources, read together:
//!
//! - **Task clocks (the judged figure).** The scheduler's `sum_exec_runtime` of every
//!   task that does a connection's work: the client (this process), the servers, and
//!   the CPU's `ksoftirqd`. It is kept in nanoseconds and read exactly through each
//!   process's CPU-time clock (`clock_getcpuclockid`). On this kernel
//!   (`CONFIG_TICK_CPU_ACCOUNTING`, no `IRQ_TIME_ACCOUNTING`) a task's runtime also holds
//!   the softirq and hardirq work that ran while it was current, and with client and
//!   servers pinned to one CPU that is where the veth traffic is processed: the
//!   sender's `local_bh_enable` runs the NET_RX softirq (and TC, and the socket hooks)
//!   in the sending task; what overflows the softirq budget goes to `ksoftirqd`,
//!   counted too. Two things make it the better source on this machine: it is exact
//!   where the tick counters below are a 4 ms statistical sample, and it sees only
//!   these tasks, where a CPU's counters also count whatever else the scheduler puts
//!   on that CPU (this 2-vCPU VM is shared: other engineers' builds land there).
//!   What it misses: softirq work that happens to run while another task or the idle
//!   task is current (timer softirqs such as the server's TIME_WAIT expiry, 60 s
//!   after the connection, which then falls on both sides alike) and the steal
//!   time a VM cannot tell from running (no `PARAVIRT_TIME_ACCOUNTING`), which also
//!   falls on both sides alike. It includes the user time of client and servers,
//!   which is the same code on both sides: [`user_ns`] estimates it (from the
//!   tick-sampled split the kernel keeps per task) so that it can be taken out.
//! - **The CPU's `/proc/stat` line** (`cpuN`: user, system, softirq, irq ... in
//!   USER_HZ units), the literal "sys + softirq" of the target, as a cross-check. Each
//!   4 ms tick (HZ=250) charges the whole tick to what the CPU was doing at that
//!   instant, so it needs many ticks (sizing in `run::Config::new`), and it counts
//!   every task on the CPU.

use std::fs;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::run::Stat;

/// `/proc/stat` counters of one CPU, in USER_HZ ticks (10 ms here, whatever HZ is).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Ticks {
    pub user: u64,
    pub nice: u64,
    pub system: u64,
    pub idle: u64,
    pub iowait: u64,
    pub irq: u64,
    pub softirq: u64,
    pub steal: u64,
}

impl Ticks {
    /// The `cpuN` line of `/proc/stat` text.
    pub fn parse(stat: &str, cpu: usize) -> Result<Ticks> {
        let tag = format!("cpu{cpu}");
        let line = stat
            .lines()
            .find(|l| l.split_whitespace().next() == Some(tag.as_str()))
            .with_context(|| format!("/proc/stat has no {tag} line"))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("/proc/stat line {line:?}"))?;
        if v.len() < 8 {
            bail!("/proc/stat line {line:?}: fewer than 8 counters");
        }
        Ok(Ticks {
            user: v[0],
            nice: v[1],
            system: v[2],
            idle: v[3],
            iowait: v[4],
            irq: v[5],
            softirq: v[6],
            steal: v[7],
        })
    }

    fn read(cpu: usize) -> Result<Ticks> {
        Ticks::parse(&fs::read_to_string("/proc/stat")?, cpu)
    }

    /// Counters since `earlier` (each counter only grows).
    pub fn since(&self, earlier: &Ticks) -> Ticks {
        Ticks {
            user: self.user.saturating_sub(earlier.user),
            nice: self.nice.saturating_sub(earlier.nice),
            system: self.system.saturating_sub(earlier.system),
            idle: self.idle.saturating_sub(earlier.idle),
            iowait: self.iowait.saturating_sub(earlier.iowait),
            irq: self.irq.saturating_sub(earlier.irq),
            softirq: self.softirq.saturating_sub(earlier.softirq),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }

    pub fn add(&mut self, d: &Ticks) {
        self.user += d.user;
        self.nice += d.nice;
        self.system += d.system;
        self.idle += d.idle;
        self.iowait += d.iowait;
        self.irq += d.irq;
        self.softirq += d.softirq;
        self.steal += d.steal;
    }

    /// system + softirq + irq: the kernel's share.
    pub fn kernel(&self) -> u64 {
        self.system + self.softirq + self.irq
    }
}

/// USER_HZ: the unit of `/proc/stat` and of `/proc/PID/stat` times.
pub fn user_hz() -> u64 {
    // SAFETY: sysconf only reads a constant of the C library.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

/// A process's CPU-time clock: its `sum_exec_runtime` over all its threads, exact.
struct TaskClock {
    pid: u32,
    clock: libc::clockid_t,
}

impl TaskClock {
    fn of(pid: u32) -> Result<TaskClock> {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: writes one clockid_t into the variable we own.
        let rc = unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) };
        if rc != 0 {
            bail!(
                "clock_getcpuclockid({pid}): {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
        Ok(TaskClock { pid, clock })
    }

    fn this_process() -> TaskClock {
        TaskClock {
            pid: std::process::id(),
            clock: libc::CLOCK_PROCESS_CPUTIME_ID,
        }
    }

    fn ns(&self) -> Result<u64> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we own.
        if unsafe { libc::clock_gettime(self.clock, &mut ts) } != 0 {
            bail!(
                "CPU clock of pid {} (did it exit?): {}",
                self.pid,
                std::io::Error::last_os_error()
            );
        }
        Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
}

/// The pid of `ksoftirqd/CPU` (kernel threads are listed in /proc like any task).
fn ksoftirqd(cpu: usize) -> Result<u32> {
    let want = format!("ksoftirqd/{cpu}");
    for entry in fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if fs::read_to_string(entry.path().join("comm")).is_ok_and(|c| c.trim() == want) {
            return Ok(pid);
        }
    }
    bail!("no {want} thread in /proc")
}

/// Everything read at a block's edges.
#[derive(Clone, Copy, Debug, Default)]
pub struct Snapshot {
    /// Client + servers + ksoftirqd, ns.
    pub tasks_ns: u64,
    /// Of which ksoftirqd.
    pub ksoftirqd_ns: u64,
    pub ticks: Ticks,
}

/// The tasks and the CPU a paired-cpu run watches.
pub struct Probe {
    cpu: usize,
    /// This process first, then the servers.
    tasks: Vec<TaskClock>,
    ksoftirqd: TaskClock,
}

impl Probe {
    /// Watch this process, `servers` and the `ksoftirqd` of `cpu`.
    pub fn new(cpu: usize, servers: &[u32]) -> Result<Probe> {
        let mut tasks = vec![TaskClock::this_process()];
        for &pid in servers {
            tasks.push(TaskClock::of(pid)?);
        }
        Ok(Probe {
            cpu,
            tasks,
            ksoftirqd: TaskClock::of(ksoftirqd(cpu)?)?,
        })
    }

    pub fn read(&self) -> Result<Snapshot> {
        let mut tasks_ns = 0;
        for t in &self.tasks {
            tasks_ns += t.ns()?;
        }
        let ksoftirqd_ns = self.ksoftirqd.ns()?;
        Ok(Snapshot {
            tasks_ns: tasks_ns + ksoftirqd_ns,
            ksoftirqd_ns,
            ticks: Ticks::read(self.cpu)?,
        })
    }

    /// User time so far of this process and the servers, ns (see [`user_ns`]).
    pub fn user_ns(&self) -> Result<u64> {
        let mut total = 0;
        for t in &self.tasks {
            total += user_ns(t.pid)?;
        }
        Ok(total)
    }
}

/// The user time of process `pid` so far, in ns: `utime` of `/proc/PID/stat`, which the
/// kernel derives from the exact runtime split in proportion to the ticks that found the
/// process in user mode (a sample again, but of a small share: its error moves the
/// judged ratio only in second order, see `run::CpuCost`).
pub fn user_ns(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    user_ticks(&stat).map(|t| t * 1_000_000_000 / user_hz())
}

/// Field 14 (`utime`) of a `/proc/PID/stat` line; the command name (field 2) may hold
/// spaces and parentheses, so counting starts after its last `)`.
fn user_ticks(stat: &str) -> Result<u64> {
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("/proc/PID/stat without a command name")?;
    // After the name: field 3 (state) is the first; utime is field 14.
    rest.split_whitespace()
        .nth(11)
        .context("/proc/PID/stat too short")?
        .parse()
        .context("utime of /proc/PID/stat")
}

/// The exact CPU time so far of process `pid` (all its threads), ns.
pub fn process_ns(pid: u32) -> Result<u64> {
    TaskClock::of(pid)?.ns()
}

/// A datapath's CPU per connection from its paired-cpu runs (one per repetition),
/// stored in results.json.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CpuCost {
    /// Connections per side, over all repetitions.
    pub connections: u64,
    /// Judged: CPU µs per connection of client, servers and ksoftirqd (task clocks,
    /// exact) minus their user time; all repetitions pooled.
    pub kernel_us: f64,
    pub baseline_kernel_us: f64,
    /// kernel_us / baseline_kernel_us.
    pub ratio: f64,
    /// The same ratio per repetition.
    pub ratio_reps: Option<Stat>,
    /// User time of client and servers per connection (both sides; the same code
    /// runs on both). Its error `e` moves the ratio by `e (ratio - 1) / kernel`:
    /// second order next to a ratio near 1.
    pub user_us: f64,
    /// Of kernel_us, what ksoftirqd ran (softirq work deferred past its budget).
    pub ksoftirqd_us: f64,
    pub baseline_ksoftirqd_us: f64,
    /// Cross-check from the CPU's /proc/stat: (system + softirq + irq) ticks per
    /// connection, in µs; statistical (4 ms ticks) and counting every task on the CPU.
    pub ticks_kernel_us: f64,
    pub ticks_baseline_kernel_us: f64,
    pub ticks_ratio: f64,
    /// User ticks per connection, both sides.
    pub ticks_user_us: f64,
    /// Share of the blocks' ticks the CPU was idle: work the task clocks cannot see
    /// may hide there (softirq run from idle), and with a share near 0 there is none.
    pub ticks_idle_share: f64,
    /// The agent's CPU time (all threads, any CPU) over the runs per target
    /// connection, µs: not part of the ratio (the conntrack GC it runs every 5 s is
    /// not tied to a block), shown beside it.
    pub agent_us: Option<f64>,
    /// What the clients reported, per repetition.
    pub runs: Vec<PairedCpuRun>,
}

/// One repetition's [`crate::netio::PairedCpu`], as stored.
pub type PairedCpuRun = crate::netio::PairedCpu;

impl CpuCost {
    /// Pools the repetitions; None without a connection or a positive baseline.
    pub fn of(runs: &[PairedCpuRun]) -> Option<CpuCost> {
        let kernel = |r: &PairedCpuRun| -> Option<(f64, f64)> {
            let (t, b) = (&r.target, &r.baseline);
            let user = r.user_ns as f64 / (t.connections + b.connections) as f64;
            let per = |s: &crate::netio::CpuSide| s.tasks_ns as f64 / s.connections as f64;
            let (kt, kb) = (per(t) - user, per(b) - user);
            (t.connections > 0 && b.connections > 0 && kb > 0.0).then_some((kt, kb))
        };
        let ratio_reps: Vec<f64> = runs.iter().filter_map(kernel).map(|(t, b)| t / b).collect();
        let mut all = PairedCpuRun::default();
        for r in runs {
            for (sum, side) in [
                (&mut all.target, &r.target),
                (&mut all.baseline, &r.baseline),
            ] {
                sum.connections += side.connections;
                sum.tasks_ns += side.tasks_ns;
                sum.ksoftirqd_ns += side.ksoftirqd_ns;
                sum.ticks.add(&side.ticks);
                sum.wall_ns += side.wall_ns;
            }
            all.user_ns += r.user_ns;
            all.agent_ns = match (all.agent_ns, r.agent_ns) {
                (None, a) => a,
                (Some(x), a) => Some(x + a.unwrap_or(0)),
            };
            all.user_hz = r.user_hz;
        }
        let (kt, kb) = kernel(&all)?;
        let (t, b) = (&all.target, &all.baseline);
        let tick_ns = 1e9 / all.user_hz.max(1) as f64;
        let us_per = |ticks: u64, n: u64| ticks as f64 * tick_ns / n as f64 / 1000.0;
        let ticks_t = us_per(t.ticks.kernel(), t.connections);
        let ticks_b = us_per(b.ticks.kernel(), b.connections);
        let mut both = t.ticks;
        both.add(&b.ticks);
        let counted = both.kernel() + both.user + both.nice + both.idle + both.iowait;
        Some(CpuCost {
            connections: t.connections,
            kernel_us: kt / 1000.0,
            baseline_kernel_us: kb / 1000.0,
            ratio: kt / kb,
            ratio_reps: Stat::of(ratio_reps),
            user_us: all.user_ns as f64 / (t.connections + b.connections) as f64 / 1000.0,
            ksoftirqd_us: t.ksoftirqd_ns as f64 / t.connections as f64 / 1000.0,
            baseline_ksoftirqd_us: b.ksoftirqd_ns as f64 / b.connections as f64 / 1000.0,
            ticks_kernel_us: ticks_t,
            ticks_baseline_kernel_us: ticks_b,
            ticks_ratio: if ticks_b > 0.0 {
                ticks_t / ticks_b
            } else {
                0.0
            },
            ticks_user_us: us_per(both.user + both.nice, t.connections + b.connections),
            ticks_idle_share: (both.idle + both.iowait) as f64 / counted.max(1) as f64,
            agent_us: all
                .agent_ns
                .map(|a| a as f64 / t.connections as f64 / 1000.0),
            runs: runs.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  921901 2575310 837734 449333 13179 0 91066 47720 0 0\n\
                        cpu0 472799 1290258 377704 277688 4739 0 21330 23936 0 0\n\
                        cpu1 449102 1285052 460029 171645 8440 3 69735 23783 0 0\n\
                        intr 1 2 3\n";

    #[test]
    fn picks_the_cpu_line_not_the_total_or_a_longer_number() {
        let t = Ticks::parse(STAT, 1).unwrap();
        assert_eq!(t.user, 449102);
        assert_eq!(t.system, 460029);
        assert_eq!(t.irq, 3);
        assert_eq!(t.softirq, 69735);
        assert_eq!(t.steal, 23783);
        assert_eq!(t.kernel(), 460029 + 69735 + 3);
        // "cpu1" must not match "cpu10".
        let ten = STAT.replace("cpu1 ", "cpu10 ");
        assert!(Ticks::parse(&ten, 1).is_err());
        assert!(Ticks::parse(STAT, 2).is_err());
    }

    #[test]
    fn since_and_add() {
        let a = Ticks::parse(STAT, 0).unwrap();
        let b = Ticks::parse(STAT, 1).unwrap();
        let d = b.since(&a);
        assert_eq!(d.system, 460029 - 377704);
        // A counter that went down (never does) gives 0, not a wrap.
        assert_eq!(d.user, 0);
        let mut sum = Ticks::default();
        sum.add(&d);
        sum.add(&d);
        assert_eq!(sum.softirq, 2 * (69735 - 21330));
    }

    #[test]
    fn utime_after_a_command_name_with_spaces() {
        let line = "4242 (lb bench) (x) S 1 2 3 4 5 6 7 8 9 10 777 888 0 0 20 0 1 0";
        assert_eq!(user_ticks(line).unwrap(), 777);
    }

    #[test]
    fn clocks_of_this_process_and_ksoftirqd_run_forward() {
        let me = std::process::id();
        let a = process_ns(me).unwrap();
        // Burn a little CPU so the clock must move.
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let b = process_ns(me).unwrap();
        assert!(b > a, "{b} <= {a}");
        assert!(ksoftirqd(0).is_ok());
        assert!(user_ns(me).is_ok());
    }

    fn side(connections: u64, tasks_ns: u64, system: u64) -> crate::netio::CpuSide {
        crate::netio::CpuSide {
            connections,
            tasks_ns,
            ksoftirqd_ns: 0,
            ticks: Ticks {
                system,
                softirq: system / 4,
                ..Default::default()
            },
            wall_ns: tasks_ns,
        }
    }

    #[test]
    fn cost_takes_the_shared_user_time_out_of_both_sides_and_pools_repetitions() {
        // 1000 connections a side; 110 µs and 100 µs of task time each, 10 µs of
        // which is user time (20 ms over 2000 connections).
        let run = PairedCpuRun {
            target: side(1000, 110_000_000, 8),
            baseline: side(1000, 100_000_000, 8),
            user_ns: 20_000_000,
            agent_ns: Some(5_000_000),
            user_hz: 100,
        };
        let c = CpuCost::of(&[run.clone(), run]).unwrap();
        assert_eq!(c.connections, 2000);
        assert!((c.kernel_us - 100.0).abs() < 1e-9, "{}", c.kernel_us);
        assert!((c.baseline_kernel_us - 90.0).abs() < 1e-9);
        assert!((c.ratio - 100.0 / 90.0).abs() < 1e-12);
        assert!((c.user_us - 10.0).abs() < 1e-9);
        let reps = c.ratio_reps.unwrap();
        assert_eq!(reps.samples.len(), 2);
        assert!((reps.median - c.ratio).abs() < 1e-12);
        // 16 ticks of system + 4 of softirq, 10 ms each, over 2000 connections.
        assert!(
            (c.ticks_kernel_us - 100.0).abs() < 1e-9,
            "{}",
            c.ticks_kernel_us
        );
        assert!((c.ticks_ratio - 1.0).abs() < 1e-12);
        assert_eq!(c.agent_us, Some(5.0));
    }

    #[test]
    fn no_cost_without_connections() {
        let run = PairedCpuRun {
            target: side(0, 0, 0),
            baseline: side(1000, 100_000_000, 8),
            user_hz: 100,
            ..Default::default()
        };
        assert!(CpuCost::of(&[run]).is_none());
        assert!(CpuCost::of(&[]).is_none());
    }
}
