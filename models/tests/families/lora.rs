//! LoRA adapters written by peft (tests/data/models/lora, `make_lora.py`): every family's
//! logits, loss and every adapter tensor's gradient equal peft's float64 model to 1e-4, at one
//! rank and at two (experts sharded, three partitions, S4); the base weights take no gradient;
//! the adapters we save are peft's file, key for key and value for value; merging keeps the
//! logits; bad adapters are refused by name.

use burn::module::{AutodiffModule, ModuleMapper};
use burn::optim::GradientsParams;
use mpipemoe::parallel::sync_replicated_grads;
use mpipemoe::MoeError;
use mpipemoe_models::{LoraSpec, PeftAdapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};

use super::*;

fn lora_dir(family: &str) -> PathBuf {
    data().join("lora").join(family)
}

pub(super) fn lora_expected(family: &str) -> Expected {
    expected(&format!("lora/{family}"))
}

/// A copy of the model whose parameters hold their gradients (zeros where there is none):
/// the adapters' gradients then come out in PEFT's layout through `adapter_tensors`.
struct GradsAsValues<'a, Bk: AutodiffBackend> {
    grads: &'a GradientsParams,
    _backend: std::marker::PhantomData<Bk>,
}

impl<Bk: AutodiffBackend> ModuleMapper<Bk> for GradsAsValues<'_, Bk> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Bk, D>>) -> Param<Tensor<Bk, D>> {
        let (id, tensor, mapper) = param.consume();
        let value = match self.grads.get::<Bk::InnerBackend, D>(id) {
            Some(g) => Tensor::from_inner(g),
            None => tensor.zeros_like(),
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

fn adapter_grads(model: &MoeCausalLm<B>, grads: &GradientsParams) -> Result<Option<TensorMap>, MoeError> {
    let mut mapper = GradsAsValues::<B> {
        grads,
        _backend: std::marker::PhantomData,
    };
    model.clone().map(&mut mapper).adapter_tensors()
}

fn compare(family: &str, what: &str, ours: &TensorMap, exp: &Expected) {
    let mut compared = 0;
    for (key, (shape, reference)) in exp
        .floats
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
    {
        let got = ours
            .get(key)
            .unwrap_or_else(|| panic!("{family} {what}: no gradient for `{key}`"));
        assert_eq!(&got.shape.to_vec(), shape, "{family} {what}: `{key}`");
        let err = rel_err(&got.to_vec::<f32>().unwrap(), reference);
        assert!(
            err < 1e-4,
            "{family} {what}: gradient of `{key}` off by {err:.2e}"
        );
        compared += 1;
    }
    assert_eq!(compared, ours.len(), "{family} {what}: every adapter tensor");
}

/// One rank's run: logits, its share of the loss, and (on rank 0) the adapters' gradients
/// summed as the library's sync sums them.
pub(super) fn run_rank(
    family: &str,
    comm: Arc<dyn mpipemoe::Communicator>,
    rows: std::ops::Range<usize>,
    share: f32,
    settings: impl Fn(mpipemoe::MoeLayerConfig) -> mpipemoe::MoeLayerConfig,
) -> Result<(Vec<f32>, f32, Option<TensorMap>), MoeError> {
    let device = Default::default();
    let exp = lora_expected(family);
    let t = exp.floats["logits"].0[1];
    let adapter = PeftAdapter::read(lora_dir(family))?;
    let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, comm.clone())?
        .map_moe_configs(settings)?
        .with_adapter(&adapter)?;
    let ids = &exp.ints["ids"][rows.start * t..rows.end * t];
    let (loss, out) = model.loss(ids_tensor(ids, [rows.len(), t]))?;
    let loss = loss * share;
    let half = values(loss.clone())[0];
    let grads = loss.backward();
    let base_grads = model
        .hf_parts()
        .parts
        .linears
        .iter()
        .filter(|(_, l)| l.weight.grad(&grads).is_some())
        .count()
        + model
            .moe_layers()
            .filter(|(_, m)| m.experts.w_in.grad(&grads).is_some())
            .count();
    assert_eq!(base_grads, 0, "{family}: a frozen base weight took a gradient");
    let mut grads = GradientsParams::from_grads(grads, &model);
    sync_replicated_grads(&model, &mut grads, comm.as_ref())?;
    Ok((values(out.logits), half, adapter_grads(&model, &grads)?))
}

#[test]
fn every_family_with_a_peft_adapter_matches_peft_logits_loss_and_adapter_gradients() {
    for family in FAMILIES {
        let exp = lora_expected(family);
        let b = exp.floats["logits"].0[0];
        let (logits, loss, grads) = run_rank(family, Arc::new(SingleRank), 0..b, 1.0, |c| c).unwrap();
        let logits_err = rel_err(&logits, &exp.floats["logits"].1);
        let loss_err = rel_err(&[loss], &exp.floats["loss"].1);
        assert!(logits_err < 1e-4, "{family}: logits off by {logits_err:.2e}");
        assert!(loss_err < 1e-4, "{family}: loss off by {loss_err:.2e}");
        compare(family, "1 rank", &grads.unwrap(), &exp);
    }
}

/// Two ranks, each with its own experts' adapters, a row of the batch and half the loss;
/// three partitions and S4, whose recompute runs the adapted weights.
#[test]
fn adapters_sharded_with_the_experts_over_two_ranks_match_peft_too() {
    for family in FAMILIES {
        let exp = lora_expected(family);
        assert_eq!(exp.floats["logits"].0[0], 2, "one row per rank");
        let results = LocalGroup::run(2, |ctx| {
            run_rank(family, ctx.comm, ctx.rank..ctx.rank + 1, 0.5, |c| {
                c.with_partitions(Partitions::Fixed(3))
                    .with_memory_reuse(MemoryReuse::S4)
            })
        })
        .unwrap();
        let mut logits = Vec::new();
        let mut loss = 0.0;
        let mut grads = None;
        for (l, half, g) in results {
            logits.extend(l);
            loss += half;
            grads = grads.or(g);
        }
        assert!(
            rel_err(&logits, &exp.floats["logits"].1) < 1e-4,
            "{family} at 2 ranks: logits"
        );
        assert!(
            rel_err(&[loss], &exp.floats["loss"].1) < 1e-4,
            "{family} at 2 ranks: loss"
        );
        compare(
            family,
            "2 ranks",
            &grads.expect("rank 0 gathers the adapters"),
            &exp,
        );
    }
}

/// The adapter we save is peft's file again: the same keys, shapes and values, and a config
/// with the same rank, alpha, scaling and targets; merged, the model gives the same logits.
#[test]
fn saved_adapters_are_peft_files_and_merging_keeps_the_logits() {
    let device = Default::default();
    for family in FAMILIES {
        let adapter = PeftAdapter::read(lora_dir(family)).unwrap();
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank))
            .unwrap()
            .with_adapter(&adapter)
            .unwrap();
        let out = std::env::temp_dir().join(format!("mpipemoe-lora-{family}-{}", std::process::id()));
        model
            .save_adapter(&adapter.spec, &data().join(family), &out)
            .unwrap();
        let (ours, _) = mpipemoe::format::read_safetensors(&out.join(ADAPTER_WEIGHTS)).unwrap();
        let (theirs, _) =
            mpipemoe::format::read_safetensors(&lora_dir(family).join(ADAPTER_WEIGHTS)).unwrap();
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{family}"
        );
        for (key, data) in &theirs {
            assert_eq!(ours[key].shape, data.shape, "{family}: `{key}`");
            assert_eq!(
                ours[key].to_vec::<f32>().unwrap(),
                data.to_vec::<f32>().unwrap(),
                "{family}: `{key}`"
            );
        }
        let again = PeftAdapter::read(&out).unwrap();
        let mut want = adapter.spec.targets.clone();
        let mut got = again.spec.targets.clone();
        want.sort();
        got.sort();
        assert_eq!(
            (again.spec.rank, again.spec.alpha, again.spec.scaling),
            (adapter.spec.rank, adapter.spec.alpha, adapter.spec.scaling)
        );
        assert_eq!(got, want, "{family}: targets");
        std::fs::remove_dir_all(&out).unwrap();

        let exp = lora_expected(family);
        let t = exp.floats["logits"].0[1];
        let ids = ids_tensor(&exp.ints["ids"], [2, t]);
        let merged = model.clone().merge_lora();
        assert!(!merged.has_lora());
        let a = values(model.forward(ids.clone(), None).logits);
        let b = values(merged.forward(ids, None).logits);
        assert!(rel_err(&b, &a) < 1e-5, "{family}: merged logits");
    }
}

fn adapter_error(family: &str, edit: impl Fn(&Path)) -> String {
    let dir = std::env::temp_dir().join(format!("mpipemoe-bad-lora-{family}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for file in [ADAPTER_CONFIG, ADAPTER_WEIGHTS] {
        std::fs::copy(lora_dir(family).join(file), dir.join(file)).unwrap();
    }
    edit(&dir);
    let device = Default::default();
    let result = PeftAdapter::read(&dir).and_then(|a| {
        MoeCausalLm::<B>::from_hf(data().join("mixtral-tiny"), &device, Arc::new(SingleRank))?
            .with_adapter(&a)
    });
    std::fs::remove_dir_all(&dir).unwrap();
    match result {
        Ok(_) => panic!("a bad adapter was accepted"),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl Fn(&mut serde_json::Value)) {
    let path = dir.join(ADAPTER_CONFIG);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn bad_adapters_are_refused_by_name() {
    // A rank that disagrees with the tensors.
    let e = adapter_error("mixtral-tiny", |d| edit_config(d, |c| c["r"] = 3.into()));
    assert!(e.contains("r = 3"), "{e}");
    // Another family's adapter on this model: shapes that do not fit.
    let e = adapter_error("qwen3-moe-tiny", |_| {});
    assert!(e.contains("do not fit") || e.contains("fit neither"), "{e}");
    // A target the model lacks (DeepSeek's latent projections on Mixtral).
    let e = adapter_error("deepseek-v3-tiny", |_| {});
    assert!(e.contains("q_a_proj") || e.contains("kv_a_proj_with_mqa"), "{e}");
    // Unsupported variants, named.
    for (field, value) in [
        ("use_dora", serde_json::json!(true)),
        ("peft_type", serde_json::json!("IA3")),
    ] {
        let e = adapter_error("mixtral-tiny", |d| edit_config(d, |c| c[field] = value.clone()));
        assert!(e.contains(field), "{field}: {e}");
    }
    let e = adapter_error("mixtral-tiny", |d| {
        edit_config(d, |c| c["rank_pattern"] = serde_json::json!({"q_proj": 4}))
    });
    assert!(e.contains("rank_pattern"), "{e}");
    // Variants whatever their type (PEFT's `use_bdlora` is a config object), and fields that
    // choose the scaling or the layers by a type PEFT would not read that way.
    for (field, value) in [
        ("use_bdlora", serde_json::json!({"nblocks": 2})),
        ("kasa_config", serde_json::json!({"beta": 0.1})),
        ("alora_invocation_tokens", serde_json::json!([5, 9])),
        ("layer_replication", serde_json::json!([[0, 2], [1, 3]])),
        ("trainable_token_indices", serde_json::json!([1, 2])),
        ("use_rslora", serde_json::json!("yes")),
        ("target_modules", serde_json::json!(["q_proj", "down_proj"])),
        ("layers_to_transform", serde_json::json!([0, "1"])),
        ("target_modules", serde_json::json!("all-linear")),
        ("exclude_modules", serde_json::json!(".*q_proj")),
    ] {
        let e = adapter_error("mixtral-tiny", |d| edit_config(d, |c| c[field] = value.clone()));
        assert!(e.contains(field), "{field}: {e}");
    }
    let e = adapter_error("mixtral-tiny", |d| {
        edit_config(d, |c| {
            c["layers_to_transform"] = serde_json::json!([0, 1, 2]);
            c["layers_pattern"] = serde_json::json!("h");
        })
    });
    assert!(e.contains("layers_pattern"), "{e}");
    // Tensors the config does not target: PEFT leaves them out, so they are refused, each
    // naming the module the config misses.
    for (edit, module) in [
        (
            serde_json::json!({"exclude_modules": ["k_proj"]}),
            "model.layers.0.self_attn.k_proj",
        ),
        (
            serde_json::json!({"layers_to_transform": [0, 2]}),
            "model.layers.1.self_attn",
        ),
        (
            serde_json::json!({"target_modules": ["q_proj", "k_proj", "v_proj"]}),
            "model.layers.0.self_attn.o_proj",
        ),
        (
            serde_json::json!({"target_parameters": ["experts.down_proj"]}),
            "model.layers.0.mlp.experts.gate_up_proj",
        ),
    ] {
        let e = adapter_error("mixtral-tiny", |d| {
            edit_config(d, |c| {
                for (k, v) in edit.as_object().unwrap() {
                    c[k] = v.clone();
                }
            })
        });
        assert!(e.contains("does not target") && e.contains(module), "{edit}: {e}");
    }
}

/// What PEFT reads as the same targets (module paths' tails, every layer listed, an
/// exclusion that matches nothing, the stack's own pattern) is accepted, with the same logits.
#[test]
fn configs_peft_reads_as_the_same_targets_give_the_same_logits() {
    let device = Default::default();
    let family = "mixtral-tiny";
    let exp = lora_expected(family);
    let t = exp.floats["logits"].0[1];
    let ids = ids_tensor(&exp.ints["ids"][..t], [1, t]);
    let logits = |dir: &Path| {
        let adapter = PeftAdapter::read(dir).unwrap();
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank))
            .unwrap()
            .with_adapter(&adapter)
            .unwrap();
        values(model.forward(ids.clone(), None).logits)
    };
    let want = logits(&lora_dir(family));
    let dir = std::env::temp_dir().join(format!("mpipemoe-same-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for file in [ADAPTER_CONFIG, ADAPTER_WEIGHTS] {
        std::fs::copy(lora_dir(family).join(file), dir.join(file)).unwrap();
    }
    edit_config(&dir, |c| {
        c["target_modules"] = serde_json::json!([
            "self_attn.q_proj",
            "k_proj",
            "model.layers.0.self_attn.v_proj",
            "v_proj",
            "o_proj"
        ]);
        c["target_parameters"] = serde_json::json!(["mlp.experts.gate_up_proj", "down_proj"]);
        c["layers_to_transform"] = serde_json::json!([2, 0, 1]);
        c["layers_pattern"] = serde_json::json!(["layers"]);
        c["exclude_modules"] = serde_json::json!(["model.layers.9.self_attn.q_proj", "gate"]);
        c["use_bdlora"] = serde_json::Value::Null;
        c["loftq_config"] = serde_json::json!({});
    });
    let got = logits(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(got, want);
}

/// Fresh adapters on every target: they start as no change, only they train, and the spec's
/// mistakes are refused by name.
#[test]
fn fresh_adapters_start_as_no_change_and_alone_take_gradients() {
    let device = Default::default();
    let base =
        MoeCausalLm::<B>::from_hf(data().join("qwen3-moe-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        scaling: mpipemoe::LoraScaling::Standard,
        targets: ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
            .map(String::from)
            .to_vec(),
        dropout: 0.0,
    };
    let model = base.clone().with_lora(&spec, 1).unwrap();
    let ids = ids_tensor(&[5, 9, 17, 3, 8, 21], [1, 6]);
    let a = values(base.forward(ids.clone(), None).logits);
    let b = values(model.forward(ids.clone(), None).logits);
    assert_eq!(a, b, "fresh adapters change nothing");
    let (loss, _) = model.loss(ids).unwrap();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let entries = mpipemoe::parallel::param_roles::<B, _>(&model);
    let trained: Vec<_> = entries
        .iter()
        .filter(|e| grads.get::<NdArray, 2>(e.id).is_some() || grads.get::<NdArray, 3>(e.id).is_some())
        .collect();
    assert!(!trained.is_empty());
    for e in &trained {
        assert!(
            e.path.contains("lora") || e.path.contains("adapters"),
            "{} took a gradient",
            e.path
        );
    }
    let bad = |spec: LoraSpec| match base.clone().with_lora(&spec, 1) {
        Err(MoeError::Config { field, reason }) => format!("{field}: {reason}"),
        other => panic!("accepted: {:?}", other.map(|_| ())),
    };
    assert!(bad(LoraSpec {
        rank: 0,
        ..spec.clone()
    })
    .starts_with("rank"));
    assert!(bad(LoraSpec {
        targets: vec!["q_a_proj".into()],
        ..spec.clone()
    })
    .contains("q_a_proj"));
    assert!(bad(LoraSpec {
        targets: vec!["mlp".into()],
        ..spec.clone()
    })
    .contains("mlp"));
    // Dropout with expert targets, as PEFT refuses it, and outside [0, 1).
    assert!(bad(LoraSpec {
        dropout: 0.1,
        ..spec.clone()
    })
    .starts_with("lora_dropout"));
    assert!(bad(LoraSpec {
        dropout: 1.0,
        targets: vec!["q_proj".into()],
        ..spec.clone()
    })
    .starts_with("lora_dropout"));
}

/// PEFT's `lora_dropout` on an attention adapter: in training each input value of the adapter
/// is zeroed or scaled by `1 / (1 - p)`, in about `p` of the places, the base projection sees
/// the input whole, and the same seed draws the same masks; without autodiff (inference)
/// nothing is dropped. Through a whole model: training losses move with it, inference logits
/// do not.
#[test]
fn adapter_dropout_drops_the_adapters_input_in_training_only() {
    use burn::tensor::backend::Backend;
    use mpipemoe_models::LoraLinear;
    let device = Default::default();
    // a = I and b = I: the adapter's output is `scale · dropout(x)` itself.
    let (d, p, scale) = (64, 0.25, 2.0);
    let eye = || Tensor::<B, 2>::eye(d, &device);
    let adapter = |dropout| LoraLinear::<B> {
        a: burn::module::Param::from_tensor(eye()),
        b: burn::module::Param::from_tensor(eye()),
        scale,
        dropout,
    };
    let x = Tensor::<B, 2>::ones([64, d], &device);
    B::seed(&device, 7);
    let dropped = adapter(p).forward(x.clone()).into_data().to_vec::<f32>().unwrap();
    let kept = (scale / (1.0 - p)) as f32;
    let zeros = dropped.iter().filter(|&&v| v == 0.0).count();
    assert!(
        dropped.iter().all(|&v| v == 0.0 || (v - kept).abs() < 1e-6),
        "values other than 0 and scale / (1 - p)"
    );
    // 4,096 draws at p = 0.25: 1,024 expected, standard deviation 28.
    assert!((900..1150).contains(&zeros), "{zeros} of 4096 zeroed at p = {p}");
    B::seed(&device, 7);
    let again = adapter(p).forward(x.clone()).into_data().to_vec::<f32>().unwrap();
    assert_eq!(dropped, again, "the same seed, other masks");
    let inference = adapter(p)
        .valid()
        .forward(x.clone().inner())
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(
        inference.iter().all(|&v| (v - scale as f32).abs() < 1e-6),
        "dropped in inference"
    );

    // Through a model with trained-looking adapters (b non-zero): inference logits ignore the
    // dropout, training losses do not.
    let base =
        MoeCausalLm::<B>::from_hf(data().join("qwen3-moe-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let spec = |dropout| LoraSpec {
        rank: 4,
        alpha: 8.0,
        scaling: mpipemoe::LoraScaling::Standard,
        targets: vec!["attention".into()],
        dropout,
    };
    let nudged = |dropout| {
        let mut model = base.clone().with_lora(&spec(dropout), 1).unwrap();
        for layer in &mut model.layers {
            for lora in layer.attn.as_mut().unwrap().lora.iter_mut().flatten() {
                lora.b = Param::from_tensor(lora.b.val().ones_like().mul_scalar(0.05));
            }
        }
        model
    };
    let (plain, dropping) = (nudged(0.0), nudged(0.5));
    let ids = ids_tensor(&[5, 9, 17, 3, 8, 21], [1, 6]);
    let logits = |m: &MoeCausalLm<B>| values(m.valid().forward(ids.clone().inner(), None).logits);
    assert_eq!(logits(&plain), logits(&dropping), "inference dropped");
    let loss = |m: &MoeCausalLm<B>| m.loss(ids.clone()).unwrap().0.into_scalar();
    assert_ne!(loss(&plain), loss(&dropping), "training did not drop");
}
