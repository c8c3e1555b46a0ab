//! Greedy generation with the key/value cache.

use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::{MoeBackend, MoeError, Result};

use crate::cache::KvCache;
use crate::model::MoeCausalLm;

impl<B: MoeBackend> MoeCausalLm<B> {
    /// The greedy continuation of `prompt`: the prompt in one forward (prefill), then one token
    /// at a time through the cache, each the argmax of the last logits (the lowest id on a
    /// tie, as `torch.argmax`), up to `max_new_tokens` or an end-of-sequence id of the config
    /// (included, as transformers' `generate` returns it). Returns the new ids.
    ///
    /// # Errors
    /// [`MoeError::Input`] if the prompt is empty or holds an id outside the vocabulary; as
    /// [`try_forward`](Self::try_forward).
    pub fn generate(
        &self,
        prompt: &[usize],
        max_new_tokens: usize,
        device: &B::Device,
    ) -> Result<Vec<usize>> {
        if prompt.is_empty() {
            return Err(MoeError::Input("the prompt is empty".into()));
        }
        let vocab = self.config.vocab_size;
        if let Some(bad) = prompt.iter().find(|&&id| id >= vocab) {
            return Err(MoeError::Input(format!(
                "prompt id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let mut cache = KvCache::new(self.layers.len());
        let mut new = Vec::with_capacity(max_new_tokens);
        let mut input: Vec<usize> = prompt.to_vec();
        while new.len() < max_new_tokens {
            let ids = Tensor::<B, 2, Int>::from_data(
                TensorData::new(
                    input.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                    [1, input.len()],
                ),
                device,
            );
            let logits = self.try_forward(ids, Some(&mut cache))?.logits;
            let [_, t, _] = logits.dims();
            let last: Vec<f32> = logits
                .slice([0..1, t - 1..t, 0..vocab])
                .into_data()
                .convert::<f32>()
                .into_vec()
                .map_err(|e| MoeError::Input(format!("logits: {e:?}")))?;
            let next = argmax(&last);
            new.push(next);
            if self.config.eos_token_ids.contains(&next) {
                break;
            }
            input = vec![next];
        }
        Ok(new)
    }
}

/// The index of the largest value, the first on a tie (NaN never wins).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}
