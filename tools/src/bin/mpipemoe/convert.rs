//! `mpipemoe convert`: a Hugging Face MoE layer to a canonical float32 layer file and back.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{ArgGroup, Args};
use mpipemoe::format::{layer_file_config, read_safetensors, LayerMeta};
use mpipemoe::hf;
use mpipemoe::MoeError;
use mpipemoe_tools::flags::may_write;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("direction").required(true).args(["from_hf", "to_hf"])))]
pub struct ConvertArgs {
    /// Read MoE layer --layer of this checkpoint folder and write it to --out as a canonical
    /// float32 layer file (the cases' names and meta, plus kind and hf_layer).
    #[arg(long, value_name = "DIR", requires = "layer")]
    from_hf: Option<PathBuf>,
    /// Write the canonical layer file --input back into MoE layer --layer of this checkpoint
    /// folder (its names, dtypes and shards), as a complete checkpoint in --out.
    #[arg(long, value_name = "DIR")]
    to_hf: Option<PathBuf>,
    /// The MoE layer's index in the model (for --to-hf, defaults to the file's `hf_layer`).
    #[arg(long)]
    layer: Option<usize>,
    /// The canonical layer file to write back (--to-hf).
    #[arg(long, value_name = "FILE")]
    input: Option<PathBuf>,
    /// The canonical file to write (--from-hf), or the checkpoint folder to write (--to-hf).
    /// Never inside the source folder, nor the source folder itself or a folder containing
    /// it (for --to-hf, the source itself takes --in-place). Written whole: into a temporary
    /// file or folder beside it, renamed into place when complete, so a failure leaves it as
    /// it was.
    #[arg(long, required_unless_present = "in_place")]
    out: Option<PathBuf>,
    /// Replace an existing --out. Without it an existing file (--from-hf) or a non-empty
    /// folder (--to-hf) is refused. With it, a folder is replaced as a whole: files in it that
    /// the new checkpoint lacks (an old model.safetensors beside new shards, say) are
    /// removed, so no stale weights remain.
    #[arg(long)]
    overwrite: bool,
    /// --to-hf only: write the layer into the checkpoint folder itself. The new folder is
    /// built beside it and takes its place only when complete (unchanged shards
    /// hard-linked), so a failure leaves the checkpoint as it was.
    #[arg(long, conflicts_with_all = ["out", "from_hf"])]
    in_place: bool,
    /// Accept NaN or infinite weights in the checkpoint (--from-hf); by default they are an
    /// error naming the tensor.
    #[arg(long)]
    allow_nonfinite: bool,
}

pub fn run(args: ConvertArgs) -> ExitCode {
    let result = match (&args.from_hf, &args.to_hf) {
        (Some(dir), _) => from_hf(dir, &args),
        (_, Some(dir)) => to_hf(dir, &args),
        _ => unreachable!("clap requires one direction"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn from_hf(dir: &Path, args: &ConvertArgs) -> Result<(), MoeError> {
    // clap makes --from-hf require --layer.
    let layer = args
        .layer
        .ok_or_else(|| MoeError::Input("--from-hf needs --layer (see `mpipemoe inspect DIR`)".into()))?;
    let out = args
        .out
        .as_deref()
        .ok_or_else(|| MoeError::Input("--from-hf needs --out FILE".into()))?;
    // A file written into the checkpoint's folder would replace one of its files or sit among
    // its shards.
    mpipemoe::files::check_apart(dir, out, "--out")?;
    may_write(out, args.overwrite).map_err(MoeError::Input)?;
    let options = hf::ImportOptions {
        allow_nonfinite: args.allow_nonfinite,
    };
    let info = hf::convert_to_file_with(dir, layer, out, &options)?;
    let c = &info.config;
    println!(
        "{}: layer {} ({}, E={}, k={}, M={}, H={}, shared={:?}, stored {}) -> {}",
        dir.display(),
        layer,
        info.family.model_type(),
        c.n_experts,
        c.top_k,
        c.d_model,
        c.d_hidden,
        c.shared_expert,
        info.dtype.as_deref().unwrap_or("?"),
        out.display()
    );
    Ok(())
}

fn to_hf(dir: &Path, args: &ConvertArgs) -> Result<(), MoeError> {
    let input = args
        .input
        .as_ref()
        .ok_or_else(|| MoeError::config("input", "--to-hf needs --input FILE (a canonical layer file)"))?;
    // The file is checked as every loader checks it (its meta against its tensors' shapes)
    // before anything is written.
    let (tensors, meta) = read_safetensors(input)?;
    layer_file_config(&tensors, meta.as_deref(), input)?;
    let meta = meta
        .map(|m| LayerMeta::parse(&m))
        .transpose()
        .map_err(|e| MoeError::file(input, e.to_string()))?;
    let layer = args
        .layer
        .or(meta.as_ref().and_then(|m| m.hf_layer))
        .ok_or_else(|| MoeError::config("layer", "give --layer: the file's meta has no `hf_layer`"))?;
    let options = hf::ExportOptions {
        overwrite: args.overwrite,
        in_place: args.in_place,
    };
    let out = args.out.as_deref().unwrap_or(dir);
    // The layer's tensors come from --input: an error about them names that file.
    let report = hf::write_layer_with(dir, layer, &tensors, out, &options).map_err(|e| match e {
        MoeError::Input(reason) => MoeError::file(input, reason),
        other => other,
    })?;
    println!(
        "{} -> layer {layer} of {}: {} tensors in {} (rewritten), {} other files copied",
        input.display(),
        out.display(),
        report.tensors,
        report.shards_rewritten.join(", "),
        report.files_copied
    );
    // One line per stored format (a checkpoint has one, but the report allows both).
    for format in ["float8_e4m3fn", "mxfp4"] {
        let weights: Vec<_> = report.requantized.iter().filter(|r| r.format == format).collect();
        if weights.is_empty() {
            continue;
        }
        let blocks: usize = weights.iter().map(|r| r.blocks).sum();
        let rescaled: usize = weights.iter().map(|r| r.rescaled_blocks).sum();
        println!(
            "{} weights written as {format} in the checkpoint's blocks ({rescaled} of {blocks} blocks needed a new scale)",
            weights.len()
        );
    }
    Ok(())
}
