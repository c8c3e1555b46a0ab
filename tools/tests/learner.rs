//! The burn-train Learner example: it trains (the loss falls), several ranks' Learners compute
//! the one-rank model's losses, a run resumed from its checkpoint continues exactly as the
//! uninterrupted run, and a resume with another rank layout or swapped records is refused.
//!
//! The example's own modules are compiled in here, so this tests the code the README runs.

#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/data.rs"]
mod data;
#[path = "../examples/learner_gpt_moe/learner.rs"]
mod learner;
#[path = "../examples/learner_gpt_moe/logs.rs"]
mod logs;
#[path = "../examples/learner_gpt_moe/metrics.rs"]
mod metrics;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/model.rs"]
mod model;
#[path = "../examples/learner_gpt_moe/step.rs"]
mod step;

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use learner::{LearnerOptions, LearnerReport, PerEpoch};
use mpipemoe::{LocalGroup, MemoryReuse, Partitions};

/// A fresh folder for one run, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mpipemoe-learner-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn options(
    dir: &Path,
    epochs: usize,
    resume: Option<usize>,
    expert_parallel: Option<usize>,
) -> LearnerOptions {
    LearnerOptions {
        model: model::GptMoeConfig::new()
            .with_seq_len(32)
            .with_d_model(32)
            .with_d_hidden(64),
        epochs,
        steps_per_epoch: 10,
        batch: 8,
        lr: 3e-3,
        seed: 11,
        partitions: Partitions::Fixed(2),
        memory_reuse: MemoryReuse::Off,
        expert_parallel,
        eval_batches: 2,
        dir: dir.to_path_buf(),
        resume,
        keep_checkpoints: 4,
        print_every: 0,
    }
}

fn run(ranks: usize, options: &LearnerOptions) -> mpipemoe::Result<Vec<LearnerReport>> {
    let corpus = data::Corpus::builtin().unwrap();
    LocalGroup::run(ranks, |ctx| {
        learner::train_rank_with_learner::<Autodiff<Flex>>(&ctx, &corpus, options, &Default::default())
    })
}

/// Per epoch and step: the mean over the ranks of a metric (the global value: every rank has
/// as many tokens).
fn global(reports: &[LearnerReport], pick: fn(&LearnerReport) -> &PerEpoch) -> PerEpoch {
    pick(&reports[0])
        .iter()
        .enumerate()
        .map(|(e, (epoch, steps))| {
            let values = (0..steps.len())
                .map(|s| reports.iter().map(|r| pick(r)[e].1[s]).sum::<f64>() / reports.len() as f64)
                .collect();
            (*epoch, values)
        })
        .collect()
}

fn assert_close(what: &str, a: &[(usize, Vec<f64>)], b: &[(usize, Vec<f64>)], tolerance: f64) {
    assert_eq!(a.len(), b.len(), "{what}: epochs");
    for ((ea, va), (eb, vb)) in a.iter().zip(b) {
        assert_eq!(ea, eb, "{what}: epochs");
        assert_eq!(va.len(), vb.len(), "{what}, epoch {ea}: steps");
        for (step, (x, y)) in va.iter().zip(vb).enumerate() {
            let rel = (x - y).abs() / x.abs().max(1e-12);
            assert!(
                rel <= tolerance,
                "{what}, epoch {ea} step {step}: {x} vs {y} ({rel:e})"
            );
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

#[test]
fn learners_train_resume_exactly_and_agree_over_ranks() {
    // One rank, two epochs of the same ten batches: the loss falls.
    let one = Scratch::new("one");
    let reports = run(1, &options(&one.0, 2, None, None)).unwrap();
    let whole = &reports[0];
    let (first, second) = (&whole.train_loss[0].1, &whole.train_loss[1].1);
    assert_eq!((first.len(), second.len()), (10, 10));
    assert!(
        mean(second) < mean(first) - 0.5,
        "loss did not fall: epoch 1 {} -> epoch 2 {}",
        mean(first),
        mean(second)
    );
    assert!(whole.imbalance[0].1.iter().all(|&v| (1.0..=4.0).contains(&v)));

    // One epoch, then a second Learner resumed from its checkpoint: epoch 2's every step (the
    // first depends on the weights, the rest on AdamW's moments too) as without the break.
    let split = Scratch::new("split");
    let head = run(1, &options(&split.0, 1, None, None)).unwrap();
    assert_close(
        "epoch 1, interrupted run",
        &head[0].train_loss,
        &whole.train_loss[..1],
        1e-6,
    );
    let tail = run(1, &options(&split.0, 2, Some(1), None)).unwrap();
    assert_close(
        "resumed epoch 2",
        &tail[0].train_loss,
        &whole.train_loss[1..],
        1e-6,
    );
    assert_close(
        "resumed validation",
        &tail[0].valid_loss,
        &whole.valid_loss[1..],
        1e-6,
    );
    // The folder holds both epochs' logs under their own numbers: the resumed run wrote epoch
    // 2 beside epoch 1, not over it (burn-train 0.21 alone would write it into epoch-1/).
    let logged = learner::read_report(&learner::rank_dir(&split.0, 0), 1..=2).unwrap();
    assert_close("logged train loss", &logged.train_loss, &whole.train_loss, 1e-6);
    assert_close("logged validation", &logged.valid_loss, &whole.valid_loss, 1e-6);

    // Two ranks (expert parallel), and two ranks as one expert-parallel rank replicated twice
    // (data parallel): the mean of the ranks' losses is the one-rank model's loss.
    for (name, ep) in [("ep2", None), ("dp2", Some(1))] {
        let two = Scratch::new(name);
        let reports = run(2, &options(&two.0, 2, None, ep)).unwrap();
        assert_close(
            name,
            &global(&reports, |r| &r.train_loss),
            &whole.train_loss,
            1e-4,
        );
        assert_close(
            name,
            &global(&reports, |r| &r.valid_loss),
            &whole.valid_loss,
            1e-4,
        );
        if ep.is_some() {
            continue;
        }
        // Resuming the two-rank run on one rank is refused, naming both layouts.
        let err = run(1, &options(&two.0, 3, Some(2), None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("written by 2 rank(s)") && err.contains("this run has 1 rank(s)"),
            "{err}"
        );
        // Swapped records (rank 0's experts in rank 1's folder) are refused, naming both shards.
        let (a, b) = (
            learner::model_checkpoint(&two.0, 0, 2),
            learner::model_checkpoint(&two.0, 1, 2),
        );
        let swap = a.with_extension("swap");
        std::fs::rename(&a, &swap).unwrap();
        std::fs::rename(&b, &a).unwrap();
        std::fs::rename(&swap, &b).unwrap();
        let err = run(2, &options(&two.0, 3, Some(2), None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("experts 2..4") && err.contains("experts 0..2"),
            "{err}"
        );
        // A damaged checkpoint of one rank (the records back in place, rank 1's truncated):
        // the error that reaches the caller is that rank's own, naming the file, not rank 0's
        // word that another rank could not start.
        std::fs::rename(&a, &swap).unwrap();
        std::fs::rename(&b, &a).unwrap();
        std::fs::rename(&swap, &b).unwrap();
        std::fs::write(&b, &std::fs::read(&b).unwrap()[..64]).unwrap();
        let err = run(2, &options(&two.0, 3, Some(2), None))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&b.display().to_string()), "{err}");
    }
}
