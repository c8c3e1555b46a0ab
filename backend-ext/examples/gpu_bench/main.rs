//! The layer's compute on one GPU, forward + backward, with every ceiling and twin beside it,
//! for the GPT3-S, BERT-L and GPT3-XL expert shapes, 8 experts on one rank, top-1 and top-2:
//!
//! - `dense`: cuBLAS's own rate on one FFN's six GEMMs over the same rows (the routed rows, as
//!   one matrix), at each GEMM precision: the ceiling of the experts' products;
//! - `experts`: the cuBLAS expert path alone (`CublasExperts`'s forward and backward of one
//!   partition holding every row, 8 experts with the same rows each), at each precision: the
//!   experts' products, activations and hand-overs, against `dense` (the GEMM efficiency);
//!   `experts` with `cublas unbatched` is the same without the batched calls (the products
//!   grouped, as before them), with `cublas looped` one `cublasGemmEx` per expert, and with
//!   `cublas skewed` the default path on experts of unequal rows (823 to 204 of 4,096: no two
//!   alike, so nothing batches), the routing of a real step, and with `cublas weights per step`
//!   (bf16) the weights' bf16 copies made once a step and kept for the backward
//!   (`CublasOptions::bf16_weights_per_step`) instead of once a pass;
//! - `layer`: the whole layer (router, plan, permutation, experts, combine, backward) on one
//!   rank with the exchange skipped (`SingleRank`), in issue order, with the cuBLAS path at each
//!   precision (device hand-over; TF32 also with host waits, and under burn's fusion; TF32 and
//!   bf16 also without the batched calls; TF32 also with LoRA adapters of rank 16 on the
//!   experts, base frozen, whose products go one cuBLAS section a step of a partition; TF32
//!   also with the router's products left on cubecl's kernels, `cublas experts only`: two
//!   sections a step fewer, each a cubecl product instead; bf16 also with the weights'
//!   copies made once a step, `cublas weights per step`; TF32 also with a shared expert of
//!   the experts' width, issued after the combine, `cublas shared`, and while the routing read
//!   is in flight, `cublas shared overlap`; TF32 raw and under fusion also with a helper that
//!   keeps cubecl's and fusion's runner threads from sleeping between the step's blocking
//!   calls, `cublas kept busy` and `cublas fusion kept busy`, whose census is off: the
//!   helper's own calls would count), and
//!   without it (cubecl's GEMMs, which multiply f32 in TF32: the twin the GPU check compares the
//!   path with); `forward` is the layer's forward alone (cuBLAS, TF32);
//! - `experts piece` and `layer piece`: the `experts` runs at each precision and the layer at
//!   TF32 and bf16 again on a timed path (`CublasOptions::timed`), each section's pieces (the
//!   weights' bf16 conversion, each GEMM role, the activation kernels, the hand-overs) with
//!   their device and host ms a step (`CublasExperts::breakdown`): where the experts' time goes
//!   against `dense`;
//! - `choice`: the router's choice of experts at 4,096 tokens, made on the device and read
//!   (`device`, what the layer runs) against the values read and chosen on the host (`host`),
//!   for the routers of BENCHMARKS §15, after a check that both choose alike (`choice.rs`; the
//!   row's `shape` names the router, `d_model` and `d_hidden` are 0).
//!
//! Routing is balanced as in `scripts/bench/torch_gpu_peer.py` (one-hot router rows, tokens that
//! send every expert the same rows), so both sides run the same GEMM shapes. Every figure is the
//! median of `--repeats` timed steps after two warm-up steps, a device sync after each.
//! `--pipeline` adds, at top-1, the whole layer with the emulated exchange (`HostLoopback`: every
//! all-to-all a device → host → device copy, the way back from page-locked memory on a copy
//! stream, as a CUDA rank without device paths runs it: `CublasExperts::adding_to`) at n = 1,
//! 2, 4 and 8 with CUDA's default executor (a worker and a CUDA stream per schedule stream:
//! `cublas threads`; n = 1 is FastMoE-style, the best other n PipeMoE), at n = 1 in issue order
//! (`cublas in-order`: no overlap), and at n = 1 and 4 with burn's pageable upload instead
//! (`cublas threads pageable`: cubecl's device thread copies the rows), cuBLAS at TF32, with the
//! exchange alone beside them (`exchange`, four round trips of every routed row, `host
//! loopback` and `host loopback pageable`); `gpu_table.py` sets each against
//! `max(compute, exchange)`.
//!
//! Every layer row also counts the CUDA driver and runtime calls of three more steps, run after
//! its timed ones, through CUPTI's callbacks (`Census`; off while anything is timed): host
//! waits, frees and launches per step, the waits by name and the kernels by name, and the time
//! each thread spent inside the driver's waits and all its calls, printed under the row and kept in
//! its JSON (`host_waits`, `frees`, `driver_launches`, `runtime_launches`, `wait_ms`,
//! `driver_ms`: which thread waited for the device in a step, and for how long).
//! Issue 56's goal is at most two host waits per layer step at one rank. Without CUPTI, or with
//! `--no-census`, the rows carry no counts.
//!
//! `--wake` runs only the table of `wake.rs`: a blocking call to cubecl's device thread after
//! idle gaps of the host, raw and under fusion (whether the thread sleeps between a step's
//! blocking calls on the lent machine's CPU, and whether a helper that keeps it busy helps).
//!
//! `--fusion-pair` runs only the layer at TF32 on the cuBLAS path, raw and under burn's fusion:
//! the pair that an A/B of two builds compares (`scripts/gpu/run.sh`'s `ab` phase), the raw row
//! being the control, which a change to fusion's delegates should not move.
//!
//! ```text
//! gpu_bench [--quick] [--repeats N] [--pipeline] [--json FILE]
//!           [--shape GPT3-S|BERT-L|GPT3-XL] [--top-k 1|2] [--layer-only | --fusion-pair]
//!           [--no-census] [--wake]
//! ```

mod choice;
mod wake;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::Param;
use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::cubecl::client::ComputeClient;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::cubecl::Runtime;
use mpipemoe::backend::{
    BlockLayout, ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, ExpertTensors, PassStore,
    StepExecutor,
};
use mpipemoe::comm::{HostLoopback, SingleRank, WithRowPaths};
use mpipemoe::harness::process_cpu_s;
use mpipemoe::{Activation, Communicator, GemmPrecision, MoeLayer, MoeLayerConfig, Partitions};
use mpipemoe_cuda::{
    cuda_available, CallCounts, CallKind, Census, CublasExperts, CublasOptions, CudaMoe, Handover,
};
use serde::Serialize;

type Inner = CudaMoe<f32>;
type B = Autodiff<Inner>;
/// burn's default CUDA backend (`cuda-fusion`) with this crate's ops on the inner one.
type Fused = Autodiff<mpipemoe_cuda::CudaMoeFusion<f32>>;

const EXPERTS: usize = 8;

/// The paper's expert shapes: name, `d_model`, `d_hidden`.
const SHAPES: [(&str, usize, usize); 3] = [
    ("GPT3-S", 768, 3072),
    ("BERT-L", 1024, 4096),
    ("GPT3-XL", 2048, 8192),
];

#[derive(Serialize, Clone)]
struct Row {
    shape: String,
    d_model: usize,
    d_hidden: usize,
    tokens: usize,
    top_k: usize,
    /// `dense`, `experts`, `layer`, `pipeline`, `experts piece`, `layer piece` or `choice`.
    what: String,
    /// `cublas` (device hand-over), `cublas host-waits`, `cubecl`, the pipeline's executor
    /// (`cublas threads`, `cublas in-order`; `n` its partitions), or
    /// a piece's name (its `median_ms` the piece's device ms a step, `n` its runs a step).
    path: String,
    /// The GEMM precision (`cubecl`: TF32, what cubek does with f32).
    precision: String,
    median_ms: f64,
    /// The fastest and slowest timed step.
    min_ms: f64,
    max_ms: f64,
    /// `12 · tokens · top_k · d_model · d_hidden` over the median.
    tflops: f64,
    /// Partitions (pipeline rows).
    n: usize,
    /// Layer rows: the median time the step's calls take on the calling thread, up to the
    /// final device sync (the forward's routing read included). Near `median_ms`, the step
    /// waits on the host; far under it, on the device or on cubecl's server thread.
    host_ms: Option<f64>,
    /// Layer rows, where CUPTI could be loaded: per step of `COUNTED` steps run after the
    /// timed ones, the driver and runtime calls that block the host until the device is done
    /// (`CallKind::Wait`), the frees, and the launches through the driver and through the
    /// runtime (cuBLAS's), apart because CUPTI may report a runtime launch and its driver call
    /// both.
    host_waits: Option<f64>,
    frees: Option<f64>,
    driver_launches: Option<f64>,
    runtime_launches: Option<f64>,
    /// Layer rows with a census: ms per step that each thread (by name: `main`, cubecl's
    /// device thread `DSD-…`, fusion's `DSU-…`, an executor worker `moe-…`, `unnamed`) spent
    /// inside the driver's waits, and inside all its calls (launches, allocations, frees and
    /// copies too), where it spent any.
    wait_ms: Option<BTreeMap<String, f64>>,
    driver_ms: Option<BTreeMap<String, f64>>,
    /// Layer rows with a census: the driver's waits per step by the thread that made them
    /// (`host_waits` counts every thread's, cubecl's collector thread's among them; issue 56's
    /// goal is about the step's own).
    waits_by_thread: Option<BTreeMap<String, f64>>,
}

/// One row's figures as `push` takes them.
struct Measured<'a> {
    /// (median, min, max) ms.
    times: (f64, f64, f64),
    /// Partitions (1 but for layer rows).
    n: usize,
    /// Layer rows: the median host ms.
    host_ms: Option<f64>,
    /// Layer rows: the census's calls.
    calls: Option<&'a CallCounts>,
}

impl Measured<'_> {
    /// Times alone (the rows without a layer).
    fn times(times: (f64, f64, f64)) -> Self {
        Measured {
            times,
            n: 1,
            host_ms: None,
            calls: None,
        }
    }
}

impl<'a> From<&'a LayerRun> for Measured<'a> {
    fn from(run: &'a LayerRun) -> Self {
        Measured {
            times: run.times,
            n: run.n,
            host_ms: Some(run.host_ms),
            calls: run.calls.as_ref(),
        }
    }
}

/// `value` of each thread that made timed driver calls, for the threads where it is not 0.
fn by_thread(calls: &CallCounts, value: impl Fn(&str) -> f64) -> BTreeMap<String, f64> {
    calls
        .threads()
        .map(|thread| (thread.to_string(), value(thread)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// Milliseconds per step each thread spent inside the driver's calls of `kinds`.
fn ms_by_thread(calls: &CallCounts, kinds: &[CallKind]) -> BTreeMap<String, f64> {
    by_thread(calls, |thread| {
        kinds.iter().map(|&kind| calls.ms_per_step(thread, kind)).sum()
    })
}

/// The driver's waits per step by the thread that made them.
fn waits_by_thread(calls: &CallCounts) -> BTreeMap<String, f64> {
    by_thread(calls, |thread| {
        calls.spent_on(thread, CallKind::Wait).calls as f64 / calls.steps() as f64
    })
}

/// A maker of the communicator a row runs with (the emulated exchange, one way or another).
type MakeComm<'a> = &'a dyn Fn() -> Arc<dyn Communicator>;

/// Steps counted by the census after a layer row's timed ones.
const COUNTED: u64 = 3;

/// What one layer row measured.
struct LayerRun {
    /// (median, min, max) ms of the timed steps.
    times: (f64, f64, f64),
    /// The partitions the layer ran.
    n: usize,
    /// The median host ms of the timed steps.
    host_ms: f64,
    /// The calls of `COUNTED` steps, where a census runs.
    calls: Option<CallCounts>,
    /// Every step run: two warm-ups, the timed ones and the counted ones.
    steps: u64,
}

struct Args {
    quick: bool,
    repeats: usize,
    pipeline: bool,
    json: Option<String>,
    /// Only this shape (`--shape GPT3-S`), for a profiled run of one configuration.
    shape: Option<String>,
    /// Only this `top_k`.
    top_k: Option<usize>,
    /// Only the layer at TF32 through the cuBLAS path (what a profiled run looks at).
    layer_only: bool,
    /// Only the layer at TF32 through the cuBLAS path, raw and under fusion (`--fusion-pair`).
    fusion_pair: bool,
    /// No CUPTI census of the layer rows' calls (`--no-census`).
    no_census: bool,
    /// Only the device thread's wake-up table (`wake.rs`).
    wake: bool,
}

fn arguments() -> Result<Args, String> {
    let mut args = Args {
        quick: false,
        repeats: 10,
        pipeline: false,
        json: None,
        shape: None,
        top_k: None,
        layer_only: false,
        fusion_pair: false,
        no_census: false,
        wake: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => args.quick = true,
            "--pipeline" => args.pipeline = true,
            "--repeats" => {
                let v = it.next().ok_or("--repeats needs a count")?;
                args.repeats = v
                    .parse()
                    .ok()
                    .filter(|&r: &usize| (1..=1000).contains(&r))
                    .ok_or(format!("--repeats {v:?}: expected 1 to 1000"))?;
            }
            "--json" => args.json = Some(it.next().ok_or("--json needs a file")?),
            "--layer-only" => args.layer_only = true,
            "--fusion-pair" => args.fusion_pair = true,
            "--wake" => args.wake = true,
            "--no-census" => args.no_census = true,
            "--shape" => {
                let v = it.next().ok_or("--shape needs a name")?;
                if !SHAPES.iter().any(|(name, _, _)| *name == v) {
                    return Err(format!("--shape {v:?}: expected GPT3-S, BERT-L or GPT3-XL"));
                }
                args.shape = Some(v);
            }
            "--top-k" => {
                let v = it.next().ok_or("--top-k needs 1 or 2")?;
                args.top_k = Some(
                    v.parse()
                        .ok()
                        .filter(|k| [1, 2].contains(k))
                        .ok_or(format!("--top-k {v:?}: expected 1 or 2"))?,
                );
            }
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    if args.layer_only && args.fusion_pair {
        return Err("--layer-only and --fusion-pair each pick the rows: give one".into());
    }
    Ok(args)
}

/// Times of `f` (which syncs the device itself) after two warm-up calls: (median, min, max) ms.
fn timed(repeats: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    f();
    f();
    median(
        (0..repeats)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// `rows` as JSON at `path` (where one is given), written whole or not at all.
fn write_json<T: Serialize>(path: Option<&str>, rows: &[T]) {
    let Some(path) = path else { return };
    let text = serde_json::to_string_pretty(rows).expect("rows serialize");
    let tmp = format!("{path}.tmp");
    if let Err(e) = std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, path)) {
        eprintln!("error: cannot write {path}: {e}");
    }
}

/// (median, min, max) of `times`, which are not empty.
fn median(mut times: Vec<f64>) -> (f64, f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0], times[times.len() - 1])
}

/// Waits for the device by reading one element.
fn sync<Bk: burn::tensor::backend::Backend, const D: usize>(t: Tensor<Bk, D>) {
    let _ = t.flatten::<1>(0, D - 1).narrow(0, 0, 1).into_data();
}

fn client(device: &burn::tensor::Device<Inner>) -> ComputeClient<CudaRuntime> {
    CudaRuntime::client(device)
}

fn primitive<const D: usize>(t: Tensor<Inner, D>) -> burn::tensor::ops::FloatTensor<Inner> {
    t.into_primitive().tensor()
}

/// One FFN's six GEMMs over `rows` rows through the path's dense product at `precision`.
fn dense_ms(
    path: &CublasExperts,
    rows: usize,
    m: usize,
    h: usize,
    precision: GemmPrecision,
    repeats: usize,
) -> (f64, f64, f64) {
    let device = Default::default();
    let x = primitive(Tensor::<Inner, 2>::random(
        [rows, m],
        Distribution::Default,
        &device,
    ));
    let w1 = primitive(Tensor::<Inner, 2>::random([m, h], Distribution::Default, &device));
    let w2 = primitive(Tensor::<Inner, 2>::random([h, m], Distribution::Default, &device));
    let t = |a: &burn::tensor::ops::FloatTensor<Inner>| {
        use burn::tensor::ops::FloatTensorOps;
        Inner::float_transpose(a.clone())
    };
    timed(repeats, || {
        let mm = |a, b| path.matmul(a, b, precision).expect("dense product");
        let z = mm(x.clone(), w1.clone());
        let y = mm(z.clone(), w2.clone());
        let dz = mm(y.clone(), t(&w2));
        let dw2 = mm(t(&z), y);
        let dx = mm(dz.clone(), t(&w1));
        let dw1 = mm(t(&x), dz);
        for out in [dx, dw1, dw2] {
            sync(Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(out)));
        }
    })
}

/// How `experts_ms` spreads its rows and what it times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// `rows / EXPERTS` rows each, timed to the device's end.
    Even,
    /// The same, timing the calls on the host alone.
    HostOnly,
    /// Unequal rows, no two experts alike (`skewed_rows`), timed to the device's end.
    Skewed,
}

/// `rows` spread over the experts in the proportions 12 : 10 : 9 : 8 : 7 : 6 : 5 : 3 (the
/// remainder to the first), as a router that favours some experts sends them: at 4,096 rows,
/// 823 down to 204, no two alike.
fn skewed_rows(rows: usize) -> Vec<usize> {
    const WEIGHTS: [usize; EXPERTS] = [12, 10, 9, 8, 7, 6, 5, 3];
    let sum: usize = WEIGHTS.iter().sum();
    let mut per: Vec<usize> = WEIGHTS.iter().map(|w| rows * w / sum).collect();
    per[0] += rows - per.iter().sum::<usize>();
    per
}

/// The path's forward and backward of one partition: `EXPERTS` experts with `rows / EXPERTS`
/// rows each, or skewed rows (GELU, no biases); with `Rows::HostOnly`, the time the calls take
/// on the host alone (the device is synchronised outside the timed span), which says whether
/// the path's time is the host's.
fn experts_ms(
    path: &CublasExperts,
    rows: usize,
    m: usize,
    h: usize,
    precision: GemmPrecision,
    repeats: usize,
    spread: Rows,
) -> (f64, f64, f64) {
    let device = Default::default();
    let host_only = spread == Rows::HostOnly;
    let per = match spread {
        Rows::Skewed => skewed_rows(rows),
        Rows::Even | Rows::HostOnly => vec![rows / EXPERTS; EXPERTS],
    };
    let layout = BlockLayout::new(&per, 1);
    let total = layout.total();
    let rand = |shape: Vec<usize>| {
        primitive(Tensor::<Inner, 3>::random(
            [shape[0], shape[1], shape[2]],
            Distribution::Default,
            &device,
        ))
    };
    let groups = ExpertGroups::new(vec![ExpertTensors::plain(
        rand(vec![EXPERTS, m, h]),
        None,
        rand(vec![EXPERTS, h, m]),
        None,
    )]);
    let x = primitive(Tensor::<Inner, 2>::random(
        [total, m],
        Distribution::Default,
        &device,
    ));
    let grad = primitive(Tensor::<Inner, 2>::random(
        [total, m],
        Distribution::Default,
        &device,
    ));
    let empty = |r: usize, c: usize| primitive(Tensor::<Inner, 2>::empty([r, c], &device));
    let mut host = Vec::new();
    let t = timed(repeats, || {
        let start = Instant::now();
        // A store per pass and one for the step that both share, as the layer's exchange
        // builds them: under bf16 each pass converts the weights once, or the forward alone
        // where the path keeps its copies across the step.
        let step = PassStore::default();
        let forward_pass = ExpertGroups::with_step(groups.groups.clone(), step.clone());
        let backward_pass = ExpertGroups::with_step(groups.groups.clone(), step);
        let (_, hidden) = path
            .forward(ExpertForward {
                x: x.clone(),
                rows_per_expert: &per,
                layout: &layout,
                hidden_layout: &layout,
                experts: &forward_pass,
                activation: Activation::Gelu,
                precision,
                hidden: empty(total, h),
                out: empty(total, m),
            })
            .expect("experts forward");
        let hidden = per
            .iter()
            .enumerate()
            .map(|(e, &r)| {
                let t = Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(hidden.clone()));
                Some(primitive(t.slice([layout.start(e)..layout.start(e) + r, 0..h])))
            })
            .collect();
        // Fresh sums, as the layer's first partition hands them over: written, not added.
        let zeros = |s: [usize; 3]| primitive(Tensor::<Inner, 3>::empty(s, &device));
        let out = path
            .backward(ExpertBackward {
                grad: grad.clone(),
                x: x.clone(),
                hidden,
                rows_per_expert: &per,
                layout: &layout,
                experts: &backward_pass,
                activation: Activation::Gelu,
                precision,
                grad_x: empty(total, m),
                fresh: true,
                grads: ExpertTensors::plain(zeros([EXPERTS, m, h]), None, zeros([EXPERTS, h, m]), None),
            })
            .expect("experts backward");
        host.push(start.elapsed().as_secs_f64() * 1e3);
        sync(Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(
            out.grad_x,
        )));
    });
    if !host_only {
        return t;
    }
    // The last `repeats` calls are the timed ones (two warm-ups came first).
    let mut host = host.split_off(host.len() - repeats);
    host.sort_by(f64::total_cmp);
    (host[host.len() / 2], host[0], host[host.len() - 1])
}

/// The timed path's pieces since its last breakdown, per step of `steps` (the warm-ups with
/// the timed ones), printed and as rows: `what` (`experts` or `layer`) with ` piece`, `path`
/// the piece, `median_ms` its device ms a step, `host_ms` its host ms, `n` its runs a step;
/// the step's own median (`step_ms`, with the events' cost in it) is printed beside the
/// pieces' sum, which leaves out the time between sections.
fn piece_rows(
    path: &CublasExperts,
    (shape, m, h, tokens, top_k): (&str, usize, usize, usize, usize),
    what: &str,
    precision: GemmPrecision,
    steps: usize,
    step_ms: f64,
) -> Vec<Row> {
    let breakdown = path
        .breakdown()
        .expect("the timed path's events")
        .per(steps as u64);
    let label = format!("{shape} {tokens} top-{top_k} {what} {}", precision.name());
    eprintln!(
        "           {label}: where a step's {step_ms:.3} ms go (sections only)\n{}",
        textwrap_indent(&breakdown.to_string(), "           ")
    );
    breakdown
        .pieces()
        .iter()
        .map(|p| Row {
            shape: shape.into(),
            d_model: m,
            d_hidden: h,
            tokens,
            top_k,
            what: format!("{what} piece"),
            path: p.piece.into(),
            precision: precision.name().into(),
            median_ms: p.device_ms,
            min_ms: p.device_ms,
            max_ms: p.device_ms,
            tflops: 0.0,
            n: p.runs as usize,
            host_ms: Some(p.host_ms),
            host_waits: None,
            frees: None,
            driver_launches: None,
            runtime_launches: None,
            wait_ms: None,
            driver_ms: None,
            waits_by_thread: None,
        })
        .collect()
}

/// `text` with `indent` before every line.
fn textwrap_indent(text: &str, indent: &str) -> String {
    text.lines()
        .map(|l| format!("{indent}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Tokens that send every expert the same rows through a one-hot router (the scheme of
/// `torch_gpu_peer.py`'s `balanced_tokens`): columns `0..EXPERTS` of each token are zero but
/// for its chosen experts, ranked.
fn balanced_tokens<Bk: burn::tensor::backend::Backend>(
    tokens: usize,
    m: usize,
    top_k: usize,
) -> Tensor<Bk, 2> {
    let mut values: Vec<f32> = (0..tokens * m)
        .map(|i| ((i.wrapping_mul(2_654_435_761) % 10_007) as f32 / 10_007.0) * 2.0 - 1.0)
        .collect();
    for t in 0..tokens {
        for c in 0..EXPERTS {
            values[t * m + c] = 0.0;
        }
        for j in 0..top_k {
            values[t * m + (t * top_k + j) % EXPERTS] = (4 + top_k - j) as f32;
        }
    }
    Tensor::from_data(TensorData::new(values, [tokens, m]), &Default::default())
}

/// The whole layer on `comm` on backend `Bk`, forward + backward (forward alone where
/// `forward_only`).
fn layer_ms<Bk>(
    config: &MoeLayerConfig,
    comm: Arc<dyn Communicator>,
    tokens: usize,
    bench: &Bench,
    forward_only: bool,
) -> LayerRun
where
    Bk: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    layer_with_ms::<Bk>(config, comm, tokens, bench, forward_only, None)
}

/// How every layer row is measured: its timed steps, and the census that counts the calls of
/// `COUNTED` more (none where CUPTI is missing or `--no-census` was given).
struct Bench<'a> {
    repeats: usize,
    census: Option<&'a Census>,
}

/// [`layer_ms`], with LoRA adapters of rank `lora` (alpha `2 · lora`) on both expert matrices
/// and every base weight frozen where given: experts with adapters run on the primitives, each
/// step's products of every expert one cuBLAS section at the config's precision, which is what
/// this row costs.
fn layer_with_ms<Bk>(
    config: &MoeLayerConfig,
    comm: Arc<dyn Communicator>,
    tokens: usize,
    bench: &Bench,
    forward_only: bool,
    lora: Option<usize>,
) -> LayerRun
where
    Bk: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    let device = Default::default();
    let mut layer: MoeLayer<Bk> = config.init_rank::<Bk>(&device, comm).expect("valid config");
    let mut router = vec![0f32; EXPERTS * config.d_model];
    for e in 0..EXPERTS {
        router[e * config.d_model + e] = 1.0;
    }
    layer.router.weight = Param::from_tensor(Tensor::from_data(
        TensorData::new(router, [EXPERTS, config.d_model]),
        &device,
    ));
    if let Some(rank) = lora {
        let spec = mpipemoe::ExpertLoraSpec {
            rank,
            alpha: 2.0 * rank as f64,
            scaling: mpipemoe::LoraScaling::Standard,
            w_in: true,
            w_out: true,
        };
        layer = layer
            .freeze_all_but_adapters()
            .with_adapters(&spec, 1)
            .expect("valid adapters");
    }
    let x = balanced_tokens::<Bk>(tokens, config.d_model, config.top_k).require_grad();
    let repeats = bench.repeats;
    let mut n = 1;
    let mut host = Vec::new();
    let mut step = || {
        let start = Instant::now();
        let out = layer.forward(x.clone());
        n = out.stats.n_partitions;
        if forward_only {
            host.push(start.elapsed().as_secs_f64() * 1e3);
            sync(out.output);
            return;
        }
        let grads = out.output.sum().backward();
        let grad = match &layer.adapters {
            // Frozen under adapters, the router has no gradient; an adapter's ends the step.
            Some(adapters) => {
                let lora = adapters.w_in.as_ref().expect("an adapter on w_in");
                lora.a.grad(&grads).expect("adapter gradient").flatten::<2>(0, 1)
            }
            None => layer.router.weight.grad(&grads).expect("router gradient"),
        };
        host.push(start.elapsed().as_secs_f64() * 1e3);
        sync(grad);
    };
    let times = timed(repeats, &mut step);
    // The calls of `COUNTED` more steps, each ending in a read that waits for its device work.
    let calls = bench.census.map(|census| {
        let ((), calls) = census
            .count(|| (0..COUNTED).for_each(|_| step()))
            .expect("the census's callbacks");
        calls.per(COUNTED)
    });
    // The timed steps are the `repeats` after two warm-ups.
    let mut host = host[2..2 + repeats].to_vec();
    host.sort_by(f64::total_cmp);
    LayerRun {
        times,
        n,
        host_ms: host[host.len() / 2],
        steps: (2 + repeats) as u64 + if calls.is_some() { COUNTED } else { 0 },
        calls,
    }
}

fn main() {
    // The arguments first, so that a usage error says so on any machine, CUDA or not.
    let args = match arguments() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = cuda_available() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    // A failed measurement ends the run at once with its message: unwinding through the CUDA
    // objects of a failed run gains nothing (the first H100 run's panic ended in a segfault).
    std::panic::set_hook(Box::new(|info| {
        eprintln!("error: {info}");
        std::process::exit(1);
    }));
    if args.wake {
        let rows = wake::wake_rows().unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1)
        });
        write_json(args.json.as_deref(), &rows);
        return;
    }
    let d = CublasOptions::default();
    let paths = [
        d,
        CublasOptions {
            handover: Handover::Host,
            ..d
        },
        CublasOptions {
            grouped: false,
            batched: false,
            ..d
        },
        CublasOptions { batched: false, ..d },
        CublasOptions { dense: false, ..d },
        CublasOptions { timed: true, ..d },
        CublasOptions {
            bf16_weights_per_step: true,
            ..d
        },
    ]
    .map(|options| {
        CublasExperts::with_options(0, options).unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1)
        })
    });
    let [device_path, host_path, looped_path, unbatched_path, experts_only_path, timed_path, per_step_path] =
        &paths;
    let device = Default::default();
    eprintln!("cuBLAS expert path: {device_path:?}");
    // The census counts each layer row's calls in steps of their own after the timed ones;
    // without CUPTI the rows go on without counts.
    let census = if args.no_census {
        None
    } else {
        match Census::start() {
            Ok(census) => Some(census),
            Err(e) => {
                eprintln!("no call counts: {e}");
                None
            }
        }
    };
    let bench = Bench {
        repeats: args.repeats,
        census: census.as_ref(),
    };
    // The timed path's layer runs count nothing: their events are not the layer's calls.
    let quiet = Bench {
        repeats: args.repeats,
        census: None,
    };
    let token_counts: &[usize] = if args.quick { &[4096] } else { &[4096, 16384] };
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    // The timed path's pieces, one row each, added to `rows` at the end.
    let mut pieces: Vec<Row> = Vec::new();
    let with = |path: &CublasExperts| -> Arc<dyn Communicator> {
        Arc::new(WithRowPaths::adding(Arc::new(SingleRank), path.paths()))
    };
    let shapes = SHAPES
        .iter()
        .filter(|(name, _, _)| args.shape.as_deref().is_none_or(|s| s == *name));
    for &(name, m, h) in shapes {
        for &tokens in token_counts {
            for top_k in [1, 2].into_iter().filter(|k| args.top_k.is_none_or(|o| o == *k)) {
                let routed = tokens * top_k;
                let flops = 12.0 * (routed * m * h) as f64;
                let mut push = |what: &str, path: &str, precision: &str, measured: Measured<'_>| {
                    let Measured {
                        times: (median, min, max),
                        n,
                        host_ms,
                        calls,
                    } = measured;
                    let host = host_ms.map_or(String::new(), |h| format!(" (host {h:.3} ms)"));
                    eprintln!(
                        "[{:7.1} s] {name} {tokens} top-{top_k} {what} {path} {precision}: {median:.3} ms{host}",
                        started.elapsed().as_secs_f64()
                    );
                    if let Some(calls) = calls {
                        eprintln!("{}", textwrap_indent(&calls.to_string(), "           "));
                    }
                    let per_step = |kind| calls.map(|c| c.per_step(kind));
                    let steps = calls.map_or(1, |c| c.steps()) as f64;
                    rows.push(Row {
                        shape: name.into(),
                        d_model: m,
                        d_hidden: h,
                        tokens,
                        top_k,
                        what: what.into(),
                        path: path.into(),
                        precision: precision.into(),
                        median_ms: median,
                        min_ms: min,
                        max_ms: max,
                        tflops: flops / (median * 1e-3) / 1e12,
                        n,
                        host_ms,
                        host_waits: per_step(CallKind::Wait),
                        frees: per_step(CallKind::Free),
                        driver_launches: calls.map(|c| c.driver_of(CallKind::Launch) as f64 / steps),
                        runtime_launches: calls.map(|c| c.runtime_of(CallKind::Launch) as f64 / steps),
                        wait_ms: calls.map(|c| ms_by_thread(c, &[CallKind::Wait])),
                        driver_ms: calls.map(|c| ms_by_thread(c, &CallKind::ALL)),
                        waits_by_thread: calls.map(waits_by_thread),
                    });
                };
                let base = MoeLayerConfig::new(m, h, EXPERTS, top_k)
                    .with_check_finite(false)
                    .with_executor(Some(StepExecutor::InOrder));
                let tf32 = base.clone().with_gemm_precision(GemmPrecision::Tf32);
                if args.layer_only || args.fusion_pair {
                    let run = layer_ms::<B>(&tf32, with(device_path), tokens, &bench, false);
                    push("layer", "cublas", "tf32", (&run).into());
                    if args.fusion_pair {
                        let run = layer_ms::<Fused>(&tf32, with(device_path), tokens, &bench, false);
                        push("layer", "cublas fusion", "tf32", (&run).into());
                    }
                    continue;
                }
                for precision in GemmPrecision::ALL {
                    push(
                        "dense",
                        "cublas",
                        precision.name(),
                        Measured::times(dense_ms(device_path, routed, m, h, precision, args.repeats)),
                    );
                    push(
                        "experts",
                        "cublas",
                        precision.name(),
                        Measured::times(experts_ms(
                            device_path,
                            routed,
                            m,
                            h,
                            precision,
                            args.repeats,
                            Rows::Even,
                        )),
                    );
                }
                // Where the experts' time goes: the same runs on the timed path, its pieces
                // per pass pair (a separate path, so the figures above carry no events).
                for precision in GemmPrecision::ALL {
                    let t = experts_ms(timed_path, routed, m, h, precision, args.repeats, Rows::Even);
                    let at = (name, m, h, tokens, top_k);
                    pieces.extend(piece_rows(
                        timed_path,
                        at,
                        "experts",
                        precision,
                        args.repeats + 2,
                        t.0,
                    ));
                }
                let host = experts_ms(
                    device_path,
                    routed,
                    m,
                    h,
                    GemmPrecision::Tf32,
                    args.repeats,
                    Rows::HostOnly,
                );
                push("experts", "cublas host only", "tf32", Measured::times(host));
                for precision in [GemmPrecision::Tf32, GemmPrecision::Bf16] {
                    for (path, name, rows) in [
                        (unbatched_path, "cublas unbatched", Rows::Even),
                        (looped_path, "cublas looped", Rows::Even),
                        (device_path, "cublas skewed", Rows::Skewed),
                    ] {
                        let t = experts_ms(path, routed, m, h, precision, args.repeats, rows);
                        push("experts", name, precision.name(), Measured::times(t));
                    }
                }
                // bf16's weight copies made once a step instead of once a pass.
                let t = experts_ms(
                    per_step_path,
                    routed,
                    m,
                    h,
                    GemmPrecision::Bf16,
                    args.repeats,
                    Rows::Even,
                );
                push("experts", "cublas weights per step", "bf16", Measured::times(t));
                for precision in GemmPrecision::ALL {
                    let config = base.clone().with_gemm_precision(precision);
                    let before = device_path.calls();
                    let run = layer_ms::<B>(&config, with(device_path), tokens, &bench, false);
                    push("layer", "cublas", precision.name(), (&run).into());
                    // The experts' cuBLAS calls of one step (warm-up and counted steps too).
                    let steps = run.steps;
                    let after = device_path.calls();
                    eprintln!(
                        "           per step: {} sections, {} strided batched, {} pointer batched, {} grouped, {} cublasGemmEx, {} bf16 weight conversions",
                        (after.sections - before.sections) / steps,
                        (after.strided_batched - before.strided_batched) / steps,
                        (after.pointer_batched - before.pointer_batched) / steps,
                        (after.grouped - before.grouped) / steps,
                        (after.looped - before.looped) / steps,
                        (after.weight_conversions - before.weight_conversions) / steps,
                    );
                }
                // bf16 with the weights' copies kept from the forward to the backward: one
                // conversion a step (autocast's trade, as the PyTorch side makes it).
                let bf16 = base.clone().with_gemm_precision(GemmPrecision::Bf16);
                let before = per_step_path.calls();
                let run = layer_ms::<B>(&bf16, with(per_step_path), tokens, &bench, false);
                push("layer", "cublas weights per step", "bf16", (&run).into());
                eprintln!(
                    "           per step: {} bf16 weight conversions",
                    (per_step_path.calls().weight_conversions - before.weight_conversions) / run.steps
                );
                // The layer's sections piece by piece (the router's products among them).
                for precision in [GemmPrecision::Tf32, GemmPrecision::Bf16] {
                    let config = base.clone().with_gemm_precision(precision);
                    let run = layer_ms::<B>(&config, with(timed_path), tokens, &quiet, false);
                    let at = (name, m, h, tokens, top_k);
                    pieces.extend(piece_rows(
                        timed_path,
                        at,
                        "layer",
                        precision,
                        run.steps as usize,
                        run.times.0,
                    ));
                }
                for precision in [GemmPrecision::Tf32, GemmPrecision::Bf16] {
                    let config = base.clone().with_gemm_precision(precision);
                    let run = layer_ms::<B>(&config, with(unbatched_path), tokens, &bench, false);
                    push("layer", "cublas unbatched", precision.name(), (&run).into());
                }
                let run = layer_ms::<B>(&tf32, with(device_path), tokens, &bench, true);
                push("forward", "cublas", "tf32", (&run).into());
                let before = device_path.calls();
                let run = layer_with_ms::<B>(&tf32, with(device_path), tokens, &bench, false, Some(16));
                push("layer", "cublas lora16", "tf32", (&run).into());
                let calls = device_path.calls();
                eprintln!(
                    "           per step: {} sections, {} cuBLAS calls",
                    (calls.sections - before.sections) / run.steps,
                    (calls.strided_batched + calls.pointer_batched + calls.grouped + calls.looped
                        - before.strided_batched
                        - before.pointer_batched
                        - before.grouped
                        - before.looped)
                        / run.steps,
                );
                // A shared expert of the routed experts' width, issued after the combine and,
                // with `shared_expert_overlap`, while the routing read is in flight.
                for (path, overlap) in [("cublas shared", false), ("cublas shared overlap", true)] {
                    let config = tf32
                        .clone()
                        .with_shared_expert(Some(h))
                        .with_shared_expert_overlap(overlap);
                    let run = layer_ms::<B>(&config, with(device_path), tokens, &bench, false);
                    push("layer", path, "tf32", (&run).into());
                }
                let run = layer_ms::<B>(&tf32, with(host_path), tokens, &bench, false);
                push("layer", "cublas host-waits", "tf32", (&run).into());
                let run = layer_ms::<B>(&tf32, with(experts_only_path), tokens, &bench, false);
                push("layer", "cublas experts only", "tf32", (&run).into());
                let run = layer_ms::<Fused>(&tf32, with(device_path), tokens, &bench, false);
                push("layer", "cublas fusion", "tf32", (&run).into());
                // The raw and fused steps again with a helper that keeps the runners from
                // sleeping between the step's blocking calls (`wake.rs`): whether the waits
                // `--wake` finds cost a step anything, and the CPU the helper burns for it.
                for (path, fused) in [("cublas kept busy", false), ("cublas fusion kept busy", true)] {
                    let keeper = wake::keeper(&device, fused);
                    let cpu = process_cpu_s();
                    let run = match fused {
                        false => layer_ms::<B>(&tf32, with(device_path), tokens, &quiet, false),
                        true => layer_ms::<Fused>(&tf32, with(device_path), tokens, &quiet, false),
                    };
                    let (cpu, touches) = (process_cpu_s() - cpu, keeper.stop());
                    eprintln!(
                        "           {:.2} s CPU of the process over {} steps, {touches} touches",
                        cpu, run.steps
                    );
                    push("layer", path, "tf32", (&run).into());
                }
                let run = layer_ms::<B>(&base, Arc::new(SingleRank), tokens, &bench, false);
                push("layer", "cubecl", "tf32", (&run).into());
                // The pipeline at top-1 only: the paper's shapes, and top-2's exchange doubles
                // a lent GPU's minutes for no new question.
                if args.pipeline && top_k == 1 {
                    // The emulated exchange as a CUDA rank without device paths gets it
                    // (`CublasExperts::adding_to`: the rows uploaded from page-locked memory on
                    // a copy stream), and as burn's upload does it (`pageable`: cubecl's device
                    // thread copies from a pageable buffer, `host_rows.rs`).
                    let loopback =
                        || -> Arc<dyn Communicator> { device_path.adding_to(Arc::new(HostLoopback)) };
                    let pageable = || -> Arc<dyn Communicator> {
                        Arc::new(WithRowPaths::adding(Arc::new(HostLoopback), device_path.paths()))
                    };
                    // The exchange alone: four all-to-alls of all routed rows (two forward, two
                    // backward), each a device -> host -> device round trip, through each
                    // communicator as the layer calls it.
                    let rows_tensor = Tensor::<Inner, 2>::random([routed, m], Distribution::Default, &device);
                    let exchanges: [(&str, MakeComm<'_>); 2] = [
                        ("host loopback", &loopback),
                        ("host loopback pageable", &pageable),
                    ];
                    for (label, make) in exchanges {
                        let comm = make();
                        let exchange = timed(args.repeats, || {
                            for _ in 0..4 {
                                let x = rows_tensor.clone().into_primitive().tensor();
                                let y = <Inner as mpipemoe::MoeBackend>::all_to_all(
                                    x,
                                    &[routed],
                                    &[routed],
                                    &comm,
                                )
                                .unwrap_or_else(|e| panic!("the emulated exchange: {e}"));
                                sync(Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(y)));
                            }
                        });
                        push("exchange", label, "-", Measured::times(exchange));
                    }
                    // The overlap needs the executor CUDA gets by default, a worker and a CUDA
                    // stream per schedule stream (`StepExecutor::for_cubecl_runtime`): `tf32`
                    // runs in issue order, right for one rank, where nothing overlaps, but with
                    // the emulated exchange it would put every copy between the products. In
                    // issue order at n = 1 (FastMoE-style) is the reference without overlap.
                    // `pageable` at n = 1 and 4 beside the others: what the page-locked upload
                    // buys the overlap, in the same call.
                    let runs: [(StepExecutor, &str, &[usize], MakeComm<'_>); 3] = [
                        (
                            StepExecutor::StreamThreads,
                            "cublas threads",
                            &[1, 2, 4, 8],
                            &loopback,
                        ),
                        (StepExecutor::InOrder, "cublas in-order", &[1], &loopback),
                        (
                            StepExecutor::StreamThreads,
                            "cublas threads pageable",
                            &[1, 4],
                            &pageable,
                        ),
                    ];
                    for (executor, label, ns, make) in runs {
                        for &n in ns {
                            let config = tf32
                                .clone()
                                .with_executor(Some(executor))
                                .with_partitions(Partitions::Fixed(n));
                            let run = layer_ms::<B>(&config, make(), tokens, &bench, false);
                            push("pipeline", label, "tf32", (&run).into());
                        }
                    }
                }
            }
        }
    }
    rows.extend(pieces);
    // The router's choice on the device and on the host (`choice.rs`), once a run.
    if !(args.layer_only || args.fusion_pair) {
        let times = choice::choice_times(4096, args.repeats).unwrap_or_else(|e| {
            eprintln!("error: router choice: {e}");
            std::process::exit(1)
        });
        for t in times {
            for (path, (median, min, max)) in [("device", t.device), ("host", t.host)] {
                eprintln!("router {} choice on the {path}: {median:.3} ms", t.label);
                rows.push(Row {
                    shape: t.label.into(),
                    d_model: 0,
                    d_hidden: 0,
                    tokens: 4096,
                    top_k: t.top_k,
                    what: "choice".into(),
                    path: path.into(),
                    precision: "f32".into(),
                    median_ms: median,
                    min_ms: min,
                    max_ms: max,
                    tflops: 0.0,
                    n: 1,
                    host_ms: None,
                    host_waits: None,
                    frees: None,
                    driver_launches: None,
                    runtime_launches: None,
                    wait_ms: None,
                    driver_ms: None,
                    waits_by_thread: None,
                });
            }
        }
    }
    if let Err(e) = device_path
        .check(&client(&device))
        .and(host_path.check(&client(&device)))
        .and(experts_only_path.check(&client(&device)))
        .and(timed_path.check(&client(&device)))
        .and(per_step_path.check(&client(&device)))
    {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    write_json(args.json.as_deref(), &rows);
    println!(
        "{:<8} {:>6} {:>2} {:<9} {:<18} {:<5} {:>9} {:>9} {:>9} {:>8} {:>3} {:>9}",
        "shape", "tokens", "k", "what", "path", "prec", "ms", "min", "max", "TFLOP/s", "n", "host ms"
    );
    for r in &rows {
        println!(
            "{:<8} {:>6} {:>2} {:<9} {:<18} {:<5} {:>9.3} {:>9.3} {:>9.3} {:>8.1} {:>3} {:>9}",
            r.shape,
            r.tokens,
            r.top_k,
            r.what,
            r.path,
            r.precision,
            r.median_ms,
            r.min_ms,
            r.max_ms,
            r.tflops,
            r.n,
            r.host_ms.map_or("-".to_string(), |h| format!("{h:.3}"))
        );
    }
    let counted: Vec<&Row> = rows.iter().filter(|r| r.host_waits.is_some()).collect();
    if !counted.is_empty() {
        println!("\nCalls per layer step (CUPTI, {COUNTED} steps after the timed ones; goal: at most 2 host waits):");
        for r in counted {
            let at = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            println!(
                "{:<8} {:>6} top-{} {:<8} {:<22} {:<5} waits {:>6} frees {:>6} launches: driver {:>7} runtime {:>7}",
                r.shape,
                r.tokens,
                r.top_k,
                r.what,
                r.path,
                r.precision,
                at(r.host_waits),
                at(r.frees),
                at(r.driver_launches),
                at(r.runtime_launches)
            );
        }
    }
    println!("\nGEMM efficiency (dense ms / experts ms, same rows and precision):");
    for r in rows
        .iter()
        .filter(|r| r.what == "experts" && r.path != "cublas host only")
    {
        if let Some(d) = rows.iter().find(|d| {
            d.what == "dense"
                && d.shape == r.shape
                && d.tokens == r.tokens
                && d.top_k == r.top_k
                && d.precision == r.precision
        }) {
            println!(
                "{:<8} {:>6} top-{} {:<5} {:<18} {:.2}",
                r.shape,
                r.tokens,
                r.top_k,
                r.precision,
                r.path,
                d.median_ms / r.median_ms
            );
        }
    }
}
