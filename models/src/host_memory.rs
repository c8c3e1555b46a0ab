//! Floors of what a pass holds in host memory, checked before it runs: a pass that cannot fit
//! is refused by name rather than ended by a failed allocation (Rust aborts the process on
//! one). Floors, not estimates: each counts tensors the pass must hold at once whatever the
//! implementation does around them, so a pass that fits is never refused.

use mpipemoe::{MoeError, Result};

use crate::config::DecoderConfig;

/// Bytes of the attention weights a training step of `rows` sequences of `seq_len` tokens
/// keeps for its backward: every layer's softmax output `[rows, n_heads, seq_len, seq_len]`
/// of `elem_bytes` each (held by the product with the values until the backward reaches it).
/// The hidden states, the MoE layers and the gradients come on top.
pub fn attention_weights_bytes(
    config: &DecoderConfig,
    rows: usize,
    seq_len: usize,
    elem_bytes: usize,
) -> u128 {
    config.layers.len() as u128 * one_layers_weights(config, rows, seq_len, elem_bytes)
}

/// Bytes of the largest tensor a forward without a backward (the logits of `rows` sequences of
/// `t` tokens, a generation's prefill) holds at once: one layer's attention weights `[rows,
/// n_heads, t, t]`, or, with `logits`, the logits `[rows · t, vocab_size]`.
pub fn forward_floor_bytes(
    config: &DecoderConfig,
    rows: usize,
    t: usize,
    logits: bool,
    elem_bytes: usize,
) -> u128 {
    let weights = one_layers_weights(config, rows, t, elem_bytes);
    let logits = match logits {
        true => rows as u128 * t as u128 * config.vocab_size as u128 * elem_bytes as u128,
        false => 0,
    };
    weights.max(logits)
}

fn one_layers_weights(config: &DecoderConfig, rows: usize, t: usize, elem_bytes: usize) -> u128 {
    rows as u128 * config.n_heads as u128 * (t as u128).pow(2) * elem_bytes as u128
}

/// `floor` bytes against `available` (`None`: nothing to check): where they do not fit, a
/// [`MoeError::Memory`] saying that `what` holds at least `floor`.
pub fn check_host_bytes(floor: u128, available: Option<u64>, what: impl FnOnce() -> String) -> Result<()> {
    match available {
        Some(available) if floor > available as u128 => Err(MoeError::Memory(format!(
            "{} holds at least {}, more than the {} available to it; lower the batch or the sequence length",
            what(),
            gib(floor),
            gib(available as u128)
        ))),
        _ => Ok(()),
    }
}

/// `bytes` as GiB with one decimal, for messages.
fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}
