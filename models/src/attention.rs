//! Causal self-attention with grouped-query heads, rotary embeddings, optional q/k norms,
//! clipping and sliding windows.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use mpipemoe::layout::swap_dims_contiguous;
use mpipemoe::{MoeBackend, Result};

use crate::cache::LayerCache;
use crate::config::{AttnRules, DecoderConfig};
use crate::linear::DenseProducts;
use crate::lora::{merged, project, project_all, LoraLinear};
use crate::norm::{NamedParts, RmsNorm};
use crate::places::Places;
use crate::rotary::Rotary;

/// Where RMSNorm is applied to the queries and keys (before the rotary embedding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// None (Mixtral, Qwen2-MoE).
    None,
    /// Over each head's `head_dim` (Qwen3-MoE's `q_norm` / `k_norm` of `[head_dim]`).
    PerHead,
    /// Over the whole projection (OLMoE's `q_norm` of `[n_heads · head_dim]` and `k_norm` of
    /// `[n_kv_heads · head_dim]`).
    Whole,
}

/// One attention block (`self_attn`).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[d_model, n_heads · head_dim]`
    pub q: Linear<B>,
    /// `[d_model, n_kv_heads · head_dim]`
    pub k: Linear<B>,
    /// `[d_model, n_kv_heads · head_dim]`
    pub v: Linear<B>,
    /// `[n_heads · head_dim, d_model]`
    pub o: Linear<B>,
    /// The queries' norm, if the family has one.
    pub q_norm: Option<RmsNorm<B>>,
    /// The keys' norm, if the family has one.
    pub k_norm: Option<RmsNorm<B>>,
    /// GPT-OSS's attention sinks: one learned logit per head that joins every query's softmax
    /// and is dropped after it, so a head can attend to nothing. `[n_heads]`
    pub sinks: Option<Param<Tensor<B, 1>>>,
    /// LoRA adapters on `q`, `k`, `v` and `o`, in [`Attention::PROJECTIONS`]' order (empty
    /// without adapters).
    pub lora: Vec<Option<LoraLinear<B>>>,
    #[module(skip)]
    pub(crate) shape: Heads,
}

/// The head layout and rules, fixed at construction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    qk_norm: QkNorm,
    clip: Option<f64>,
    rope_pairs: bool,
    eps: f64,
}

impl Heads {
    /// The layout and rules of `config`'s attention.
    pub(crate) fn of(config: &DecoderConfig) -> Self {
        Heads {
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            qk_norm: config.qk_norm,
            clip: config.clip_qkv,
            rope_pairs: config.rope_pairs,
            eps: config.rms_eps,
        }
    }
}

impl<B: Backend> Attention<B> {
    /// Randomly initialised for `config` (burn's `Linear` initialisation, norms at one).
    pub fn new(config: &DecoderConfig, device: &B::Device) -> Self {
        let (m, hd) = (config.d_model, config.head_dim);
        let (q_width, kv_width) = (config.n_heads * hd, config.n_kv_heads * hd);
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        let (q_norm, k_norm) = Self::norm_widths(config);
        Self {
            q: linear(m, q_width, config.qkv_bias),
            k: linear(m, kv_width, config.qkv_bias),
            v: linear(m, kv_width, config.qkv_bias),
            o: linear(q_width, m, config.o_bias),
            q_norm: q_norm.map(|w| RmsNorm::new(w, config.rms_eps, device)),
            k_norm: k_norm.map(|w| RmsNorm::new(w, config.rms_eps, device)),
            sinks: config
                .attention_sinks
                .then(|| Param::from_tensor(Tensor::zeros([config.n_heads], device))),
            lora: Vec::new(),
            shape: Heads::of(config),
        }
    }

    /// The projections' Hugging Face names, the order of [`Attention::lora`].
    pub const PROJECTIONS: [&'static str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

    /// The projection named `name` (one of [`Attention::PROJECTIONS`]).
    pub fn projection(&self, name: &str) -> Option<&Linear<B>> {
        match name {
            "q_proj" => Some(&self.q),
            "k_proj" => Some(&self.k),
            "v_proj" => Some(&self.v),
            "o_proj" => Some(&self.o),
            _ => None,
        }
    }

    /// The `[d_in, d_out]` of the projection `name`, if the block has it.
    pub fn projection_dims(&self, name: &str) -> Option<[usize; 2]> {
        self.projection(name).map(|l| l.weight.dims())
    }

    /// The adapter on projection `i` of [`Attention::PROJECTIONS`], if any.
    fn adapter(&self, i: usize) -> Option<&LoraLinear<B>> {
        self.lora.get(i).and_then(Option::as_ref)
    }

    /// The block with its adapters folded into the projections' weights and dropped.
    pub(crate) fn merge_lora(mut self) -> Self {
        let mut lora = std::mem::take(&mut self.lora);
        let mut take = |i: usize| lora.get_mut(i).and_then(Option::take);
        self.q = merged(self.q, take(0));
        self.k = merged(self.k, take(1));
        self.v = merged(self.v, take(2));
        self.o = merged(self.o, take(3));
        self
    }

    /// The widths of the query and key norms `config` asks for, if any.
    pub(crate) fn norm_widths(config: &DecoderConfig) -> (Option<usize>, Option<usize>) {
        let hd = config.head_dim;
        match config.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (Some(hd), Some(hd)),
            QkNorm::Whole => (Some(config.n_heads * hd), Some(config.n_kv_heads * hd)),
        }
    }

    /// The Hugging Face names of its parameters under `prefix` (`...self_attn`).
    pub fn hf_parts(&self, prefix: &str) -> NamedParts<'_, B> {
        let mut parts = NamedParts::default();
        for (name, l) in [
            ("q_proj", &self.q),
            ("k_proj", &self.k),
            ("v_proj", &self.v),
            ("o_proj", &self.o),
        ] {
            parts.linears.push((format!("{prefix}.{name}"), l));
        }
        for (name, n) in [("q_norm", &self.q_norm), ("k_norm", &self.k_norm)] {
            if let Some(n) = n {
                parts.norm(format!("{prefix}.{name}"), n);
            }
        }
        if let Some(sinks) = &self.sinks {
            parts.vectors.push((format!("{prefix}.sinks"), sinks));
        }
        parts
    }
}

impl<B: MoeBackend> Attention<B> {
    /// Attends the tokens `x` at `places` to themselves and to `cached` (earlier columns),
    /// causally, within `window` and past each row's pad columns. Returns the output and the
    /// cache extended by these tokens' keys and values, untrimmed (the model trims what it
    /// keeps: `DecoderLayer::kept`). The projections and the per-head products multiply as
    /// `dense` makes them.
    ///
    /// # Errors
    /// As [`DenseProducts::matmul`].
    ///
    /// # Shapes
    /// - x: `[batch, seq, d_model]`; places: `seq` columns
    /// - cos, sin: `[rows, seq, head_dim]` (the rotary tables of `places`' positions: `rows`
    ///   is the batch where rows are padded, else 1)
    /// - output: `[batch, seq, d_model]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        places: &Places,
        (cos, sin): (&Tensor<B, 3>, &Tensor<B, 3>),
        rules: &AttnRules,
        (cached, reserve): (Option<LayerCache<B>>, usize),
        dense: &DenseProducts,
    ) -> Result<(Tensor<B, 3>, LayerCache<B>)> {
        let Heads {
            n_heads,
            n_kv_heads,
            head_dim,
            qk_norm,
            clip,
            rope_pairs,
            eps,
        } = self.shape;
        let [b, t, _] = x.dims();
        let device = x.device();
        // The three projections of one input in two calls (one without adapters): on CUDA a
        // call is a cuBLAS section, and a decode step's products are too small to hide one.
        let parts = [
            (&self.q, self.adapter(0)),
            (&self.k, self.adapter(1)),
            (&self.v, self.adapter(2)),
        ];
        let [mut q, mut k, mut v]: [Tensor<B, 3>; 3] = project_all(dense, &parts, x)?
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per projection"));
        if qk_norm == QkNorm::Whole {
            q = norm(&self.q_norm, q);
            k = norm(&self.k_norm, k);
        }
        if let Some(c) = clip {
            q = q.clamp(-c, c);
            k = k.clamp(-c, c);
            v = v.clamp(-c, c);
        }
        // [batch, seq, heads, head_dim] -> [batch, heads, seq, head_dim]
        let heads = |x: Tensor<B, 3>, n: usize| x.reshape([b, t, n, head_dim]);
        let (mut q, mut k, v) = (heads(q, n_heads), heads(k, n_kv_heads), heads(v, n_kv_heads));
        if qk_norm == QkNorm::PerHead {
            q = norm(&self.q_norm, q);
            k = norm(&self.k_norm, k);
        }
        // Head-major in a layout of their own: Flex copied the strided view of `swap_dims`
        // element by element in each product and in backward. The rotation is element-wise per
        // position, so it reads the contiguous sequence-major layout; where the backend has the
        // rotation kernels (`rotary_node`) it writes its output head-major in the same pass, and
        // its backward reads the head-major gradient where it lies, so the queries and the keys
        // are not copied again. Elsewhere it rotates in place of layout and one copy swaps
        // (`swap_dims_contiguous`).
        let to_heads = rules.rope && B::rotary_node();
        if rules.rope && !to_heads {
            (q, k) = match rope_pairs {
                true => (
                    Rotary::apply_pairs_seq_major(q, cos, sin),
                    Rotary::apply_pairs_seq_major(k, cos, sin),
                ),
                false => (
                    Rotary::apply_seq_major(q, cos, sin),
                    Rotary::apply_seq_major(k, cos, sin),
                ),
            };
        }
        let (mut q, mut k, v) = match to_heads {
            true => (
                Rotary::apply_seq_major_to_heads(q, cos, sin, rope_pairs),
                Rotary::apply_seq_major_to_heads(k, cos, sin, rope_pairs),
                swap_dims_contiguous(v),
            ),
            false => (
                swap_dims_contiguous(q),
                swap_dims_contiguous(k),
                swap_dims_contiguous(v),
            ),
        };
        if rules.l2_qk_norm {
            // One weight of ones for both norms: each is a fill launch on a GPU backend.
            let ones = Tensor::<B, 1>::ones([head_dim], &device);
            (q, k) = (l2_norm(q, &ones, eps), l2_norm(k, &ones, eps));
        }
        if let Some((attn_scale, floor_scale)) = rules.temperature {
            // By column, as transformers counts it (from the cache's length).
            q = q * temperature::<B>(&places.columns(), attn_scale, floor_scale, &device);
        }

        let cache = LayerCache::extend(cached, k, v, &places.columns(), reserve);
        let scale = (head_dim as f64).powf(-0.5);
        let sinks = self.sinks.as_ref().map(|p| p.val());
        // Views of the cache's storage, dropped before the next step writes into it.
        let (keys, values) = (cache.keys(), cache.values());
        let out = attend(
            q,
            (keys, values),
            (places, &cache.columns),
            rules,
            (scale, sinks),
            dense,
        )?;
        let out = swap_dims_contiguous(out).reshape([b, t, n_heads * head_dim]);
        // Untrimmed: the model trims what it keeps (`LayerCache::trim`), and a forward that keeps
        // no cache (training's) drops it without copying the window's entries.
        Ok((project(dense, &self.o, self.adapter(3), out)?, cache))
    }
}

/// `softmax(q · kᵀ · scale, masked) · v`, the step every attention here ends with: keys hidden
/// by [`Places::mask`] get `-inf`, and a sink logit per head (GPT-OSS), if given, joins each
/// row's softmax as one more column and is dropped after it.
///
/// Grouped-query attention without copies of the cache: with fewer key/value heads than
/// query heads, each key/value head serves the `heads / kv_heads` query heads next to it
/// (transformers' `repeat_kv`), so those query heads' rows are stacked as the rows of one
/// product with their key/value head, rather than the keys and values repeated per query head
/// (a copy of the whole cache every step).
///
/// # Shapes
/// - q: `[batch, heads, seq, d]`; keys: `[batch, kv_heads, cached, d]`; values: `[batch,
///   kv_heads, cached, d_v]`, `kv_heads` dividing `heads`; sinks: `[heads]`
/// - output: `[batch, heads, seq, d_v]`
pub(crate) fn attend<B: MoeBackend>(
    q: Tensor<B, 4>,
    (keys, values): (Tensor<B, 4>, Tensor<B, 4>),
    (places, cached): (&Places, &[usize]),
    rules: &AttnRules,
    (scale, sinks): (f64, Option<Tensor<B, 1>>),
    dense: &DenseProducts,
) -> Result<Tensor<B, 4>> {
    let [b, h, t, d] = q.dims();
    let [_, h_kv, s, _] = keys.dims();
    let d_v = values.dims()[3];
    let group = h / h_kv;
    // Per head, as `dense` multiplies (the library at its precision where there is one; on
    // Flex a decode step's few rows read the cached keys and values where they lie).
    let scores = dense
        .heads_matmul(q.reshape([b, h_kv, group * t, d]), keys.swap_dims(2, 3))?
        .reshape([b, h, t, s]);
    let weights =
        probabilities(scores, scale, (places, cached), rules, sinks).reshape([b, h_kv, group * t, s]);
    Ok(dense.heads_matmul(weights, values)?.reshape([b, h, t, d_v]))
}

/// The attention weights of `scores · scale`: keys hidden by [`Places::mask`] at `-inf`, the
/// softmax over the keys, with a sink logit per head (GPT-OSS), if given, as one more column
/// dropped after it.
///
/// Either form is one op of the backend's
/// ([`DecoderKernels::attention_softmax`](mpipemoe::backend::DecoderKernels::attention_softmax)
/// and [`attention_softmax_sinks`](mpipemoe::backend::DecoderKernels::attention_softmax_sinks)):
/// one kernel each way on the CubeCL backends, under autodiff one node.
///
/// # Shapes
/// - scores: `[batch, heads, seq, cached]`; sinks: `[heads]`
/// - output: `[batch, heads, seq, cached]`
pub(crate) fn probabilities<B: MoeBackend>(
    scores: Tensor<B, 4>,
    scale: f64,
    (places, cached): (&Places, &[usize]),
    rules: &AttnRules,
    sinks: Option<Tensor<B, 1>>,
) -> Tensor<B, 4> {
    let hidden = places
        .mask::<B>(cached, rules, &scores.device())
        .map(Tensor::into_primitive);
    let scores = scores.into_primitive().tensor();
    let probs = match sinks {
        None => B::attention_softmax(scores, hidden, scale),
        Some(sinks) => B::attention_softmax_sinks(scores, hidden, sinks.into_primitive().tensor(), scale).0,
    };
    Tensor::from_primitive(TensorPrimitive::Float(probs))
}

fn norm<B: MoeBackend, const D: usize>(norm: &Option<RmsNorm<B>>, x: Tensor<B, D>) -> Tensor<B, D> {
    match norm {
        Some(n) => n.forward(x),
        None => x,
    }
}

/// `x / sqrt(mean(x²) + eps)` over the last dimension, no weight (Llama 4's `L2Norm`): the
/// backend's RMSNorm with a weight of ones, which is exact (a product by one changes no bit).
/// So the CubeCL backends run it in one kernel each way and record it as one node, as every
/// other norm, where composed it was about twenty launches a layer in training.
///
/// # Shapes
/// - x: `[batch, heads, seq, head_dim]` → the same; ones: `[head_dim]`
fn l2_norm<B: MoeBackend>(x: Tensor<B, 4>, ones: &Tensor<B, 1>, eps: f64) -> Tensor<B, 4> {
    let dims = x.dims();
    let width = dims[3];
    let rows = x.reshape([dims[0] * dims[1] * dims[2], width]);
    let y = B::rms_norm(
        rows.into_primitive().tensor(),
        ones.clone().into_primitive().tensor(),
        eps,
    );
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(dims)
}

/// Llama 4's attention temperature per query position, in f32 as transformers computes it:
/// `ln(1 + floor((p + 1) / floor_scale)) · attn_scale + 1`.
///
/// # Shapes
/// - output: `[1, 1, positions, 1]`
fn temperature<B: Backend>(
    positions: &[usize],
    attn_scale: f64,
    floor_scale: f64,
    device: &B::Device,
) -> Tensor<B, 4> {
    let scales: Vec<f32> = positions
        .iter()
        .map(|&p| ((p as f32 + 1.0) / floor_scale as f32).floor().ln_1p() * attn_scale as f32 + 1.0)
        .collect();
    Tensor::<B, 1>::from_data(TensorData::new(scales, [positions.len()]), device).reshape([
        1,
        1,
        positions.len(),
        1,
    ])
}
