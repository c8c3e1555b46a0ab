//! The CUDA driver and runtime calls a stretch of work made, by name and by kind: host waits,
//! kernel launches, polls. No CUDA here, so it is tested on every machine; the counts come from
//! CUPTI's callbacks (`census.rs`, the `cuda` feature).
//!
//! Why: issue 56 asks for at most two host waits per layer step at one rank and a launch count
//! that can be explained, and both were read from the code until now. A step's time cannot tell
//! a host wait from a slow kernel; a count of the calls that block the host can. The time spent
//! inside the driver's calls, by the thread that made them ([`Spent`]), says which of them
//! held the step: the H200 runs of BENCHMARKS §14b had the cuBLAS layer's host time at 0.94–0.98
//! of its step at GPT3-XL (the cubecl layer's at 0.14), so some thread waits for the device
//! inside the step, and a count alone cannot say which thread or for how long. The kinds are
//! read from the call's name, so the same rule holds for the driver's names (`cuEventSynchronize`,
//! `cuLaunchKernel_ptsz`) and the runtime's (`cudaStreamSynchronize_v3020`), whatever CUDA
//! version numbers its callbacks.

use std::collections::BTreeMap;
use std::fmt;

/// What a driver or runtime call does to the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    /// Blocks the host until device work has finished: every `…Synchronize`, and the
    /// synchronous copies whose destination may be host memory (`DtoH`, `AtoH`, or no direction
    /// in the name: `cuMemcpy`, `cudaMemcpy`, whose direction is only known from the pointers).
    Wait,
    /// Frees device or pinned memory: `cudaFree` waits for the device, so every free is counted
    /// apart from the plain calls (a step that allocates through cubecl's pools frees nothing).
    Free,
    /// Asks whether work has finished without waiting (`…Query`): one count per question, so a
    /// spin shows as many.
    Poll,
    /// Puts one kernel on a stream (`…LaunchKernel…`, `…LaunchCooperativeKernel…`,
    /// `cuLaunchGrid…`).
    Launch,
    /// Everything else: asynchronous copies, events recorded, streams made to wait on the
    /// device, context and attribute calls.
    Other,
}

impl CallKind {
    /// The kind of the call named `name`, a driver (`cu…`) or runtime (`cuda…`) function as
    /// CUPTI names it.
    pub fn of(name: &str) -> CallKind {
        let base = base_name(name);
        if base.ends_with("Synchronize") {
            return CallKind::Wait;
        }
        if base.starts_with("Memcpy") && !base.contains("Async") {
            // Directions are spelt `DtoH`, `HtoD`, `AtoH`, `DtoA`...: lowercase `to`.
            let to_host = base.contains("toH");
            let no_direction =
                !["toH", "toD", "toA"].iter().any(|d| base.contains(d)) && !base.contains("Peer");
            if to_host || no_direction {
                return CallKind::Wait;
            }
            return CallKind::Other;
        }
        if base.ends_with("Query") {
            return CallKind::Poll;
        }
        if base.contains("Launch") && (base.contains("Kernel") || base.starts_with("LaunchGrid")) {
            return CallKind::Launch;
        }
        if base.starts_with("MemFree") || base.starts_with("Free") || base == "MemHostUnregister" {
            return CallKind::Free;
        }
        CallKind::Other
    }

    /// Every kind, in the order a report prints them.
    pub const ALL: [CallKind; 5] = [
        CallKind::Wait,
        CallKind::Free,
        CallKind::Poll,
        CallKind::Launch,
        CallKind::Other,
    ];

    /// The kind's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::Wait => "host waits",
            CallKind::Free => "frees",
            CallKind::Poll => "polls",
            CallKind::Launch => "launches",
            CallKind::Other => "other calls",
        }
    }
}

/// `name` without its API prefix (`cuda`, `cu`) and without the suffixes that only version it
/// or pick its default-stream flavour (`_v2`, `_v3020`, `_ptsz`, `_ptds`).
fn base_name(name: &str) -> &str {
    let bare = name
        .strip_prefix("cuda")
        .or_else(|| name.strip_prefix("cu"))
        .unwrap_or(name);
    let mut end = bare.len();
    loop {
        let head = &bare[..end];
        let cut = head.rfind('_').filter(|&at| {
            let suffix = &head[at + 1..];
            suffix == "ptsz"
                || suffix == "ptds"
                || (suffix.len() > 1
                    && suffix.starts_with('v')
                    && suffix[1..].bytes().all(|b| b.is_ascii_digit()))
        });
        match cut {
            Some(at) => end = at,
            None => return head,
        }
    }
}

/// Time spent inside the driver's calls of one name on one thread: how many returned, and
/// their nanoseconds from entry to exit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spent {
    /// Calls that returned.
    pub calls: u64,
    /// Nanoseconds inside them, in all.
    pub ns: u64,
}

impl Spent {
    fn less(self, earlier: Spent) -> Spent {
        Spent {
            calls: self.calls.saturating_sub(earlier.calls),
            ns: self.ns.saturating_sub(earlier.ns),
        }
    }

    fn add(&mut self, other: Spent) {
        self.calls += other.calls;
        self.ns += other.ns;
    }
}

/// [`Spent`] by thread name, then by driver call name.
type Times = BTreeMap<String, BTreeMap<String, Spent>>;

/// Calls by name: the driver's, the runtime's, and the kernels the driver launched, over some
/// stretch of work of `steps` steps (1 until [`CallCounts::per`] says otherwise); and, where
/// the census timed them, the time each thread spent inside the driver's calls.
///
/// Only the driver's calls are timed: a runtime call (cuBLAS's) enters the driver for its
/// device work, so the driver's times hold every wait once, where the runtime's would count
/// each twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallCounts {
    driver: BTreeMap<String, u64>,
    runtime: BTreeMap<String, u64>,
    kernels: BTreeMap<String, u64>,
    times: Times,
    steps: u64,
}

impl Default for CallCounts {
    fn default() -> Self {
        CallCounts {
            driver: BTreeMap::new(),
            runtime: BTreeMap::new(),
            kernels: BTreeMap::new(),
            times: BTreeMap::new(),
            steps: 1,
        }
    }
}

impl CallCounts {
    /// Counts from `(name, count)` pairs: driver calls, runtime calls, kernels launched through
    /// the driver. A name given twice adds up; zero counts are left out.
    pub fn new<'a>(
        driver: impl IntoIterator<Item = (&'a str, u64)>,
        runtime: impl IntoIterator<Item = (&'a str, u64)>,
        kernels: impl IntoIterator<Item = (&'a str, u64)>,
    ) -> CallCounts {
        let collect = |pairs: &mut dyn Iterator<Item = (&'a str, u64)>| {
            let mut map = BTreeMap::new();
            for (name, count) in pairs.filter(|(_, c)| *c > 0) {
                *map.entry(name.to_string()).or_insert(0) += count;
            }
            map
        };
        CallCounts {
            driver: collect(&mut driver.into_iter()),
            runtime: collect(&mut runtime.into_iter()),
            kernels: collect(&mut kernels.into_iter()),
            times: BTreeMap::new(),
            steps: 1,
        }
    }

    /// These counts with the time spent in the driver's calls, from `(thread, call, spent)`
    /// triples (a pair given twice adds up; calls that never returned are left out).
    pub fn with_times<'a>(
        mut self,
        times: impl IntoIterator<Item = (&'a str, &'a str, Spent)>,
    ) -> CallCounts {
        for (thread, name, spent) in times.into_iter().filter(|(_, _, s)| s.calls > 0) {
            self.times
                .entry(thread.to_string())
                .or_default()
                .entry(name.to_string())
                .or_default()
                .add(spent);
        }
        self
    }

    /// The calls made since `earlier` was read from the same census: every count less
    /// `earlier`'s (a count cannot fall, so a smaller one means another census: it reads 0).
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let less = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(name, &c)| (name.clone(), c.saturating_sub(*then.get(name).unwrap_or(&0))))
                .filter(|(_, c)| *c > 0)
                .collect()
        };
        let mut times = Times::new();
        for (thread, calls) in &self.times {
            let then = earlier.times.get(thread);
            let spent: BTreeMap<String, Spent> = calls
                .iter()
                .map(|(name, s)| {
                    let before = then.and_then(|t| t.get(name)).copied().unwrap_or_default();
                    (name.clone(), s.less(before))
                })
                .filter(|(_, s)| s.calls > 0)
                .collect();
            if !spent.is_empty() {
                times.insert(thread.clone(), spent);
            }
        }
        CallCounts {
            driver: less(&self.driver, &earlier.driver),
            runtime: less(&self.runtime, &earlier.runtime),
            kernels: less(&self.kernels, &earlier.kernels),
            times,
            steps: 1,
        }
    }

    /// The same counts, read as `steps` steps' worth (`0` is taken as 1).
    pub fn per(mut self, steps: u64) -> CallCounts {
        self.steps = steps.max(1);
        self
    }

    /// How many steps the counts cover.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Driver calls by name, in all.
    pub fn driver(&self) -> &BTreeMap<String, u64> {
        &self.driver
    }

    /// Runtime calls by name, in all.
    pub fn runtime(&self) -> &BTreeMap<String, u64> {
        &self.runtime
    }

    /// Kernels launched through the driver, by name, in all.
    pub fn kernels(&self) -> &BTreeMap<String, u64> {
        &self.kernels
    }

    /// Driver calls of `kind`, in all.
    pub fn driver_of(&self, kind: CallKind) -> u64 {
        of_kind(&self.driver, kind)
    }

    /// Runtime calls of `kind`, in all.
    pub fn runtime_of(&self, kind: CallKind) -> u64 {
        of_kind(&self.runtime, kind)
    }

    /// The threads that made timed driver calls, by name (`unnamed` for a thread without one).
    pub fn threads(&self) -> impl Iterator<Item = &str> {
        self.times.keys().map(String::as_str)
    }

    /// The timed driver calls of `kind`, every thread's together, in all (not per step).
    pub fn spent_of(&self, kind: CallKind) -> Spent {
        let mut total = Spent::default();
        self.times
            .values()
            .for_each(|calls| total.add(spent_in(calls, kind)));
        total
    }

    /// The timed driver calls of `kind` that `thread` made, in all (not per step).
    pub fn spent_on(&self, thread: &str, kind: CallKind) -> Spent {
        self.times
            .get(thread)
            .map_or_else(Spent::default, |calls| spent_in(calls, kind))
    }

    /// Milliseconds per step that `thread` spent inside driver calls of `kind`.
    pub fn ms_per_step(&self, thread: &str, kind: CallKind) -> f64 {
        self.spent_on(thread, kind).ns as f64 / 1e6 / self.steps as f64
    }

    /// Driver and runtime calls of `kind` per step. Where CUPTI reports a runtime call and the
    /// driver call it makes both, the two add up: [`CallCounts::driver_of`] and
    /// [`CallCounts::runtime_of`] keep them apart.
    pub fn per_step(&self, kind: CallKind) -> f64 {
        (self.driver_of(kind) + self.runtime_of(kind)) as f64 / self.steps as f64
    }
}

/// One thread's timed calls of `kind`, added up.
fn spent_in(calls: &BTreeMap<String, Spent>, kind: CallKind) -> Spent {
    let mut total = Spent::default();
    calls
        .iter()
        .filter(|(name, _)| CallKind::of(name) == kind)
        .for_each(|(_, s)| total.add(*s));
    total
}

fn of_kind(calls: &BTreeMap<String, u64>, kind: CallKind) -> u64 {
    calls
        .iter()
        .filter(|(name, _)| CallKind::of(name) == kind)
        .map(|(_, c)| c)
        .sum()
}

/// How many names of each list a report prints.
const SHOWN: usize = 12;

/// `count` over `steps`, as an integer where it divides.
fn per_step_text(count: u64, steps: u64) -> String {
    if count.is_multiple_of(steps) {
        (count / steps).to_string()
    } else {
        format!("{:.2}", count as f64 / steps as f64)
    }
}

impl fmt::Display for CallCounts {
    /// Per step: each kind's driver and runtime counts, then the calls that wait or free by
    /// name, then the kernels launched, most first, `SHOWN` of each at most.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps = self.steps;
        writeln!(f, "per step ({steps} counted):")?;
        for kind in CallKind::ALL {
            writeln!(
                f,
                "  {:<12} driver {:>6}  runtime {:>6}",
                kind.name(),
                per_step_text(self.driver_of(kind), steps),
                per_step_text(self.runtime_of(kind), steps)
            )?;
        }
        let blocking: Vec<(&String, &u64)> = self
            .driver
            .iter()
            .chain(self.runtime.iter())
            .filter(|(name, _)| matches!(CallKind::of(name), CallKind::Wait | CallKind::Free))
            .collect();
        for (name, &c) in blocking.iter().take(SHOWN) {
            writeln!(f, "  wait or free: {name} {}", per_step_text(c, steps))?;
        }
        self.fmt_times(f)?;
        let mut kernels: Vec<(&String, &u64)> = self.kernels.iter().collect();
        kernels.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (name, &c) in kernels.iter().take(SHOWN) {
            // cuBLAS's kernels have C++ names of a hundred characters and more.
            let short: String = name.chars().take(72).collect();
            writeln!(f, "  kernel: {} {short}", per_step_text(c, steps))?;
        }
        if kernels.len() > SHOWN {
            writeln!(f, "  ... {} kernels more", kernels.len() - SHOWN)?;
        }
        Ok(())
    }
}

impl CallCounts {
    /// Per step: each thread's milliseconds inside the driver's calls of each kind (with how
    /// many), then the calls by thread and name, longest first, `SHOWN` at most: any kind, since
    /// a launch or an allocation can hold a thread too (a full launch queue, memory mapped in).
    fn fmt_times(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.times.is_empty() {
            return Ok(());
        }
        let steps = self.steps;
        let ms = |ns: u64| format!("{:.3}", ns as f64 / 1e6 / steps as f64);
        writeln!(f, "  time in driver calls, per step, by thread:")?;
        for (thread, calls) in &self.times {
            let mut line = format!("    {thread:<14}");
            for kind in CallKind::ALL {
                let total = spent_in(calls, kind);
                if total.calls > 0 {
                    let n = per_step_text(total.calls, steps);
                    line.push_str(&format!("  {} {} ms ({n})", kind.name(), ms(total.ns)));
                }
            }
            writeln!(f, "{line}")?;
        }
        let mut longest: Vec<(&String, &String, &Spent)> = self
            .times
            .iter()
            .flat_map(|(thread, calls)| calls.iter().map(move |(name, s)| (thread, name, s)))
            .collect();
        longest.sort_by(|a, b| b.2.ns.cmp(&a.2.ns).then(a.0.cmp(b.0)).then(a.1.cmp(b.1)));
        for (thread, name, s) in longest.iter().take(SHOWN) {
            let n = per_step_text(s.calls, steps);
            writeln!(f, "  in calls: {thread} {name} {} ms ({n})", ms(s.ns))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_every_api_and_version_have_their_kind() {
        let cases = [
            ("cuEventSynchronize", CallKind::Wait),
            ("cuStreamSynchronize_ptsz", CallKind::Wait),
            ("cuCtxSynchronize", CallKind::Wait),
            ("cudaDeviceSynchronize_v3020", CallKind::Wait),
            ("cudaStreamSynchronize_v3020", CallKind::Wait),
            ("cuMemcpyDtoH_v2", CallKind::Wait),
            ("cuMemcpyDtoH_v2_ptds", CallKind::Wait),
            ("cuMemcpyAtoH_v2", CallKind::Wait),
            ("cuMemcpy", CallKind::Wait),
            ("cudaMemcpy_v3020", CallKind::Wait),
            ("cuMemcpy2DUnaligned_v2", CallKind::Wait),
            ("cuMemcpyDtoHAsync_v2", CallKind::Other),
            ("cudaMemcpyAsync_v3020", CallKind::Other),
            ("cuMemcpyHtoD_v2", CallKind::Other),
            ("cuMemcpyDtoD_v2", CallKind::Other),
            ("cuMemcpyPeer", CallKind::Other),
            ("cuEventQuery", CallKind::Poll),
            ("cudaStreamQuery_v3020", CallKind::Poll),
            ("cuLaunchKernel", CallKind::Launch),
            ("cuLaunchKernel_ptsz", CallKind::Launch),
            ("cuLaunchKernelEx_ptsz", CallKind::Launch),
            ("cuLaunchCooperativeKernel", CallKind::Launch),
            ("cuLaunchGridAsync", CallKind::Launch),
            ("cudaLaunchKernel_v7000", CallKind::Launch),
            ("cudaLaunchKernelExC_v11060", CallKind::Launch),
            ("cuLaunchHostFunc", CallKind::Other),
            ("cuMemFree_v2", CallKind::Free),
            ("cuMemFreeHost", CallKind::Free),
            ("cuMemFreeAsync", CallKind::Free),
            ("cudaFree_v3020", CallKind::Free),
            ("cudaFreeHost_v3020", CallKind::Free),
            ("cuMemHostUnregister", CallKind::Free),
            ("cuEventRecord", CallKind::Other),
            ("cuStreamWaitEvent", CallKind::Other),
            ("cuStreamWaitValue32_v2", CallKind::Other),
            ("cuCtxSetCurrent", CallKind::Other),
            ("cuMemAlloc_v2", CallKind::Other),
        ];
        for (name, kind) in cases {
            assert_eq!(CallKind::of(name), kind, "{name}");
        }
    }

    #[test]
    fn version_and_stream_suffixes_come_off_but_nothing_else() {
        assert_eq!(base_name("cuMemcpyDtoH_v2_ptds"), "MemcpyDtoH");
        assert_eq!(base_name("cudaLaunchKernelExC_v11060"), "LaunchKernelExC");
        assert_eq!(base_name("cuStreamSynchronize_ptsz"), "StreamSynchronize");
        // Not a version: a bare `_v`, or letters after it.
        assert_eq!(base_name("cuFoo_v"), "Foo_v");
        assert_eq!(base_name("cuFoo_vx2"), "Foo_vx2");
        assert_eq!(base_name("cuGraphExec_update"), "GraphExec_update");
    }

    fn sample() -> CallCounts {
        CallCounts::new(
            [
                ("cuEventSynchronize", 3),
                ("cuLaunchKernel", 120),
                ("cuStreamWaitEvent", 40),
                ("cuMemcpyDtoHAsync_v2", 2),
                ("cuEventQuery", 0),
            ],
            [("cudaLaunchKernel_v7000", 12), ("cudaStreamSynchronize_v3020", 1)],
            [
                ("gelu_forward", 8),
                ("sm90_gemm", 12),
                ("gelu_forward", 4),
                ("a_fill", 4),
            ],
        )
    }

    #[test]
    fn kinds_add_over_names_and_divide_by_steps() {
        let counts = sample();
        assert_eq!(counts.driver_of(CallKind::Wait), 3);
        assert_eq!(counts.runtime_of(CallKind::Wait), 1);
        assert_eq!(counts.driver_of(CallKind::Launch), 120);
        assert_eq!(counts.runtime_of(CallKind::Launch), 12);
        assert_eq!(counts.driver_of(CallKind::Other), 42);
        assert_eq!(counts.driver_of(CallKind::Poll), 0);
        assert_eq!(counts.kernels()["gelu_forward"], 12);
        assert!(!counts.driver().contains_key("cuEventQuery"));
        let per = counts.per(4);
        assert_eq!(per.per_step(CallKind::Wait), 1.0);
        assert_eq!(per.per_step(CallKind::Launch), 33.0);
        assert_eq!(CallCounts::default().per(0).steps(), 1);
    }

    #[test]
    fn since_subtracts_name_by_name() {
        let later = CallCounts::new(
            [
                ("cuEventSynchronize", 5),
                ("cuLaunchKernel", 150),
                ("cuMemFree_v2", 1),
            ],
            [("cudaLaunchKernel_v7000", 12)],
            [("gelu_forward", 20), ("sm90_gemm", 12)],
        );
        let step = later.since(&sample());
        assert_eq!(step.driver_of(CallKind::Wait), 2);
        assert_eq!(step.driver_of(CallKind::Launch), 30);
        assert_eq!(step.driver_of(CallKind::Free), 1);
        // Unchanged and vanished names leave no zero entries behind.
        assert!(step.runtime().is_empty());
        assert_eq!(step.kernels().len(), 1);
        assert_eq!(step.kernels()["gelu_forward"], 8);
    }

    #[test]
    fn the_report_is_per_step_with_the_waits_by_name() {
        let text = sample().per(4).to_string();
        assert!(text.contains("per step (4 counted):"), "{text}");
        assert!(
            text.contains("host waits   driver   0.75  runtime   0.25"),
            "{text}"
        );
        assert!(
            text.contains("launches     driver     30  runtime      3"),
            "{text}"
        );
        assert!(text.contains("wait or free: cuEventSynchronize 0.75"), "{text}");
        assert!(
            text.contains("wait or free: cudaStreamSynchronize_v3020 0.25"),
            "{text}"
        );
        assert!(!text.contains("wait or free: cuLaunchKernel"), "{text}");
        // Most launched first.
        let gelu = text.find("kernel: 3 gelu_forward").expect("gelu's line");
        let gemm = text.find("kernel: 3 sm90_gemm").expect("the GEMM's line");
        assert!(gelu < gemm, "ties by name: {text}");
        let fill = text.find("kernel: 1 a_fill").expect("the fill's line");
        assert!(gemm < fill, "most launched first, whatever the name: {text}");
        let long = "k".repeat(100);
        let text = CallCounts::new([], [], [(long.as_str(), 1)]).to_string();
        assert!(
            text.contains(&format!("kernel: 1 {}\n", "k".repeat(72))),
            "{text}"
        );
    }

    #[test]
    fn times_are_per_thread_and_step_and_subtract_pair_by_pair() {
        let spent = |calls, ns| Spent { calls, ns };
        let earlier = CallCounts::new([], [], []).with_times([
            ("main", "cuEventSynchronize", spent(1, 1_000_000)),
            ("DSD-0-0", "cuLaunchKernel", spent(10, 50_000)),
        ]);
        let later = CallCounts::new([], [], []).with_times([
            ("main", "cuEventSynchronize", spent(5, 3_000_000)),
            // A pair given twice adds up.
            ("main", "cuEventSynchronize", spent(1, 1_000_000)),
            // Unchanged since `earlier`: no entry is left behind.
            ("DSD-0-0", "cuLaunchKernel", spent(10, 50_000)),
            ("DSD-0-0", "cuEventSynchronize", spent(2, 8_000_000)),
            ("DSD-0-0", "cuLaunchKernel_ptsz", spent(4, 20_000)),
            // A call that never returned is left out.
            ("unnamed", "cuMemFree_v2", spent(0, 5)),
        ]);
        let step = later.since(&earlier).per(2);
        assert_eq!(step.threads().collect::<Vec<_>>(), ["DSD-0-0", "main"]);
        // main: 6 calls and 4 ms less 1 call and 1 ms, over two steps.
        assert_eq!(step.ms_per_step("main", CallKind::Wait), 1.5);
        assert_eq!(step.ms_per_step("DSD-0-0", CallKind::Wait), 4.0);
        assert_eq!(step.ms_per_step("DSD-0-0", CallKind::Launch), 0.01);
        assert_eq!(step.ms_per_step("main", CallKind::Launch), 0.0);
        assert_eq!(step.ms_per_step("nobody", CallKind::Wait), 0.0);
        // The caller's own waits, apart from the device thread's (not per step).
        assert_eq!(step.spent_on("main", CallKind::Wait), spent(5, 3_000_000));
        assert_eq!(step.spent_on("main", CallKind::Launch), spent(0, 0));
        // Every thread's together, not per step.
        assert_eq!(step.spent_of(CallKind::Wait), spent(7, 11_000_000));
        assert_eq!(step.spent_of(CallKind::Free), spent(0, 0));
        let text = step.to_string();
        assert!(
            text.contains("time in driver calls, per step, by thread:"),
            "{text}"
        );
        assert!(
            text.contains("    DSD-0-0         host waits 4.000 ms (1)  launches 0.010 ms (2)\n"),
            "{text}"
        );
        assert!(
            text.contains("    main            host waits 1.500 ms (2.50)\n"),
            "{text}"
        );
        // Longest first, whichever thread made it and whatever its kind.
        let at = |line: &str| text.find(line).unwrap_or_else(|| panic!("{line}: {text}"));
        let runner = at("in calls: DSD-0-0 cuEventSynchronize 4.000 ms (1)");
        let caller = at("in calls: main cuEventSynchronize 1.500 ms (2.50)");
        let launch = at("in calls: DSD-0-0 cuLaunchKernel_ptsz 0.010 ms (2)");
        assert!(runner < caller && caller < launch, "{text}");
        // Counts without times print no time lines.
        assert!(!sample().to_string().contains("time in driver calls"));
    }
}
