//! Measuring a [`Profile`] on the backend in use (`mpipemoe profile`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData};

use super::Profile;
use crate::comm::LocalGroup;
use crate::error::{MoeError, Result};
use crate::memory::{HostStore, MemoryMeter};

/// What to measure with.
#[derive(Debug, Clone)]
pub struct ProfileOptions {
    /// Token width of the GEMMs (the layer's `d_model`).
    pub d_model: usize,
    /// Hidden width of the GEMMs (the layer's `d_hidden`).
    pub d_hidden: usize,
    /// Rows of the large GEMM (a partition's rows).
    pub rows: usize,
    /// Rows of the small GEMM, for the efficiency at few rows.
    pub small_rows: usize,
    /// Ranks of the in-process group the all-to-all is measured on.
    pub comm_ranks: usize,
    /// Bytes each rank sends per all-to-all.
    pub comm_bytes: usize,
    /// Bytes per host copy.
    pub copy_bytes: usize,
    /// Timed repeats per measurement (the median is kept).
    pub repeats: usize,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            d_model: 768,
            d_hidden: 3072,
            rows: 1024,
            small_rows: 64,
            comm_ranks: 2,
            comm_bytes: 16 << 20,
            copy_bytes: 64 << 20,
            repeats: 5,
        }
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Median time of `op` over `repeats` runs after one warm-up.
fn time_op(repeats: usize, op: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
    op()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        op()?;
        times.push(start.elapsed());
    }
    Ok(median(times))
}

/// Median time of `op` while each of `loads` runs in a loop on its own thread.
fn time_with_load(
    repeats: usize,
    op: &mut (dyn FnMut() -> Result<()> + Send),
    loads: &[&(dyn Fn() -> Result<()> + Sync)],
) -> Result<Duration> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let handles: Vec<_> = loads
            .iter()
            .map(|load| {
                let stop = &stop;
                scope.spawn(move || -> Result<()> {
                    while !stop.load(Ordering::Relaxed) {
                        load()?;
                    }
                    Ok(())
                })
            })
            .collect();
        // Let the loads get going before timing.
        std::thread::sleep(Duration::from_millis(20));
        let result = time_op(repeats, op);
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.join().map_err(|p| MoeError::from_panic(p, 0))??;
        }
        result
    })
}

/// Measures the profile on backend `B`: the GEMM rate at the layer's shapes (and at few rows,
/// for `gemm_half_rows`), the all-to-all rate and latency over an in-process group of
/// `comm_ranks` ranks, the host-store copy rate, and the slowdown of each stream while the
/// others run. `step` is told what is being measured (for a progress bar).
pub fn measure_profile<B: Backend>(
    device: &B::Device,
    options: &ProfileOptions,
    step: &mut dyn FnMut(&str),
) -> Result<Profile> {
    let probes = Probes::<B>::new(device, options);
    let [w_comp, gemm_half_rows, comp_latency, t_big] = probes.measure_compute(device, step)?;
    let [w_comm, comm_latency, t_comm] = probes.measure_comm(step)?;
    let [w_mem, mem_latency, t_copy] = probes.measure_copy(step)?;
    let [sigma, mu_comp, mu_all, eta_all] = probes.measure_interference(t_big, t_comm, t_copy, step)?;
    let o = options;
    let (m, h, ranks) = (o.d_model, o.d_hidden, probes.ranks);
    let mut sources = BTreeMap::new();
    let how = format!(
        "measured by `mpipemoe profile` on backend {} (GEMM [{}x{}]x[{m}x{h}] and [{}x{m}]x[{m}x{h}]; \
         all-to-all of {} bytes/rank over {ranks} in-process ranks; host-store copies of {} bytes; medians of {})",
        B::name(device),
        o.rows,
        m,
        o.small_rows,
        o.comm_bytes,
        o.copy_bytes,
        o.repeats
    );
    sources.insert("all".to_string(), how);
    let profile = Profile::from_numbers(
        format!("measured-{}", B::name(device)),
        sources,
        [
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
        ],
    );
    profile.validate()?;
    Ok(profile)
}

/// The three kinds of work a profile times, each on its own or as the load beside another.
struct Probes<'a, B: Backend> {
    o: &'a ProfileOptions,
    weight: Tensor<B, 2>,
    big: Tensor<B, 2>,
    small: Tensor<B, 2>,
    /// Ranks of the in-process group, at least 2.
    ranks: usize,
    store: HostStore,
    block: TensorData,
}

impl<'a, B: Backend> Probes<'a, B> {
    fn new(device: &B::Device, o: &'a ProfileOptions) -> Self {
        let (m, h) = (o.d_model, o.d_hidden);
        Self {
            o,
            weight: Tensor::random([m, h], Distribution::Default, device),
            big: Tensor::random([o.rows, m], Distribution::Default, device),
            small: Tensor::random([o.small_rows, m], Distribution::Default, device),
            ranks: o.comm_ranks.max(2),
            store: HostStore::new(MemoryMeter::new()),
            block: TensorData::new(vec![0u8; o.copy_bytes], [o.copy_bytes]),
        }
    }

    fn gemm(&self, x: &Tensor<B, 2>) -> Result<()> {
        let y = x.clone().matmul(self.weight.clone());
        // Reading one value forces the work on asynchronous backends.
        let _ = y.slice([0..1, 0..1]).into_data();
        Ok(())
    }

    fn per_peer(&self) -> usize {
        self.o.comm_bytes / self.ranks
    }

    fn all_to_all(&self, bytes_per_peer: usize) -> Result<()> {
        let ranks = self.ranks;
        LocalGroup::run(ranks, |ctx| {
            let send = vec![ctx.rank as u8; bytes_per_peer * ranks];
            ctx.comm
                .all_to_all_v(&send, 1, &vec![bytes_per_peer; ranks])
                .map(|_| ())
        })
        .map(|_| ())
    }

    fn copy(&self) -> Result<()> {
        let handle = self.store.offload(self.block.clone())?;
        handle
            .take()
            .map(|_| ())
            .ok_or_else(|| MoeError::Memory("host block vanished".into()))
    }

    /// `[w_comp, gemm_half_rows, comp_latency, t_big]`: the GEMM rate, the rows at which a
    /// GEMM runs at half of it, the latency of a tiny op, and the large GEMM's time.
    fn measure_compute(&self, device: &B::Device, step: &mut dyn FnMut(&str)) -> Result<[f64; 4]> {
        let o = self.o;
        let (m, h) = (o.d_model, o.d_hidden);
        step("GEMM rate");
        let t_big = time_op(o.repeats, &mut || self.gemm(&self.big))?.as_secs_f64();
        let w_comp = 2.0 * (o.rows * m * h) as f64 / t_big;
        step("GEMM efficiency at few rows");
        let t_small = time_op(o.repeats, &mut || self.gemm(&self.small))?.as_secs_f64();
        let efficiency = ((2.0 * (o.small_rows * m * h) as f64 / t_small) / w_comp).clamp(1e-3, 1.0);
        let gemm_half_rows = o.small_rows as f64 * (1.0 - efficiency) / efficiency;
        step("compute latency");
        let tiny = Tensor::<B, 2>::ones([1, 8], device);
        let comp_latency = time_op(o.repeats * 4, &mut || {
            let _ = (tiny.clone() + 1.0).into_data();
            Ok(())
        })?
        .as_secs_f64();
        Ok([w_comp, gemm_half_rows, comp_latency, t_big])
    }

    /// `[w_comm, comm_latency, t_comm]`: the all-to-all's rate past its latency, the latency
    /// (an empty all-to-all), and the full one's time.
    fn measure_comm(&self, step: &mut dyn FnMut(&str)) -> Result<[f64; 3]> {
        let repeats = self.o.repeats;
        step("all-to-all latency");
        let comm_latency = time_op(repeats, &mut || self.all_to_all(0))?.as_secs_f64();
        step("all-to-all rate");
        let t_comm = time_op(repeats, &mut || self.all_to_all(self.per_peer()))?.as_secs_f64();
        let w_comm = (self.per_peer() * self.ranks) as f64 / (t_comm - comm_latency).max(1e-9);
        Ok([w_comm, comm_latency, t_comm])
    }

    /// `[w_mem, mem_latency, t_copy]`: the host-store copy rate, the latency of a tiny
    /// offload, and one block's offload + prefetch time.
    fn measure_copy(&self, step: &mut dyn FnMut(&str)) -> Result<[f64; 3]> {
        let o = self.o;
        let tiny_block = TensorData::new(vec![0u8; 8], [8]);
        step("copy latency");
        let mem_latency = time_op(o.repeats, &mut || {
            self.store.offload(tiny_block.clone())?.take();
            Ok(())
        })?
        .as_secs_f64();
        step("copy rate");
        // One offload and one prefetch move the block twice.
        let t_copy = time_op(o.repeats, &mut || self.copy())?.as_secs_f64();
        let w_mem = 2.0 * o.copy_bytes as f64 / t_copy;
        Ok([w_mem, mem_latency, t_copy])
    }

    /// `[sigma, mu_comp, mu_all, eta_all]`: each stream's speed while the others run in
    /// loops, as a fraction of its speed alone (`t_big`, `t_comm`, `t_copy`).
    fn measure_interference(
        &self,
        t_big: f64,
        t_comm: f64,
        t_copy: f64,
        step: &mut dyn FnMut(&str),
    ) -> Result<[f64; 4]> {
        let repeats = self.o.repeats;
        let per_peer = self.per_peer();
        let compute_load = || self.gemm(&self.big);
        let comm_load = || self.all_to_all(per_peer);
        let copy_load = || self.copy();
        step("compute while the others run (sigma)");
        let t_big_loaded =
            time_with_load(repeats, &mut || self.gemm(&self.big), &[&comm_load, &copy_load])?.as_secs_f64();
        step("all-to-all while computing (mu_comp)");
        let t_comm_comp =
            time_with_load(repeats, &mut || self.all_to_all(per_peer), &[&compute_load])?.as_secs_f64();
        step("all-to-all with everything (mu_all)");
        let t_comm_all = time_with_load(
            repeats,
            &mut || self.all_to_all(per_peer),
            &[&compute_load, &copy_load],
        )?
        .as_secs_f64();
        step("copies with everything (eta_all)");
        let t_copy_all =
            time_with_load(repeats, &mut || self.copy(), &[&compute_load, &comm_load])?.as_secs_f64();
        let factor = |alone: f64, loaded: f64| (alone / loaded).clamp(0.01, 1.5);
        Ok([
            factor(t_big, t_big_loaded),
            factor(t_comm, t_comm_comp),
            factor(t_comm, t_comm_all),
            factor(t_copy, t_copy_all),
        ])
    }
}
