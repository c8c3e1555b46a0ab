//! The decode path (`layer/decode.rs`): a few tokens at inference on one rank go straight to
//! the experts, with no exchange plan. Its output must be the exchange's, bit for bit, on
//! every layer the exchange runs (capacity drops, weights on the input, a shared expert,
//! adapters, biases, every activation), and the reference cases' to 1e-4; and the layer must
//! take it only where it applies.
//!
//! `cargo test -p mpipemoe --features testkit --test layer decode`

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData};
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::{expected, Case};
use mpipemoe::{
    Activation, ExchangePath, ExpertLoraSpec, LocalGroup, LoraScaling, MoeBackend, MoeLayer, MoeLayerConfig,
    MoeOutput, Partitions, Scoring,
};

/// The layer's output and stats with the decode path on (its default bound) and off.
fn both_paths<B: MoeBackend>(layer: MoeLayer<B>, x: Tensor<B, 2>) -> (MoeOutput<B, 2>, MoeOutput<B, 2>) {
    let config = layer.config().clone();
    let exchange = layer
        .clone()
        .with_config(config.clone().with_decode_tokens(0))
        .unwrap()
        .forward(x.clone());
    let decode = layer.forward(x);
    (decode, exchange)
}

fn bits<B: Backend>(t: Tensor<B, 2>) -> Vec<u32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Layers the exchange runs in every form the decode path must reproduce: each activation,
/// biases, softmax and sigmoid routing with normalisation, capacity that drops rows, the
/// combine weights on the experts' input (Llama 4), a shared expert.
fn configs() -> Vec<(&'static str, MoeLayerConfig)> {
    let base = || MoeLayerConfig::new(24, 40, 6, 2).with_seed(7);
    vec![
        ("gelu, biases", base().with_bias(true)),
        ("relu", base().with_activation(Activation::Relu)),
        (
            "swiglu, sigmoid routing, normalised",
            base()
                .with_activation(Activation::SwiGlu)
                .with_scoring(Scoring::Sigmoid)
                .with_normalize_topk(true),
        ),
        // 0.5 × 5 tokens × 2 / 6 experts: a capacity of 1, so an expert chosen twice drops a
        // row, and the decode path must drop the same one.
        ("capacity drops", base().with_capacity_factor(Some(0.5))),
        (
            "weights on the input, top-1",
            MoeLayerConfig::new(24, 40, 6, 1)
                .with_seed(7)
                .with_weights_on_input(true),
        ),
        (
            "shared expert, partitions and a strategy",
            base()
                .with_shared_expert(Some(16))
                .with_partitions(Partitions::Fixed(3))
                .with_memory_reuse(mpipemoe::MemoryReuse::S4),
        ),
    ]
}

fn decode_equals_the_exchange_on<B: MoeBackend>() {
    let device = Default::default();
    for (what, config) in configs() {
        for n_tokens in [1, 2, 5, 16] {
            let layer = config.clone().init::<B>(&device);
            let x = Tensor::<B, 2>::random([n_tokens, 24], Distribution::Normal(0.0, 1.0), &device);
            let (decode, exchange) = both_paths(layer, x);
            assert!(
                decode.stats.decode,
                "{what}, {n_tokens} tokens: not on the decode path"
            );
            assert!(!exchange.stats.decode);
            assert_eq!(
                decode.stats.routing, exchange.stats.routing,
                "{what}, {n_tokens} tokens"
            );
            assert_eq!(decode.stats.recv_rows, exchange.stats.recv_rows, "{what}");
            assert_eq!(
                bits(decode.output),
                bits(exchange.output),
                "{what}, {n_tokens} tokens: the decode path's output is not the exchange's"
            );
        }
    }
}

#[test]
fn the_decode_path_gives_the_exchanges_bits_on_flex() {
    decode_equals_the_exchange_on::<Flex>();
}

#[test]
fn the_decode_path_gives_the_exchanges_bits_on_ndarray() {
    decode_equals_the_exchange_on::<NdArray>();
}

/// The experts' adapters run on the decode path too. Their `b` factors start at zero (PEFT's
/// initialisation), so they are drawn here: an adapter that were skipped would show.
#[test]
fn the_decode_path_runs_the_experts_adapters() {
    let device = Default::default();
    let spec = ExpertLoraSpec {
        rank: 3,
        alpha: 6.0,
        scaling: LoraScaling::Standard,
        w_in: true,
        w_out: true,
    };
    let layer = MoeLayerConfig::new(24, 40, 6, 2)
        .with_activation(Activation::SwiGlu)
        .init::<Flex>(&device);
    let plain = layer.clone();
    let mut layer = layer.with_adapters(&spec, 3).unwrap();
    let adapters = layer.adapters.as_mut().unwrap();
    for lora in [adapters.w_in.as_mut().unwrap(), adapters.w_out.as_mut().unwrap()] {
        let b = lora.b.val();
        lora.b = Param::from_tensor(Tensor::random(b.dims(), Distribution::Normal(0.0, 0.5), &device));
    }
    let x = Tensor::<Flex, 2>::random([3, 24], Distribution::Normal(0.0, 1.0), &device);
    let without = plain.forward(x.clone());
    let (decode, exchange) = both_paths(layer, x);
    assert!(decode.stats.decode);
    let decode = bits(decode.output);
    assert_eq!(decode, bits(exchange.output));
    assert_ne!(decode, bits(without.output), "the adapters changed nothing");
}

/// Every reference case, its whole batch on the decode path (bounded above the case's
/// tokens), gives the case's output to 1e-4 on both CPU backends.
#[test]
fn every_case_on_the_decode_path_gives_the_cases_output() {
    for case in super::expert_path::cases() {
        check_case_on::<Flex>(&case);
        check_case_on::<NdArray>(&case);
    }
}

fn check_case_on<B: MoeBackend>(case: &Case) {
    let device = Default::default();
    let config = case.config.clone().with_decode_tokens(case.n_tokens());
    let comm = std::sync::Arc::new(SingleRank);
    let layer = MoeLayer::<B>::from_tensor_map(&config, &case.tensors, &case.path, &device, comm).unwrap();
    let x = case.tensor("x").clone().convert::<f32>();
    let x = Tensor::<B, 2>::from_data(x, &device);
    let out = layer.forward(x);
    assert!(out.stats.decode, "{}", case.name);
    let got: Vec<f64> = out.output.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    let err = mpipemoe::harness::relative_error(&got, &expected(case, "y"));
    assert!(
        err <= 1e-4,
        "{}: the decode path's output is {err:.2e} off",
        case.name
    );
}

/// The decode path is taken only for a few tokens, on one rank, on the fused path, where the
/// backend tracks no gradients; everywhere else the batch goes through the exchange.
#[test]
fn the_decode_path_is_taken_only_where_it_applies() {
    let device = Default::default();
    let config = MoeLayerConfig::new(24, 40, 6, 2);
    let decodes = |config: MoeLayerConfig, n_tokens: usize| {
        let layer = config.init::<Flex>(&device);
        let x = Tensor::<Flex, 2>::random([n_tokens, 24], Distribution::Default, &device);
        layer.forward(x).stats.decode
    };
    assert!(decodes(config.clone(), 1));
    assert!(decodes(config.clone(), 16), "the default bound is 16 tokens");
    assert!(!decodes(config.clone(), 17));
    assert!(
        !decodes(config.clone(), 0),
        "an empty batch has nothing to decode"
    );
    assert!(!decodes(config.clone().with_decode_tokens(0), 1));
    assert!(decodes(config.clone().with_decode_tokens(100), 100));
    assert!(!decodes(config.clone().with_path(ExchangePath::Reference), 1));

    // Under autodiff the exchange's backward node is needed.
    type A = Autodiff<NdArray>;
    let device = Default::default();
    let layer = config.clone().init::<A>(&device);
    let out = layer.forward(Tensor::<A, 2>::random([1, 24], Distribution::Default, &device));
    assert!(!out.stats.decode);

    // A one-rank group that emulates the network sends its rows.
    let layer = config
        .clone()
        .init_rank::<Flex>(
            &Default::default(),
            std::sync::Arc::new(mpipemoe::comm::HostLoopback),
        )
        .unwrap();
    let x = Tensor::<Flex, 2>::random([1, 24], Distribution::Default, &Default::default());
    assert!(!layer.forward(x).stats.decode);

    // A second rank joins the exchange's collectives, so neither rank may skip them.
    let ranks = LocalGroup::run(2, |ctx| {
        let layer = config.init_rank::<NdArray>(&device, ctx.comm.clone())?;
        let x = Tensor::<NdArray, 2>::from_data(TensorData::new(vec![0.5f32; 24], [1, 24]), &device);
        Ok(layer.try_forward(x)?.stats.decode)
    })
    .unwrap();
    assert_eq!(ranks, vec![false, false]);
}
