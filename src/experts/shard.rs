//! Which experts a rank holds, saved with the experts' record so that a record is never
//! loaded into another rank's experts unnoticed.
//!
//! With expert parallelism a rank's [`Experts`](super::Experts) record holds only its own
//! experts, `[n_local_experts, ..]` tensors that look alike on every rank: rank 1's record
//! loads into rank 0's model without a shape error, and the model then computes with the
//! wrong experts. The record therefore carries the range it was saved from
//! ([`ExpertShard`]); loading keeps both, and the layer refuses to run (and
//! [`Experts::check_shard`](super::Experts::check_shard) reports) when they differ, naming
//! both.

use burn::module::{
    AutodiffModule, Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor,
};
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::{AutodiffBackend, Backend};
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

use crate::error::{MoeError, Result};

/// The experts one rank holds: `first_expert..first_expert + n_local` of `n_experts`, as rank
/// `rank` of an expert-parallel group of `n_ranks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertShard {
    /// Global index of the first expert.
    pub first_expert: usize,
    /// Experts held.
    pub n_local: usize,
    /// Experts of the layer over all ranks.
    pub n_experts: usize,
    /// The rank in the expert-parallel group.
    pub rank: usize,
    /// Ranks in the expert-parallel group.
    pub n_ranks: usize,
}

impl std::fmt::Display for ExpertShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "experts {}..{} of {} (rank {} of {})",
            self.first_expert,
            self.first_expert + self.n_local,
            self.n_experts,
            self.rank,
            self.n_ranks
        )
    }
}

impl<B: Backend> Record<B> for ExpertShard {
    type Item<S: PrecisionSettings> = ExpertShard;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        item
    }
}

/// The shard a layer was built for and, after `load_record`, the shard the record was saved
/// from. A module field of [`Experts`](super::Experts) with no tensors; generic over the
/// backend only because burn's derive persists a field's record when its type names the
/// backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardCheck<B: Backend> {
    built: ExpertShard,
    loaded: Option<ExpertShard>,
    backend: PhantomData<B>,
}

impl<B: Backend> ShardCheck<B> {
    /// A layer's own shard, nothing loaded yet.
    pub fn new(built: ExpertShard) -> Self {
        Self {
            built,
            loaded: None,
            backend: PhantomData,
        }
    }

    /// The shard whose weights the experts hold: the loaded record's, or the built one.
    pub fn shard(&self) -> ExpertShard {
        self.loaded.unwrap_or(self.built)
    }

    /// An error naming both shards if a record of other experts was loaded.
    pub fn check(&self) -> Result<()> {
        match self.loaded {
            Some(loaded) if loaded != self.built => Err(MoeError::Input(format!(
                "the experts' record was saved from {loaded}, but this layer holds {}: load each \
                 rank's record on the same rank of the same number of ranks",
                self.built
            ))),
            _ => Ok(()),
        }
    }

    fn with_backend<C: Backend>(&self) -> ShardCheck<C> {
        ShardCheck {
            built: self.built,
            loaded: self.loaded,
            backend: PhantomData,
        }
    }
}

impl<B: Backend> Module<B> for ShardCheck<B> {
    type Record = ExpertShard;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        devices
    }

    fn fork(self, _device: &B::Device) -> Self {
        self
    }

    fn to_device(self, _device: &B::Device) -> Self {
        self
    }

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        self
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            loaded: Some(record),
            ..self
        }
    }

    fn into_record(self) -> Self::Record {
        self.shard()
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for ShardCheck<B> {
    type InnerModule = ShardCheck<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        self.with_backend()
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        module.with_backend()
    }
}

impl<B: Backend> ModuleDisplayDefault for ShardCheck<B> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&self.shard().to_string()).optional()
    }
}

impl<B: Backend> ModuleDisplay for ShardCheck<B> {}
