//! A communicator's own paths for the rows on a given backend: the all-to-all, so that rows
//! stay on the device (NCCL on CUDA) instead of passing through host bytes, and the offload of
//! S1–S3, so that partitions go to pinned host memory on a copy stream of their own.
//!
//! The layer only holds an `Arc<dyn Communicator>`, and the fused exchange only knows its
//! backend `B` as a type parameter, so the path is found by type: a communicator offers
//! [`RowPaths`], a list of `Arc<dyn RowExchange<B>>` for the backends it serves, and the
//! exchange takes the entry for its `B`, or the host-bytes path when there is none.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::peer::host_all_to_all_v;
use super::{Communicator, Payload};
use crate::error::{MoeError, Result};
use crate::memory::{HostBlock, HostStore};

/// The uneven all-to-all of a `[rows, width]` float tensor on backend `B`.
pub trait RowExchange<B: Backend>: Send + Sync + fmt::Debug {
    /// Sends `send_rows[peer]` rows of `x` (grouped by peer, in rank order) to each peer and
    /// returns the `recv_rows[peer]` rows from each, grouped by source rank.
    ///
    /// # Shapes
    /// - x: `[sum(send_rows), width]` → `[sum(recv_rows), width]`
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: FloatTensor<B>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<FloatTensor<B>>;
}

/// A partition parked in host memory by an [`OffloadPath`] until backward takes it back.
pub trait Offloaded<B: Backend>: Send + Sync + fmt::Debug {
    /// Copies the rows back to the device and frees the host memory (the prefetch). Called
    /// once per offload.
    fn restore(&self) -> Result<FloatTensor<B>>;
}

/// A backend's own offload of a partition (S1–S3) to host memory.
pub trait OffloadPath<B: Backend>: Send + Sync + fmt::Debug {
    /// Starts copying `x` to host memory and returns the parked partition; the host bytes are
    /// reported to `host`'s meter while they are held.
    ///
    /// # Shapes
    /// - x: `[rows, width]`
    fn offload(&self, x: FloatTensor<B>, host: &HostStore) -> Result<Arc<dyn Offloaded<B>>>;
}

/// The device paths a communicator offers, at most one of each kind per backend type: the
/// rows' all-to-all ([`RowExchange`]), the offload ([`OffloadPath`]), the tensor all-reduce and
/// broadcast (`with_reduce`), and a device library's expert compute (`with_experts`).
#[derive(Clone, Default)]
pub struct RowPaths {
    paths: Vec<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for RowPaths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowPaths({} backends)", self.paths.len())
    }
}

impl RowPaths {
    /// No paths: every backend uses host bytes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `entry`, replacing an earlier entry of the same type: entries are found by
    /// their type, which names the kind of path and the backend.
    pub(crate) fn insert<T: Any + Send + Sync>(mut self, entry: T) -> Self {
        self.paths.retain(|p| !p.is::<T>());
        self.paths.push(Arc::new(entry));
        self
    }

    pub(crate) fn find<T: Any + Clone>(&self) -> Option<T> {
        self.paths.iter().find_map(|p| p.downcast_ref::<T>().cloned())
    }

    /// `self` with every entry of `other` added, each replacing an entry of the same kind and
    /// backend: how a wrapper adds paths to those its inner communicator offers.
    pub fn merged(mut self, other: &RowPaths) -> Self {
        for entry in &other.paths {
            self.paths.retain(|p| (**p).type_id() != (**entry).type_id());
            self.paths.push(entry.clone());
        }
        self
    }

    /// The entries of `self` of a kind and backend that `other` has none of: fallbacks to add
    /// to a communicator's own paths without replacing any (`self.absent_from(own)` merged
    /// into `own` keeps every path `own` had).
    pub fn absent_from(mut self, other: &RowPaths) -> Self {
        self.paths
            .retain(|p| !other.paths.iter().any(|o| (**o).type_id() == (**p).type_id()));
        self
    }

    /// Adds the path for backend `B` (replacing an earlier one for the same backend).
    pub fn with<B: Backend>(self, path: Arc<dyn RowExchange<B>>) -> Self {
        self.insert(path)
    }

    /// The path for backend `B`, if there is one.
    pub fn get<B: Backend>(&self) -> Option<Arc<dyn RowExchange<B>>> {
        self.find()
    }

    /// Adds the offload path for backend `B` (replacing an earlier one for the same backend).
    pub fn with_offload<B: Backend>(self, path: Arc<dyn OffloadPath<B>>) -> Self {
        self.insert(path)
    }

    /// The offload path for backend `B`, if there is one.
    pub fn offload<B: Backend>(&self) -> Option<Arc<dyn OffloadPath<B>>> {
        self.find()
    }
}

/// The host twin of a device [`RowExchange`]: reads the rows to host bytes and runs the
/// shared posting logic ([`post_all_to_all_v`](super::peer::post_all_to_all_v)) through
/// [`HostPeers`](super::peer::HostPeers). It serves every backend, and it is the exchange's
/// own path where a communicator offers none; tests also put it behind [`WithRowPaths`] to
/// drive the fused exchange through the device hook on the CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostRows;

impl<B: Backend> RowExchange<B> for HostRows {
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: FloatTensor<B>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<FloatTensor<B>> {
        let device = B::float_device(&x);
        let data = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x)).into_data();
        let [_, width] = [data.shape[0], data.shape[1]];
        let dtype = data.dtype;
        let recv = host_all_to_all_v(
            comm,
            "all_to_all_v",
            data.as_bytes(),
            width * dtype.size(),
            send_rows,
            recv_rows,
        )?;
        let rows = recv_rows.iter().sum::<usize>();
        Ok(B::float_from_data(
            TensorData::from_bytes_vec(recv, [rows, width], dtype),
            &device,
        ))
    }
}

/// The host twin of a device [`OffloadPath`]: the partition goes through the [`HostStore`]
/// (an anonymous mapping, counted by its meter), as the exchange does without a path. Tests
/// put it behind [`WithRowPaths`] to drive S1–S3 through the offload hook on the CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostOffload;

#[derive(Debug)]
struct HostParked<B: Backend> {
    block: HostBlock,
    device: B::Device,
}

impl<B: Backend> Offloaded<B> for HostParked<B> {
    fn restore(&self) -> Result<FloatTensor<B>> {
        let data = self
            .block
            .take()
            .ok_or_else(|| MoeError::Backend("an offloaded partition was restored twice".into()))?;
        Ok(B::float_from_data(data, &self.device))
    }
}

impl<B: Backend> OffloadPath<B> for HostOffload {
    fn offload(&self, x: FloatTensor<B>, host: &HostStore) -> Result<Arc<dyn Offloaded<B>>> {
        let device = B::float_device(&x);
        let data = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x)).into_data();
        Ok(Arc::new(HostParked::<B> {
            block: host.offload(data)?,
            device,
        }))
    }
}

/// A communicator with [`RowPaths`] added: collectives go to the inner communicator, the
/// rows' all-to-all to the path for the exchange's backend.
#[derive(Debug, Clone)]
pub struct WithRowPaths {
    inner: Arc<dyn Communicator>,
    paths: RowPaths,
    /// What [`adding`](Self::adding) added to the inner communicator's own paths, so that a
    /// sub-group adds it to the sub-group's own.
    added: Option<RowPaths>,
}

impl WithRowPaths {
    /// `inner` with `paths` in place of any it offers.
    pub fn new(inner: Arc<dyn Communicator>, paths: RowPaths) -> Self {
        Self {
            inner,
            paths,
            added: None,
        }
    }

    /// `inner` with `paths` added to those it offers (each replacing the inner entry of the
    /// same kind and backend): e.g. the CUDA expert GEMMs added to a group of thread ranks,
    /// or to NCCL's rows.
    pub fn adding(inner: Arc<dyn Communicator>, paths: RowPaths) -> Self {
        let merged = inner.row_paths().cloned().unwrap_or_default().merged(&paths);
        Self {
            inner,
            paths: merged,
            added: Some(paths),
        }
    }
}

impl Communicator for WithRowPaths {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn n_ranks(&self) -> usize {
        self.inner.n_ranks()
    }

    fn is_identity(&self) -> bool {
        self.inner.is_identity()
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        self.inner.exchange(op, outgoing)
    }

    /// The inner communicator's, with its own arrival bound.
    fn arrival_barrier(&self) -> Result<()> {
        self.inner.arrival_barrier()
    }

    fn row_paths(&self) -> Option<&RowPaths> {
        Some(&self.paths)
    }

    /// The inner communicator's sub-group with the same paths: the paths [`new`](Self::new)
    /// carries are the host twins, which serve any communicator they are called with; what
    /// [`adding`](Self::adding) added is added to the sub-group's own paths (NCCL's sub-group
    /// has paths of its own communicator).
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let sub = self.inner.split(color)?;
        Ok(Arc::new(match &self.added {
            Some(added) => Self::adding(sub, added.clone()),
            None => Self::new(sub, self.paths.clone()),
        }))
    }
}
