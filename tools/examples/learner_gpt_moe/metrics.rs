//! The expert-load imbalance as a burn-train metric, and a renderer that prints one line every
//! few steps on rank 0 and nothing on the others.

use std::collections::HashMap;
use std::sync::Arc;

use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricDefinition, MetricId, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// The metric's name, and its log file's (`Expert_load_imbalance.log`).
pub const IMBALANCE: &str = "Expert load imbalance";

/// One step's imbalance: the most loaded expert's assignments over the mean, averaged over the
/// MoE layers (1 is perfectly even; `n_experts` is every token on one expert).
#[derive(Debug, Clone, Copy)]
pub struct ImbalanceInput {
    value: f64,
}

impl ImbalanceInput {
    /// The step's value.
    pub fn new(value: f64) -> Self {
        Self { value }
    }
}

/// The expert-load imbalance of the MoE layers, step by step and averaged over the epoch.
#[derive(Clone)]
pub struct ImbalanceMetric {
    name: MetricName,
    state: NumericMetricState,
}

impl ImbalanceMetric {
    /// An empty metric.
    pub fn new() -> Self {
        Self {
            name: Arc::new(IMBALANCE.to_string()),
            state: NumericMetricState::new(),
        }
    }
}

impl Metric for ImbalanceMetric {
    type Input = ImbalanceInput;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn description(&self) -> Option<String> {
        Some("most loaded expert's assignments over the mean, averaged over the MoE layers".into())
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("x".into()),
            higher_is_better: false,
        }
        .into()
    }

    fn update(&mut self, item: &ImbalanceInput, _metadata: &MetricMetadata) -> SerializedEntry {
        self.state
            .update(item.value, 1, FormatOptions::new(self.name()).precision(3))
    }

    fn clear(&mut self) {
        self.state.reset();
    }
}

impl Numeric for ImbalanceMetric {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}

/// Prints `epoch E/N train step I (windows done/total) | Loss ... | Expert load imbalance ...` every `every` steps and at
/// the end of each epoch's training and validation; silent when `every` is 0 (the other ranks:
/// every rank runs its own Learner, and their lines would interleave).
pub struct LineRenderer {
    every: usize,
    names: HashMap<MetricId, String>,
    latest: Vec<(String, String)>,
}

impl LineRenderer {
    /// A renderer printing every `every` steps (0: never).
    pub fn new(every: usize) -> Self {
        Self {
            every,
            names: HashMap::new(),
            latest: Vec::new(),
        }
    }

    fn record(&mut self, split: &str, state: MetricState) {
        let entry = match state {
            MetricState::Generic(entry) | MetricState::Numeric(entry, _) => entry,
        };
        let Some(name) = self.names.get(&entry.metric_id) else {
            return;
        };
        let key = format!("{split} {name}");
        let text = entry.serialized_entry.formatted;
        match self.latest.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = text,
            None => self.latest.push((key, text)),
        }
    }

    fn print(&self, split: &str, item: &TrainingProgress) {
        let Some(progress) = &item.progress else {
            return;
        };
        let last = progress.items_processed >= progress.items_total;
        let due = item.iteration.is_some_and(|i| i % self.every.max(1) == 0);
        if self.every == 0 || !(due || last) {
            return;
        }
        let metrics: Vec<String> = self
            .latest
            .iter()
            .filter(|(k, _)| k.starts_with(split))
            .map(|(k, v)| format!("{} {v}", &k[split.len() + 1..]))
            .collect();
        println!(
            "epoch {}/{} {split} step {} ({}/{} windows) | {}",
            item.global_progress.items_processed,
            item.global_progress.items_total,
            item.iteration.unwrap_or(0),
            progress.items_processed,
            progress.items_total,
            metrics.join(" | ")
        );
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.record("train", state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record("valid", state);
    }

    fn render_train(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        self.print("train", &item);
    }

    fn render_valid(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        self.print("valid", &item);
    }
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
