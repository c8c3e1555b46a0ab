//! Multi-head latent attention (DeepSeek-V2 / V3): queries through an optional low-rank
//! projection, keys and values expanded from a shared compressed latent, a rotary part of
//! each head kept apart and shared by all heads for the keys.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use mpipemoe::decoder::TailRotation;
use mpipemoe::layout::swap_dims_contiguous;
use mpipemoe::{MoeBackend, Result};

use crate::attention::{attend, probabilities};
use crate::cache::LayerCache;
use crate::config::AttnRules;
use crate::linear::DenseProducts;
use crate::lora::{merged, project, project_all, LoraLinear};
use crate::norm::{NamedParts, RmsNorm};
use crate::places::Places;
use crate::rotary::Rotary;

/// The sizes and rules of latent attention (DeepSeek-V3's `q_lora_rank`, `kv_lora_rank`,
/// `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatentConfig {
    /// The queries' low rank (`q_a_proj` → `q_a_layernorm` → `q_b_proj`); `None` for one
    /// `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// The keys' and values' shared latent width.
    pub kv_lora_rank: usize,
    /// Each head's query/key width without rotary embedding.
    pub qk_nope_head_dim: usize,
    /// Each head's query/key width with it (the key's is shared by every head).
    pub qk_rope_head_dim: usize,
    /// Each head's value width.
    pub v_head_dim: usize,
    /// The rotary dimensions come in interleaved pairs `(x0, x1), (x2, x3), ...`
    /// (transformers' `apply_rotary_pos_emb_interleave`); else "rotate half".
    pub rope_interleave: bool,
    /// The softmax's scale: `(qk_nope + qk_rope)^-0.5`, times `mscale²` under YaRN with
    /// `mscale_all_dim` (transformers' `yarn_apply_mscale`).
    pub softmax_scale: f64,
}

/// One latent attention block (`self_attn` of DeepSeek-V3).
#[derive(Module, Debug)]
pub struct LatentAttention<B: Backend> {
    /// `q_proj` without a query rank: `[d_model, n_heads · (nope + rope)]`
    pub q: Option<Linear<B>>,
    /// `q_a_proj`: `[d_model, q_lora_rank]`
    pub q_a: Option<Linear<B>>,
    /// `q_a_layernorm`
    pub q_a_norm: Option<RmsNorm<B>>,
    /// `q_b_proj`: `[q_lora_rank, n_heads · (nope + rope)]`
    pub q_b: Option<Linear<B>>,
    /// `kv_a_proj_with_mqa`: `[d_model, kv_lora_rank + rope]`
    pub kv_a: Linear<B>,
    /// `kv_a_layernorm`
    pub kv_a_norm: RmsNorm<B>,
    /// `kv_b_proj`: `[kv_lora_rank, n_heads · (nope + v)]`
    pub kv_b: Linear<B>,
    /// `o_proj`: `[n_heads · v, d_model]`
    pub o: Linear<B>,
    /// LoRA adapters on the projections, in [`LatentAttention::PROJECTIONS`]' order (empty
    /// without adapters).
    pub lora: Vec<Option<LoraLinear<B>>>,
    /// The head count and the latent sizes.
    #[module(skip)]
    pub(crate) rules: (usize, LatentConfig),
}

impl<B: Backend> LatentAttention<B> {
    /// Randomly initialised (burn's `Linear` initialisation, norms at one): `n_heads` heads on
    /// a residual of `d_model`, biases on `q_a`, `kv_a` and `o` if `bias`.
    pub fn new(
        d_model: usize,
        n_heads: usize,
        c: LatentConfig,
        bias: bool,
        eps: f64,
        device: &B::Device,
    ) -> Self {
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let (q, q_a, q_a_norm, q_b) = match c.q_lora_rank {
            None => (Some(linear(d_model, n_heads * qk, false)), None, None, None),
            Some(r) => (
                None,
                Some(linear(d_model, r, bias)),
                Some(RmsNorm::new(r, eps, device)),
                Some(linear(r, n_heads * qk, false)),
            ),
        };
        Self {
            q,
            q_a,
            q_a_norm,
            q_b,
            kv_a: linear(d_model, c.kv_lora_rank + c.qk_rope_head_dim, bias),
            kv_a_norm: RmsNorm::new(c.kv_lora_rank, eps, device),
            kv_b: linear(
                c.kv_lora_rank,
                n_heads * (c.qk_nope_head_dim + c.v_head_dim),
                false,
            ),
            o: linear(n_heads * c.v_head_dim, d_model, bias),
            lora: Vec::new(),
            rules: (n_heads, c),
        }
    }

    /// The projections' Hugging Face names, the order of [`LatentAttention::lora`].
    pub const PROJECTIONS: [&'static str; 6] = [
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ];

    /// The projection named `name` (one of [`LatentAttention::PROJECTIONS`]), if the block
    /// has it.
    pub fn projection(&self, name: &str) -> Option<&Linear<B>> {
        match name {
            "q_proj" => self.q.as_ref(),
            "q_a_proj" => self.q_a.as_ref(),
            "q_b_proj" => self.q_b.as_ref(),
            "kv_a_proj_with_mqa" => Some(&self.kv_a),
            "kv_b_proj" => Some(&self.kv_b),
            "o_proj" => Some(&self.o),
            _ => None,
        }
    }

    /// The `[d_in, d_out]` of the projection `name`, if the block has it.
    pub fn projection_dims(&self, name: &str) -> Option<[usize; 2]> {
        self.projection(name).map(|l| l.weight.dims())
    }

    /// The adapter on projection `i` of [`LatentAttention::PROJECTIONS`], if any.
    fn adapter(&self, i: usize) -> Option<&LoraLinear<B>> {
        self.lora.get(i).and_then(Option::as_ref)
    }

    /// The block with its adapters folded into the projections' weights and dropped.
    pub(crate) fn merge_lora(mut self) -> Self {
        let mut lora = std::mem::take(&mut self.lora);
        let mut take = |i: usize| lora.get_mut(i).and_then(Option::take);
        let (q, q_a, q_b) = (take(0), take(1), take(2));
        self.q = self.q.map(|l| merged(l, q));
        self.q_a = self.q_a.map(|l| merged(l, q_a));
        self.q_b = self.q_b.map(|l| merged(l, q_b));
        self.kv_a = merged(self.kv_a, take(3));
        self.kv_b = merged(self.kv_b, take(4));
        self.o = merged(self.o, take(5));
        self
    }

    /// The Hugging Face names of its parameters under `prefix` (`...self_attn`).
    pub fn hf_parts(&self, prefix: &str) -> NamedParts<'_, B> {
        let mut parts = NamedParts::default();
        if let Some(q) = &self.q {
            parts.linears.push((format!("{prefix}.q_proj"), q));
        }
        if let (Some(a), Some(n), Some(b)) = (&self.q_a, &self.q_a_norm, &self.q_b) {
            parts.linears.push((format!("{prefix}.q_a_proj"), a));
            parts.norm(format!("{prefix}.q_a_layernorm"), n);
            parts.linears.push((format!("{prefix}.q_b_proj"), b));
        }
        parts
            .linears
            .push((format!("{prefix}.kv_a_proj_with_mqa"), &self.kv_a));
        parts.norm(format!("{prefix}.kv_a_layernorm"), &self.kv_a_norm);
        parts.linears.push((format!("{prefix}.kv_b_proj"), &self.kv_b));
        parts.linears.push((format!("{prefix}.o_proj"), &self.o));
        parts
    }
}

impl<B: MoeBackend> LatentAttention<B> {
    /// Attends the tokens `x` at `places` to themselves and to `cached`, causally and past
    /// each row's pad columns. The cache holds the compressed form (DeepSeek's inference
    /// cache): each token's normalised `kv_lora_rank` latent (as `values`) and its rotary key
    /// (as `keys`), both shared by every head, `kv_lora_rank + qk_rope_head_dim` values a token
    /// where the expanded keys and values would take `n_heads · (qk_nope + qk_rope + v)`. A
    /// forward with nothing cached expands the keys and values as transformers does; one after
    /// a cache attends on the latents, `kv_b` absorbed into the queries. The projections
    /// multiply as `dense` makes them.
    ///
    /// # Errors
    /// As [`DenseProducts::matmul`].
    ///
    /// # Shapes
    /// - x: `[batch, seq, d_model]`; cos, sin: `[rows, seq, qk_rope_head_dim]` (`rows` the
    ///   batch where rows are padded, else 1)
    /// - output: `[batch, seq, d_model]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        places: &Places,
        (cos, sin): (&Tensor<B, 3>, &Tensor<B, 3>),
        (cached, reserve): (Option<LayerCache<B>>, usize),
        dense: &DenseProducts,
    ) -> Result<(Tensor<B, 3>, LayerCache<B>)> {
        let (h, c) = self.rules;
        let (nope, rope, v_dim, lora) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let [b, t, _] = x.dims();
        // The two projections of the input (the query's, or its compression's, and the keys'
        // and values' compression) in one call of `dense` (on CUDA one cuBLAS section).
        let first = match (&self.q, &self.q_a) {
            (Some(q), _) => (q, self.adapter(0)),
            (None, Some(a)) => (a, self.adapter(1)),
            _ => unreachable!("built with q_proj or the q_a / q_b pair"),
        };
        let [q, compressed]: [Tensor<B, 3>; 2] =
            project_all(dense, &[first, (&self.kv_a, self.adapter(3))], x)?
                .try_into()
                .unwrap_or_else(|_| unreachable!("one output per projection"));
        let q = match (&self.q, &self.q_a_norm, &self.q_b) {
            (Some(_), ..) => q,
            (None, Some(n), Some(qb)) => project(dense, qb, self.adapter(2), n.forward(q))?,
            _ => unreachable!("built with q_proj or the q_a / q_b pair"),
        };
        // [batch, heads, seq, nope + rope]: each head's rotary part rotated and the whole
        // written head-major in one op (one kernel each way on the CubeCL backends).
        let form = |skip, pass| TailRotation {
            interleaved: c.rope_interleave,
            skip,
            pass,
        };
        let query = Rotary::apply_tail_to_heads(q.reshape([b, t, h, nope + rope]), cos, sin, form(0, nope));
        // Composed, the op's output is a head-major view of a sequence-major tensor: written
        // head-major once here, as attention's products read it, rather than copied by each
        // product that reads the view on a CPU backend.
        let query = match B::rotary_node() {
            true => query,
            false => swap_dims_contiguous(query.swap_dims(1, 2)),
        };
        // The latent: the compression's first `kv_lora_rank` values, normalised where they lie.
        let kv = self.kv_a_norm.forward_columns(compressed.clone());
        // [batch, 1, seq, rope]: the keys' rotary part, one head shared by all, read from the
        // compression whole with the latent left out: where the rotation is one op, no slice
        // is copied forward, and its gradient is the whole compression's (zero where the latent
        // is) rather than a slice's padded.
        let k_rot = Rotary::apply_tail_to_heads(
            compressed.reshape([b, t, 1, lora + rope]),
            cos,
            sin,
            form(lora, 0),
        );
        // The cache holds the compressed form: the normalised latent and the rotary key, both
        // shared by every head.
        let latent = kv.clone().reshape([b, 1, t, lora]);
        let continues = cached.is_some();
        let mut cache = LayerCache::extend(cached, k_rot.clone(), latent, &places.columns(), reserve);
        let out = match continues {
            // Nothing earlier: every head's keys and values expanded from these tokens' latent,
            // as transformers computes them (the training path and a prefill).
            false => {
                // [batch, seq, heads, nope + v]: each head's `[k_nope | v]`.
                let kv = project(dense, &self.kv_b, self.adapter(4), kv)?.reshape([b, t, h, nope + v_dim]);
                let (keys, values) = keys_and_values(kv, k_rot, nope);
                attend(
                    query,
                    (keys, values),
                    (places, &cache.columns),
                    &AttnRules::default(),
                    (c.softmax_scale, None),
                    dense,
                )?
            }
            true => {
                let maps = cache.absorbed.clone().unwrap_or_else(|| self.absorbed_maps());
                cache.absorbed = Some(maps.clone());
                let q_pass = query.clone().slice([0..b, 0..h, 0..t, 0..nope]);
                let q_rot = query.slice([0..b, 0..h, 0..t, nope..nope + rope]);
                self.absorbed(q_pass, q_rot, maps, &cache, places, dense)?
            }
        };
        let out = swap_dims_contiguous(out).reshape([b, t, h * v_dim]);
        Ok((project(dense, &self.o, self.adapter(5), out)?, cache))
    }

    /// Attention on the compressed cache, as DeepSeek's own inference runs it: `kv_b`'s key map
    /// absorbed into the queries and its value map applied after the weighted sum, so that
    /// every cached token is its `kv_lora_rank` latent and one rotary key, not every head's
    /// keys and values. The same function as the expanded form (`kv_b` has no bias): per head
    /// `q_nope · (L · W_k)ᵀ = (q_nope · W_kᵀ) · Lᵀ` and `P · (L · W_v) = (P · L) · W_v`.
    ///
    /// # Shapes
    /// - q_pass: `[batch, heads, seq, qk_nope_head_dim]`; q_rot: `[batch, heads, seq,
    ///   qk_rope_head_dim]`
    /// - cache: keys (the rotary keys) `[batch, 1, cached, qk_rope_head_dim]`, values (the
    ///   latents) `[batch, 1, cached, kv_lora_rank]`
    /// - output: `[batch, heads, seq, v_head_dim]`
    fn absorbed(
        &self,
        q_pass: Tensor<B, 4>,
        q_rot: Tensor<B, 4>,
        (w_key, w_value): (Tensor<B, 3>, Tensor<B, 3>),
        cache: &LayerCache<B>,
        places: &Places,
        dense: &DenseProducts,
    ) -> Result<Tensor<B, 4>> {
        let (h, c) = self.rules;
        let lora = c.kv_lora_rank;
        let [b, _, t, _] = q_pass.dims();
        let s = cache.columns.len();
        let q_latent = per_head(q_pass, w_key, dense)?;
        // The keys are shared by the heads: the heads' queries are rows of one product.
        let rows = |x: Tensor<B, 4>| {
            let d = x.dims()[3];
            x.reshape([b, 1, h * t, d])
        };
        // Every product per head as `dense` multiplies (the library at its precision where
        // there is one), as the expanded form's are (`attend`).
        let scores = dense.heads_matmul(rows(q_latent), cache.values().swap_dims(2, 3))?
            + dense.heads_matmul(rows(q_rot), cache.keys().swap_dims(2, 3))?;
        let scores = scores.reshape([b, h, t, s]);
        let probs = probabilities(
            scores,
            c.softmax_scale,
            (places, &cache.columns),
            &AttnRules::default(),
            None,
        );
        let context = dense
            .heads_matmul(rows(probs), cache.values())?
            .reshape([b, h, t, lora]);
        per_head(context, w_value, dense)
    }
}

impl<B: Backend> LatentAttention<B> {
    /// `kv_b`'s weight `[lora, heads · (nope + v)]` as each head's maps from the latent, the
    /// key map transposed: `[heads, nope, lora]` and `[heads, lora, v]`, each in a buffer of
    /// its own. A generation makes them once, at its first cached step, and its cache carries
    /// them ([`LayerCache`]): re-laid at every step they were a copy of the whole weight per
    /// layer and token (67 MB a layer for DeepSeek-V3), where the step itself reads it once.
    /// Taken from the weight's values, so a cached step's products hold `kv_b` constant:
    /// generation does not train, and a loss takes no cache.
    fn absorbed_maps(&self) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (h, c) = self.rules;
        let (nope, v_dim, lora) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
        // An adapter on `kv_b` is part of the maps: the weight the expanded path runs.
        let w = match self.adapter(4) {
            Some(lora) => self.kv_b.weight.val() + lora.delta(),
            None => self.kv_b.weight.val(),
        };
        let device = w.device();
        let w = w.reshape([lora, h, nope + v_dim]).swap_dims(0, 1);
        let own = |t: Tensor<B, 3>| Tensor::from_data(t.into_data(), &device);
        (
            own(w.clone().slice([0..h, 0..lora, 0..nope]).swap_dims(1, 2)),
            own(w.slice([0..h, 0..lora, nope..nope + v_dim])),
        )
    }
}

/// Latent attention's keys and values from the expanded product, both head-major: the keys
/// each head's `k_nope` joined with the rotary key every head shares, the values each head's
/// `v`. Where the backend has them as one op each way
/// ([`DecoderKernels::latent_node`](mpipemoe::backend::DecoderKernels::latent_node): the CubeCL
/// backends), one kernel each; elsewhere one swap of the product, views of it and the
/// concatenation, whose backward pads and adds the views' gradients.
///
/// # Shapes
/// - kv: `[batch, seq, heads, nope + v]`; k_rot: `[batch, 1, seq, rope]`
/// - output: keys `[batch, heads, seq, nope + rope]`, values `[batch, heads, seq, v]`
fn keys_and_values<B: MoeBackend>(
    kv: Tensor<B, 4>,
    k_rot: Tensor<B, 4>,
    nope: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    if B::latent_node() {
        let float = |t: FloatTensor<B>| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
        let (kv, k_rot) = (kv.into_primitive().tensor(), k_rot.into_primitive().tensor());
        return (
            float(B::latent_keys(kv.clone(), k_rot, nope)),
            float(B::latent_values(kv, nope)),
        );
    }
    let [b, t, h, width] = kv.dims();
    let kv = swap_dims_contiguous(kv);
    let k_nope = kv.clone().slice([0..b, 0..h, 0..t, 0..nope]);
    let values = kv.slice([0..b, 0..h, 0..t, nope..width]);
    (Tensor::cat(vec![k_nope, k_rot.repeat_dim(1, h)], 3), values)
}

/// Each head's rows times that head's matrix.
///
/// # Shapes
/// - x: `[batch, heads, seq, in]`; w: `[heads, in, out]`
/// - output: `[batch, heads, seq, out]`
fn per_head<B: MoeBackend>(x: Tensor<B, 4>, w: Tensor<B, 3>, dense: &DenseProducts) -> Result<Tensor<B, 4>> {
    let [b, h, t, i] = x.dims();
    let o = w.dims()[2];
    let rows = x.swap_dims(0, 1).reshape([h, b * t, i]);
    Ok(dense.heads_matmul(rows, w)?.reshape([h, b, t, o]).swap_dims(0, 1))
}
