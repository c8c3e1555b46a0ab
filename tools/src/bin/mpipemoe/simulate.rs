//! `mpipemoe simulate`: predicted time and memory of every (n, strategy) on a profile.

use std::path::Path;
use std::process::ExitCode;

use clap::Args;
use mpipemoe::memory::{Execution, ExpertRoute, Strategy};
use mpipemoe::sim::{predict_shadowing, sweep, ShadowingPrediction, SimResult};
use mpipemoe::tuning::{CostModel, Profile};
use serde::Serialize;

use mpipemoe_tools::inputs::Skew;

use crate::shape::{ShapeArgs, PARTITION_CANDIDATES};

#[derive(Args, Debug)]
pub struct SimulateArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    /// A preset (`a100-cluster-N`, `h100-node-N`; N defaults to --gpus) or a profile JSON file.
    #[arg(long, default_value = "a100-cluster")]
    profile: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Also predict hot-expert shadowing under this routing skew (`balanced`, `all-to-one`,
    /// `zipf:S`, `weights:W0,W1,...`): every GPU routes its tokens with these expert shares.
    #[arg(long, value_parser = Skew::parse)]
    skew: Option<Skew>,
}

#[derive(Serialize)]
struct Row {
    n: usize,
    strategy: Strategy,
    time_ms: f64,
    forward_ms: f64,
    peak_device_mib: f64,
    host_mib: f64,
}

#[derive(Serialize)]
struct Report {
    profile: Profile,
    rows: Vec<Row>,
    best: Row,
    best_per_strategy: Vec<Row>,
    cost_model_choice: Strategy,
    #[serde(skip_serializing_if = "Option::is_none")]
    shadowing: Option<ShadowingPrediction>,
}

fn row(r: &SimResult) -> Row {
    Row {
        n: r.n_partitions,
        strategy: r.strategy,
        time_ms: r.time * 1e3,
        forward_ms: r.forward * 1e3,
        peak_device_mib: r.peak_bytes / (1024.0 * 1024.0),
        host_mib: r.host_bytes / (1024.0 * 1024.0),
    }
}

/// A preset name (with the GPU count filled in when omitted) or a JSON file.
pub fn load_profile(name: &str, gpus: usize) -> Result<Profile, String> {
    let with_gpus = if name
        .rsplit_once('-')
        .is_some_and(|(_, n)| n.chars().all(|c| c.is_ascii_digit()))
    {
        name.to_string()
    } else {
        format!("{name}-{gpus}")
    };
    if let Some(p) = Profile::preset(&with_gpus) {
        return Ok(p);
    }
    let path = Path::new(name);
    if path.exists() {
        return Profile::load(path).map_err(|e| e.to_string());
    }
    Err(format!(
        "--profile {name:?} is neither a preset (a100-cluster-N, h100-node-N) nor a file"
    ))
}

pub fn run(args: SimulateArgs) -> ExitCode {
    // The simulator's streams time the routed experts and the exchange only: a shared expert
    // would be in its peaks and not in its times, so it is refused rather than half-modelled.
    if args.shape.shared_expert.is_some() {
        eprintln!(
            "error: --shared-expert: the simulator's time model has no shared expert (`mpipemoe plan` counts its memory)"
        );
        return ExitCode::from(2);
    }
    let (shape, profile) = match args
        .shape
        .shape(1)
        .and_then(|s| load_profile(&args.profile, args.shape.gpus).map(|p| (s, p)))
    {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bytes = args.shape.dtype.bytes();
    let results = sweep(&shape, &PARTITION_CANDIDATES, &Strategy::ALL, &profile, bytes);
    let best = &results[0];
    let best_per_strategy: Vec<&SimResult> = Strategy::ALL
        .iter()
        .filter_map(|s| results.iter().find(|r| r.strategy == *s))
        .collect();
    let shape_n = mpipemoe::memory::LayerShape {
        n_partitions: best.n_partitions,
        ..shape
    };
    // No budget: the choice is the cheapest by time, and the peaks (of the simulated GPUs'
    // default execution) only fill the table.
    let gpus = Execution::on_gpu(ExpertRoute::ExpertByExpert, shape.n_ranks);
    let choice = CostModel::new(profile.clone())
        .choose(&shape_n, bytes, None, gpus)
        .map(|c| c.best)
        .unwrap_or(Strategy::None);
    let shadowing = match &args.skew {
        None => None,
        Some(skew) => match predict_shadowing(&shape, &profile, &skew.shares(shape.n_experts), bytes) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: --skew: {e}");
                return ExitCode::from(2);
            }
        },
    };
    if args.json {
        let mut rows: Vec<Row> = results.iter().map(row).collect();
        rows.sort_by(|a, b| (a.n, a.strategy.name()).cmp(&(b.n, b.strategy.name())));
        let report = Report {
            profile,
            rows,
            best: row(best),
            best_per_strategy: best_per_strategy.iter().map(|r| row(r)).collect(),
            cost_model_choice: choice,
            shadowing,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("reports serialize")
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{} | B={} tokens/GPU, M={}, H={}, E={}, N={}, {} bytes/element",
        profile.name, shape.tokens, shape.d_model, shape.d_hidden, shape.n_experts, shape.n_ranks, bytes
    );
    println!(
        "{:>3} {:<5} {:>10} {:>10} {:>10} {:>9}",
        "n", "strat", "time ms", "fwd ms", "peak MiB", "host MiB"
    );
    let mut sorted: Vec<&SimResult> = results.iter().collect();
    sorted.sort_by(|a, b| (a.n_partitions, a.strategy.name()).cmp(&(b.n_partitions, b.strategy.name())));
    for r in sorted {
        let x = row(r);
        println!(
            "{:>3} {:<5} {:>10.3} {:>10.3} {:>10.1} {:>9.1}",
            x.n,
            x.strategy.name(),
            x.time_ms,
            x.forward_ms,
            x.peak_device_mib,
            x.host_mib
        );
    }
    println!(
        "\nbest: n={} {} ({:.3} ms)",
        best.n_partitions,
        best.strategy,
        best.time * 1e3
    );
    for r in best_per_strategy {
        println!(
            "  best {:<4}: n={:<2} {:.3} ms",
            r.strategy.name(),
            r.n_partitions,
            r.time * 1e3
        );
    }
    println!(
        "cost model (Eq. 13) at n={} without a memory budget: {choice}",
        best.n_partitions
    );
    if let (Some(p), Some(skew)) = (shadowing, &args.skew) {
        println!(
            "\nshadowing under {} routing (the rule's step model: slowest rank's compute or exchange, plus the shadows' traffic):",
            skew.name()
        );
        println!("  off:                       {:.3} ms", p.off_seconds * 1e3);
        println!(
            "  auto, NCCL ring broadcast: {:.3} ms ({:.2}x), shadows {:?}",
            p.ring_seconds * 1e3,
            p.ring_speedup(),
            p.ring_shadows
        );
        println!(
            "  auto, host broadcast:      {:.3} ms ({:.2}x), shadows {:?}",
            p.host_seconds * 1e3,
            p.host_speedup(),
            p.host_shadows
        );
    }
    ExitCode::SUCCESS
}
