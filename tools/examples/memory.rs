//! Memory benchmark: peak memory of one forward + backward of the layer, for the paper's
//! GPT3-S and BERT-L expert shapes, against the FastMoE-style baseline, the paper's Eq. 8 and
//! this implementation's model, with balanced routing and with every token routed to one rank.
//!
//! ```text
//! cargo run --release --example memory -- [--json] [--out DIR] [--quick]
//! ```
//!
//! Each rank holds one expert (the paper's `E = N` setting) and `tokens` tokens, top-1. The
//! router is set so that routing is balanced (every expert receives `tokens` rows) or, in the
//! skewed rows, so that every token of both ranks goes to rank 0's expert. A counting global
//! allocator measures each rank's peak over one forward + backward above what it held before
//! (after one warm-up pass per configuration); the table shows the hot rank. Offloaded
//! partitions (S1–S3) live in anonymous memory mappings outside the allocator and are reported
//! as host bytes: on the CPU "device" and host are the same RAM, so they are counted apart.
//!
//! Columns, per row:
//! - `cut`: the saving against the FastMoE-style baseline of the same rows (`n = 1`, no
//!   reuse), in MiB and as a share of the baseline;
//! - `cut/2ΔM`: that saving over the paper's `ΔM_act + ΔM_buf = 2·ΔM` (Eq. 8), the saving
//!   the paper attributes to partition-buffer reuse;
//! - `reuse/2ΔM`: the saving against PipeMoE at the same `n` (the same pipeline without
//!   reuse) over `2·ΔM`: what reuse itself saves here;
//! - `model`: this implementation's modelled peak of the hot rank (`ImplementationModel` on
//!   its rows, the experts on Flex's own path as the layer runs them), and `meas/model`.

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::format::TensorMap;
use mpipemoe::harness::{measure_layer_memory_with, CountingAllocator, TokenSource};
use mpipemoe::memory::Strategy;
use mpipemoe::memory::{Execution, ExpertRoute, ImplementationModel, LayerShape, PaperTerms, RankRows};
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions};
use mpipemoe_tools::inputs::{balanced_router, balanced_tokens};
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
    routing: String,
    tokens: usize,
    ranks: usize,
    n: usize,
    strategy: String,
    /// The hot rank's peak (the largest over ranks).
    peak_device_bytes: usize,
    host_bytes: usize,
    cut_bytes: i64,
    cut_percent: f64,
    /// Eq. 8's ΔM_act + ΔM_buf for this shape and n.
    paper_two_delta_m_bytes: f64,
    cut_over_two_delta_m: Option<f64>,
    reuse_saving_bytes: Option<i64>,
    reuse_over_two_delta_m: Option<f64>,
    model_peak_bytes: f64,
    measured_over_model: f64,
}

struct Grid {
    shapes: Vec<(&'static str, usize, usize)>,
    tokens: Vec<usize>,
    ranks: Vec<usize>,
    skewed_tokens: usize,
}

impl Grid {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                shapes: vec![("small", 128, 512)],
                tokens: vec![1024],
                ranks: vec![1, 2],
                skewed_tokens: 1024,
            }
        } else {
            Self {
                shapes: vec![("GPT3-S", 768, 3072), ("BERT-L", 1024, 4096)],
                tokens: vec![4096, 16384],
                ranks: vec![1, 2],
                skewed_tokens: 4096,
            }
        }
    }

    /// Partition counts per token count and rank count: fewer at 16384 tokens (and fewer
    /// still with two ranks, which do twice the work) to keep the whole run near 10 minutes on
    /// a 2-core machine.
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
        (runs + 1 + 5 * 2) * self.shapes.len()
    }
}

fn label(strategy: Option<Strategy>) -> &'static str {
    match strategy {
        None => "baseline",
        Some(Strategy::None) => "none",
        Some(s) => s.name(),
    }
}

/// The layer's weights with a router that balances (`skewed = false`) or sends every token
/// to expert 0 (rank 0).
fn weights(config: &MoeLayerConfig, skewed: bool) -> TensorMap {
    let layer = config
        .clone()
        .try_init::<burn::backend::NdArray>(&Default::default())
        .expect("valid config");
    let mut w = layer.gather_tensor_map().expect("one rank").expect("rank 0");
    let (e, m) = (config.n_experts, config.d_model);
    let router = if skewed {
        vec![0.0f32; e * m]
    } else {
        balanced_router(e, m)
    };
    w.insert("router.weight".into(), TensorData::new(router, [e, m]));
    let bias: Vec<f32> = (0..e)
        .map(|i| if skewed && i > 0 { -30.0 } else { 0.0 })
        .collect();
    w.insert("router.bias".into(), TensorData::new(bias, [e]));
    w
}

fn tokens_note() -> &'static str {
    "tokens: seeded; balanced rows route evenly (a one-hot router and tokens whose first E coordinates name their expert)"
}

fn main() -> mpipemoe::Result<()> {
    let args = Args::parse();
    let grid = Grid::new(args.quick);
    let device = Default::default();
    let bar = ProgressBar::new(grid.runs() as u64);
    bar.set_style(ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap());
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut plans: Vec<(String, usize, usize, bool, Vec<usize>)> = Vec::new();
    for &(model, _, _) in &grid.shapes {
        for &ranks in &grid.ranks {
            for &tokens in &grid.tokens {
                plans.push((
                    model.to_string(),
                    ranks,
                    tokens,
                    false,
                    grid.partitions(tokens, ranks),
                ));
            }
        }
        plans.push((model.to_string(), 2, grid.skewed_tokens, true, vec![4, 8]));
    }
    let mut warmed = std::collections::HashSet::new();
    for (model, ranks, tokens, skewed, partitions) in plans {
        let (_, m, h) = *grid.shapes.iter().find(|s| s.0 == model).expect("listed");
        let base_config = MoeLayerConfig::new(m, h, ranks, 1)
            .with_seed(1)
            .with_router_bias(true);
        let w = weights(&base_config, skewed);
        if warmed.insert((model.clone(), ranks)) {
            // Thread pools and allocator caches settle before anything is measured.
            measure_layer_memory_with::<B>(&ALLOC, &base_config, Some(&w), None, 256, ranks, true, &device)?;
        }
        let mut configs = vec![(1, None)];
        for &n in &partitions {
            configs.extend(Strategy::ALL.map(|s| (n, Some(s))));
        }
        let routing = if skewed { "all to rank 0" } else { "balanced" };
        let mut baseline = 0usize;
        let mut pipemoe = std::collections::HashMap::new();
        for (n, strategy) in configs {
            let name = label(strategy);
            bar.set_message(format!(
                "{model} {routing} tokens={tokens} ranks={ranks} n={n} {name}"
            ));
            let config = base_config
                .clone()
                .with_partitions(Partitions::Fixed(n))
                .with_memory_reuse(MemoryReuse::from(strategy.unwrap_or(Strategy::None)));
            let balanced = |rank: usize| balanced_tokens(3, rank, tokens, m, ranks, 1);
            let source: Option<TokenSource<'_>> = (!skewed).then_some(&balanced);
            let measured = measure_layer_memory_with::<B>(
                &ALLOC,
                &config,
                Some(&w),
                source,
                tokens,
                ranks,
                true,
                &device,
            )?;
            let hot = measured.peak_device_bytes;
            if strategy.is_none() {
                baseline = hot;
            }
            if strategy == Some(Strategy::None) {
                pipemoe.insert(n, hot);
            }
            let shape = LayerShape::paper(tokens, m, h, ranks, n);
            let two_delta = PaperTerms::new(&shape).to_bytes(4).delta_total();
            let rank_rows = if skewed {
                RankRows::skewed(&shape, ranks as f64)
            } else {
                RankRows::balanced(&shape)
            };
            // The layer runs without a budget on Flex's own expert path, one expert a rank
            // here, so as many at once as threads changes nothing; in issue order, Flex's
            // executor at every rank count.
            let execution = Execution::in_order(ExpertRoute::Tasks { concurrent: 1 });
            let strategy_run = strategy.unwrap_or(Strategy::None);
            let model_peak = ImplementationModel::for_execution(&shape, &rank_rows, strategy_run, execution)
                .peak_device()
                * 4.0;
            let cut = baseline as i64 - hot as i64;
            let reuse = match strategy {
                Some(s) if s != Strategy::None => pipemoe.get(&n).map(|&p| p as i64 - hot as i64),
                _ => None,
            };
            rows.push(Row {
                model: model.clone(),
                routing: routing.to_string(),
                tokens,
                ranks,
                n,
                strategy: name.to_string(),
                peak_device_bytes: hot,
                host_bytes: measured.host_bytes,
                cut_bytes: cut,
                cut_percent: 100.0 * cut as f64 / baseline as f64,
                paper_two_delta_m_bytes: two_delta,
                cut_over_two_delta_m: (strategy.is_some() && two_delta > 0.0).then(|| cut as f64 / two_delta),
                reuse_saving_bytes: reuse,
                reuse_over_two_delta_m: reuse.filter(|_| two_delta > 0.0).map(|r| r as f64 / two_delta),
                model_peak_bytes: model_peak,
                measured_over_model: hot as f64 / model_peak,
            });
            bar.inc(1);
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
        "Peak device memory of the hot rank, one forward + backward (Flex, CPU)",
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
    eprintln!("rows: {}; {}", json_path.display(), tokens_note());
    Ok(())
}

fn mb(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

fn opt(v: Option<f64>) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.2}"))
}

fn render_table(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<7} {:<13} {:>6} {:>5} {:>2} {:<8} {:>9} {:>9} {:>9} {:>7} {:>8} {:>10} {:>9} {:>10}\n",
        "model",
        "routing",
        "tokens",
        "ranks",
        "n",
        "strategy",
        "peak MiB",
        "host MiB",
        "cut MiB",
        "cut %",
        "cut/2ΔM",
        "reuse/2ΔM",
        "model MiB",
        "meas/model"
    ));
    for r in rows {
        out.push_str(&format!(
            "{:<7} {:<13} {:>6} {:>5} {:>2} {:<8} {:>9.1} {:>9.1} {:>9.1} {:>6.1}% {:>8} {:>10} {:>9.1} {:>10.2}\n",
            r.model,
            r.routing,
            r.tokens,
            r.ranks,
            r.n,
            r.strategy,
            mb(r.peak_device_bytes as f64),
            mb(r.host_bytes as f64),
            mb(r.cut_bytes as f64),
            r.cut_percent,
            opt(r.cut_over_two_delta_m),
            opt(r.reuse_over_two_delta_m),
            mb(r.model_peak_bytes),
            r.measured_over_model,
        ));
    }
    let ratios: Vec<f64> = rows.iter().map(|r| r.measured_over_model).collect();
    let (lo, hi) = ratios
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, h), &v| (l.min(v), h.max(v)));
    out.push_str(&format!(
        "\nmeasured/model over {} rows: {lo:.2} .. {hi:.2} (target: within 15%)\n",
        rows.len()
    ));
    out
}

fn panels(rows: &[Row]) -> Vec<Panel> {
    let mut groups: Vec<(String, String, usize, usize)> = rows
        .iter()
        .map(|r| (r.model.clone(), r.routing.clone(), r.tokens, r.ranks))
        .collect();
    groups.dedup();
    groups
        .into_iter()
        .map(|(model, routing, tokens, ranks)| {
            let group: Vec<&Row> = rows
                .iter()
                .filter(|r| {
                    r.model == model && r.routing == routing && r.tokens == tokens && r.ranks == ranks
                })
                .collect();
            let baseline = group
                .iter()
                .find(|r| r.strategy == "baseline")
                .map(|r| mb(r.peak_device_bytes as f64));
            let n_max = group.iter().map(|r| r.n as f64).fold(1.0, f64::max);
            let mut series = vec![Series {
                name: "FastMoE-style baseline (n=1)".into(),
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
                title: format!("{model}, {tokens} tokens/rank, {ranks} rank(s), {routing}"),
                x_label: "partitions n".into(),
                y_label: "hot rank peak MiB".into(),
                series,
                log_x: true,
            }
        })
        .collect()
}
