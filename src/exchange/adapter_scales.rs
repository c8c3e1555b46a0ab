//! The experts' adapter scales folded into their `b` factors for one exchange.
//!
//! An adapter's term is `scale · (x · a) · b`. Applied as written, the scale is one element-wise
//! launch per expert, adapter, partition and pass on the primitives path: forward on `x · a`,
//! backward on `g · bᵀ` and on `x · a` again, six per expert and partition in a step with
//! adapters on both matrices (88 of the test Qwen3-MoE's 803 LoRA launches on WGPU; on CUDA
//! each one a cubecl launch beside the batched library call). The term equals
//! `(x · a) · (scale · b)`, so the exchange scales
//! each stacked `b` once in its forward and runs the adapters with a scale of 1, which
//! [`LowRank::scaled`](super::rows::LowRank::scaled) skips. The gradient the exchange then sums
//! is that of `scale · b`: `b`'s is it times `scale`, once per backward
//! ([`AdapterScales::unfold`]).
//!
//! The product is the same up to rounding (the scale multiplies `b`'s entries instead of
//! `x · a`'s), the adapters' tests hold it to PEFT's within their tolerance, and where the
//! scale is 1 (PEFT's default, `lora_alpha = r`) nothing changes at all.

use burn::tensor::ops::FloatTensor;

use super::MoeBackend;
use crate::experts::{ExpertGrads, ExpertPart, ExpertTensors, LowRankTensors};

/// The scales folded out of one exchange's adapters, to put back on their gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdapterScales {
    /// The scale of the adapter on `w_in` and on `w_out` (1 where there is none).
    scales: [f64; 2],
}

impl AdapterScales {
    /// `experts` with each adapter's `b` times its scale and the scale set to 1, and the scales
    /// taken out. A scale of 1 folds nothing (no launch).
    pub(crate) fn fold<B: MoeBackend>(experts: ExpertTensors<B>) -> (ExpertTensors<B>, Self) {
        let fold_one = |l: Option<LowRankTensors<B>>| match l {
            Some(l) if l.scale != 1.0 => {
                let scale = l.scale;
                let b = B::float_mul_scalar(l.b, (scale as f32).into());
                (
                    Some(LowRankTensors {
                        a: l.a,
                        b,
                        scale: 1.0,
                    }),
                    scale,
                )
            }
            other => (other, 1.0),
        };
        let (lora_in, scale_in) = fold_one(experts.lora_in);
        let (lora_out, scale_out) = fold_one(experts.lora_out);
        let experts = ExpertTensors {
            lora_in,
            lora_out,
            ..experts
        };
        (
            experts,
            Self {
                scales: [scale_in, scale_out],
            },
        )
    }

    /// The gradients of the unfolded `b`s from those of the folded ones (`d b = scale · d(scale
    /// · b)`); the other parts as they are.
    pub(crate) fn unfold<B: MoeBackend>(&self, mut grads: ExpertGrads<B>) -> ExpertGrads<B> {
        for (part, scale) in [ExpertPart::LoraInB, ExpertPart::LoraOutB]
            .into_iter()
            .zip(self.scales)
        {
            if scale != 1.0 {
                let slot = &mut grads.parts[part as usize];
                *slot = slot
                    .take()
                    .map(|g: FloatTensor<B>| B::float_mul_scalar(g, (scale as f32).into()));
            }
        }
        grads
    }
}
