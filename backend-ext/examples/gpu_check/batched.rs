//! The cuBLAS path's batched calls against its own looped ones (one `cublasGemmEx` per expert
//! product, the calls every earlier GPU run checked against the cases): forward and backward
//! of one partition, every output and every gradient, at each GEMM precision.
//!
//! The reference cases batch only where their routing happens to give two experts of a
//! partition the same rows. Here the rows are chosen so that every kind of call runs: even rows
//! (one strided batch per role), rows 5, 3, 5, 7, 3, 5 (the 3s a strided batch, the 5s a batch
//! through pointer tables, since their blocks do not step evenly, and the 7 grouped or looped),
//! with biases (whose gradients multiply one shared ones row: pointer tables again) and
//! without, with `T_M` kept and recomputed, written into fresh sums and added into running
//! ones. The call counters say that the batched calls ran and the looped path made none. The
//! batched side runs each job twice on one pass store (`ExpertGroups::pass`), as a pass's
//! partitions do: in bf16 the weights are converted once, by the first section, and the
//! second run's results (read from those copies) are the ones compared.

use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive};
use mpipemoe::backend::{
    BlockLayout, ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, ExpertTensors, PassStore,
};
use mpipemoe::harness::relative_error;
use mpipemoe::{Activation, GemmPrecision};
use mpipemoe_cuda::{CublasExperts, CublasOptions, CudaMoe};

type Inner = CudaMoe<f32>;
type Float = burn::tensor::ops::FloatTensor<Inner>;

const D_MODEL: usize = 64;
const D_HIDDEN: usize = 96;

/// Most that the two calls' results may differ, relative (Frobenius), by precision: the same
/// operands and accumulator type, summed in another order by another kernel.
fn tolerance(precision: GemmPrecision) -> f64 {
    match precision {
        GemmPrecision::F32 => 1e-5,
        GemmPrecision::Tf32 | GemmPrecision::Bf16 => 1e-3,
    }
}

/// One job's inputs, as host values (each path gets tensors of its own: the backward writes
/// its running sums in place).
struct Job {
    rows: Vec<usize>,
    activation: Activation,
    bias: bool,
    keep_hidden: bool,
    fresh: bool,
    values: Vec<(Vec<f32>, Vec<usize>)>,
}

/// Host values of a random tensor of `shape`, from the device's generator.
fn random(shape: Vec<usize>) -> (Vec<f32>, Vec<usize>) {
    let device = Default::default();
    let n: usize = shape.iter().product();
    let t = Tensor::<Inner, 1>::random([n], Distribution::Normal(0.0, 0.5), &device);
    (t.into_data().to_vec::<f32>().expect("f32 values"), shape)
}

fn upload((values, shape): &(Vec<f32>, Vec<usize>)) -> Float {
    let device = Default::default();
    let data = TensorData::new(values.clone(), shape.clone());
    match shape.len() {
        2 => Tensor::<Inner, 2>::from_data(data, &device)
            .into_primitive()
            .tensor(),
        _ => Tensor::<Inner, 3>::from_data(data, &device)
            .into_primitive()
            .tensor(),
    }
}

fn download(t: Float) -> Vec<f32> {
    Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(t))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_else(|_| Vec::new())
}

fn download3(t: Float) -> Vec<f32> {
    Tensor::<Inner, 3>::from_primitive(TensorPrimitive::Float(t))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_else(|_| Vec::new())
}

impl Job {
    fn new(rows: Vec<usize>, activation: Activation, bias: bool, keep_hidden: bool, fresh: bool) -> Self {
        let e = rows.len();
        let total: usize = rows.iter().sum();
        let d_inner = activation.d_inner(D_HIDDEN);
        // x, grad, w_in, b_in, w_out, b_out, then the running sums' starting values.
        let values = vec![
            random(vec![total, D_MODEL]),
            random(vec![total, D_MODEL]),
            random(vec![e, D_MODEL, d_inner]),
            random(vec![e, d_inner]),
            random(vec![e, D_HIDDEN, D_MODEL]),
            random(vec![e, D_MODEL]),
            random(vec![e, D_MODEL, d_inner]),
            random(vec![e, d_inner]),
            random(vec![e, D_HIDDEN, D_MODEL]),
            random(vec![e, D_MODEL]),
        ];
        Self {
            rows,
            activation,
            bias,
            keep_hidden,
            fresh,
            values,
        }
    }

    fn label(&self, precision: GemmPrecision) -> String {
        format!(
            "cublas batched against looped {} rows {:?} {:?}{}{}{}",
            precision.name(),
            self.rows,
            self.activation,
            if self.bias { " biases" } else { "" },
            if self.keep_hidden {
                " T_M kept"
            } else {
                " T_M recomputed"
            },
            if self.fresh {
                " fresh sums"
            } else {
                " running sums"
            },
        )
    }

    /// Forward and backward on `path`, `times` times on the same experts (one pass store, as
    /// the partitions of a pass share it): the last time's `T_DO`, `T_M`, `dT_DI` and gradient
    /// sums, as host values.
    fn run(
        &self,
        path: &CublasExperts,
        precision: GemmPrecision,
        times: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        let v = &self.values;
        let bias = |i: usize| self.bias.then(|| upload(&v[i]));
        let groups = ExpertGroups::new(vec![ExpertTensors::plain(
            upload(&v[2]),
            bias(3),
            upload(&v[4]),
            bias(5),
        )]);
        let mut last = Vec::new();
        for _ in 0..times {
            last = self.once(path, precision, &groups, &groups)?;
        }
        Ok(last)
    }

    /// One forward and backward as the layer's exchange runs them: a pass store each, and one
    /// step store that the backward gets from the forward.
    fn run_as_a_step(&self, path: &CublasExperts, precision: GemmPrecision) -> Result<Vec<Vec<f32>>, String> {
        let v = &self.values;
        let bias = |i: usize| self.bias.then(|| upload(&v[i]));
        let experts = vec![ExpertTensors::plain(
            upload(&v[2]),
            bias(3),
            upload(&v[4]),
            bias(5),
        )];
        let step = PassStore::default();
        let forward = ExpertGroups::with_step(experts.clone(), step.clone());
        let backward = ExpertGroups::with_step(experts, step);
        self.once(path, precision, &forward, &backward)
    }

    fn once(
        &self,
        path: &CublasExperts,
        precision: GemmPrecision,
        groups: &ExpertGroups<Inner>,
        backward_groups: &ExpertGroups<Inner>,
    ) -> Result<Vec<Vec<f32>>, String> {
        let device = Default::default();
        let v = &self.values;
        let layout = BlockLayout::new(&self.rows, 1);
        let total = layout.total();
        let d_inner = self.activation.d_inner(D_HIDDEN);
        let bias = |i: usize| self.bias.then(|| upload(&v[i]));
        let empty = |r: usize, c: usize| {
            Tensor::<Inner, 2>::empty([r, c], &device)
                .into_primitive()
                .tensor()
        };
        let x = upload(&v[0]);
        let (out, hidden) = path
            .forward(ExpertForward {
                x: x.clone(),
                rows_per_expert: &self.rows,
                layout: &layout,
                hidden_layout: &layout,
                experts: groups,
                activation: self.activation,
                precision,
                hidden: empty(total, d_inner),
                out: empty(total, D_MODEL),
            })
            .map_err(|e| format!("forward: {e}"))?;
        let kept = self
            .rows
            .iter()
            .enumerate()
            .map(|(e, &r)| {
                let t = Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(hidden.clone()));
                let start = layout.start(e);
                (self.keep_hidden && r > 0)
                    .then(|| t.slice([start..start + r, 0..d_inner]).into_primitive().tensor())
            })
            .collect();
        let sums = ExpertTensors::plain(upload(&v[6]), bias(7), upload(&v[8]), bias(9));
        let back = path
            .backward(ExpertBackward {
                grad: upload(&v[1]),
                x,
                hidden: kept,
                rows_per_expert: &self.rows,
                layout: &layout,
                experts: backward_groups,
                activation: self.activation,
                precision,
                grad_x: empty(total, D_MODEL),
                fresh: self.fresh,
                grads: sums,
            })
            .map_err(|e| format!("backward: {e}"))?;
        let mut outs = vec![download(out), download(hidden), download(back.grad_x)];
        outs.push(download3(back.grads.w_in));
        outs.push(download3(back.grads.w_out));
        for b in [back.grads.b_in, back.grads.b_out].into_iter().flatten() {
            outs.push(download(b));
        }
        Ok(outs)
    }
}

const NAMES: [&str; 7] = ["T_DO", "T_M", "dT_DI", "dW_in", "dW_out", "db_in", "db_out"];

/// The largest relative error of `got` against `want`, output by output (`NAMES`), or which
/// output differs in length, is empty, or errs by more than `tolerance`.
fn worst_error(got: &[Vec<f32>], want: &[Vec<f32>], tolerance: f64) -> Result<f64, String> {
    let mut worst = 0.0f64;
    for ((name, g), w) in NAMES.iter().zip(got).zip(want) {
        let g: Vec<f64> = g.iter().map(|&v| f64::from(v)).collect();
        let w: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        if g.len() != w.len() || g.is_empty() {
            return Err(format!("{name}: {} values against {}", g.len(), w.len()));
        }
        let err = relative_error(&g, &w);
        if err.is_nan() || err > tolerance {
            return Err(format!("{name} relative error {err:.2e}"));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}

/// Every job at every precision: a label and `Ok(note)` or `Err(why)` each.
pub(crate) fn checks() -> Vec<(String, Result<String, String>)> {
    let make = |options: CublasOptions| CublasExperts::with_options(0, options).map_err(|e| e.to_string());
    let batched = make(CublasOptions::default());
    // The looped side is timed too: its results are the reference here, so a stopwatch that
    // disturbed the work would show as a mismatch, and its pieces are checked below.
    let looped = make(CublasOptions {
        grouped: false,
        batched: false,
        timed: true,
        ..CublasOptions::default()
    });
    let (batched, looped) = match (batched, looped) {
        (Ok(b), Ok(l)) => (b, l),
        (Err(why), _) | (_, Err(why)) => {
            return vec![(
                "cublas batched against looped".into(),
                Err(format!("no cuBLAS path: {why}")),
            )]
        }
    };
    let jobs = [
        Job::new(vec![6; 4], Activation::Gelu, true, true, true),
        Job::new(vec![5, 3, 5, 7, 3, 5], Activation::Gelu, true, false, false),
        Job::new(vec![5, 3, 5, 7, 3, 5], Activation::SwiGlu, false, true, true),
        Job::new(vec![4, 0, 4, 4, 0, 9], Activation::Relu, true, true, false),
    ];
    let mut out = Vec::new();
    for precision in GemmPrecision::ALL {
        for job in &jobs {
            let before = batched.calls();
            // Twice on one pass store: the second forward and backward find the bf16 weights
            // the first converted.
            let result = job
                .run(&batched, precision, 2)
                .and_then(|got| Ok((got, job.run(&looped, precision, 1)?)))
                .and_then(|(got, want)| {
                    let after = batched.calls();
                    let ran = after.strided_batched + after.pointer_batched
                        - before.strided_batched
                        - before.pointer_batched;
                    if ran == 0 {
                        return Err("the batched path made no batched call".into());
                    }
                    let converted = after.weight_conversions - before.weight_conversions;
                    let expected = u64::from(precision == GemmPrecision::Bf16);
                    if converted != expected {
                        return Err(format!(
                            "{converted} conversions of the weights in four sections of one pass store \
                             (expected {expected})"
                        ));
                    }
                    let worst = worst_error(&got, &want, tolerance(precision))?;
                    Ok(format!("max_rel_err={worst:.2e} ({ran} batched calls)"))
                });
            out.push((job.label(precision), result));
        }
    }
    let looped_calls = looped.calls();
    let only_looped = looped_calls.strided_batched + looped_calls.pointer_batched + looped_calls.grouped == 0;
    out.push((
        "cublas looped path made only cublasGemmEx calls".into(),
        match only_looped {
            true => Ok(format!("{looped_calls:?}")),
            false => Err(format!("{looped_calls:?}")),
        },
    ));
    out.extend(per_step_checks(&batched, &jobs));
    out.push((
        "cublas timed path's pieces: every section's, in order".into(),
        timed_pieces(&looped, jobs.len() * GemmPrecision::ALL.len()),
    ));
    let calls = batched.calls();
    out.push((
        "cublas batched path took strided and pointer-table batches".into(),
        match calls.strided_batched > 0 && calls.pointer_batched > 0 {
            true => Ok(format!("{calls:?}")),
            false => Err(format!("{calls:?}")),
        },
    ));
    if let Err(e) = batched.check(&f32_client()).and(looped.check(&f32_client())) {
        out.push(("cublas batched check's hand-overs".into(), Err(e.to_string())));
    }
    out
}

/// bf16's weight copies once a step (`CublasOptions::bf16_weights_per_step`): each job run as
/// the layer runs a step (a pass store each way, one step store), on a path that keeps the
/// copies across the step and on `default`, which makes them once a pass. The first converts
/// the weights once (the forward), the second twice, and their results agree: the backward
/// read the forward's copies, which are the same values it would have made.
fn per_step_checks(default: &CublasExperts, jobs: &[Job]) -> Vec<(String, Result<String, String>)> {
    let per_step = match CublasExperts::with_options(
        0,
        CublasOptions {
            bf16_weights_per_step: true,
            ..CublasOptions::default()
        },
    ) {
        Ok(p) => p,
        Err(e) => return vec![("cublas bf16 weights per step".into(), Err(e.to_string()))],
    };
    let precision = GemmPrecision::Bf16;
    let conversions = |path: &CublasExperts, job: &Job| -> Result<(u64, Vec<Vec<f32>>), String> {
        let before = path.calls().weight_conversions;
        let got = job.run_as_a_step(path, precision)?;
        Ok((path.calls().weight_conversions - before, got))
    };
    let mut out = Vec::new();
    for job in jobs {
        let label = job
            .label(precision)
            .replace("batched against looped", "weights per step against per pass");
        let result = conversions(&per_step, job).and_then(|(once, got)| {
            let (twice, want) = conversions(default, job)?;
            if (once, twice) != (1, 2) {
                return Err(format!(
                    "{once} conversions a step kept, {twice} a pass each (expected 1 and 2)"
                ));
            }
            let worst = worst_error(&got, &want, tolerance(GemmPrecision::F32))?;
            Ok(format!("max_rel_err={worst:.2e}"))
        });
        out.push((label, result));
    }
    if let Err(e) = per_step.check(&f32_client()) {
        out.push(("cublas weights per step's hand-overs".into(), Err(e.to_string())));
    }
    out
}

/// The timed path's breakdown after `jobs` forward and backward runs (one run each, at every
/// precision): two sections a run, each with its hand-overs and its GEMM roles, the weights
/// converted in bf16's runs alone, `T_M` recomputed where a job dropped it, and device time in
/// every GEMM role.
fn timed_pieces(path: &CublasExperts, jobs: usize) -> Result<String, String> {
    let b = path.breakdown().map_err(|e| e.to_string())?;
    let runs = |piece: &str| b.piece(piece).map_or(0, |p| p.runs);
    let sections = 2 * jobs as u64;
    let per_run = [
        "T_M = X·W_in",
        "activation",
        "T_DO = A·W_out",
        "dA = dT_DO·W_outᵀ",
    ];
    let per_run = per_run.iter().chain(&[
        "activation backward",
        "dW_out += Aᵀ·dT_DO",
        "dW_in += Xᵀ·dT_M",
        "dT_DI = dT_M·W_inᵀ",
    ]);
    let mut wrong = Vec::new();
    if b.sections() != sections || runs("hand-over in") != sections || runs("hand-over out") != sections {
        wrong.push(format!(
            "{} sections, {} hand-overs in",
            b.sections(),
            runs("hand-over in")
        ));
    }
    for piece in per_run {
        if runs(piece) != jobs as u64 {
            wrong.push(format!("{piece}: {} runs, expected {jobs}", runs(piece)));
        }
        if b.piece(piece).is_none_or(|p| p.device_ms <= 0.0) {
            wrong.push(format!("{piece}: no device time"));
        }
    }
    // A run's forward and backward share one pass store, so bf16's runs convert the weights
    // once per job (the forward); one job of the four recomputes T_M.
    let per_precision = (jobs / GemmPrecision::ALL.len()) as u64;
    if runs("convert weights") != per_precision {
        wrong.push(format!("convert weights: {} runs", runs("convert weights")));
    }
    if runs("recompute T_M") != GemmPrecision::ALL.len() as u64 {
        wrong.push(format!("recompute T_M: {} runs", runs("recompute T_M")));
    }
    match wrong.is_empty() {
        true => Ok(format!(
            "{} sections, {:.3} device ms, {:.3} host ms",
            b.sections(),
            b.device_ms(),
            b.host_ms()
        )),
        false => Err(format!("{}\n{b}", wrong.join("; "))),
    }
}

fn f32_client() -> burn_cubecl::cubecl::client::ComputeClient<burn_cubecl::cubecl::cuda::CudaRuntime> {
    use burn_cubecl::cubecl::Runtime;
    burn_cubecl::cubecl::cuda::CudaRuntime::client(&Default::default())
}
