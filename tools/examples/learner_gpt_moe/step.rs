//! The toy GPT-MoE as burn-train wants a model: batches, a training step that returns summed
//! gradients, an inference step, and an output the metrics read.

use burn::backend::Flex;
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData, Transaction};
use burn::train::metric::{Adaptor, LossInput};
use burn::train::{InferenceStep, ItemLazy, TrainOutput, TrainStep};
use mpipemoe::parallel::ParallelGroups;
use mpipemoe::MoeBackend;

use super::metrics::ImbalanceInput;
use super::model::{cross_entropy_sum, GptMoe};

/// A batch of this rank's windows: bytes `0..seq` predict bytes `1..seq + 1`.
#[derive(Clone, Debug)]
pub struct LmBatch<B: Backend> {
    /// `[batch, seq]`
    pub inputs: Tensor<B, 2, Int>,
    /// `[batch, seq]`
    pub targets: Tensor<B, 2, Int>,
}

/// Turns windows of `seq + 1` bytes into [`LmBatch`]es.
#[derive(Clone, Debug)]
pub struct LmBatcher;

impl<B: Backend> Batcher<B, Vec<u8>, LmBatch<B>> for LmBatcher {
    fn batch(&self, windows: Vec<Vec<u8>>, device: &B::Device) -> LmBatch<B> {
        let rows = windows.len();
        let seq = windows.first().map_or(0, |w| w.len().saturating_sub(1));
        let ids = |range: std::ops::Range<usize>| {
            let values: Vec<i64> = windows
                .iter()
                .flat_map(|w| w[range.clone()].iter().map(|&b| b as i64))
                .collect();
            Tensor::from_data(
                TensorData::new(values, [rows, seq]).convert::<B::IntElem>(),
                device,
            )
        };
        LmBatch {
            inputs: ids(0..seq),
            targets: ids(1..seq + 1),
        }
    }
}

/// What one step tells the metrics.
pub struct LmOutput<B: Backend> {
    /// This rank's mean cross-entropy, nats per byte. `[1]`
    pub loss: Tensor<B, 1>,
    /// Mean over the MoE layers of the most loaded expert's assignments over the mean, over the
    /// global batch.
    pub imbalance: f64,
}

impl<B: Backend> ItemLazy for LmOutput<B> {
    type ItemSync = LmOutput<Flex>;

    fn sync(self) -> LmOutput<Flex> {
        let [loss] = Transaction::default()
            .register(self.loss)
            .execute()
            .try_into()
            .expect("one tensor registered, one read");
        LmOutput {
            loss: Tensor::from_data(loss, &Default::default()),
            imbalance: self.imbalance,
        }
    }
}

impl<B: Backend> Adaptor<LossInput<B>> for LmOutput<B> {
    fn adapt(&self) -> LossInput<B> {
        LossInput::new(self.loss.clone())
    }
}

impl<B: Backend> Adaptor<ImbalanceInput> for LmOutput<B> {
    fn adapt(&self) -> ImbalanceInput {
        ImbalanceInput::new(self.imbalance)
    }
}

/// The toy GPT-MoE and the groups its gradients are summed over.
///
/// burn-train's `Learner` calls [`TrainStep::step`] on every rank's own copy; the step sums the
/// gradients over the ranks ([`ParallelGroups::sync_grads`]: replicated parameters over the
/// world, experts over their data-parallel replicas) before it returns them, so every rank's
/// optimizer takes the step the one-rank model would take.
#[derive(Module, Debug)]
pub struct LmModel<B: Backend> {
    /// The model.
    pub gpt: GptMoe<B>,
    #[module(skip)]
    groups: ParallelGroups,
}

impl<B: Backend> LmModel<B> {
    /// Wraps `gpt`, whose MoE layers were built for `groups`.
    pub fn new(gpt: GptMoe<B>, groups: ParallelGroups) -> Self {
        Self { gpt, groups }
    }
}

impl<B: MoeBackend> LmModel<B> {
    /// The training loss of `batch` on this rank (its share of the global mean: summed over
    /// the ranks it is the mean cross-entropy of the global batch plus the auxiliary losses)
    /// and what the metrics read.
    ///
    /// # Panics
    /// If an MoE layer fails (a communicator error, or a record loaded from other experts):
    /// burn-train's steps cannot return errors, so the message names the rank and the cause.
    fn loss(&self, batch: LmBatch<B>) -> (Tensor<B, 1>, LmOutput<B>) {
        let world = self.groups.world();
        let [rows, seq] = batch.inputs.dims();
        let out = self.gpt.forward(batch.inputs).unwrap_or_else(|e| {
            panic!(
                "rank {} of {}: the MoE forward failed: {e}",
                world.rank(),
                world.n_ranks()
            )
        });
        let ce_sum = cross_entropy_sum(out.logits, batch.targets);
        let local_tokens = (rows * seq) as f64;
        let global_tokens = local_tokens * world.n_ranks() as f64;
        let loss = ce_sum.clone() / global_tokens + out.aux;
        let imbalance =
            out.stats.iter().map(|s| s.load_imbalance).sum::<f64>() / out.stats.len().max(1) as f64;
        let output = LmOutput {
            loss: ce_sum.detach() / local_tokens,
            imbalance,
        };
        (loss, output)
    }
}

impl<B> TrainStep for LmModel<B>
where
    B: AutodiffBackend + MoeBackend,
    B::InnerBackend: MoeBackend,
{
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<LmOutput<B>> {
        let (loss, output) = self.loss(batch);
        let mut grads = GradientsParams::from_grads(loss.backward(), self);
        if let Err(e) = self.groups.sync_grads(self, &mut grads) {
            let world = self.groups.world();
            panic!(
                "rank {} of {}: the gradient sync failed: {e}",
                world.rank(),
                world.n_ranks()
            );
        }
        TrainOutput { grads, item: output }
    }
}

impl<B: MoeBackend> InferenceStep for LmModel<B> {
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> LmOutput<B> {
        self.loss(batch).1
    }
}
