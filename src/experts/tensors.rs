//! The experts as the exchange op takes them: stacked weights and biases as backend
//! primitives, with any low-rank adapters beside them, and their gradients.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// The expert tensors of one exchange, in the order of the op's per-part tables (the running
/// gradient sums, the shadows' broadcasts and folds, the autodiff node's parents).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    /// The first GEMM's weights.
    WIn = 0,
    /// The first GEMM's bias.
    BIn = 1,
    /// The second GEMM's weights.
    WOut = 2,
    /// The second GEMM's bias.
    BOut = 3,
    /// The input-side factor of the first GEMM's adapter.
    LoraInA = 4,
    /// The output-side factor of the first GEMM's adapter.
    LoraInB = 5,
    /// The input-side factor of the second GEMM's adapter.
    LoraOutA = 6,
    /// The output-side factor of the second GEMM's adapter.
    LoraOutB = 7,
}

/// How many [`ExpertPart`]s there are.
pub const EXPERT_PARTS: usize = 8;

impl ExpertPart {
    /// Every part, in table order.
    pub const ALL: [ExpertPart; EXPERT_PARTS] = [
        ExpertPart::WIn,
        ExpertPart::BIn,
        ExpertPart::WOut,
        ExpertPart::BOut,
        ExpertPart::LoraInA,
        ExpertPart::LoraInB,
        ExpertPart::LoraOutA,
        ExpertPart::LoraOutB,
    ];

    /// Whether the part is a weight or an adapter factor (`[n, rows, cols]`), not a bias
    /// (`[n, cols]`).
    pub fn is_matrix(self) -> bool {
        !matches!(self, ExpertPart::BIn | ExpertPart::BOut)
    }
}

/// A low-rank adapter on one stacked weight `w [n, rows, cols]`, as the exchange op takes it:
/// the experts run `x · w[e] + scale · (x · a[e]) · b[e]`, without `w + scale · a · b` ever
/// being built, and their backward gives the factors' gradients without the weight's.
///
/// # Shapes
/// - a: `[n, rows, rank]`
/// - b: `[n, rank, cols]`
#[derive(Debug, Clone)]
pub struct LowRankTensors<B: Backend> {
    /// The input side's factor.
    pub a: FloatTensor<B>,
    /// The output side's factor.
    pub b: FloatTensor<B>,
    /// The factor on the adapter's product (`alpha / r`, or rsLoRA's `alpha / sqrt(r)`).
    pub scale: f64,
}

/// The expert weights as backend primitives, the form the exchange op takes.
#[derive(Debug, Clone)]
pub struct ExpertTensors<B: Backend> {
    /// `[n_local_experts, d_model, d_inner]`
    pub w_in: FloatTensor<B>,
    /// `[n_local_experts, d_inner]`
    pub b_in: Option<FloatTensor<B>>,
    /// `[n_local_experts, d_hidden, d_model]`
    pub w_out: FloatTensor<B>,
    /// `[n_local_experts, d_model]`
    pub b_out: Option<FloatTensor<B>>,
    /// An adapter on `w_in`: a `[n_local_experts, d_model, rank]`, b `[n_local_experts, rank, d_inner]`.
    pub lora_in: Option<LowRankTensors<B>>,
    /// An adapter on `w_out`: a `[n_local_experts, d_hidden, rank]`, b `[n_local_experts, rank, d_model]`.
    pub lora_out: Option<LowRankTensors<B>>,
}

impl<B: Backend> ExpertTensors<B> {
    /// The experts without adapters.
    pub fn plain(
        w_in: FloatTensor<B>,
        b_in: Option<FloatTensor<B>>,
        w_out: FloatTensor<B>,
        b_out: Option<FloatTensor<B>>,
    ) -> Self {
        Self {
            w_in,
            b_in,
            w_out,
            b_out,
            lora_in: None,
            lora_out: None,
        }
    }

    /// Every tensor through `f`: how a wrapping backend (autodiff, fusion) hands the experts to
    /// its inner backend and the gradients back.
    pub fn map<C: Backend>(self, mut f: impl FnMut(FloatTensor<B>) -> FloatTensor<C>) -> ExpertTensors<C> {
        let result: Result<_, std::convert::Infallible> = self.try_map(|t| Ok(f(t)));
        match result {
            Ok(mapped) => mapped,
            Err(never) => match never {},
        }
    }

    /// Every tensor through the fallible `f`, in table order ([`ExpertPart::ALL`]), stopping
    /// at the first error.
    pub fn try_map<C: Backend, E>(
        self,
        mut f: impl FnMut(FloatTensor<B>) -> Result<FloatTensor<C>, E>,
    ) -> Result<ExpertTensors<C>, E> {
        fn low_rank<B: Backend, C: Backend, E>(
            l: Option<LowRankTensors<B>>,
            f: &mut impl FnMut(FloatTensor<B>) -> Result<FloatTensor<C>, E>,
        ) -> Result<Option<LowRankTensors<C>>, E> {
            l.map(|l| {
                Ok(LowRankTensors {
                    a: f(l.a)?,
                    b: f(l.b)?,
                    scale: l.scale,
                })
            })
            .transpose()
        }
        // Weights and biases first, then the adapters: the table order, which every rank's
        // collectives over the parts follow.
        let w_in = f(self.w_in)?;
        let b_in = self.b_in.map(&mut f).transpose()?;
        let w_out = f(self.w_out)?;
        let b_out = self.b_out.map(&mut f).transpose()?;
        let lora_in = low_rank(self.lora_in, &mut f)?;
        let lora_out = low_rank(self.lora_out, &mut f)?;
        Ok(ExpertTensors {
            w_in,
            b_in,
            w_out,
            b_out,
            lora_in,
            lora_out,
        })
    }

    /// Whether any adapter runs beside the weights.
    pub fn has_adapters(&self) -> bool {
        self.lora_in.is_some() || self.lora_out.is_some()
    }

    /// Part `part`, borrowed; `None` where the experts have no such part.
    pub(crate) fn part(&self, part: ExpertPart) -> Option<&FloatTensor<B>> {
        match part {
            ExpertPart::WIn => Some(&self.w_in),
            ExpertPart::BIn => self.b_in.as_ref(),
            ExpertPart::WOut => Some(&self.w_out),
            ExpertPart::BOut => self.b_out.as_ref(),
            ExpertPart::LoraInA => self.lora_in.as_ref().map(|l| &l.a),
            ExpertPart::LoraInB => self.lora_in.as_ref().map(|l| &l.b),
            ExpertPart::LoraOutA => self.lora_out.as_ref().map(|l| &l.a),
            ExpertPart::LoraOutB => self.lora_out.as_ref().map(|l| &l.b),
        }
    }

    /// Every tensor by [`ExpertPart`], `None` where the experts have no such part: the order
    /// of the exchange's per-part tables.
    pub(crate) fn into_parts(self) -> [Option<FloatTensor<B>>; EXPERT_PARTS] {
        let split = |l: Option<LowRankTensors<B>>| match l {
            Some(l) => (Some(l.a), Some(l.b)),
            None => (None, None),
        };
        let (in_a, in_b) = split(self.lora_in);
        let (out_a, out_b) = split(self.lora_out);
        [
            Some(self.w_in),
            self.b_in,
            Some(self.w_out),
            self.b_out,
            in_a,
            in_b,
            out_a,
            out_b,
        ]
    }

    /// The inverse of [`into_parts`](Self::into_parts), with the adapters' scales of `like`.
    ///
    /// # Panics
    /// If a weight is missing, or an adapter has one factor without the other (parts taken
    /// from experts shaped like `like` have neither gap).
    pub(crate) fn from_parts(parts: [Option<FloatTensor<B>>; EXPERT_PARTS], like: &Self) -> Self {
        let [w_in, b_in, w_out, b_out, in_a, in_b, out_a, out_b] = parts;
        let pair =
            |a: Option<FloatTensor<B>>, b: Option<FloatTensor<B>>, l: &Option<LowRankTensors<B>>| match (
                a, b, l,
            ) {
                (Some(a), Some(b), Some(l)) => Some(LowRankTensors { a, b, scale: l.scale }),
                (None, None, _) => None,
                _ => panic!("an adapter's parts disagree with the experts they were taken from"),
            };
        Self {
            w_in: w_in.expect("the experts' first weights"),
            b_in,
            w_out: w_out.expect("the experts' second weights"),
            b_out,
            lora_in: pair(in_a, in_b, &like.lora_in),
            lora_out: pair(out_a, out_b, &like.lora_out),
        }
    }
}

/// Gradients of the exchange op's expert tensors, by [`ExpertPart`]: `None` for a part the
/// experts do not have, or one the run marks frozen ([`ExchangeRun::frozen`]), whose gradient
/// is never computed.
///
/// [`ExchangeRun::frozen`]: crate::backend::ExchangeRun::frozen
#[derive(Debug, Clone)]
pub struct ExpertGrads<B: Backend> {
    /// Each part's gradient, shaped like the part, indexed by [`ExpertPart`].
    pub parts: [Option<FloatTensor<B>>; EXPERT_PARTS],
}

impl<B: Backend> ExpertGrads<B> {
    /// Part `part`'s gradient.
    pub fn get(&self, part: ExpertPart) -> Option<&FloatTensor<B>> {
        self.parts[part as usize].as_ref()
    }

    /// Part `part`'s gradient, taken out.
    pub fn take(&mut self, part: ExpertPart) -> Option<FloatTensor<B>> {
        self.parts[part as usize].take()
    }

    /// Every gradient through `f`.
    pub fn map<C: Backend>(self, mut f: impl FnMut(FloatTensor<B>) -> FloatTensor<C>) -> ExpertGrads<C> {
        ExpertGrads {
            parts: self.parts.map(|p| p.map(&mut f)),
        }
    }
}

impl<B: Backend> From<ExpertTensors<B>> for ExpertGrads<B> {
    /// Gradients held as tensors shaped like the experts (a device library's stacked sums).
    fn from(grads: ExpertTensors<B>) -> Self {
        Self {
            parts: grads.into_parts(),
        }
    }
}
