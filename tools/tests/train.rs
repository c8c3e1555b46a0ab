//! The toy GPT-MoE example trains the same model whatever the rank count, partitions and
//! memory strategy: the first 20 steps' losses agree to 1e-4 relative.
//!
//! The example's own modules are compiled in here, so this tests the code the README runs.

#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/train.rs"]
mod train;

use burn::backend::{Autodiff, Flex};
use mpipemoe::{LocalGroup, MemoryReuse, Partitions};

fn losses(ranks: usize, partitions: Partitions, memory_reuse: MemoryReuse) -> Vec<f64> {
    let corpus = data::Corpus::builtin().unwrap();
    let options = train::TrainOptions {
        model: model::GptMoeConfig::new()
            .with_seq_len(32)
            .with_d_model(32)
            .with_d_hidden(64),
        steps: 20,
        batch: 8,
        lr: 3e-3,
        seed: 11,
        partitions,
        memory_reuse,
        memory_budget: None,
        eval_every: 0,
        eval_batches: 1,
        sample_len: 0,
    };
    let reports = LocalGroup::run(ranks, |ctx| {
        train::train_rank::<Autodiff<Flex>>(&ctx, &corpus, &options, &Default::default(), &|_| {})
    })
    .unwrap();
    // Every rank reports the same global losses.
    for r in &reports[1..] {
        assert_eq!(r.losses, reports[0].losses);
    }
    reports[0].losses.clone()
}

#[test]
fn losses_do_not_depend_on_ranks_partitions_or_strategy() {
    let one = losses(1, Partitions::Fixed(1), MemoryReuse::Off);
    let two = losses(2, Partitions::Fixed(4), MemoryReuse::S4);
    assert_eq!(one.len(), 20);
    let mut worst = 0f64;
    for (step, (a, b)) in one.iter().zip(&two).enumerate() {
        let rel = (a - b).abs() / a.abs();
        worst = worst.max(rel);
        assert!(
            rel <= 1e-4,
            "step {step}: {a} (1 rank) vs {b} (2 ranks, n=4, S4): {rel:e}"
        );
    }
    eprintln!("largest relative loss difference over 20 steps: {worst:.2e}");
    // And the model learns: the loss falls over the 20 steps.
    assert!(
        one[19] < one[0] - 0.5,
        "loss did not fall: {} -> {}",
        one[0],
        one[19]
    );
}
