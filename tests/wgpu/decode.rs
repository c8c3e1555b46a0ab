//! The decode path (a few tokens at inference on one rank, straight to the experts) on WGPU,
//! raw and under burn's fusion, where it runs the default `MoeBackend::experts_forward` and
//! `Fusion`'s hand-over to the inner backend: the exchange's output, and every case's.

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::backend::Wgpu;
use burn::tensor::{Distribution, Tensor};
use burn_cubecl::CubeBackend;
use burn_fusion::Fusion;
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::{expected, relative_error, Case};
use mpipemoe::{Activation, MoeBackend, MoeLayer, MoeLayerConfig};

use super::{case_files, shared};

type FusedWgpu = Fusion<CubeBackend<WgpuRuntime, f32, i32, u32>>;

fn values<B: MoeBackend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn decode_on<B: MoeBackend<Device = WgpuDevice>>(what: &str) {
    let device = WgpuDevice::default();
    // Capacity drops a row of any expert chosen twice (0.5 × 5 × 2 / 6 → 1 a expert).
    for config in [
        MoeLayerConfig::new(24, 40, 6, 2)
            .with_activation(Activation::SwiGlu)
            .with_normalize_topk(true),
        MoeLayerConfig::new(24, 40, 6, 2)
            .with_bias(true)
            .with_capacity_factor(Some(0.5))
            .with_shared_expert(Some(16)),
    ] {
        for n_tokens in [1, 5] {
            let layer = config.clone().init::<B>(&device);
            let x = Tensor::<B, 2>::random([n_tokens, 24], Distribution::Normal(0.0, 1.0), &device);
            let exchange = layer
                .clone()
                .with_config(config.clone().with_decode_tokens(0))
                .unwrap()
                .forward(x.clone());
            let decode = layer.forward(x);
            assert!(decode.stats.decode && !exchange.stats.decode, "{what}");
            assert_eq!(decode.stats.routing, exchange.stats.routing, "{what}");
            let (a, b) = (values(decode.output), values(exchange.output));
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{what}, {n_tokens} tokens: {a:?} / {b:?}");
        }
    }
    for file in case_files() {
        let case = Case::load(&file).unwrap();
        let config = case.config.clone().with_decode_tokens(case.n_tokens());
        let layer = MoeLayer::<B>::from_tensor_map(
            &config,
            &case.tensors,
            &case.path,
            &device,
            std::sync::Arc::new(SingleRank),
        )
        .unwrap();
        let x = Tensor::<B, 2>::from_data(case.tensor("x").clone().convert::<f32>(), &device);
        let out = layer.forward(x);
        assert!(out.stats.decode, "{what}: {}", case.name);
        let got: Vec<f64> = values(out.output).into_iter().map(f64::from).collect();
        let err = relative_error(&got, &expected(&case, "y"));
        assert!(err <= 1e-4, "{what}: {}: {err:.2e}", case.name);
    }
}

#[test]
fn the_decode_path_on_wgpu_gives_the_exchanges_output() {
    let _device = shared();
    decode_on::<Wgpu>("raw");
    decode_on::<FusedWgpu>("fusion");
}
