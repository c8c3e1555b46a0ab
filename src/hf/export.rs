//! Writing one MoE layer back into a Hugging Face checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::backend::Backend;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

use super::checkpoint::{narrow, parse, Checkpoint, ImportOptions};
use super::config::HfConfig;
use super::fp8::{is_fp8, quantize, scale_name};
use super::layout::{to_hf, HfEntry};
use super::model::HfCheckpoint;
use super::quantization::{refuse_nonfinite, Quantization};
use crate::error::{MoeError, Result};
use crate::files::{check_apart, file_in, map_regular, same_folder, StagedDir};
use crate::layer::{MoeLayer, MoeLayerConfig, TensorMap};

/// What [`write_layer`] wrote.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExportReport {
    /// The shards that hold the layer's tensors, rewritten.
    pub shards_rewritten: Vec<String>,
    /// Tensors of the layer written back.
    pub tensors: usize,
    /// Other files copied unchanged (0 when writing in place).
    pub files_copied: usize,
    /// The weights the checkpoint stores quantised (FP8 with block scales, or MXFP4 experts),
    /// written back in that form from the layer's values; empty for other checkpoints.
    pub requantized: Vec<Requantized>,
}

/// A quantised weight written back by an export: the layer holds it unquantised, and the
/// checkpoint keeps FP8 or MXFP4, so it is quantised again in the checkpoint's blocks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Requantized {
    /// The weight's name in the checkpoint (for MXFP4, the projection whose `_blocks` and
    /// `_scales` are written).
    pub tensor: String,
    /// The stored form: `"float8_e4m3fn"` or `"mxfp4"`.
    pub format: &'static str,
    /// Its scale blocks.
    pub blocks: usize,
    /// Blocks that got a new scale; the others keep theirs, so an unchanged weight is written
    /// back to the same bytes. FP8: blocks whose values no longer fit the stored scale
    /// (`|w| · (1 / scale) > 464`, beyond what clamping to 448 costs no more than rounding),
    /// rescaled to `amax / 448`. MXFP4: blocks whose values are no longer e2m1 values times
    /// the stored scale, rescaled as transformers' quantiser does (`amax / 6` rounded up to a
    /// power of two).
    pub rescaled_blocks: usize,
}

/// Options of an export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportOptions {
    /// Replace an existing, non-empty output folder that is not the source checkpoint. The
    /// folder is replaced as a whole: files in it that the new checkpoint does not have (an
    /// old `model.safetensors` beside new shards, say) are gone afterwards, so transformers
    /// never loads a stale file. Off by default: such a folder is an error and is left alone.
    /// It never allows the source checkpoint itself, a folder that contains it or a folder
    /// inside it: that takes [`in_place`](Self::in_place) or is refused.
    pub overwrite: bool,
    /// Write over the source checkpoint itself (`out_dir` is `checkpoint`): an in-place
    /// update, asked for by name. The new folder is still built beside the old one and takes
    /// its place only when complete, so a failure leaves the checkpoint as it was; unchanged
    /// files are hard links, not copies, where the file system allows. Off by default: an
    /// `out_dir` that is the source is an error, so that a mistyped `--out` never replaces
    /// the checkpoint a run read.
    pub in_place: bool,
}

/// Writes MoE layer `layer` back into the checkpoint in `checkpoint`, from its canonical
/// tensors (all experts), as a complete checkpoint in `out_dir`: every tensor of the layer
/// under its Hugging Face name, in the dtype and shard it is stored in there; every other
/// tensor, the index, `config.json` and the other files unchanged. So a fine-tuned layer
/// loads in transformers again, and a layer imported and exported without training gives the
/// original bytes back.
///
/// All or nothing: the new checkpoint is built in a folder beside `out_dir` and put in its
/// place only when complete; a failure leaves `out_dir` as it was. `out_dir` is `checkpoint`
/// itself only with [`ExportOptions::in_place`] (see [`write_layer_with`]); a folder that
/// contains the checkpoint or lies inside it is always refused. An existing non-empty
/// `out_dir` is an error (see [`ExportOptions::overwrite`] to replace it).
///
/// # Errors
/// [`MoeError::Input`] naming the canonical tensor that is missing or mis-shaped;
/// [`MoeError::File`] naming the file and tensor where the checkpoint disagrees with its
/// `config.json` or cannot be read or written, or naming `out_dir` if it holds other files.
pub fn write_layer(
    checkpoint: impl AsRef<Path>,
    layer: usize,
    tensors: &TensorMap,
    out_dir: impl AsRef<Path>,
) -> Result<ExportReport> {
    write_layer_with(checkpoint, layer, tensors, out_dir, &ExportOptions::default())
}

/// [`write_layer`] with options.
///
/// # Errors
/// As [`write_layer`].
pub fn write_layer_with(
    checkpoint: impl AsRef<Path>,
    layer: usize,
    tensors: &TensorMap,
    out_dir: impl AsRef<Path>,
    options: &ExportOptions,
) -> Result<ExportReport> {
    write_layers_with(checkpoint, &[(layer, tensors)], out_dir, options)
}

/// [`write_layer`] for many MoE layers at once, `(layer index, canonical tensors)`: each
/// shard that holds any of them is read and rewritten once, and the other files copied once,
/// where writing the layers one by one would rewrite a shared shard once per layer.
///
/// # Errors
/// As [`write_layer`]; [`MoeError::Config`] if a layer index is given twice.
pub fn write_layers_with(
    checkpoint: impl AsRef<Path>,
    layers: &[(usize, &TensorMap)],
    out_dir: impl AsRef<Path>,
    options: &ExportOptions,
) -> Result<ExportReport> {
    write_model_with(checkpoint, layers, HashMap::new(), out_dir, options)
}

/// [`write_layers_with`] for a whole model: the MoE layers from their canonical tensors, and
/// `others` — any other tensor of the checkpoint (attention, norms, embeddings, dense MLPs)
/// under its Hugging Face name, as f32 values in its stored layout — each written in the dtype
/// (and, for FP8 block-scaled weights, the blocks) it is stored in. What a fine-tuned whole
/// model is saved with.
///
/// # Errors
/// As [`write_layer`]; [`MoeError::File`] naming the index if a tensor of `others` is not in
/// the checkpoint, or the shard if its value count differs from the stored shape's.
pub fn write_model_with(
    checkpoint: impl AsRef<Path>,
    layers: &[(usize, &TensorMap)],
    others: HashMap<String, Vec<f32>>,
    out_dir: impl AsRef<Path>,
    options: &ExportOptions,
) -> Result<ExportReport> {
    let (dir, out_dir) = (checkpoint.as_ref(), out_dir.as_ref());
    let source = HfCheckpoint::open(dir)?;
    let (hf, ckpt) = (&source.config, &source.ckpt);
    let mut values = others;
    for (i, &(layer, tensors)) in layers.iter().enumerate() {
        if layers[..i].iter().any(|&(seen, _)| seen == layer) {
            return Err(MoeError::config(
                "layers",
                format!("layer {layer} is given twice"),
            ));
        }
        let config = hf.layer_config(layer)?;
        values.extend(to_hf(&config, &hf.names(layer), tensors)?);
    }
    let mut requantized = requantize_fp8(ckpt, &mut values)?;
    requantized.extend(ckpt.requantize_mxfp4(&mut values)?);
    // A diverged training run or a NaN learning rate leaves NaN weights: written, they would
    // load into transformers without a word and give NaN logits. The quantised weights were
    // refused above (naming their format); every other tensor is refused here by name,
    // before anything is written, whatever float dtype it is stored in.
    let mut names: Vec<&String> = values.keys().collect();
    names.sort();
    for name in names {
        if let Some(at) = values[name].iter().position(|v| !v.is_finite()) {
            return Err(MoeError::Input(format!(
                "tensor `{name}` holds {} at [{at}]: refusing to write a checkpoint that would \
                 load as NaN; nothing was written",
                values[name][at]
            )));
        }
    }
    let mut by_shard: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in values.keys() {
        by_shard
            .entry(ckpt.shard_of(name)?.to_string())
            .or_default()
            .push(name.clone());
    }
    check_out_dir(dir, out_dir, options)?;
    let in_place = options.in_place && same_folder(dir, out_dir);
    if let Some(parent) = out_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| MoeError::file(parent, format!("cannot create: {e}")))?;
    }
    let staged = StagedDir::new(out_dir)?;
    let files_copied = copy_other_files(dir, out_dir, staged.path(), &by_shard, in_place)?;
    let count = values.len();
    for (shard, names) in &by_shard {
        let shard_values: HashMap<String, Vec<f32>> = names
            .iter()
            .map(|n| (n.clone(), values.remove(n).expect("grouped from these values")))
            .collect();
        let source = file_in(dir, shard, &dir.join("model.safetensors.index.json"))?;
        rewrite_shard(&source, &staged.path().join(shard), &shard_values)?;
    }
    // The source's shard maps go before the new folder takes the old one's place (in place,
    // the old shards are replaced; some systems refuse to replace a mapped file).
    drop(source);
    staged.commit()?;
    Ok(ExportReport {
        shards_rewritten: by_shard.into_keys().collect(),
        tensors: count,
        files_copied,
        requantized,
    })
}

/// Turns the values of every weight the checkpoint stores as float8_e4m3fn into FP8 values
/// and block scales (`fp8::quantize`), and adds the scales to `values`, so that the
/// checkpoint stays what its `quantization_config` says. Returns what was re-quantised.
fn requantize_fp8(ckpt: &Checkpoint, values: &mut HashMap<String, Vec<f32>>) -> Result<Vec<Requantized>> {
    let names: Vec<String> = values.keys().cloned().collect();
    let mut fp8: Vec<(String, Vec<usize>)> = ckpt
        .header_shapes(&names)?
        .into_iter()
        .filter(|(_, (dtype, _))| is_fp8(*dtype))
        .map(|(name, (_, shape))| (name, shape))
        .collect();
    fp8.sort();
    let mut out = Vec::with_capacity(fp8.len());
    for (name, shape) in fp8 {
        let shard = ckpt.dir.join(ckpt.shard_of(&name)?);
        let (blocks, [rows, cols]) = match (ckpt.quant.and_then(Quantization::fp8), shape.as_slice()) {
            (Some(blocks), &[rows, cols]) => (blocks, [rows, cols]),
            _ => {
                return Err(MoeError::file(
                    shard,
                    format!("tensor `{name}` is float8_e4m3fn of shape {shape:?}, but config.json gives no block size for it (`quantization_config.weight_block_size`) or it is not a matrix"),
                ))
            }
        };
        let scale = scale_name(&name);
        let grid = blocks.grid(&shape).expect("a matrix has a grid");
        let entry = HfEntry::whole(scale.clone(), grid.to_vec());
        refuse_nonfinite(&name, &values[&name], &shape, "float8_e4m3fn")?;
        let stored = ckpt.read(std::slice::from_ref(&entry), &ImportOptions::default())?;
        let (q, scales, rescaled_blocks) =
            quantize(&values[&name], [rows, cols], &stored[&scale].values, blocks);
        values.insert(name.clone(), q);
        values.insert(scale.clone(), scales);
        out.push(Requantized {
            tensor: name,
            format: "float8_e4m3fn",
            blocks: grid[0] * grid[1],
            rescaled_blocks,
        });
    }
    Ok(out)
}

/// Copies (in place: hard-links) every file of `dir` except the shards in `rewritten` into
/// the staging folder `staged` of `out_dir`. Returns how many were copied.
fn copy_other_files(
    dir: &Path,
    out_dir: &Path,
    staged: &Path,
    rewritten: &BTreeMap<String, Vec<String>>,
    in_place: bool,
) -> Result<usize> {
    let mut files_copied = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| MoeError::file(dir, format!("cannot list: {e}")))? {
        let path = entry.map_err(|e| MoeError::file(dir, e.to_string()))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !path.is_file() || rewritten.contains_key(&name) {
            continue;
        }
        let target = staged.join(&name);
        // In place, the old folder goes away once the new one is in: a hard link keeps the
        // unchanged multi-gigabyte shards without copying them.
        let linked = in_place && std::fs::hard_link(&path, &target).is_ok();
        if !linked {
            std::fs::copy(&path, &target)
                .map_err(|e| MoeError::file(out_dir.join(&name), format!("cannot copy: {e}")))?;
            files_copied += 1;
        }
    }
    Ok(files_copied)
}

/// Whether the writers would accept `out_dir` for a checkpoint read from `checkpoint`: a new
/// or empty folder apart from the checkpoint, any folder apart from it with
/// `options.overwrite`, or the checkpoint itself with `options.in_place`. Never a folder that
/// contains the checkpoint or lies inside it ([`check_apart`]). Long work that ends in a write
/// (fine-tuning) calls it first, so a refused folder costs nothing.
///
/// # Errors
/// [`MoeError::File`] naming `out_dir` if it is the checkpoint without `in_place`, contains it
/// or lies in it, holds files and may not be replaced, or cannot be read.
pub fn check_out_dir(checkpoint: &Path, out_dir: &Path, options: &ExportOptions) -> Result<()> {
    if same_folder(checkpoint, out_dir) {
        if options.in_place {
            return Ok(());
        }
        return Err(MoeError::file(
            out_dir,
            "is the source checkpoint itself: writing there would replace the checkpoint that was read; give another folder, or ask for an in-place update (--in-place)",
        ));
    }
    check_apart(checkpoint, out_dir, "the output")?;
    if !options.overwrite && holds_files(out_dir)? {
        return Err(MoeError::file(
            out_dir,
            "is not empty; refusing to mix checkpoints (give an empty or new folder, or --overwrite to replace it as a whole)",
        ));
    }
    Ok(())
}

fn holds_files(dir: &Path) -> Result<bool> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(MoeError::file(dir, format!("cannot list: {e}"))),
    }
}

/// Writes `source` to `target` with the tensors in `replace` (f32 values) narrowed to their
/// stored dtypes; every other tensor and the header's metadata are kept as they are.
fn rewrite_shard(source: &Path, target: &Path, replace: &HashMap<String, Vec<f32>>) -> Result<()> {
    let bytes = {
        let map = map_regular(source)?;
        let st: SafeTensors<'_> = parse(&map, source)?;
        let (_, header) = SafeTensors::read_metadata(&map)
            .map_err(|e| MoeError::file(source, format!("bad safetensors header: {e:?}")))?;
        let metadata = header.metadata().clone();
        let mut owned: HashMap<String, Vec<u8>> = HashMap::new();
        for (name, values) in replace {
            let view = st
                .tensor(name)
                .map_err(|_| MoeError::file(source, format!("missing tensor `{name}`")))?;
            let count: usize = view.shape().iter().product();
            if count != values.len() {
                return Err(MoeError::file(
                    source,
                    format!(
                        "tensor `{name}` has shape {:?} ({count} values), the layer gives {}",
                        view.shape(),
                        values.len()
                    ),
                ));
            }
            let data = narrow(values, view.dtype())
                .map_err(|reason| MoeError::file(source, format!("tensor `{name}`: {reason}")))?;
            owned.insert(name.clone(), data);
        }
        let views = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let data = owned.get(&name).map_or(view.data(), Vec::as_slice);
                let view = TensorView::new(view.dtype(), view.shape().to_vec(), data)
                    .map_err(|e| MoeError::file(source, format!("tensor `{name}`: {e:?}")))?;
                Ok((name, view))
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize(views, metadata)
            .map_err(|e| MoeError::file(target, format!("cannot encode: {e:?}")))?
    };
    // The target is inside the staging folder, so a half-written shard is never seen.
    std::fs::write(target, bytes).map_err(|e| MoeError::file(target, format!("cannot write: {e}")))
}

impl<B: Backend> MoeLayer<B> {
    /// Writes this layer back into MoE layer `layer` of the Hugging Face checkpoint in
    /// `checkpoint`, as a complete checkpoint in `out_dir` ([`write_layer`]). A collective
    /// with expert parallelism: every rank calls it; the experts are gathered and rank 0
    /// writes.
    ///
    /// # Errors
    /// [`MoeError::Config`] if the layer's shape differs from that checkpoint layer's; the
    /// errors of [`write_layer`].
    pub fn save_hf(
        &self,
        checkpoint: impl AsRef<Path>,
        layer: usize,
        out_dir: impl AsRef<Path>,
    ) -> Result<()> {
        Self::save_hf_layers(&[(layer, self)], checkpoint, out_dir)
    }

    /// Writes many layers, `(layer index, layer)`, back into the Hugging Face checkpoint in
    /// `checkpoint` as one complete checkpoint in `out_dir`, each shard rewritten once
    /// ([`write_layers_with`]): what saves a model loaded with
    /// [`from_hf_layers`](Self::from_hf_layers). A collective with expert parallelism: every
    /// rank calls it with its own layers in the same order; the experts are gathered and rank
    /// 0 writes.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming the layer whose shape differs from that checkpoint layer's,
    /// or a layer index given twice; the errors of [`write_layer`].
    pub fn save_hf_layers(
        layers: &[(usize, &Self)],
        checkpoint: impl AsRef<Path>,
        out_dir: impl AsRef<Path>,
    ) -> Result<()> {
        let checkpoint = checkpoint.as_ref();
        let hf = HfConfig::read(checkpoint)?;
        for &(layer, this) in layers {
            check_same_shape(this.config(), &hf.layer_config(layer)?, layer, checkpoint)?;
        }
        // Every rank takes part in every gather, in the same order; rank 0 gets them all.
        let mut gathered = Vec::with_capacity(layers.len());
        for &(layer, this) in layers {
            if let Some(tensors) = this.gather_tensor_map()? {
                gathered.push((layer, tensors));
            }
        }
        if gathered.len() == layers.len() && !layers.is_empty() {
            let refs: Vec<(usize, &TensorMap)> = gathered.iter().map(|(l, t)| (*l, t)).collect();
            write_layers_with(checkpoint, &refs, out_dir, &ExportOptions::default())?;
        }
        Ok(())
    }
}

/// Refuses to write a layer `a` into checkpoint layer `layer` whose config `b` has another
/// shape.
fn check_same_shape(a: &MoeLayerConfig, b: &MoeLayerConfig, layer: usize, checkpoint: &Path) -> Result<()> {
    let shape = |c: &MoeLayerConfig| {
        (
            c.d_model,
            c.d_hidden,
            c.n_experts,
            c.activation,
            c.bias,
            c.score_bias,
            c.shared_expert,
            c.shared_expert_gate,
        )
    };
    if shape(a) == shape(b) {
        return Ok(());
    }
    Err(MoeError::config(
        "save_hf",
        format!(
            "the layer (M={}, H={}, E={}, shared={:?}) does not have the shape of layer {layer} of {} (M={}, H={}, E={}, shared={:?})",
            a.d_model,
            a.d_hidden,
            a.n_experts,
            a.shared_expert,
            checkpoint.display(),
            b.d_model,
            b.d_hidden,
            b.n_experts,
            b.shared_expert
        ),
    ))
}
