//! Keeping a rayon pool's other threads awake through a run of short parallel regions.
//!
//! A decode step is a chain of products, each split over the pool and each lasting tens of
//! microseconds, with single-threaded work between them (attention on a few rows, routing,
//! norms). Between two regions an idle rayon worker yields a few dozen times and then sleeps
//! (rayon-core 1.13 `sleep/mod.rs`: 32 rounds of `yield_now` before it is sleepy, then a
//! condition variable), and waking it again took 50–250 µs on this project's 2-vCPU VM
//! (BENCHMARKS §13i) — as long as the half of a product it was woken for. So a decode step on
//! two threads ran many of its products on one (`perf`: the waking thread's
//! `_raw_spin_unlock_irqrestore` and the sleeper's `__schedule`, BENCHMARKS §13m).
//!
//! [`HotPool`] parks a job on every other thread of the current pool that keeps looking for
//! work (`rayon::yield_now`, which runs a pending job of the pool if there is one) until the
//! guard is dropped: the threads steal each product's halves as soon as they are pushed, as
//! llama.cpp's threads, waiting at a polling barrier between ops (`ggml_barrier`), take its
//! next op. The cost is those threads' cores, busy for as long as the guard lives, so it is for
//! a stretch of work that keeps the pool busy anyway: a generation, not a training step with
//! long single-threaded phases.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// While alive, the current rayon pool's other threads wait for work awake (see the module's
/// docs). Dropping it lets them sleep again as rayon's own idle threads do.
#[derive(Debug)]
pub struct HotPool {
    stop: Arc<AtomicBool>,
    spinning: Arc<AtomicUsize>,
}

impl HotPool {
    /// Parks a spinning job on every thread of the current pool (the pool this thread is a
    /// worker of, else rayon's global pool) but this one. On a pool of one thread, or from a
    /// thread outside any pool whose pool has one thread, it does nothing.
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let spinning = Arc::new(AtomicUsize::new(0));
        let caller = rayon::current_thread_index();
        if rayon::current_num_threads() > 1 {
            let (flag, count) = (stop.clone(), spinning.clone());
            rayon::spawn_broadcast(move |ctx| {
                if Some(ctx.index()) == caller || flag.load(Ordering::Acquire) {
                    return;
                }
                count.fetch_add(1, Ordering::AcqRel);
                while !flag.load(Ordering::Acquire) {
                    // A pending job of the pool (a product's half) if there is one, else a
                    // pause: the thread never sleeps while the guard lives.
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::hint::spin_loop();
                    }
                }
                count.fetch_sub(1, Ordering::AcqRel);
            });
        }
        Self { stop, spinning }
    }

    /// How many threads are spinning now (they start as the pool picks up their jobs).
    pub fn spinning(&self) -> usize {
        self.spinning.load(Ordering::Acquire)
    }
}

impl Drop for HotPool {
    fn drop(&mut self) {
        // The spinning jobs see the flag and return; nothing waits for them (the caller's own
        // broadcast job, queued on its thread, may only run after the caller returns).
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::HotPool;

    /// Inside a pool of three threads, both other threads spin while the guard lives (the
    /// caller's thread does not), the pool's work still runs and gives its values meanwhile
    /// (the spinning threads run its jobs), and once the guard is dropped they stop: no thread
    /// spins, and a `broadcast`, which needs every thread, completes.
    #[test]
    fn the_other_threads_spin_while_hot_and_return_when_dropped() {
        use rayon::prelude::*;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let wait_for = |what: &dyn Fn() -> bool| {
            let started = Instant::now();
            while !what() && started.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(1));
            }
            what()
        };
        let spinning = pool.install(|| {
            let hot = HotPool::start();
            assert!(
                wait_for(&|| hot.spinning() == 2),
                "{} threads spin",
                hot.spinning()
            );
            let sum: u64 = (0..10_000u64).into_par_iter().map(|i| i * i).sum();
            assert_eq!(sum, (0..10_000u64).map(|i| i * i).sum::<u64>());
            assert_eq!(
                hot.spinning(),
                2,
                "the caller's thread spins, or a spinner stopped"
            );
            let spinning = hot.spinning.clone();
            drop(hot);
            spinning
        });
        assert!(
            wait_for(&|| spinning.load(Ordering::Acquire) == 0),
            "threads still spin"
        );
        let count = AtomicUsize::new(0);
        pool.broadcast(|_| count.fetch_add(1, Ordering::Relaxed));
        assert_eq!(count.load(Ordering::Relaxed), 3);
    }

    /// On a pool of one thread nothing spins.
    #[test]
    fn a_pool_of_one_has_nothing_to_keep_awake() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(|| assert_eq!(HotPool::start().spinning(), 0));
    }
}
