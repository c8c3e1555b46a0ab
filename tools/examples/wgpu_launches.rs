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
//!
//! `--null-experts` offers the layer a device library that launches nothing (`NullLibrary`):
//! the experts' compute and the dense products are taken by it, as cuBLAS takes them on CUDA
//! (`gpu_bench`'s `cublas` rows, in issue order, without the finite check), so what is counted
//! is the layer's own cubecl launches around them: on CUDA, the launches besides the cuBLAS
//! sections. The results are not computed (the buffers are handed back as they came); only
//! the launches count.

use std::sync::Arc;

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Distribution, Tensor};
use clap::Parser;
use mpipemoe::backend::{ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertPath, StepExecutor};
use mpipemoe::comm::{RowPaths, SingleRank, WithRowPaths};
use mpipemoe::{Communicator, GemmPrecision, MoeLayerConfig, Partitions};

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
    /// The experts and the dense products on a library that launches nothing, in issue order
    /// and without the finite check, as `gpu_bench` runs the cuBLAS path (with `--fusion`,
    /// under fusion, as its `cublas fusion` row does: the library takes the inner backend's
    /// jobs).
    #[arg(long)]
    null_experts: bool,
}

/// A device library that takes every job and launches nothing: what a cuBLAS section is to
/// cubecl's launch count. Its outputs are the buffers it was handed, unwritten, and its
/// products empty tensors of the right shape.
#[derive(Debug)]
struct NullLibrary;

impl ExpertPath<Wgpu> for NullLibrary {
    fn forward(
        &self,
        job: ExpertForward<'_, Wgpu>,
    ) -> mpipemoe::Result<(FloatTensor<Wgpu>, FloatTensor<Wgpu>)> {
        Ok((job.out, job.hidden))
    }

    fn backward(&self, job: ExpertBackward<'_, Wgpu>) -> mpipemoe::Result<ExpertBackwardOut<Wgpu>> {
        Ok(ExpertBackwardOut {
            grad_x: job.grad_x,
            grads: job.grads,
        })
    }

    fn matmul(
        &self,
        lhs: FloatTensor<Wgpu>,
        rhs: FloatTensor<Wgpu>,
        _: GemmPrecision,
    ) -> mpipemoe::Result<FloatTensor<Wgpu>> {
        let (l, r) = (lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
        let shape = [l[0], r[1]];
        Ok(<Wgpu as FloatTensorOps<Wgpu>>::float_empty(
            shape.into(),
            &lhs.device,
            lhs.dtype.into(),
        ))
    }
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
    let mut config = MoeLayerConfig::new(args.d_model, args.d_hidden, args.experts, args.top_k)
        .with_partitions(Partitions::Fixed(args.partitions))
        .with_z_loss_coef(args.z_loss);
    let comm: Arc<dyn Communicator> = match args.null_experts {
        true => {
            config = config
                .with_check_finite(false)
                .with_executor(Some(StepExecutor::InOrder));
            Arc::new(WithRowPaths::adding(
                Arc::new(SingleRank),
                RowPaths::new().with_experts::<Wgpu>(Arc::new(NullLibrary)),
            ))
        }
        false => Arc::new(SingleRank),
    };
    let layer = config.init_rank::<B>(&device, comm)?;
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
