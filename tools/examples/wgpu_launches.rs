//! Kernel launches of the layer's training step on WGPU, for cubecl's profiling log to count.
//!
//! ```text
//! scripts/bench/wgpu_launches.sh [--top-k 2] [--partitions 2] [--tokens 256] ...
//! ```
//!
//! Runs `--steps` forward + backward passes of one layer on `Autodiff<Wgpu>` (raw, no fusion:
//! each burn op is one launch; `--fusion` runs burn's fusing backend instead) with a fixed seed, so that two runs that differ only in their
//! step count differ by exactly one step's launches. The script runs it at two step counts in
//! a folder whose `cubecl.toml` turns cubecl's profiling logger on at `minimal` (one line per
//! launch, named) and prints the difference and the last step's kernels. On a GPU each launch
//! costs the host a few microseconds whatever its size, and at small shapes the step waits on
//! the host (BENCHMARKS §14b), so the count is what a change to the step's ops moves.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Distribution, Tensor};
use clap::Parser;
use mpipemoe::{MoeLayerConfig, Partitions};

#[derive(Parser, Debug)]
struct Args {
    /// Forward + backward passes.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 1)]
    top_k: usize,
    /// Experts.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Tokens per pass.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Expert hidden width.
    #[arg(long, default_value_t = 128)]
    d_hidden: usize,
    /// Micro-batch partitions n (fixed, so that every step runs the same schedule).
    #[arg(long, default_value_t = 2)]
    partitions: usize,
    /// Under burn's fusion (`Fusion<CubeBackend<WgpuRuntime>>`, burn's default WGPU backend).
    #[arg(long)]
    fusion: bool,
    /// The router z-loss's coefficient (0: off, the layer's default).
    #[arg(long, default_value_t = 0.0)]
    z_loss: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    match args.fusion {
        false => steps::<Autodiff<Wgpu>>(&args),
        true => steps::<Autodiff<mpipemoe_tools::backends::WgpuFusion>>(&args),
    }
}

fn steps<B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend>(
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let device = Default::default();
    B::seed(&device, 7);
    let layer = MoeLayerConfig::new(args.d_model, args.d_hidden, args.experts, args.top_k)
        .with_partitions(Partitions::Fixed(args.partitions))
        .with_z_loss_coef(args.z_loss)
        .try_init::<B>(&device)?;
    let x =
        Tensor::<B, 2>::random([args.tokens, args.d_model], Distribution::Default, &device).require_grad();
    for _ in 0..args.steps {
        let out = layer.try_forward(x.clone())?;
        let _grads = (out.output.sum() + out.aux_loss + out.z_loss).backward();
    }
    // Waits for the device without a launch of its own.
    B::sync(&device)?;
    Ok(())
}
