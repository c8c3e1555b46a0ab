//! Reductions across a cube's threads in shared memory, for the kernels that give a row a cube
//! whose threads stride along it (`decoder/cubecl_norm.rs`, `decoder/cubecl_softmax.rs`,
//! `loss/cubecl_cross_entropy.rs`).
//!
//! Each thread writes its part into `shared` (one slot a thread), and every thread reads all
//! of them after a barrier, so every thread leaves with the same result. A second barrier
//! before returning lets the caller reuse `shared` for its next reduction. Every thread of the
//! cube must call them: a cube whose row is past the last leaves whole, before any barrier.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

/// The sum of every thread's `value` in the cube, in every thread.
#[cube]
pub(crate) fn cube_sum(shared: &mut SharedMemory<f32>, value: f32, #[comptime] threads: usize) -> f32 {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut total = 0.0f32;
    for i in 0..threads {
        total += shared[i];
    }
    sync_cube();
    total
}

/// The maximum of every thread's `value` in the cube, in every thread.
#[cube]
pub(crate) fn cube_max(shared: &mut SharedMemory<f32>, value: f32, #[comptime] threads: usize) -> f32 {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut max = shared[0];
    for i in 1..threads {
        max = f32::max(max, shared[i]);
    }
    sync_cube();
    max
}
