//! Making new cases: expected tensors from the float64 oracle.

use std::path::PathBuf;

use burn::tensor::TensorData;

use super::golden::golden;
use super::Case;
use crate::error::Result;

use crate::layer::{LayerMeta, TensorMap};
use crate::MoeLayerConfig;

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
}
