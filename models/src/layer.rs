//! One decoder layer: pre-norm attention, then a pre-norm dense MLP or MoE layer, each added
//! to the residual stream.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpipemoe::{MoeBackend, MoeLayer, Result};

use crate::attention::Attention;
use crate::cache::LayerCache;
use crate::config::AttnRules;
use crate::latent::LatentAttention;
use crate::mlp::Mlp;
use crate::norm::{NamedParts, RmsNorm};
use crate::places::Places;

/// `h = x + attn(norm1(x)); y = h + ffn(norm2(h))`, the ffn dense or MoE.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// `input_layernorm`
    pub attn_norm: RmsNorm<B>,
    /// `self_attn`, multi-head (grouped-query) attention.
    pub attn: Option<Attention<B>>,
    /// `self_attn`, multi-head latent attention (DeepSeek-V3).
    pub mla: Option<LatentAttention<B>>,
    /// `post_attention_layernorm`
    pub ffn_norm: RmsNorm<B>,
    /// The dense MLP of a dense layer.
    pub mlp: Option<Mlp<B>>,
    /// The MoE layer of a MoE layer (this rank's experts).
    pub moe: Option<MoeLayer<B>>,
    /// The layer's attention rules (window, chunks, NoPE, ...).
    #[module(skip)]
    pub rules: AttnRules,
    /// The dense MLP's module name (`mlp`, Llama 4's `feed_forward`).
    #[module(skip)]
    pub mlp_name: String,
}

/// A layer's output: the residual stream and the MoE layer's losses (zero for a dense one).
/// One MoE layer's part of transformers' load-balancing loss across layers
/// (`load_balancing_loss_func`), see `MoeCausalLm::try_forward`.
pub(crate) struct BalanceTerms<B: Backend> {
    /// This rank's tokens' softmax over all experts, summed. `[n_experts]`
    pub softmax_sum: Tensor<B, 1>,
    /// Assignments per expert over the expert-parallel group's batch, summed over its
    /// data-parallel replicas.
    pub routed: Vec<usize>,
    /// Tokens in the world's batch.
    pub n_tokens_world: usize,
    /// The layer's `aux_loss_coef`.
    pub coef: f64,
}

pub(crate) struct LayerOutput<B: Backend> {
    pub hidden: Tensor<B, 3>,
    pub z_loss: Option<Tensor<B, 1>>,
    /// The MoE layer's share of the model's load-balancing loss.
    pub balance: Option<BalanceTerms<B>>,
    pub cache: LayerCache<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// The Hugging Face names of its parameters under `prefix` (`model.layers.{i}`), the MoE
    /// layer's left out.
    pub fn hf_parts(&self, prefix: &str) -> NamedParts<'_, B> {
        let attn = format!("{prefix}.self_attn");
        let mut parts = match (&self.attn, &self.mla) {
            (Some(a), _) => a.hf_parts(&attn),
            (None, Some(m)) => m.hf_parts(&attn),
            (None, None) => NamedParts::default(),
        };
        if let Some(mlp) = &self.mlp {
            parts
                .linears
                .extend(mlp.hf_parts(&format!("{prefix}.{}", self.mlp_name)));
        }
        parts.norm(format!("{prefix}.input_layernorm"), &self.attn_norm);
        parts.norm(format!("{prefix}.post_attention_layernorm"), &self.ffn_norm);
        parts
    }
}

impl<B: MoeBackend> DecoderLayer<B> {
    /// Runs the layer on `x` at `places`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, d_model]`; output the same
    ///
    /// # Errors
    /// As [`MoeLayer::try_forward`] (a peer rank that fails).
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        places: &Places,
        rope: (&Tensor<B, 3>, &Tensor<B, 3>),
        cached: Option<&LayerCache<B>>,
    ) -> Result<LayerOutput<B>> {
        let normed = self.attn_norm.forward(x.clone());
        let (attended, cache) = match (&self.attn, &self.mla) {
            (Some(attn), _) => attn.forward(normed, places, rope, &self.rules, cached),
            (None, Some(mla)) => mla.forward(normed, places, rope, cached),
            (None, None) => unreachable!("a decoder layer is built with an attention block"),
        };
        let h = x + attended;
        let normed = self.ffn_norm.forward(h.clone());
        let (ffn, z_loss, balance) = match (&self.mlp, &self.moe) {
            (_, Some(moe)) => {
                // The layer's own `aux_loss` is not used: the model takes the loss across its
                // layers, as transformers does.
                let out = moe.try_forward(normed)?;
                let balance = BalanceTerms {
                    softmax_sum: out.router_softmax_sum,
                    routed: out.stats.routing.routed_per_expert,
                    n_tokens_world: out.stats.routing.n_tokens_world,
                    coef: moe.config().aux_loss_coef,
                };
                (out.output, Some(out.z_loss), Some(balance))
            }
            (Some(mlp), None) => (mlp.forward(normed), None, None),
            (None, None) => unreachable!("a decoder layer is built with an MLP or an MoE layer"),
        };
        Ok(LayerOutput {
            hidden: h + ffn,
            z_loss,
            balance,
            cache,
        })
    }
}
