//! What GPT-OSS's MXFP4 experts cost against the same model stored in bf16, side by side:
//! import of every MoE layer (`HfCheckpoint::load_layers`) and export of them unchanged
//! (`MoeLayer::save_hf_layers`), on two generated GPT-OSS checkpoints of one shape.
//!
//! ```text
//! cargo run --release -p mpipemoe-tools --example hf_mxfp4 -- [--layers 8] [--experts 32] [--d-model 512] [--d-hidden 512] [--rounds 5] [--json]
//! ```
//!
//! The comparator is the bf16 checkpoint: the same layers, read and written without the
//! MXFP4 codec. MXFP4 stores 4.25 bits a weight against 16, so it reads fewer bytes and
//! spends time decoding them; the ratio says which wins on this machine. Rounds interleave
//! the two, and medians are compared. Both checkpoints are written once and stay in the page
//! cache: these are read, decode, convert and write times, not disk times. Each round checks
//! that the unchanged MXFP4 export is byte-identical to its source.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Flex;
use clap::Parser;
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::{write_synthetic_checkpoint, SyntheticCheckpoint, SyntheticFamily};
use mpipemoe::hf::{HfCheckpoint, ReadStats};
use mpipemoe::MoeLayer;
use serde::Serialize;

#[path = "shared/timing.rs"]
mod timing;
use timing::{median, ms, same_files};

type B = Flex;

#[derive(Parser, Debug)]
struct Args {
    /// MoE layers (every GPT-OSS decoder layer is one).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Experts per layer.
    #[arg(long, default_value_t = 32)]
    experts: usize,
    /// Token width (a multiple of 32).
    #[arg(long, default_value_t = 512)]
    d_model: usize,
    /// Expert hidden width (a multiple of 32).
    #[arg(long, default_value_t = 512)]
    d_hidden: usize,
    /// Safetensors shards.
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// Interleaved rounds (medians are reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Where the checkpoints and the exports go (replaced).
    #[arg(long, default_value = "target/hf-mxfp4")]
    dir: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One storage's figures.
#[derive(Serialize)]
struct Side {
    checkpoint_bytes: u64,
    import_ms: f64,
    export_ms: f64,
    read: ReadStats,
}

#[derive(Serialize)]
struct Report {
    layers: usize,
    experts: usize,
    d_model: usize,
    d_hidden: usize,
    weights: usize,
    bf16: Side,
    mxfp4: Side,
    /// bf16 time / MXFP4 time (above 1: MXFP4 is faster).
    import_ratio: f64,
    export_ratio: f64,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> mpipemoe::Result<()> {
    let _ = std::fs::remove_dir_all(&a.dir);
    let mut sources = Vec::new();
    for (family, name) in [
        (SyntheticFamily::GptOss, "bf16"),
        (SyntheticFamily::GptOssMxfp4, "mxfp4"),
    ] {
        let spec = SyntheticCheckpoint {
            family,
            n_layers: a.layers,
            n_experts: a.experts,
            top_k: 4,
            d_model: a.d_model,
            d_hidden: a.d_hidden,
            n_shards: a.shards,
            bf16: true,
            seed: 1,
        };
        let dir = a.dir.join(name);
        let bytes = write_synthetic_checkpoint(&dir, &spec)?;
        sources.push((dir, bytes));
    }
    let device = Default::default();
    let single = || -> Arc<dyn mpipemoe::Communicator> { Arc::new(SingleRank) };
    let (mut import, mut export) = ([vec![], vec![]], [vec![], vec![]]);
    let mut read = [ReadStats::default(); 2];
    for round in 0..a.rounds {
        // Alternate which goes first, so neither always runs on a warmer cache.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let (source, _) = &sources[side];
            let t = Instant::now();
            let ckpt = HfCheckpoint::open(source)?;
            let layers = ckpt.load_layers::<B>(&device, single())?;
            import[side].push(ms(t));
            read[side] = ckpt.stats();
            drop(ckpt);
            let refs: Vec<(usize, &MoeLayer<B>)> = layers.iter().map(|(l, layer)| (*l, layer)).collect();
            let out = a.dir.join(format!("out-{side}"));
            let _ = std::fs::remove_dir_all(&out);
            let t = Instant::now();
            MoeLayer::save_hf_layers(&refs, source, &out)?;
            export[side].push(ms(t));
            same_files(source, &out)?;
        }
    }
    let side = |i: usize, import: &mut [Vec<f64>; 2], export: &mut [Vec<f64>; 2]| Side {
        checkpoint_bytes: sources[i].1,
        import_ms: median(std::mem::take(&mut import[i])),
        export_ms: median(std::mem::take(&mut export[i])),
        read: read[i],
    };
    let (bf16, mxfp4) = (
        side(0, &mut import, &mut export),
        side(1, &mut import, &mut export),
    );
    let report = Report {
        layers: a.layers,
        experts: a.experts,
        d_model: a.d_model,
        d_hidden: a.d_hidden,
        weights: a.layers * a.experts * 3 * a.d_model * a.d_hidden,
        import_ratio: bf16.import_ms / mxfp4.import_ms,
        export_ratio: bf16.export_ms / mxfp4.export_ms,
        bf16,
        mxfp4,
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
        "GPT-OSS, {} MoE layers x {} experts, d_model {}, d_hidden {}: {:.1} M expert weights, {} rounds, medians",
        r.layers,
        r.experts,
        r.d_model,
        r.d_hidden,
        r.weights as f64 / 1e6,
        a.rounds
    );
    println!(
        "{:<8} {:>12} {:>14} {:>12} {:>12}",
        "", "file MiB", "tensor MiB read", "import ms", "export ms"
    );
    for (name, s) in [("bf16", &r.bf16), ("mxfp4", &r.mxfp4)] {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "{name:<8} {:>12.1} {:>14.1} {:>12.1} {:>12.1}",
            mib(s.checkpoint_bytes),
            mib(s.read.tensor_bytes),
            s.import_ms,
            s.export_ms
        );
    }
    println!(
        "bf16 / mxfp4: import {:.2}x, export {:.2}x (the unchanged exports are byte-identical to their sources)",
        r.import_ratio, r.export_ratio
    );
    Ok(())
}
