//! Expert parallelism on threads: the all-to-all, failure handling, determinism.

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use mpipemoe::comm::GroupOptions;
use mpipemoe::harness::{check_case, Case, CheckOptions};
use mpipemoe::{ExchangePath, LocalGroup, MoeError, MoeLayerConfig, Partitions, Strategy};
use proptest::prelude::*;

type B = Autodiff<NdArray>;

fn short() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_millis(400),
    }
}

/// Row `i` sent by `src` to `dst` is identified by its bytes (src, dst, i).
fn row(src: usize, dst: usize, i: usize) -> [u8; 3] {
    [src as u8, dst as u8, i as u8]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every row arrives exactly once, at the right rank, grouped by source in source order
    /// and in send order within a source; sending the result back restores the input.
    #[test]
    fn all_to_all_v_delivers_every_row_once_and_reverses(
        n_ranks in 1usize..5,
        counts in prop::collection::vec(0usize..5, 16),
    ) {
        let count = |src: usize, dst: usize| counts[(src * 4 + dst) % counts.len()];
        let results = LocalGroup::run(n_ranks, |ctx| {
            let me = ctx.rank;
            let send_counts: Vec<usize> = (0..n_ranks).map(|dst| count(me, dst)).collect();
            let send: Vec<u8> = (0..n_ranks).flat_map(|dst| (0..count(me, dst)).flat_map(move |i| row(me, dst, i))).collect();
            let (recv, recv_counts) = ctx.comm.all_to_all_v(&send, 3, &send_counts)?;
            let (back, back_counts) = ctx.comm.all_to_all_v(&recv, 3, &recv_counts)?;
            Ok((send, recv, recv_counts, back, back_counts, send_counts))
        }).unwrap();
        for (me, (send, recv, recv_counts, back, back_counts, send_counts)) in results.into_iter().enumerate() {
            let want: Vec<u8> = (0..n_ranks).flat_map(|src| (0..count(src, me)).flat_map(move |i| row(src, me, i))).collect();
            prop_assert_eq!(&recv, &want);
            prop_assert_eq!(recv_counts, (0..n_ranks).map(|src| count(src, me)).collect::<Vec<_>>());
            prop_assert_eq!(back, send);
            prop_assert_eq!(back_counts, send_counts);
        }
    }
}

#[test]
fn counts_gather_and_reduce_agree_on_every_rank() {
    let results = LocalGroup::run(3, |ctx| {
        let gathered = ctx.comm.all_gather_counts(&[ctx.rank, 10 + ctx.rank])?;
        let exchanged = ctx
            .comm
            .all_to_all_counts(&[ctx.rank * 10, ctx.rank * 10 + 1, ctx.rank * 10 + 2], 1)?;
        let mut values = [0.1 * ctx.rank as f64, 1.0];
        ctx.comm.all_reduce_sum(&mut values)?;
        ctx.comm.barrier()?;
        Ok((gathered, exchanged, values))
    })
    .unwrap();
    for (rank, (gathered, exchanged, values)) in results.into_iter().enumerate() {
        assert_eq!(gathered, vec![0, 10, 1, 11, 2, 12]);
        assert_eq!(exchanged, vec![rank, 10 + rank, 20 + rank]);
        assert_eq!(values, [0.1 + 0.2, 3.0]);
    }
}

fn expect_comm_error(result: &mpipemoe::Result<()>, naming: &str) {
    match result {
        Err(MoeError::Comm { reason, .. }) => assert!(reason.contains(naming), "{reason}"),
        other => panic!("expected a comm error naming {naming}, got {other:?}"),
    }
}

/// A peer's echo of another rank's failure is classified by its type, and names the rank.
fn expect_peer_failure(result: &mpipemoe::Result<()>, failed: usize) {
    match result {
        Err(e @ MoeError::PeerFailed { peer, .. }) => {
            assert_eq!(*peer, failed, "{e}");
            assert!(e.is_peer_failure());
            assert!(e.to_string().contains(&format!("rank {failed} failed")), "{e}");
        }
        other => panic!("expected a peer failure naming rank {failed}, got {other:?}"),
    }
}

#[test]
fn a_rank_that_errors_mid_exchange_fails_the_others_promptly() {
    let start = Instant::now();
    let results = LocalGroup::run_each(
        GroupOptions {
            timeout: Duration::from_secs(30),
        },
        3,
        |ctx| {
            ctx.comm.barrier()?;
            if ctx.rank == 1 {
                return Err(MoeError::Input("rank 1 gave up".into()));
            }
            ctx.comm.all_to_all_v(&[], 4, &[0, 0, 0]).map(|_| ())
        },
    );
    // Far below the 30 s timeout: the failure is propagated, not waited out.
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(matches!(results[1], Err(MoeError::Input(_))));
    expect_peer_failure(&results[0], 1);
    expect_peer_failure(&results[2], 1);
    // `run` reports the root cause, not a peer's echo of it.
    let root = LocalGroup::run(2, |ctx| {
        if ctx.rank == 0 {
            Err(MoeError::Input("boom".into()))
        } else {
            ctx.comm.barrier()
        }
    });
    assert!(matches!(root, Err(MoeError::Input(_))));
}

#[test]
fn a_rank_that_panics_fails_the_others() {
    let results = LocalGroup::run_each(short(), 2, |ctx| {
        if ctx.rank == 0 {
            panic!("rank 0 exploded");
        }
        ctx.comm.barrier()
    });
    match &results[0] {
        Err(e) => assert!(e.to_string().contains("rank 0 exploded"), "{e}"),
        Ok(_) => panic!("rank 0 should fail"),
    }
    expect_peer_failure(&results[1], 0);
}

#[test]
fn a_missing_rank_times_out_by_name() {
    let start = Instant::now();
    let results = LocalGroup::run_each(short(), 3, |ctx| {
        if ctx.rank == 2 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        ctx.comm.barrier()
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    // Whichever of ranks 0 and 1 times out first names rank 2; the other either times out
    // the same way or reports that failure as a peer's.
    let timed_out = results[..2]
        .iter()
        .filter(|r| matches!(r, Err(MoeError::Comm { reason, .. }) if reason.contains("rank(s) [2]")))
        .count();
    assert!(timed_out >= 1, "{results:?}");
    assert!(results[..2].iter().all(|r| r.is_err()), "{results:?}");
}

#[test]
fn a_rank_that_finishes_early_is_named() {
    let results = LocalGroup::run_each(
        GroupOptions {
            timeout: Duration::from_secs(30),
        },
        2,
        |ctx| {
            if ctx.rank == 1 {
                return Ok(());
            }
            ctx.comm.barrier()
        },
    );
    expect_comm_error(&results[0], "rank 1 finished without joining");
}

#[test]
fn ranks_calling_different_collectives_fail() {
    let results = LocalGroup::run_each(short(), 2, |ctx| {
        if ctx.rank == 0 {
            ctx.comm.barrier()
        } else {
            ctx.comm.all_gather_counts(&[1]).map(|_| ())
        }
    });
    assert!(results.iter().all(|r| r.is_err()));
    assert!(results
        .iter()
        .any(|r| matches!(r, Err(MoeError::Comm { reason, .. }) if reason.contains("another called"))));
}

#[test]
fn a_rank_that_fails_before_backward_fails_its_peers_in_backward() {
    let device = Default::default();
    let config = MoeLayerConfig::new(8, 12, 4, 2).with_partitions(Partitions::Fixed(2));
    let results = LocalGroup::run_each(short(), 2, |ctx| {
        let layer = config.init_rank::<B>(&device, ctx.comm.clone())?;
        let x = Tensor::<B, 2>::random([6, 8], burn::tensor::Distribution::Default, &device).require_grad();
        let out = layer.try_forward(x)?;
        if ctx.rank == 1 {
            return Err(MoeError::Input("rank 1 stops before backward".into()));
        }
        // Rank 0's exchange backward waits for rank 1 in an all-to-all and must not hang.
        let _ = out.output.sum().backward();
        Ok(())
    });
    expect_peer_failure(&results[0], 1);
}

#[test]
fn results_are_bitwise_identical_run_to_run() {
    let device = Default::default();
    let config = MoeLayerConfig::new(8, 12, 4, 2)
        .with_bias(true)
        .with_capacity_factor(Some(1.0));
    let case = Case::generate("determinism", &config, 23, 8).unwrap();
    for n_ranks in [2, 4] {
        for (path, strategy) in [
            (ExchangePath::Reference, Strategy::None),
            (ExchangePath::Fused, Strategy::S3),
        ] {
            let options = CheckOptions {
                path,
                n_ranks,
                partitions: Partitions::Fixed(3),
                strategy,
                memory_budget: None,
                executor: None,
            };
            let a = check_case::<B>(&case, &options, &device).unwrap();
            let b = check_case::<B>(&case, &options, &device).unwrap();
            for (name, values) in &a.tensors {
                let same = values
                    .iter()
                    .zip(&b.tensors[name])
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{name} differs between two runs ({options:?})");
            }
        }
    }
}

#[test]
fn n_experts_not_divisible_by_ranks_names_both_numbers() {
    let device = Default::default();
    let config = MoeLayerConfig::new(8, 12, 6, 2);
    let err = LocalGroup::run(4, |ctx| {
        config.init_rank::<B>(&device, ctx.comm.clone()).map(|_| ())
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("6 experts") && text.contains("4 ranks"), "{text}");
    let case = Case::generate("six", &config, 4, 1).unwrap();
    let err = check_case::<B>(
        &case,
        &CheckOptions {
            n_ranks: 4,
            ..CheckOptions::default()
        },
        &device,
    )
    .unwrap_err();
    assert!(err.to_string().contains("6 experts"));
}
