//! A device library's expert compute: the `C_i` and `C'_i` steps of a partition handed whole to
//! a backend's own kernels (on CUDA, cuBLAS's GEMMs and a few fused element-wise kernels), at
//! the precision the layer's config asks for.
//!
//! The fused exchange finds such a path the way it finds a device row exchange: among the
//! [`RowPaths`](crate::comm::RowPaths) its communicator offers, by the backend type
//! ([`RowPaths::with_experts`](crate::comm::RowPaths::with_experts)). Without one, each expert
//! runs on burn's primitives, one GEMM per expert and role (`exchange/ffn/`).
//!
//! A path sees a partition as buffers laid out by a [`BlockLayout`]: expert `e`'s rows start at
//! `layout.start(e)`, and the padding between blocks is never read. It writes the outputs into
//! the buffers the job hands it and returns them; the weight gradients are added to running
//! sums stacked like the experts (`[n_slots, ..]`), so a path can accumulate them in place
//! over the partitions and the exchange returns them without a concatenation.
//!
//! [`ComposedExperts`] is the plain-primitive twin of every path: the same job on burn's ops,
//! which the tests put behind the hook on the CPU and WGPU backends, so the plumbing (layouts,
//! stacked sums, recomputation, shadow slots) is held to the reference cases where no GPU
//! library runs.

use std::fmt::Debug;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Slice, TensorMetadata};
use serde::{Deserialize, Serialize};

use super::blocks::BlockLayout;
use super::pass_store::PassStore;
use super::rows::{dims2, narrow_rows};
use super::MoeBackend;
use crate::error::Result;
use crate::experts::{activation_backward, activation_forward, Activation, ExpertTensors};

/// The precision of the experts' products where the backend's library offers a choice (the
/// CUDA path in `mpipemoe-cuda`). The CPU backends, WGPU and the CubeCL GEMMs ignore it and
/// multiply as they always do: f32 in f32 on the CPU, f32 in TF32 in cubecl's CUDA kernels.
///
/// The names follow PyTorch's `torch.set_float32_matmul_precision`: `F32` is its `"highest"`
/// (`allow_tf32 = False`, PyTorch's default), `Tf32` its `"high"`, `Bf16` its `"medium"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum GemmPrecision {
    /// IEEE f32 products, f32 accumulation (cuBLAS `CUBLAS_COMPUTE_32F` without tensor-core
    /// math): what the reference cases hold to 1e-4.
    #[default]
    F32,
    /// f32 operands rounded to TF32 on the tensor cores (10-bit mantissa), f32 accumulation.
    Tf32,
    /// f32 operands rounded to bf16 on the tensor cores (7-bit mantissa), f32 accumulation.
    Bf16,
}

impl GemmPrecision {
    /// Every precision, in the order the tools list them.
    pub const ALL: [GemmPrecision; 3] = [GemmPrecision::F32, GemmPrecision::Tf32, GemmPrecision::Bf16];

    /// `f32`, `tf32` or `bf16`: the spelling of the command line and the case files.
    pub fn name(self) -> &'static str {
        match self {
            GemmPrecision::F32 => "f32",
            GemmPrecision::Tf32 => "tf32",
            GemmPrecision::Bf16 => "bf16",
        }
    }

    /// Parses [`name`](Self::name)'s spelling, ignoring case.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(text))
    }
}

impl std::fmt::Display for GemmPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The experts of one exchange as the path sees them: groups of stacked experts whose slots
/// are numbered through the groups in order (this rank's own experts, then the copies of the
/// shadowed ones), and the stores for what the path derives from them once.
#[derive(Debug, Clone)]
pub struct ExpertGroups<B: MoeBackend> {
    /// The groups, each `[n, ..]` as in [`ExpertTensors`].
    pub groups: Vec<ExpertTensors<B>>,
    /// What the path makes from the weights once per pass and reuses in each partition (the
    /// CUDA path's bf16 copies, by default). The exchange builds one `ExpertGroups` per pass.
    pub pass: PassStore,
    /// What the path makes from the weights once per step: the forward's store, which the
    /// exchange hands to the same step's backward (the CUDA path's bf16 copies where it is
    /// asked to keep them across the step). Fresh in a forward; the forward's in a backward.
    pub step: PassStore,
}

impl<B: MoeBackend> ExpertGroups<B> {
    /// `groups` with empty pass and step stores: build one per pass.
    pub fn new(groups: Vec<ExpertTensors<B>>) -> Self {
        Self::with_step(groups, PassStore::default())
    }

    /// `groups` with an empty pass store and the step's store `step` (a backward's: its
    /// forward's).
    pub fn with_step(groups: Vec<ExpertTensors<B>>, step: PassStore) -> Self {
        Self {
            groups,
            pass: PassStore::default(),
            step,
        }
    }

    /// Slots over every group.
    pub fn n_slots(&self) -> usize {
        self.groups.iter().map(|g| g.w_in.shape().to_vec()[0]).sum()
    }

    /// The group slot `e` lives in, and its index there.
    ///
    /// # Panics
    /// If `e` is not below [`n_slots`](Self::n_slots).
    pub fn locate(&self, e: usize) -> (&ExpertTensors<B>, usize) {
        let mut e = e;
        for group in &self.groups {
            let n = group.w_in.shape().to_vec()[0];
            if e < n {
                return (group, e);
            }
            e -= n;
        }
        panic!("expert slot past the last group");
    }

    /// Slot `e`'s first matrix. `[d_model, d_inner]`
    pub fn w_in(&self, e: usize) -> FloatTensor<B> {
        let (g, i) = self.locate(e);
        g.w_in_of(i)
    }

    /// Slot `e`'s second matrix. `[d_hidden, d_model]`
    pub fn w_out(&self, e: usize) -> FloatTensor<B> {
        let (g, i) = self.locate(e);
        g.w_out_of(i)
    }

    /// Slot `e`'s first bias. `[1, d_inner]`
    pub fn b_in(&self, e: usize) -> Option<FloatTensor<B>> {
        let (g, i) = self.locate(e);
        g.b_in_of(i)
    }

    /// Slot `e`'s second bias. `[1, d_model]`
    pub fn b_out(&self, e: usize) -> Option<FloatTensor<B>> {
        let (g, i) = self.locate(e);
        g.b_out_of(i)
    }
}

/// One partition's forward (`C_i`) for an [`ExpertPath`].
///
/// # Shapes
/// - x (`T_DI`), out (`T_DO`): `[layout.total(), d_model]`
/// - hidden (`T_M`, pre-activation, biases added): `[hidden_layout.total(), d_inner]`
#[derive(Debug)]
pub struct ExpertForward<'a, B: MoeBackend> {
    /// The partition's rows, expert `e`'s from `layout.start(e)`.
    pub x: FloatTensor<B>,
    /// Rows of each expert slot of this partition.
    pub rows_per_expert: &'a [usize],
    /// Where the blocks of the `d_model`-wide buffers start.
    pub layout: &'a BlockLayout,
    /// Where the blocks of the hidden buffer start (its width may align differently).
    pub hidden_layout: &'a BlockLayout,
    /// The experts, by slot.
    pub experts: &'a ExpertGroups<B>,
    /// The activation between the two GEMMs.
    pub activation: Activation,
    /// The products' precision.
    pub precision: GemmPrecision,
    /// Where `T_M` goes.
    pub hidden: FloatTensor<B>,
    /// Where `T_DO` goes.
    pub out: FloatTensor<B>,
}

/// One partition's backward (`C'_i`) for an [`ExpertPath`].
///
/// # Shapes
/// - grad (`dT_DO`), x (`T_DI`), grad_x (`dT_DI`): `[layout.total(), d_model]`
/// - hidden: per slot `[rows_e, d_inner]`
/// - grads: the experts' shapes with `n_slots` first
#[derive(Debug)]
pub struct ExpertBackward<'a, B: MoeBackend> {
    /// The gradient of the partition's expert outputs.
    pub grad: FloatTensor<B>,
    /// The partition's rows, restored.
    pub x: FloatTensor<B>,
    /// Each slot's `T_M` where it was kept or restored; `None` where it is recomputed from
    /// `x` (S3, S4) or the slot has no rows.
    pub hidden: Vec<Option<FloatTensor<B>>>,
    /// Rows of each expert slot of this partition.
    pub rows_per_expert: &'a [usize],
    /// Where the blocks start.
    pub layout: &'a BlockLayout,
    /// The experts, by slot.
    pub experts: &'a ExpertGroups<B>,
    /// The activation between the two GEMMs.
    pub activation: Activation,
    /// The products' precision.
    pub precision: GemmPrecision,
    /// Where `dT_DI` goes.
    pub grad_x: FloatTensor<B>,
    /// Whether `grads` are uninitialised (the pass's first partition): then this partition's
    /// gradients are written, not added, and every slot without rows is set to zero.
    pub fresh: bool,
    /// The running sums of the weight gradients, every slot: this partition's are added.
    pub grads: ExpertTensors<B>,
}

/// What a partition's backward returns: `dT_DI` and the running sums with this partition's
/// gradients added.
#[derive(Debug)]
pub struct ExpertBackwardOut<B: MoeBackend> {
    /// `[layout.total(), d_model]`
    pub grad_x: FloatTensor<B>,
    /// The running sums.
    pub grads: ExpertTensors<B>,
}

/// A backend library's expert compute for backend `B` (see the module docs).
///
/// Contract: the same function as [`ComposedExperts`] at the job's precision; buffers it is
/// handed are written in place or replaced by what it returns; rows of padding are never read.
/// Every device write is ordered before any later op on the calling thread's stream reads
/// it, and nothing the job hands over is read after the calling thread's stream has moved on
/// to reuse its memory.
pub trait ExpertPath<B: MoeBackend>: Send + Sync + Debug {
    /// `C_i`: returns `(T_DO, T_M)`.
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    fn forward(&self, job: ExpertForward<'_, B>) -> Result<(FloatTensor<B>, FloatTensor<B>)>;

    /// `C'_i`.
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    fn backward(&self, job: ExpertBackward<'_, B>) -> Result<ExpertBackwardOut<B>>;

    /// What the path holds while its jobs run at `precision` (the layer's
    /// [`gemm_precision`](crate::MoeLayerConfig::gemm_precision)), for the implementation's
    /// memory model ([`ExpertRoute`](crate::memory::ExpertRoute)), asked from the layer's
    /// thread before a batch's exchange under a memory budget. The default,
    /// [`partition_scratch`](crate::memory::ExpertRoute::partition_scratch) (scratch for every
    /// row of the partition, and at bf16 copies of the operands), assumes every transient as
    /// large as the partition.
    fn route(&self, precision: GemmPrecision) -> crate::memory::ExpertRoute {
        crate::memory::ExpertRoute::partition_scratch(precision)
    }

    /// A dense `lhs · rhs` at `precision` (the router's logits, the shared expert, and their
    /// gradients: [`MoeBackend::dense_matmul`]). The operands may be transposed views. The
    /// default is the backend's matmul.
    ///
    /// # Shapes
    /// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    fn matmul(
        &self,
        lhs: FloatTensor<B>,
        rhs: FloatTensor<B>,
        precision: GemmPrecision,
    ) -> Result<FloatTensor<B>> {
        let _ = precision;
        Ok(B::float_matmul(lhs, rhs))
    }

    /// Independent dense products `lhs · rhs` at `precision`, in one call: the primitives'
    /// products of every expert of a partition, step by step (experts with adapters). A
    /// library whose every call has a fixed cost (on CUDA, a section: a trip to the device
    /// thread and a stream hand-over) issues them together. The default is one
    /// [`matmul`](Self::matmul) each.
    ///
    /// # Shapes
    /// - each pair: lhs `[m, k]`, rhs `[k, n]` → `[m, n]`, in the pairs' order
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    fn matmuls(
        &self,
        pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
        precision: GemmPrecision,
    ) -> Result<Vec<FloatTensor<B>>> {
        pairs
            .into_iter()
            .map(|(lhs, rhs)| self.matmul(lhs, rhs, precision))
            .collect()
    }

    /// Products of matching batches of matrices at `precision`: attention's per-head products
    /// (the scores against the keys, the weights against the values, and their gradients:
    /// [`MoeBackend::dense_heads_matmul`]). Either operand may be the transposed view of its
    /// last two dimensions (the keys as `kᵀ`, a gradient's `bᵀ`). The default is the backend's
    /// [`heads_matmul`](MoeBackend::heads_matmul).
    ///
    /// # Shapes
    /// - lhs: `[.., m, k]`, rhs: `[.., k, n]` with the same leading dimensions → `[.., m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    fn heads_matmul(
        &self,
        lhs: FloatTensor<B>,
        rhs: FloatTensor<B>,
        precision: GemmPrecision,
    ) -> Result<FloatTensor<B>> {
        let _ = precision;
        Ok(B::heads_matmul(lhs, rhs))
    }

    /// Whether the layer's dense products (the router's logits, the shared expert, a model's
    /// projections: [`MoeBackend::dense_matmul`]) go through this path too, or stay on the
    /// backend's own product. The default is `true`. A library may leave them to the backend
    /// where its per-call cost outweighs its faster product (on CUDA, a section for a
    /// router's `[n_tokens, d_model] · [d_model, n_experts]`); the experts' own products
    /// (`forward`, `backward`, `matmuls` of the primitives) go through it either way.
    fn multiplies_dense(&self) -> bool {
        true
    }
}

/// The plain-primitive twin of every [`ExpertPath`]: each expert's GEMMs and activation on
/// burn's ops, its blocks written into the job's buffers with [`MoeBackend::assign_rows`], its
/// gradients added into the stacked running sums slot by slot. Exact at every precision (it
/// multiplies as the backend always does).
#[derive(Debug, Clone, Copy, Default)]
pub struct ComposedExperts;

/// `lhs · rhs (+ bias)`.
fn affine<B: MoeBackend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let z = B::expert_matmul(lhs, rhs);
    match bias {
        Some(b) => B::float_add(z, b),
        None => z,
    }
}

/// `sums[e] += grad` for a stacked `[n, ..]` tensor and a slot's `[..]` gradient (a bias's
/// `[1, cols]`).
fn add_slot<B: MoeBackend>(sums: FloatTensor<B>, e: usize, grad: FloatTensor<B>) -> FloatTensor<B> {
    let dims = sums.shape().to_vec();
    let mut ranges: Vec<Slice> = dims.iter().map(|&d| Slice::from(0..d)).collect();
    ranges[0] = Slice::from(e..e + 1);
    let mut one = dims.clone();
    one[0] = 1;
    let old = B::float_slice(sums.clone(), &ranges);
    let new = B::float_add(old, B::float_reshape(grad, one.into()));
    B::float_slice_assign(sums, &ranges, new)
}

impl<B: MoeBackend> ExpertPath<B> for ComposedExperts {
    fn forward(&self, job: ExpertForward<'_, B>) -> Result<(FloatTensor<B>, FloatTensor<B>)> {
        let ExpertForward {
            x,
            rows_per_expert,
            layout,
            hidden_layout,
            experts,
            activation,
            mut hidden,
            mut out,
            ..
        } = job;
        for (e, &rows) in rows_per_expert.iter().enumerate() {
            if rows == 0 {
                continue;
            }
            let x_e = narrow_rows::<B>(x.clone(), layout.start(e), rows);
            let z = affine::<B>(x_e, experts.w_in(e), experts.b_in(e));
            let a = activation_forward::<B>(activation, z.clone());
            let o = affine::<B>(a, experts.w_out(e), experts.b_out(e));
            hidden = B::assign_rows(hidden, hidden_layout.start(e), z);
            out = B::assign_rows(out, layout.start(e), o);
        }
        Ok((out, hidden))
    }

    fn backward(&self, job: ExpertBackward<'_, B>) -> Result<ExpertBackwardOut<B>> {
        let ExpertBackward {
            grad,
            x,
            hidden,
            rows_per_expert,
            layout,
            experts,
            activation,
            mut grad_x,
            mut grads,
            fresh,
            ..
        } = job;
        if fresh {
            // The twin adds into zeros, which the device paths spare themselves.
            grads = grads.map(|t| B::float_zeros(t.shape(), &B::float_device(&t), t.dtype().into()));
        }
        for (e, (&rows, z)) in rows_per_expert.iter().zip(hidden).enumerate() {
            if rows == 0 {
                continue;
            }
            let x_e = narrow_rows::<B>(x.clone(), layout.start(e), rows);
            let g_e = narrow_rows::<B>(grad.clone(), layout.start(e), rows);
            let z = z.unwrap_or_else(|| affine::<B>(x_e.clone(), experts.w_in(e), experts.b_in(e)));
            let a = activation_forward::<B>(activation, z.clone());
            grads.w_out = add_slot::<B>(
                grads.w_out,
                e,
                B::expert_matmul(B::float_transpose(a), g_e.clone()),
            );
            if let Some(b) = grads.b_out.take() {
                grads.b_out = Some(add_slot::<B>(b, e, B::float_sum_dim(g_e.clone(), 0)));
            }
            let grad_a = B::expert_matmul(g_e, B::float_transpose(experts.w_out(e)));
            let grad_z = activation_backward::<B>(activation, z, grad_a);
            grads.w_in = add_slot::<B>(
                grads.w_in,
                e,
                B::expert_matmul(B::float_transpose(x_e), grad_z.clone()),
            );
            if let Some(b) = grads.b_in.take() {
                grads.b_in = Some(add_slot::<B>(b, e, B::float_sum_dim(grad_z.clone(), 0)));
            }
            let dx = B::expert_matmul(grad_z, B::float_transpose(experts.w_in(e)));
            grad_x = B::assign_rows(grad_x, layout.start(e), dx);
        }
        debug_assert_eq!(dims2::<B>(&grad_x)[0], layout.total());
        Ok(ExpertBackwardOut { grad_x, grads })
    }
}

impl crate::comm::RowPaths {
    /// Adds the expert compute path for backend `B` (replacing an earlier one for the same
    /// backend).
    pub fn with_experts<B: MoeBackend>(self, path: std::sync::Arc<dyn ExpertPath<B>>) -> Self {
        self.insert(path)
    }

    /// The expert compute path for backend `B`, if there is one.
    pub fn experts<B: MoeBackend>(&self) -> Option<std::sync::Arc<dyn ExpertPath<B>>> {
        self.find()
    }
}
