//! A model's dense products (attention's projections, dense MLPs, the head) go through the
//! MoE layers' communicator's device library at their GEMM precision where it offers one, as
//! the layers' router and shared-expert products do: on CUDA that is cuBLAS at the precision
//! asked, where cubecl's kernels multiply f32 in TF32 whatever is asked.

use std::sync::Mutex;

use burn::tensor::ops::FloatTensor;
use mpipemoe::backend::{ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertPath};
use mpipemoe::comm::{RowPaths, WithRowPaths};
use mpipemoe::{Communicator, GemmPrecision};

use super::*;

/// A library that multiplies as NdArray does (its experts the plain-primitive twin) and
/// records the precision of each dense product it is asked for.
#[derive(Debug, Default)]
struct Recording(Mutex<Vec<GemmPrecision>>);

impl ExpertPath<NdArray> for Recording {
    fn forward(
        &self,
        job: ExpertForward<'_, NdArray>,
    ) -> mpipemoe::Result<(FloatTensor<NdArray>, FloatTensor<NdArray>)> {
        ComposedExperts.forward(job)
    }

    fn backward(&self, job: ExpertBackward<'_, NdArray>) -> mpipemoe::Result<ExpertBackwardOut<NdArray>> {
        ComposedExperts.backward(job)
    }

    fn matmul(
        &self,
        lhs: FloatTensor<NdArray>,
        rhs: FloatTensor<NdArray>,
        precision: GemmPrecision,
    ) -> mpipemoe::Result<FloatTensor<NdArray>> {
        use burn::tensor::ops::FloatTensorOps;
        self.0.lock().unwrap().push(precision);
        Ok(<NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
    }
}

/// Every family's logits through the library equal the model's own, bit for bit, and the
/// library saw at least each layer's attention projections, the head and each MoE layer's
/// router, every one at the precision the MoE layers were given. A model that kept its dense
/// products on the backend (cubecl's TF32 on CUDA) fails it: its MoE layers' own products
/// alone fall short of the count in every family.
#[test]
fn every_familys_dense_products_go_through_the_library_at_the_layers_precision() {
    let device = Default::default();
    let ids = [3usize, 14, 15, 9, 26];
    for family in FAMILIES {
        let library = Arc::new(Recording::default());
        let comm: Arc<dyn Communicator> = Arc::new(WithRowPaths::adding(
            Arc::new(SingleRank),
            RowPaths::new().with_experts::<NdArray>(library.clone()),
        ));
        let through = MoeCausalLm::<B>::from_hf(data().join(family), &device, comm)
            .and_then(|m| m.map_moe_configs(|c| c.with_gemm_precision(GemmPrecision::Tf32)))
            .unwrap();
        let own = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let logits = |m: &MoeCausalLm<B>| values(m.forward(ids_tensor(&ids, [1, ids.len()]), None).logits);
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(logits(&through)), bits(logits(&own)), "{family}: logits");
        let seen = library.0.lock().unwrap().clone();
        // At least four attention projections a layer, the head, and each MoE layer's router.
        let layers = through.layers.len();
        let moe_layers = through.layers.iter().filter(|l| l.moe.is_some()).count();
        assert!(
            seen.len() > 4 * layers + moe_layers,
            "{family}: {} products through the library for {layers} layers",
            seen.len()
        );
        assert!(
            seen.iter().all(|&p| p == GemmPrecision::Tf32),
            "{family}: {seen:?}"
        );
    }
}
