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
/// records each call of dense products it is asked for: its precision and how many products it
/// held (one for `matmul`); and, apart, the precision of each call of attention's per-head
/// products.
#[derive(Debug, Default)]
struct Recording(Mutex<Vec<(GemmPrecision, usize)>>, Mutex<Vec<GemmPrecision>>);

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
        self.0.lock().unwrap().push((precision, 1));
        Ok(<NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
    }

    fn heads_matmul(
        &self,
        lhs: FloatTensor<NdArray>,
        rhs: FloatTensor<NdArray>,
        precision: GemmPrecision,
    ) -> mpipemoe::Result<FloatTensor<NdArray>> {
        self.1.lock().unwrap().push(precision);
        Ok(<NdArray as mpipemoe::MoeBackend>::heads_matmul(lhs, rhs))
    }

    fn matmuls(
        &self,
        pairs: Vec<(FloatTensor<NdArray>, FloatTensor<NdArray>)>,
        precision: GemmPrecision,
    ) -> mpipemoe::Result<Vec<FloatTensor<NdArray>>> {
        use burn::tensor::ops::FloatTensorOps;
        self.0.lock().unwrap().push((precision, pairs.len()));
        Ok(pairs
            .into_iter()
            .map(|(lhs, rhs)| <NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
            .collect())
    }
}

/// `SingleRank` with `library` as its device library for NdArray.
fn with_library(library: &Arc<Recording>) -> Arc<dyn Communicator> {
    Arc::new(WithRowPaths::adding(
        Arc::new(SingleRank),
        RowPaths::new().with_experts::<NdArray>(library.clone()),
    ))
}

/// `a` and `b` bit for bit, or a panic naming `what` and the first element that differs.
fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} is {} against {}", a[i], b[i]);
    }
}

/// Every family's logits through the library equal the model's own, bit for bit, and the
/// library saw at least each layer's attention projections, the head and each MoE layer's
/// router, every one at the precision the MoE layers were given. The projections of one input
/// share a call (attention's q, k and v; DeepSeek-V3's two compressions; a dense MLP's gate and
/// up): at least one call of several products a layer, where the MoE layers' own products
/// (the router's one, the experts' whole-partition jobs) make none in a forward. A model that
/// kept its dense products on the backend (cubecl's TF32 on CUDA) fails the count in every
/// family; one that made a call per projection fails the shared calls.
#[test]
fn every_familys_dense_products_go_through_the_library_at_the_layers_precision() {
    let device = Default::default();
    let ids = [3usize, 14, 15, 9, 26];
    for family in FAMILIES {
        let library = Arc::new(Recording::default());
        let through = MoeCausalLm::<B>::from_hf(data().join(family), &device, with_library(&library))
            .and_then(|m| m.map_moe_configs(|c| c.with_gemm_precision(GemmPrecision::Tf32)))
            .unwrap();
        let own = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let logits = |m: &MoeCausalLm<B>| values(m.forward(ids_tensor(&ids, [1, ids.len()]), None).logits);
        same_bits(&logits(&through), &logits(&own), &format!("{family}: logits"));
        // A cached step (a prompt, then one token): DeepSeek-V3's attention on its compressed
        // cache multiplies per head as well, through the library where there is one.
        let cached_step = |m: &MoeCausalLm<B>| {
            let mut cache = mpipemoe_models::KvCache::new(m.layers.len());
            m.forward(ids_tensor(&ids[..4], [1, 4]), Some(&mut cache));
            values(m.forward(ids_tensor(&ids[4..], [1, 1]), Some(&mut cache)).logits)
        };
        let heads_before = library.1.lock().unwrap().len();
        same_bits(
            &cached_step(&through),
            &cached_step(&own),
            &format!("{family}: a cached step's logits"),
        );
        let heads_cached = library.1.lock().unwrap().len() - heads_before;
        assert!(
            heads_cached >= 4 * through.layers.len(),
            "{family}: {heads_cached} per-head calls in a prompt and a cached step"
        );
        let seen = library.0.lock().unwrap().clone();
        let products: usize = seen.iter().map(|&(_, n)| n).sum();
        // At least four attention projections a layer, the head, and each MoE layer's router.
        let layers = through.layers.len();
        let moe_layers = through.layers.iter().filter(|l| l.moe.is_some()).count();
        assert!(
            products > 4 * layers + moe_layers,
            "{family}: {products} products through the library for {layers} layers"
        );
        let shared = seen.iter().filter(|&&(_, n)| n > 1).count();
        assert!(
            shared >= layers,
            "{family}: {shared} calls of several products for {layers} layers: {seen:?}"
        );
        // Every call at the precision set, and none empty (a call is a section on CUDA).
        assert!(
            seen.iter().all(|&(p, n)| p == GemmPrecision::Tf32 && n > 0),
            "{family}: {seen:?}"
        );
        // Attention's two per-head products a layer (the scores, the weighted values), at the
        // precision set: a model that left them on the backend multiplied them in TF32 on
        // CUDA whatever it was asked.
        let heads = library.1.lock().unwrap().clone();
        assert!(
            heads.len() >= 2 * layers,
            "{family}: {} per-head calls for {layers} layers",
            heads.len()
        );
        assert!(
            heads.iter().all(|&p| p == GemmPrecision::Tf32),
            "{family}: {heads:?}"
        );
    }
}

/// Training through the library: every family with its PEFT adapter (attention and experts),
/// the logits, the loss and every adapter's gradient bit for bit the model's own on the
/// backend. Each projection sharing a call keeps a backward node of its own, so a gradient
/// routed to another projection's weights, or a product of one projection answered for
/// another, fails it.
#[test]
fn training_with_adapters_through_the_library_keeps_every_bit() {
    for family in FAMILIES {
        let exp = super::lora::lora_expected(family);
        let b = exp.floats["logits"].0[0];
        let library = Arc::new(Recording::default());
        let tf32 = |c: mpipemoe::MoeLayerConfig| c.with_gemm_precision(GemmPrecision::Tf32);
        let (logits, loss, grads) =
            super::lora::run_rank(family, with_library(&library), 0..b, 1.0, tf32).unwrap();
        let (own_logits, own_loss, own_grads) =
            super::lora::run_rank(family, Arc::new(SingleRank), 0..b, 1.0, tf32).unwrap();
        same_bits(&logits, &own_logits, &format!("{family}: logits"));
        assert_eq!(loss.to_bits(), own_loss.to_bits(), "{family}: loss");
        let (grads, own_grads) = (grads.unwrap(), own_grads.unwrap());
        assert_eq!(
            grads.keys().collect::<Vec<_>>(),
            own_grads.keys().collect::<Vec<_>>(),
            "{family}"
        );
        for (key, g) in &grads {
            let (g, own) = (
                g.to_vec::<f32>().unwrap(),
                own_grads[key].to_vec::<f32>().unwrap(),
            );
            same_bits(&g, &own, &format!("{family}: gradient of `{key}`"));
        }
        let seen = library.0.lock().unwrap().clone();
        assert!(seen.iter().any(|&(_, n)| n > 1), "{family}: {seen:?}");
        // The per-head products' backward through the library too: each forward product's
        // node makes its tracked operands' gradients there, at least one each (the first
        // layer's keys and values come from frozen weights and the frozen embedding where
        // no adapter reaches them), so at least four calls a layer with the forward's two,
        // where a backward on the backend leaves two.
        let layers =
            MoeCausalLm::<B>::from_hf(data().join(family), &Default::default(), Arc::new(SingleRank))
                .unwrap()
                .layers
                .len();
        let heads = library.1.lock().unwrap().len();
        assert!(
            heads >= 4 * layers,
            "{family}: {heads} per-head calls for {layers} layers"
        );
    }
}
