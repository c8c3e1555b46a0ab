//! A small decoder-only transformer whose FFNs are `MoeLayer`s.

use burn::config::Config;
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::attention::{
    generate_autoregressive_mask, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::parallel::ParallelGroups;
use mpipemoe::{seeded_uniform, MoeBackend, MoeLayer, MoeLayerConfig, MoeStats};

/// Shape of the toy GPT-MoE.
#[derive(Config, Debug)]
pub struct GptMoeConfig {
    /// Byte-level vocabulary.
    #[config(default = 256)]
    pub vocab: usize,
    /// Context length.
    #[config(default = 64)]
    pub seq_len: usize,
    /// Model width.
    #[config(default = 64)]
    pub d_model: usize,
    /// Attention heads.
    #[config(default = 4)]
    pub n_heads: usize,
    /// Transformer blocks.
    #[config(default = 2)]
    pub n_layers: usize,
    /// Experts per MoE layer (over all ranks).
    #[config(default = 4)]
    pub n_experts: usize,
    /// Experts per token.
    #[config(default = 2)]
    pub top_k: usize,
    /// Expert hidden width.
    #[config(default = 128)]
    pub d_hidden: usize,
    /// Load-balancing loss weight.
    #[config(default = 0.01)]
    pub aux_loss_coef: f64,
    /// Router z-loss weight.
    #[config(default = 0.001)]
    pub z_loss_coef: f64,
}

/// One pre-norm block: attention, then the MoE layer in place of the FFN.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    norm_attn: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    norm_moe: LayerNorm<B>,
    /// The MoE layer.
    pub moe: MoeLayer<B>,
}

/// The model: token and position embeddings, blocks, final norm, LM head.
#[derive(Module, Debug)]
pub struct GptMoe<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    /// The blocks.
    pub blocks: Vec<Block<B>>,
    norm: LayerNorm<B>,
    head: Linear<B>,
}

/// What a forward pass returns besides the logits.
pub struct Forward<B: Backend> {
    /// `[batch, seq, vocab]`
    pub logits: Tensor<B, 3>,
    /// Sum of the MoE layers' auxiliary and z-loss shares. `[1]`
    pub aux: Tensor<B, 1>,
    /// Per MoE layer.
    pub stats: Vec<MoeStats>,
}

impl GptMoeConfig {
    /// This rank's replica: every non-MoE parameter drawn from a stream keyed by (seed, its
    /// path), so replicas are identical on every rank and for every rank count; the MoE layers
    /// initialise their own experts per expert in the same way.
    pub fn init<B: Backend>(
        &self,
        moe: &MoeLayerConfig,
        seed: u64,
        device: &B::Device,
        groups: &ParallelGroups,
    ) -> mpipemoe::Result<GptMoe<B>> {
        let blocks = (0..self.n_layers)
            .map(|i| {
                let layer_moe = moe.clone().with_seed(seed.wrapping_add(1000 + i as u64));
                Ok(Block {
                    norm_attn: LayerNormConfig::new(self.d_model).init(device),
                    attn: MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
                        .with_dropout(0.0)
                        .init(device),
                    norm_moe: LayerNormConfig::new(self.d_model).init(device),
                    moe: layer_moe.init_groups(device, groups)?,
                })
            })
            .collect::<mpipemoe::Result<Vec<_>>>()?;
        let model = GptMoe {
            tokens: EmbeddingConfig::new(self.vocab, self.d_model).init(device),
            positions: EmbeddingConfig::new(self.seq_len, self.d_model).init(device),
            blocks,
            norm: LayerNormConfig::new(self.d_model).init(device),
            head: LinearConfig::new(self.d_model, self.vocab).init(device),
        };
        Ok(model.map(&mut SeededInit {
            seed,
            path: Vec::new(),
        }))
    }

    /// The MoE layer config this model uses.
    pub fn moe(&self) -> MoeLayerConfig {
        MoeLayerConfig::new(self.d_model, self.d_hidden, self.n_experts, self.top_k)
            .with_aux_loss_coef(self.aux_loss_coef)
            .with_z_loss_coef(self.z_loss_coef)
    }
}

/// Re-initialises every parameter outside the MoE layers from the seeded host stream:
/// weights uniform in ±1/sqrt(fan_in), LayerNorm gains 1, biases and LayerNorm shifts 0.
struct SeededInit {
    seed: u64,
    path: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for SeededInit {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if self.path.iter().any(|p| p == "moe") {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let dims = tensor.dims();
        let count: usize = dims.iter().product();
        let key = self.path.join(".");
        let values = match self.path.last().map(String::as_str) {
            Some("gamma") => vec![1.0f32; count],
            Some("beta") | Some("bias") => vec![0.0f32; count],
            _ => seeded_uniform(self.seed, &key, count, 1.0 / (dims[0] as f64).sqrt()),
        };
        let data = TensorData::new(values, dims).convert::<B::FloatElem>();
        let fresh = Tensor::<B, D>::from_data(data, &tensor.device()).require_grad();
        Param::from_mapped_value(id, fresh, mapper)
    }
}

impl<B: MoeBackend> GptMoe<B> {
    /// # Shapes
    /// - tokens: `[batch, seq]` → logits `[batch, seq, vocab]`
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> mpipemoe::Result<Forward<B>> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let mut h = self.tokens.forward(tokens) + self.positions.forward(positions);
        let mask = generate_autoregressive_mask::<B>(batch, seq, &device);
        let mut aux = Tensor::zeros([1], &device);
        let mut stats = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let attended = block
                .attn
                .forward(MhaInput::self_attn(block.norm_attn.forward(h.clone())).mask_attn(mask.clone()))
                .context;
            h = h + attended;
            let moe = block.moe.try_forward(block.norm_moe.forward(h.clone()))?;
            h = h + moe.output;
            aux = aux + moe.aux_loss + moe.z_loss;
            stats.push(moe.stats);
        }
        Ok(Forward {
            logits: self.head.forward(self.norm.forward(h)),
            aux,
            stats,
        })
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing on every MoE layer, from this step's
    /// global per-expert load (`stats`, one per layer, as `forward` returned them).
    pub fn balance_score_bias(&mut self, stats: &[MoeStats], gamma: f64) -> mpipemoe::Result<()> {
        for (block, stats) in self.blocks.iter_mut().zip(stats) {
            block
                .moe
                .balance_score_bias(&stats.routing.routed_per_expert, gamma)?;
        }
        Ok(())
    }
}

/// Sum over the batch's tokens of the cross-entropy of predicting `targets`. `[1]`
///
/// # Shapes
/// - logits: `[batch, seq, vocab]`, targets: `[batch, seq]`
pub fn cross_entropy_sum<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, s, v] = logits.dims();
    let log_probs = burn::tensor::activation::log_softmax(logits.reshape([b * s, v]), 1);
    log_probs.gather(1, targets.reshape([b * s, 1])).sum().neg()
}
