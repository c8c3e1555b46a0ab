//! The layer's CubeCL path on burn's WGPU backend (feature `wgpu`), checked against every
//! reference case: ranks 1 and 2, n ∈ {1, 3}, every strategy, both paths, 1e-4; in f16; and
//! device memory that does not grow from step to step; and through burn's fusion (`fusion.rs`). On a machine without a GPU it runs on
//! Mesa's software Vulkan driver ("llvmpipe"; Debian packages `mesa-vulkan-drivers` and
//! `libvulkan1`), which `.ci/run` installs.
//!
//! `cargo test -p mpipemoe --features wgpu --test wgpu`
#![cfg(feature = "wgpu")]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::cubecl::stream_id::StreamId;
use burn_cubecl::cubecl::Runtime;
use mpipemoe::backend::{
    execute_on, BlockLayout, ExchangeRun, HostStore, PartitionArena, Role, Schedule, Slot, StepExecutor,
    Stream,
};
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::{check_case, Case, CheckOptions};
use mpipemoe::memory::Strategy;
use mpipemoe::memory::{LayerShape, PaperTerms};
use mpipemoe::{
    seeded_uniform, Activation, ExchangePath, MemoryReuse, MoeBackend, MoeLayer, MoeLayerConfig, Partitions,
    Shadowing,
};

/// burn's default GPU backend (`Wgpu` with burn's default features, which wrap it in fusion).
#[path = "wgpu/fusion.rs"]
mod fusion;

/// The layer's device memory against the memory model.
#[path = "wgpu/memory.rs"]
mod memory;

/// The decode path, raw and under fusion.
#[path = "wgpu/decode.rs"]
mod decode;

type B = Autodiff<Wgpu>;
type Inner = Wgpu;

mod common;

/// The tests of this file share one WGPU device, and cubecl maps stream ids to its streams
/// modulo `max_streams`, so another test's threads can allocate in the very pools a memory
/// test reads. Memory tests take the device alone; the others share it.
static DEVICE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    DEVICE.read().unwrap_or_else(|e| e.into_inner())
}

fn alone() -> RwLockWriteGuard<'static, ()> {
    DEVICE.write().unwrap_or_else(|e| e.into_inner())
}

fn case_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = [
        "tests/data/cases",
        "tests/data/hf",
        "../shared/cases",
        "../shared/hf",
        "tests/data/hf/generated",
    ]
    .iter()
    .filter_map(|dir| std::fs::read_dir(root.join(dir)).ok())
    .flat_map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()))
    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
    // In `generated/`, the cases are `<folder>.layer<L>`; the FP8 companion is not one.
    .filter(|p| {
        !p.starts_with(root.join("tests/data/hf/generated")) || p.to_string_lossy().contains(".layer")
    })
    .collect();
    // The shared folder's copy of a case wins; each case once.
    files.sort_by_key(|p| {
        (
            p.file_name().map(|n| n.to_owned()),
            !p.starts_with(root.join("../shared")),
        )
    });
    files.dedup_by_key(|p| p.file_name().map(|n| n.to_owned()));
    assert!(files.len() >= 7, "{files:?}");
    files
}

/// One forward + backward of `layer` on `x`, waited for (the expert gradient is read back).
fn train_step(layer: &MoeLayer<B>, x: &Tensor<B, 2>) {
    let out = layer.forward(x.clone());
    let grads = out.output.sum().backward();
    let _ = layer
        .experts
        .w_in
        .grad(&grads)
        .expect("expert gradient")
        .into_data();
}

/// WGPU runs the schedule in order by default: every cubecl stream on WGPU submits to the one
/// wgpu queue, so a worker per stream buys no overlap there. The threaded executor is correct
/// on WGPU too (every case below runs through it), because it fences each step itself.
#[test]
fn cubecl_backends_run_in_order() {
    let _device = shared();
    let device = Default::default();
    assert_eq!(
        <Wgpu as MoeBackend>::step_executor(&device),
        StepExecutor::InOrder
    );
    assert_eq!(<B as MoeBackend>::step_executor(&device), StepExecutor::InOrder);
}

/// The finite check on the GPU backends, raw and under burn's fusion, trained and not: NaN and
/// infinities refused wherever they are, extreme finite values let through
/// (`common::holds_the_finite_check`).
#[test]
fn the_finite_check_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    common::holds_the_finite_check::<B>(&device);
    common::holds_the_finite_check::<Inner>(&device);
    common::holds_the_finite_check::<fusion::F>(&device);
    common::holds_the_finite_check::<fusion::FusedWgpu>(&device);
}

/// The z-loss as one op (a kernel and a sum, one kernel backward) against its composed form,
/// raw and under burn's fusion (`common::z_loss_matches_its_composed_form`).
#[test]
fn the_z_loss_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    common::z_loss_matches_its_composed_form::<B>(&device);
    common::z_loss_matches_its_composed_form::<fusion::F>(&device);
}

/// The GPU check's list of kernels against their composed forms (`harness::kernel_checks`: the
/// activations, the decoder blocks' ops and the token loss, each way), here on WGPU raw and
/// under fusion, so that the list the GPU check runs on CUDA is known to pass where it can run.
#[test]
fn the_gpu_checks_kernel_list_passes_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    for (backend, checks) in [
        ("raw", mpipemoe::harness::kernel_checks::<Inner>(&device)),
        (
            "fused",
            mpipemoe::harness::kernel_checks::<fusion::FusedWgpu>(&device),
        ),
    ] {
        assert!(checks.len() >= 30, "{backend}: {} checks", checks.len());
        for (label, outcome) in checks {
            assert!(outcome.is_ok(), "{backend} {label}: {outcome:?}");
        }
    }
}

/// Attention's weights as one op (a node over a kernel each way) against burn's `mask_fill` and
/// `softmax`, raw and under burn's fusion (`common::attention_softmax_matches_burns_ops`).
#[test]
fn attention_softmax_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    common::attention_softmax_matches_burns_ops::<B>(&device);
    common::attention_softmax_matches_burns_ops::<fusion::F>(&device);
}

/// The token cross-entropy as one node over a kernel each way against burn's `log_softmax`,
/// raw and under burn's fusion (`common::cross_entropy_matches_burns_ops`).
#[test]
fn cross_entropy_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    common::cross_entropy_matches_burns_ops::<B>(&device);
    common::cross_entropy_matches_burns_ops::<fusion::F>(&device);
}

/// The rotary embedding as one op (a node over a kernel each way) against burn's slices and
/// concatenation, raw and under burn's fusion (`common::rotary_matches_burns_ops`).
#[test]
fn rotary_on_wgpu_raw_and_fused() {
    let _device = shared();
    let device = Default::default();
    common::rotary_matches_burns_ops::<B>(&device);
    common::rotary_matches_burns_ops::<fusion::F>(&device);
}

/// Every case through the reference path and the fused path at ranks {1, 2}, n {1, 3}, every
/// strategy, in issue order and with a worker per stream, and under a memory budget, within
/// 1e-4; and the reference path
/// and the in-order fused path under no reuse and S4 again through burn's fusion, which must
/// match the case and the raw backend's results (`fusion::check_through_fusion`).
#[test]
fn every_case_on_wgpu() {
    let _device = shared();
    let device = Default::default();
    let mut failures = Vec::new();
    let mut runs = 0;
    let mut fusion_runs = 0;
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        for n_ranks in [1, 2]
            .into_iter()
            .filter(|r| case.config.n_experts.is_multiple_of(*r))
        {
            let mut options = vec![CheckOptions {
                path: ExchangePath::Reference,
                n_ranks,
                ..CheckOptions::default()
            }];
            for n in [1, 3] {
                for strategy in Strategy::ALL {
                    for executor in [None, Some(StepExecutor::StreamThreads)] {
                        options.push(CheckOptions {
                            path: ExchangePath::Fused,
                            n_ranks,
                            partitions: Partitions::Fixed(n),
                            strategy,
                            executor,
                            ..CheckOptions::default()
                        });
                    }
                }
            }
            // Under a memory budget the layer runs the experts' activations expert by expert,
            // as the memory model replays them (`exchange/ffn`, `Scope`); without one, over
            // the whole partition. Both must give the case.
            options.push(CheckOptions {
                path: ExchangePath::Fused,
                n_ranks,
                partitions: Partitions::Fixed(3),
                memory_budget: Some(usize::MAX / 4),
                ..CheckOptions::default()
            });
            for o in options {
                let label = format!(
                    "{} {} ranks={} {:?} {} {:?} budget {:?}",
                    case.name,
                    o.path.name(),
                    o.n_ranks,
                    o.partitions,
                    o.strategy,
                    o.executor,
                    o.memory_budget
                );
                match check_case::<B>(&case, &o, &device) {
                    Ok(report) => {
                        if !report.passed(1e-4) {
                            failures.push(format!("{label}: {:?}", report.worst()));
                        }
                        if fusion::covers(&o) {
                            fusion_runs += 1;
                            let mut found = fusion::check_through_fusion(&case, &o, &report, &device);
                            failures.extend(found.drain(..).map(|f| format!("{label} through fusion: {f}")));
                        }
                    }
                    Err(e) => failures.push(format!("{label}: {e}")),
                }
                runs += 1;
            }
        }
    }
    eprintln!("{runs} configurations checked on wgpu, {fusion_runs} of them through fusion too");
    assert!(
        fusion_runs >= 7 * 5,
        "only {fusion_runs} configurations ran through fusion"
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// No device memory is lost per step: 20 forward + backward steps of the fused exchange (n = 3)
/// under every strategy leave cubecl's in-use bytes and its reserved pool where the first
/// steps left them, so no partition buffer, offload or saved activation outlives its step.
#[test]
fn device_memory_does_not_grow_over_twenty_steps() {
    let _device = alone();
    let device = WgpuDevice::default();
    let client = WgpuRuntime::client(&device);
    for strategy in Strategy::ALL {
        let layer = MoeLayerConfig::new(16, 32, 4, 2)
            .with_partitions(Partitions::Fixed(3))
            .with_memory_reuse(MemoryReuse::from(strategy))
            .init::<B>(&device);
        let x = Tensor::<B, 2>::random([48, 16], Distribution::Default, &device).require_grad();
        let step = || train_step(&layer, &x);
        let usage = || {
            let u = client.memory_usage().expect("memory usage");
            (u.bytes_in_use, u.bytes_reserved)
        };
        // Warm-up: autotune and the pool's first pages.
        for _ in 0..3 {
            step();
        }
        let (in_use, reserved) = usage();
        let mut seen = Vec::new();
        for _ in 0..20 {
            step();
            seen.push(usage());
        }
        assert!(
            seen.iter().all(|&(u, r)| u <= in_use && r <= reserved),
            "{strategy:?}: after warm-up {in_use} in use / {reserved} reserved; then {seen:?}"
        );
    }
}

/// The partition arena (on by default on a CubeCL backend, in issue order): after warm-up,
/// 20 more forward + backward steps at n = 3 allocate nothing under every strategy that
/// reuses the partition buffers, and the arena holds what the paper's buffers come to
/// (§III-C: two partitions of `T_DI`, one of `T_M`, two of `T_DO`, with backward's `dT_DO` in
/// `T_DO`'s buffers, plus the two `dT_DI` partitions backward writes beside them; `T_DI` only
/// where the received rows must be permuted, which one rank never needs), within 15%.
/// Under `none`, which keeps every partition's `T_DI` and `T_M` for backward, the kept
/// buffers leave with the saved tensors and the arena allocates the slots again, so the
/// arena never hands out a buffer that something still holds. Every case above ran through
/// the same arena (the layers there build it the same way). Weights and input are seeded:
/// the partitions' sizes, and so the reserved bytes, follow the routing.
#[test]
fn the_partition_arena_reuses_one_buffer_per_slot() {
    let _device = shared();
    let device = WgpuDevice::default();
    let (d_model, d_hidden, n_experts, top_k, tokens, n) = (64, 256, 4, 2, 96, 3);
    for strategy in Strategy::ALL {
        let layer = MoeLayerConfig::new(d_model, d_hidden, n_experts, top_k)
            .with_partitions(Partitions::Fixed(n))
            .with_memory_reuse(MemoryReuse::from(strategy))
            .with_seed(5)
            .init::<B>(&device);
        let arena = layer.context().partition_arena();
        let x = TensorData::new(seeded_uniform(6, "x", tokens * d_model, 1.0), [tokens, d_model]);
        let x = Tensor::<B, 2>::from_data(x, &device).require_grad();
        let step = || train_step(&layer, &x);
        for _ in 0..3 {
            step();
        }
        let warm = arena.stats();
        for _ in 0..20 {
            step();
        }
        let after = arena.stats();
        assert!(
            warm.allocations > 0,
            "{strategy:?}: the arena was not used: {warm:?}"
        );
        if strategy == Strategy::None {
            // Within one forward, partitions 1..n find `T_M`'s buffer still held by the
            // partition before them (saved for backward), so each allocates; only partition
            // 0 may take the buffer the previous step's backward let go, and only when it
            // fits. So at least n - 1 allocations a step; without the arena's check that it
            // holds the last reference there would be none.
            assert!(
                after.allocations >= warm.allocations + 20 * (n as u64 - 1),
                "{strategy:?}: kept partitions must take their buffers with them: {warm:?} → {after:?}"
            );
            continue;
        }
        assert_eq!(
            after.allocations, warm.allocations,
            "{strategy:?}: the arena allocated after warm-up: {warm:?} → {after:?}"
        );
        assert!(after.reuses > warm.reuses, "{strategy:?}: {warm:?} → {after:?}");
        // The paper's model (Eq. 8): with reuse, `T_DI`, `T_M` and `T_DO` (B·M + B·H + B·M
        // without it) shrink by ΔM_act to 2·B·M/n + B·H/n + 2·B·M/n; backward's two `dT_DI`
        // partitions add 2·B·M/n. On one rank the received rows need no permutation, so
        // `T_DI` is used as it arrives (a view of `T_I`, no copy) and its 2·B·M/n is not in
        // the arena. One rank, dropless: B = tokens · top_k.
        let shape = LayerShape {
            top_k,
            n_experts,
            ..LayerShape::paper(tokens, d_model, d_hidden, 1, n)
        };
        let terms = PaperTerms::new(&shape);
        let (b, m, h) = (shape.rows(), d_model as f64, d_hidden as f64);
        let forward = 2.0 * b * m + b * h - terms.delta_m_act;
        let t_di = 2.0 * b * m / n as f64;
        let model = 4.0 * (forward - t_di + 2.0 * b * m / n as f64);
        let held = after.reserved_bytes as f64;
        assert!(
            (held - model).abs() <= 0.15 * model,
            "{strategy:?}: the arena holds {held} bytes, the paper's buffers {model}"
        );
        eprintln!("{strategy:?}: arena {held} bytes, model {model}, {after:?}");
    }
}

/// A buffer is handed out again only on the thread (cubecl stream) that last had it: a step
/// on another thread allocates its slots anew, and the first thread's next step does too,
/// because the device orders work only within one stream.
#[test]
fn the_arena_reuses_a_buffer_only_on_the_thread_that_last_used_it() {
    let _device = shared();
    let device = WgpuDevice::default();
    let layer = MoeLayerConfig::new(16, 32, 4, 2)
        .with_partitions(Partitions::Fixed(2))
        .with_memory_reuse(MemoryReuse::from(Strategy::S4))
        .init::<B>(&device);
    let arena = layer.context().partition_arena();
    let x = Tensor::<B, 2>::random([24, 16], Distribution::Default, &device).require_grad();
    train_step(&layer, &x);
    train_step(&layer, &x);
    let settled = arena.stats().allocations;
    train_step(&layer, &x);
    assert_eq!(arena.stats().allocations, settled, "same thread: reused");
    std::thread::scope(|s| {
        s.spawn(|| train_step(&layer, &x))
            .join()
            .expect("step on another thread");
    });
    let other = arena.stats().allocations;
    assert!(
        other > settled,
        "another thread must not reuse: {settled} → {other}"
    );
    train_step(&layer, &x);
    assert!(
        arena.stats().allocations > other,
        "back on the first thread, the buffers were last used elsewhere"
    );
}

/// The arena's device ops against plain tensor ops on WGPU: rows copied into a padded
/// expert-major buffer (a permutation, an expert without rows, blocks at the device's
/// alignment) read back as `select`; a GEMM with bias written into a block view equals
/// `matmul + bias`, and writing one block leaves its neighbours alone. (The exchange's
/// outputs and every gradient through these ops are checked against the reference path on
/// every case above.)
#[test]
fn arena_ops_match_plain_tensor_ops() {
    let _device = shared();
    type W = Wgpu;
    let device = WgpuDevice::default();
    let mut run = ExchangeRun::new(
        Arc::new(SingleRank),
        Activation::Gelu,
        Strategy::S1,
        HostStore::default(),
    );
    run.arena = Some(PartitionArena::new());
    // 6 columns of f32 are 24 bytes: unless the device binds at 8 bytes, blocks are padded.
    let width = 6;
    let rows_per_expert = [3, 0, 5, 1];
    let n_rows: usize = rows_per_expert.iter().sum();
    let src = Tensor::<W, 2>::random([n_rows, width], Distribution::Default, &device);
    let prim = src.clone().into_primitive().tensor();
    let mem = <W as MoeBackend>::slot_memory(&run, &prim).expect("WGPU has a partition arena");
    let layout = BlockLayout::new(&rows_per_expert, mem.row_align(width));
    let perm: Vec<usize> = vec![4, 0, 7, 2, 8, 1, 3, 6, 5];
    let slot = Slot {
        role: Role::Dispatched,
        index: 0,
    };
    let buffer = mem.buffer(slot, layout.total(), width).expect("buffer");
    mem.copy_rows(&buffer, &layout.buffer_rows(), prim.clone(), &perm);
    let placed = Tensor::<W, 2>::from_primitive(TensorPrimitive::Float(buffer.clone()));
    let rows_of = |t: Tensor<W, 2>, idx: &[usize]| {
        let idx: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
        t.select(0, Tensor::<W, 1, Int>::from_data(idx.as_slice(), &device))
            .into_data()
    };
    assert_eq!(
        rows_of(placed, &layout.buffer_rows()),
        rows_of(src.clone(), &perm)
    );

    // Expert 2's block (5 rows) = x_e · w + b, in place in the buffer.
    let w = Tensor::<W, 2>::random([width, width], Distribution::Default, &device);
    let b = Tensor::<W, 2>::random([1, width], Distribution::Default, &device);
    let x_e = src.clone().slice([0..5, 0..width]);
    let out = mem.rows(&buffer, layout.start(2), 5);
    mem.gemm_into(
        &out,
        x_e.clone().into_primitive().tensor(),
        w.clone().into_primitive().tensor(),
        Some(b.clone().into_primitive().tensor()),
    )
    .expect("GEMM into the arena");
    // An adapter's term `u · v` added in place to the block the GEMM wrote.
    let u = Tensor::<W, 2>::random([5, 2], Distribution::Default, &device);
    let v = Tensor::<W, 2>::random([2, width], Distribution::Default, &device);
    let term = u.matmul(v);
    mem.add_into(&out, term.clone().into_primitive().tensor());
    let got = Tensor::<W, 2>::from_primitive(TensorPrimitive::Float(out));
    let want = x_e.matmul(w) + b + term;
    got.into_data()
        .assert_approx_eq::<f32>(&want.into_data(), burn::tensor::Tolerance::rel_abs(1e-5, 1e-6));
    let placed = Tensor::<W, 2>::from_primitive(TensorPrimitive::Float(buffer));
    let others: Vec<usize> = layout
        .buffer_rows()
        .into_iter()
        .filter(|&r| r < layout.start(2) || r >= layout.start(2) + 5)
        .collect();
    let sources: Vec<usize> = layout
        .buffer_rows()
        .iter()
        .zip(&perm)
        .filter(|(r, _)| others.contains(r))
        .map(|(_, &p)| p)
        .collect();
    assert_eq!(rows_of(placed, &others), rows_of(src, &sources));
}

/// Half precision through the fused exchange on a CubeCL backend: every case in f16, n = 3,
/// keeping everything (none), offloading both activations (S1) and re-communicating and
/// recomputing them (S4), within 1e-2: f16 keeps 11 bits of mantissa, and the measured worst
/// on llvmpipe was 3.5e-3 (f32 gives about 1e-6, so an f32 path would not show here).
#[test]
fn every_case_in_f16_on_wgpu() {
    let _device = shared();
    type H = Autodiff<Wgpu<burn::tensor::f16, i32>>;
    let device = Default::default();
    let mut failures = Vec::new();
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        for strategy in [Strategy::None, Strategy::S1, Strategy::S4] {
            let options = CheckOptions {
                path: ExchangePath::Fused,
                n_ranks: 1,
                partitions: Partitions::Fixed(3),
                strategy,
                ..CheckOptions::default()
            };
            match check_case::<H>(&case, &options, &device) {
                Ok(report) if report.passed(1e-2) => {}
                Ok(report) => failures.push(format!("{} {strategy}: {:?}", case.name, report.worst())),
                Err(e) => failures.push(format!("{} {strategy}: {e}", case.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The threaded executor's workers issue on the same cubecl streams for every pass a thread
/// runs: 100 passes of a schedule that uses all three streams see one stream id per schedule
/// stream (read with cubecl's `StreamId::current()` inside the workers), three different ones,
/// none the calling thread's own; another calling thread (another rank) gets other ones.
#[test]
fn worker_streams_are_the_same_for_every_pass() {
    let _device = shared();
    let device = WgpuDevice::default();
    let schedule = Schedule::forward(3, Strategy::S1);
    let seen_from = || {
        let seen: Mutex<BTreeMap<String, BTreeSet<u64>>> = Mutex::default();
        for _ in 0..100 {
            let streams = <Wgpu as MoeBackend>::worker_streams(&device);
            execute_on(streams.as_ref(), &schedule, &|_, step| {
                let id = StreamId::current().value;
                assert_eq!(streams.current_stream_id(), Some(id));
                seen.lock()
                    .unwrap()
                    .entry(format!("{:?}", step.stream()))
                    .or_default()
                    .insert(id);
                Ok(Vec::new())
            })
            .expect("a pass of empty steps");
        }
        seen.into_inner().unwrap()
    };
    let own = StreamId::current().value;
    let seen = seen_from();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        seen.values().all(|ids| ids.len() == 1),
        "a stream changed ids: {seen:?}"
    );
    let ids: BTreeSet<u64> = seen.values().flatten().copied().collect();
    assert_eq!(ids.len(), 3, "{seen:?}");
    assert!(!ids.contains(&own));
    assert_eq!(seen_from(), seen, "the same thread, the same streams");
    let other = std::thread::scope(|scope| scope.spawn(seen_from).join().unwrap());
    let other_ids: BTreeSet<u64> = other.values().flatten().copied().collect();
    assert!(ids.is_disjoint(&other_ids), "{seen:?} / {other:?}");
}

/// Device memory of the threaded executor does not grow: two layers, 20 forward + backward
/// steps each (n = 3) under every strategy, after warm-up leave the bytes in use and reserved
/// on the worker streams and the calling thread's stream where the warm-up left them; and the
/// layers really issue on those worker streams (the compute stream's pool holds memory), so no
/// pass made streams of its own.
#[test]
fn device_memory_does_not_grow_with_the_threaded_executor() {
    let _device = alone();
    let device = WgpuDevice::default();
    let client = WgpuRuntime::client(&device);
    for strategy in Strategy::ALL {
        let layers: Vec<MoeLayer<B>> = (0..2)
            .map(|seed| {
                let mut config = MoeLayerConfig::new(16, 32, 4, 2)
                    .with_partitions(Partitions::Fixed(3))
                    .with_memory_reuse(MemoryReuse::from(strategy))
                    .with_seed(seed);
                config.executor = Some(StepExecutor::StreamThreads);
                config.init::<B>(&device)
            })
            .collect();
        let x = Tensor::<B, 2>::random([48, 16], Distribution::Default, &device).require_grad();
        let step = || layers.iter().for_each(|layer| train_step(layer, &x));
        // Bytes in use and reserved on each worker stream, then on this thread's stream.
        let usage = || {
            let streams = <Wgpu as MoeBackend>::worker_streams(&device);
            let mut rows = Vec::new();
            for stream in [Stream::Comm, Stream::Compute, Stream::Copy] {
                streams
                    .run_on(stream, &mut || {
                        let u = client.memory_usage().expect("memory usage");
                        rows.push((u.bytes_in_use, u.bytes_reserved));
                        Ok(())
                    })
                    .unwrap();
            }
            let u = client.memory_usage().expect("memory usage");
            rows.push((u.bytes_in_use, u.bytes_reserved));
            rows
        };
        for _ in 0..3 {
            step();
        }
        let warm = usage();
        // The compute worker's stream allocates every expert output; on one rank the comm
        // worker's all-to-alls are the identity and the assembled output is the caller's.
        assert!(
            warm[1].1 > 0,
            "{strategy:?}: the compute worker's stream holds no memory: {warm:?}"
        );
        for _ in 0..20 {
            step();
            let now = usage();
            assert!(
                now.iter().zip(&warm).all(|(n, w)| n.0 <= w.0 && n.1 <= w.1),
                "{strategy:?}: after warm-up {warm:?}; then {now:?}"
            );
        }
    }
}

/// `case` through the fused path on `n_ranks` ranks cut into `partitions`, with `shadowing`,
/// on both executors and under every strategy, within 1e-4.
fn check_skewed(case: &Case, n_ranks: usize, partitions: Partitions, shadowing: Shadowing) {
    let device = Default::default();
    for executor in [StepExecutor::InOrder, StepExecutor::StreamThreads] {
        for strategy in Strategy::ALL {
            let options = CheckOptions {
                path: ExchangePath::Fused,
                n_ranks,
                partitions,
                strategy,
                executor: Some(executor),
                shadowing,
                ..CheckOptions::default()
            };
            let report = check_case::<B>(case, &options, &device).unwrap();
            assert!(report.passed(1e-4), "{options:?}: {:?}", report.worst());
        }
    }
}

/// Ranks that receive no rows: every token to expert 0, which lives on rank 0, so rank 1's
/// partition slots are all empty (zero-row receives, combines and expert blocks) under every
/// strategy, on both executors, within 1e-4; and no op on zero elements reaches the device
/// (the row helpers' debug assertion, `exchange/rows.rs`, fails the test where one does).
#[test]
fn a_rank_that_receives_no_rows_on_wgpu() {
    let _device = shared();
    check_skewed(
        &Case::all_to_one_expert(4, 10).expect("case"),
        2,
        Partitions::Fixed(3),
        Shadowing::Off,
    );
}

/// Shadowed experts on a device backend: every token to expert 0 (rank 0's), shadowed on both
/// ranks (`Shadowing::Fixed(1)`), so rank 1 computes its own rows with the copy of expert 0's
/// weights that reached it through the all-to-all, and the copy's gradient returns to rank 0;
/// expert 1 stays unshadowed. Every strategy, both executors (the copies cross streams),
/// n = 3, within 1e-4 of the case, whose gradients are those of the layer without shadows.
#[test]
fn shadowed_experts_on_wgpu() {
    let _device = shared();
    check_skewed(
        &Case::all_to_one_expert(4, 10).expect("case"),
        2,
        Partitions::Fixed(3),
        Shadowing::Fixed(1),
    );
}

/// Routing skew under `Partitions::ByRank` (one partition per source rank): every token to
/// expert 0 with 4 ranks and 2 local experts each, so in every partition ranks 1-3 receive
/// nothing, rank 0 receives from one rank only, and ranks return nothing to the ranks they
/// heard nothing from. Every op the exchange issues on a zero-row partition would launch a
/// kernel with an empty grid, which CUDA rejects; the row helpers' debug assertion (module
/// docs of `exchange/rows.rs`) fails this test wherever one does. Both executors, every
/// strategy, within 1e-4.
#[test]
fn routing_skew_by_rank_issues_no_empty_kernel_on_wgpu() {
    let _device = shared();
    check_skewed(
        &Case::all_to_one_expert(8, 12).expect("case"),
        4,
        Partitions::ByRank,
        Shadowing::Off,
    );
}

/// At a shape where the streams' work takes long enough for a missing fence to show (d_model
/// 256, d_hidden 1024, 4096 tokens, top-2 of 8 experts, n = 4; the copy stream busy under S1),
/// the threaded executor's output and every gradient equal the in-order executor's within
/// 1e-5 relative.
#[test]
fn threaded_and_in_order_agree_at_a_realistic_shape() {
    let _device = shared();
    let device = WgpuDevice::default();
    let (d_model, d_hidden, n_experts, top_k, tokens) = (256, 1024, 8, 2, 4096);
    let x = TensorData::new(seeded_uniform(11, "x", tokens * d_model, 1.0), [tokens, d_model]);
    for strategy in [Strategy::S1] {
        let run = |executor: StepExecutor| {
            let mut config = MoeLayerConfig::new(d_model, d_hidden, n_experts, top_k)
                .with_partitions(Partitions::Fixed(4))
                .with_memory_reuse(MemoryReuse::from(strategy))
                .with_seed(3);
            config.executor = Some(executor);
            let layer = config.init::<B>(&device);
            let x = Tensor::<B, 2>::from_data(x.clone(), &device).require_grad();
            let out = layer.forward(x.clone());
            let probe = Tensor::<B, 2>::from_data(
                TensorData::new(
                    seeded_uniform(12, "probe", tokens * d_model, 1.0),
                    [tokens, d_model],
                ),
                &device,
            );
            let grads = (out.output.clone() * probe).sum().backward();
            let vec = |t: Tensor<Inner, 2>| t.into_data().to_vec::<f32>().unwrap();
            vec![
                ("y", vec(out.output.inner())),
                ("dx", vec(x.grad(&grads).unwrap())),
                ("dw_in", vec(flat(layer.experts.w_in.grad(&grads).unwrap()))),
                ("dw_out", vec(flat(layer.experts.w_out.grad(&grads).unwrap()))),
            ]
        };
        let in_order = run(StepExecutor::InOrder);
        let threaded = run(StepExecutor::StreamThreads);
        for ((name, a), (_, b)) in in_order.iter().zip(&threaded) {
            let diff: f64 = a
                .iter()
                .zip(b)
                .map(|(p, q)| ((p - q) as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            let norm: f64 = a.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
            assert!(norm > 0.0, "{strategy:?} {name}: all zeros");
            assert!(
                diff <= 1e-5 * norm,
                "{strategy:?} {name}: relative difference {}",
                diff / norm
            );
        }
    }
}

/// A `[n_experts, rows, cols]` expert weight as one `[n_experts * rows, cols]` matrix.
fn flat(t: Tensor<Inner, 3>) -> Tensor<Inner, 2> {
    let [e, r, c] = t.dims();
    t.reshape([e * r, c])
}

/// The CubeCL activation kernels (one pass each: exact GELU and SwiGLU, forward and
/// derivative) against the composed forms (NdArray's defaults, in f64-checked f32) on a
/// contiguous tensor, a row slice at an offset and a transposed view (which the kernels hand
/// to the composed form): every value within 1e-5 of the composed one, relative to its size.
/// Values span [-10, 10], the tails of the erf and the sigmoid included. A wrong half of
/// `[gate | up]`, a wrong constant or a derivative term dropped fails it.
#[test]
fn cubecl_activation_kernels_match_the_composed_form() {
    use burn::backend::NdArray;
    use mpipemoe::backend::ActivationKernels;

    let _guard = shared();
    let device = WgpuDevice::default();
    let (rows, h) = (40, 350);
    let z_values: Vec<f32> = (0..rows * 2 * h)
        .map(|i| ((i * 7919) % 2003) as f32 / 100.0 - 10.0)
        .collect();
    let g_values: Vec<f32> = (0..rows * h)
        .map(|i| ((i * 104729) % 1009) as f32 / 500.0 - 1.0)
        .collect();
    let gpu = |v: &[f32], shape: [usize; 2]| {
        Tensor::<Inner, 2>::from_data(TensorData::new(v.to_vec(), shape), &device)
    };
    let host = |t: Tensor<Inner, 2>| t.into_data().to_vec::<f32>().unwrap();
    let wrap = |p| Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(p));
    let nd = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<NdArray, 2>::from_data(TensorData::new(v, shape), &Default::default())
            .into_primitive()
            .tensor()
    };
    let nd_host = |p| {
        Tensor::<NdArray, 2>::from_primitive(TensorPrimitive::Float(p))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let close = |name: &str, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{name}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{name}[{i}]: {g} against {w}"
            );
        }
    };
    let z_full = gpu(&z_values, [rows, 2 * h]);
    let g_full = gpu(&g_values, [rows, h]);
    let views: [(&str, Tensor<Inner, 2>, Tensor<Inner, 2>); 3] = [
        ("contiguous", z_full.clone(), g_full.clone()),
        (
            "row slice",
            z_full.clone().narrow(0, 13, 11),
            g_full.clone().narrow(0, 13, 11),
        ),
        (
            "transposed",
            gpu(&host(z_full.clone().transpose()), [2 * h, rows]).transpose(),
            gpu(&host(g_full.clone().transpose()), [h, rows]).transpose(),
        ),
    ];
    for (name, z, g) in views {
        let (zs, gs) = (host(z.clone()), host(g.clone()));
        let [r, _] = z.dims();
        let p = |t: Tensor<Inner, 2>| t.into_primitive().tensor();
        close(
            &format!("{name} swiglu"),
            &host(wrap(Inner::swiglu(p(z.clone())))),
            &nd_host(<NdArray as ActivationKernels>::swiglu(nd(zs.clone(), [r, 2 * h]))),
        );
        close(
            &format!("{name} swiglu backward"),
            &host(wrap(Inner::swiglu_backward(p(z.clone()), p(g.clone())))),
            &nd_host(<NdArray as ActivationKernels>::swiglu_backward(
                nd(zs.clone(), [r, 2 * h]),
                nd(gs.clone(), [r, h]),
            )),
        );
        // GPT-OSS's clamp at 7: the values run from -10 to 10 in hundredths, so some lie
        // exactly on each bound (where the gradient passes) and some past it (where it does not).
        let (alpha, limit) = (1.702, 7.0);
        close(
            &format!("{name} clamped swiglu"),
            &host(wrap(Inner::clamped_swiglu(p(z.clone()), alpha, limit))),
            &nd_host(<NdArray as ActivationKernels>::clamped_swiglu(
                nd(zs.clone(), [r, 2 * h]),
                alpha,
                limit,
            )),
        );
        close(
            &format!("{name} clamped swiglu backward"),
            &host(wrap(Inner::clamped_swiglu_backward(
                p(z.clone()),
                p(g.clone()),
                alpha,
                limit,
            ))),
            &nd_host(<NdArray as ActivationKernels>::clamped_swiglu_backward(
                nd(zs.clone(), [r, 2 * h]),
                nd(gs.clone(), [r, h]),
                alpha,
                limit,
            )),
        );
        // GELU on the gate half's shape: z's first `h` columns as a tensor of their own.
        let zg = gpu(
            &zs.chunks(2 * h)
                .flat_map(|row| row[..h].to_vec())
                .collect::<Vec<_>>(),
            [r, h],
        );
        let zgs = host(zg.clone());
        close(
            &format!("{name} gelu"),
            &host(wrap(Inner::gelu_exact(p(zg.clone())))),
            &nd_host(<NdArray as ActivationKernels>::gelu_exact(nd(
                zgs.clone(),
                [r, h],
            ))),
        );
        close(
            &format!("{name} gelu backward"),
            &host(wrap(Inner::gelu_backward_exact(p(zg.clone()), p(g.clone())))),
            &nd_host(<NdArray as ActivationKernels>::gelu_backward_exact(
                nd(zgs, [r, h]),
                nd(gs, [r, h]),
            )),
        );
        // The value and the derivative from one kernel (the experts' backward on the arena)
        // are the two kernels' own, bit for bit: the forward's activation is recomputed
        // there, and a different value would train a different model.
        let pairs = [
            (
                "gelu",
                Inner::gelu_with_backward_exact(p(zg.clone()), p(g.clone())),
                (
                    Inner::gelu_exact(p(zg.clone())),
                    Inner::gelu_backward_exact(p(zg), p(g.clone())),
                ),
            ),
            (
                "swiglu",
                Inner::swiglu_with_backward(p(z.clone()), p(g.clone())),
                (
                    Inner::swiglu(p(z.clone())),
                    Inner::swiglu_backward(p(z.clone()), p(g.clone())),
                ),
            ),
            (
                "clamped swiglu",
                Inner::clamped_swiglu_with_backward(p(z.clone()), p(g.clone()), alpha, limit),
                (
                    Inner::clamped_swiglu(p(z.clone()), alpha, limit),
                    Inner::clamped_swiglu_backward(p(z), p(g), alpha, limit),
                ),
            ),
        ];
        for (what, (value, grad), (want_value, want_grad)) in pairs {
            let bits = |t| host(wrap(t)).into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(value),
                bits(want_value),
                "{name} {what} with backward: the value"
            );
            assert_eq!(
                bits(grad),
                bits(want_grad),
                "{name} {what} with backward: the derivative"
            );
        }
    }
}

/// The device-library hook of the experts' compute (`ExpertPath`) on a CubeCL backend, with
/// its plain-primitive twin behind it: the partitions in the arena (padded blocks, in issue
/// order) and on worker streams (the threaded executor: the hook's buffers written on the
/// compute stream and read on the comm stream), one and two ranks, the skewed case included
/// (empty blocks), within 1e-4 of the cases, and the hook taken.
#[test]
fn the_expert_hook_on_wgpu_in_order_and_threaded() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::tensor::ops::FloatTensor;
    use mpipemoe::backend::{ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertPath};
    use mpipemoe::comm::{RowPaths, WithRowPaths};
    use mpipemoe::harness::check_case_through;
    use mpipemoe::Communicator;

    #[derive(Debug, Default)]
    struct Counted(AtomicUsize);
    impl ExpertPath<Inner> for Counted {
        fn forward(
            &self,
            job: ExpertForward<'_, Inner>,
        ) -> mpipemoe::Result<(FloatTensor<Inner>, FloatTensor<Inner>)> {
            self.0.fetch_add(1, Ordering::Relaxed);
            ComposedExperts.forward(job)
        }
        fn backward(&self, job: ExpertBackward<'_, Inner>) -> mpipemoe::Result<ExpertBackwardOut<Inner>> {
            self.0.fetch_add(1, Ordering::Relaxed);
            ComposedExperts.backward(job)
        }
    }

    let _device = shared();
    let device = WgpuDevice::default();
    let mut cases: Vec<Case> = case_files()
        .iter()
        .take(1)
        .map(|f| Case::load(f).expect("case"))
        .collect();
    cases.push(Case::all_to_one_expert(4, 10).expect("case"));
    for case in &cases {
        for n_ranks in [1, 2] {
            for executor in [StepExecutor::InOrder, StepExecutor::StreamThreads] {
                let options = CheckOptions {
                    path: ExchangePath::Fused,
                    n_ranks,
                    partitions: Partitions::Fixed(3),
                    strategy: Strategy::S4,
                    executor: Some(executor),
                    ..CheckOptions::default()
                };
                let counted = Arc::new(Counted::default());
                let paths = RowPaths::new().with_experts::<Inner>(counted.clone());
                let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
                    Arc::new(WithRowPaths::adding(comm, paths.clone()))
                };
                let what = format!("{} ranks {n_ranks} {executor:?}", case.name);
                let report = check_case_through::<B>(case, &options, &device, &wrap)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(report.passed(1e-4), "{what}: {:?}", report.worst());
                assert!(
                    counted.0.load(Ordering::Relaxed) >= 2 * n_ranks,
                    "{what}: the hook was not taken"
                );
            }
        }
    }
}

/// Low-rank adapters on the experts through the fused op's CubeCL path (the arena's blocks,
/// the adapter's term added in place with `SlotMemory::add_into`), against the reference
/// twin on the same device (which runs `w + scale · a · b` and which the CPU tests hold to a
/// float64 oracle): outputs and every adapter gradient, base weights frozen, at n = 3 with S4
/// (the recomputed `T_M` includes the adapter's term); then the same with a device library
/// offered, through which the primitives then multiply (each block copied into the arena's
/// buffer). One configuration: every strategy's difference is the CPU tests' business, and
/// each one here costs llvmpipe's kernel builds.
#[test]
fn expert_adapters_on_wgpu_match_the_reference_twin() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::tensor::ops::FloatTensor;
    use mpipemoe::backend::{ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertPath};
    use mpipemoe::comm::{RowPaths, WithRowPaths};
    use mpipemoe::Communicator;

    let _device = shared();
    let device = WgpuDevice::default();
    let spec = mpipemoe::ExpertLoraSpec {
        rank: 3,
        alpha: 6.0,
        scaling: mpipemoe::LoraScaling::Standard,
        w_in: true,
        w_out: true,
    };
    let base = MoeLayerConfig::new(16, 24, 4, 2)
        .with_activation(Activation::SwiGlu)
        .with_bias(true)
        .with_seed(5);
    let x = Tensor::<B, 2>::random([40, 16], Distribution::Default, &device);
    let g = Tensor::<B, 2>::random([40, 16], Distribution::Default, &device);
    let run_on = |config: MoeLayerConfig, comm: Arc<dyn Communicator>| {
        let mut layer = config
            .init_rank::<B>(&device, comm)
            .unwrap()
            .freeze_all_but_adapters()
            .with_adapters(&spec, 9)
            .unwrap();
        // Fresh adapters have `b = 0`; these do not, the same on every run.
        let adapters = layer.adapters.as_mut().unwrap();
        for (key, lora) in [
            ("b_in", adapters.w_in.as_mut()),
            ("b_out", adapters.w_out.as_mut()),
        ] {
            let lora = lora.unwrap();
            let dims = lora.b.dims();
            let values = seeded_uniform(1, key, dims.iter().product(), 0.5);
            lora.b =
                burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(values, dims), &device));
        }
        let out = layer.forward(x.clone()).output;
        let grads = (out.clone() * g.clone()).sum().backward();
        let adapters = layer.adapters.as_ref().unwrap();
        let mut all = vec![out.into_data()];
        for lora in [adapters.w_in.as_ref().unwrap(), adapters.w_out.as_ref().unwrap()] {
            all.push(lora.a.grad(&grads).expect("a's gradient").into_data());
            all.push(lora.b.grad(&grads).expect("b's gradient").into_data());
        }
        assert!(
            layer.experts.w_in.grad(&grads).is_none(),
            "a frozen weight took a gradient"
        );
        all
    };
    let run = |config: MoeLayerConfig| run_on(config, Arc::new(SingleRank));
    let want = run(base.clone().with_path(ExchangePath::Reference));
    let fused = base
        .with_path(ExchangePath::Fused)
        .with_partitions(Partitions::Fixed(3))
        .with_memory_reuse(MemoryReuse::S4);
    let got = run(fused.clone());
    for (got, want) in got.into_iter().zip(&want) {
        got.assert_approx_eq::<f32>(want, burn::tensor::Tolerance::rel_abs(1e-4, 1e-5));
    }
    // The same with a device library offered (as cuBLAS is on CUDA): the adapters keep the
    // experts on the primitives, whose products now go through the library, each block copied
    // into the arena's buffer.
    #[derive(Debug, Default)]
    struct DenseOnly(AtomicUsize);
    impl ExpertPath<Inner> for DenseOnly {
        fn forward(
            &self,
            _: ExpertForward<'_, Inner>,
        ) -> mpipemoe::Result<(FloatTensor<Inner>, FloatTensor<Inner>)> {
            Err(mpipemoe::MoeError::Backend(
                "a job with adapters reached the library".into(),
            ))
        }
        fn backward(&self, _: ExpertBackward<'_, Inner>) -> mpipemoe::Result<ExpertBackwardOut<Inner>> {
            Err(mpipemoe::MoeError::Backend(
                "a job with adapters reached the library".into(),
            ))
        }
        fn matmul(
            &self,
            lhs: FloatTensor<Inner>,
            rhs: FloatTensor<Inner>,
            _: mpipemoe::GemmPrecision,
        ) -> mpipemoe::Result<FloatTensor<Inner>> {
            use burn::tensor::ops::FloatTensorOps;
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(<Inner as FloatTensorOps<Inner>>::float_matmul(lhs, rhs))
        }
    }
    let library = Arc::new(DenseOnly::default());
    let comm: Arc<dyn Communicator> = Arc::new(WithRowPaths::adding(
        Arc::new(SingleRank),
        RowPaths::new().with_experts::<Inner>(library.clone()),
    ));
    let got = run_on(fused, comm);
    assert!(
        library.0.load(Ordering::Relaxed) > 0,
        "no product went through the library"
    );
    for (got, want) in got.into_iter().zip(&want) {
        got.assert_approx_eq::<f32>(want, burn::tensor::Tolerance::rel_abs(1e-4, 1e-5));
    }
}

/// Steps 4 and 6's row moves on WGPU (`MoeBackend::gather_rows` / `combine_rows`: the combine
/// a kernel of its own on the CubeCL backends, each op the other's backward under autodiff)
/// against burn's `select` and `select_assign` onto zeros, which they replace: outputs and
/// gradients bit for bit, with tokens of three rows, of none, rows in any order, a width that
/// is no multiple of a vector, a transposed (strided) input, and a width-1 tensor (the combine
/// weights' slots). A dropped row, a row summed onto the wrong token or a sum in another order
/// fails it.
#[test]
fn row_moves_on_wgpu_match_burns_select_ops() {
    use burn::tensor::IndexingUpdateOp;
    use mpipemoe::backend::RowMap;

    let _guard = shared();
    let device = WgpuDevice::default();
    let value = |i: usize| ((i * 7919) % 2003) as f32 / 97.0 - 10.0;
    for (n_targets, width, transposed) in [(37usize, 13usize, false), (37, 13, true), (64, 1, false)] {
        // Target 5 gets three rows, every third target none.
        let targets: Vec<usize> = (0..n_targets * 2)
            .map(|i| (i * 17) % n_targets)
            .filter(|t| t % 3 != 1)
            .chain([5, 5])
            .collect();
        let n_rows = targets.len();
        let map = Arc::new(RowMap::new(targets.clone(), n_targets));
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(targets.iter().map(|&t| t as i64).collect::<Vec<_>>(), [n_rows]),
            &device,
        );
        let make = |rows: usize, seed: usize| {
            let data: Vec<f32> = (0..rows * width).map(|i| value(i + seed)).collect();
            if transposed {
                Tensor::<B, 2>::from_data(TensorData::new(data, [width, rows]), &device).transpose()
            } else {
                Tensor::<B, 2>::from_data(TensorData::new(data, [rows, width]), &device)
            }
        };
        let bits = |t: Tensor<B, 2>| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let wrap = |p| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
        let what = format!("{n_targets} targets, width {width}, transposed {transposed}");

        // The combine and its backward (a gather of the gradient).
        let rows = make(n_rows, 3).require_grad();
        let weight = make(n_targets, 11);
        let ours = wrap(B::combine_rows(rows.clone().into_primitive().tensor(), &map));
        let theirs = Tensor::<B, 2>::zeros([n_targets, width], &device).select_assign(
            0,
            idx.clone(),
            rows.clone(),
            IndexingUpdateOp::Add,
        );
        assert_eq!(bits(ours.clone()), bits(theirs.clone()), "combine, {what}");
        let g_ours = rows.grad(&(ours * weight.clone()).sum().backward()).unwrap();
        let g_theirs = rows.grad(&(theirs * weight).sum().backward()).unwrap();
        assert_eq!(
            g_ours.into_data().to_vec::<f32>().unwrap(),
            g_theirs.into_data().to_vec::<f32>().unwrap(),
            "combine's gradient, {what}"
        );

        // The gather and its backward (a combine of the gradient).
        let x = make(n_targets, 5).require_grad();
        let weight = make(n_rows, 13);
        let ours = wrap(B::gather_rows(x.clone().into_primitive().tensor(), &map));
        let theirs = x.clone().select(0, idx.clone());
        assert_eq!(bits(ours.clone()), bits(theirs.clone()), "gather, {what}");
        let g_ours = x.grad(&(ours * weight.clone()).sum().backward()).unwrap();
        let g_theirs = x.grad(&(theirs * weight).sum().backward()).unwrap();
        assert_eq!(
            g_ours.into_data().to_vec::<f32>().unwrap(),
            g_theirs.into_data().to_vec::<f32>().unwrap(),
            "gather's gradient, {what}"
        );
    }
}

/// `shared_expert_overlap` on the GPU backend, where the routing read is in flight while the
/// shared expert is issued: every case with a shared expert gives the same bits with it as
/// without, raw and under burn's fusion, within 1e-4 of the case.
#[test]
fn the_shared_expert_overlap_on_wgpu_changes_no_bit() {
    let _device = shared();
    let mut seen = 0;
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        if case.config.shared_expert.is_none() {
            continue;
        }
        seen += 1;
        let mut overlapped = case.clone();
        overlapped.config.shared_expert_overlap = true;
        let options = CheckOptions {
            partitions: Partitions::Fixed(3),
            strategy: Strategy::S2,
            ..CheckOptions::default()
        };
        for backend in ["raw", "fused"] {
            let run = |case: &Case| match backend {
                "raw" => check_case::<B>(case, &options, &Default::default()).unwrap(),
                _ => check_case::<fusion::F>(case, &options, &Default::default()).unwrap(),
            };
            let (plain, overlap) = (run(&case), run(&overlapped));
            let what = format!("{} {backend}", case.name);
            assert!(overlap.passed(1e-4), "{what}: {:?}", overlap.errors);
            for (name, values) in &plain.tensors {
                let same = values
                    .iter()
                    .zip(&overlap.tensors[name])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: {name} differs with the overlap");
            }
        }
    }
    assert!(seen >= 2, "{seen} cases with a shared expert");
}
