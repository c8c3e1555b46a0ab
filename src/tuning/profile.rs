//! The hardware profile the cost model and the simulator run on (paper §II-C, §III-E).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{MoeError, Result};

/// Speeds of the three streams and how they slow each other down.
///
/// Rates are per rank. A step of `w` units takes `latency + w / (rate · factor)`, where
/// `factor` is the interference factor for the streams running at the time. GEMMs also lose
/// efficiency on few rows: a GEMM over `r` rows runs at `w_comp · r / (r + gemm_half_rows)`,
/// which is what makes very fine partitions slow (the paper's under-utilisation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// What was measured or which preset this is.
    pub name: String,
    /// `W_comp`: GEMM rate at the layer's shapes, FLOP/s.
    pub w_comp: f64,
    /// Rows at which an expert GEMM reaches half of `w_comp`.
    pub gemm_half_rows: f64,
    /// Fixed cost of one compute step (kernel launches, permutes), seconds.
    pub comp_latency: f64,
    /// `W_comm`: all-to-all rate, bytes this rank sends per second.
    pub w_comm: f64,
    /// Fixed cost of one all-to-all, seconds.
    pub comm_latency: f64,
    /// `W_mem`: host↔device copy rate, bytes per second.
    pub w_mem: f64,
    /// Fixed cost of one copy, seconds.
    pub mem_latency: f64,
    /// `σ`: compute speed factor while other streams run (the paper sets 1).
    pub sigma: f64,
    /// `μ_comp`: all-to-all speed factor while compute runs (Table III, none and S4).
    pub mu_comp: f64,
    /// `μ_all`: all-to-all speed factor with compute and copies running (S1–S3).
    pub mu_all: f64,
    /// `η_all`: copy speed factor with compute and all-to-all running (S1–S3).
    pub eta_all: f64,
    /// Where each number comes from.
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
}

/// A `(field, source)` list, for presets.
fn sources(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Profile {
    /// The paper's cluster (§IV-A): DGX A100 nodes, 8× A100 SXM 40 GB each, NVLink3 /
    /// NVSwitch inside a node, 8× HDR InfiniBand 200 Gb/s per node, for `n_gpus` GPUs.
    pub fn a100_cluster(n_gpus: usize) -> Self {
        // NVIDIA A100 datasheet: 156 TFLOP/s TF32 tensor-core peak; torch 1.9 (the paper's)
        // runs fp32 matmuls in TF32 by default. Assumed: large GEMMs reach 70% of peak.
        let w_comp = 0.7 * 156e12;
        let intra = n_gpus <= 8;
        // DGX A100: NVSwitch gives each GPU 300 GB/s per direction (600 GB/s NVLink3 total).
        // Assumed: NCCL all-to-all reaches 60% of it inside a node.
        let nvlink = 0.6 * 300e9;
        // DGX A100: one HDR 200 Gb/s (25 GB/s) ConnectX-6 per GPU. Assumed: 80% efficiency.
        // A fraction (N - 8) / N of each GPU's rows leaves the node through its NIC, so the
        // rate for the whole buffer is the NIC rate divided by that fraction.
        let nic = 0.8 * 25e9;
        let w_comm = if intra {
            nvlink
        } else {
            let leaving = (n_gpus - 8) as f64 / n_gpus as f64;
            nic / leaving
        };
        // Assumed: ~10 µs NCCL launch plus ~2 µs per peer (grouped send/recv).
        let comm_latency = 10e-6 + 2e-6 * n_gpus as f64;
        Self {
            name: format!("a100-cluster-{n_gpus}"),
            w_comp,
            gemm_half_rows: 512.0,
            comp_latency: 20e-6,
            w_comm,
            comm_latency,
            // PCIe Gen4 x16: 32 GB/s per direction; assumed 80% with pinned memory.
            w_mem: 0.8 * 32e9,
            mem_latency: 10e-6,
            sigma: 1.0,
            mu_comp: 0.85,
            mu_all: 0.6,
            eta_all: 0.6,
            sources: sources(&[
                ("w_comp", "A100 datasheet: 156 TFLOP/s TF32; assumed 70% achieved"),
                ("gemm_half_rows", "assumed: cuBLAS reaches half of peak near 512 rows at M=1024-2048"),
                ("comp_latency", "assumed: a few kernel launches per step"),
                (
                    "w_comm",
                    "DGX A100: NVSwitch 300 GB/s per direction per GPU (60% assumed); 1x HDR 200 Gb/s per GPU across nodes (80% assumed)",
                ),
                ("comm_latency", "assumed: 10 us + 2 us per peer"),
                ("w_mem", "PCIe Gen4 x16 32 GB/s per direction; 80% assumed"),
                ("sigma", "paper §II-C: computation barely slowed; set to 1 as the paper does"),
                (
                    "mu_comp, mu_all, eta_all",
                    "assumed from paper Fig. 3's description (comm slowed by compute but > 0.5; copies and comm compete for bandwidth); the grid's values are not in the text",
                ),
            ]),
        }
    }

    /// One DGX/HGX H100 node (8× H100 SXM, NVLink4 / NVSwitch) with `n_gpus <= 8` GPUs.
    pub fn h100_node(n_gpus: usize) -> Self {
        Self {
            name: format!("h100-node-{n_gpus}"),
            // H100 SXM datasheet: 494 TFLOP/s TF32 dense (989 with sparsity); 70% assumed.
            w_comp: 0.7 * 494e12,
            gemm_half_rows: 1024.0,
            comp_latency: 15e-6,
            // NVLink4: 900 GB/s total, 450 GB/s per direction per GPU; 60% assumed.
            w_comm: 0.6 * 450e9,
            comm_latency: 10e-6 + 2e-6 * n_gpus as f64,
            // PCIe Gen5 x16: 64 GB/s per direction; 80% assumed.
            w_mem: 0.8 * 64e9,
            mem_latency: 10e-6,
            sigma: 1.0,
            mu_comp: 0.85,
            mu_all: 0.6,
            eta_all: 0.6,
            sources: sources(&[
                (
                    "w_comp",
                    "H100 SXM datasheet: 494 TFLOP/s TF32 dense; assumed 70% achieved",
                ),
                ("gemm_half_rows", "assumed: twice the A100's, for a faster device"),
                ("w_comm", "NVLink4 450 GB/s per direction per GPU; 60% assumed"),
                ("w_mem", "PCIe Gen5 x16 64 GB/s per direction; 80% assumed"),
                ("mu_comp, mu_all, eta_all", "assumed, as for the A100 preset"),
            ]),
        }
    }

    /// A preset by name: `a100-cluster-N` (or `a100-cluster`, N = 64), `h100-node-N` (or
    /// `h100-node`, N = 8).
    pub fn preset(name: &str) -> Option<Self> {
        let (base, n) = match name.rsplit_once('-') {
            Some((base, n)) if n.chars().all(|c| c.is_ascii_digit()) => (base, n.parse().ok()?),
            _ => (name, 0),
        };
        match base {
            "a100-cluster" => Some(Self::a100_cluster(if n == 0 { 64 } else { n })),
            "h100-node" => Some(Self::h100_node(if n == 0 { 8 } else { n.min(8) })),
            _ => None,
        }
    }

    /// `α`: time of one all-to-all unit (`b·M` elements) over time of one GEMM unit
    /// (`b·H·M` multiply-adds) — Eq. 13's normalisation.
    pub fn alpha(&self, d_hidden: usize, elem_bytes: usize) -> f64 {
        (elem_bytes as f64 / self.w_comm) / (2.0 * d_hidden as f64 / self.w_comp)
    }

    /// `β`: the same for one copy unit (`b·M` elements).
    pub fn beta(&self, d_hidden: usize, elem_bytes: usize) -> f64 {
        (elem_bytes as f64 / self.w_mem) / (2.0 * d_hidden as f64 / self.w_comp)
    }

    /// The eleven numbers of the profile with their names, in a fixed order.
    pub fn numbers(&self) -> [(&'static str, f64); 11] {
        [
            ("w_comp", self.w_comp),
            ("gemm_half_rows", self.gemm_half_rows),
            ("comp_latency", self.comp_latency),
            ("w_comm", self.w_comm),
            ("comm_latency", self.comm_latency),
            ("w_mem", self.w_mem),
            ("mem_latency", self.mem_latency),
            ("sigma", self.sigma),
            ("mu_comp", self.mu_comp),
            ("mu_all", self.mu_all),
            ("eta_all", self.eta_all),
        ]
    }

    /// A profile named `name` from its eleven numbers, in [`numbers`](Self::numbers) order.
    pub fn from_numbers(name: String, sources: BTreeMap<String, String>, values: [f64; 11]) -> Self {
        let [w_comp, gemm_half_rows, comp_latency, w_comm, comm_latency, w_mem, mem_latency, sigma, mu_comp, mu_all, eta_all] =
            values;
        Self {
            name,
            w_comp,
            gemm_half_rows,
            comp_latency,
            w_comm,
            comm_latency,
            w_mem,
            mem_latency,
            sigma,
            mu_comp,
            mu_all,
            eta_all,
            sources,
        }
    }

    /// This profile with its numbers replaced by `values` (in [`numbers`](Self::numbers) order).
    pub fn with_numbers(&self, values: [f64; 11]) -> Self {
        Self::from_numbers(self.name.clone(), self.sources.clone(), values)
    }

    /// Checks every number: rates finite and > 0, latencies and `gemm_half_rows` finite and
    /// >= 0, slowdown factors in (0, 1.5] (a little above 1 is measurement noise).
    pub fn validate(&self) -> Result<()> {
        for (field, v) in self.numbers() {
            let (ok, rule) = match field {
                "w_comp" | "w_comm" | "w_mem" => (v.is_finite() && v > 0.0, "finite and > 0"),
                "sigma" | "mu_comp" | "mu_all" | "eta_all" => (v > 0.0 && v <= 1.5, "in (0, 1.5]"),
                _ => (v.is_finite() && v >= 0.0, "finite and >= 0"),
            };
            if !ok {
                return Err(MoeError::config(
                    "profile",
                    format!("`{field}` is {v}, must be {rule}"),
                ));
            }
        }
        Ok(())
    }

    /// Reads a profile written by [`save`](Self::save) (or `mpipemoe profile --out`).
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::files::read_text(path)?;
        let profile: Self = serde_json::from_str(&text)
            .map_err(|e| MoeError::file(path, format!("bad profile JSON: {e}")))?;
        profile
            .validate()
            .map_err(|e| MoeError::file(path, e.to_string()))?;
        Ok(profile)
    }

    /// Writes the profile as JSON, whole (a temporary file beside `path`, then renamed). An
    /// existing file is replaced only with `overwrite`.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `path` if it exists (without `overwrite`) or cannot be
    /// written.
    pub fn save(&self, path: &Path, overwrite: bool) -> Result<()> {
        let json = serde_json::to_string_pretty(self).expect("profiles serialize");
        crate::files::write_whole(path, json.as_bytes(), overwrite)
    }
}
