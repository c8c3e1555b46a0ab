//! The key/value cache: each cached step's logits against the full forward's, and what
//! DeepSeek-V3's latent attention keeps a token.

use mpipemoe_models::KvCache;

use super::*;

/// A prompt in one forward without a cache, against the same prompt as a prefill of all but
/// its last three ids and three cached single-id steps: each step's logits equal the full
/// forward's at its position, to float32 rounding, on every family (DeepSeek-V3's steps on
/// the compressed cache, its queries absorbing `kv_b`; sliding windows and Llama 4's chunks
/// trimmed in between).
#[test]
fn every_familys_cached_steps_give_the_full_forwards_logits() {
    let device = Default::default();
    for family in FAMILIES {
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let prompt = expected(family).ints["prompt"].clone();
        let t = prompt.len();
        let full = model
            .try_forward(ids_tensor(&prompt, [1, t]), None)
            .unwrap()
            .logits;
        let vocab = full.dims()[2];
        let mut cache = KvCache::new(model.layers.len());
        model
            .try_forward(ids_tensor(&prompt[..t - 3], [1, t - 3]), Some(&mut cache))
            .unwrap();
        for p in t - 3..t {
            let step = model
                .try_forward(ids_tensor(&prompt[p..p + 1], [1, 1]), Some(&mut cache))
                .unwrap()
                .logits;
            let want = full.clone().slice([0..1, p..p + 1, 0..vocab]);
            let err = rel_err(&values(step), &values(want));
            assert!(err < 1e-5, "{family}: position {p}: relative error {err:.1e}");
        }
    }
}

/// DeepSeek-V3's cache keeps a token's `kv_lora_rank` latent and its one rotary key, shared
/// by the heads, not every head's expanded keys and values.
#[test]
fn deepseeks_cache_holds_the_latent_per_token() {
    let device = Default::default();
    let model =
        MoeCausalLm::<B>::from_hf(data().join("deepseek-v3-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let latent = model.config().latent.unwrap();
    let heads = model.config().n_heads;
    let mut cache = KvCache::new(model.layers.len());
    model
        .try_forward(ids_tensor(&[5, 9, 13, 4, 7], [1, 5]), Some(&mut cache))
        .unwrap();
    model
        .try_forward(ids_tensor(&[8], [1, 1]), Some(&mut cache))
        .unwrap();
    let expanded = heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim + latent.v_head_dim);
    for layer in cache.layers.iter().map(|l| l.as_ref().unwrap()) {
        assert_eq!(layer.keys().dims(), [1, 1, 6, latent.qk_rope_head_dim]);
        assert_eq!(layer.values().dims(), [1, 1, 6, latent.kv_lora_rank]);
        let per_token = latent.qk_rope_head_dim + latent.kv_lora_rank;
        assert!(per_token < expanded, "{per_token} against {expanded}");
    }
}

/// `try_forward_last`, the logits `generate` asks for, equals the last position of
/// `try_forward`'s, row by row, on every family.
#[test]
fn the_last_positions_logits_alone_equal_the_full_forwards_last() {
    let device = Default::default();
    for family in FAMILIES {
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let ids: Vec<usize> = (0..10).map(|i| 3 + (i * 7) % 50).collect();
        let full = model.try_forward(ids_tensor(&ids, [2, 5]), None).unwrap().logits;
        let last = model
            .try_forward_last(ids_tensor(&ids, [2, 5]), None)
            .unwrap()
            .logits;
        let vocab = full.dims()[2];
        assert_eq!(last.dims(), [2, 1, vocab], "{family}");
        let err = rel_err(&values(last), &values(full.slice([0..2, 4..5, 0..vocab])));
        assert!(err < 1e-6, "{family}: relative error {err:.1e}");
    }
}
