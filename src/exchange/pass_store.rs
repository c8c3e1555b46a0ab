//! What an [`ExpertPath`](super::ExpertPath) derives from the experts once per pass (or once
//! per step) and reuses in every partition of it.
//!
//! A pass (one forward, or one backward) runs a path once per partition, on the same weights.
//! Work that depends on the weights alone — the CUDA path's bf16 copies of them — need not be
//! redone for each of the `n` partitions: the path keeps it in a store. Each pass builds its
//! [`ExpertGroups`](super::ExpertGroups) once, with an empty pass store (`pass`), and drops it
//! when the pass ends. The step store (`step`) is made by the forward and handed to its
//! backward with the rest of what the forward saves, then dropped when the backward ends: a
//! path that keeps its copies there makes them once a step instead of once a pass, and holds
//! them from the forward to the backward (the trade autocast makes with its saved casts). The
//! backward reads the weights the forward saved, so neither store sees weights that an
//! optimizer step changed.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::error::Result;

type Entry = (TypeId, Arc<dyn Any + Send + Sync>);

/// One pass's (or one step's) store of values by type (see the module docs). Clones share it.
#[derive(Clone, Default)]
pub struct PassStore {
    entries: Arc<Mutex<Vec<Entry>>>,
}

impl fmt::Debug for PassStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PassStore")
            .field("entries", &self.lock().len())
            .finish()
    }
}

impl PassStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn find<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let entries = self.lock();
        let (_, value) = entries.iter().find(|(id, _)| *id == TypeId::of::<T>())?;
        value.clone().downcast::<T>().ok()
    }

    /// The pass's value of type `T`, made by `make` the first time any partition asks.
    ///
    /// `make` runs without the store's lock held, so it may take as long as it needs and wait
    /// on other threads; where two partitions ask at once, both may make one and the first
    /// stored is the one both get.
    ///
    /// # Errors
    /// What `make` returns; nothing is stored then, and a later call makes it again.
    pub fn get_or_make<T: Any + Send + Sync>(&self, make: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        if let Some(value) = self.find::<T>() {
            return Ok(value);
        }
        let made: Arc<dyn Any + Send + Sync> = Arc::new(make()?);
        let mut entries = self.lock();
        let value = match entries.iter().find(|(id, _)| *id == TypeId::of::<T>()) {
            Some((_, earlier)) => earlier.clone(),
            None => {
                entries.push((TypeId::of::<T>(), made.clone()));
                made
            }
        };
        Ok(value.downcast::<T>().expect("stored under its own type id"))
    }

    /// How many values the pass holds (for tests and diagnostics).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the pass holds nothing yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MoeError;

    #[test]
    fn each_type_is_made_once_and_shared_by_clones() {
        let store = PassStore::default();
        let made = std::sync::atomic::AtomicUsize::new(0);
        let make = || {
            made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(7u32)
        };
        let first = store.get_or_make(make).unwrap();
        let again = store.clone().get_or_make(make).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(made.load(std::sync::atomic::Ordering::Relaxed), 1);
        let other = store.get_or_make(|| Ok(String::from("bf16"))).unwrap();
        assert_eq!((*first, other.as_str(), store.len()), (7, "bf16", 2));
        // A new store (the next pass) starts empty.
        assert!(PassStore::default().is_empty());
    }

    #[test]
    fn a_failed_make_stores_nothing() {
        let store = PassStore::default();
        let err = store
            .get_or_make::<u8>(|| Err(MoeError::Backend("no memory".into())))
            .unwrap_err();
        assert!(err.to_string().contains("no memory"));
        assert!(store.is_empty());
        assert_eq!(*store.get_or_make(|| Ok(3u8)).unwrap(), 3);
    }
}
