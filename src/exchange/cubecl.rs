//! `MoeBackend` for burn's CubeCL backends (CUDA, ROCm, WGPU), with the generic fused
//! algorithm.
//!
//! This is the correctness path on a GPU: the same schedule and strategies as on the CPU,
//! with plans on the host, offloads as real device → host → device copies, and every step on
//! burn's own stream. Overlapping S, C and R on streams of their own (DESIGN §6) belongs in
//! the `mpipemoe-cuda` crate and is not done yet.

use burn::tensor::backend::DeviceOps;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::cubecl::server::ComputeServer;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{fused, ExchangeGrads, ExchangeRun, MoeBackend};
use crate::dispatch::ExchangePlan;
use crate::error::Result;
use crate::experts::ExpertTensors;

impl<R, F, I, BT> MoeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    R::Server: ComputeServer,
    R::Device: DeviceOps,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type Saved = fused::Saved<Self>;

    fn exchange_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<(FloatTensor<Self>, Self::Saved)> {
        fused::forward::<Self>(input, experts, plan, run)
    }

    fn exchange_backward(
        grad_out: FloatTensor<Self>,
        saved: Self::Saved,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<ExchangeGrads<Self>> {
        fused::backward::<Self>(grad_out, saved, plan, run)
    }
}
