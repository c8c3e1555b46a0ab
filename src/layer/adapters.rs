//! The layer's low-rank adapters on its experts: adding them, the weights they give, merging.

use burn::module::{Module, Param};
use burn::tensor::Tensor;

use super::io::gather_experts;
use super::MoeLayer;
use crate::error::{MoeError, Result};
use crate::exchange::MoeBackend;
use crate::experts::{ExpertAdapters, ExpertLora, ExpertWeights, LoraScaling};
use crate::format::TensorMap;

/// Which of the experts' weights get adapters, of what rank and scale.
///
/// ```
/// use mpipemoe::{ExpertLoraSpec, LoraScaling};
/// let spec = ExpertLoraSpec { rank: 8, alpha: 16.0, scaling: LoraScaling::Standard, w_in: true, w_out: true };
/// assert_eq!(spec.scale(), 2.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertLoraSpec {
    /// The adapters' rank `r` (≥ 1).
    pub rank: usize,
    /// PEFT's `lora_alpha`.
    pub alpha: f64,
    /// `alpha / r` or rsLoRA's `alpha / sqrt(r)`.
    pub scaling: LoraScaling,
    /// An adapter on the first GEMM's weights (`gate_up_proj`).
    pub w_in: bool,
    /// An adapter on the second GEMM's weights (`down_proj`).
    pub w_out: bool,
}

impl ExpertLoraSpec {
    /// The factor on the adapters' products.
    pub fn scale(&self) -> f64 {
        self.scaling.scale(self.alpha, self.rank)
    }
}

impl<B: MoeBackend> MoeLayer<B> {
    /// The layer with fresh adapters on its experts as `spec` says (each rank draws its own
    /// experts' adapters, the same values whatever the rank count), replacing any it had. The
    /// base weights are left as they are: freeze them with burn's `no_grad` on the layer
    /// before, as a model's LoRA set-up does, so that they take no gradient.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming `rank` when it is 0, `alpha` when it is not finite, or `targets` when neither weight is chosen.
    pub fn with_adapters(mut self, spec: &ExpertLoraSpec, seed: u64) -> Result<Self> {
        let cfg = self.config().clone();
        let d_inner = cfg.activation.d_inner(cfg.d_hidden);
        let bad = |field: &'static str, reason: String| MoeError::Config { field, reason };
        if !spec.w_in && !spec.w_out {
            return Err(bad("targets", "no expert weight is chosen for an adapter".into()));
        }
        if spec.rank == 0 {
            return Err(bad("rank", "is 0; an adapter needs a rank of at least 1".into()));
        }
        if !spec.alpha.is_finite() {
            return Err(bad("alpha", format!("{} is not a finite number", spec.alpha)));
        }
        let first = self.experts.first_expert();
        let experts = first..first + self.experts.n_local_experts();
        let device = self.experts.w_in.device();
        let make = |rows, cols, name| {
            ExpertLora::init(
                experts.clone(),
                rows,
                cols,
                spec.rank,
                spec.scale(),
                seed,
                name,
                &device,
            )
        };
        self.adapters = Some(ExpertAdapters {
            w_in: spec.w_in.then(|| make(cfg.d_model, d_inner, "lora.w_in")),
            w_out: spec.w_out.then(|| make(cfg.d_hidden, cfg.d_model, "lora.w_out")),
        });
        Ok(self)
    }

    /// This rank's expert weights as one exchange runs them: the parameters plus any
    /// adapters' deltas, tracked by autodiff back to both (a view, with no copy, where there
    /// are no adapters).
    pub fn expert_weights(&self) -> ExpertWeights<B> {
        let weights = self.experts.weights();
        match &self.adapters {
            Some(adapters) => adapters.apply(weights),
            None => weights,
        }
    }

    /// The layer with its adapters folded into the expert weights (`w + scale · a · b`) and
    /// dropped: the same function, with no adapter to run. The weights keep their
    /// `require_grad` setting.
    pub fn merge_adapters(mut self) -> Self {
        let Some(adapters) = self.adapters.take() else {
            return self;
        };
        let fold = |param: Param<Tensor<B, 3>>, lora: Option<ExpertLora<B>>| match lora {
            Some(lora) => param.map(|w| {
                let grad = w.is_require_grad();
                (w.detach() + lora.delta().detach()).set_require_grad(grad)
            }),
            None => param,
        };
        self.experts.w_in = fold(self.experts.w_in, adapters.w_in);
        self.experts.w_out = fold(self.experts.w_out, adapters.w_out);
        self
    }

    /// Sets the experts' adapters from every expert's factors (`[n_experts, rows, rank]` and
    /// `[n_experts, rank, cols]`, as a file holds them): this rank keeps its own experts'.
    ///
    /// # Errors
    /// [`MoeError::Input`] naming the weight (`w_in`, `w_out`) whose factors do not fit the
    /// experts (expert count, rows, columns, or the two factors' ranks).
    pub fn set_adapters(
        &mut self,
        w_in: Option<(Tensor<B, 3>, Tensor<B, 3>)>,
        w_out: Option<(Tensor<B, 3>, Tensor<B, 3>)>,
        scale: f64,
    ) -> Result<()> {
        let cfg = self.config().clone();
        let d_inner = cfg.activation.d_inner(cfg.d_hidden);
        let first = self.experts.first_expert();
        let n_local = self.experts.n_local_experts();
        let mine = |name: &str, (a, b): (Tensor<B, 3>, Tensor<B, 3>), rows: usize, cols: usize| {
            let ([ea, ra, rank], [eb, rank_b, cb]) = (a.dims(), b.dims());
            if ea != cfg.n_experts
                || eb != cfg.n_experts
                || ra != rows
                || cb != cols
                || rank != rank_b
                || rank == 0
            {
                return Err(MoeError::Input(format!(
                    "the adapter on the experts' `{name}` has factors {:?} and {:?}; the layer's \
                     {} experts of [{rows}, {cols}] need [{}, {rows}, r] and [{}, r, {cols}]",
                    a.dims(),
                    b.dims(),
                    cfg.n_experts,
                    cfg.n_experts,
                    cfg.n_experts
                )));
            }
            Ok(ExpertLora::new(
                a.narrow(0, first, n_local),
                b.narrow(0, first, n_local),
                scale,
            ))
        };
        let w_in = w_in.map(|f| mine("w_in", f, cfg.d_model, d_inner)).transpose()?;
        let w_out = w_out
            .map(|f| mine("w_out", f, cfg.d_hidden, cfg.d_model))
            .transpose()?;
        self.adapters = (w_in.is_some() || w_out.is_some()).then_some(ExpertAdapters { w_in, w_out });
        Ok(())
    }

    /// Every expert's adapter factors gathered on rank 0 (`w_in.a`, `w_in.b`, `w_out.a`,
    /// `w_out.b`, those the layer has, stacked over the ranks' experts), `None` on the other
    /// ranks and where the layer has no adapters. A collective: every rank calls it.
    ///
    /// # Errors
    /// [`MoeError::Comm`] if a peer fails.
    pub fn gather_adapters(&self) -> Result<Option<TensorMap>> {
        let Some(adapters) = &self.adapters else {
            return Ok(None);
        };
        let mut local = Vec::new();
        for (name, lora) in [("w_in", &adapters.w_in), ("w_out", &adapters.w_out)] {
            if let Some(lora) = lora {
                let data = |t: Tensor<B, 3>| t.into_data().convert::<f32>();
                local.push((
                    if name == "w_in" { "w_in.a" } else { "w_out.a" },
                    data(lora.a.val()),
                ));
                local.push((
                    if name == "w_in" { "w_in.b" } else { "w_out.b" },
                    data(lora.b.val()),
                ));
            }
        }
        gather_experts(self.context().comm().as_ref(), "gather_adapters", local)
    }

    /// The layer with its experts' and adapters' trainable state unchanged, every other
    /// parameter frozen: what LoRA fine-tuning trains in a layer on its own.
    pub fn freeze_all_but_adapters(self) -> Self {
        let adapters = self.adapters.clone();
        let mut frozen = self.no_grad();
        frozen.adapters = adapters;
        frozen
    }
}
