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
use crate::linear::DenseProducts;
use crate::lora::LoraLinear;
use crate::mlp::Mlp;
use crate::norm::{NamedParts, RmsNorm};
use crate::places::Places;

/// The attention block's projection names, in the order of its adapters.
pub(crate) type Projections = &'static [&'static str];

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
    /// The attention adapters, read-only (see [`attention_lora_mut`](Self::attention_lora_mut)).
    pub(crate) fn attention_lora(&self) -> Option<(Projections, &[Option<LoraLinear<B>>])> {
        match (&self.attn, &self.mla) {
            (Some(a), _) => Some((&Attention::<B>::PROJECTIONS, &a.lora)),
            (None, Some(m)) => Some((&LatentAttention::<B>::PROJECTIONS, &m.lora)),
            (None, None) => None,
        }
    }

    /// Whether the layer has any adapter.
    pub(crate) fn has_lora(&self) -> bool {
        let attn = self
            .attention_lora()
            .is_some_and(|(_, l)| l.iter().any(Option::is_some));
        attn || self.moe.as_ref().is_some_and(|m| m.adapters.is_some())
    }

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
    /// Puts a fresh adapter on the attention projection `name` if the layer has it; whether
    /// it did.
    pub(crate) fn add_attention_adapter(
        &mut self,
        name: &str,
        rank: usize,
        scale: f64,
        seed: u64,
        key: &str,
        dropout: f64,
    ) -> bool {
        let Some([d_in, d_out]) = self.projection_dims(name) else {
            return false;
        };
        let device = self.attn_norm.weight.device();
        let Some((names, lora)) = self.attention_lora_mut() else {
            return false;
        };
        let Some(i) = names.iter().position(|n| *n == name) else {
            return false;
        };
        lora.resize_with(names.len(), || None);
        lora[i] = Some(LoraLinear {
            dropout,
            ..LoraLinear::init(d_in, d_out, rank, scale, seed, key, &device)
        });
        true
    }

    /// The attention adapters: the block's projection names, and the adapters in their order.
    pub(crate) fn attention_lora_mut(&mut self) -> Option<(Projections, &mut Vec<Option<LoraLinear<B>>>)> {
        match (&mut self.attn, &mut self.mla) {
            (Some(a), _) => Some((&Attention::<B>::PROJECTIONS, &mut a.lora)),
            (None, Some(m)) => Some((&LatentAttention::<B>::PROJECTIONS, &mut m.lora)),
            (None, None) => None,
        }
    }

    /// The `[d_in, d_out]` of the attention projection `name`, if the layer has it.
    pub(crate) fn projection_dims(&self, name: &str) -> Option<[usize; 2]> {
        match (&self.attn, &self.mla) {
            (Some(a), _) => a.projection_dims(name),
            (None, Some(m)) => m.projection_dims(name),
            (None, None) => None,
        }
    }

    /// The layer with every adapter merged into its weights.
    pub(crate) fn merge_lora(mut self) -> Self {
        self.attn = self.attn.map(Attention::merge_lora);
        self.mla = self.mla.map(LatentAttention::merge_lora);
        self.moe = self.moe.map(MoeLayer::merge_adapters);
        self
    }

    /// What of the cache a step extended ([`forward`](Self::forward)'s) a later query can still
    /// see: for standard attention, the entries inside its window or chunk
    /// ([`LayerCache::trim`]); latent attention keeps everything.
    pub(crate) fn kept(&self, cache: LayerCache<B>, pads: &[usize]) -> LayerCache<B> {
        match self.attn {
            Some(_) => cache.trim(self.rules.window, self.rules.chunk, pads),
            None => cache,
        }
    }

    /// Runs the layer on `x` at `places`, continuing `cached.0` (taken from the model's
    /// cache, so that the step writes into storage no one else holds) with room for
    /// `cached.1` entries ([`KvCache::reserve`](crate::KvCache::reserve)).
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
        cached: (Option<LayerCache<B>>, usize),
        dense: &DenseProducts,
    ) -> Result<LayerOutput<B>> {
        let normed = self.attn_norm.forward(x.clone());
        let (attended, cache) = match (&self.attn, &self.mla) {
            (Some(attn), _) => attn.forward(normed, places, rope, &self.rules, cached, dense)?,
            (None, Some(mla)) => mla.forward(normed, places, rope, cached, dense)?,
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
                // A layer without a z-loss returns a zero: not adding it to the model's sum
                // saves a launch a layer on a GPU backend, and changes no bit.
                let z_loss = (moe.config().z_loss_coef != 0.0).then_some(out.z_loss);
                (out.output, z_loss, Some(balance))
            }
            (Some(mlp), None) => (mlp.forward(normed, dense)?, None, None),
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
