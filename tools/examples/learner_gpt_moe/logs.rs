//! burn-train's file metric logger, with the epoch of a resumed run's first epoch put right.
//!
//! burn-train 0.21 numbers the epochs it hands its metric loggers from 1 for every split until
//! the first epoch ends (`metric/store/log.rs`, `LogEventStore::add_event`:
//! `self.epochs.entry(split).or_insert(1)`; only `Event::EndEpoch` sets it to the summary's
//! epoch + 1). A run resumed from epoch `k` therefore writes its first epoch's metrics into
//! `epoch-1/`, over the logs the original run wrote there, and `epoch-(k+1)/` never appears;
//! from the second resumed epoch on the numbers are right again. This wrapper maps the one
//! misnumbered epoch to the one it is, so no log is overwritten and every epoch's values are
//! where its number says.

use std::path::Path;

use burn::train::logger::{FileMetricLogger, MetricLogger};
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, NumericEntry};

/// [`FileMetricLogger`] whose epoch 1 is `first_epoch` (the epoch a run starts from).
pub struct ResumedFileLogger {
    inner: FileMetricLogger,
    first_epoch: usize,
}

impl ResumedFileLogger {
    /// A logger writing under `directory` (as burn-train's default one) for a run whose first
    /// epoch is `first_epoch` (1 when not resumed, `k + 1` when resumed from epoch `k`).
    pub fn new(directory: impl AsRef<Path>, first_epoch: usize) -> Self {
        Self {
            inner: FileMetricLogger::new(directory),
            first_epoch: first_epoch.max(1),
        }
    }

    /// The epoch the logs belong to. A resumed run starts after epoch 1, so only the epoch
    /// burn-train mislabels as 1 can be 1 here.
    fn epoch(&self, epoch: usize) -> usize {
        if epoch == 1 {
            self.first_epoch
        } else {
            epoch
        }
    }
}

impl MetricLogger for ResumedFileLogger {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let epoch = self.epoch(epoch);
        self.inner.log(update, epoch, split);
    }

    fn read_numeric(&mut self, name: &str, epoch: usize, split: &Split) -> Result<Vec<NumericEntry>, String> {
        let epoch = self.epoch(epoch);
        self.inner.read_numeric(name, epoch, split)
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.inner.log_metric_definition(definition);
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        self.inner.log_epoch_summary(summary);
    }
}
