//! The element-wise kernels of the CUDA expert path (`kernels.cu`): compiled once per process by
//! NVRTC, launched on a lane's stream with their block tables passed by value.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use mpipemoe::{Activation, MoeError, Result};

/// The kernels' source.
const SOURCE: &str = include_str!("kernels.cu");

/// Blocks one launch covers (`MAX_JOBS` in the source); more are launched in chunks.
pub(crate) const MAX_JOBS: usize = 64;

/// Pointers one table fill covers (`MAX_PTRS` in the source).
pub(crate) const MAX_PTRS: usize = 384;

/// One expert block of a launch: its base pointers (0 where unused) and rows. `Job` in the
/// source, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Job {
    pub(crate) p: [u64; 4],
    pub(crate) bias: u64,
    pub(crate) rows: u32,
    pad: u32,
}

impl Job {
    pub(crate) fn new(p: [u64; 4], bias: u64, rows: usize) -> Self {
        Self {
            p,
            bias,
            rows: rows as u32,
            pad: 0,
        }
    }
}

/// `Jobs` in the source: passed by value (3 KiB, under CUDA's 4 KiB of kernel parameters).
#[repr(C)]
#[derive(Clone, Copy)]
struct Jobs {
    n: u32,
    pad: u32,
    job: [Job; MAX_JOBS],
}

/// `Ptrs` in the source.
#[repr(C)]
#[derive(Clone, Copy)]
struct Ptrs {
    n: u32,
    pad: u32,
    ptr: [u64; MAX_PTRS],
}

// SAFETY: plain `#[repr(C)]` data of integers, laid out as the source's structs (u32, u32, then
// 8-byte fields), passed by value.
unsafe impl DeviceRepr for Jobs {}
// SAFETY: as above.
unsafe impl DeviceRepr for Ptrs {}

/// The activation's kind and parameters as the kernels read them.
fn kind(act: Activation) -> (i32, f32, f32) {
    match act {
        Activation::Gelu => (0, 0.0, 0.0),
        Activation::Relu => (1, 0.0, 0.0),
        Activation::SwiGlu => (2, 0.0, 0.0),
        Activation::ClampedSwiGlu { alpha, limit } => (3, alpha, limit),
    }
}

/// The loaded kernels of one CUDA context.
#[derive(Debug)]
pub(crate) struct Kernels {
    act_forward: CudaFunction,
    act_backward: CudaFunction,
    add_bias: CudaFunction,
    fill_ptrs: CudaFunction,
    wait_flag: CudaFunction,
    set_flag: CudaFunction,
    to_bf16: CudaFunction,
}

fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Backend(format!("CUDA expert kernels: {what}: {e:?}"))
}

/// The PTX, compiled once per process (NVRTC takes a fraction of a second; every context loads
/// the same text).
fn ptx() -> Result<cudarc::nvrtc::Ptx> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let text = PTX.get_or_init(|| {
        let options = CompileOptions {
            name: Some("mpipemoe_experts.cu".into()),
            ..Default::default()
        };
        compile_ptx_with_opts(SOURCE, options)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    match text {
        Ok(src) => Ok(cudarc::nvrtc::Ptx::from_src(src.clone())),
        Err(e) => Err(err("NVRTC", e)),
    }
}

/// One block of one thread.
fn single() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of every launch.
const THREADS: u32 = 256;

/// The grid of an element-wise launch over `jobs` blocks of at most `largest` elements: enough
/// blocks in x to cover the largest block (capped; the kernels loop), one row of blocks per job.
fn grid(largest: usize, jobs: usize) -> LaunchConfig {
    let x = largest.div_ceil(THREADS as usize).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (x, jobs as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Kernels {
    /// The kernels loaded into `context`.
    pub(crate) fn load(context: &Arc<CudaContext>) -> Result<Self> {
        let module = context.load_module(ptx()?).map_err(|e| err("module", e))?;
        let f = |name: &str| module.load_function(name).map_err(|e| err(name, e));
        Ok(Self {
            act_forward: f("act_forward")?,
            act_backward: f("act_backward")?,
            add_bias: f("add_bias")?,
            fill_ptrs: f("fill_ptrs")?,
            wait_flag: f("wait_flag")?,
            set_flag: f("set_flag")?,
            to_bf16: f("to_bf16")?,
        })
    }

    /// The tables of `jobs` in chunks of [`MAX_JOBS`], each with its largest block's element
    /// count (`elements` per row).
    fn tables(jobs: &[Job], elements: usize) -> Vec<(Jobs, LaunchConfig)> {
        jobs.chunks(MAX_JOBS)
            .filter_map(|chunk| {
                let mut table = Jobs {
                    n: chunk.len() as u32,
                    pad: 0,
                    job: [Job::default(); MAX_JOBS],
                };
                table.job[..chunk.len()].copy_from_slice(chunk);
                let largest = chunk
                    .iter()
                    .map(|j| j.rows as usize * elements)
                    .max()
                    .unwrap_or(0);
                (largest > 0).then(|| (table, grid(largest, chunk.len())))
            })
            .collect()
    }

    /// The activation kernel `func` (forward or backward) over `jobs`, its outputs in bf16
    /// where `half`.
    fn activation(
        &self,
        stream: &CudaStream,
        func: &CudaFunction,
        act: Activation,
        d_hidden: usize,
        half: bool,
        jobs: &[Job],
    ) -> Result<()> {
        let (kind, alpha, limit) = kind(act);
        let d_hidden = d_hidden as u32;
        let half = i32::from(half);
        for (table, config) in Self::tables(jobs, d_hidden as usize) {
            let mut launch = stream.launch_builder(func);
            launch
                .arg(&kind)
                .arg(&alpha)
                .arg(&limit)
                .arg(&d_hidden)
                .arg(&half)
                .arg(&table);
            // SAFETY: every job's pointers cover `rows` rows of their widths (the caller
            // builds them from the partition's layout and the tensors' resources), and the
            // kernel bounds every access by `rows` and the widths.
            unsafe { launch.launch(config) }.map_err(|e| err("launch", e))?;
        }
        Ok(())
    }

    /// Per job: `z += bias` (where set) and `a = act(z)` (where `p[1]` is set; bf16 where
    /// `half`).
    pub(crate) fn act_forward(
        &self,
        stream: &CudaStream,
        act: Activation,
        d_hidden: usize,
        half: bool,
        jobs: &[Job],
    ) -> Result<()> {
        self.activation(stream, &self.act_forward, act, d_hidden, half, jobs)
    }

    /// Per job: `a = act(z)` and `grad_z = act'(z) · grad_a` (`p = [z, grad_a, a, grad_z]`; the
    /// two outputs bf16 where `half`).
    pub(crate) fn act_backward(
        &self,
        stream: &CudaStream,
        act: Activation,
        d_hidden: usize,
        half: bool,
        jobs: &[Job],
    ) -> Result<()> {
        self.activation(stream, &self.act_backward, act, d_hidden, half, jobs)
    }

    /// `dst = bf16(src)` for each `(src, dst, floats)` span.
    pub(crate) fn to_bf16(&self, stream: &CudaStream, spans: &[(u64, u64, usize)]) -> Result<()> {
        for &(src, dst, n) in spans {
            if n == 0 {
                continue;
            }
            let count = n as u64;
            let mut launch = stream.launch_builder(&self.to_bf16);
            launch.arg(&src).arg(&dst).arg(&count);
            // SAFETY: `src` holds `n` floats and `dst` room for `n` bf16 values (the caller
            // sizes the scratch); the kernel bounds its loop by `n`.
            unsafe { launch.launch(grid(n, 1)) }.map_err(|e| err("launch", e))?;
        }
        Ok(())
    }

    /// Per job: every row of `p[0]` (`width` wide) plus the job's bias row.
    pub(crate) fn add_bias(&self, stream: &CudaStream, width: usize, jobs: &[Job]) -> Result<()> {
        let width = width as u32;
        for (table, config) in Self::tables(jobs, width as usize) {
            let mut launch = stream.launch_builder(&self.add_bias);
            launch.arg(&width).arg(&table);
            // SAFETY: as in `activation`; the bias row holds `width` values.
            unsafe { launch.launch(config) }.map_err(|e| err("launch", e))?;
        }
        Ok(())
    }

    /// One thread on `stream` that waits until the word at `flag` is `seq` (at most `bound`
    /// turns, then it stores `seq` at `gave_up` and ends).
    pub(crate) fn wait_flag(
        &self,
        stream: &CudaStream,
        flag: u64,
        seq: u32,
        bound: u32,
        gave_up: u64,
    ) -> Result<()> {
        let mut launch = stream.launch_builder(&self.wait_flag);
        launch.arg(&flag).arg(&seq).arg(&bound).arg(&gave_up);
        // SAFETY: `flag` and `gave_up` are words of a live device buffer (the lane's flags), and
        // the kernel ends after at most `bound` turns.
        unsafe { launch.launch(single()) }.map_err(|e| err("launch", e))?;
        Ok(())
    }

    /// One thread on `stream` that stores `seq` at `flag` after the stream's earlier work.
    pub(crate) fn set_flag(&self, stream: &CudaStream, flag: u64, seq: u32) -> Result<()> {
        let mut launch = stream.launch_builder(&self.set_flag);
        launch.arg(&flag).arg(&seq);
        // SAFETY: `flag` is a word of a live device buffer (the lane's flags).
        unsafe { launch.launch(single()) }.map_err(|e| err("launch", e))?;
        Ok(())
    }

    /// Writes `ptrs` to the device array at `dst`, in chunks of [`MAX_PTRS`].
    pub(crate) fn fill_ptrs(&self, stream: &CudaStream, ptrs: &[u64], dst: u64) -> Result<()> {
        for (i, chunk) in ptrs.chunks(MAX_PTRS).enumerate() {
            let mut table = Ptrs {
                n: chunk.len() as u32,
                pad: 0,
                ptr: [0; MAX_PTRS],
            };
            table.ptr[..chunk.len()].copy_from_slice(chunk);
            let at = dst + (i * MAX_PTRS * 8) as u64;
            let mut launch = stream.launch_builder(&self.fill_ptrs);
            launch.arg(&table).arg(&at);
            let config = LaunchConfig {
                grid_dim: ((chunk.len() as u32).div_ceil(THREADS), 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `dst` holds at least `ptrs.len()` pointers (the lane sizes it), and the
            // kernel writes only the first `n` of this chunk.
            unsafe { launch.launch(config) }.map_err(|e| err("launch", e))?;
        }
        Ok(())
    }
}
