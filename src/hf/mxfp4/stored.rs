//! MXFP4 projections in a checkpoint: found by their `_blocks` and `_scales`, checked against
//! the shape `config.json` implies, read for a range of experts, and written back.

use std::collections::HashMap;
use std::sync::Arc;

use safetensors::tensor::TensorInfo;
use safetensors::Dtype;

use super::{dequantize, is_packed_dtype, packed_names, packed_shapes, quantize, BLOCK, BLOCK_BYTES};
use crate::error::{MoeError, Result};
use crate::hf::checkpoint::{check_finite, dtype_name, Checkpoint, ImportOptions, Shard, StoredTensor};
use crate::hf::export::Requantized;
use crate::hf::layout::HfEntry;
use crate::hf::quantization::{refuse_nonfinite, Quantization};

/// Where a projection's MXFP4 bytes live: its blocks and its scales, checked against its
/// shape.
struct PackedTensors {
    blocks: (Arc<Shard>, TensorInfo),
    scales: (Arc<Shard>, TensorInfo),
}

impl Checkpoint {
    /// Refuses a checkpoint whose `quantization_config` says MXFP4 but which stores one of the
    /// projections `names` unquantised: transformers' loader expects `_blocks` and `_scales`
    /// for every expert projection of such a folder and would not load it, and an export
    /// could not say which format the folder is meant to hold. (Refused rather than read as
    /// float: the folder contradicts itself, and only its author knows which half is right.)
    ///
    /// # Errors
    /// [`MoeError::File`] naming the shard, the tensor and `quantization_config`.
    pub(crate) fn refuse_unpacked_experts(&self, names: &[String]) -> Result<()> {
        if self.quant != Some(Quantization::Mxfp4) {
            return Ok(());
        }
        for name in names {
            if let Some(shard) = self.weight_map.get(name) {
                return Err(MoeError::file(
                    self.dir.join(shard),
                    format!(
                        "holds `{name}` unquantised, but config.json's `quantization_config` says \
                         mxfp4, which stores it as `{}` and `{}`: drop the quantization_config \
                         for a float checkpoint, or store the experts in MXFP4",
                        packed_names(name).0,
                        packed_names(name).1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether the checkpoint stores projection `name` in MXFP4: it says `mxfp4`, and holds
    /// `name_blocks` rather than `name`.
    fn stores_mxfp4(&self, name: &str) -> bool {
        self.quant == Some(Quantization::Mxfp4)
            && !self.weight_map.contains_key(name)
            && self.weight_map.contains_key(&packed_names(name).0)
    }

    /// The uint8 dtype and logical `[E, in, out]` shape of projection `name` if the
    /// checkpoint stores it in MXFP4, from its blocks' header; `None` otherwise.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the blocks if they are not 4-D with 16 bytes a block.
    pub(crate) fn mxfp4_header(&self, name: &str) -> Result<Option<(Dtype, Vec<usize>)>> {
        if !self.stores_mxfp4(name) {
            return Ok(None);
        }
        let blocks_name = packed_names(name).0;
        let (shard, info) = self.locate(&blocks_name)?;
        match info.shape[..] {
            [n, out, groups, BLOCK_BYTES] => Ok(Some((info.dtype, vec![n, groups * BLOCK, out]))),
            _ => Err(MoeError::file(
                &shard.path,
                format!(
                    "`{blocks_name}` has shape {:?}: MXFP4 blocks are [experts, out, in / {BLOCK}, {BLOCK_BYTES}]",
                    info.shape
                ),
            )),
        }
    }

    /// The blocks and scales of projection `name` of logical shape `shape`, if the checkpoint
    /// stores it in MXFP4.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the tensor if the input dimension is not a multiple of 32,
    /// the blocks or scales are not uint8 of the shapes `shape` implies, or the scales are
    /// missing.
    fn locate_packed(&self, name: &str, shape: &[usize]) -> Result<Option<PackedTensors>> {
        if !self.stores_mxfp4(name) {
            return Ok(None);
        }
        let (blocks_name, scales_name) = packed_names(name);
        let blocks = self.locate(&blocks_name)?;
        let path = blocks.0.path.clone();
        let (blocks_shape, scales_shape) = packed_shapes(shape).ok_or_else(|| {
            MoeError::file(
                &path,
                format!(
                    "`{name}` of shape {shape:?} is stored in MXFP4 (`{blocks_name}`), which packs the input dimension in blocks of {BLOCK}: a stacked [experts, in, out] projection with `in` a multiple of {BLOCK} expected"
                ),
            )
        })?;
        let scales = self.locate(&scales_name).map_err(|_| {
            MoeError::file(
                &path,
                format!("`{blocks_name}` is MXFP4 blocks, but their scales `{scales_name}` are missing"),
            )
        })?;
        for (tensor, (shard, info), want) in [
            (&blocks_name, &blocks, &blocks_shape),
            (&scales_name, &scales, &scales_shape),
        ] {
            if !is_packed_dtype(info.dtype) || info.shape != *want {
                return Err(MoeError::file(
                    &shard.path,
                    format!(
                        "`{tensor}` is {} {:?}; `{name}` {shape:?} in MXFP4 needs uint8 {want:?}",
                        dtype_name(info.dtype),
                        info.shape
                    ),
                ));
            }
        }
        Ok(Some(PackedTensors { blocks, scales }))
    }

    /// The stacked projection `entry` (its experts `entry.rows`) dequantised from its MXFP4
    /// `_blocks` and `_scales`, or `None` if the checkpoint does not store it in MXFP4. Only
    /// the wanted experts' bytes are read.
    ///
    /// # Errors
    /// As `locate_packed`; [`MoeError::File`] naming the tensor if the experts are not a
    /// range of its first dimension, or (unless `options.allow_nonfinite`) a value is not
    /// finite (exponent 255).
    pub(crate) fn read_mxfp4(
        &self,
        entry: &HfEntry,
        options: &ImportOptions,
    ) -> Result<Option<StoredTensor>> {
        let name = &entry.name;
        let Some(PackedTensors { blocks, scales }) = self.locate_packed(name, &entry.shape)? else {
            return Ok(None);
        };
        let path = &blocks.0.path;
        let (n_all, rows) = (entry.shape[0], &entry.rows);
        if rows.start > rows.end || rows.end > n_all {
            return Err(MoeError::file(
                path,
                format!("tensor `{name}`: entries {rows:?} of its first dimension ({n_all}) were asked for"),
            ));
        }
        // The expert is the outermost dimension of both, so an expert range is one run of
        // bytes; the header's offsets were checked against the shapes checked above.
        fn cut<'a>(bytes: &'a [u8], n_all: usize, rows: &std::ops::Range<usize>) -> &'a [u8] {
            let per_expert = bytes.len() / n_all.max(1);
            &bytes[rows.start * per_expert..rows.end * per_expert]
        }
        let block_bytes = cut(blocks.0.data(&blocks.1), n_all, rows);
        let scale_bytes = cut(scales.0.data(&scales.1), n_all, rows);
        self.count(|s| s.tensor_bytes += (block_bytes.len() + scale_bytes.len()) as u64);
        let values = dequantize(
            block_bytes,
            scale_bytes,
            [rows.len(), entry.shape[1], entry.shape[2]],
        );
        check_finite(name, &values, options, path)?;
        Ok(Some(StoredTensor {
            dtype: Dtype::U8,
            values,
            quantized: true,
        }))
    }

    /// Replaces every projection in `values` that the checkpoint stores in MXFP4 by its
    /// `_blocks` and `_scales` ([`quantize`] against the stored scales; the bytes carried as
    /// f32 integers), so that the checkpoint stays what its `quantization_config` says.
    /// Returns what was quantised.
    ///
    /// # Errors
    /// As `locate_packed`; [`MoeError::File`] naming the projection if a value is not finite
    /// or the layer gives another number of values than its shape.
    pub(crate) fn requantize_mxfp4(
        &self,
        values: &mut HashMap<String, Vec<f32>>,
    ) -> Result<Vec<Requantized>> {
        let mut names: Vec<String> = values.keys().filter(|n| self.stores_mxfp4(n)).cloned().collect();
        names.sort();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let (_, shape) = self.mxfp4_header(&name)?.expect("stored in MXFP4");
            let PackedTensors { blocks, scales } =
                self.locate_packed(&name, &shape)?.expect("stored in MXFP4");
            let w = values.remove(&name).expect("a key of values");
            refuse_nonfinite(&name, &w, &shape, "mxfp4")?;
            let count: usize = shape.iter().product();
            let shape = [shape[0], shape[1], shape[2]];
            let packed = match w.len() == count {
                true => quantize(&w, shape, scales.0.data(&scales.1)).map_err(|at| {
                    format!("`{name}` holds a non-finite value at flat index {at}: MXFP4 cannot store it")
                }),
                false => Err(format!(
                    "`{name}` is {shape:?} ({count} values), the layer gives {}",
                    w.len()
                )),
            }
            .map_err(|reason| MoeError::file(&blocks.0.path, reason))?;
            let (blocks_name, scales_name) = packed_names(&name);
            let bytes = |b: Vec<u8>| b.into_iter().map(f32::from).collect();
            out.push(Requantized {
                tensor: name,
                format: "mxfp4",
                blocks: packed.scales.len(),
                rescaled_blocks: packed.rescaled,
            });
            values.insert(blocks_name, bytes(packed.blocks));
            values.insert(scales_name, bytes(packed.scales));
        }
        Ok(out)
    }
}
