//! Auxiliary-loss-free load balancing (DeepSeek-V3) on a layer.

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::MoeLayer;
use crate::error::{MoeError, Result};
use crate::router::score_bias_step;

impl<B: Backend> MoeLayer<B> {
    /// DeepSeek-V3's auxiliary-loss-free balancing: after a training step, moves each expert's
    /// score bias by `gamma · sign(mean_load − load[e])`, so that overloaded experts are chosen
    /// less often and underloaded ones more. `load` is the step's global per-expert load, as
    /// every rank has it: `stats.routing.routed_per_expert` of the step's [`MoeStats`](crate::MoeStats)
    /// (crate::MoeStats). Every rank makes the same update, so the replicated routers stay
    /// identical. DeepSeek-V3 uses `gamma = 0.001`.
    ///
    /// ```
    /// use burn::backend::{Autodiff, NdArray};
    /// use burn::tensor::{Distribution, Tensor};
    /// use mpipemoe::{MoeLayerConfig, Scoring};
    ///
    /// type B = Autodiff<NdArray>;
    /// let device = Default::default();
    /// let mut layer = MoeLayerConfig::new(16, 32, 8, 2)
    ///     .with_scoring(Scoring::Sigmoid)
    ///     .with_score_bias(true)
    ///     .init::<B>(&device);
    /// let x = Tensor::<B, 2>::random([32, 16], Distribution::Default, &device);
    /// let out = layer.forward(x);
    /// layer.balance_score_bias(&out.stats.routing.routed_per_expert, 0.001).unwrap();
    /// ```
    ///
    /// # Errors
    /// [`MoeError::Config`] if the layer has no score bias (`score_bias` is off) or `load` does
    /// not have one entry per expert.
    pub fn balance_score_bias(&mut self, load: &[usize], gamma: f64) -> Result<()> {
        let n_experts = self.router.n_experts();
        if load.len() != n_experts {
            return Err(MoeError::config(
                "score_bias",
                format!(
                    "balancing needs one load per expert: got {}, the layer has {n_experts}",
                    load.len()
                ),
            ));
        }
        if !(gamma.is_finite() && gamma >= 0.0) {
            return Err(MoeError::config(
                "score_bias",
                format!("the bias update speed gamma is {gamma}, must be finite and >= 0"),
            ));
        }
        let bias = self.router.score_bias.take().ok_or_else(|| {
            MoeError::config(
                "score_bias",
                "is off: the layer has no score bias to balance with (set `score_bias`)",
            )
        })?;
        let step = score_bias_step(load, gamma);
        let value = bias.val();
        let device = value.device();
        let delta = Tensor::<B, 1>::from_data(
            TensorData::new(step, [n_experts]).convert::<B::FloatElem>(),
            &device,
        );
        // The buffer keeps its id (records and optimizers key parameters by it) and never
        // requires a gradient.
        let updated = (value + delta).detach().set_require_grad(false);
        self.router.score_bias = Some(Param::initialized(bias.id, updated));
        Ok(())
    }
}
