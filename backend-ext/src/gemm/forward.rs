//! `C_i` on cuBLAS: `T_M = X·W_in` (one call over the experts, `Inner::run`), the input bias and the
//! activation in one kernel (`T_M` keeps the biased pre-activation, `A` goes to scratch),
//! `T_DO = A·W_out` (the same), the output bias.

use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::tensor::CubeTensor;
use mpipemoe::backend::ExpertForward;
use mpipemoe::{GemmPrecision, Result};

use std::sync::{Arc, Mutex};

use super::blas::{Product, Role};
use super::kernels::Job;
use super::lane::Lane;
use super::operands::{ready, row_at, Addresses, Dims, ExpertOperands, Halves};
use super::{CallCounters, CublasExperts};
use crate::CudaMoe;

pub(crate) fn forward(
    path: &CublasExperts,
    job: ExpertForward<'_, CudaMoe<f32>>,
) -> Result<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> {
    if job.rows_per_expert.iter().all(|&r| r == 0) {
        return Ok((job.out, job.hidden));
    }
    let client = job.x.client.clone();
    path.on_device_thread(&client, |lane| forward_on(path, job, lane))
}

fn forward_on(
    path: &CublasExperts,
    job: ExpertForward<'_, CudaMoe<f32>>,
    lane: Arc<Mutex<Lane>>,
) -> Result<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> {
    let rows = job.rows_per_expert;
    let ord = path.inner.ordinal;
    let client = job.x.client.clone();
    let dims = Dims::of(job.experts, job.activation);
    let Dims {
        d_model: dm,
        d_inner: di,
        d_hidden: dh,
    } = dims;
    let (layout, hidden_layout) = (job.layout, job.hidden_layout);
    let half = job.precision == GemmPrecision::Bf16;
    let bytes = if half { 2 } else { 4 };
    // 1. Every address before the hand-over (see `Addresses`).
    let mut at = Addresses::new(&client);
    let x = ready(job.x, ord, "T_DI")?;
    let hidden = ready(job.hidden, ord, "T_M")?;
    let out = ready(job.out, ord, "T_DO")?;
    let (x_at, hidden_at, out_at) = (at.of(&x)?, at.of(&hidden)?, at.of(&out)?);
    // The lane's identity keys the pass's bf16 weights (`PassHalves`).
    let lane_key = Arc::as_ptr(&lane) as usize;
    let store = path.inner.halves_store(job.experts);
    let experts = ExpertOperands::new(job.experts, store, &mut at, ord, dims, half, lane_key)?;
    if !experts.halves.is_empty() {
        path.inner.calls.add(CallCounters::CONVERSIONS, 1);
    }
    let (x_half, x_op) = Halves::plan(&mut at, half, &[(x_at, layout.total() * dm)])?;
    let act_at = at.scratch(hidden_layout.total() * dh * bytes)?;
    let used: Vec<usize> = (0..rows.len()).filter(|&e| rows[e] > 0).collect();
    let z_of = |e: usize| row_at(hidden_at, hidden_layout.start(e), di, 4);
    let a_of = |e: usize| row_at(act_at, hidden_layout.start(e), dh, bytes);
    let x_of = |e: usize| row_at(x_op[0], layout.start(e), dm, bytes);
    let w = |e: usize| experts.matrices[e];
    let first = Role::new(
        false,
        false,
        false,
        half,
        used.iter()
            .map(|&e| Product::new(x_of(e), dm, w(e)[0], di, z_of(e), di, rows[e], di, dm))
            .collect(),
    );
    let act_jobs: Vec<Job> = used
        .iter()
        .map(|&e| Job::new([z_of(e), a_of(e), 0, 0], experts.slots[e][1], rows[e]))
        .collect();
    let out_of = |e: usize| row_at(out_at, layout.start(e), dm, 4);
    let second = Role::new(
        false,
        false,
        false,
        half,
        used.iter()
            .map(|&e| Product::new(a_of(e), dh, w(e)[1], dm, out_of(e), dm, rows[e], dm, dh))
            .collect(),
    );
    let bias_jobs: Vec<Job> = used
        .iter()
        .filter(|&&e| experts.slots[e][3] != 0)
        .map(|&e| {
            Job::new(
                [row_at(out_at, layout.start(e), dm, 4), 0, 0, 0],
                experts.slots[e][3],
                rows[e],
            )
        })
        .collect();
    // 2. The section.
    let (act, precision) = (job.activation, job.precision);
    path.inner.section(
        &client,
        |inner, lane| {
            // Each piece is marked where the lane is timed (`CublasOptions::timed`).
            if !experts.halves.is_empty() {
                experts.halves.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert weights")?;
            }
            if !x_half.is_empty() {
                x_half.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert inputs")?;
            }
            inner.run(lane, &first, precision)?;
            lane.mark("T_M = X·W_in")?;
            inner
                .kernels
                .act_forward(&lane.stream, act, dh, half, &act_jobs)?;
            lane.mark("activation")?;
            inner.run(lane, &second, precision)?;
            lane.mark("T_DO = A·W_out")?;
            if !bias_jobs.is_empty() {
                inner.kernels.add_bias(&lane.stream, dm, &bias_jobs)?;
                lane.mark("output bias")?;
            }
            Ok(())
        },
        &lane,
    )?;
    // The section is queued: what it reads may go back to cubecl's pool (later cubecl work
    // waits for the section, handover.rs).
    drop(at);
    Ok((out, hidden))
}
