//! Several prompts at once: a left-padded batch (`tests/data/models/make_batched.py`, written
//! by transformers' batched `generate`), its greedy ids and the logits of each row against the
//! prompt alone.

use mpipemoe::memory::Strategy;
use mpipemoe_models::{GenerateOptions, KvCache};

use super::*;

/// Each family's prompts and transformers' new ids for them, batched.
fn reference(family: &str) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let text = std::fs::read_to_string(data().join("batched.expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    let lists = |key: &str| -> Vec<Vec<usize>> {
        all[family][key]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as usize)
                    .collect()
            })
            .collect()
    };
    (lists("prompts"), lists("new_ids"))
}

fn refs(prompts: &[Vec<usize>]) -> Vec<&[usize]> {
    prompts.iter().map(Vec::as_slice).collect()
}

/// Four prompts of 9, 3, 6 and 1 ids (pads past the sliding windows and Llama 4's chunks), in
/// one call: every row's new ids equal transformers' batched greedy ids, rows that reach the
/// end-of-sequence id early included.
#[test]
fn batched_greedy_ids_equal_transformers_on_every_family() {
    let device = Default::default();
    for family in FAMILIES {
        let (prompts, want) = reference(family);
        let model =
            MoeCausalLm::<NdArray>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let got = model
            .generate_batch(&refs(&prompts), &GenerateOptions::greedy(12), &device)
            .unwrap();
        assert_eq!(got, want, "{family}: batched greedy ids");
    }
}

/// The prefill of a left-padded batch: each row's logits at its real columns equal the
/// logits of its prompt run alone (the mask, the rows' own rotary positions), to float32
/// rounding; and a decode step after it equals the next step of the prompt alone. Not Llama
/// 4: its NoPE layers' attention temperature counts columns, pads included, as transformers
/// counts them (so its padded rows differ from the prompts alone there too; its batched ids
/// are held to transformers' above).
#[test]
fn each_padded_rows_logits_equal_its_prompt_alone() {
    let device = Default::default();
    for family in FAMILIES.into_iter().filter(|&f| f != "llama4-tiny") {
        let (prompts, _) = reference(family);
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let width = prompts.iter().map(Vec::len).max().unwrap();
        let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
        let padded: Vec<usize> = prompts
            .iter()
            .zip(&pads)
            .flat_map(|(p, &pad)| std::iter::repeat_n(0, pad).chain(p.iter().copied()))
            .collect();
        let mut cache = KvCache::left_padded(model.layers.len(), &pads);
        let batch = model
            .try_forward(ids_tensor(&padded, [prompts.len(), width]), Some(&mut cache))
            .unwrap()
            .logits;
        let next: Vec<usize> = (0..prompts.len()).map(|r| 3 + r).collect();
        let step = model
            .try_forward(ids_tensor(&next, [prompts.len(), 1]), Some(&mut cache))
            .unwrap()
            .logits;
        let vocab = batch.dims()[2];
        for (r, prompt) in prompts.iter().enumerate() {
            let mut alone_cache = KvCache::new(model.layers.len());
            let alone = model
                .try_forward(ids_tensor(prompt, [1, prompt.len()]), Some(&mut alone_cache))
                .unwrap()
                .logits;
            let row = batch.clone().slice([r..r + 1, pads[r]..width, 0..vocab]);
            let err = rel_err(&values(row), &values(alone));
            assert!(
                err < 1e-5,
                "{family}: row {r} (pads {}): relative error {err:.1e}",
                pads[r]
            );
            let alone_step = model
                .try_forward(ids_tensor(&next[r..r + 1], [1, 1]), Some(&mut alone_cache))
                .unwrap()
                .logits;
            let row = step.clone().slice([r..r + 1, 0..1, 0..vocab]);
            let err = rel_err(&values(row), &values(alone_step));
            assert!(
                err < 1e-5,
                "{family}: row {r}, decode step: relative error {err:.1e}"
            );
        }
    }
}

/// The experts sharded over two rank threads, three partitions and strategy S4: each rank's
/// batch (rank 0 the first two prompts, rank 1 the last two) gets transformers' ids.
#[test]
fn batched_generation_over_two_ranks_with_three_partitions_and_s4_equals_transformers() {
    for family in ["qwen3-moe-tiny", "llama4-tiny"] {
        let (prompts, want) = reference(family);
        let got = LocalGroup::run(2, |ctx| {
            let device = Default::default();
            let model = MoeCausalLm::<NdArray>::from_hf(data().join(family), &device, ctx.comm)?
                .map_moe_configs(|c| {
                    c.with_partitions(Partitions::Fixed(3))
                        .with_memory_reuse(MemoryReuse::from(Strategy::S4))
                })?;
            let mine = &prompts[2 * ctx.rank..2 * ctx.rank + 2];
            model.generate_batch(&refs(mine), &GenerateOptions::greedy(12), &device)
        })
        .unwrap();
        assert_eq!(got.concat(), want, "{family}: two ranks");
    }
}

/// A padded cache for another batch, or a row that is padding only, is refused by name.
#[test]
fn padding_that_does_not_fit_the_batch_is_refused() {
    let device = Default::default();
    let model =
        MoeCausalLm::<B>::from_hf(data().join("mixtral-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let run = |pads: &[usize], rows: usize, t: usize| {
        let mut cache = KvCache::left_padded(model.layers.len(), pads);
        model
            .try_forward(ids_tensor(&vec![5; rows * t], [rows, t]), Some(&mut cache))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    assert!(run(&[1, 0, 2], 2, 4).contains("padded for 3 rows, given a batch of 2"));
    assert!(run(&[0, 4], 2, 4).contains("row 1 is padding only"));
    let empty: &[&[usize]] = &[&[3, 4], &[]];
    let err = model
        .generate_batch(empty, &GenerateOptions::greedy(2), &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt 1: the prompt is empty"), "{err}");
}

/// Sampled rows draw in row order from one generator: the same seed gives the same rows,
/// another seed other rows.
#[test]
fn sampled_batches_repeat_with_their_seed() {
    let device = Default::default();
    let model =
        MoeCausalLm::<NdArray>::from_hf(data().join("mixtral-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let (prompts, _) = reference("mixtral-tiny");
    let sampled = |seed| GenerateOptions {
        max_new_tokens: 12,
        sampling: Some(mpipemoe_models::Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed,
        }),
    };
    let run = |seed| {
        model
            .generate_batch(&refs(&prompts), &sampled(seed), &device)
            .unwrap()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}
