//! Making new cases: expected tensors from the float64 oracle.

use std::path::PathBuf;

use burn::tensor::TensorData;

use super::golden::golden;
use super::Case;
use crate::error::Result;

use crate::layer::MoeLayerConfig;
use crate::layer::{LayerMeta, TensorMap};

impl Case {
    /// A case whose expected `y`, `dx` and gradients come from an independent float64
    /// implementation of the reference function, for the given weights (canonical names)
    /// and `x`, `probe` (`[n_tokens, d_model]` each, in `tensors`).
    pub fn from_parts(name: &str, config: &MoeLayerConfig, mut tensors: TensorMap) -> Result<Case> {
        config.validate()?;
        let source = PathBuf::from(format!("<generated {name}>"));
        let n_tokens = tensors["x"].shape[0];
        let d_model = config.d_model;
        let oracle = golden(config, &tensors);
        let f32_data = |values: Vec<f64>, shape: Vec<usize>| TensorData::new(values, shape).convert::<f32>();
        tensors.insert("y".into(), f32_data(oracle.y, vec![n_tokens, d_model]));
        tensors.insert("dx".into(), f32_data(oracle.dx, vec![n_tokens, d_model]));
        for (param, grad) in oracle.grads {
            let shape = tensors[param].shape.to_vec();
            tensors.insert(format!("grad.{param}"), f32_data(grad, shape));
        }
        let case = Case {
            name: name.to_string(),
            path: source,
            meta: LayerMeta::from_config(config),
            config: config.clone(),
            tensors,
            expected_by_oracle: true,
        };
        for (name, shape) in case.expected_shapes() {
            crate::layer::expect_tensor(&case.tensors, &name, &shape, &case.path)?;
        }
        Ok(case)
    }

    /// A case with random weights (the layer's own initialisation with `seed`), random `x`
    /// and `probe` of `n_tokens` tokens, and expected tensors from [`Case::from_parts`].
    #[cfg(feature = "ndarray")]
    pub fn generate(name: &str, config: &MoeLayerConfig, n_tokens: usize, seed: u64) -> Result<Case> {
        let layer = config
            .clone()
            .with_seed(seed)
            .try_init::<burn::backend::NdArray>(&Default::default())?;
        let mut tensors = layer.gather_tensor_map()?.expect("a single rank is rank 0");
        let m = config.d_model;
        let draw = |tensor: &str| {
            let values = crate::experts::HostInit::new(seed, tensor, 0).uniform(n_tokens * m, 1.0);
            TensorData::new(values, [n_tokens, m])
        };
        tensors.insert("x".into(), draw("x"));
        tensors.insert("probe".into(), draw("probe"));
        Self::from_parts(name, config, tensors)
    }

    /// A case where every token goes to expert 0 (router weights zero, a router bias favouring
    /// expert 0; top-1, d_model 6, d_hidden 8), so with experts sharded over ranks every rank
    /// but rank 0 receives no rows: every one of their partition slots is empty.
    #[cfg(feature = "ndarray")]
    pub fn all_to_one_expert(n_experts: usize, n_tokens: usize) -> Result<Case> {
        let config = MoeLayerConfig::new(6, 8, n_experts, 1)
            .with_router_bias(true)
            .with_bias(true);
        let base = Self::generate("all_to_one", &config, n_tokens, 9)?;
        let mut tensors = base.tensors;
        tensors.insert(
            "router.weight".into(),
            TensorData::zeros::<f32, _>([n_experts, 6]),
        );
        let mut bias = vec![0f32; n_experts];
        bias[0] = 4.0;
        tensors.insert("router.bias".into(), TensorData::new(bias, [n_experts]));
        Self::from_parts("all_to_one", &config, tensors)
    }
}
