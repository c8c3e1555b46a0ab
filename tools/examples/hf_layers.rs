//! Every MoE layer of a checkpoint at once against one layer at a time: import
//! (`HfCheckpoint::load_layers` against `MoeLayer::from_hf` per layer) and export
//! (`MoeLayer::save_hf_layers` against `save_hf` per layer, chained in place), side by side
//! on a generated Mixtral-style checkpoint.
//!
//! ```text
//! cargo run --release --example hf_layers -- [--layers 24] [--experts 64] [--shards 12] [--rounds 5] [--json]
//! ```
//!
//! Rounds interleave the two ways, and medians are compared. The checkpoint is written once,
//! so its files are in the page cache: the times are parsing, mapping and copying, not the
//! disk. "Bytes read" are what the loader parsed (config, index, shard headers) and copied
//! (tensor data), from `HfCheckpoint::stats`; `from_hf` is `HfCheckpoint::open` followed by
//! `load_layer`, so its figures are those of that pair per layer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Flex;
use clap::Parser;
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::{write_synthetic_checkpoint, SyntheticCheckpoint};
use mpipemoe::hf::{HfCheckpoint, ReadStats};
use mpipemoe::MoeLayer;
use serde::Serialize;

#[path = "shared/timing.rs"]
mod timing;
use timing::{median, ms, same_files};

type B = Flex;

#[derive(Parser, Debug)]
struct Args {
    /// MoE layers (every decoder layer of a Mixtral is one).
    #[arg(long, default_value_t = 24)]
    layers: usize,
    /// Experts per layer (the number of tensors, hence of index entries, grows with it).
    #[arg(long, default_value_t = 64)]
    experts: usize,
    /// Token width.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Expert hidden width.
    #[arg(long, default_value_t = 128)]
    d_hidden: usize,
    /// Safetensors shards.
    #[arg(long, default_value_t = 12)]
    shards: usize,
    /// Interleaved rounds (medians are reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Where the checkpoint and the exports go (replaced).
    #[arg(long, default_value = "target/hf-layers")]
    dir: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    layers: usize,
    experts: usize,
    shards: usize,
    checkpoint_bytes: u64,
    import_per_layer_ms: f64,
    import_all_ms: f64,
    import_speedup: f64,
    per_layer: ReadStats,
    all: ReadStats,
    export_per_layer_ms: f64,
    export_all_ms: f64,
    export_speedup: f64,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> mpipemoe::Result<()> {
    let source = a.dir.join("checkpoint");
    let spec = SyntheticCheckpoint {
        family: mpipemoe::harness::SyntheticFamily::Mixtral,
        n_layers: a.layers,
        n_experts: a.experts,
        top_k: 2,
        d_model: a.d_model,
        d_hidden: a.d_hidden,
        n_shards: a.shards,
        bf16: true,
        seed: 1,
    };
    let _ = std::fs::remove_dir_all(&a.dir);
    let checkpoint_bytes = write_synthetic_checkpoint(&source, &spec)?;
    let device = Default::default();
    let single = || -> Arc<dyn mpipemoe::Communicator> { Arc::new(SingleRank) };
    let indices = HfCheckpoint::open(&source)?.moe_layers()?;

    // What each way reads, counted once outside the timed rounds.
    let mut per_layer = ReadStats::default();
    for &l in &indices {
        let ckpt = HfCheckpoint::open(&source)?;
        ckpt.load_layer::<B>(l, &device, single())?;
        let s = ckpt.stats();
        per_layer.shards_mapped += s.shards_mapped;
        per_layer.metadata_bytes += s.metadata_bytes;
        per_layer.tensor_bytes += s.tensor_bytes;
    }
    let all_ckpt = HfCheckpoint::open(&source)?;
    let layers = all_ckpt.load_layers::<B>(&device, single())?;
    let all = all_ckpt.stats();
    let refs: Vec<(usize, &MoeLayer<B>)> = layers.iter().map(|(l, layer)| (*l, layer)).collect();

    let (mut imp_one, mut imp_all, mut exp_one, mut exp_all) = (vec![], vec![], vec![], vec![]);
    for round in 0..a.rounds {
        // Alternate which goes first, so neither always runs on a warmer cache.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for at_once in order {
            if at_once {
                let t = Instant::now();
                let got = MoeLayer::<B>::from_hf_layers(&source, &device, single())?;
                imp_all.push(ms(t));
                assert_eq!(got.len(), indices.len());
            } else {
                let t = Instant::now();
                for &l in &indices {
                    MoeLayer::<B>::from_hf(&source, l, &device)?;
                }
                imp_one.push(ms(t));
            }
        }
        for at_once in order {
            let out = a.dir.join(if at_once { "all" } else { "one" });
            let _ = std::fs::remove_dir_all(&out);
            let t = Instant::now();
            if at_once {
                MoeLayer::save_hf_layers(&refs, &source, &out)?;
            } else {
                // One at a time: the first into a new folder, the rest in place in it.
                for (i, (l, layer)) in refs.iter().enumerate() {
                    layer.save_hf(if i == 0 { source.as_path() } else { out.as_path() }, *l, &out)?;
                }
            }
            let elapsed = ms(t);
            if at_once { &mut exp_all } else { &mut exp_one }.push(elapsed);
        }
    }
    same_files(&a.dir.join("one"), &a.dir.join("all"))?;
    let (import_per_layer_ms, import_all_ms) = (median(imp_one), median(imp_all));
    let (export_per_layer_ms, export_all_ms) = (median(exp_one), median(exp_all));
    let report = Report {
        layers: indices.len(),
        experts: a.experts,
        shards: a.shards,
        checkpoint_bytes,
        import_per_layer_ms,
        import_all_ms,
        import_speedup: import_per_layer_ms / import_all_ms,
        per_layer,
        all,
        export_per_layer_ms,
        export_all_ms,
        export_speedup: export_per_layer_ms / export_all_ms,
    };
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serializes")
        );
        return Ok(());
    }
    let r = &report;
    println!(
        "checkpoint: {} MoE layers x {} experts in {} shards, {:.1} MiB (bf16), {} rounds, medians",
        r.layers,
        r.experts,
        r.shards,
        r.checkpoint_bytes as f64 / (1 << 20) as f64,
        a.rounds
    );
    println!(
        "{:<34} {:>10} {:>8} {:>14} {:>14}",
        "", "ms", "shards", "metadata B", "tensor B"
    );
    let row = |name: &str, t: f64, s: &ReadStats| {
        println!(
            "{name:<34} {t:>10.1} {:>8} {:>14} {:>14}",
            s.shards_mapped, s.metadata_bytes, s.tensor_bytes
        )
    };
    row("import: from_hf per layer", r.import_per_layer_ms, &r.per_layer);
    row("import: HfCheckpoint::load_layers", r.import_all_ms, &r.all);
    println!("  per layer / at once: {:.2}x", r.import_speedup);
    println!(
        "{:<34} {:>10.1}",
        "export: save_hf per layer", r.export_per_layer_ms
    );
    println!("{:<34} {:>10.1}", "export: save_hf_layers", r.export_all_ms);
    println!(
        "  per layer / at once: {:.2}x (the outputs are byte-identical)",
        r.export_speedup
    );
    Ok(())
}
