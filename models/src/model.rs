//! The whole decoder: embedding, layers, final norm, output projection.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use mpipemoe::loss::cross_entropy;
use mpipemoe::{Communicator, MoeBackend, MoeError, MoeLayer, MoeLayerConfig, Result};

use crate::attention::Attention;
use crate::cache::KvCache;
use crate::config::{DecoderConfig, FfnKind};
use crate::latent::LatentAttention;
use crate::layer::DecoderLayer;
use crate::linear::DenseProducts;
use crate::mlp::Mlp;
use crate::norm::{NamedParts, RmsNorm};
use crate::places::Places;
use crate::rotary::Rotary;

/// A decoder-only MoE language model (`*ForCausalLM`).
#[derive(Module, Debug)]
pub struct MoeCausalLm<B: Backend> {
    /// `embed_tokens`: `[vocab, d_model]`
    pub embed: Embedding<B>,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// The final `norm`.
    pub norm: RmsNorm<B>,
    /// `lm_head` (`[d_model, vocab]`); `None` when tied to the embedding.
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    pub(crate) config: DecoderConfig,
    #[module(skip)]
    pub(crate) ignored: Vec<String>,
}

/// The parameters outside the MoE layers, by Hugging Face name (see [`NamedParts`]), and
/// the token embedding.
#[derive(Debug)]
pub struct HfParts<'a, B: Backend> {
    /// The projections and vectors.
    pub parts: NamedParts<'a, B>,
    /// The token embedding's name and weight (`[vocab, d_model]`, stored as is).
    pub embedding: (String, &'a Param<Tensor<B, 2>>),
}

/// What [`MoeCausalLm::forward`] returns.
#[derive(Debug, Clone)]
pub struct LmOutput<B: Backend> {
    /// `[batch, seq, vocab]`
    pub logits: Tensor<B, 3>,
    /// The router load-balancing loss across the MoE layers, as transformers takes it
    /// (this rank's share; already scaled by the layers' `aux_loss_coef`, zero where they are
    /// zero). `[1]`
    pub aux_loss: Tensor<B, 1>,
    /// The MoE layers' z-losses summed (this rank's share). `[1]`
    pub z_loss: Tensor<B, 1>,
    /// Each MoE layer's rows per expert this step, over its expert-parallel group and, where
    /// the replicas are set ([`MoeCausalLm::set_replicas`]), its data-parallel replicas (the
    /// same on every such rank), in layer order: the load DeepSeek-V3's bias balancing reads
    /// ([`balance_score_biases`](MoeCausalLm::balance_score_biases)).
    pub routed_per_expert: Vec<Vec<usize>>,
}

impl<B: Backend> MoeCausalLm<B> {
    /// A randomly initialised model of `config` (burn's initialisation; each MoE layer from its
    /// own configuration's seed), with this rank's experts of every MoE layer.
    ///
    /// # Errors
    /// [`MoeError::Config`](mpipemoe::MoeError::Config) naming a bad field, or an MoE layer
    /// whose experts do not split over `comm`'s ranks.
    pub fn new(config: DecoderConfig, device: &B::Device, comm: Arc<dyn Communicator>) -> Result<Self> {
        config.validate()?;
        let layers = config
            .layers
            .iter()
            .map(|spec| {
                let (mlp, moe) = match &spec.ffn {
                    FfnKind::Dense { d_hidden } => (Some(Mlp::new(config.d_model, *d_hidden, device)), None),
                    FfnKind::Moe(moe) => (None, Some(moe.init_rank::<B>(device, comm.clone())?)),
                };
                let (attn, mla) = match config.latent {
                    None => (Some(Attention::new(&config, device)), None),
                    Some(latent) => (
                        None,
                        Some(LatentAttention::new(
                            config.d_model,
                            config.n_heads,
                            latent,
                            config.o_bias,
                            config.rms_eps,
                            device,
                        )),
                    ),
                };
                Ok(DecoderLayer {
                    attn_norm: RmsNorm::new(config.d_model, config.rms_eps, device),
                    attn,
                    mla,
                    ffn_norm: RmsNorm::new(config.d_model, config.rms_eps, device),
                    mlp,
                    moe,
                    rules: spec.attn,
                    mlp_name: config.mlp_name.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed: EmbeddingConfig::new(config.vocab_size, config.d_model).init(device),
            layers,
            norm: RmsNorm::new(config.d_model, config.rms_eps, device),
            lm_head: (!config.tie_embeddings).then(|| {
                LinearConfig::new(config.d_model, config.vocab_size)
                    .with_bias(false)
                    .init(device)
            }),
            config,
            ignored: Vec::new(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The folder's tensors that were not loaded because transformers skips them too
    /// (DeepSeek-V3's multi-token-prediction layers); empty for a model not loaded from a
    /// folder.
    pub fn ignored_tensors(&self) -> &[String] {
        &self.ignored
    }

    /// The same weights with every MoE layer's run settings changed by `f` (partitions,
    /// memory reuse, exchange path, shadowing, ...; see [`MoeLayer::with_config`]).
    ///
    /// # Errors
    /// As [`MoeLayer::with_config`]: if `f` changes a layer's shape or parameters, or makes
    /// its configuration invalid.
    pub fn map_moe_configs(mut self, f: impl Fn(MoeLayerConfig) -> MoeLayerConfig) -> Result<Self> {
        for (layer, spec) in self.layers.iter_mut().zip(self.config.layers.iter_mut()) {
            if let Some(moe) = layer.moe.take() {
                let config = f(moe.config().clone());
                spec.ffn = FfnKind::Moe(Box::new(config.clone()));
                layer.moe = Some(moe.with_config(config)?);
            }
        }
        Ok(self)
    }

    /// Every parameter outside the MoE layers under its Hugging Face name: the projections
    /// (`Linear`s, stored `[out, in]`), the norms, and the embedding.
    pub fn hf_parts(&self) -> HfParts<'_, B> {
        let root = &self.config.hf_root;
        let mut parts = NamedParts::default();
        parts.norm(format!("{root}norm"), &self.norm);
        for (i, layer) in self.layers.iter().enumerate() {
            parts.extend(layer.hf_parts(&format!("{root}layers.{i}")));
        }
        if let Some(head) = &self.lm_head {
            parts.linears.push((self.config.lm_head_name(), head));
        }
        HfParts {
            parts,
            embedding: (format!("{root}embed_tokens.weight"), &self.embed.weight),
        }
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing after a training step: every MoE layer
    /// with a score bias moves it by `gamma · sign(mean_load − load[e])`
    /// ([`MoeLayer::balance_score_bias`]), `loads` holding one load per MoE layer in layer
    /// order (as [`LmOutput::routed_per_expert`]; with data-parallel replicas set
    /// ([`set_replicas`](Self::set_replicas)) that is the world's load, the same on every
    /// replica, so all move alike). Returns how many layers moved.
    ///
    /// # Errors
    /// [`MoeError::Config`](mpipemoe::MoeError::Config) naming `score_bias` if no MoE layer
    /// has one (the model's family does not balance this way) or `gamma` is not a finite
    /// number ≥ 0; [`MoeError::Input`](mpipemoe::MoeError::Input) if `loads` has not one load
    /// per MoE layer.
    pub fn balance_score_biases(&mut self, loads: &[Vec<usize>], gamma: f64) -> Result<usize> {
        let n_moe = self.layers.iter().filter(|l| l.moe.is_some()).count();
        if loads.len() != n_moe {
            return Err(mpipemoe::MoeError::Input(format!(
                "score bias balancing: {} loads for {n_moe} MoE layers",
                loads.len()
            )));
        }
        let biased = self.moe_layers().filter(|(_, m)| m.config().score_bias).count();
        if biased == 0 {
            return Err(mpipemoe::MoeError::config(
                "score_bias",
                "no MoE layer of this model has a score bias to balance (DeepSeek-V3's \
                 e_score_correction_bias)",
            ));
        }
        let moes = self.layers.iter_mut().filter_map(|l| l.moe.as_mut());
        for (moe, load) in moes.zip(loads) {
            if moe.config().score_bias {
                moe.balance_score_bias(load, gamma)?;
            }
        }
        Ok(biased)
    }

    /// Every MoE layer's data-parallel replicas ([`MoeLayer::set_replicas`]): under expert ×
    /// data parallelism, pass `ParallelGroups::expert_data`, so that the losses and the
    /// per-expert loads are the world's batch's, not one replica's.
    pub fn set_replicas(&mut self, replicas: &Arc<dyn Communicator>) {
        for moe in self.layers.iter_mut().filter_map(|l| l.moe.as_mut()) {
            moe.set_replicas(replicas.clone());
        }
    }

    /// The MoE layers, with their decoder-layer index.
    pub fn moe_layers(&self) -> impl Iterator<Item = (usize, &MoeLayer<B>)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.moe.as_ref().map(|m| (i, m)))
    }
}

/// The router load-balancing loss across the MoE layers, as transformers takes it
/// (`load_balancing_loss_func`, added as `router_aux_loss_coef · aux_loss`): with `L` MoE layers
/// and `T` tokens in the world's batch, `F_e = Σ_l routed_l[e] / (L·T)` (the fraction of every
/// layer's rows routed to `e`, summed over the top-k choices) and
/// `P_e = Σ_l Σ_t softmax_l(t)[e] / (L·T)` (the mean router probability over every layer's
/// rows), the loss is `n_experts · Σ_e F_e · P_e`, each layer's `P` part weighted by its
/// coefficient. This rank's share: its own tokens' softmax sums (the ranks' shares add up to
/// the loss). Zero when every coefficient is. Not the sum of each layer's own loss, which takes
/// the two means per layer.
fn balance_loss<B: Backend>(layers: &[crate::layer::BalanceTerms<B>], device: &B::Device) -> Tensor<B, 1> {
    let zero = || Tensor::zeros([1], device);
    if layers.iter().all(|l| l.coef == 0.0) {
        return zero();
    }
    let n_layers = layers.len() as f64;
    let n_tokens = layers.iter().map(|l| l.n_tokens_world).max().unwrap_or(0);
    let n_experts = layers[0].routed.len();
    if n_tokens == 0 || layers.iter().any(|l| l.routed.len() != n_experts) {
        return zero();
    }
    let scale = n_layers * n_tokens as f64;
    let fraction: Vec<f64> = (0..n_experts)
        .map(|e| layers.iter().map(|l| l.routed[e] as f64).sum::<f64>() / scale)
        .collect();
    let fraction = Tensor::<B, 1>::from_data(
        burn::tensor::TensorData::new(fraction, [n_experts]).convert::<B::FloatElem>(),
        device,
    );
    let weighted = layers
        .iter()
        .map(|l| l.softmax_sum.clone() * l.coef)
        .reduce(|a, b| a + b)
        .expect("at least one layer");
    (weighted * fraction).sum() * (n_experts as f64 / scale)
}

impl<B: Backend> MoeCausalLm<B> {
    /// Checks token ids from outside (a prompt, `logits --ids`) before they reach the model:
    /// every id inside the vocabulary (the embedding would index out of its table), and the
    /// `ids.len()` tokens plus `new_tokens` more within the model's positions
    /// ([`DecoderConfig::max_positions`]), so that an over-long request is refused up front
    /// rather than after minutes of work or on a `[seq, seq]` allocation. `try_forward` reads
    /// no ids back from the device, so callers with ids from strangers check them here.
    ///
    /// # Errors
    /// [`MoeError::Input`](mpipemoe::MoeError::Input) naming the first id outside the
    /// vocabulary, or the positions asked for and the model's `max_position_embeddings`; an
    /// empty `ids`.
    pub fn check_ids(&self, ids: &[usize], new_tokens: usize) -> Result<()> {
        if ids.is_empty() {
            return Err(MoeError::Input("no token ids were given".into()));
        }
        let vocab = self.config.vocab_size;
        if let Some((at, bad)) = ids.iter().enumerate().find(|(_, &id)| id >= vocab) {
            return Err(MoeError::Input(format!(
                "token id {bad} (at {at}) is outside the vocabulary of {vocab}"
            )));
        }
        self.check_positions(0, ids.len().saturating_add(new_tokens))
    }

    /// Refuses `t` tokens from position `start` on where they run past the model's positions.
    fn check_positions(&self, start: usize, t: usize) -> Result<()> {
        match self.config.max_positions {
            Some(max) if start.saturating_add(t) > max => Err(MoeError::Input(format!(
                "{} positions asked for ({start} before, {t} now), over the model's \
                 max_position_embeddings of {max} (config.json)",
                start.saturating_add(t)
            ))),
            _ => Ok(()),
        }
    }
}

impl<B: MoeBackend> MoeCausalLm<B> {
    /// Runs the model on `ids`, continuing `cache` if one is given (columns start at its
    /// `next_position`, and the cache is extended by these tokens). A cache made with
    /// [`KvCache::left_padded`] runs a left-padded batch: its rows' pad columns are hidden
    /// from every query and each row's positions count from its first real token, so each
    /// row's logits are those of its tokens alone (with a capacity factor, the pad tokens
    /// still take the MoE layers' capacity as transformers' layers let them: the families
    /// without one are unaffected).
    ///
    /// # Shapes
    /// - ids: `[batch, seq]`
    /// - logits: `[batch, seq, vocab]`
    ///
    /// # Panics
    /// Where [`try_forward`](Self::try_forward) would return an error.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, cache: Option<&mut KvCache<B>>) -> LmOutput<B> {
        self.try_forward(ids, cache).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`forward`](Self::forward).
    ///
    /// # Errors
    /// As [`MoeLayer::try_forward`] (a peer rank that fails); [`MoeError::Input`](mpipemoe::MoeError::Input)
    /// if a cache of another depth is given, a padded cache for another number of rows or
    /// with a row of padding only, or if the cache's columns and `seq` run past the model's
    /// positions ([`DecoderConfig::max_positions`]). Every id must be inside the
    /// vocabulary: ids from outside are checked with [`check_ids`](Self::check_ids) first.
    pub fn try_forward(&self, ids: Tensor<B, 2, Int>, cache: Option<&mut KvCache<B>>) -> Result<LmOutput<B>> {
        self.forward_logits(ids, cache, Logits::All)
    }

    /// [`try_forward`](Self::try_forward) with the logits of each row's last token only
    /// (`[batch, 1, vocab]`), as transformers' `generate` asks for them (`logits_to_keep=1`):
    /// a prefill's other positions skip the final norm and the output projection.
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward).
    pub fn try_forward_last(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: Option<&mut KvCache<B>>,
    ) -> Result<LmOutput<B>> {
        self.forward_logits(ids, cache, Logits::Last)
    }

    /// Where the dense products (attention, dense MLPs, the head) multiply: as the MoE layers'
    /// own dense products do, through their communicator's device library at their GEMM
    /// precision where it offers one (cuBLAS on CUDA), the backend's product otherwise. Every
    /// MoE layer of a model shares one communicator and precision (`map_moe_configs` sets
    /// them alike); a model without MoE layers multiplies on the backend.
    fn dense_products(&self) -> DenseProducts {
        self.layers
            .iter()
            .find_map(|l| l.moe.as_ref())
            .map_or_else(DenseProducts::backend, |moe| {
                DenseProducts::of::<B>(moe.context().comm(), moe.config().gemm_precision)
            })
    }

    fn forward_logits(
        &self,
        ids: Tensor<B, 2, Int>,
        mut cache: Option<&mut KvCache<B>>,
        keep: Logits,
    ) -> Result<LmOutput<B>> {
        let device = ids.device();
        let [batch, t] = ids.dims();
        if let Some(c) = &cache {
            if c.layers.len() != self.layers.len() {
                return Err(mpipemoe::MoeError::Input(format!(
                    "a cache of {} layers for a model of {}",
                    c.layers.len(),
                    self.layers.len()
                )));
            }
        }
        let start = cache.as_ref().map_or(0, |c| c.next_position);
        let pads = cache.as_ref().map_or(&[][..], |c| &c.pads[..]);
        check_pads(pads, batch, start + t)?;
        self.check_positions(start, t)?;
        let places = Places::new(start..start + t, pads);
        let rotary = Rotary::scaled(
            self.config.head_dim,
            self.config.rope_theta,
            self.config.rope_scaling,
        );
        let (cos, sin) = rotary.tables::<B>(&places.positions(), &device);
        let dense = self.dense_products();
        let mut hidden = self.embed.forward(ids);
        let mut z = Tensor::zeros([1], &device);
        let mut balance = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            // Taken out of the cache, so that the layer's step writes into storage no one else
            // holds (`LayerCache::extend`).
            let cached = cache
                .as_mut()
                .map_or((None, 0), |c| (c.layers[i].take(), c.reserve));
            let out = layer.forward(hidden, &places, (&cos, &sin), cached, &dense)?;
            hidden = out.hidden;
            balance.extend(out.balance);
            if let Some(zl) = out.z_loss {
                z = z + zl;
            }
            if let Some(c) = cache.as_mut() {
                // What a later query can still see; a forward without a cache keeps nothing
                // and trims nothing (each trim is a copy of the kept entries, recorded under
                // autodiff in training).
                c.layers[i] = Some(layer.kept(out.cache, places.pads()));
            }
        }
        if let Some(c) = cache {
            c.next_position = start + t;
        }
        let hidden = match keep {
            Logits::All => hidden,
            Logits::Last => {
                let [b, _, d] = hidden.dims();
                hidden.slice([0..b, t - 1..t, 0..d])
            }
        };
        let hidden = self.norm.forward(hidden);
        let logits = match &self.lm_head {
            Some(head) => dense.linear(head, hidden)?,
            // Tied to the embedding: `Eᵀ` as a transposed view, which Flex's row product reads
            // in place (burn's matmul copied it whole in each forward).
            None => dense.matmul(hidden, self.embed.weight.val().transpose())?,
        };
        Ok(LmOutput {
            logits,
            aux_loss: balance_loss(&balance, &device),
            z_loss: z,
            routed_per_expert: balance.into_iter().map(|terms| terms.routed).collect(),
        })
    }

    /// The causal language-modelling loss of `ids`: the mean cross-entropy of predicting
    /// token `t + 1` from the tokens up to `t`, over every row and position (as transformers'
    /// `ForCausalLMLoss` with `labels = ids`), and the MoE layers' losses beside it (add them
    /// to train with them).
    ///
    /// # Shapes
    /// - ids: `[batch, seq]` with `seq ≥ 2`
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward); [`MoeError::Input`](mpipemoe::MoeError::Input)
    /// if `seq < 2`.
    pub fn loss(&self, ids: Tensor<B, 2, Int>) -> Result<(Tensor<B, 1>, LmOutput<B>)> {
        let [b, t] = ids.dims();
        if t < 2 {
            return Err(mpipemoe::MoeError::Input(format!(
                "a loss needs at least 2 tokens a row, got {t}"
            )));
        }
        let out = self.try_forward(ids.clone(), None)?;
        let v = self.config.vocab_size;
        // Every position's logits in place, the last of each row ignored (target −1), rather
        // than a sliced copy of the others: the same mean over `b · (t − 1)` tokens.
        let logits = out.logits.clone().reshape([b * t, v]);
        let last = Tensor::<B, 2, Int>::full([b, 1], -1, &ids.device());
        let targets = Tensor::cat(vec![ids.slice([0..b, 1..t]), last], 1).reshape([b * t]);
        let loss = cross_entropy(logits, targets);
        Ok((loss, out))
    }
}

/// Which positions' logits a forward computes.
#[derive(Debug, Clone, Copy)]
enum Logits {
    All,
    Last,
}

/// Refuses left padding that does not fit a batch of `batch` rows whose cache will hold
/// `columns` columns: one count per row, and every row with a real token.
fn check_pads(pads: &[usize], batch: usize, columns: usize) -> Result<()> {
    if pads.is_empty() {
        return Ok(());
    }
    if pads.len() != batch {
        return Err(MoeError::Input(format!(
            "a cache padded for {} rows, given a batch of {batch}",
            pads.len()
        )));
    }
    match pads.iter().position(|&p| p >= columns) {
        Some(r) => Err(MoeError::Input(format!(
            "row {r} is padding only ({} pad columns of {columns})",
            pads[r]
        ))),
        None => Ok(()),
    }
}

/// `Param` of a `Linear` weight from a stored `[out, in]` matrix: burn's `Linear` holds
/// `[in, out]`.
pub(crate) fn linear_weight<B: Backend>(stored: Tensor<B, 2>) -> Param<Tensor<B, 2>> {
    // In a row-major buffer of its own, not as a transposed view of the stored matrix: Flex
    // copies a strided operand to a contiguous one in every product, forward and backward
    // (`FlexTensor::to_contiguous` took 48% of a 163 M-parameter model's generation before).
    let device = stored.device();
    Param::from_tensor(Tensor::from_data(stored.transpose().into_data(), &device))
}
