//! The model flags `plan` and `simulate` share.

use clap::{Args, ValueEnum};
use mpipemoe::memory::LayerShape;
use mpipemoe::Activation;
use mpipemoe_tools::flags::count;

/// The paper's Table I shapes (64 experts each), in any case (`GPT3-S` as the paper writes it).
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum Preset {
    /// MoE-GPT3-S: d_model 768, d_hidden 3072.
    Gpt3S,
    /// MoE-GPT3-XL: d_model 2048, d_hidden 8192.
    Gpt3Xl,
    /// MoE-BERT-L: d_model 1024, d_hidden 4096.
    BertL,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct ShapeArgs {
    /// A Table I model (sets d-model, d-hidden and 64 experts).
    #[arg(long, value_enum, ignore_case = true)]
    pub preset: Option<Preset>,
    /// Token width M (without --preset; 1..=1048576).
    #[arg(long, value_parser = count(1, 1 << 20))]
    pub d_model: Option<usize>,
    /// Expert hidden width H (without --preset; 1..=4194304).
    #[arg(long, value_parser = count(1, 1 << 22))]
    pub d_hidden: Option<usize>,
    /// Experts E over all GPUs (without --preset; 1..=1048576).
    #[arg(long, value_parser = count(1, 1 << 20))]
    pub experts: Option<usize>,
    /// Tokens B per GPU (1..=2^32).
    #[arg(long, default_value_t = 8192, value_parser = count(1, 1 << 32))]
    pub tokens: usize,
    /// GPUs N (1..=4096).
    #[arg(long, default_value_t = 8, value_parser = count(1, 4096))]
    pub gpus: usize,
    /// Experts per token (the paper's k = 1; at most --experts).
    #[arg(long, default_value_t = 1, value_parser = count(1, 1024))]
    pub top_k: usize,
    /// Element type.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    pub dtype: Dtype,
    /// The experts' activation (SwiGLU doubles the first GEMM's width).
    #[arg(long, value_parser = parse_activation, default_value = "gelu")]
    pub activation: Activation,
    /// The shared expert's hidden width: a SwiGLU on every token beside the routed experts,
    /// as DeepSeek's and Qwen2-MoE's layers have (1..=4194304). The implementation's peaks
    /// count it; the paper's terms, which have none, do not.
    #[arg(long, value_parser = count(1, 1 << 22))]
    pub shared_expert: Option<usize>,
    /// The shared expert issued while the routing read is in flight
    /// (`shared_expert_overlap`): what it keeps is then live through the exchange's forward.
    #[arg(long, requires = "shared_expert")]
    pub shared_expert_overlap: bool,
    /// The shared expert without a sigmoid gate on its output, as DeepSeek's are (Qwen2-MoE's
    /// is gated, the layer's default): autodiff then keeps neither the output before the gate
    /// nor the gate's scores, `tokens · (d_model + 1)` values less.
    #[arg(long, requires = "shared_expert")]
    pub shared_expert_ungated: bool,
}

/// The partition counts `plan --budget` chooses from when `--partitions` is not given, and
/// `simulate` sweeps.
pub const PARTITION_CANDIDATES: [usize; 5] = [1, 2, 4, 8, 16];

/// The most (partition, expert of a GPU) pairs a shape may ask the models to replay.
const MAX_PAIRS: usize = 1 << 20;

fn parse_activation(s: &str) -> Result<Activation, String> {
    Activation::parse(s).ok_or_else(|| format!("{s:?} is not gelu, relu or swiglu"))
}

impl ShapeArgs {
    /// The layer shape, or a one-line error naming the missing or bad flag.
    pub fn shape(&self, n_partitions: usize) -> Result<LayerShape, String> {
        let (m, h, e) = match self.preset {
            Some(Preset::Gpt3S) => (768, 3072, 64),
            Some(Preset::Gpt3Xl) => (2048, 8192, 64),
            Some(Preset::BertL) => (1024, 4096, 64),
            None => (
                self.d_model.ok_or("give --preset or --d-model")?,
                self.d_hidden.ok_or("give --preset or --d-hidden")?,
                self.experts.ok_or("give --preset or --experts")?,
            ),
        };
        let m = self.d_model.unwrap_or(m);
        let h = self.d_hidden.unwrap_or(h);
        let e = self.experts.unwrap_or(e);
        for (flag, v) in [
            ("--d-model", m),
            ("--d-hidden", h),
            ("--experts", e),
            ("--gpus", self.gpus),
            ("--top-k", self.top_k),
            ("--partitions", n_partitions),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.top_k > e {
            return Err(format!("--top-k {} is more than the {e} experts", self.top_k));
        }
        if !e.is_multiple_of(self.gpus) {
            return Err(format!(
                "--experts {e} cannot be split evenly over --gpus {}",
                self.gpus
            ));
        }
        // The models replay each partition's rows expert by expert: one entry, and a few
        // steps, per (partition, expert of a GPU). Bounded at the larger of the given count
        // and the largest candidate the budget and the simulator choose among, before anything
        // is built from it: 1M experts over 4,096 partitions asked for 32 GB.
        let local = e / self.gpus;
        let largest_n = n_partitions.max(PARTITION_CANDIDATES[PARTITION_CANDIDATES.len() - 1]);
        if local.saturating_mul(largest_n) > MAX_PAIRS {
            return Err(format!(
                "--experts {e} over --gpus {} is {local} experts per GPU, which at {largest_n} partitions is more than the {MAX_PAIRS} (partition, expert) pairs the models replay: give fewer experts per GPU (or plan fewer --partitions)",
                self.gpus
            ));
        }
        Ok(LayerShape {
            tokens: self.tokens,
            top_k: self.top_k,
            d_model: m,
            d_hidden: h,
            activation: self.activation,
            shared_expert: self.shared_expert,
            shared_expert_gate: !self.shared_expert_ungated,
            shared_expert_overlap: self.shared_expert_overlap,
            weights_on_input: false,
            n_experts: e,
            n_ranks: self.gpus,
            n_partitions,
        })
    }
}
