//! LoRA: low-rank adapters on the attention projections and the experts, with every base
//! weight frozen, as PEFT's `LoraConfig(target_modules=..., target_parameters=...)` sets a
//! model up; merging them back into the weights.

use burn::module::{Module, Param};
use burn::nn::{DropoutConfig, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpipemoe::{seeded_uniform, ExpertLoraSpec, LoraScaling, MoeBackend, MoeError, Result};

use crate::linear::{with_bias, DenseProducts};
use crate::model::MoeCausalLm;

/// An adapter on one projection `y = x · w + bias`: it adds `scale · (x · a) · b`.
///
/// # Shapes
/// - a: `[d_in, rank]` (PEFT's `lora_A.weight` transposed)
/// - b: `[rank, d_out]` (PEFT's `lora_B.weight` transposed)
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend> {
    /// The input side's factor.
    pub a: Param<Tensor<B, 2>>,
    /// The output side's factor.
    pub b: Param<Tensor<B, 2>>,
    /// `alpha / r` or `alpha / sqrt(r)`.
    #[module(skip)]
    pub scale: f64,
    /// PEFT's `lora_dropout`: the probability that an input value of the adapter is zeroed in
    /// training (the kept ones scaled by `1 / (1 - p)`); 0 for none. Inference (a backend
    /// without autodiff) never drops, as PEFT's eval mode does not.
    #[module(skip)]
    pub dropout: f64,
}

impl<B: Backend> LoraLinear<B> {
    /// A fresh adapter as PEFT makes one: `a` uniform in `±1/sqrt(d_in)` (drawn from the host
    /// stream keyed by `seed` and `key`, the same on every rank), `b` zeros, so that it starts
    /// as no change.
    pub fn init(
        d_in: usize,
        d_out: usize,
        rank: usize,
        scale: f64,
        seed: u64,
        key: &str,
        device: &B::Device,
    ) -> Self {
        let bound = 1.0 / (d_in.max(1) as f64).sqrt();
        let a = seeded_uniform(seed, key, d_in * rank, bound);
        let a = Tensor::<B, 1>::from_floats(a.as_slice(), device).reshape([d_in, rank]);
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(Tensor::zeros([rank, d_out], device)),
            scale,
            dropout: 0.0,
        }
    }

    /// `scale · a · b`: what the adapter adds to the weight. `[d_in, d_out]`
    pub fn delta(&self) -> Tensor<B, 2> {
        self.a.val().matmul(self.b.val()).mul_scalar(self.scale)
    }
}

impl<B: MoeBackend> LoraLinear<B> {
    /// `scale · (dropout(x) · a) · b`, the adapter's part of the projection of `x`
    /// (`[..., d_in]` → `[..., d_out]`): two thin products, never the full-size delta. The
    /// dropout is PEFT's `lora_dropout` on the adapter's input alone (the base projection
    /// sees `x` whole), in training only: burn's `Dropout`, which is the identity where the
    /// backend tracks no gradients, with the backend's random stream.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_with(x, &DenseProducts::backend())
            .expect("the backend's own products return no error")
    }

    /// PEFT's `lora_dropout` on the adapter's input, in training only (burn's `Dropout` is the
    /// identity where the backend tracks no gradients).
    fn dropped<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        DropoutConfig::new(self.dropout).init().forward(x)
    }

    /// [`forward`](Self::forward) with its two products made as `dense` makes them.
    ///
    /// # Errors
    /// As [`DenseProducts::matmul`].
    pub fn forward_with<const D: usize>(
        &self,
        x: Tensor<B, D>,
        dense: &DenseProducts,
    ) -> Result<Tensor<B, D>> {
        let down = dense.matmul(self.dropped(x), self.a.val())?;
        let term = dense.matmul(down, self.b.val())?;
        // A scale of 1 (PEFT's default, `lora_alpha = r`) is no launch each way.
        Ok(match self.scale == 1.0 {
            true => term,
            false => term.mul_scalar(self.scale),
        })
    }
}

/// `linear(x)`, plus `lora`'s part where the projection has an adapter, each product as
/// `dense` makes it.
///
/// # Errors
/// As [`DenseProducts::matmul`].
pub(crate) fn project<B: MoeBackend, const D: usize>(
    dense: &DenseProducts,
    linear: &Linear<B>,
    lora: Option<&LoraLinear<B>>,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>> {
    Ok(match lora {
        Some(lora) => dense.linear(linear, x.clone())? + lora.forward_with(x, dense)?,
        None => dense.linear(linear, x)?,
    })
}

/// [`project`] of several projections of one input (attention's q, k and v; DeepSeek-V3's
/// `q_a_proj` and `kv_a_proj_with_mqa`), their products made in two calls of `dense` (the base
/// products with the adapters' first, then the adapters' second) rather than two or three per
/// projection: through a device library each call is one section on CUDA. Without a library
/// every product, and so every bit, is what [`project`] makes; the adapters' dropouts draw in
/// the projections' order, as they did one projection at a time.
///
/// # Errors
/// As [`DenseProducts::matmul`].
pub(crate) fn project_all<B: MoeBackend, const D: usize>(
    dense: &DenseProducts,
    parts: &[(&Linear<B>, Option<&LoraLinear<B>>)],
    x: Tensor<B, D>,
) -> Result<Vec<Tensor<B, D>>> {
    let mut first: Vec<(Tensor<B, D>, Tensor<B, 2>)> = parts
        .iter()
        .map(|(linear, _)| (x.clone(), linear.weight.val()))
        .collect();
    for (_, lora) in parts {
        if let Some(lora) = lora {
            first.push((lora.dropped(x.clone()), lora.a.val()));
        }
    }
    let mut first = dense.matmuls(first)?.into_iter();
    let bases: Vec<Tensor<B, D>> = first.by_ref().take(parts.len()).collect();
    let second: Vec<_> = parts
        .iter()
        .filter_map(|(_, lora)| *lora)
        .zip(first)
        .map(|(lora, down)| (down, lora.b.val()))
        .collect();
    let mut ups = dense.matmuls(second)?.into_iter();
    Ok(parts
        .iter()
        .zip(bases)
        .map(|((linear, lora), y)| {
            let y = with_bias(y, linear);
            match lora {
                Some(lora) => {
                    y + ups
                        .next()
                        .expect("one up-projection per adapter")
                        .mul_scalar(lora.scale)
                }
                None => y,
            }
        })
        .collect())
}

/// `linear` with `lora` folded into its weight; the weight keeps its `require_grad` setting.
pub(crate) fn merged<B: Backend>(mut linear: Linear<B>, lora: Option<LoraLinear<B>>) -> Linear<B> {
    if let Some(lora) = lora {
        linear.weight = linear.weight.map(|w| {
            let grad = w.is_require_grad();
            (w.detach() + lora.delta().detach()).set_require_grad(grad)
        });
    }
    linear
}

/// Where a model's LoRA adapters go and how large they are: PEFT's `r`, `lora_alpha`,
/// `use_rslora` and targets.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The adapters' rank `r` (≥ 1).
    pub rank: usize,
    /// PEFT's `lora_alpha`.
    pub alpha: f64,
    /// `alpha / r`, or rsLoRA's `alpha / sqrt(r)`.
    pub scaling: LoraScaling,
    /// Projection names of the attention blocks (`q_proj`, `k_proj`, `v_proj`, `o_proj`;
    /// DeepSeek-V3's `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`), and
    /// `experts` (both of the experts' stacked weights), `gate_up_proj` or `down_proj` (one);
    /// `attention` stands for every projection each layer's attention has.
    pub targets: Vec<String>,
    /// PEFT's `lora_dropout` on the attention adapters' input in training, in `[0, 1)`; PEFT
    /// refuses it with expert targets (`target_parameters`: the input cannot be factored out
    /// of a weight's adapter), and so does [`validate`](Self::validate).
    pub dropout: f64,
}

/// The target names the models know, for errors.
pub const LORA_TARGETS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "attention",
    "experts",
    "gate_up_proj",
    "down_proj",
];

impl LoraSpec {
    /// The scale on every adapter's product.
    pub fn scale(&self) -> f64 {
        self.scaling.scale(self.alpha, self.rank)
    }

    /// Whether the experts' first (`gate_up_proj`) and second (`down_proj`) weights are
    /// targets.
    pub fn expert_targets(&self) -> (bool, bool) {
        let has = |name: &str| self.targets.iter().any(|t| t == name || t == "experts");
        (has("gate_up_proj"), has("down_proj"))
    }

    /// The attention projections among the targets.
    pub fn attention_targets(&self) -> impl Iterator<Item = &str> {
        self.targets
            .iter()
            .map(String::as_str)
            .filter(|t| !matches!(*t, "experts" | "gate_up_proj" | "down_proj"))
    }

    /// # Errors
    /// [`MoeError::Config`] naming `rank`, `alpha`, `targets` (an empty list, or a name the
    /// models do not know) or `lora_dropout` (outside `[0, 1)`, or above 0 with expert
    /// targets).
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(MoeError::config(
                "rank",
                "is 0; an adapter needs a rank of at least 1",
            ));
        }
        if !self.alpha.is_finite() {
            return Err(MoeError::config(
                "alpha",
                format!("{} is not a finite number", self.alpha),
            ));
        }
        if self.targets.is_empty() {
            return Err(MoeError::config("targets", "is empty"));
        }
        if let Some(bad) = self.targets.iter().find(|t| !LORA_TARGETS.contains(&t.as_str())) {
            return Err(MoeError::config(
                "targets",
                format!("`{bad}` is not one of {}", LORA_TARGETS.join(", ")),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(MoeError::config(
                "lora_dropout",
                format!("{} is not in [0, 1)", self.dropout),
            ));
        }
        if self.dropout > 0.0 && self.expert_targets() != (false, false) {
            return Err(MoeError::config(
                "lora_dropout",
                format!(
                    "is {} with the experts among the targets; PEFT refuses dropout on \
                     `target_parameters` too (an adapter on a weight cannot drop its input): \
                     target the attention projections alone, or set it to 0",
                    self.dropout
                ),
            ));
        }
        Ok(())
    }
}

impl<B: MoeBackend> MoeCausalLm<B> {
    /// The model set up for LoRA fine-tuning: every parameter frozen (no gradient, so no
    /// optimizer state), fresh adapters on the targets, which alone train. Each rank holds the
    /// adapters of its own experts. The adapters start as no change (`b` zeros), so the model
    /// computes what it did.
    ///
    /// # Errors
    /// As [`LoraSpec::validate`], and [`MoeError::Config`] naming `targets` when a target
    /// matches nothing in this model (`q_proj` on DeepSeek-V3 with a query rank; `experts` on
    /// a model without MoE layers).
    pub fn with_lora(self, spec: &LoraSpec, seed: u64) -> Result<Self> {
        spec.validate()?;
        let mut model = self.no_grad();
        let scale = spec.scale();
        for target in spec.attention_targets() {
            let mut found = false;
            for (i, layer) in model.layers.iter_mut().enumerate() {
                let names: Vec<&str> = match target {
                    "attention" => layer.attention_lora().map_or(&[][..], |(n, _)| n).to_vec(),
                    one => vec![one],
                };
                for name in names {
                    let key = format!("lora.layers.{i}.{name}");
                    found |= layer.add_attention_adapter(name, spec.rank, scale, seed, &key, spec.dropout);
                }
            }
            if !found {
                return Err(MoeError::config(
                    "targets",
                    format!("`{target}` is not a projection of this model's attention"),
                ));
            }
        }
        let (w_in, w_out) = spec.expert_targets();
        if w_in || w_out {
            let expert_spec = ExpertLoraSpec {
                rank: spec.rank,
                alpha: spec.alpha,
                scaling: spec.scaling,
                w_in,
                w_out,
            };
            let mut found = false;
            for (i, layer) in model.layers.iter_mut().enumerate() {
                if let Some(moe) = layer.moe.take() {
                    layer.moe = Some(moe.with_adapters(&expert_spec, seed ^ (i as u64 + 1))?);
                    found = true;
                }
            }
            if !found {
                return Err(MoeError::config(
                    "targets",
                    "`experts`: this model has no MoE layer",
                ));
            }
        }
        Ok(model)
    }

    /// The model with every adapter folded into its weight (`w + scale · a · b`) and dropped:
    /// the same function, with the base model's parameters only, as PEFT's
    /// `merge_and_unload`.
    pub fn merge_lora(mut self) -> Self {
        self.layers = self.layers.into_iter().map(|l| l.merge_lora()).collect();
        self
    }
}

impl<B: Backend> MoeCausalLm<B> {
    /// Whether any adapter is set.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|l| l.has_lora())
    }
}
