//! What a decoder is made of: the sizes and the rules its family switches on.

use mpipemoe::{MoeError, MoeLayerConfig, Result};

use crate::attention::QkNorm;
use crate::generation::GenerationDefaults;
use crate::latent::LatentConfig;
use crate::rotary::RopeScaling;

/// The most elements one weight may have (2^40: 4 TiB of f32, beyond any published model's
/// largest matrix), so that products of sizes from a config never overflow.
const MAX_WEIGHT_ELEMENTS: usize = 1 << 40;

/// A decoder layer's feed-forward block.
#[derive(Debug, Clone)]
pub enum FfnKind {
    /// A dense SwiGLU MLP of width `d_hidden` (`down(silu(gate(x)) · up(x))`).
    Dense {
        /// The MLP's hidden width.
        d_hidden: usize,
    },
    /// An [`MoeLayer`](mpipemoe::MoeLayer) with this configuration.
    Moe(Box<MoeLayerConfig>),
}

/// One decoder layer's rules.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    /// Dense MLP or MoE layer.
    pub ffn: FfnKind,
    /// Its attention's rules.
    pub attn: AttnRules,
}

/// The rules one layer's attention follows (beyond the model-wide ones).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnRules {
    /// Sliding-window attention: a query at position `p` sees keys at positions
    /// `p - window + 1 ..= p` (transformers' `sliding_window_overlay`); `None` for full causal
    /// attention.
    pub window: Option<usize>,
    /// Chunked attention (Llama 4): a query sees only the keys of its own chunk of this many
    /// positions (transformers' `chunked_overlay`).
    pub chunk: Option<usize>,
    /// Rotary embeddings on this layer (Llama 4's NoPE layers have none).
    pub rope: bool,
    /// L2 norm (an RMS norm without weight) on queries and keys after the rotary embedding
    /// (Llama 4's `use_qk_norm`, on its rotary layers).
    pub l2_qk_norm: bool,
    /// Attention temperature tuning (Llama 4's NoPE layers): queries at position `p` times
    /// `ln(1 + floor((p + 1) / floor_scale)) · attn_scale + 1`, as `(attn_scale, floor_scale)`.
    pub temperature: Option<(f64, f64)>,
}

impl Default for AttnRules {
    fn default() -> Self {
        Self {
            window: None,
            chunk: None,
            rope: true,
            l2_qk_norm: false,
            temperature: None,
        }
    }
}

/// A decoder-only MoE language model's configuration: what [`family`](crate::family) reads
/// from a Hugging Face `config.json`, or what a user writes for a model of their own.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    /// The Hugging Face `model_type` it was read from (or a name of the user's).
    pub model_type: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The residual stream's width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention: `n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm's epsilon.
    pub rms_eps: f64,
    /// Rotary embeddings' base (`rope_theta`).
    pub rope_theta: f64,
    /// Rotary embeddings' scaling rule.
    pub rope_scaling: RopeScaling,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// RMSNorm on the queries and keys before the rotary embedding.
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after the projections (OLMoE's `clip_qkv`).
    pub clip_qkv: Option<f64>,
    /// A learned sink logit per head in every softmax (GPT-OSS's `sinks`).
    pub attention_sinks: bool,
    /// Every layer's rules, in order.
    pub layers: Vec<LayerSpec>,
    /// The output projection is the embedding's transpose.
    pub tie_embeddings: bool,
    /// Ids that end generation: `generation_config.json`'s where the folder has them (as
    /// transformers' `generate` stops), else `config.json`'s.
    pub eos_token_ids: Vec<usize>,
    /// `generation_config.json`'s sampling defaults (and stop ids), as transformers'
    /// `generate` uses them; greedy where the folder has none.
    pub generation: GenerationDefaults,
    /// The most positions the model was built for (`max_position_embeddings`): a forward
    /// past them is refused, as are a prompt and new tokens that would run past them. `None`
    /// where the config does not say (no bound).
    pub max_positions: Option<usize>,
    /// Multi-head latent attention in place of grouped-query attention (DeepSeek-V3); the
    /// rotary embedding then covers `qk_rope_head_dim` (`head_dim` is set to it).
    pub latent: Option<LatentConfig>,
    /// What the Hugging Face names of the text model start with (`model.`).
    pub hf_root: String,
    /// The dense MLP's module name (`mlp`; Llama 4's `feed_forward`).
    pub mlp_name: String,
    /// Rotary dimensions in interleaved pairs `(x0, x1), (x2, x3), ...`, rotated in place
    /// (Llama 4's complex-number form); else "rotate half".
    pub rope_pairs: bool,
}

impl DecoderConfig {
    /// The output projection's Hugging Face name: `lm_head`, or `language_model.lm_head`
    /// inside a multimodal release (Llama 4's), beside its text model's root.
    pub fn lm_head_name(&self) -> String {
        let outer = self.hf_root.strip_suffix("model.").unwrap_or("");
        format!("{outer}lm_head")
    }

    /// Checks the sizes agree with each other.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming the field that is zero or does not divide.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("layers", self.layers.len()),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(MoeError::config(field, "must be positive"));
        }
        // Each weight's element count from these sizes must fit, far below overflow, before
        // the loader compares it with the stored shapes (the sizes come from strangers).
        let mut products = vec![
            ("head_dim", self.n_heads, self.head_dim),
            ("head_dim", self.n_kv_heads, self.head_dim),
            ("vocab_size", self.vocab_size, self.d_model),
        ];
        if let Some(c) = &self.latent {
            let qk = c.qk_nope_head_dim.saturating_add(c.qk_rope_head_dim);
            let v = c.qk_nope_head_dim.saturating_add(c.v_head_dim);
            products.push(("qk_nope_head_dim", self.n_heads, qk));
            products.push(("v_head_dim", self.n_heads, v));
            products.push((
                "kv_lora_rank",
                c.kv_lora_rank.saturating_add(c.qk_rope_head_dim),
                self.d_model,
            ));
        }
        for (field, a, b) in products {
            if a.checked_mul(b).is_none_or(|n| n > MAX_WEIGHT_ELEMENTS) {
                return Err(MoeError::config(
                    field,
                    format!("{a} x {b} elements in one weight, over the {MAX_WEIGHT_ELEMENTS} this loader accepts"),
                ));
            }
        }
        if self.max_positions == Some(0) {
            return Err(MoeError::config("max_position_embeddings", "must be positive"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(MoeError::config(
                "n_kv_heads",
                format!("{} does not divide n_heads = {}", self.n_kv_heads, self.n_heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(MoeError::config(
                "head_dim",
                format!("{} is odd: rotary embeddings rotate pairs", self.head_dim),
            ));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if layer.attn.window == Some(0) || layer.attn.chunk == Some(0) {
                return Err(MoeError::config(
                    "window",
                    format!("layer {i}: a window or chunk of 0 sees nothing"),
                ));
            }
            match &layer.ffn {
                FfnKind::Dense { d_hidden: 0 } => {
                    return Err(MoeError::config(
                        "d_hidden",
                        format!("layer {i}: must be positive"),
                    ))
                }
                FfnKind::Moe(moe) if moe.d_model != self.d_model => {
                    return Err(MoeError::config(
                        "d_model",
                        format!(
                            "layer {i}'s MoE layer is {} wide, the model {}",
                            moe.d_model, self.d_model
                        ),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn n_rep(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}
