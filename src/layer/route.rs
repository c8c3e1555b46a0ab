//! Step 2 of the forward in two halves, so that work can be issued while the choice is read
//! (the shared expert under `shared_expert_overlap`): the router's choice, with the input's
//! finite check made on what the routing reads to the host, and the layer's dense products at
//! their precision.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::MoeLayer;
use crate::error::{MoeError, Result};
use crate::exchange::{GemmPrecision, MoeBackend};
use crate::router::{PendingRoute, Routing};

impl<B: MoeBackend> MoeLayer<B> {
    /// `a · b` at `precision` through the communicator's device library where it offers one
    /// (cuBLAS on CUDA), the backend's product otherwise: the router's and the shared
    /// expert's products.
    ///
    /// # Shapes
    /// - a: `[m, k]`, b: `[k, n]` → `[m, n]`
    pub(super) fn dense(
        &self,
        a: Tensor<B, 2>,
        b: Tensor<B, 2>,
        precision: GemmPrecision,
    ) -> Result<Tensor<B, 2>> {
        crate::exchange::dense(a, b, &self.ctx.comm, precision)
    }

    /// The shared expert's output for `x`, its products at the config's GEMM precision
    /// (step 7, or step 2 under `shared_expert_overlap`); `None` without a shared expert or
    /// without tokens.
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]` → `[n_tokens, d_model]`
    ///
    /// # Errors
    /// What the device library's products return.
    pub(super) fn shared_expert(&self, x: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        let precision = self.ctx.config.gemm_precision;
        match (&self.shared, x.dims()[0] > 0) {
            (Some(shared), true) => shared
                .forward_with(x.clone(), &|a, b| self.dense(a, b, precision))
                .map(Some),
            _ => Ok(None),
        }
    }

    /// Step 2's first half: the router's products and, on the CubeCL backends, its choice
    /// on the device, whose read is then in flight ([`Router::route_start`](crate::Router::route_start)). Nothing waits
    /// for the device here.
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]`
    ///
    /// # Errors
    /// What the router's products return.
    pub(super) fn route_start(&self, x: &Tensor<B, 2>) -> Result<PendingRoute<B>> {
        let config = &self.ctx.config;
        // The router's logits stay f32 where the experts multiply in bf16: the choice of
        // experts is discrete, and bf16 logits turn near-ties into different experts (the
        // Qwen2-MoE case on the H100: one token's top-4 changed, a 9e-2 error in the router's
        // gradient). Megatron-Core's `moe_router_dtype` keeps routing in f32 for the same reason.
        let router_precision = match config.gemm_precision {
            GemmPrecision::Bf16 => GemmPrecision::F32,
            other => other,
        };
        self.router
            .route_start(x.clone(), &config.routing_rule(), &|a, b| {
                self.dense(a, b, router_precision)
            })
    }

    /// Step 2's second half: the top-k experts and their weights for each token of `x`, and
    /// the input's finite check where the config asks for it. One transfer to the host, one
    /// host wait: on the CubeCL backends the choice made on the device, which checked every
    /// logit and choice value finite as it chose (finite logits mean a finite input: see
    /// below); elsewhere, or where a value was not finite there, the router's choice values,
    /// which the check reads.
    ///
    /// A router without a score bias chooses by its logits, which come to the host for the
    /// choice anyway, and a NaN or an infinity anywhere in a token's input makes every logit
    /// of that token NaN or infinite (a product with either is NaN or infinite, and so is a
    /// sum with such a term). So the host checks the values it read, and looks at the input
    /// itself only where one is not finite (an input that is not, or logits that overflowed
    /// from one that is). That costs the device nothing, where the check on the device had
    /// taken five launches. A score bias chooses by scores, which a logit of -inf leaves
    /// finite (softmax and sigmoid take it to 0), so there the input's own check is read
    /// with the choice values.
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]`; `shape` is the caller's input shape, for the error
    ///
    /// # Errors
    /// [`MoeError::Input`] where a value is not finite.
    pub(super) fn route_finish(
        &self,
        pending: PendingRoute<B>,
        x: &Tensor<B, 2>,
        shape: &[usize],
    ) -> Result<Routing<B>> {
        let check = self.ctx.config.check_finite && x.dims()[0] > 0;
        let by_logits = self.router.chooses_by_logits();
        let (routing, read) = pending.finish(&|| (check && !by_logits).then(|| non_finite_sum(x)));
        let finite = match (check, by_logits) {
            (false, _) => true,
            _ if read.device_checked => true,
            (true, true) => read.choice_finite || input_is_finite(x),
            (true, false) => read.also.first().is_some_and(|&sum| sum == 0.0),
        };
        match finite {
            true => Ok(routing),
            false => Err(MoeError::Input(format!(
                "input {shape:?} contains NaN or infinite values"
            ))),
        }
    }
}

/// `Σ x · 0` over the detached input: 0 exactly when every value is finite (a finite value
/// times zero is zero, a NaN or an infinity times zero is NaN). Two kernels and a fill on the
/// CubeCL backends, where burn 0.21's `is_finite().bool_not().any()` launches ten (a NaN
/// test, an infinity test, two negations and an `and` in burn-tensor `api/float.rs`, and a
/// cast, a fill and a sum for `any`).
///
/// # Shapes
/// - `x`: `[n_tokens, d_model]` → `[1]`
fn non_finite_sum<B: Backend>(x: &Tensor<B, 2>) -> Tensor<B, 1> {
    x.clone().detach().mul_scalar(0.0).sum()
}

/// Whether every value of `x` is finite, read to the host: a host wait of its own, which the
/// layer takes only where the values read with the routing were not all finite.
fn input_is_finite<B: Backend>(x: &Tensor<B, 2>) -> bool {
    let sum = non_finite_sum(x).into_data().convert::<f32>();
    sum.as_slice::<f32>().is_ok_and(|v| v.first() == Some(&0.0))
}
