//! A partition's experts on Flex side by side: each thread of the pool runs whole experts,
//! and the weight gradients are written straight into their stacked sums.
//!
//! On the primitives (`exchange/ffn/`) a partition runs its experts one after another, and
//! each product splits over the pool inside `gemm`, which joins its threads after every block
//! of depth. A fine-tuning step's expert products are many and small (the 163 M Qwen3-MoE of
//! BENCHMARKS §13: 32 experts of about 64 rows a layer, `[64, 512] · [512, 1536]`), so those
//! joins, the single-threaded packing between them and the blocks one thread finishes while
//! the other waits left the pool's second thread without work for about a third of the rank
//! thread's busy time (`perf`, DWARF stacks, 9 steps). And each expert's weight gradient was a
//! tensor of its own, concatenated at the end of backward (`ExpertGradAcc::stack`: one copy of
//! the layer's 150 MB of expert gradients per step, on one thread). Here the experts are the
//! unit of work, largest first, each product on `gemm` alone on its thread (an expert with more
//! than a thread's share of the rows splits its products over the pool as before), and each
//! expert's weight gradient is written into its slot of the stacked sums: no per-expert
//! gradient, no concatenation. Called from outside any rayon pool, it runs the experts one
//! after another instead (see [`side_by_side`]).
//!
//! Each value is computed as [`ComposedExperts`] computes it (the same products, the same
//! activation kernels, the same adds in the same order), so the two give the same bits; the
//! tests hold them to that.
//!
//! Memory: the partition's buffers and the stacked sums are whole from the start, and each
//! running expert holds its own temporaries, so the peak is not the expert-by-expert one of
//! the primitives (measured up to 1.38 times that route's model on `tests/memory.rs`'s shapes,
//! one thread a rank). The implementation's memory model replays this route
//! ([`ExpertRoute::Tasks`](crate::memory::ExpertRoute::Tasks), `memory/implementation/library.rs`),
//! so a `memory_budget` keeps it.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::expert_path::{
    ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertGroups, ExpertPath,
};
use super::flex_gemm::{is_plain, product_into, PARALLEL_THRESHOLD};
use super::rows::{dims2, narrow_rows};
use crate::error::Result;
use crate::experts::{activation_backward, activation_forward, ExpertTensors};

/// The Flex backend's [`ExpertPath`]: see the module docs. The exchange takes it where the
/// communicator offers no path of its own ([`MoeBackend::expert_path`](super::MoeBackend::expert_path)).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FlexExperts;

/// A pointer to a buffer whose disjoint parts the pool's threads write.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: every task writes only its own expert's rows or slot of the buffer (see the callers),
// and the buffer's owner is not touched until the parallel region has ended.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The buffer of `t`, which [`writable`] made the sole owner of its contiguous storage.
    fn of(t: &mut FlexTensor) -> Self {
        Self(t.storage_mut::<f32>().as_mut_ptr())
    }

    /// `len` values from value `at` on.
    ///
    /// # Safety
    /// The range lies in the buffer and no other task touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn part(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// `t` as the sole owner of a contiguous `f32` storage that starts with its values: as it is
/// where it already is, else copied.
fn writable(t: FlexTensor) -> FlexTensor {
    let n = t.shape().num_elements();
    let mut t = match t.layout().contiguous_offsets() {
        Some((0, end)) if end == n => t,
        _ => t.to_contiguous(),
    };
    // Copy-on-write: a storage shared with another tensor is copied here, once.
    t.storage_mut::<f32>();
    t
}

/// The weights and biases of `t` (the path never runs adapters: the exchange keeps experts
/// with adapters on the primitives).
fn tensors_of(t: &ExpertTensors<Flex>) -> impl Iterator<Item = &FlexTensor> {
    [Some(&t.w_in), t.b_in.as_ref(), Some(&t.w_out), t.b_out.as_ref()]
        .into_iter()
        .flatten()
}

/// Whether every tensor of the job is an `f32` matrix this path reads in place; otherwise the
/// job runs on the twin.
fn plain_f32(tensors: &[&FlexTensor]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
}

/// `out = lhs · rhs` into `m · n` values that the caller owns for the call: the product
/// [`B::expert_matmul`](super::MoeBackend::expert_matmul) computes, split as `split` says.
fn product(lhs: &FlexTensor, rhs: &FlexTensor, out: &mut [f32], split: Split) {
    let ([m, k], [k2, n]) = (dims2::<Flex>(lhs), dims2::<Flex>(rhs));
    assert!(
        k == k2 && out.len() == m * n,
        "expert product: [{m}, {k}] · [{k2}, {n}] into {}",
        out.len()
    );
    if !(is_plain(lhs) && is_plain(rhs)) {
        let z = super::flex_gemm::matmul(lhs.clone(), rhs.clone());
        out.copy_from_slice(&z.to_contiguous().storage::<f32>()[..m * n]);
        return;
    }
    let parallel = match split {
        Split::Alone => false,
        Split::Pool => true,
        Split::BySize => m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD,
    };
    // SAFETY: both operands are plain `[m, k]`, `[k, n]` matrices (checked above); `out` holds
    // `m · n` values that nothing else touches during the call.
    unsafe { product_into(lhs, rhs, [m, k, n], out.as_mut_ptr(), parallel) };
}

/// Expert `e`'s `z = x_e · w_in[e] (+ b_in[e])`, `[rows, d_inner]` row-major: what the forward
/// computes and a backward without the kept `T_M` recomputes (S3, S4).
fn first_product(x_e: &FlexTensor, experts: &ExpertGroups<Flex>, e: usize, split: Split) -> Vec<f32> {
    let w_in = experts.w_in(e);
    let mut z = vec![0f32; dims2::<Flex>(x_e)[0] * dims2::<Flex>(&w_in)[1]];
    product(x_e, &w_in, &mut z, split);
    if let Some(b) = experts.b_in(e) {
        add_bias(&mut z, &b);
    }
    z
}

/// `out[i, j] += bias[j]` for a `[rows, cols]` block: Flex's broadcast add, element by element.
fn add_bias(out: &mut [f32], bias: &FlexTensor) {
    let bias = bias.to_contiguous();
    let b = &bias.storage::<f32>()[..bias.shape().num_elements()];
    for row in out.chunks_exact_mut(b.len()) {
        for (o, &v) in row.iter_mut().zip(b) {
            *o += v;
        }
    }
}

/// A `[rows, cols]` tensor that takes `values` over (no copy).
fn tensor(values: Vec<f32>, rows: usize, cols: usize) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, Shape::new([rows, cols])))
}

/// How one expert's products use the pool.
#[derive(Clone, Copy)]
enum Split {
    /// On the calling thread alone (the experts run side by side).
    Alone,
    /// Over the pool (an expert with more than a thread's share of the rows).
    Pool,
    /// Over the pool from Flex's threshold on, as `B::expert_matmul` splits them (the experts
    /// run one after another).
    BySize,
}

/// Whether the experts run side by side: where the calling thread is a worker of a pool of
/// more than one thread. A thread outside any pool (a rank thread of `LocalGroup::run`)
/// hands a parallel region to rayon's global pool and sleeps until it ends
/// (rayon-core 1.13 `Registry::in_worker_cold`), and those hand-offs, two per partition and
/// pass, made the toy GPT-MoE (small experts, two such ranks on two cores) 3% slower; there
/// the experts run one after another as on the primitives, still writing into the partition
/// buffers and the stacked sums.
fn side_by_side() -> bool {
    rayon::current_thread_index().is_some() && rayon::current_num_threads() > 1
}

/// The order the experts run in, largest first (so that the last tasks are short), and how
/// each one's products split (see [`Split`]).
fn schedule(rows_per_expert: &[usize], side_by_side: bool) -> Vec<(usize, Split)> {
    let total: usize = rows_per_expert.iter().sum();
    let share = total.div_ceil(rayon::current_num_threads().max(1));
    let mut order: Vec<usize> = (0..rows_per_expert.len())
        .filter(|&e| rows_per_expert[e] > 0)
        .collect();
    order.sort_by_key(|&e| std::cmp::Reverse(rows_per_expert[e]));
    let split = |e: usize| match (side_by_side, rows_per_expert[e] > share) {
        (false, _) => Split::BySize,
        (true, true) => Split::Pool,
        (true, false) => Split::Alone,
    };
    order.into_iter().map(|e| (e, split(e))).collect()
}

/// Runs `task` for every expert of `order`: side by side over the pool, or one after another.
///
/// Side by side, each thread takes the next expert of `order` as it frees up (the greedy
/// longest-first schedule), so the pass ends with the shortest experts and the threads finish
/// at most one short expert apart, and the last expert's products are offered to the pool.
/// A rayon `par_iter` over `order` splits it in halves
/// instead: the thread that steals the smaller half first finishes early and steals back
/// from the middle of the other's run, and a pass of the 163 M Qwen3-MoE's fine-tuning step
/// ended with one thread running a mid-sized expert alone (`perf`: about 40 ms of a 1.3 s
/// step with the other thread idle).
fn run_all(order: Vec<(usize, Split)>, side_by_side: bool, task: impl Fn((usize, Split)) + Sync) {
    if !side_by_side {
        return order.into_iter().for_each(task);
    }
    let next = AtomicUsize::new(0);
    let last = order.len().saturating_sub(1);
    let drain = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        match order.get(i) {
            // The last expert offers its products to the pool: a thread that finishes its
            // own expert meanwhile takes part of them instead of waiting at the scope's end
            // (the same values: `gemm` and the column split cut by output blocks alone).
            Some(&(e, Split::Alone)) if i == last => task((e, Split::Pool)),
            Some(&job) => task(job),
            None => break,
        }
    };
    let helpers = rayon::current_num_threads().min(order.len()).saturating_sub(1);
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| drain());
        }
        drain();
    });
}

/// Slot `e`'s values in a stacked `[n_slots, ..]` buffer of `per_slot` values a slot.
struct Sums {
    out: Out,
    per_slot: usize,
}

impl Sums {
    fn of(t: &mut FlexTensor) -> Self {
        let dims = t.shape().to_vec();
        let per_slot = dims[1..].iter().product();
        Self {
            out: Out::of(t),
            per_slot,
        }
    }

    /// `slot[e] = value` where `fresh`, else `slot[e] = slot[e] + value`: the twin's zeros
    /// plus the first partition's value, then each later partition's added.
    ///
    /// # Safety
    /// Only this task touches slot `e` meanwhile.
    unsafe fn put(&self, e: usize, fresh: bool, fill: impl FnOnce(&mut [f32])) {
        let slot = self.out.part(e * self.per_slot, self.per_slot);
        match fresh {
            true => fill(slot),
            false => {
                let mut value = vec![0f32; self.per_slot];
                fill(&mut value);
                for (s, v) in slot.iter_mut().zip(&value) {
                    *s += v;
                }
            }
        }
    }

    /// Slot `e` set to zero (an expert without rows, where the sums are fresh).
    ///
    /// # Safety
    /// As [`put`](Self::put).
    unsafe fn zero(&self, e: usize) {
        self.out.part(e * self.per_slot, self.per_slot).fill(0.0);
    }
}

impl ExpertPath<Flex> for FlexExperts {
    /// Experts as tasks, as many at once as the calling thread's pool has threads where they
    /// run side by side (see [`side_by_side`]), else one. Asked from the layer's thread: an
    /// upper bound where the exchange's compute runs on a stream worker outside any pool
    /// (the threaded executor), which runs them one after another.
    fn route(&self, _: crate::GemmPrecision) -> crate::memory::ExpertRoute {
        let concurrent = match side_by_side() {
            true => rayon::current_num_threads(),
            false => 1,
        };
        crate::memory::ExpertRoute::Tasks { concurrent }
    }

    fn forward(&self, job: ExpertForward<'_, Flex>) -> Result<(FlexTensor, FlexTensor)> {
        let groups: Vec<&FlexTensor> = job.experts.groups.iter().flat_map(tensors_of).collect();
        if !plain_f32(&[&[&job.x, &job.hidden, &job.out][..], &groups[..]].concat()) {
            return ComposedExperts.forward(job);
        }
        let ExpertForward {
            x,
            rows_per_expert,
            layout,
            hidden_layout,
            experts,
            activation,
            hidden,
            out,
            ..
        } = job;
        let (mut hidden, mut out) = (writable(hidden), writable(out));
        let [_, d_model] = dims2::<Flex>(&out);
        let [_, d_inner] = dims2::<Flex>(&hidden);
        let (hidden_at, out_at) = (Out::of(&mut hidden), Out::of(&mut out));
        let run = |(e, parallel): (usize, Split)| {
            let rows = rows_per_expert[e];
            let x_e = narrow_rows::<Flex>(x.clone(), layout.start(e), rows);
            // SAFETY: expert `e`'s blocks of rows are its task's alone.
            let (z_e, o_e) = unsafe {
                (
                    hidden_at.part(hidden_layout.start(e) * d_inner, rows * d_inner),
                    out_at.part(layout.start(e) * d_model, rows * d_model),
                )
            };
            // `z` in a tensor of its own for the activation (a view of `hidden` would read
            // the buffer the other tasks write), copied into its block of `hidden`.
            let z = first_product(&x_e, experts, e, parallel);
            z_e.copy_from_slice(&z);
            let a = activation_forward::<Flex>(activation, tensor(z, rows, d_inner));
            product(&a, &experts.w_out(e), o_e, parallel);
            if let Some(b) = experts.b_out(e) {
                add_bias(o_e, &b);
            }
        };
        let side_by_side = side_by_side();
        run_all(schedule(rows_per_expert, side_by_side), side_by_side, run);
        Ok((out, hidden))
    }

    fn backward(&self, job: ExpertBackward<'_, Flex>) -> Result<ExpertBackwardOut<Flex>> {
        let groups: Vec<&FlexTensor> = job.experts.groups.iter().flat_map(tensors_of).collect();
        let sums: Vec<&FlexTensor> = tensors_of(&job.grads).collect();
        let kept: Vec<&FlexTensor> = job.hidden.iter().flatten().collect();
        let all = [
            &[&job.grad, &job.x, &job.grad_x][..],
            &groups[..],
            &sums[..],
            &kept[..],
        ]
        .concat();
        if !plain_f32(&all) || job.grads.lora_in.is_some() || job.grads.lora_out.is_some() {
            return ComposedExperts.backward(job);
        }
        let ExpertBackward {
            grad,
            x,
            hidden,
            rows_per_expert,
            layout,
            experts,
            activation,
            grad_x,
            fresh,
            grads,
            ..
        } = job;
        let ExpertTensors {
            w_in,
            b_in,
            w_out,
            b_out,
            ..
        } = grads;
        let mut grad_x = writable(grad_x);
        let [_, d_model] = dims2::<Flex>(&grad_x);
        let grad_x_at = Out::of(&mut grad_x);
        let (mut w_in, mut w_out) = (writable(w_in), writable(w_out));
        let (mut b_in, mut b_out) = (b_in.map(writable), b_out.map(writable));
        let (w_in_at, w_out_at) = (Sums::of(&mut w_in), Sums::of(&mut w_out));
        let (b_in_at, b_out_at) = (b_in.as_mut().map(Sums::of), b_out.as_mut().map(Sums::of));
        let every_sum = || {
            [
                Some(&w_in_at),
                Some(&w_out_at),
                b_in_at.as_ref(),
                b_out_at.as_ref(),
            ]
        };
        if fresh {
            for e in (0..rows_per_expert.len()).filter(|&e| rows_per_expert[e] == 0) {
                for sums in every_sum().into_iter().flatten() {
                    // SAFETY: no task runs yet.
                    unsafe { sums.zero(e) };
                }
            }
        }
        let t = Flex::float_transpose;
        let run = |(e, parallel): (usize, Split)| {
            let rows = rows_per_expert[e];
            let x_e = narrow_rows::<Flex>(x.clone(), layout.start(e), rows);
            let g_e = narrow_rows::<Flex>(grad.clone(), layout.start(e), rows);
            let z = match &hidden[e] {
                Some(z) => z.clone(),
                None => {
                    // Recomputed from `T_DI` (S3, S4), as the forward computed it.
                    let z = first_product(&x_e, experts, e, parallel);
                    let width = z.len() / rows;
                    tensor(z, rows, width)
                }
            };
            let a = activation_forward::<Flex>(activation, z.clone());
            // SAFETY (each `put`): slot `e` of every sum is this task's alone.
            unsafe { w_out_at.put(e, fresh, |s| product(&t(a.clone()), &g_e, s, parallel)) };
            if let Some(sums) = &b_out_at {
                let db = Flex::float_sum_dim(g_e.clone(), 0);
                unsafe { sums.put(e, fresh, |s| s.copy_from_slice(&db.storage::<f32>()[..s.len()])) };
            }
            let [_, d_hidden] = dims2::<Flex>(&a);
            let mut grad_a = vec![0f32; rows * d_hidden];
            product(&g_e, &t(experts.w_out(e)), &mut grad_a, parallel);
            let grad_z = activation_backward::<Flex>(activation, z, tensor(grad_a, rows, d_hidden));
            unsafe { w_in_at.put(e, fresh, |s| product(&t(x_e.clone()), &grad_z, s, parallel)) };
            if let Some(sums) = &b_in_at {
                let db = Flex::float_sum_dim(grad_z.clone(), 0);
                unsafe { sums.put(e, fresh, |s| s.copy_from_slice(&db.storage::<f32>()[..s.len()])) };
            }
            // SAFETY: expert `e`'s block of rows is its task's alone.
            let dx = unsafe { grad_x_at.part(layout.start(e) * d_model, rows * d_model) };
            product(&grad_z, &t(experts.w_in(e)), dx, parallel);
        };
        let side_by_side = side_by_side();
        run_all(schedule(rows_per_expert, side_by_side), side_by_side, run);
        let grads = ExpertTensors::plain(w_in, b_in, w_out, b_out);
        Ok(ExpertBackwardOut { grad_x, grads })
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexTensor};
    use burn::tensor::{FloatDType, Shape, TensorData};

    use super::super::blocks::BlockLayout;
    use super::super::expert_path::{
        ComposedExperts, ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, GemmPrecision,
    };
    use super::super::rows::narrow_rows;
    use super::super::MoeBackend;
    use super::FlexExperts;
    use crate::experts::{Activation, ExpertTensors};

    /// A tensor of values in `[-1, 1)` that differ from seed to seed.
    fn tensor(dims: &[usize], seed: usize) -> FlexTensor {
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5) - 1.0)
            .collect();
        FlexTensor::from_data(TensorData::new(values, Shape::from(dims.to_vec())))
    }

    fn values(t: &FlexTensor) -> Vec<f32> {
        let t = t.to_contiguous();
        t.storage::<f32>()[..t.layout().shape().num_elements()].to_vec()
    }

    fn experts(
        n: usize,
        [d_model, d_inner, d_hidden]: [usize; 3],
        bias: bool,
        seed: usize,
    ) -> ExpertTensors<Flex> {
        let b = |width: usize, s: usize| bias.then(|| tensor(&[n, width], seed + s));
        ExpertTensors::plain(
            tensor(&[n, d_model, d_inner], seed),
            b(d_inner, 1),
            tensor(&[n, d_hidden, d_model], seed + 2),
            b(d_model, 3),
        )
    }

    fn buffer(rows: usize, width: usize) -> FlexTensor {
        Flex::write_buffer(Shape::new([rows, width]), &Default::default(), FloatDType::F32)
    }

    /// Both passes of a partition on this path and on the twin, on pools of one and three
    /// threads: experts without rows, with one to sixteen (the streaming kernel), with more (on
    /// `gemm`), one with more than a thread's share (its products split over the pool), two
    /// groups (a shadow's slots after the own experts), biases and not, three activations,
    /// `T_M` kept for some experts and recomputed for others, the running sums fresh and
    /// already holding a partition's: every output, `T_M`, `dT_DI` and sum the same bits.
    /// A row block written at another expert's place, a gradient in another slot, a sum
    /// overwritten instead of added, or a slot without rows left unwritten fails it.
    #[test]
    fn flex_experts_give_the_twins_bits() {
        let rows_per_expert = [0, 37, 3, 1, 120, 16, 17];
        let d_model = 24;
        let d_hidden = 20;
        for (activation, bias) in [
            (Activation::SwiGlu, false),
            (Activation::Gelu, true),
            (
                Activation::ClampedSwiGlu {
                    alpha: 1.702,
                    limit: 0.5,
                },
                true,
            ),
        ] {
            let d_inner = activation.d_inner(d_hidden);
            let dims = [d_model, d_inner, d_hidden];
            let groups = ExpertGroups::new(vec![experts(5, dims, bias, 10), experts(2, dims, bias, 20)]);
            let layout = BlockLayout::new(&rows_per_expert, 1);
            let total = layout.total();
            let x = tensor(&[total, d_model], 1);
            let grad = tensor(&[total, d_model], 2);
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let what = format!("{activation:?}, bias {bias}, {threads} threads");
                let forward = |path: &dyn ExpertPath<Flex>| {
                    pool.install(|| {
                        path.forward(ExpertForward {
                            x: x.clone(),
                            rows_per_expert: &rows_per_expert,
                            layout: &layout,
                            hidden_layout: &layout,
                            experts: &groups,
                            activation,
                            precision: GemmPrecision::F32,
                            hidden: buffer(total, d_inner),
                            out: buffer(total, d_model),
                        })
                        .unwrap()
                    })
                };
                let (out, hidden) = forward(&FlexExperts);
                let (twin_out, twin_hidden) = forward(&ComposedExperts);
                assert!(values(&out) == values(&twin_out), "{what}: T_DO");
                assert!(values(&hidden) == values(&twin_hidden), "{what}: T_M");
                for fresh in [true, false] {
                    let backward = |path: &dyn ExpertPath<Flex>| {
                        // Every other expert's T_M kept, the rest recomputed from T_DI.
                        let kept = (0..rows_per_expert.len())
                            .map(|e| {
                                (e % 2 == 0 && rows_per_expert[e] > 0).then(|| {
                                    narrow_rows::<Flex>(hidden.clone(), layout.start(e), rows_per_expert[e])
                                })
                            })
                            .collect();
                        // Sums already holding a partition's gradients, or uninitialised
                        // (whatever they hold must not show: here, other values).
                        let sums = experts(7, dims, bias, 30);
                        pool.install(|| {
                            path.backward(ExpertBackward {
                                grad: grad.clone(),
                                x: x.clone(),
                                hidden: kept,
                                rows_per_expert: &rows_per_expert,
                                layout: &layout,
                                experts: &groups,
                                activation,
                                precision: GemmPrecision::F32,
                                grad_x: buffer(total, d_model),
                                fresh,
                                grads: sums,
                            })
                            .unwrap()
                        })
                    };
                    let (ours, twin) = (backward(&FlexExperts), backward(&ComposedExperts));
                    assert!(
                        values(&ours.grad_x) == values(&twin.grad_x),
                        "{what}, fresh {fresh}: dT_DI"
                    );
                    let (a, b) = (ours.grads.into_parts(), twin.grads.into_parts());
                    for (part, (a, b)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(a.is_some(), b.is_some(), "{what}, fresh {fresh}: part {part}");
                        if let (Some(a), Some(b)) = (a, b) {
                            assert!(
                                values(a) == values(b),
                                "{what}, fresh {fresh}: part {part}'s sums"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Flex takes this path where the communicator offers none.
    #[test]
    fn flex_offers_its_expert_path() {
        assert!(<Flex as MoeBackend>::expert_path().is_some());
    }
}
