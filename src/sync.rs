//! Poison-tolerant locks and panic messages, for every room that runs threads (ranks, stream
//! workers, the arena).
//!
//! A thread that panics while it holds one of the library's locks leaves the guarded state
//! consistent (each update is a single assignment or push), and the panic itself is reported
//! as an error by whoever joins the thread (`LocalGroup::run`, the step executor). So a
//! poisoned lock is used as it is: failing every other thread on it would turn one reported
//! error into many unrelated panics.

use std::any::Any;
use std::sync::{Mutex, MutexGuard};

/// Locks `m`, also after a panic in another holder (see the module docs).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The value inside `m`, also after a panic in a holder (see the module docs).
pub(crate) fn into_inner<T>(m: Mutex<T>) -> T {
    m.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// The message of a panic payload that is not a raised `MoeError`.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "non-string panic payload".to_string())
}
