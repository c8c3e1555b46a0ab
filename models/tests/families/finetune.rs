//! The text side and fine-tuning: the folders' `tokenizer.json` against what Hugging Face's
//! `tokenizers` gave (tests/data/models/make_tokenizer.py), and `finetune_rank` at one rank,
//! at two expert-parallel ranks and at EP 1 × DP 2 on the same batches: the same losses and
//! the same trained model, saved and loaded back.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::comm::SingleRank;
use mpipemoe::hf::ExportOptions;
use mpipemoe::{Communicator, LocalGroup, MoeError};
use mpipemoe_models::{finetune_rank, FinetuneOptions, MoeCausalLm, TextTokenizer};

use super::{data, expected, rel_err, temp_dir, values, B};

fn tokenizer(family: &str) -> TextTokenizer {
    TextTokenizer::from_dir(data().join(family), 96)
        .unwrap()
        .expect("the folder has a tokenizer")
}

#[test]
fn the_tokenizer_gives_the_ids_and_text_that_hugging_faces_tokenizers_gives() {
    let text = std::fs::read_to_string(data().join("tokenizer.expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for family in ["qwen3-moe-tiny", "mixtral-tiny"] {
        let tokenizer = tokenizer(family);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<usize> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let ids = tokenizer.encode(text, false).unwrap();
            assert_eq!(ids, want, "{family}: ids of {text:?}");
            assert_eq!(
                tokenizer.decode(&ids).unwrap(),
                case["decoded"].as_str().unwrap(),
                "{family}: text of {text:?}"
            );
        }
    }
    // A folder without one has none; a tokenizer of a larger vocabulary than the model's is
    // refused when it gives an id outside it; a file that is no tokenizer names itself.
    assert!(TextTokenizer::from_dir(data().join("olmoe-tiny"), 96)
        .unwrap()
        .is_none());
    let small = TextTokenizer::from_dir(data().join("mixtral-tiny"), 40)
        .unwrap()
        .unwrap();
    let err = small
        .encode("the layer routes every token", false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vocabulary of 40"), "{err}");
    let bad = temp_dir("bad-tokenizer");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("tokenizer.json"), b"{\"model\": 7}").unwrap();
    let err = TextTokenizer::from_dir(&bad, 96).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("not a tokenizer"),
        "{err}"
    );
    std::fs::remove_dir_all(&bad).unwrap();
}

/// The tokens fine-tuning reads: the tokenizer's training text, as `mpipemoe finetune` would
/// read a file.
fn stream() -> Vec<u32> {
    let text = std::fs::read_to_string(data().join("../../../docs/architecture.md")).unwrap();
    let ids = tokenizer("mixtral-tiny").encode(&text, false).unwrap();
    ids.into_iter().map(|i| i as u32).collect()
}

fn options(expert_parallel: Option<usize>) -> FinetuneOptions {
    FinetuneOptions {
        steps: 2,
        batch: 2,
        seq_len: 12,
        lr: 1e-3,
        weight_decay: 0.01,
        epsilon: 1e-8,
        seed: 5,
        expert_parallel,
        bias_update_speed: 0.0,
        ..FinetuneOptions::default()
    }
}

/// Fine-tunes mixtral-tiny at `ranks` ranks, saving to `out`; returns rank 0's losses and its
/// trained logits for the expected file's ids.
fn tune(ranks: usize, expert_parallel: Option<usize>, out: &Path) -> (Vec<f64>, Vec<f32>) {
    let src = data().join("mixtral-tiny");
    let tokens = stream();
    let exp = expected("mixtral-tiny");
    let ids: Vec<i64> = exp.ints["ids"].iter().map(|&i| i as i64).collect();
    let shape = [exp.floats["logits"].0[0], exp.floats["logits"].0[1]];
    let export = ExportOptions {
        overwrite: true,
        ..ExportOptions::default()
    };
    let results = LocalGroup::run(ranks, |ctx| {
        let device = Default::default();
        let (model, report) = finetune_rank::<B>(
            ctx.comm,
            &src,
            &tokens,
            &options(expert_parallel),
            &|c| c,
            Some((out, &export)),
            &device,
            &|_| {},
        )?;
        let all = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), shape), &device);
        Ok((report.losses, values(model.try_forward(all, None)?.logits)))
    })
    .unwrap();
    results.into_iter().next().unwrap()
}

/// The same two AdamW steps at one rank, at EP 2 and at EP 1 × DP 2: the same losses and the
/// same trained logits (the replicated gradients and the experts' summed over the right
/// ranks), unlike the untrained model's; the folder each run saved loads back to its trained
/// logits, with the tokenizer copied beside it.
#[test]
fn fine_tuning_at_one_rank_at_ep2_and_at_ep1_dp2_trains_the_same_model() {
    let exp = expected("mixtral-tiny");
    let ids = exp.ints["ids"].clone();
    let shape = [exp.floats["logits"].0[0], exp.floats["logits"].0[1]];
    let mut runs = Vec::new();
    for (name, ranks, ep) in [("one", 1, None), ("ep2", 2, None), ("ep1dp2", 2, Some(1))] {
        let out = temp_dir(&format!("finetune-{name}"));
        let (losses, logits) = tune(ranks, ep, &out);
        let reloaded = MoeCausalLm::<B>::from_hf(&out, &Default::default(), Arc::new(SingleRank)).unwrap();
        let saved = values(reloaded.forward(super::ids_tensor(&ids, shape), None).logits);
        assert!(
            rel_err(&saved, &logits) < 1e-5,
            "{name}: the saved folder's logits differ from the trained model's"
        );
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(data().join("mixtral-tiny/tokenizer.json")).unwrap(),
            "{name}: tokenizer copied"
        );
        std::fs::remove_dir_all(&out).unwrap();
        runs.push((name, losses, logits));
    }
    let (_, losses, logits) = &runs[0];
    assert!(losses[0].is_finite() && losses.len() == 2);
    let moved = rel_err(logits, &exp.floats["logits"].1);
    assert!(moved > 1e-3, "two steps changed the logits by only {moved:.2e}");
    for (name, other_losses, other_logits) in &runs[1..] {
        for (a, b) in losses.iter().zip(other_losses) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{name}: loss {b} against one rank's {a}"
            );
        }
        let err = rel_err(other_logits, logits);
        assert!(err < 1e-4, "{name}: trained logits off one rank's by {err:.2e}");
    }
}

fn finetune_error(ranks: usize, tokens: &[u32], options: FinetuneOptions, out: Option<&Path>) -> MoeError {
    let src = data().join("mixtral-tiny");
    let export = ExportOptions::default();
    LocalGroup::run(ranks, |ctx| {
        let comm: Arc<dyn Communicator> = ctx.comm;
        finetune_rank::<B>(
            comm,
            &src,
            tokens,
            &options,
            &|c| c,
            out.map(|o| (o, &export)),
            &Default::default(),
            &|_| panic!("no step may run"),
        )
        .map(|_| ())
    })
    .unwrap_err()
}

/// A step whose attention weights alone exceed the host memory given to a rank is refused by
/// name before any step, on every rank alike; at exactly the floor it trains. mixtral-tiny
/// (its `config.json`: 3 layers, 4 heads) at 2 ranks, batch 2, seq_len 12: each rank keeps
/// 3 × 1 row × 4 heads × 12² f32 values. A floor with the rows of the whole batch, the key
/// length left out or the layers not counted moves the edge and fails it.
#[test]
fn a_step_past_the_host_memory_given_is_refused_before_it_runs() {
    let tokens = stream();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data().join("mixtral-tiny/config.json")).unwrap()).unwrap();
    let (layers, heads) = (
        config["num_hidden_layers"].as_u64().unwrap(),
        config["num_attention_heads"].as_u64().unwrap(),
    );
    let floor = layers * heads * 12 * 12 * 4;
    let err = finetune_error(
        2,
        &tokens,
        FinetuneOptions {
            host_bytes: Some(floor - 1),
            ..options(None)
        },
        None,
    );
    assert!(matches!(err, MoeError::Memory(_)), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("batch 2 × seq_len 12") && message.contains("lower the batch"),
        "{message}"
    );
    let src = data().join("mixtral-tiny");
    let steps = LocalGroup::run(2, |ctx| {
        let options = FinetuneOptions {
            host_bytes: Some(floor),
            steps: 1,
            ..options(None)
        };
        let steps = std::sync::atomic::AtomicUsize::new(0);
        finetune_rank::<B>(
            ctx.comm,
            &src,
            &tokens,
            &options,
            &|c| c,
            None,
            &Default::default(),
            &|_| {
                steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            },
        )?;
        Ok(steps.into_inner())
    })
    .unwrap();
    assert_eq!(steps, vec![1, 1]);
}

/// The floor a forward without a backward is checked against (`logits`, a generation's
/// prefill): the larger of one layer's attention weights `[rows, heads, t, t]` and, with the
/// logits, `[rows · t, vocab]`, from mixtral-tiny's `config.json`; a byte under it is refused
/// naming the pass, at it nothing is.
#[test]
fn a_forwards_floor_is_its_largest_tensor() {
    let model = MoeCausalLm::<B>::from_hf(
        data().join("mixtral-tiny"),
        &Default::default(),
        Arc::new(SingleRank),
    )
    .unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data().join("mixtral-tiny/config.json")).unwrap()).unwrap();
    let (heads, vocab) = (
        config["num_attention_heads"].as_u64().unwrap() as u128,
        config["vocab_size"].as_u64().unwrap() as u128,
    );
    let floor = |rows: usize, t: usize, logits| {
        mpipemoe_models::forward_floor_bytes(model.config(), rows, t, logits, 4)
    };
    // Few tokens: the logits are the larger; many: the weights, quadratic in t.
    assert_eq!(floor(2, 8, true), (2 * 8 * vocab * 4).max(2 * heads * 64 * 4));
    assert_eq!(floor(2, 8, false), 2 * heads * 64 * 4);
    assert_eq!(
        floor(1, 4096, true),
        (heads * 4096 * 4096 * 4).max(4096 * vocab * 4)
    );
    let at = floor(3, 100, true);
    let what = || "this forward".to_string();
    assert!(mpipemoe_models::check_host_bytes(at, Some(at as u64), what).is_ok());
    assert!(mpipemoe_models::check_host_bytes(at, None, what).is_ok());
    match mpipemoe_models::check_host_bytes(at, Some(at as u64 - 1), what) {
        Err(MoeError::Memory(m)) => assert!(
            m.starts_with("this forward") && m.contains("lower the batch"),
            "{m}"
        ),
        other => panic!("expected a memory error, got {other:?}"),
    }
}

#[test]
fn bad_fine_tuning_options_data_or_output_are_errors_naming_them_before_any_step() {
    let tokens = stream();
    let err = finetune_error(
        2,
        &tokens,
        FinetuneOptions {
            batch: 3,
            ..options(None)
        },
        None,
    );
    assert!(matches!(err, MoeError::Config { field: "batch", .. }), "{err}");
    let err = finetune_error(
        1,
        &tokens,
        FinetuneOptions {
            steps: 0,
            ..options(None)
        },
        None,
    );
    assert!(matches!(err, MoeError::Config { field: "steps", .. }), "{err}");
    let err = finetune_error(2, &tokens, options(Some(3)), None);
    assert!(err.to_string().contains("expert_parallel"), "{err}");
    let err = finetune_error(1, &tokens[..12], options(None), None);
    assert!(err.to_string().contains("12 tokens"), "{err}");
    let mut foreign = tokens.clone();
    foreign[40] = 96;
    let err = finetune_error(1, &foreign, options(None), None);
    assert!(err.to_string().contains("token id 96"), "{err}");
    let occupied = temp_dir("finetune-occupied");
    std::fs::create_dir_all(&occupied).unwrap();
    std::fs::write(occupied.join("notes.txt"), b"keep me").unwrap();
    let err = finetune_error(1, &tokens, options(None), Some(&occupied));
    assert!(
        matches!(&err, MoeError::File { path, .. } if path == &occupied),
        "{err}"
    );
    assert_eq!(std::fs::read(occupied.join("notes.txt")).unwrap(), b"keep me");
    std::fs::remove_dir_all(&occupied).unwrap();
}

/// Every family fine-tunes at two ranks (experts sharded) and saves a folder that loads back
/// to the trained model's logits, which differ from the untrained ones.
#[test]
fn every_family_fine_tunes_at_two_ranks_and_saves_a_folder_that_loads_back() {
    // Token ids under every tiny model's vocabulary of 96, as a tokenizer would give them.
    let tokens: Vec<u32> = stream().into_iter().take(400).collect();
    for family in super::FAMILIES {
        let src = data().join(family);
        let out = temp_dir(&format!("finetune-every-{family}"));
        let exp = expected(family);
        let ids: Vec<i64> = exp.ints["ids"].iter().map(|&i| i as i64).collect();
        let shape = [exp.floats["logits"].0[0], exp.floats["logits"].0[1]];
        let export = ExportOptions {
            overwrite: true,
            ..ExportOptions::default()
        };
        let trained = LocalGroup::run(2, |ctx| {
            let device = Default::default();
            let (model, _) = finetune_rank::<B>(
                ctx.comm,
                &src,
                &tokens,
                &FinetuneOptions {
                    steps: 1,
                    ..options(None)
                },
                &|c| c,
                Some((&out, &export)),
                &device,
                &|_| {},
            )?;
            let all = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), shape), &device);
            Ok(values(model.try_forward(all, None)?.logits))
        })
        .unwrap();
        let reloaded = MoeCausalLm::<B>::from_hf(&out, &Default::default(), Arc::new(SingleRank)).unwrap();
        let logits = values(
            reloaded
                .forward(super::ids_tensor(&exp.ints["ids"], shape), None)
                .logits,
        );
        std::fs::remove_dir_all(&out).unwrap();
        let same = rel_err(&logits, &trained[0]);
        let moved = rel_err(&logits, &exp.floats["logits"].1);
        assert!(
            same < 1e-5,
            "{family}: reloaded logits off the trained ones by {same:.2e}"
        );
        assert!(
            moved > 1e-3,
            "{family}: one step moved the logits by only {moved:.2e}"
        );
    }
}

/// DeepSeek-V3's bias balancing in fine-tuning (`bias_update_speed`), with the learning rate at
/// zero so that only the biases move: each moves by a whole number of `gamma` steps, some
/// move, and at one rank, at EP 2 and at EP 1 × DP 2 they end equal — the replicas of EP 1 ×
/// DP 2 each see half the batch and must take the load over the replicas to move alike
/// (without that sum they differ). A family without a score bias refuses the option.
#[test]
fn deepseek_bias_balancing_moves_every_replica_alike() {
    let src = data().join("deepseek-v3-tiny");
    let tokens = stream();
    let gamma = 0.01;
    let options = |expert_parallel| FinetuneOptions {
        lr: 0.0,
        weight_decay: 0.0,
        bias_update_speed: gamma,
        ..options(expert_parallel)
    };
    let biases = |model: &MoeCausalLm<B>| -> Vec<Vec<f32>> {
        model
            .moe_layers()
            .map(|(_, m)| {
                let bias = m
                    .router
                    .score_bias
                    .as_ref()
                    .expect("DeepSeek-V3 has a score bias");
                bias.val().into_data().to_vec::<f32>().unwrap()
            })
            .collect()
    };
    let before = biases(&MoeCausalLm::<B>::from_hf(&src, &Default::default(), Arc::new(SingleRank)).unwrap());
    let mut after = Vec::new();
    for (ranks, ep) in [(1, None), (2, None), (2, Some(1))] {
        let run = LocalGroup::run(ranks, |ctx| {
            let (model, _) = finetune_rank::<B>(
                ctx.comm,
                &src,
                &tokens,
                &options(ep),
                &|c| c,
                None,
                &Default::default(),
                &|_| {},
            )?;
            Ok(biases(&model))
        })
        .unwrap();
        assert!(
            run.windows(2).all(|w| w[0] == w[1]),
            "ranks={ranks} ep={ep:?}: the ranks' biases differ"
        );
        after.push(run.into_iter().next().unwrap());
    }
    let mut moved = 0;
    for (layer, (b, a)) in before.iter().zip(&after[0]).enumerate() {
        for (x, y) in b.iter().zip(a) {
            let steps = (y - x) / gamma as f32;
            assert!(
                (steps - steps.round()).abs() < 1e-3,
                "layer {layer}: moved by {} (not a multiple of gamma)",
                y - x
            );
            moved += usize::from(steps.round() != 0.0);
        }
    }
    assert!(moved > 0, "no bias moved");
    for (i, other) in after.iter().enumerate().skip(1) {
        for (a, b) in after[0].iter().flatten().zip(other.iter().flatten()) {
            assert!((a - b).abs() < 1e-6, "run {i}: biases {b} against one rank's {a}");
        }
    }
    let err = LocalGroup::run(1, |ctx| {
        finetune_rank::<B>(
            ctx.comm,
            &data().join("mixtral-tiny"),
            &tokens,
            &options(None),
            &|c| c,
            None,
            &Default::default(),
            &|_| {},
        )
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("bias_update_speed") && err.contains("score bias"),
        "{err}"
    );
}
