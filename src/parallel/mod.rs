//! Training a model that holds MoE layers on many ranks: which parameters are experts and which
//! are replicated ([`param_roles`]), rank-independent parameter names ([`with_path_ids`]), the
//! gradient all-reduce on the device ([`sync_replicated_grads`]), and expert parallelism inside
//! data parallelism ([`ParallelGroups`]).
//!
//! One training step on every rank:
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
//! use burn::tensor::Tensor;
//! use mpipemoe::parallel::sync_replicated_grads;
//! use mpipemoe::{LocalGroup, MoeLayerConfig};
//!
//! type B = Autodiff<NdArray>;
//! LocalGroup::run(2, |ctx| {
//!     let device = Default::default();
//!     let layer = MoeLayerConfig::new(8, 16, 4, 2).init_rank::<B>(&device, ctx.comm.clone())?;
//!     let mut optimizer = AdamWConfig::new().init();
//!     let x = Tensor::<B, 2>::ones([3, 8], &device) * (ctx.rank as f64 + 1.0);
//!     let out = layer.try_forward(x)?;
//!     let loss = out.output.sum() + out.aux_loss;
//!     let mut grads = GradientsParams::from_grads(loss.backward(), &layer);
//!     // The router's gradient is summed over both ranks; each rank's experts keep theirs.
//!     sync_replicated_grads(&layer, &mut grads, ctx.comm.as_ref())?;
//!     let _layer = optimizer.step(1e-3, layer, grads);
//!     Ok(())
//! })
//! .unwrap();
//! ```

mod groups;
mod roles;
mod sync;

pub use groups::ParallelGroups;
pub use roles::{param_roles, path_id, with_path_ids, ParamEntry, ParamRole};
pub use sync::{sync_expert_grads, sync_grads_of, sync_replicated_grads, SyncReport, DEFAULT_BUCKET_BYTES};
