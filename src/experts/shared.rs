//! The shared (always-on) expert of Qwen2-MoE / DeepSeek-style layers.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::HostInit;
use crate::decoder::{gated_silu, DecoderKernels};
use crate::router::{RouterKernels, Scoring};

/// A SwiGLU FFN that every token passes through,
/// `y = (silu(x · w_in[:, :H]) ⊙ x · w_in[:, H:]) · w_out`, scaled by a sigmoid gate
/// `σ(x · gate^T)` where it has one (Qwen2-MoE) and ungated otherwise (DeepSeek-V3).
///
/// It is replicated on every rank (data parallel), like the router.
///
/// # Shapes
/// - w_in: `[d_model, 2·d_shared]` (gate half first, then up)
/// - w_out: `[d_shared, d_model]`
/// - gate: `[1, d_model]`
#[derive(Module, Debug)]
pub struct SharedExpert<B: Backend> {
    /// Gate and up projections, side by side.
    pub w_in: Param<Tensor<B, 2>>,
    /// Down projection.
    pub w_out: Param<Tensor<B, 2>>,
    /// The scalar gate's weights, if the expert is gated.
    pub gate: Option<Param<Tensor<B, 2>>>,
}

impl<B: Backend> SharedExpert<B> {
    pub(crate) fn init(d_model: usize, d_shared: usize, gated: bool, seed: u64, device: &B::Device) -> Self {
        Self {
            w_in: Param::from_tensor(HostInit::new(seed, "shared.w_in", 0).tensor(
                [d_model, 2 * d_shared],
                d_model,
                device,
            )),
            w_out: Param::from_tensor(HostInit::new(seed, "shared.w_out", 0).tensor(
                [d_shared, d_model],
                d_shared,
                device,
            )),
            gate: gated.then(|| {
                Param::from_tensor(HostInit::new(seed, "shared.gate.weight", 0).tensor(
                    [1, d_model],
                    d_model,
                    device,
                ))
            }),
        }
    }

    /// Width of the shared expert's hidden layer.
    pub fn d_shared(&self) -> usize {
        self.w_out.dims()[0]
    }
}

impl<B: DecoderKernels + RouterKernels> SharedExpert<B> {
    /// # Shapes
    /// - x: `[n_tokens, d_model]` → `[n_tokens, d_model]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let plain = |a: Tensor<B, 2>, b: Tensor<B, 2>| Ok(a.matmul(b));
        self.forward_with(x, &plain).expect("burn's matmul does not fail")
    }

    /// [`forward`](Self::forward) with its three products computed by `matmul` (the layer
    /// passes its dense product at the config's GEMM precision).
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]` → `[n_tokens, d_model]`
    ///
    /// # Errors
    /// What `matmul` returns.
    pub fn forward_with(
        &self,
        x: Tensor<B, 2>,
        matmul: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>) -> crate::Result<Tensor<B, 2>>,
    ) -> crate::Result<Tensor<B, 2>> {
        // `[gate | up]` is the product's layout, so SwiGLU reads it whole: one op each way
        // where the backend has the kernel (`decoder::gated_silu`), burn's ops elsewhere.
        let hidden = gated_silu(matmul(x.clone(), self.w_in.val())?);
        let out = matmul(hidden, self.w_out.val())?;
        Ok(match &self.gate {
            Some(gate) => out * gate_scores(matmul(x, gate.val().transpose())?),
            None => out,
        })
    }
}

/// The gate's sigmoid as the router's sigmoid scores, a router of one expert: one op each way
/// where the backend has the router's kernels (one kernel each on CubeCL), where burn's
/// `sigmoid` is six element-wise launches forward (`exp(-log(1 + exp(-x)))`) and its backward
/// recomputes them before its own four, every step of every Qwen2-MoE layer.
///
/// # Shapes
/// - logits: `[n_tokens, 1]` → `[n_tokens, 1]`
fn gate_scores<B: RouterKernels>(logits: Tensor<B, 2>) -> Tensor<B, 2> {
    let scores = B::router_scores(logits.into_primitive().tensor(), Scoring::Sigmoid);
    Tensor::from_primitive(TensorPrimitive::Float(scores))
}
