//! Counting every CUDA driver and runtime call of the process with CUPTI's callback API, for the
//! benchmark's host waits and launches per step ([`CallCounts`], `calls.rs`).
//!
//! CUPTI calls [`on_call`] on the thread that makes each call, before the call runs
//! (`CUPTI_API_ENTER`) and after it returns (`CUPTI_API_EXIT`), with the counters this census
//! owns as its user data: no global state, and the counting is a relaxed atomic add per call.
//! Kernel names are taken from launch calls only, where CUPTI documents `symbolName` as valid
//! (CUPTI's `CUpti_CallbackData`). A driver call's entry also writes its start into the call's
//! `correlationData`, which CUPTI keeps for that call's exit callback (zeroed before the
//! entry), so the exit adds the call's duration to its thread's [`Spent`] under a lock: the
//! time each thread spends inside the driver, waits above all (`calls.rs`).
//!
//! CUPTI allows one subscriber per process: a second census, or a profiler attached to the
//! process, makes [`Census::start`] fail with CUPTI's error.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::cupti::result::{enable_domain, get_callback_name, subscribe, unsubscribe};
use cudarc::cupti::sys::{
    CUpti_ApiCallbackSite, CUpti_CallbackData, CUpti_CallbackDomain, CUpti_CallbackId, CUpti_SubscriberHandle,
};

use crate::calls::{CallCounts, CallKind, Spent};
use crate::driver::CudaError;

/// Callback ids looked up per domain: every CUDA 13 driver and runtime function has one below
/// this (CUPTI 13.0's `CUPTI_DRIVER_TRACE_CBID_SIZE` is 754, its runtime's under 600); a call
/// with a higher id is counted as `beyond`.
const IDS: u32 = 2048;

/// One domain's counters and names, indexed by callback id.
struct Domain {
    counts: Vec<AtomicU64>,
    names: Vec<Option<String>>,
    launches: Vec<bool>,
}

impl Domain {
    fn new(domain: CUpti_CallbackDomain) -> Domain {
        let names: Vec<Option<String>> = (0..IDS).map(|id| callback_name(domain, id)).collect();
        let launches = names
            .iter()
            .map(|n| n.as_deref().is_some_and(|n| CallKind::of(n) == CallKind::Launch))
            .collect();
        Domain {
            counts: (0..IDS).map(|_| AtomicU64::new(0)).collect(),
            names,
            launches,
        }
    }

    fn pairs(&self) -> Vec<(&str, u64)> {
        self.names
            .iter()
            .zip(&self.counts)
            .filter_map(|(name, c)| Some((name.as_deref()?, c.load(Ordering::Relaxed))))
            .collect()
    }
}

/// What the callback writes into.
struct Tally {
    driver: Domain,
    runtime: Domain,
    /// Calls of an id CUPTI has no name for, at or over [`IDS`], or of another domain.
    beyond: AtomicU64,
    /// Kernels launched through the driver, by name.
    kernels: Mutex<HashMap<String, u64>>,
    /// What a call's start is measured from.
    epoch: Instant,
    /// Time inside the driver's calls, by thread name, then by callback id.
    times: Mutex<HashMap<String, HashMap<u32, Spent>>>,
}

impl Tally {
    /// Nanoseconds since the census started, at least 1 (0 marks a call whose entry this
    /// census did not see).
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Adds a driver call of `id` that took `ns` to the calling thread's time.
    fn spent(&self, id: u32, ns: u64) {
        // A poisoned lock (a panic while timing) loses this call's time, never the call; and
        // a thread being torn down, whose name is gone, is not timed.
        let Ok(mut times) = self.times.lock() else {
            return;
        };
        let _ = THREAD.try_with(|thread| {
            if !times.contains_key(thread.as_str()) {
                times.insert(thread.clone(), HashMap::new());
            }
            if let Some(calls) = times.get_mut(thread.as_str()) {
                let spent = calls.entry(id).or_default();
                spent.calls += 1;
                spent.ns += ns;
            }
        });
    }
}

thread_local! {
    /// The calling thread's name, read once a thread (cubecl's device threads are `DSD-…`,
    /// burn-fusion's `DSU-…`, the executor's workers `moe-…`).
    static THREAD: String = std::thread::current().name().unwrap_or("unnamed").to_string();
}

/// CUPTI's name for `id` in `domain`, where it has one.
fn callback_name(domain: CUpti_CallbackDomain, id: u32) -> Option<String> {
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: CUPTI writes a pointer to a static string into `name`, or returns an error for an
    // id it does not know.
    unsafe { get_callback_name(domain, id, &mut name) }.ok()?;
    if name.is_null() {
        return None;
    }
    // SAFETY: non-null, CUPTI's static, nul-terminated name.
    Some(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
}

/// Counts one call. CUPTI calls this on the calling thread, before the call (`ENTER`) and after
/// it (`EXIT`); `ENTER` counts, and for a driver call marks its start, whose `EXIT` adds its
/// duration to the thread's time.
///
/// # Safety
/// `userdata` is the [`Tally`] of a live [`Census`] (it unsubscribes before the tally is
/// dropped) and `data` CUPTI's `CUpti_CallbackData` for a driver or runtime call.
unsafe extern "C" fn on_call(
    userdata: *mut c_void,
    domain: CUpti_CallbackDomain,
    id: CUpti_CallbackId,
    data: *const c_void,
) {
    // A panic may not unwind into the driver (it would abort the process): one that escapes
    // the count (a thread's name read while the thread is torn down) loses that call alone.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the function's contract, passed on.
        unsafe { count_call(userdata, domain, id, data) }
    }));
}

/// [`on_call`]'s work.
///
/// # Safety
/// As [`on_call`].
unsafe fn count_call(
    userdata: *mut c_void,
    domain: CUpti_CallbackDomain,
    id: CUpti_CallbackId,
    data: *const c_void,
) {
    if userdata.is_null() || data.is_null() {
        return;
    }
    // SAFETY: the function's contract.
    let (tally, data) = unsafe {
        (
            &*(userdata as *const Tally),
            &*(data as *const CUpti_CallbackData),
        )
    };
    let driver = domain == CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API;
    if data.callbackSite == CUpti_ApiCallbackSite::CUPTI_API_EXIT {
        if driver && !data.correlationData.is_null() {
            // SAFETY: CUPTI's slot for this call, written at its entry (or 0 where the window
            // opened during the call).
            let start = unsafe { *data.correlationData };
            if start > 0 {
                tally.spent(id, tally.now_ns().saturating_sub(start));
            }
        }
        return;
    }
    if data.callbackSite != CUpti_ApiCallbackSite::CUPTI_API_ENTER {
        return;
    }
    if driver && !data.correlationData.is_null() {
        // SAFETY: CUPTI's slot for this call, kept for its exit callback.
        unsafe { *data.correlationData = tally.now_ns() };
    }
    let counters = match domain {
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API => &tally.driver,
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API => &tally.runtime,
        _ => {
            tally.beyond.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let named = counters.names.get(id as usize).is_some_and(Option::is_some);
    let Some(count) = counters.counts.get(id as usize).filter(|_| named) else {
        tally.beyond.fetch_add(1, Ordering::Relaxed);
        return;
    };
    count.fetch_add(1, Ordering::Relaxed);
    let is_driver_launch = driver && counters.launches[id as usize];
    if is_driver_launch && !data.symbolName.is_null() {
        // SAFETY: valid for launch callbacks (CUPTI's `CUpti_CallbackData::symbolName`).
        let name = unsafe { CStr::from_ptr(data.symbolName) }.to_string_lossy();
        // A poisoned lock (a panic while counting) loses this name, never the call.
        if let Ok(mut kernels) = tally.kernels.lock() {
            match kernels.get_mut(name.as_ref()) {
                Some(c) => *c += 1,
                None => {
                    kernels.insert(name.into_owned(), 1);
                }
            }
        }
    }
}

/// A subscription to CUPTI's driver and runtime callbacks that counts every call the process
/// makes within [`Census::count`]'s windows, until it is dropped.
pub struct Census {
    subscriber: CUpti_SubscriberHandle,
    /// Leaked, so that its address, CUPTI's user data, stays valid for good: CUPTI does not say
    /// that `cuptiUnsubscribe` waits for callbacks already running on other threads, so the
    /// counters are never freed under one (a few tens of KB once per census).
    tally: &'static Tally,
}

impl Census {
    /// Subscribes to the driver and runtime domains, with the callbacks off until
    /// [`Census::count`] turns them on. Fails where `libcupti` cannot be loaded
    /// (the GPU machine's PyTorch wheels ship it; `device-env.sh` puts it on the library path)
    /// or CUPTI refuses the subscriber (another one is attached).
    pub fn start() -> Result<Census, CudaError> {
        // SAFETY: this only tries to dlopen libcupti and look up its symbols.
        if !unsafe { cudarc::cupti::sys::is_culib_present() } {
            return Err(CudaError::NoCupti);
        }
        let tally: &'static Tally = Box::leak(Box::new(Tally {
            driver: Domain::new(CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API),
            runtime: Domain::new(CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API),
            beyond: AtomicU64::new(0),
            kernels: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            times: Mutex::new(HashMap::new()),
        }));
        let mut subscriber: CUpti_SubscriberHandle = std::ptr::null_mut();
        let userdata = tally as *const Tally as *mut c_void;
        // SAFETY: `on_call` reads `userdata` as the tally, which is never freed.
        unsafe { subscribe(&mut subscriber, Some(on_call), userdata) }
            .map_err(|e| CudaError::Cupti(format!("cuptiSubscribe: {:?}", e.0)))?;
        Ok(Census { subscriber, tally })
    }

    /// Turns the callbacks of both domains on or off.
    fn enable(&self, on: bool) -> Result<(), CudaError> {
        for domain in [
            CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API,
            CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API,
        ] {
            // SAFETY: the subscriber lives as long as `self`.
            unsafe { enable_domain(u32::from(on), self.subscriber, domain) }
                .map_err(|e| CudaError::Cupti(format!("cuptiEnableDomain: {:?}", e.0)))?;
        }
        Ok(())
    }

    /// The calls every thread of the process makes while `work` runs: the callbacks are on for
    /// `work` alone, so what runs outside it pays nothing for the census. `work` must end with
    /// its device work queued (a sync or a read at its end), or a call it caused on another
    /// thread may fall after the window.
    pub fn count<R>(&self, work: impl FnOnce() -> R) -> Result<(R, CallCounts), CudaError> {
        let before = self.counts();
        self.enable(true)?;
        let out = work();
        self.enable(false)?;
        Ok((out, self.counts().since(&before)))
    }

    /// Every call counted since the census started.
    fn counts(&self) -> CallCounts {
        let kernels = match self.tally.kernels.lock() {
            Ok(k) => k.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let times = match self.tally.times.lock() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let names = &self.tally.driver.names;
        let timed = times.iter().flat_map(|(thread, calls)| {
            calls.iter().filter_map(move |(&id, &spent)| {
                let name = names.get(id as usize)?.as_deref()?;
                Some((thread.as_str(), name, spent))
            })
        });
        CallCounts::new(
            self.tally.driver.pairs(),
            self.tally.runtime.pairs(),
            kernels.iter().map(|(name, &c)| (name.as_str(), c)),
        )
        .with_times(timed)
    }

    /// Calls CUPTI reported with an id this census has no name for: 0 unless CUPTI grew.
    pub fn unnamed(&self) -> u64 {
        self.tally.beyond.load(Ordering::Relaxed)
    }
}

impl Drop for Census {
    fn drop(&mut self) {
        // SAFETY: the subscriber is live; the tally stays (see the field).
        let _ = unsafe { unsubscribe(self.subscriber) };
    }
}
