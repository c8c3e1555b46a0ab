//! `C'_i` on cuBLAS: `T_M` recomputed where the strategy dropped it, `dA = dT_DO·W_outᵀ`, one
//! kernel for `A` and `dT_M`, then `dW_out += Aᵀ·dT_DO` and `dW_in += Xᵀ·dT_M` straight into the
//! stacked running sums (written rather than added into fresh ones), the bias gradients as
//! products with a ones row, and `dT_DI = dT_M·W_inᵀ`.

use mpipemoe::backend::{ExpertBackward, ExpertBackwardOut, ExpertTensors};
use mpipemoe::{GemmPrecision, Result};

use std::sync::{Arc, Mutex};

use super::blas::{Product, Role};
use super::kernels::Job;
use super::lane::Lane;
use super::operands::{dense_starts, ready, row_at, Addresses, Dims, ExpertOperands, Halves};
use super::{CallCounters, CublasExperts};
use crate::CudaMoe;

pub(crate) fn backward(
    path: &CublasExperts,
    job: ExpertBackward<'_, CudaMoe<f32>>,
) -> Result<ExpertBackwardOut<CudaMoe<f32>>> {
    if job.rows_per_expert.iter().all(|&r| r == 0) && !job.fresh {
        return Ok(ExpertBackwardOut {
            grad_x: job.grad_x,
            grads: job.grads,
        });
    }
    let client = job.x.client.clone();
    path.on_device_thread(&client, |lane| backward_on(path, job, lane))
}

fn backward_on(
    path: &CublasExperts,
    job: ExpertBackward<'_, CudaMoe<f32>>,
    lane: Arc<Mutex<Lane>>,
) -> Result<ExpertBackwardOut<CudaMoe<f32>>> {
    let rows = job.rows_per_expert;
    let ord = path.inner.ordinal;
    let client = job.x.client.clone();
    let dims = Dims::of(job.experts, job.activation);
    let Dims {
        d_model: dm,
        d_inner: di,
        d_hidden: dh,
    } = dims;
    let layout = job.layout;
    let half = job.precision == GemmPrecision::Bf16;
    let bytes = if half { 2 } else { 4 };
    let mut at = Addresses::new(&client);
    let grad = ready(job.grad, ord, "dT_DO")?;
    let x = ready(job.x, ord, "T_DI")?;
    let grad_x = ready(job.grad_x, ord, "dT_DI")?;
    // The exchange never hands a path experts with adapters (`Library::find`), so the
    // running sums are the weights' and biases' alone.
    let grads = ExpertTensors::plain(
        ready(job.grads.w_in, ord, "dW_in")?,
        job.grads.b_in.map(|b| ready(b, ord, "db_in")).transpose()?,
        ready(job.grads.w_out, ord, "dW_out")?,
        job.grads.b_out.map(|b| ready(b, ord, "db_out")).transpose()?,
    );
    let (g_at, x_at, gx_at) = (at.of(&grad)?, at.of(&x)?, at.of(&grad_x)?);
    let sums = [
        at.of(&grads.w_in)?,
        grads.b_in.as_ref().map(|b| at.of(b)).transpose()?.unwrap_or(0),
        at.of(&grads.w_out)?,
        grads.b_out.as_ref().map(|b| at.of(b)).transpose()?.unwrap_or(0),
    ];
    // The lane's identity keys the pass's bf16 weights (`PassHalves`).
    let lane_key = Arc::as_ptr(&lane) as usize;
    let store = path.inner.halves_store(job.experts);
    let experts = ExpertOperands::new(job.experts, store, &mut at, ord, dims, half, lane_key)?;
    if !experts.halves.is_empty() {
        path.inner.calls.add(CallCounters::CONVERSIONS, 1);
    }
    let (inputs_half, inputs) = Halves::plan(
        &mut at,
        half,
        &[(x_at, layout.total() * dm), (g_at, layout.total() * dm)],
    )?;
    let (x_op, g_op) = (inputs[0], inputs[1]);
    // Each slot's T_M: kept or restored (its own tensor, contiguous), or recomputed into scratch.
    let mut kept_at: Vec<Option<u64>> = Vec::with_capacity(rows.len());
    for z in job.hidden {
        kept_at.push(match z {
            Some(z) => Some(at.of(&ready(z, ord, "T_M")?)?),
            None => None,
        });
    }
    let starts = dense_starts(rows);
    let total: usize = rows.iter().sum();
    let max_rows = rows.iter().copied().max().unwrap_or(0);
    let used: Vec<usize> = (0..rows.len()).filter(|&e| rows[e] > 0).collect();
    let recompute: Vec<usize> = used.iter().copied().filter(|&e| kept_at[e].is_none()).collect();
    let z_scratch = at.scratch(if recompute.is_empty() { 4 } else { total * di * 4 })?;
    let ga_at = at.scratch(total * dh * 4)?;
    let a_at = at.scratch(total * dh * bytes)?;
    let gz_at = at.scratch(total * di * bytes)?;
    let z_of = |e: usize| kept_at[e].unwrap_or_else(|| row_at(z_scratch, starts[e], di, 4));
    let x_of = |e: usize| row_at(x_op, layout.start(e), dm, bytes);
    let g_of = |e: usize| row_at(g_op, layout.start(e), dm, bytes);
    let ga_of = |e: usize| row_at(ga_at, starts[e], dh, 4);
    let a_of = |e: usize| row_at(a_at, starts[e], dh, bytes);
    let gz_of = |e: usize| row_at(gz_at, starts[e], di, bytes);
    let slot = |q: usize, e: usize, size: usize| sums[q] + (e * size * 4) as u64;
    let w = |e: usize| experts.matrices[e];
    // T_M = X·W_in (+ b_in), where it was dropped.
    let redo = Role::new(
        false,
        false,
        false,
        half,
        recompute
            .iter()
            .map(|&e| Product::new(x_of(e), dm, w(e)[0], di, z_of(e), di, rows[e], di, dm))
            .collect(),
    );
    let redo_bias: Vec<Job> = recompute
        .iter()
        .filter(|&&e| experts.slots[e][1] != 0)
        .map(|&e| Job::new([z_of(e), 0, 0, 0], experts.slots[e][1], rows[e]))
        .collect();
    // dA = dT_DO · W_outᵀ
    let grad_a = Role::new(
        false,
        true,
        false,
        half,
        used.iter()
            .map(|&e| Product::new(g_of(e), dm, w(e)[1], dm, ga_of(e), dh, rows[e], dh, dm))
            .collect(),
    );
    let act_jobs: Vec<Job> = used
        .iter()
        .map(|&e| Job::new([z_of(e), ga_of(e), a_of(e), gz_of(e)], 0, rows[e]))
        .collect();
    // dW_out += Aᵀ · dT_DO; dW_in += Xᵀ · dT_M (written, not added, into fresh sums).
    let add = !job.fresh;
    let w_out = Role::new(
        true,
        false,
        add,
        half,
        used.iter()
            .map(|&e| Product::new(a_of(e), dh, g_of(e), dm, slot(2, e, dh * dm), dm, dh, dm, rows[e]))
            .collect(),
    );
    let w_in = Role::new(
        true,
        false,
        add,
        half,
        used.iter()
            .map(|&e| {
                Product::new(
                    x_of(e),
                    dm,
                    gz_of(e),
                    di,
                    slot(0, e, dm * di),
                    di,
                    dm,
                    di,
                    rows[e],
                )
            })
            .collect(),
    );
    // Fresh sums of slots without rows in this partition are zeroed (each `(address, floats)`),
    // so that every slot holds a sum after the first partition.
    let sizes = [dm * di, di, dh * dm, dm];
    let zero_slots: Vec<(u64, usize)> = match job.fresh {
        false => Vec::new(),
        true => (0..rows.len())
            .filter(|&e| rows[e] == 0)
            .flat_map(|e| (0..4).filter(|&q| sums[q] != 0).map(move |q| (e, q)))
            .map(|(e, q)| (slot(q, e, sizes[q]), sizes[q]))
            .collect(),
    };
    // dT_DI = dT_M · W_inᵀ
    let grad_x_role = Role::new(
        false,
        true,
        false,
        half,
        used.iter()
            .map(|&e| {
                Product::new(
                    gz_of(e),
                    di,
                    w(e)[0],
                    di,
                    row_at(gx_at, layout.start(e), dm, 4),
                    dm,
                    rows[e],
                    dm,
                    di,
                )
            })
            .collect(),
    );
    let (act, precision) = (job.activation, job.precision);
    path.inner.section(
        &client,
        |inner, lane| {
            // Each piece is marked where the lane is timed (`CublasOptions::timed`).
            if !zero_slots.is_empty() {
                lane.zero(&zero_slots)?;
                lane.mark("zero idle experts' sums")?;
            }
            if !experts.halves.is_empty() {
                experts.halves.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert weights")?;
            }
            if !inputs_half.is_empty() {
                inputs_half.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert inputs")?;
            }
            if !recompute.is_empty() {
                inner.run(lane, &redo, precision)?;
                inner
                    .kernels
                    .act_forward(&lane.stream, act, dh, half, &redo_bias)?;
                lane.mark("recompute T_M")?;
            }
            inner.run(lane, &grad_a, precision)?;
            lane.mark("dA = dT_DO·W_outᵀ")?;
            inner
                .kernels
                .act_backward(&lane.stream, act, dh, half, &act_jobs)?;
            lane.mark("activation backward")?;
            inner.run(lane, &w_out, precision)?;
            lane.mark("dW_out += Aᵀ·dT_DO")?;
            inner.run(lane, &w_in, precision)?;
            lane.mark("dW_in += Xᵀ·dT_M")?;
            // The bias gradients: a ones row times each slot's rows (added, as above).
            if sums[1] != 0 || sums[3] != 0 {
                let ones = lane.ones(max_rows, half)?;
                let bias = |q: usize, width: usize, rows_at: &dyn Fn(usize) -> u64| {
                    Role::new(
                        false,
                        false,
                        add,
                        half,
                        used.iter()
                            .map(|&e| {
                                Product::new(
                                    ones,
                                    rows[e],
                                    rows_at(e),
                                    width,
                                    slot(q, e, width),
                                    width,
                                    1,
                                    width,
                                    rows[e],
                                )
                            })
                            .collect(),
                    )
                };
                if sums[3] != 0 {
                    inner.run(lane, &bias(3, dm, &g_of), precision)?;
                }
                if sums[1] != 0 {
                    inner.run(lane, &bias(1, di, &gz_of), precision)?;
                }
                lane.mark("bias gradients")?;
            }
            inner.run(lane, &grad_x_role, precision)?;
            lane.mark("dT_DI = dT_M·W_inᵀ")
        },
        &lane,
    )?;
    drop(at);
    Ok(ExpertBackwardOut { grad_x, grads })
}
