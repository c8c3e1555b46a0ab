//! Memory benchmark: peak memory of one forward + backward of the layer, for the paper's
//! GPT3-S and BERT-L expert shapes, against the FastMoE-style baseline and the paper's model.
//!
//! ```text
//! cargo run --release --example memory -- [--json] [--out DIR] [--quick]
//! ```
//!
//! Each rank holds one expert (the paper's `E = N` setting) and `tokens` tokens, top-1. A
//! counting global allocator measures the peak over one forward + backward (after one warm-up
//! pass per shape and rank count),
//! minus what was live before; with 2 ranks (threads in one process, in lockstep) the
//! process peak is divided by 2. Offloaded partitions (S1–S3) live in anonymous memory
//! mappings outside the allocator and are reported as host bytes: on the CPU "device" and
//! host are the same RAM, so they are counted apart rather than both being counted.
//!
//! Columns: the measured device peak, host bytes, the saving against the baseline (`n = 1`, no
//! reuse), the saving the paper's equations predict against that baseline
//! (`(M_act + M_buf) − (M_act^pipe + M_buf^pipe − ΔM_act − ΔM_buf)`, Eq. 2–3, 7–8), and their
//! ratio. `paper_delta_m_bytes` is `ΔM_act + ΔM_buf` as printed (a saving relative to pipelining
//! without reuse); `implementation_*` compare with this implementation's own model.

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::harness::{measure_layer_memory, CountingAllocator};
use mpipemoe::memory::{ImplementationModel, LayerShape, PaperTerms};
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions, Strategy};
use mpipemoe_tools::report::{write_panels, Panel, Series};
use serde::Serialize;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

type B = Autodiff<Flex>;

#[derive(Parser, Debug)]
struct Args {
    /// Print the rows as a JSON array on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Folder for memory.png and memory.json.
    #[arg(long, default_value = "target/memory")]
    out: PathBuf,
    /// A small grid that runs in seconds (for a smoke test).
    #[arg(long)]
    quick: bool,
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    model: String,
    tokens: usize,
    ranks: usize,
    n: usize,
    strategy: String,
    peak_device_bytes: usize,
    host_bytes: usize,
    measured_saving_bytes: i64,
    modelled_saving_bytes: f64,
    ratio: Option<f64>,
    reduction_percent: f64,
    paper_delta_m_bytes: f64,
    implementation_peak_bytes: f64,
    implementation_host_bytes: f64,
    implementation_ratio: f64,
}

struct Grid {
    shapes: Vec<(&'static str, usize, usize)>,
    tokens: Vec<usize>,
    ranks: Vec<usize>,
}

impl Grid {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                shapes: vec![("small", 128, 512)],
                tokens: vec![1024],
                ranks: vec![1, 2],
            }
        } else {
            Self {
                shapes: vec![("GPT3-S", 768, 3072), ("BERT-L", 1024, 4096)],
                tokens: vec![4096, 16384],
                ranks: vec![1, 2],
            }
        }
    }

    /// Partition counts per token count and rank count: fewer at 16384 tokens (and fewer
    /// still with two ranks, which do twice the work) to keep the whole run under 10 minutes
    /// on a 2-core machine.
    fn partitions(&self, tokens: usize, ranks: usize) -> Vec<usize> {
        match (tokens >= 16384, ranks > 1) {
            (false, _) => vec![2, 4, 8],
            (true, false) => vec![4, 8],
            (true, true) => vec![8],
        }
    }

    fn runs(&self) -> usize {
        let mut runs = 0;
        for &ranks in &self.ranks {
            for &t in &self.tokens {
                runs += 1 + 5 * self.partitions(t, ranks).len();
            }
        }
        runs * self.shapes.len()
    }
}

fn label(strategy: Option<Strategy>) -> &'static str {
    match strategy {
        None => "baseline",
        Some(Strategy::None) => "none",
        Some(s) => s.name(),
    }
}

fn main() -> mpipemoe::Result<()> {
    let args = Args::parse();
    let grid = Grid::new(args.quick);
    let device = Default::default();
    let bar = ProgressBar::new(grid.runs() as u64);
    bar.set_style(ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap());
    let started = Instant::now();
    let mut rows = Vec::new();
    for &(model, m, h) in &grid.shapes {
        for &ranks in &grid.ranks {
            let base_config = MoeLayerConfig::new(m, h, ranks, 1).with_seed(1);
            // Warm-up: thread pools and allocator caches settle before anything is measured.
            measure_layer_memory::<B>(&ALLOC, &base_config, 256, ranks, true, &device)?;
            for &tokens in &grid.tokens {
                let mut configs = vec![(1, None)];
                for n in grid.partitions(tokens, ranks) {
                    configs.extend(Strategy::ALL.map(|s| (n, Some(s))));
                }
                let mut baseline = 0usize;
                for (n, strategy) in configs {
                    let name = label(strategy);
                    bar.set_message(format!("{model} tokens={tokens} ranks={ranks} n={n} {name}"));
                    let reuse = MemoryReuse::from(strategy.unwrap_or(Strategy::None));
                    let config = base_config
                        .clone()
                        .with_partitions(Partitions::Fixed(n))
                        .with_memory_reuse(reuse);
                    let measured = measure_layer_memory::<B>(&ALLOC, &config, tokens, ranks, false, &device)?;
                    if strategy.is_none() {
                        baseline = measured.peak_device_bytes;
                    }
                    let shape = LayerShape::paper(tokens, m, h, ranks, n);
                    let paper = PaperTerms::new(&shape).to_bytes(4);
                    let modelled = match strategy {
                        None => 0.0,
                        Some(s) => paper.saving_vs_fastmoe(s.reuses_buffers()),
                    };
                    let implementation = ImplementationModel::new(&shape, strategy.unwrap_or(Strategy::None));
                    let saving = baseline as i64 - measured.peak_device_bytes as i64;
                    rows.push(Row {
                        model: model.to_string(),
                        tokens,
                        ranks,
                        n,
                        strategy: name.to_string(),
                        peak_device_bytes: measured.peak_device_bytes,
                        host_bytes: measured.host_bytes,
                        measured_saving_bytes: saving,
                        modelled_saving_bytes: modelled,
                        ratio: (modelled > 0.0).then(|| saving as f64 / modelled),
                        reduction_percent: 100.0 * saving as f64 / baseline as f64,
                        paper_delta_m_bytes: paper.delta_total(),
                        implementation_peak_bytes: implementation.peak_device() * 4.0,
                        implementation_host_bytes: implementation.host() * 4.0,
                        implementation_ratio: measured.peak_device_bytes as f64
                            / (implementation.peak_device() * 4.0),
                    });
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_with_message(format!("done in {:.0} s", started.elapsed().as_secs_f64()));

    let table = render_table(&rows);
    std::fs::create_dir_all(&args.out).map_err(|e| mpipemoe::MoeError::file(&args.out, e.to_string()))?;
    let json = serde_json::to_string_pretty(&rows).expect("rows serialize");
    let json_path = args.out.join("memory.json");
    std::fs::write(&json_path, &json).map_err(|e| mpipemoe::MoeError::file(&json_path, e.to_string()))?;
    let png = args.out.join("memory.png");
    let chart = write_panels(
        &png,
        "Peak device memory per rank, one forward + backward (Flex, CPU)",
        &panels(&rows),
        2,
    );
    if args.json {
        eprintln!("{table}");
        println!("{json}");
    } else {
        println!("{table}");
    }
    match chart {
        Ok(()) => eprintln!("chart: {}", png.display()),
        Err(e) => eprintln!("chart not written: {e}"),
    }
    eprintln!("rows: {}", json_path.display());
    Ok(())
}

fn mb(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

fn render_table(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<7} {:>6} {:>5} {:>2} {:<8} {:>10} {:>9} {:>10} {:>8} {:>10} {:>6} {:>10} {:>6}\n",
        "model",
        "tokens",
        "ranks",
        "n",
        "strategy",
        "peak MiB",
        "host MiB",
        "saved MiB",
        "saved %",
        "model MiB",
        "ratio",
        "impl MiB",
        "m/impl"
    ));
    for r in rows {
        out.push_str(&format!(
            "{:<7} {:>6} {:>5} {:>2} {:<8} {:>10.1} {:>9.1} {:>10.1} {:>7.1}% {:>10.1} {:>6} {:>10.1} {:>6.2}\n",
            r.model,
            r.tokens,
            r.ranks,
            r.n,
            r.strategy,
            mb(r.peak_device_bytes as f64),
            mb(r.host_bytes as f64),
            mb(r.measured_saving_bytes as f64),
            r.reduction_percent,
            mb(r.modelled_saving_bytes),
            r.ratio.map_or("-".to_string(), |v| format!("{v:.2}")),
            mb(r.implementation_peak_bytes),
            r.implementation_ratio,
        ));
    }
    let s4: Vec<&Row> = rows
        .iter()
        .filter(|r| r.strategy == "s4" && (r.n == 4 || r.n == 8))
        .collect();
    let worst = s4.iter().filter_map(|r| r.ratio).fold(f64::INFINITY, f64::min);
    out.push_str(&format!(
        "\nS4 at n = 4 and 8: lowest measured/modelled saving ratio {worst:.2} (target >= 0.95) over {} rows\n",
        s4.len()
    ));
    out
}

fn panels(rows: &[Row]) -> Vec<Panel> {
    let mut groups: Vec<(String, usize, usize)> = rows
        .iter()
        .map(|r| (r.model.clone(), r.tokens, r.ranks))
        .collect();
    groups.dedup();
    groups
        .into_iter()
        .map(|(model, tokens, ranks)| {
            let group: Vec<&Row> = rows
                .iter()
                .filter(|r| r.model == model && r.tokens == tokens && r.ranks == ranks)
                .collect();
            let baseline = group
                .iter()
                .find(|r| r.strategy == "baseline")
                .map(|r| mb(r.peak_device_bytes as f64));
            let ns: Vec<f64> = group.iter().map(|r| r.n as f64).collect();
            let n_max = ns.iter().cloned().fold(1.0, f64::max);
            let mut series = vec![Series {
                name: "baseline (n=1)".into(),
                points: baseline.map_or(vec![], |b| vec![(1.0, b), (n_max, b)]),
            }];
            for strategy in ["none", "s1", "s2", "s3", "s4"] {
                series.push(Series {
                    name: if strategy == "none" {
                        "PipeMoE (no reuse)".into()
                    } else {
                        strategy.to_uppercase()
                    },
                    points: group
                        .iter()
                        .filter(|r| r.strategy == strategy)
                        .map(|r| (r.n as f64, mb(r.peak_device_bytes as f64)))
                        .collect(),
                });
            }
            Panel {
                title: format!("{model}, {tokens} tokens/rank, {ranks} rank(s)"),
                x_label: "partitions n".into(),
                y_label: "peak MiB".into(),
                series,
                log_x: true,
            }
        })
        .collect()
}
