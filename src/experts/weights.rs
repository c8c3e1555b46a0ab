//! The experts a forward pass runs: this rank's own, and the copies of shadowed experts
//! appended to them, as tensors that autodiff tracks back to the parameters.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::{Activation, ExpertTensors};

/// The weights of the experts one exchange runs, stacked along the first dimension: a view
/// of [`Experts`](super::Experts)' parameters (cheap: shares their buffers), with the copies
/// of any shadowed experts appended after this rank's own. Gradients flow back through the
/// view to the parameters.
///
/// # Shapes
/// - w_in: `[n_slots, d_model, d_inner]`
/// - b_in: `[n_slots, d_inner]`
/// - w_out: `[n_slots, d_hidden, d_model]`
/// - b_out: `[n_slots, d_model]`
///
/// where `n_slots` is `n_local_experts` plus the shadowed experts.
#[derive(Debug, Clone)]
pub struct ExpertWeights<B: Backend> {
    /// First GEMM's weights.
    pub w_in: Tensor<B, 3>,
    /// First GEMM's bias, if the experts have biases.
    pub b_in: Option<Tensor<B, 2>>,
    /// Second GEMM's weights.
    pub w_out: Tensor<B, 3>,
    /// Second GEMM's bias, if the experts have biases.
    pub b_out: Option<Tensor<B, 2>>,
    /// The activation between the two GEMMs.
    pub activation: Activation,
}

pub(crate) fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    match t.into_primitive() {
        TensorPrimitive::Float(p) => p,
        TensorPrimitive::QFloat(_) => panic!("quantized expert weights are not supported"),
    }
}

impl<B: Backend> ExpertWeights<B> {
    /// Experts in the view.
    pub fn n_slots(&self) -> usize {
        self.w_in.dims()[0]
    }

    /// The weights as primitives, the form the fused exchange op takes.
    pub fn tensors(&self) -> ExpertTensors<B> {
        ExpertTensors::plain(
            primitive(self.w_in.clone()),
            self.b_in.clone().map(primitive),
            primitive(self.w_out.clone()),
            self.b_out.clone().map(primitive),
        )
    }

    /// Expert `e` (slot index) applied to `rows` with ordinary tensor ops: the reference twin
    /// of the fused op's compute step.
    ///
    /// # Shapes
    /// - rows: `[n_rows, d_model]` → `[n_rows, d_model]`
    pub fn forward_expert(&self, e: usize, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        let [_, m, f] = self.w_in.dims();
        let h = self.w_out.dims()[1];
        let w_in = self.w_in.clone().slice([e..e + 1, 0..m, 0..f]).reshape([m, f]);
        let mut z = rows.matmul(w_in);
        if let Some(b) = &self.b_in {
            z = z + b.clone().slice([e..e + 1, 0..f]);
        }
        let a = self.activation.forward(z);
        let w_out = self.w_out.clone().slice([e..e + 1, 0..h, 0..m]).reshape([h, m]);
        let mut out = a.matmul(w_out);
        if let Some(b) = &self.b_out {
            out = out + b.clone().slice([e..e + 1, 0..m]);
        }
        out
    }

    /// The experts at `slots` (slot indices, in that order), each tensor selected along the
    /// first dimension.
    pub fn select(&self, slots: &[usize]) -> Self {
        // A run of consecutive slots (the usual shadows of one owner) is a slice: the same
        // values, and a cheaper backward on Flex (the gather's, `select_add`, was about 7% of
        // a shadowed GPT3-S step in a profile; the slice's gradient is one block copy).
        if let Some(&first) = slots.first() {
            if slots.iter().enumerate().all(|(i, &s)| s == first + i) {
                let range = first..first + slots.len();
                return Self {
                    w_in: self.w_in.clone().narrow(0, range.start, range.len()),
                    b_in: self.b_in.clone().map(|b| b.narrow(0, range.start, range.len())),
                    w_out: self.w_out.clone().narrow(0, range.start, range.len()),
                    b_out: self.b_out.clone().map(|b| b.narrow(0, range.start, range.len())),
                    activation: self.activation,
                };
            }
        }
        let device = self.w_in.device();
        let index = || {
            let idx: Vec<i64> = slots.iter().map(|&e| e as i64).collect();
            Tensor::<B, 1, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(idx, [slots.len()]),
                &device,
            )
        };
        Self {
            w_in: self.w_in.clone().select(0, index()),
            b_in: self.b_in.clone().map(|b| b.select(0, index())),
            w_out: self.w_out.clone().select(0, index()),
            b_out: self.b_out.clone().map(|b| b.select(0, index())),
            activation: self.activation,
        }
    }

    /// Each expert's parameters as one row, in the order `w_in`, `b_in`, `w_out`, `b_out`:
    /// the form in which shadowed experts travel.
    ///
    /// # Shapes
    /// - returns `[n_slots, params_per_expert]`
    pub fn flatten(&self) -> Tensor<B, 2> {
        let n = self.n_slots();
        let mut parts = vec![self.w_in.clone().reshape([n as i64, -1])];
        parts.extend(self.b_in.clone());
        parts.push(self.w_out.clone().reshape([n as i64, -1]));
        parts.extend(self.b_out.clone());
        Tensor::cat(parts, 1)
    }

    /// The inverse of [`flatten`](Self::flatten) for rows of experts shaped like these.
    ///
    /// # Shapes
    /// - rows: `[n, params_per_expert]` → `n` experts
    pub fn unflatten_like(&self, rows: Tensor<B, 2>) -> Self {
        let [n, _] = rows.dims();
        let [_, m, f] = self.w_in.dims();
        let h = self.w_out.dims()[1];
        let mut at = 0;
        let mut take = |width: usize| {
            let part = rows.clone().slice([0..n, at..at + width]);
            at += width;
            part
        };
        let w_in = take(m * f).reshape([n, m, f]);
        let b_in = self.b_in.as_ref().map(|_| take(f));
        let w_out = take(h * m).reshape([n, h, m]);
        let b_out = self.b_out.as_ref().map(|_| take(m));
        Self {
            w_in,
            b_in,
            w_out,
            b_out,
            activation: self.activation,
        }
    }

    /// These experts followed by `more` (shaped alike), along the first dimension.
    pub fn append(self, more: Self) -> Self {
        let cat2 = |a: Tensor<B, 2>, b: Tensor<B, 2>| Tensor::cat(vec![a, b], 0);
        Self {
            w_in: Tensor::cat(vec![self.w_in, more.w_in], 0),
            b_in: self.b_in.zip(more.b_in).map(|(a, b)| cat2(a, b)),
            w_out: Tensor::cat(vec![self.w_out, more.w_out], 0),
            b_out: self.b_out.zip(more.b_out).map(|(a, b)| cat2(a, b)),
            activation: self.activation,
        }
    }
}
