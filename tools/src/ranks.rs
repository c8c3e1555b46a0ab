//! How the training example's ranks run: threads of this process exchanging rows through host
//! memory (`--comm threads`, any backend), or GPUs joined by NCCL (`--comm nccl`, the CUDA
//! backends): all GPUs of this machine from one process, or one rank per process under
//! torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).

use clap::ValueEnum;
use mpipemoe::comm::GroupOptions;
use mpipemoe::{LocalGroup, RankContext};

use crate::backends::BackendArg;

/// `--comm`: how ranks run and exchange rows.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommArg {
    /// One process, a thread per rank, rows through host memory (every backend; on a GPU
    /// backend all ranks share device 0).
    Threads,
    /// A GPU per rank joined by NCCL (`--backend cuda` or `cuda-fusion`, `--features cuda`):
    /// GPUs `0..ranks` of this machine from one process, or, where `WORLD_SIZE` is set, this
    /// process as rank `RANK` of a torchrun launch.
    Nccl,
}

/// The ranks' results and the rank of the first one: all ranks where this process runs them
/// all, this process's own rank under torchrun.
pub struct RankResults<T> {
    /// The global rank of `results[0]`.
    pub first_rank: usize,
    /// One result per rank this process ran, in rank order.
    pub results: Vec<T>,
}

/// Checks `--comm` against the backend and the build before anything runs; `Err` is a usage
/// error (exit 2).
pub fn check_comm(comm: CommArg, backend: BackendArg, n_ranks: usize) -> Result<(), String> {
    match comm {
        CommArg::Threads => Ok(()),
        CommArg::Nccl if !backend.is_cuda() => Err(format!(
            "--comm nccl joins GPUs with NCCL: it needs --backend cuda or cuda-fusion, not {}",
            backend.name()
        )),
        CommArg::Nccl => nccl_world(n_ranks).map(|_| ()),
    }
}

/// Runs `f` once per rank as `comm` says, with the GPU each rank uses on this machine.
/// `threads_per_rank` gives each thread rank a compute pool of its own
/// ([`GroupOptions::threads_per_rank`]); a GPU rank has its own device already, and
/// [`check_comm`] refuses the option with NCCL.
///
/// # Errors
/// The first rank's own error (a peer's timeout caused by it comes second), or a group that
/// cannot be formed.
pub fn run_ranks<T, F>(
    comm: CommArg,
    n_ranks: usize,
    threads_per_rank: Option<usize>,
    f: F,
) -> mpipemoe::Result<RankResults<T>>
where
    T: Send,
    F: Fn(RankContext, usize) -> mpipemoe::Result<T> + Sync,
{
    match comm {
        CommArg::Threads => {
            let options = GroupOptions {
                threads_per_rank,
                ..GroupOptions::default()
            };
            Ok(RankResults {
                first_rank: 0,
                results: LocalGroup::run_with(options, n_ranks, |ctx| f(ctx, 0))?,
            })
        }
        CommArg::Nccl => run_nccl(n_ranks, f),
    }
}

/// `Some((rank, world))` under torchrun, `None` for one process driving every GPU.
#[cfg(feature = "cuda")]
fn nccl_world(n_ranks: usize) -> Result<Option<(usize, usize)>, String> {
    mpipemoe_cuda::nccl_available().map_err(|e| format!("--comm nccl: {e}"))?;
    let Ok(world) = std::env::var("WORLD_SIZE") else {
        return Ok(None);
    };
    let parse = |name: &str, text: &str| {
        text.trim()
            .parse::<usize>()
            .map_err(|_| format!("{name}={text:?} is not a rank count"))
    };
    let world = parse("WORLD_SIZE", &world)?;
    let rank = parse("RANK", &std::env::var("RANK").unwrap_or_else(|_| "0".into()))?;
    if world != n_ranks {
        return Err(format!(
            "--ranks {n_ranks} disagrees with torchrun's WORLD_SIZE={world}"
        ));
    }
    Ok(Some((rank, world)))
}

#[cfg(not(feature = "cuda"))]
fn nccl_world(_n_ranks: usize) -> Result<Option<(usize, usize)>, String> {
    Err("this build has no NCCL: rebuild with `--features cuda` for --comm nccl".to_string())
}

#[cfg(feature = "cuda")]
fn run_nccl<T, F>(n_ranks: usize, f: F) -> mpipemoe::Result<RankResults<T>>
where
    T: Send,
    F: Fn(RankContext, usize) -> mpipemoe::Result<T> + Sync,
{
    use std::sync::Arc;
    use std::time::Duration;
    // How long a transfer waits for a peer before the rank gives up (NCCL itself waits forever).
    const TIMEOUT: Duration = Duration::from_secs(120);
    // How long ranks wait for each other where they come apart by design: processes started
    // apart (the rendezvous and NCCL's initialisation), a checkpoint written by one rank.
    const ARRIVAL: Duration = Duration::from_secs(30 * 60);
    let world = nccl_world(n_ranks).map_err(mpipemoe::MoeError::Backend)?;
    match world {
        None => Ok(RankResults {
            first_rank: 0,
            results: mpipemoe_cuda::Nccl::run_local(n_ranks, TIMEOUT, |ctx| {
                let gpu = ctx.rank;
                f(ctx, gpu)
            })?,
        }),
        Some((rank, world)) => {
            let nccl = mpipemoe_cuda::Nccl::from_env(ARRIVAL)?
                .with_timeout(TIMEOUT)
                .with_arrival_timeout(ARRIVAL);
            let gpu = nccl.gpu();
            let ctx = RankContext {
                rank,
                n_ranks: world,
                comm: Arc::new(nccl),
            };
            Ok(RankResults {
                first_rank: rank,
                results: vec![f(ctx, gpu)?],
            })
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn run_nccl<T, F>(n_ranks: usize, _f: F) -> mpipemoe::Result<RankResults<T>>
where
    T: Send,
    F: Fn(RankContext, usize) -> mpipemoe::Result<T> + Sync,
{
    Err(mpipemoe::MoeError::Backend(
        nccl_world(n_ranks).err().unwrap_or_default(),
    ))
}
