//! Generation as people use it: the sampling filters held to transformers' own processors on
//! stored logits (`tests/data/models/make_sampling.py`), seeded draws, and the stop ids and
//! defaults of `generation_config.json`.

use mpipemoe_models::{GenerateOptions, GenerationDefaults, Sampling};

use super::*;

fn sampling(setting: &serde_json::Value, seed: u64) -> Sampling {
    Sampling {
        temperature: setting["temperature"].as_f64().unwrap_or(1.0),
        top_k: setting["top_k"].as_u64().map(|k| k as usize),
        top_p: setting["top_p"].as_f64(),
        seed,
    }
}

/// Temperature, top-k (ties of the k-th value kept) and top-p (the largest always kept), in
/// transformers' order: the same entries kept, the same filtered logits, the same softmax,
/// for every setting and row the script wrote (rows where top-p's cut falls between equal
/// values are torch's sort order, not a rule, and are skipped, as marked).
#[test]
fn the_filters_equal_transformers_processors_on_stored_logits() {
    let text = std::fs::read_to_string(data().join("sampling.expected.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows: Vec<Vec<f32>> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let mut compared = 0;
    for case in reference["cases"].as_array().unwrap() {
        let s = sampling(&case["setting"], 0);
        s.validate().unwrap();
        for (r, row) in rows.iter().enumerate() {
            if case["ambiguous"][r].as_bool().unwrap() {
                continue;
            }
            let mut ours = row.clone();
            s.filter(&mut ours);
            let kept: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] > f32::NEG_INFINITY).collect();
            let want: Vec<usize> = case["kept"][r]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(kept, want, "{}: row {r}", case["setting"]);
            let max = kept.iter().map(|&i| f64::from(ours[i])).fold(f64::MIN, f64::max);
            let sum: f64 = kept.iter().map(|&i| (f64::from(ours[i]) - max).exp()).sum();
            for &i in &kept {
                let theirs = case["filtered"][r][i].as_f64().unwrap();
                assert!((f64::from(ours[i]) - theirs).abs() <= 1e-6 * theirs.abs().max(1.0));
                let p = (f64::from(ours[i]) - max).exp() / sum;
                let q = case["probs"][r][i].as_f64().unwrap();
                assert!(
                    (p - q).abs() < 1e-6,
                    "{}: row {r} id {i}: {p} vs {q}",
                    case["setting"]
                );
            }
            compared += 1;
        }
    }
    assert!(compared >= 40, "{compared} rows compared");
}

/// Sampled generation on a whole model: the same seed gives the same ids, another seed other
/// ids, and top-k 1 is the greedy continuation (the filter and the draw are on the path).
#[test]
fn sampled_generation_is_seeded_and_top_k_one_is_greedy() {
    let dir = data().join("mixtral-tiny");
    let device = Default::default();
    let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, Arc::new(SingleRank)).unwrap();
    let prompt = [1usize, 5, 9];
    let run = |s: Sampling| {
        let options = GenerateOptions {
            max_new_tokens: 24,
            sampling: Some(s),
        };
        model.generate_with(&prompt, &options, &device).unwrap()
    };
    let hot = |seed| Sampling {
        temperature: 1.5,
        top_k: None,
        top_p: Some(0.95),
        seed,
    };
    assert_eq!(run(hot(11)), run(hot(11)));
    assert_ne!(run(hot(11)), run(hot(12)));
    let one = Sampling {
        temperature: 0.8,
        top_k: Some(1),
        top_p: None,
        seed: 5,
    };
    assert_eq!(run(one), model.generate(&prompt, 24, &device).unwrap());
    let bad = GenerateOptions {
        max_new_tokens: 4,
        sampling: Some(Sampling {
            temperature: 0.0,
            ..one
        }),
    };
    let err = model
        .generate_with(&prompt, &bad, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("temperature"), "{err}");
}

/// transformers stops at `generation_config.json`'s `eos_token_id` where the folder has the
/// file (a published chat model lists its end-of-turn id there, not in `config.json`), and
/// takes its sampling defaults from it; a bad key is named.
#[test]
fn generation_config_gives_the_stop_ids_and_sampling_defaults() {
    let device = Default::default();
    let base = data().join("mixtral-tiny");
    let greedy = MoeCausalLm::<NdArray>::from_hf(&base, &device, Arc::new(SingleRank))
        .unwrap()
        .generate(&[1, 5, 9], 16, &device)
        .unwrap();
    // A token the greedy continuation reaches at step 4 and not before.
    let step = (3..greedy.len())
        .find(|&i| !greedy[..i].contains(&greedy[i]))
        .unwrap();
    let stop = greedy[step];
    let dir = edited_copy("mixtral-tiny", "generation-config", |_, _| {});
    let write = |json: serde_json::Value| {
        std::fs::write(dir.join("generation_config.json"), json.to_string()).unwrap();
    };
    write(
        serde_json::json!({"eos_token_id": [90, stop], "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    );
    let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, Arc::new(SingleRank)).unwrap();
    assert_eq!(model.config().eos_token_ids, vec![90, stop]);
    assert_eq!(model.generate(&[1, 5, 9], 16, &device).unwrap(), greedy[..=step]);
    let defaults = &model.config().generation;
    assert_eq!(
        defaults.sampling(3),
        Some(Sampling {
            temperature: 0.6,
            top_k: Some(20),
            top_p: Some(0.95),
            seed: 3
        })
    );
    // Without the file's ids, config.json's (2 here) stand.
    write(serde_json::json!({"do_sample": false}));
    let model = MoeCausalLm::<NdArray>::from_hf(&dir, &device, Arc::new(SingleRank)).unwrap();
    assert_eq!(model.config().eos_token_ids, vec![2]);
    assert_eq!(model.config().generation.sampling(0), None);
    write(serde_json::json!({"do_sample": true, "temperature": 0.0}));
    let err = GenerationDefaults::read(&dir).unwrap_err().to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("temperature"),
        "{err}"
    );
    write(serde_json::json!({"do_sample": "yes"}));
    let err = GenerationDefaults::read(&dir).unwrap_err().to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("do_sample"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
