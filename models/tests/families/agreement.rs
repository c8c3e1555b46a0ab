//! Generation over expert-parallel ranks: every step is a collective, so the ranks must agree
//! before each one whether any of them still generates, whatever each rank's prompt, length
//! or routing.

use std::time::{Duration, Instant};

use mpipemoe::comm::GroupOptions;

use super::*;

/// A bound far below what a rank left waiting would take (the group's timeout), so that a
/// rank that leaves the loop early fails this test instead of stalling it.
fn options() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    }
}

/// Two ranks with different prompts and different `max_new_tokens` (one rank finishes six
/// steps before the other): both return, each with its own prompt's continuation, the same
/// ids a single rank gives for that prompt (without a capacity factor a row's experts do not
/// depend on the other rows).
#[test]
fn ranks_with_different_prompts_and_lengths_agree_on_every_step() {
    let dir = data().join("mixtral-tiny");
    let device = Default::default();
    let prompts: [(Vec<usize>, usize); 2] = [(vec![1, 5, 9], 3), (vec![7, 2, 11, 4, 30], 9)];
    let alone: Vec<Vec<usize>> = prompts
        .iter()
        .map(|(prompt, n)| {
            let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, Arc::new(SingleRank)).unwrap();
            model.generate(prompt, *n, &device).unwrap()
        })
        .collect();
    assert!(
        alone[0].len() < alone[1].len(),
        "{alone:?}: the ranks must stop at different steps"
    );
    let start = Instant::now();
    let ranked = LocalGroup::run_with(options(), 2, |ctx| {
        let device = Default::default();
        let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, ctx.comm)?;
        let (prompt, n) = &prompts[ctx.rank];
        model.generate(prompt, *n, &device)
    })
    .unwrap();
    assert_eq!(ranked, alone);
    assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
}

/// The same prompt on two ranks with a capacity factor: capacity is first come in rank
/// order, so a token kept on one rank may be dropped on the other and the continuations
/// differ. With an end-of-sequence id that only rank 1's continuation reaches, rank 1 stops
/// steps before rank 0, and both still return (rank 0's ids up to that step unchanged).
#[test]
fn ranks_whose_routing_drops_differently_still_agree_on_every_step() {
    let prompt = [3usize, 14, 15, 9, 26, 5];
    let run = |dir: &std::path::Path| {
        LocalGroup::run_with(options(), 2, |ctx| {
            let device = Default::default();
            let model =
                MoeCausalLm::<NdArray>::from_hf(dir, &device, ctx.comm)?.map_moe_configs(|mut c| {
                    c.capacity_factor = Some(0.5);
                    c
                })?;
            model.generate(&prompt, 12, &device)
        })
    };
    let first = run(&data().join("mixtral-tiny")).unwrap();
    assert_ne!(
        first[0], first[1],
        "the capacity factor must make the ranks differ"
    );
    // A step where rank 1 makes a token that neither rank made before it.
    let step = (1..first[1].len())
        .find(|&i| {
            let t = first[1][i];
            !first[1][..i].contains(&t) && !first[0][..=i].contains(&t)
        })
        .expect("a token only rank 1 makes");
    let eos = first[1][step];
    let dir = edited_copy("mixtral-tiny", "agreement-eos", |config, _| {
        config["eos_token_id"] = eos.into();
    });
    // generation_config.json's stop ids win where the folder has them, as in transformers.
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::json!({ "eos_token_id": eos }).to_string(),
    )
    .unwrap();
    let start = Instant::now();
    let second = run(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let second = second.unwrap();
    assert_eq!(
        second[1],
        first[1][..=step],
        "rank 1 stops at its end-of-sequence id"
    );
    assert_eq!(second[0][..=step], first[0][..=step]);
    assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
}

/// A prompt with an id outside the vocabulary, or whose length and new tokens run past the
/// model's positions, is refused before any work (the positions by name).
#[test]
fn prompts_outside_the_vocabulary_or_the_positions_are_refused_up_front() {
    let dir = data().join("mixtral-tiny");
    let device = Default::default();
    let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, Arc::new(SingleRank)).unwrap();
    let vocab = model.config().vocab_size;
    let max = model
        .config()
        .max_positions
        .expect("the tiny model has max_position_embeddings");
    let err = model.generate(&[1, vocab], 4, &device).unwrap_err().to_string();
    assert!(
        err.contains(&vocab.to_string()) && err.contains("vocabulary"),
        "{err}"
    );
    let err = model.generate(&[1, 2, 3], max, &device).unwrap_err().to_string();
    assert!(err.contains("max_position_embeddings"), "{err}");
    // Exactly at the bound is allowed: prompt + new = max.
    assert!(model.check_ids(&[1, 2, 3], max - 3).is_ok());
    // A forward past the positions is refused too, without the [seq, seq] allocation.
    let long = vec![1usize; max + 1];
    let err = model
        .try_forward(ids_tensor_on::<NdArray>(&long), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("max_position_embeddings"), "{err}");
}

fn ids_tensor_on<Bk: burn::tensor::backend::Backend>(ids: &[usize]) -> Tensor<Bk, 2, Int> {
    Tensor::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), [1, ids.len()]),
        &Default::default(),
    )
}
