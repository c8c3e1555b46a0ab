//! Rank threads for the benchmarks: each keeps a layer replica and its input, and runs one
//! forward + backward per command, so that benchmark iterations time only the pass.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::comm::GroupOptions;
use mpipemoe::{LocalGroup, MoeBackend, MoeLayerConfig, MoeStats};

use crate::backends::BackendJob;
use crate::inputs::{balance_router, skewed_tokens, Skew};

/// What the ranks run: the layer, its batch and the ranks' compute budget.
#[derive(Debug, Clone)]
pub struct RankSetup {
    /// The layer (every rank builds its part).
    pub config: MoeLayerConfig,
    /// Ranks (threads).
    pub n_ranks: usize,
    /// Tokens per rank.
    pub tokens: usize,
    /// How the tokens route (the router is set to [`crate::inputs::balanced_router`]).
    pub skew: Skew,
    /// Each rank's own pool of this many threads (`None`: the shared global pool).
    pub threads_per_rank: Option<usize>,
}

/// Ranks started by [`StartRanks`], waiting for [`BenchRanks::step`].
pub struct BenchRanks {
    commands: Vec<Sender<bool>>,
    done: Receiver<(usize, Duration, MoeStats)>,
    threads: Vec<JoinHandle<()>>,
    /// What [`run`](Self::run) timed: each step's slowest rank, and the last step's
    /// statistics.
    record: Mutex<(Vec<Duration>, Vec<MoeStats>)>,
}

/// Starts [`BenchRanks`] on the chosen backend ([`crate::backends::run_on`]).
pub struct StartRanks<'a>(pub &'a RankSetup);

impl BackendJob for StartRanks<'_> {
    type Output = BenchRanks;

    fn run<B>(self, _device: &B::Device) -> BenchRanks
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        BenchRanks::new::<B>(self.0.clone())
    }
}

impl BenchRanks {
    fn new<B: AutodiffBackend + MoeBackend>(setup: RankSetup) -> Self {
        let (done_tx, done) = channel();
        let mut commands = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..setup.n_ranks {
            let (tx, rx) = channel::<bool>();
            commands.push(tx);
            receivers.push(Mutex::new(Some(rx)));
        }
        let receivers = Arc::new(receivers);
        let starter = std::thread::spawn(move || {
            let options = GroupOptions {
                threads_per_rank: setup.threads_per_rank,
                ..GroupOptions::default()
            };
            let config = &setup.config;
            let result = LocalGroup::run_with(options, setup.n_ranks, |ctx| {
                let device = Default::default();
                let rx = receivers[ctx.rank].lock().unwrap().take().unwrap();
                // Seeded tokens and a router that sends them where `skew` says: every
                // configuration times the same batch with the same per-expert load.
                let mut layer = config.init_rank::<B>(&device, ctx.comm.clone())?;
                balance_router(&mut layer);
                let (m, tokens) = (config.d_model, setup.tokens);
                let values = skewed_tokens(
                    7,
                    ctx.rank,
                    tokens,
                    m,
                    config.n_experts,
                    config.top_k,
                    &setup.skew,
                );
                let x =
                    Tensor::<B, 2>::from_data(TensorData::new(values, [tokens, m]), &device).require_grad();
                while let Ok(true) = rx.recv() {
                    let start = Instant::now();
                    let out = layer.try_forward(x.clone())?;
                    let _ = (out.output.sum() + out.aux_loss).backward();
                    // A rank that is done waits for the slowest at the next collective; the
                    // step's time is the slowest rank's.
                    done_tx.send((ctx.rank, start.elapsed(), out.stats)).unwrap();
                }
                Ok(())
            });
            if let Err(e) = result {
                eprintln!("benchmark ranks failed: {e}");
            }
        });
        Self {
            commands,
            done,
            threads: vec![starter],
            record: Mutex::new((Vec::new(), Vec::new())),
        }
    }

    /// `iters` timed steps (criterion's `iter_custom`): their total, each recorded for
    /// [`median_ms`](Self::median_ms) and the last one's statistics for
    /// [`last_stats`](Self::last_stats).
    pub fn run(&self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let (t, stats) = self.step();
            let mut record = self.record.lock().unwrap_or_else(|e| e.into_inner());
            record.0.push(t);
            record.1 = stats;
            total += t;
        }
        total
    }

    /// The median of the steps [`run`](Self::run) timed, milliseconds (0 if none).
    pub fn median_ms(&self) -> f64 {
        let mut times = self.record.lock().unwrap_or_else(|e| e.into_inner()).0.clone();
        times.sort();
        times.get(times.len() / 2).map_or(0.0, |t| t.as_secs_f64() * 1e3)
    }

    /// Every rank's statistics of the last step [`run`](Self::run) timed, in rank order.
    pub fn last_stats(&self) -> Vec<MoeStats> {
        self.record.lock().unwrap_or_else(|e| e.into_inner()).1.clone()
    }

    /// One pass on every rank: the slowest rank's time, and every rank's statistics in rank
    /// order.
    ///
    /// # Panics
    /// If the ranks have stopped (their error is printed).
    pub fn step(&self) -> (Duration, Vec<MoeStats>) {
        for c in &self.commands {
            c.send(true).expect("benchmark ranks stopped");
        }
        let mut slowest = Duration::ZERO;
        let mut stats = Vec::with_capacity(self.commands.len());
        for _ in 0..self.commands.len() {
            let (rank, t, s) = self.done.recv().expect("benchmark ranks stopped");
            slowest = slowest.max(t);
            stats.push((rank, s));
        }
        stats.sort_by_key(|(rank, _)| *rank);
        (slowest, stats.into_iter().map(|(_, s)| s).collect())
    }
}

impl Drop for BenchRanks {
    fn drop(&mut self) {
        for c in &self.commands {
            let _ = c.send(false);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
