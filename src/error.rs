//! The crate's one error type.
//!
//! Contract violations that the caller controls (a bad config field, an input of the wrong
//! width) and environment failures (a rank that died, a file that cannot be read, a memory
//! plan that does not fit) are all reported as [`MoeError`]. Every message names the field,
//! tensor, file, rank or collective it is about, so a one-line print is enough to act on.

use std::path::PathBuf;

/// Everything that can go wrong in mpipemoe.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MoeError {
    /// A configuration field has a value the layer cannot run with.
    #[error("invalid config: `{field}` {reason}")]
    Config {
        /// The name of the field, as spelled in [`MoeLayerConfig`](crate::MoeLayerConfig).
        field: &'static str,
        /// Why the value is rejected.
        reason: String,
    },
    /// The input tensor does not satisfy the layer's contract.
    #[error("invalid input: {0}")]
    Input(String),
    /// A collective failed: a peer died or errored, timed out, or the ranks disagreed.
    #[error("comm error in `{op}` on rank {rank}: {reason}")]
    Comm {
        /// The collective that failed (`all_to_all_v`, `all_gather`, ...).
        op: String,
        /// The rank that reports the failure.
        rank: usize,
        /// What happened, naming the rank at fault where known.
        reason: String,
    },
    /// A collective could not complete because another rank of the group failed first. The
    /// failing rank's own error is the root cause; [`LocalGroup::run`](crate::LocalGroup::run)
    /// reports that one and not these.
    #[error("comm error in `{op}` on rank {rank}: rank {peer} failed: {reason}")]
    PeerFailed {
        /// The collective this rank was in.
        op: String,
        /// The rank that reports the failure.
        rank: usize,
        /// The rank that failed.
        peer: usize,
        /// The failed rank's own error.
        reason: String,
    },
    /// A file could not be read or written, or its contents are not what the format says.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it, naming the tensor or key where it is about one.
        reason: String,
    },
    /// A memory plan or budget cannot be satisfied.
    #[error("memory plan: {0}")]
    Memory(String),
    /// A backend (CUDA driver, NCCL, ...) is missing or failed.
    #[error("backend: {0}")]
    Backend(String),
}

impl MoeError {
    /// Shorthand for a [`MoeError::Config`] error.
    pub fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Config {
            field,
            reason: reason.into(),
        }
    }

    /// Shorthand for a [`MoeError::File`] error.
    pub fn file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::File {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for a [`MoeError::Comm`] error.
    pub fn comm(op: impl Into<String>, rank: usize, reason: impl Into<String>) -> Self {
        Self::Comm {
            op: op.into(),
            rank,
            reason: reason.into(),
        }
    }

    /// Whether this error only reports another rank's failure ([`MoeError::PeerFailed`]).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, MoeError::PeerFailed { .. })
    }

    /// Raises this error as a panic whose payload is the error itself.
    ///
    /// Burn's backward pass has no error channel, so a collective that fails inside a custom
    /// op's backward panics with the [`MoeError`] as payload; [`LocalGroup::run`](crate::LocalGroup::run)
    /// (crate::LocalGroup::run) recovers it with [`MoeError::from_panic`].
    pub fn raise(self) -> ! {
        std::panic::panic_any(self)
    }

    /// Recovers an error from a panic payload: a raised [`MoeError`], or the panic message.
    pub fn from_panic(payload: Box<dyn std::any::Any + Send>, rank: usize) -> Self {
        match payload.downcast::<MoeError>() {
            Ok(err) => *err,
            Err(payload) => {
                let message = crate::sync::panic_message(payload.as_ref());
                Self::comm("rank", rank, format!("rank {rank} panicked: {message}"))
            }
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T, E = MoeError> = std::result::Result<T, E>;
