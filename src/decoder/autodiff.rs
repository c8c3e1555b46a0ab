//! RMSNorm under `Autodiff<B>`: one node over the inner backend's norm whose backward is the
//! inner backend's [`DecoderKernels::rms_norm_backward`], where the inner backend has a kernel
//! each way ([`DecoderKernels::rms_norm_node`]); burn's ops recorded one by one elsewhere, as
//! before. Attention's weights likewise ([`DecoderKernels::attention_softmax_node`]): one node
//! whose backward reads the weights it wrote (with GPT-OSS's sinks, one node over the scores
//! and the sinks that reads the sinks' shares too); and the rotary embedding
//! ([`DecoderKernels::rotary_node`]): one node whose backward is the rotation's transpose, the
//! tables constants (a rotation whose tables are tracked is recorded composed, so that their
//! gradient is not lost); and the dense blocks' SwiGLU ([`DecoderKernels::gated_silu_node`]):
//! one node that keeps its input, from which the derivative recomputes `σ(gate)`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{BoolTensor, FloatTensor};

use super::gated::gated_silu_pair_composed;
use super::softmax::{attention_softmax_composed, attention_softmax_sinks_composed};
use super::TailRotation;
use super::{latent_keys_composed, latent_values_composed, rms_norm_columns_sliced};
use super::{
    rms_norm_composed, rotate_half_seq_major_composed, rotate_pairs_seq_major_composed,
    rotate_tail_to_heads_composed, rotate_to_heads_composed, DecoderKernels,
};

/// The backward of the norm: of whole rows ([`DecoderKernels::rms_norm`]), or of each row's
/// first values of a wider `x` (`columns`: [`DecoderKernels::rms_norm_columns`], `x`'s gradient
/// then over its whole width).
#[derive(Debug)]
struct RmsNormBackward {
    columns: bool,
}

/// What the backward reads: the norm's input and weight (both gradients need both; the inverse
/// root is recomputed from the input).
#[derive(Debug, Clone)]
struct RmsNormState<B: DecoderKernels> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
}

impl<B: DecoderKernels> Backward<B, 2> for RmsNormBackward {
    type State = RmsNormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let RmsNormState { x, weight, eps } = ops.state;
        let [x_parent, weight_parent] = ops.parents;
        if x_parent.is_none() && weight_parent.is_none() {
            return;
        }
        // An untracked weight (frozen, or a constant) gets no gradient, so none is computed.
        let weight_grad = weight_parent.is_some();
        let (dx, dweight) = match self.columns {
            true => B::rms_norm_columns_backward(x, weight, grad, eps, weight_grad),
            false => B::rms_norm_backward(x, weight, grad, eps, weight_grad),
        };
        if let Some(parent) = x_parent {
            grads.register::<B>(parent.id, dx);
        }
        if let (Some(parent), Some(dweight)) = (weight_parent, dweight) {
            grads.register::<B>(parent.id, dweight);
        }
    }
}

/// The norm (`columns`: of each row's first values) as one node over the inner backend's op,
/// which the caller has checked has a kernel each way.
fn norm_node<B: DecoderKernels, C: CheckpointStrategy>(
    x: Tracked<B, C>,
    weight: Tracked<B, C>,
    eps: f64,
    columns: bool,
) -> Tracked<B, C> {
    let (xp, wp) = (x.primitive.clone(), weight.primitive.clone());
    let out = match columns {
        true => B::rms_norm_columns(xp, wp, eps),
        false => B::rms_norm(xp, wp, eps),
    };
    let node = RmsNormBackward { columns };
    match node
        .prepare::<C>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            RmsNormState {
                x: x.primitive,
                weight: weight.primitive,
                eps,
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// Which rotation a node records: sequence-major (`rotate_half`, or Llama 4's `pairs`),
/// written head-major (`ToHeads`), or latent attention's ([`DecoderKernels::rotate_tail_to_heads`]).
#[derive(Debug, Clone, Copy)]
enum Rotation {
    SeqMajor { pairs: bool },
    ToHeads { pairs: bool },
    Tail(TailRotation),
}

/// The backward of a rotation: its transpose, of a gradient that is head-major where the
/// forward wrote it so.
#[derive(Debug)]
struct RotaryBackward {
    kind: Rotation,
}

impl<B: DecoderKernels> Backward<B, 1> for RotaryBackward {
    /// The tables: the transpose reads them and nothing else.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        let [Some(parent)] = ops.parents else {
            return;
        };
        let dx = match self.kind {
            Rotation::SeqMajor { pairs } => seq_major_transpose::<B>(grad, cos, sin, pairs),
            // A head-major gradient seen sequence-major: a view the kernels read at its strides.
            Rotation::ToHeads { pairs } => {
                seq_major_transpose::<B>(B::float_swap_dims(grad, 1, 2), cos, sin, pairs)
            }
            Rotation::Tail(form) => B::rotate_tail_to_heads_backward(grad, cos, sin, form),
        };
        grads.register::<B>(parent.id, dx);
    }
}

/// The transpose of the sequence-major rotation (`pairs`: Llama 4's).
fn seq_major_transpose<B: DecoderKernels>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    pairs: bool,
) -> FloatTensor<B> {
    match pairs {
        true => B::rotate_pairs_seq_major_backward(grad, cos, sin),
        false => B::rotate_half_seq_major_backward(grad, cos, sin),
    }
}

/// The backward of latent attention's keys ([`DecoderKernels::latent_keys`]): the expanded
/// product's and the rotary key's gradients from the keys'.
#[derive(Debug)]
struct LatentKeysBackward {
    nope: usize,
    v: usize,
}

impl<B: DecoderKernels> Backward<B, 2> for LatentKeysBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [kv_parent, rot_parent] = ops.parents;
        if kv_parent.is_none() && rot_parent.is_none() {
            return;
        }
        let (dkv, dk_rot) = B::latent_keys_backward(grad, self.nope, self.v);
        if let Some(parent) = kv_parent {
            grads.register::<B>(parent.id, dkv);
        }
        if let Some(parent) = rot_parent {
            grads.register::<B>(parent.id, dk_rot);
        }
    }
}

/// The backward of latent attention's values ([`DecoderKernels::latent_values`]).
#[derive(Debug)]
struct LatentValuesBackward {
    nope: usize,
}

impl<B: DecoderKernels> Backward<B, 1> for LatentValuesBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::latent_values_backward(grad, self.nope));
        }
    }
}

/// The backward of the dense blocks' SwiGLU of two halves given apart
/// ([`DecoderKernels::gated_silu_pair`]).
#[derive(Debug)]
struct GatedSiluPairBackward;

impl<B: DecoderKernels> Backward<B, 2> for GatedSiluPairBackward {
    /// Both halves: the derivative reads them and nothing else.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [gate_parent, up_parent] = ops.parents;
        if gate_parent.is_none() && up_parent.is_none() {
            return;
        }
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::gated_silu_pair_backward(gate, up, grad);
        if let Some(parent) = gate_parent {
            grads.register::<B>(parent.id, d_gate);
        }
        if let Some(parent) = up_parent {
            grads.register::<B>(parent.id, d_up);
        }
    }
}

#[derive(Debug)]
struct GatedSiluBackward;

impl<B: DecoderKernels> Backward<B, 1> for GatedSiluBackward {
    /// The input `[gate | up]`: the derivative reads both halves and nothing else.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::gated_silu_backward(ops.state, grad));
        }
    }
}

/// An autodiff tensor of `Autodiff<B, C>`.
type Tracked<B, C> = FloatTensor<Autodiff<B, C>>;

/// A rotation as one node over the inner backend's where it has a kernel each way and the
/// tables are constants; the operands back where it should be recorded composed.
fn rotation<B: DecoderKernels, C: CheckpointStrategy>(
    x: Tracked<B, C>,
    cos: Tracked<B, C>,
    sin: Tracked<B, C>,
    kind: Rotation,
) -> Result<Tracked<B, C>, [Tracked<B, C>; 3]> {
    let tracked = |t: &Tracked<B, C>| !t.node.requirement.is_none();
    if !B::rotary_node() || tracked(&cos) || tracked(&sin) {
        return Err([x, cos, sin]);
    }
    let (c, s) = (cos.primitive.clone(), sin.primitive.clone());
    let out = match kind {
        Rotation::SeqMajor { pairs: true } => B::rotate_pairs_seq_major(x.primitive, c, s),
        Rotation::SeqMajor { pairs: false } => B::rotate_half_seq_major(x.primitive, c, s),
        Rotation::ToHeads { pairs } => B::rotate_seq_major_to_heads(x.primitive, c, s, pairs),
        Rotation::Tail(form) => B::rotate_tail_to_heads(x.primitive, c, s, form),
    };
    let node = RotaryBackward { kind };
    Ok(match node.prepare::<C>([x.node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((cos.primitive, sin.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    })
}

#[derive(Debug)]
struct AttentionSoftmaxBackward;

impl<B: DecoderKernels> Backward<B, 1> for AttentionSoftmaxBackward {
    /// The weights the forward wrote, and the scale: the backward needs nothing else (a hidden
    /// key's weight is 0, which zeroes its gradient without the mask).
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (probs, scale) = ops.state;
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::attention_softmax_backward(probs, grad, scale));
        }
    }
}

#[derive(Debug)]
struct AttentionSinksBackward;

impl<B: DecoderKernels> Backward<B, 2> for AttentionSinksBackward {
    /// The weights and the sinks' shares the forward wrote, and the scale.
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (probs, sink_probs, scale) = ops.state;
        let [scores_parent, sinks_parent] = ops.parents;
        let (dscores, dsinks) = B::attention_softmax_sinks_backward(probs, sink_probs, grad, scale);
        if let Some(parent) = scores_parent {
            grads.register::<B>(parent.id, dscores);
        }
        if let Some(parent) = sinks_parent {
            grads.register::<B>(parent.id, dsinks);
        }
    }
}

impl<B: DecoderKernels, C: CheckpointStrategy> DecoderKernels for Autodiff<B, C> {
    /// The inner backend's norm as one node where it has a kernel each way; burn's ops,
    /// recorded one by one, elsewhere.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        match B::rms_norm_node() {
            true => norm_node::<B, C>(x, weight, eps, false),
            false => rms_norm_composed::<Self>(x, weight, eps),
        }
    }

    fn rms_norm_node() -> bool {
        B::rms_norm_node()
    }

    /// As the norm: one node over `x` whole and the weight where the inner backend has a
    /// kernel each way; the slice and the norm, recorded, elsewhere.
    fn rms_norm_columns(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        match B::rms_norm_node() {
            true => norm_node::<B, C>(x, weight, eps, true),
            false => rms_norm_columns_sliced::<Self>(x, weight, eps),
        }
    }

    /// The inner backend's rotation as one node where it has a kernel each way and the tables
    /// are constants; burn's ops, recorded one by one, elsewhere.
    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotation::<B, C>(x, cos, sin, Rotation::SeqMajor { pairs: false })
            .unwrap_or_else(|[x, cos, sin]| rotate_half_seq_major_composed::<Self>(x, cos, sin))
    }

    /// As the `rotate_half` form: one node where the inner backend has a kernel each way and
    /// the tables are constants.
    fn rotate_pairs_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotation::<B, C>(x, cos, sin, Rotation::SeqMajor { pairs: true })
            .unwrap_or_else(|[x, cos, sin]| rotate_pairs_seq_major_composed::<Self>(x, cos, sin))
    }

    fn rotary_node() -> bool {
        B::rotary_node()
    }

    /// As the sequence-major forms: one node where the inner backend has a kernel each way and
    /// the tables are constants; elsewhere the rotation (composed) and burn's swap.
    fn rotate_seq_major_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        pairs: bool,
    ) -> FloatTensor<Self> {
        rotation::<B, C>(x, cos, sin, Rotation::ToHeads { pairs })
            .unwrap_or_else(|[x, cos, sin]| rotate_to_heads_composed::<Self>(x, cos, sin, pairs))
    }

    /// As the other rotations: one node where the inner backend has a kernel each way and the
    /// tables are constants; elsewhere composed, recorded op by op.
    fn rotate_tail_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        rotation::<B, C>(x, cos, sin, Rotation::Tail(form))
            .unwrap_or_else(|[x, cos, sin]| rotate_tail_to_heads_composed::<Self>(x, cos, sin, form))
    }

    fn latent_node() -> bool {
        B::latent_node()
    }

    /// The inner backend's keys as one node over both inputs where it has a kernel each way;
    /// composed, recorded op by op, elsewhere.
    fn latent_keys(kv: FloatTensor<Self>, k_rot: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        if !B::latent_node() {
            return latent_keys_composed::<Self>(kv, k_rot, nope);
        }
        let v = burn::tensor::TensorMetadata::shape(&kv.primitive)[3].saturating_sub(nope);
        let out = B::latent_keys(kv.primitive, k_rot.primitive, nope);
        LatentKeysBackward { nope, v }
            .prepare::<C>([kv.node, k_rot.node])
            .compute_bound()
            .stateless(out)
    }

    /// As the keys: one node where the inner backend has a kernel each way.
    fn latent_values(kv: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        if !B::latent_node() {
            return latent_values_composed::<Self>(kv, nope);
        }
        let out = B::latent_values(kv.primitive, nope);
        LatentValuesBackward { nope }
            .prepare::<C>([kv.node])
            .compute_bound()
            .stateless(out)
    }

    /// The inner backend's SwiGLU as one node where it has a kernel each way; burn's ops,
    /// recorded one by one, elsewhere.
    fn gated_silu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        if !B::gated_silu_node() {
            return <Self as crate::experts::ActivationKernels>::swiglu(z);
        }
        let out = B::gated_silu(z.primitive.clone());
        match GatedSiluBackward
            .prepare::<C>([z.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(z.primitive, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn gated_silu_node() -> bool {
        B::gated_silu_node()
    }

    fn gated_silu_pair_node() -> bool {
        B::gated_silu_pair_node()
    }

    /// The inner backend's op as one node over both halves where it has a kernel each way;
    /// burn's ops, recorded one by one, elsewhere.
    fn gated_silu_pair(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if !B::gated_silu_pair_node() {
            return gated_silu_pair_composed::<Self>(gate, up);
        }
        let out = B::gated_silu_pair(gate.primitive.clone(), up.primitive.clone());
        match GatedSiluPairBackward
            .prepare::<C>([gate.node, up.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn gated_silu_joins() -> bool {
        B::gated_silu_joins()
    }

    /// The inner backend's weights as one node where it has a kernel each way; burn's ops,
    /// recorded one by one, elsewhere.
    fn attention_softmax(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        if !B::attention_softmax_node() {
            return attention_softmax_composed::<Self>(scores, hidden, scale);
        }
        let probs = B::attention_softmax(scores.primitive, hidden, scale);
        match AttentionSoftmaxBackward
            .prepare::<C>([scores.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((probs.clone(), scale), probs),
            OpsKind::UnTracked(prep) => prep.finish(probs),
        }
    }

    fn attention_softmax_node() -> bool {
        B::attention_softmax_node()
    }

    /// As without sinks: one node, over the scores and the sinks, where the inner backend has
    /// a kernel each way. The sinks' shares it returns are constants of the graph.
    fn attention_softmax_sinks(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        sinks: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !B::attention_softmax_node() {
            return attention_softmax_sinks_composed::<Self>(scores, hidden, sinks, scale);
        }
        let (probs, sink_probs) =
            B::attention_softmax_sinks(scores.primitive, hidden, sinks.primitive, scale);
        let shares = <Self as AutodiffBackend>::from_inner(sink_probs.clone());
        let probs = match AttentionSinksBackward
            .prepare::<C>([scores.node, sinks.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((probs.clone(), sink_probs, scale), probs),
            OpsKind::UnTracked(prep) => prep.finish(probs),
        };
        (probs, shares)
    }
}
