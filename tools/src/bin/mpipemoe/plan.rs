//! `mpipemoe plan`: the paper's memory equations and this implementation's model for a shape,
//! and, with `--budget`, the partitions and strategy a per-rank memory budget allows under
//! routing skew.

use std::process::ExitCode;

use clap::{Args, ValueEnum};
use mpipemoe::memory::Strategy;
use mpipemoe::memory::{
    fit_budget, rank_peak_bytes, BudgetCandidate, Execution, ExpertRoute, GemmOperands, LayerShape,
    MemoryPlan, RankRows, MODEL_HEADROOM,
};
use mpipemoe::tuning::CostModel;
use mpipemoe::MAX_PARTITIONS;
use mpipemoe_tools::backends::PrecisionArg;
use mpipemoe_tools::flags::{self, count};
use serde::Serialize;

use crate::shape::{ShapeArgs, PARTITION_CANDIDATES};
use crate::simulate::load_profile;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    /// Partitions n (default 4; with --budget, the budget chooses among 1, 2, 4, 8, 16).
    #[arg(long, value_parser = count(1, MAX_PARTITIONS))]
    partitions: Option<usize>,
    /// A per-rank memory budget in bytes (or with a unit: 80GiB, 1.5GB): report the cheapest
    /// (n, strategy) whose modelled peak on the worst rank fits it.
    #[arg(long, value_parser = flags::bytes)]
    budget: Option<usize>,
    /// Routing skew for --budget: the worst rank receives this many times the mean rows
    /// (from 1, every rank the mean, to --gpus, every GPU's rows on one).
    #[arg(long, default_value_t = 1.0, requires = "budget")]
    imbalance: f64,
    /// The profile that ranks strategies by cost for --budget (a preset or a JSON file).
    #[arg(long, default_value = "a100-cluster", requires = "budget")]
    profile: String,
    /// Who computes the experts, for --budget: a device library with scratch for a whole
    /// partition (cuBLAS), the backend's own experts as tasks (Flex,
    /// --concurrent of them at once), the primitives, expert by expert (WGPU and NdArray,
    /// and experts with adapters where there is no library), or the primitives with their
    /// products on a library (experts with adapters on CUDA).
    #[arg(long, value_enum, default_value_t = Route::PartitionScratch, requires = "budget")]
    route: Route,
    /// Experts running at once on `--route tasks` (Flex: its pool's threads).
    #[arg(long, default_value_t = 1, value_parser = count(1, 4096), requires = "budget")]
    concurrent: usize,
    /// The experts' GEMM precision on a library's routes, for --budget: at `bf16` the
    /// partition-scratch path holds bf16 copies of its operands (each partition's rows, and
    /// every expert's matrices for the pass) and bf16 scratch where a GEMM reads it; on
    /// `--route library-products` each product's section holds copies of both its operands.
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32, requires = "budget")]
    gemm_precision: PrecisionArg,
    /// With `--gemm-precision bf16`: the experts' bf16 copies kept from the forward to the
    /// backward, not made in each pass (`CublasOptions::bf16_weights_per_step`).
    #[arg(long, requires = "budget")]
    bf16_weights_per_step: bool,
    /// How the exchange runs its steps, for --budget: `threads` (a worker per stream, the
    /// streams at once: CUDA's above one rank), `in-order`, or `auto`: the layer's choice for
    /// the route's backend (in order at one GPU and on `--route tasks`, Flex's; threaded
    /// otherwise, which holds more).
    #[arg(long, value_enum, default_value_t = ExecutorArg::Auto, requires = "budget")]
    executor: ExecutorArg,
    /// Print JSON (`paper` and `implementation` objects, elements; `budget` with --budget).
    #[arg(long)]
    json: bool,
}

/// `--executor`'s values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExecutorArg {
    Auto,
    Threads,
    InOrder,
}

/// `--route`'s values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Route {
    PartitionScratch,
    Tasks,
    ExpertByExpert,
    LibraryProducts,
}

impl PlanArgs {
    /// The precision flags describe a library's routes over f32 tensors (the cuBLAS path
    /// multiplies f32 tensors only, through bf16 copies at bf16); elsewhere they would change
    /// nothing, so they are refused rather than ignored. The weights' copies kept for the step
    /// are the partition-scratch path's alone.
    fn check_precision(&self, bytes: usize) -> Result<(), String> {
        let bf16 = self.gemm_precision == PrecisionArg::Bf16;
        if self.bf16_weights_per_step && !bf16 {
            return Err("--bf16-weights-per-step needs --gemm-precision bf16".into());
        }
        if self.gemm_precision != PrecisionArg::F32
            && !matches!(self.route, Route::PartitionScratch | Route::LibraryProducts)
        {
            return Err(format!(
                "--gemm-precision {} applies to --route partition-scratch or library-products only (the other routes multiply the tensors as they are)",
                self.gemm_precision.precision()
            ));
        }
        if self.bf16_weights_per_step && !matches!(self.route, Route::PartitionScratch) {
            return Err("--bf16-weights-per-step applies to --route partition-scratch only (library-products converts each product's operands in its section)".into());
        }
        if bf16 && bytes != 4 {
            return Err(
                "--gemm-precision bf16 describes f32 tensors (the cuBLAS path's): use --dtype f32".into(),
            );
        }
        Ok(())
    }

    /// The route run as `--executor` says on `n_ranks` ranks.
    fn execution(&self, n_ranks: usize) -> Execution {
        let route = self.route();
        match (self.executor, self.route) {
            (ExecutorArg::Threads, _) => Execution::threaded(route),
            (ExecutorArg::InOrder, _) | (ExecutorArg::Auto, Route::Tasks) => Execution::in_order(route),
            (ExecutorArg::Auto, _) => Execution::on_gpu(route, n_ranks),
        }
    }

    fn route(&self) -> ExpertRoute {
        match self.route {
            Route::PartitionScratch => ExpertRoute::PartitionScratch {
                operands: GemmOperands::at(self.gemm_precision.precision(), self.bf16_weights_per_step),
            },
            Route::Tasks => ExpertRoute::Tasks {
                concurrent: self.concurrent,
            },
            Route::ExpertByExpert => ExpertRoute::ExpertByExpert,
            Route::LibraryProducts => ExpertRoute::LibraryProducts {
                operands: GemmOperands::at(self.gemm_precision.precision(), false),
            },
        }
    }
}

/// The budget's answer, as `--json` prints it.
#[derive(Serialize)]
struct BudgetAnswer {
    bytes: usize,
    imbalance: f64,
    route: ExpertRoute,
    threaded: bool,
    fits: bool,
    n: Option<usize>,
    strategy: Option<Strategy>,
    worst_rank_peak_bytes: Option<f64>,
    headroom: f64,
    candidates: Vec<BudgetCandidate>,
}

#[derive(Serialize)]
struct Report {
    #[serde(flatten)]
    plan: MemoryPlan,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<BudgetAnswer>,
}

fn budget_answer(
    args: &PlanArgs,
    shape: &LayerShape,
    bytes: usize,
    budget: usize,
) -> Result<BudgetAnswer, String> {
    // The worst rank receives at least the mean and at most every GPU's rows.
    let most = shape.n_ranks as f64;
    if !(args.imbalance.is_finite() && (1.0..=most).contains(&args.imbalance)) {
        return Err(format!(
            "--imbalance {} must be a number in [1, {most}] (--gpus): the worst rank receives \
             at least the mean rows and at most every GPU's",
            args.imbalance
        ));
    }
    args.check_precision(bytes)?;
    let profile = load_profile(&args.profile, shape.n_ranks)?;
    let cost = CostModel::new(profile);
    let partitions: Vec<usize> = args.partitions.map_or(PARTITION_CANDIDATES.to_vec(), |n| vec![n]);
    let at = |n: usize| LayerShape {
        n_partitions: n,
        ..*shape
    };
    let mut by_cost = |n: usize| cost.cheapest_first(&at(n), bytes);
    let mut peak = |n: usize, strategy: Strategy| {
        let shape = at(n);
        let rows = RankRows::skewed(&shape, args.imbalance);
        rank_peak_bytes(&shape, &rows, strategy, args.execution(shape.n_ranks), bytes)
    };
    // Every (n, strategy), for the table; the rule's choice is the first that fits.
    let (choice, _) = fit_budget(budget, &partitions, &mut by_cost, &mut peak);
    let candidates: Vec<BudgetCandidate> = partitions
        .iter()
        .flat_map(|&n| Strategy::ALL.into_iter().map(move |s| (n, s)))
        .map(|(n, strategy)| {
            let peak_bytes = peak(n, strategy);
            BudgetCandidate {
                n_partitions: n,
                strategy,
                peak_bytes,
                fits: peak_bytes * MODEL_HEADROOM <= budget as f64,
            }
        })
        .collect();
    Ok(BudgetAnswer {
        bytes: budget,
        imbalance: args.imbalance,
        route: args.route(),
        threaded: args.execution(shape.n_ranks).threaded,
        fits: choice.is_some(),
        n: choice.map(|c| c.n_partitions),
        strategy: choice.map(|c| c.strategy),
        worst_rank_peak_bytes: choice.map(|c| c.peak_bytes),
        headroom: MODEL_HEADROOM,
        candidates,
    })
}

pub fn run(args: PlanArgs) -> ExitCode {
    let n = args.partitions.unwrap_or(4);
    let shape = match args.shape.shape(n) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bytes = args.shape.dtype.bytes();
    let budget = match args
        .budget
        .map(|b| budget_answer(&args, &shape, bytes, b))
        .transpose()
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // The memory plan at the budget's choice, where it made one.
    let shape = LayerShape {
        n_partitions: budget.as_ref().and_then(|b| b.n).unwrap_or(n),
        ..shape
    };
    let plan = MemoryPlan::new(&shape, bytes, false);
    if args.json {
        let report = Report { plan, budget };
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("plans serialize")
        );
        return ExitCode::SUCCESS;
    }
    print_plan(&plan, &shape, bytes);
    if let Some(b) = &budget {
        print_budget(b);
    }
    ExitCode::SUCCESS
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

fn print_plan(plan: &MemoryPlan, shape: &LayerShape, bytes: usize) {
    let mib_el = |elements: f64| mib(elements * bytes as f64);
    println!(
        "B={} tokens/GPU, top_k={}, M={}, H={}, E={} ({} per GPU), N={}, n={}, {} bytes/element",
        shape.tokens,
        shape.top_k,
        shape.d_model,
        shape.d_hidden,
        shape.n_experts,
        shape.local_experts(),
        shape.n_ranks,
        shape.n_partitions,
        bytes
    );
    if let Some(hs) = shape.shared_expert {
        println!("shared expert: SwiGLU of hidden width {hs} on every token (in the peaks below, not in the paper's terms)");
    }
    println!(
        "{:<13} {:>16} {:>12}   {:>16} {:>12}",
        "term", "paper elements", "paper MiB", "impl elements", "impl MiB"
    );
    let (p, i) = (&plan.paper, &plan.implementation);
    let rows = [
        ("M_ms", p.m_ms, i.m_ms),
        ("M_act", p.m_act, i.m_act),
        ("M_buf", p.m_buf, i.m_buf),
        ("M_act^pipe", p.m_act_pipe, i.m_act_pipe),
        ("dM_act", p.delta_m_act, i.delta_m_act),
        ("dM_buf", p.delta_m_buf, i.delta_m_buf),
    ];
    for (name, paper, implementation) in rows {
        println!(
            "{name:<13} {paper:>16.0} {:>12.1}   {implementation:>16.0} {:>12.1}",
            mib_el(paper),
            mib_el(implementation)
        );
    }
    println!("{:<13} {:>16.4} {:>12}   {:>16.4}", "phi", p.phi, "", i.phi);
    println!(
        "\nthis implementation's peak per strategy at n={} (device MiB / host MiB, balanced routing):",
        shape.n_partitions
    );
    for (strategy, model) in &plan.strategies {
        println!(
            "  {:<5} {:>10.1} {:>10.1}   at {}",
            strategy.name(),
            mib_el(model.peak_device()),
            mib_el(model.host()).abs(),
            model.peak().step
        );
    }
}

fn print_budget(b: &BudgetAnswer) {
    println!(
        "\nworst rank receiving {:.2}x the mean rows, experts {}, {}, budget {:.1} MiB (the model's peak x {:.2} must fit):",
        b.imbalance,
        b.route.name(),
        if b.threaded { "threaded" } else { "in order" },
        mib(b.bytes as f64),
        b.headroom
    );
    println!("  {:>3} {:<5} {:>12}  fits", "n", "strat", "peak MiB");
    for c in &b.candidates {
        println!(
            "  {:>3} {:<5} {:>12.1}  {}",
            c.n_partitions,
            c.strategy.name(),
            mib(c.peak_bytes),
            if c.fits { "yes" } else { "no" }
        );
    }
    match (b.n, b.strategy, b.worst_rank_peak_bytes) {
        (Some(n), Some(s), Some(p)) => println!(
            "chosen: n={n} {s} (smallest n that fits, then the cheapest strategy by the cost model): {:.1} MiB on the worst rank",
            mib(p)
        ),
        _ => println!("nothing fits: split the batch or raise the budget"),
    }
}
