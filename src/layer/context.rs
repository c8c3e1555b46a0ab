//! What a layer holds besides its parameters.

use std::sync::{Arc, Mutex, MutexGuard};

use super::MoeLayerConfig;
use crate::comm::Communicator;
use crate::exchange::PartitionArena;
use crate::memory::{HostStore, MemoryMeter};
use crate::sync::lock;
use crate::tuning::{GranularityTable, Profile, TrialTimer, WallClock};

/// The non-parameter state of one layer: its settings, its rank's handle to the
/// expert-parallel group, its host store and memory meter, and its tuning state.
///
/// Nothing here is global: two layers never share a host store, meter or granularity table by
/// accident (clones of one layer do share them, as the same layer). Layers of one model on one
/// rank do share the communicator (like a process group), which is right because they call
/// its collectives in the same order on every rank.
#[derive(Debug, Clone)]
pub struct MoeContext {
    pub(crate) config: MoeLayerConfig,
    pub(crate) comm: Arc<dyn Communicator>,
    /// The data-parallel replicas of this rank's experts (one rank without data parallelism):
    /// the routing statistics are summed over them.
    pub(crate) replicas: Arc<dyn Communicator>,
    pub(crate) host: HostStore,
    pub(crate) arena: PartitionArena,
    pub(crate) tuning: Arc<Tuning>,
}

/// Algorithm 1's table, the hardware profile and the trial timer of one layer.
#[derive(Debug)]
pub(crate) struct Tuning {
    pub(crate) table: Mutex<GranularityTable>,
    pub(crate) profile: Mutex<Option<Profile>>,
    pub(crate) timer: Mutex<Arc<dyn TrialTimer>>,
}

impl Tuning {
    pub(crate) fn table(&self) -> MutexGuard<'_, GranularityTable> {
        lock(&self.table)
    }

    pub(crate) fn profile(&self) -> MutexGuard<'_, Option<Profile>> {
        lock(&self.profile)
    }

    pub(crate) fn timer(&self) -> Arc<dyn TrialTimer> {
        lock(&self.timer).clone()
    }
}

impl MoeContext {
    pub(crate) fn new(config: MoeLayerConfig, comm: Arc<dyn Communicator>) -> Self {
        Self {
            config,
            comm,
            replicas: Arc::new(crate::comm::SingleRank),
            host: HostStore::new(MemoryMeter::new()),
            arena: PartitionArena::new(),
            tuning: Arc::new(Tuning {
                table: Mutex::new(GranularityTable::new()),
                profile: Mutex::new(None),
                timer: Mutex::new(Arc::new(WallClock::default())),
            }),
        }
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeLayerConfig {
        &self.config
    }

    /// The ranks that hold the same experts as this one, one per data-parallel replica of the
    /// expert-parallel group (one rank without data parallelism).
    pub fn replicas(&self) -> &Arc<dyn Communicator> {
        &self.replicas
    }

    /// This rank's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The meter of this layer's host store.
    pub fn meter(&self) -> &MemoryMeter {
        self.host.meter()
    }

    /// The partition arena this layer builds its partitions in on backends that have one
    /// (the CubeCL backends): a handle to share it, or to read its
    /// [`stats`](PartitionArena::stats).
    pub fn partition_arena(&self) -> PartitionArena {
        self.arena.clone()
    }

    /// A copy of the granularity table (Algorithm 1's state), e.g. to save it.
    pub fn granularity_table(&self) -> GranularityTable {
        self.tuning.table().clone()
    }

    /// Replaces the granularity table (e.g. one restored from JSON).
    pub fn set_granularity_table(&self, table: GranularityTable) {
        *self.tuning.table() = table;
    }

    /// The hardware profile `MemoryReuse::Auto` uses, if one is set or was measured.
    pub fn profile(&self) -> Option<Profile> {
        self.tuning.profile().clone()
    }

    /// Sets the hardware profile for `MemoryReuse::Auto` (a preset, or one measured by
    /// `mpipemoe profile`). Every rank must set the same profile.
    pub fn set_profile(&self, profile: Profile) {
        *self.tuning.profile() = Some(profile);
    }

    /// Replaces the timer of adaptive-granularity trials (tests inject a fake one).
    pub fn set_trial_timer(&self, timer: Arc<dyn TrialTimer>) {
        *lock(&self.tuning.timer) = timer;
    }
}
