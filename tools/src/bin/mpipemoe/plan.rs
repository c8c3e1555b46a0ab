//! `mpipemoe plan`: the paper's memory equations and this implementation's model for a shape.

use std::process::ExitCode;

use clap::Args;
use mpipemoe::memory::MemoryPlan;

use crate::shape::ShapeArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    /// Partitions n.
    #[arg(long, default_value_t = 4)]
    partitions: usize,
    /// Print JSON (`paper` and `implementation` objects, elements).
    #[arg(long)]
    json: bool,
}

pub fn run(args: PlanArgs) -> ExitCode {
    let shape = match args.shape.shape(args.partitions) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bytes = args.shape.dtype.bytes();
    let plan = MemoryPlan::new(&shape, bytes, false);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).expect("plans serialize")
        );
        return ExitCode::SUCCESS;
    }
    let mib = |elements: f64| elements * bytes as f64 / (1024.0 * 1024.0);
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
            mib(paper),
            mib(implementation)
        );
    }
    println!("{:<13} {:>16.4} {:>12}   {:>16.4}", "phi", p.phi, "", i.phi);
    println!(
        "\nthis implementation's peak per strategy at n={} (device MiB / host MiB):",
        shape.n_partitions
    );
    for (strategy, model) in &plan.strategies {
        println!(
            "  {:<5} {:>10.1} {:>10.1}",
            strategy.name(),
            mib(model.peak_device()),
            mib(model.host()).abs()
        );
    }
    ExitCode::SUCCESS
}
