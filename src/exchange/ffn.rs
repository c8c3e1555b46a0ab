//! The expert FFNs of one partition, forward and backward, on backend primitives (the `C_i`
//! and `C'_i` steps), and the running sums of the expert weight gradients.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use super::rows::{cat_rows, dims2, expert_matrix, expert_row, float_dtype, narrow_rows};
use crate::dispatch::PartitionPlan;
use crate::experts::{activation_backward, activation_forward, Activation, ActivationKernels, ExpertTensors};

/// `x_e · w_in[e] + b_in[e]`: the first GEMM of expert `e`, i.e. `T_M` before activation.
pub(crate) fn first_gemm<B: Backend>(
    x: FloatTensor<B>,
    experts: &ExpertTensors<B>,
    e: usize,
) -> FloatTensor<B> {
    let z = B::float_matmul(x, expert_matrix::<B>(&experts.w_in, e));
    match &experts.b_in {
        Some(b) => B::float_add(z, expert_row::<B>(b, e)),
        None => z,
    }
}

/// C_i: every local expert on its rows of the expert-major partition. Returns the outputs
/// (expert-major, `[rows, d_model]`) and each expert's pre-activation `T_M`.
pub(crate) fn compute<B: ActivationKernels>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    experts: &ExpertTensors<B>,
    act: Activation,
) -> (FloatTensor<B>, Vec<Option<FloatTensor<B>>>) {
    let [_, d_model] = dims2::<B>(&x);
    let mut outs = Vec::with_capacity(part.rows_per_expert.len());
    let mut hidden = Vec::with_capacity(part.rows_per_expert.len());
    let mut offset = 0;
    for (e, &rows) in part.rows_per_expert.iter().enumerate() {
        if rows == 0 {
            hidden.push(None);
            continue;
        }
        let z = first_gemm::<B>(narrow_rows::<B>(x.clone(), offset, rows), experts, e);
        let a = activation_forward::<B>(act, z.clone());
        let mut out = B::float_matmul(a, expert_matrix::<B>(&experts.w_out, e));
        if let Some(b) = &experts.b_out {
            out = B::float_add(out, expert_row::<B>(b, e));
        }
        outs.push(out);
        hidden.push(Some(z));
        offset += rows;
    }
    (cat_rows::<B>(outs, &x, d_model), hidden)
}

/// A partition's tensors, back for its backward step.
pub(crate) struct Restored<B: Backend> {
    /// Gradient of the expert outputs, expert-major. `[rows, d_model]`
    pub grad: FloatTensor<B>,
    /// `T_DI_i`, expert-major. `[rows, d_model]`
    pub x: FloatTensor<B>,
    /// `T_M_i` per expert where it was kept or offloaded; `None` where it is recomputed.
    pub hidden: Vec<Option<FloatTensor<B>>>,
}

/// C'_i: the FFN backward of every local expert on one partition. Returns the gradient of
/// the partition's expert-major inputs and adds the weight gradients to `acc`.
pub(crate) fn compute_backward<B: ActivationKernels>(
    restored: Restored<B>,
    part: &PartitionPlan,
    experts: &ExpertTensors<B>,
    act: Activation,
    acc: &mut ExpertGradAcc<B>,
) -> FloatTensor<B> {
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let mut grads_x = Vec::with_capacity(part.rows_per_expert.len());
    let mut offset = 0;
    for (e, (&rows, z)) in part.rows_per_expert.iter().zip(hidden).enumerate() {
        if rows == 0 {
            continue;
        }
        let x_e = narrow_rows::<B>(x.clone(), offset, rows);
        let g_e = narrow_rows::<B>(grad.clone(), offset, rows);
        offset += rows;
        let z = z.unwrap_or_else(|| first_gemm::<B>(x_e.clone(), experts, e));
        let a = activation_forward::<B>(act, z.clone());
        acc.add(
            Param::WOut,
            e,
            B::float_matmul(B::float_transpose(a), g_e.clone()),
        );
        if experts.b_out.is_some() {
            acc.add(Param::BOut, e, B::float_sum_dim(g_e.clone(), 0));
        }
        let grad_a = B::float_matmul(g_e, B::float_transpose(expert_matrix::<B>(&experts.w_out, e)));
        let grad_z = activation_backward::<B>(act, z, grad_a);
        acc.add(
            Param::WIn,
            e,
            B::float_matmul(B::float_transpose(x_e), grad_z.clone()),
        );
        if experts.b_in.is_some() {
            acc.add(Param::BIn, e, B::float_sum_dim(grad_z.clone(), 0));
        }
        grads_x.push(B::float_matmul(
            grad_z,
            B::float_transpose(expert_matrix::<B>(&experts.w_in, e)),
        ));
    }
    cat_rows::<B>(grads_x, &x, d_model)
}

/// Which expert parameter a gradient belongs to (an index into `ExpertGradAcc::sums`).
#[derive(Clone, Copy)]
enum Param {
    WIn = 0,
    BIn = 1,
    WOut = 2,
    BOut = 3,
}

/// Expert weight gradients summed over partitions, one running sum per expert (the adds
/// happen in place where the backend owns the sum uniquely), stacked once at the end: a
/// reshape when the rank holds one expert, a single concatenation otherwise. (Accumulating
/// straight into the stacked tensor through slice views measured ~40x slower on Flex.)
pub(crate) struct ExpertGradAcc<B: Backend> {
    sums: [Vec<Option<FloatTensor<B>>>; 4],
    like: ExpertTensors<B>,
}

impl<B: Backend> ExpertGradAcc<B> {
    pub(crate) fn new(experts: &ExpertTensors<B>) -> Self {
        let n = experts.w_in.shape().to_vec()[0];
        let empty = || (0..n).map(|_| None).collect::<Vec<_>>();
        Self {
            sums: [empty(), empty(), empty(), empty()],
            like: experts.clone(),
        }
    }

    /// Adds `grad` (expert `e`'s `[rows, cols]` matrix, or `[1, cols]` bias row).
    fn add(&mut self, param: Param, e: usize, grad: FloatTensor<B>) {
        let slot = &mut self.sums[param as usize][e];
        *slot = Some(match slot.take() {
            Some(acc) => B::float_add(acc, grad),
            None => grad,
        });
    }

    /// Stacks per-expert sums (zeros where an expert had no rows) into `like`'s shape.
    fn stack(sums: Vec<Option<FloatTensor<B>>>, like: &FloatTensor<B>) -> FloatTensor<B> {
        let dims = like.shape().to_vec();
        let mut one = dims.clone();
        one[0] = 1;
        let parts: Vec<FloatTensor<B>> = sums
            .into_iter()
            .map(|s| {
                let s = s.unwrap_or_else(|| {
                    B::float_zeros(
                        Shape::from(one.clone()),
                        &B::float_device(like),
                        float_dtype::<B>(like),
                    )
                });
                B::float_reshape(s, Shape::from(one.clone()))
            })
            .collect();
        if parts.len() == 1 {
            parts.into_iter().next().expect("one part")
        } else {
            B::float_cat(parts, 0)
        }
    }

    pub(crate) fn finish(self) -> ExpertTensors<B> {
        let [w_in, b_in, w_out, b_out] = self.sums;
        let like = self.like;
        ExpertTensors {
            w_in: Self::stack(w_in, &like.w_in),
            b_in: like.b_in.as_ref().map(|b| Self::stack(b_in, b)),
            w_out: Self::stack(w_out, &like.w_out),
            b_out: like.b_out.as_ref().map(|b| Self::stack(b_out, b)),
        }
    }
}
