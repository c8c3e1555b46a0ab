//! Generation with the key/value cache: greedy or sampled, every step agreed across ranks.

use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::hot_pool::HotPool;
use mpipemoe::rng::SplitMix64;
use mpipemoe::{Communicator, MoeBackend, MoeError, Result};

use crate::cache::KvCache;
use crate::generation::GenerateOptions;
use crate::model::MoeCausalLm;

impl<B: MoeBackend> MoeCausalLm<B> {
    /// The greedy continuation of `prompt`: the prompt in one forward (prefill), then one token
    /// at a time through the cache, each the argmax of the last logits (the lowest id on a
    /// tie, as `torch.argmax`), up to `max_new_tokens` or an end-of-sequence id of the config
    /// (included, as transformers' `generate` returns it). Returns the new ids.
    ///
    /// With expert parallelism it is a collective: every rank of the MoE layers' group calls
    /// it, each with a prompt and `max_new_tokens` of its own (a rank's batch, as in
    /// training), and every step is an exchange all ranks take part in. So the ranks agree
    /// before each step whether any of them still generates (one small all-reduce); a rank
    /// that has finished (its end-of-sequence id, or its own `max_new_tokens`) keeps stepping
    /// with its last token on a copy of its cache, so that its peers' exchanges complete,
    /// and discards what comes out. Each rank's ids are its own prompt's continuation. (With
    /// a capacity factor the ranks' tokens compete for the experts' capacity as a batch's
    /// rows do, so the same prompt on two ranks may continue differently; that is the
    /// layer's semantics, and the steps still agree.)
    ///
    /// # Errors
    /// [`MoeError::Input`] if the prompt is empty, holds an id outside the vocabulary, or the
    /// prompt and `max_new_tokens` run past the model's positions ([`Self::check_ids`]); as
    /// [`try_forward`](Self::try_forward); [`MoeError::Comm`] if a peer fails.
    pub fn generate(
        &self,
        prompt: &[usize],
        max_new_tokens: usize,
        device: &B::Device,
    ) -> Result<Vec<usize>> {
        self.generate_with(prompt, &GenerateOptions::greedy(max_new_tokens), device)
    }

    /// [`generate`](Self::generate) with options: greedy, or each token drawn from the last
    /// logits filtered as transformers' `generate(do_sample=True)` filters them (temperature,
    /// top-k, top-p: [`Sampling`](crate::Sampling)), from a generator seeded by `options.sampling.seed` (the
    /// same seed, the same ids). Stops at the config's stop ids
    /// ([`DecoderConfig::eos_token_ids`](crate::DecoderConfig::eos_token_ids):
    /// `generation_config.json`'s where the folder has them). With expert parallelism every
    /// rank draws from its own logits with the same seed.
    ///
    /// # Errors
    /// As [`generate`](Self::generate); [`MoeError::Config`] naming a sampling setting that
    /// is out of range ([`Sampling::validate`](crate::Sampling::validate)).
    pub fn generate_with(
        &self,
        prompt: &[usize],
        options: &GenerateOptions,
        device: &B::Device,
    ) -> Result<Vec<usize>> {
        let mut rows = self.generate_batch(&[prompt], options, device)?;
        Ok(rows.pop().expect("one row per prompt"))
    }

    /// [`generate_with`](Self::generate_with) for several prompts at once, as transformers'
    /// batched `generate` runs them: the prompts left-padded to the longest (the pad columns
    /// hidden by the mask, each row's positions counted from its first real token:
    /// [`KvCache::left_padded`]), one forward a step for all rows, each row stopping at its
    /// own stop id or at `max_new_tokens` and fed the pad id while the others go on. Returns
    /// each prompt's new ids, in the prompts' order, each row's greedy ids those of
    /// transformers' batched `generate`: the ids the prompt gets alone (where its logits do
    /// not tie within rounding), except on Llama 4, whose NoPE layers' attention temperature
    /// counts columns, pads included, in transformers as here. Sampled rows draw in
    /// row order from one generator seeded by `options.sampling.seed`. The pad id is the
    /// first stop id (0 without one); which id it is changes no real token's logits.
    ///
    /// On the CPU a decode step's products split over rayon's threads; call this from a
    /// worker of a pool (inside `ThreadPool::install`, or ranks run with
    /// `GroupOptions::pool_per_rank`, as `mpipemoe generate` does), where each split is
    /// cheap, rather than from a thread outside any pool, where each one wakes a worker and
    /// waits (BENCHMARKS §13i).
    ///
    /// # Errors
    /// As [`generate_with`](Self::generate_with), naming the prompt; [`MoeError::Input`] if
    /// `prompts` is empty.
    pub fn generate_batch(
        &self,
        prompts: &[&[usize]],
        options: &GenerateOptions,
        device: &B::Device,
    ) -> Result<Vec<Vec<usize>>> {
        let max_new_tokens = options.max_new_tokens;
        if let Some(sampling) = &options.sampling {
            sampling.validate()?;
        }
        let mut rng = SplitMix64::new(options.sampling.map_or(0, |s| s.seed));
        if prompts.is_empty() {
            return Err(MoeError::Input("no prompts were given".into()));
        }
        for (i, prompt) in prompts.iter().enumerate() {
            let named = |e: MoeError| match (e, prompts.len()) {
                (e, 1) => e,
                (MoeError::Input(m), _) => MoeError::Input(format!("prompt {i}: {m}")),
                (e, _) => e,
            };
            if prompt.is_empty() {
                return Err(named(MoeError::Input("the prompt is empty".into())));
            }
            self.check_ids(prompt, max_new_tokens).map_err(named)?;
        }
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
        let pad_id = self.config.eos_token_ids.first().copied().unwrap_or(0);
        let group = self.exchange_group();
        // Room for the prompt and every new token, so that no step copies the cache.
        let mut cache = KvCache::left_padded(self.layers.len(), &pads).with_reserve(width + max_new_tokens);
        let mut new: Vec<Vec<usize>> = vec![Vec::with_capacity(max_new_tokens); prompts.len()];
        let mut finished = vec![max_new_tokens == 0; prompts.len()];
        let mut input: Vec<usize> = prompts
            .iter()
            .zip(&pads)
            .flat_map(|(p, &pad)| std::iter::repeat_n(pad_id, pad).chain(p.iter().copied()))
            .collect();
        let b = prompts.len();
        // The pool's other threads wait for each step's products awake rather than asleep
        // (`mpipemoe::hot_pool`): a step is a chain of short parallel products.
        let _hot = HotPool::start();
        loop {
            let all_done = finished.iter().all(|&f| f);
            if !any_running(group.as_deref(), all_done)? {
                break;
            }
            let t = input.len() / b;
            let ids = Tensor::<B, 2, Int>::from_data(
                TensorData::new(input.iter().map(|&i| i as i64).collect::<Vec<_>>(), [b, t]),
                device,
            );
            if all_done {
                // Only for the peers' exchanges: the cache is not extended and the output is
                // not read.
                let mut scratch = cache.clone();
                self.try_forward_last(ids, Some(&mut scratch))?;
                continue;
            }
            let logits = self.try_forward_last(ids, Some(&mut cache))?.logits;
            let mut last: Vec<f32> = logits
                .into_data()
                .convert::<f32>()
                .into_vec()
                .map_err(|e| MoeError::Input(format!("logits: {e:?}")))?;
            input = Vec::with_capacity(b);
            for (r, row) in last.chunks_mut(self.config.vocab_size).enumerate() {
                if finished[r] {
                    input.push(pad_id);
                    continue;
                }
                let next = match &options.sampling {
                    None => argmax(row),
                    Some(sampling) => sampling.sample(row, &mut rng),
                };
                new[r].push(next);
                finished[r] = self.config.eos_token_ids.contains(&next) || new[r].len() == max_new_tokens;
                input.push(next);
            }
        }
        Ok(new)
    }

    /// The group the MoE layers exchange rows over, where it has more than one rank: the
    /// ranks whose steps must agree.
    fn exchange_group(&self) -> Option<Arc<dyn Communicator>> {
        self.moe_layers()
            .map(|(_, m)| m.context().comm().clone())
            .find(|c| c.n_ranks() > 1)
    }
}

/// Whether any rank of `group` still generates, this rank being `done` or not: one all-reduce
/// that every rank calls before each step, so that all take the same steps.
fn any_running(group: Option<&dyn Communicator>, done: bool) -> Result<bool> {
    let Some(group) = group else {
        return Ok(!done);
    };
    let mut running = [if done { 0.0 } else { 1.0 }];
    group.all_reduce_sum(&mut running)?;
    Ok(running[0] > 0.0)
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
