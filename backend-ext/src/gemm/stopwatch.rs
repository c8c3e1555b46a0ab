//! The marks of a timed path (`CublasOptions::timed`): a CUDA event and a host instant before a
//! section's first piece and after each piece, read into a [`Breakdown`] when the path is asked
//! for one (`CublasExperts::breakdown`).
//!
//! Events record the lane's stream position (cudarc 0.19.10 `driver/safe/core.rs`,
//! `CudaEvent::record` → `cuEventRecord`), so the time between two marks is the device time of
//! the work queued between them on that stream, waits included; reading one waits for it
//! (`elapsed_ms` synchronises both events), which is why marks are read only when asked, or
//! when too many are held, never inside a section.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use mpipemoe::{MoeError, Result};

use crate::breakdown::Breakdown;

fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Backend(format!("CUDA expert path's stopwatch: {what}: {e:?}"))
}

/// The name of the mark that opens a section (not a piece).
pub(crate) const START: &str = "start";

/// Closed sections held before the older half is read: a path timed for a long run keeps its
/// memory bounded (a few dozen events a step), and the events read then finished long before.
const HELD_SECTIONS: usize = 4096;

struct Mark {
    piece: &'static str,
    host: Instant,
    event: CudaEvent,
}

/// One lane's marks (see the module docs).
pub(crate) struct Stopwatch {
    context: Arc<CudaContext>,
    open: Vec<Mark>,
    closed: Vec<Vec<Mark>>,
    read: Breakdown,
}

impl std::fmt::Debug for Stopwatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stopwatch")
            .field("open", &self.open.len())
            .field("closed", &self.closed.len())
            .finish_non_exhaustive()
    }
}

impl Stopwatch {
    pub(crate) fn new(context: &Arc<CudaContext>) -> Self {
        Self {
            context: context.clone(),
            open: Vec::new(),
            closed: Vec::new(),
            read: Breakdown::default(),
        }
    }

    /// Marks `stream`'s position now: the end of `piece` (or, as [`START`], a section's start).
    pub(crate) fn mark(&mut self, stream: &CudaStream, piece: &'static str) -> Result<()> {
        // A section that failed before it could close keeps its marks to itself.
        if piece == START && !self.open.is_empty() {
            self.closed.push(std::mem::take(&mut self.open));
        }
        // Timing events (cudarc's default disables timing).
        let event = self
            .context
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| err("event", e))?;
        event.record(stream).map_err(|e| err("record", e))?;
        self.open.push(Mark {
            piece,
            host: Instant::now(),
            event,
        });
        Ok(())
    }

    /// Ends the open section (whatever it managed to mark, so that a failed section still
    /// counts the pieces it ran).
    pub(crate) fn close(&mut self) -> Result<()> {
        if !self.open.is_empty() {
            self.closed.push(std::mem::take(&mut self.open));
        }
        if self.closed.len() > HELD_SECTIONS {
            self.read_oldest(HELD_SECTIONS / 2)?;
        }
        Ok(())
    }

    /// Reads the `n` oldest closed sections into the running breakdown.
    fn read_oldest(&mut self, n: usize) -> Result<()> {
        let n = n.min(self.closed.len());
        for section in self.closed.drain(..n) {
            let Some(first) = section.first() else {
                continue;
            };
            let mut marks = Vec::with_capacity(section.len());
            for m in &section {
                let device = first.event.elapsed_ms(&m.event).map_err(|e| err("elapsed", e))?;
                let host = m.host.duration_since(first.host).as_secs_f64() * 1e3;
                marks.push((m.piece, f64::from(device), host));
            }
            self.read.add_section(&marks);
        }
        Ok(())
    }

    /// Every closed section's pieces since the last take, emptied (waits for their events).
    pub(crate) fn take(&mut self) -> Result<Breakdown> {
        self.read_oldest(self.closed.len())?;
        Ok(std::mem::take(&mut self.read))
    }
}
