//! What the machine was doing during a scenario: the figures of a shared machine
//! move 10-30% from one run to the next, and these say how loaded it was.

use serde_json::json;

/// Load average and CPU time counters (Linux `/proc`); `None` elsewhere.
pub(crate) struct MachineAtStart {
    load: Option<f64>,
    cpu: Option<CpuTimes>,
}

/// The aggregate `cpu` line of `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CpuTimes {
    total: u64,
    steal: u64,
    /// Idle, waiting for I/O included.
    idle: u64,
    iowait: u64,
}

/// Shares of the CPU time between two readings of [`CpuTimes`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct CpuShares {
    pub(crate) idle: f64,
    /// The virtual CPUs were runnable but the host ran something else.
    pub(crate) steal: f64,
    /// Idle with I/O outstanding (a commit waiting for its WAL flush shows here).
    pub(crate) iowait: f64,
}

impl CpuTimes {
    pub(crate) fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let fields: Vec<u64> = stat
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal [guest guest_nice]: guest
        // time is already counted in user and nice.
        let get = |i: usize| fields.get(i).copied().unwrap_or(0);
        Some(Self {
            total: (0..8).map(get).sum(),
            steal: get(7),
            idle: get(3) + get(4),
            iowait: get(4),
        })
    }

    /// The shares of the time from this reading to `later`; `None` when no tick
    /// passed.
    pub(crate) fn shares_until(&self, later: &Self) -> Option<CpuShares> {
        let total = later.total.checked_sub(self.total).filter(|&t| t > 0)? as f64;
        let share = |x: u64, y: u64| y.saturating_sub(x) as f64 / total;
        Some(CpuShares {
            idle: share(self.idle, later.idle),
            steal: share(self.steal, later.steal),
            iowait: share(self.iowait, later.iowait),
        })
    }
}

impl MachineAtStart {
    pub(crate) fn now() -> Self {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok());
        Self {
            load,
            cpu: CpuTimes::read(),
        }
    }

    /// Text for a result line and JSON for the report: the load average at the
    /// start, and the shares of CPU time that were idle and that the host took
    /// (steal: the virtual CPUs were runnable but not run) since the start.
    pub(crate) fn since(&self) -> (String, serde_json::Value) {
        let shares = self
            .cpu
            .zip(CpuTimes::read())
            .and_then(|(a, b)| a.shares_until(&b))
            .map(|s| (s.idle, s.steal));
        let mut parts = Vec::new();
        if let Some(load) = self.load {
            parts.push(format!("load {load:.1} at start"));
        }
        if let Some((idle, steal)) = shares {
            parts.push(format!(
                "CPU idle {:.0}%, host steal {:.0}%",
                idle * 100.0,
                steal * 100.0
            ));
        }
        let text = if parts.is_empty() {
            String::new()
        } else {
            format!(" [machine: {}]", parts.join(", "))
        };
        let json = json!({
            "load_at_start": self.load,
            "cpu_idle_share": shares.map(|s| s.0),
            "cpu_steal_share": shares.map(|s| s.1),
        });
        (text, json)
    }
}

/// The machine in one line: CPU model and count, memory, kernel.
pub(crate) fn describe() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or("unknown memory".into(), |kb| {
            format!("{:.0} GiB", kb / 1024.0 / 1024.0)
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or("unknown kernel".into(), |k| format!("Linux {}", k.trim()));
    format!("{cpus} x {model}, {memory_gib}, {kernel}")
}
