//! What a layer holds besides its parameters.

use std::sync::Arc;

use super::MoeLayerConfig;
use crate::comm::Communicator;
use crate::memory::{HostStore, MemoryMeter};

/// The non-parameter state of one layer: its settings, its rank's handle to the
/// expert-parallel group, and its host store and memory meter.
///
/// Nothing here is global: two layers never share a host store or meter by accident. Layers
/// of one model on one rank do share the communicator (like a process group), which is
/// right because they call its collectives in the same order on every rank.
#[derive(Debug, Clone)]
pub struct MoeContext {
    pub(crate) config: MoeLayerConfig,
    pub(crate) comm: Arc<dyn Communicator>,
    pub(crate) host: HostStore,
}

impl MoeContext {
    pub(crate) fn new(config: MoeLayerConfig, comm: Arc<dyn Communicator>) -> Self {
        Self {
            config,
            comm,
            host: HostStore::new(MemoryMeter::new()),
        }
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeLayerConfig {
        &self.config
    }

    /// This rank's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The meter of this layer's host store.
    pub fn meter(&self) -> &MemoryMeter {
        self.host.meter()
    }
}
