//! The rows one rank handles in one pass, partition by partition: what the memory model needs
//! to know about a batch's routing.

use serde::Serialize;

use super::LayerShape;
use crate::pipeline::chunk_len;

/// The rows one rank sends and receives in each partition of the exchange.
///
/// Balanced routing gives every rank `tokens · top_k` rows each way ([`RankRows::balanced`]);
/// a real batch gives each rank its own counts, which every rank knows after the counts
/// exchange (`RoutingCounts::rank_rows` in `dispatch`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankRows {
    /// Tokens on this rank.
    pub tokens: usize,
    /// Rows this rank sends in each partition (its share of `T_I`). `[n_partitions]`
    pub send: Vec<usize>,
    /// Rows each local expert of this rank receives in each partition.
    /// `[n_partitions][n_local_experts]`
    pub recv: Vec<Vec<usize>>,
}

impl RankRows {
    /// Balanced routing: every rank sends and receives `tokens · top_k` rows, spread evenly
    /// over its local experts and cut into `n_partitions` near-equal partitions.
    pub fn balanced(shape: &LayerShape) -> Self {
        Self::receiving(shape, shape.tokens * shape.top_k)
    }

    /// The rank that receives `imbalance` × the mean rows (`tokens · top_k`), spread evenly
    /// over its local experts, while sending its own `tokens · top_k`: the worst rank of a
    /// skewed batch, for planning.
    pub fn skewed(shape: &LayerShape, imbalance: f64) -> Self {
        let rows = shape.tokens * shape.top_k;
        Self::receiving(shape, (rows as f64 * imbalance).round() as usize)
    }

    /// A rank that sends its own `tokens · top_k` rows and receives `received` rows, spread
    /// evenly over its local experts; every list cut into `n_partitions` near-equal partitions.
    pub(crate) fn receiving(shape: &LayerShape, received: usize) -> Self {
        let n = shape.n_partitions.max(1);
        let rows = shape.tokens * shape.top_k;
        let local = shape.local_experts().max(1);
        Self {
            tokens: shape.tokens,
            send: (0..n).map(|i| chunk_len(rows, n, i)).collect(),
            recv: (0..n)
                .map(|i| {
                    (0..local)
                        .map(|e| chunk_len(chunk_len(received, local, e), n, i))
                        .collect()
                })
                .collect(),
        }
    }

    /// Partitions.
    pub fn n_partitions(&self) -> usize {
        self.send.len()
    }

    /// Rows sent over all partitions (`T_I`, `T_O`).
    pub fn send_rows(&self) -> usize {
        self.send.iter().sum()
    }

    /// Rows received over all partitions (`T_DI`).
    pub fn recv_rows(&self) -> usize {
        self.recv.iter().flatten().sum()
    }

    /// Rows received in partition `i`.
    pub fn partition_recv(&self, i: usize) -> usize {
        self.recv[i].iter().sum()
    }
}
