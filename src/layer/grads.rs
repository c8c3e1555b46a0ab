//! Parameters and gradients by canonical name.

use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use super::MoeLayer;

/// How a parameter's gradient combines over expert-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Replicated on every rank (router, shared expert): gradients are summed over ranks.
    Replicated,
    /// Sharded by expert along dimension 0: each rank owns its experts' gradient.
    Expert,
}

fn grad<B: AutodiffBackend, const D: usize>(
    p: &Param<Tensor<B, D>>,
    grads: &B::Gradients,
) -> Option<TensorData> {
    p.grad(grads).map(|g| g.into_data().convert::<f32>())
}

impl<B: AutodiffBackend> MoeLayer<B> {
    /// This rank's parameter gradients under their canonical names (`router.weight`,
    /// `experts.w_in`, ...), with how each combines over ranks. `None` where the parameter
    /// received no gradient (for example, a rank with no tokens never touches the router).
    pub fn grads_by_name(&self, grads: &B::Gradients) -> Vec<(&'static str, ParamKind, Option<TensorData>)> {
        use ParamKind::*;
        let mut out = vec![("router.weight", Replicated, grad(&self.router.weight, grads))];
        if let Some(b) = &self.router.bias {
            out.push(("router.bias", Replicated, grad(b, grads)));
        }
        // Not trained by gradient: it never has one (the cases expect zeros).
        if let Some(b) = &self.router.score_bias {
            out.push(("router.score_bias", Replicated, grad(b, grads)));
        }
        out.push(("experts.w_in", Expert, grad(&self.experts.w_in, grads)));
        if let Some(b) = &self.experts.b_in {
            out.push(("experts.b_in", Expert, grad(b, grads)));
        }
        out.push(("experts.w_out", Expert, grad(&self.experts.w_out, grads)));
        if let Some(b) = &self.experts.b_out {
            out.push(("experts.b_out", Expert, grad(b, grads)));
        }
        if let Some(s) = &self.shared {
            out.push(("shared.w_in", Replicated, grad(&s.w_in, grads)));
            out.push(("shared.w_out", Replicated, grad(&s.w_out, grads)));
            if let Some(gate) = &s.gate {
                out.push(("shared.gate.weight", Replicated, grad(gate, grads)));
            }
        }
        out
    }
}
