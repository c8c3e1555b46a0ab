//! # mpipemoe
//!
//! Mixture-of-Experts layers for [burn](https://burn.dev) that train faster and in less
//! memory, after *MPipeMoE* (Zhang et al., IPDPS 2023). [`MoeLayer`] replaces a transformer's
//! FFN: a router picks `top_k` of `n_experts` feed-forward experts per token, the tokens are
//! exchanged with the ranks that own those experts (an uneven all-to-all), and the results
//! come back weighted. The exchange is cut into `n` partitions along the token dimension so
//! that dispatch, expert compute and combine of different partitions overlap, and partition
//! buffers are reused, with the activations the backward pass needs restored by offloading,
//! re-communication or recomputation (strategies S1–S4).
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::{Distribution, Tensor};
//! use mpipemoe::{Activation, MemoryReuse, MoeLayerConfig, Partitions};
//!
//! type B = Autodiff<NdArray>;
//! let device = Default::default();
//! // d_model, d_hidden, n_experts, top_k
//! let layer = MoeLayerConfig::new(32, 64, 8, 2)
//!     .with_activation(Activation::SwiGlu)
//!     .with_partitions(Partitions::Fixed(2)) // the paper's n
//!     .with_memory_reuse(MemoryReuse::S4) // re-communicate T_DI, recompute T_M
//!     .with_aux_loss_coef(0.01)
//!     .init::<B>(&device);
//! let x = Tensor::<B, 3>::random([4, 16, 32], Distribution::Default, &device);
//! let out = layer.forward(x); // out.output: [4, 16, 32]
//! let loss = out.output.powi_scalar(2).mean() + out.aux_loss + out.z_loss;
//! let grads = loss.backward();
//! assert!(layer.experts.w_in.grad(&grads).is_some());
//! println!("tokens per expert: {:?}", out.stats.routing.tokens_per_expert);
//! ```
//!
//! With expert parallelism each rank holds `n_experts / n_ranks` experts and calls the layer
//! on its slice of the batch. On the CPU the ranks are threads ([`LocalGroup`]); the
//! `mpipemoe-cuda` crate adds NCCL ranks on GPUs.
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::{Distribution, Tensor};
//! use mpipemoe::{LocalGroup, MoeLayerConfig};
//!
//! type B = Autodiff<NdArray>;
//! let config = MoeLayerConfig::new(16, 32, 4, 2);
//! let sums = LocalGroup::run(2, |ctx| {
//!     let device = Default::default();
//!     // Rank r holds experts [2r, 2r + 2) and the replicated router.
//!     let layer = config.init_rank::<B>(&device, ctx.comm.clone())?;
//!     let x = Tensor::<B, 2>::random([6, 16], Distribution::Default, &device);
//!     let out = layer.try_forward(x)?;
//!     Ok(out.output.sum().into_scalar())
//! })
//! .unwrap();
//! assert_eq!(sums.len(), 2);
//! ```
//!
//! Where to look:
//! - [`MoeLayerConfig`] for every setting, [`MoeOutput`] and [`MoeStats`] for what a pass
//!   returns, [`MoeError`] for what can fail.
//! - [`hf`]: Hugging Face checkpoints (Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3, Llama 4,
//!   GPT-OSS) in and out.
//! - [`comm`]: the [`Communicator`] trait and the in-process group of ranks.
//! - [`tuning`], [`memory`], [`sim`]: Algorithm 1, the cost model (Eq. 10–13), the memory
//!   model (Eq. 1–9) and the stream simulator behind `mpipemoe plan` and `simulate`.
//! - [`backend`]: the [`MoeBackend`] contract, for implementing the fused exchange on a new
//!   backend.

#![warn(missing_docs)]

/// The default implementations of a per-backend kernel trait (`$kernels`, whose methods all
/// have defaults) for the backends the crate supports that do not override them: NdArray,
/// the CubeCL backends, `Fusion<B>` and `Autodiff<B>` over any backend that has them. Flex,
/// which overrides, implements each trait by hand; `$kernels, except cubecl` leaves the CubeCL
/// backends out too, for a trait they implement by hand, and `$kernels, except autodiff`
/// leaves `Autodiff<B>` out, for a trait whose ops it records as nodes of its own;
/// `@ndarray $kernels` is NdArray's alone, for a trait that `Fusion<B>` implements by hand.
macro_rules! default_kernel_impls {
    ($kernels:path) => {
        default_kernel_impls!(@plain $kernels);
        default_kernel_impls!(@cubecl $kernels);
        default_kernel_impls!(@autodiff $kernels);
    };
    ($kernels:path, except cubecl) => {
        default_kernel_impls!(@plain $kernels);
        default_kernel_impls!(@autodiff $kernels);
    };
    ($kernels:path, except autodiff) => {
        default_kernel_impls!(@plain $kernels);
        default_kernel_impls!(@cubecl $kernels);
    };
    (@plain $kernels:path) => {
        default_kernel_impls!(@ndarray $kernels);

        #[cfg(feature = "fusion")]
        impl<B: burn_fusion::FusionBackend + $kernels> $kernels for burn_fusion::Fusion<B> {}
    };
    (@ndarray $kernels:path) => {
        #[cfg(feature = "ndarray")]
        impl<E, I, Q> $kernels for burn::backend::NdArray<E, I, Q>
        where
            E: burn::backend::ndarray::FloatNdArrayElement,
            I: burn::backend::ndarray::IntNdArrayElement,
            Q: burn::backend::ndarray::QuantElement,
            burn::backend::ndarray::NdArrayTensor:
                From<burn::backend::ndarray::SharedArray<E>> + From<burn::backend::ndarray::SharedArray<I>>,
        {
        }
    };
    (@cubecl $kernels:path) => {
        #[cfg(feature = "cubecl")]
        impl<R, F, I, BT> $kernels for burn_cubecl::CubeBackend<R, F, I, BT>
        where
            R: burn_cubecl::CubeRuntime,
            R::Server: burn_cubecl::cubecl::server::ComputeServer,
            R::Device: burn::tensor::backend::DeviceOps,
            F: burn_cubecl::FloatElement,
            I: burn_cubecl::IntElement,
            BT: burn_cubecl::BoolElement,
        {
        }
    };
    (@autodiff $kernels:path) => {
        impl<B: $kernels, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> $kernels
            for burn::backend::Autodiff<B, C>
        {
        }
    };
}

pub mod backend;
#[cfg(feature = "testkit")]
mod cases;
pub mod comm;
#[cfg(feature = "cubecl")]
mod cubecl_cube;
#[cfg(feature = "cubecl")]
mod cubecl_launch;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_test_kernels;
pub mod decoder;
mod dispatch;
mod error;
mod exchange;
mod experts;
pub mod files;
pub mod format;
#[cfg(feature = "testkit")]
#[doc(hidden)]
pub mod harness;
pub mod heap;
pub mod hf;
pub mod hot_pool;
mod layer;
pub mod layout;
pub mod loss;
pub mod memory;
pub mod optim;
pub mod parallel;
mod pipeline;
pub mod rng;
mod router;
pub mod sim;
mod sync;
pub mod tuning;

pub use comm::{Communicator, LocalGroup, RankContext};
pub use dispatch::RoutingStats;
pub use error::{MoeError, Result};
pub use exchange::{GemmPrecision, MoeBackend};
pub use experts::{
    seeded_uniform, Activation, ExpertAdapters, ExpertLora, ExpertShard, Experts, LoraScaling, ShardCheck,
    SharedExpert,
};
pub use layer::{
    ExchangePath, ExpertLoraSpec, MoeContext, MoeLayer, MoeLayerConfig, MoeOutput, MoeStats, ParamKind,
    Partitions, MAX_PARTITIONS,
};
pub use memory::MemoryReuse;
pub use router::{Router, Routing, RoutingRule, Scoring};
pub use tuning::Shadowing;
