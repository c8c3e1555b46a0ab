//! Expert parallelism on threads: the all-to-all, failure handling, determinism.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;
use mpipemoe::backend::HostStore;
use mpipemoe::comm::{
    host_all_to_all_v, host_all_to_all_v_into, post_all_to_all_v, GroupOptions, HostOffload, HostRows,
    OffloadPath, Offloaded, PeerLayout, PeerTransport, RowExchange, RowPaths, WithRowPaths,
};
use mpipemoe::harness::{check_case, check_case_through, Case, CheckOptions};
use mpipemoe::memory::Restore;
use mpipemoe::memory::Strategy;
use mpipemoe::{Communicator, ExchangePath, LocalGroup, MoeError, MoeLayerConfig, Partitions};
use proptest::prelude::*;

type B = Autodiff<NdArray>;

fn short() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_millis(400),
        ..GroupOptions::default()
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The device transports' posting logic (`PeerLayout` + `post_all_to_all_v`), run by the
    /// host twin, moves exactly the bytes of the host-bytes path, at 1–4 ranks with uneven and
    /// zero counts and rows of any width.
    #[test]
    fn posted_all_to_all_matches_the_host_bytes_path(
        n_ranks in 1usize..5,
        counts in prop::collection::vec(0usize..6, 16),
        row_bytes in 1usize..9,
    ) {
        let count = |src: usize, dst: usize| counts[(src * 4 + dst) % counts.len()];
        let results = LocalGroup::run(n_ranks, |ctx| {
            let me = ctx.rank;
            let send_counts: Vec<usize> = (0..n_ranks).map(|dst| count(me, dst)).collect();
            let recv_counts: Vec<usize> = (0..n_ranks).map(|src| count(src, me)).collect();
            let total: usize = send_counts.iter().sum();
            let send: Vec<u8> = (0..total * row_bytes).map(|b| (b * 31 + me * 7 + 1) as u8).collect();
            let (host, host_counts) = ctx.comm.all_to_all_v(&send, row_bytes, &send_counts)?;
            let posted = host_all_to_all_v(ctx.comm.as_ref(), "posted", &send, row_bytes, &send_counts, &recv_counts)?;
            // Into a caller's buffer of stale bytes (CUDA's page-locked one): every byte is
            // written, and a buffer of another size is refused before anything is posted.
            let layout = PeerLayout::new(&send_counts, &recv_counts, row_bytes)?;
            let mut into = vec![0xA5u8; posted.len()];
            host_all_to_all_v_into(ctx.comm.as_ref(), "into", &send, &layout, &mut into)?;
            let mut long = vec![0u8; posted.len() + 1];
            let refused = host_all_to_all_v_into(ctx.comm.as_ref(), "long", &send, &layout, &mut long)
                .is_err_and(|e| e.to_string().contains(&format!("a {}-byte receive buffer", posted.len() + 1)));
            Ok((host, host_counts, posted, recv_counts, into, refused))
        }).unwrap();
        for (host, host_counts, posted, recv_counts, into, refused) in results {
            prop_assert_eq!(host_counts, recv_counts);
            prop_assert_eq!(&posted, &host);
            prop_assert_eq!(into, host);
            prop_assert!(refused, "a receive buffer of the wrong size was taken");
        }
    }
}

/// Records what a device transport would be asked to do; with `fail_on`, the post whose
/// record starts with it fails, as a device transport's post can (NCCL's invalid argument, a
/// CUDA error).
#[derive(Default)]
struct Recorder {
    calls: Vec<String>,
    fail_on: Option<&'static str>,
    /// Groups open on this "thread", as NCCL counts them.
    depth: i32,
}

impl Recorder {
    fn failing_on(what: &'static str) -> Self {
        Self {
            fail_on: Some(what),
            ..Self::default()
        }
    }

    fn record(&mut self, call: String) -> mpipemoe::Result<()> {
        let fails = self.fail_on.is_some_and(|f| call.starts_with(f));
        self.calls.push(call);
        if fails {
            return Err(mpipemoe::MoeError::comm(
                "posted",
                0,
                "the transport refused a post",
            ));
        }
        Ok(())
    }
}

impl PeerTransport for Recorder {
    fn begin(&mut self) -> mpipemoe::Result<()> {
        self.depth += 1;
        self.record("begin".into())
    }
    fn send(&mut self, peer: usize, bytes: Range<usize>) -> mpipemoe::Result<()> {
        self.record(format!("send {peer} {bytes:?}"))
    }
    fn recv(&mut self, peer: usize, bytes: Range<usize>) -> mpipemoe::Result<()> {
        self.record(format!("recv {peer} {bytes:?}"))
    }
    fn copy_local(&mut self, from: Range<usize>, to: Range<usize>) -> mpipemoe::Result<()> {
        self.record(format!("copy {from:?} -> {to:?}"))
    }
    fn end(&mut self) -> mpipemoe::Result<()> {
        self.depth -= 1;
        self.record("end".into())
    }
    fn abandon(&mut self) {
        self.depth -= 1;
        self.calls.push("abandon".into());
    }
}

/// A post that fails inside the group closes the group (`abandon`) before the error returns,
/// whichever post fails; no `end` is called for a group that did not post everything, and the
/// next group on the same transport opens at depth one, not nested.
#[test]
fn a_failing_post_closes_its_group() {
    // Rank 1 of 3: a local copy, a send to 0, a receive from 2.
    let layout = PeerLayout::new(&[2, 1, 0], &[0, 1, 3], 4).unwrap();
    for fail_on in ["copy", "send", "recv"] {
        let mut rec = Recorder::failing_on(fail_on);
        let err = post_all_to_all_v(&mut rec, 1, &layout).unwrap_err();
        assert!(err.to_string().contains("refused a post"), "{err}");
        assert_eq!(rec.depth, 0, "{fail_on}: the group is left open: {:?}", rec.calls);
        assert_eq!(rec.calls.last().map(String::as_str), Some("abandon"), "{fail_on}");
        assert!(
            !rec.calls.iter().any(|c| c == "end"),
            "{fail_on}: {:?}",
            rec.calls
        );
        rec.fail_on = None;
        post_all_to_all_v(&mut rec, 1, &layout).unwrap();
        assert_eq!(rec.depth, 0, "{fail_on}: {:?}", rec.calls);
    }
}

/// What NCCL is asked for, spelled out: byte offsets per peer, own rows as a local copy,
/// nothing posted for an empty pair, and every bad layout refused before anything is posted.
#[test]
fn the_posts_are_per_peer_byte_ranges_with_empty_pairs_skipped() {
    // Rank 1 of 3, rows of 4 bytes: sends 2, 1, 0 rows; receives 0, 1, 3 rows.
    let layout = PeerLayout::new(&[2, 1, 0], &[0, 1, 3], 4).unwrap();
    assert_eq!((layout.send_bytes(), layout.recv_bytes()), (12, 16));
    let mut rec = Recorder::default();
    post_all_to_all_v(&mut rec, 1, &layout).unwrap();
    assert_eq!(
        rec.calls,
        [
            "begin",
            "copy 8..12 -> 0..4",
            "send 0 0..8",
            "recv 2 4..16",
            "end"
        ]
    );

    let mut rec = Recorder::default();
    assert!(
        post_all_to_all_v(&mut rec, 3, &layout).is_err(),
        "rank outside the layout"
    );
    let uneven_self = PeerLayout::new(&[1, 2], &[1, 1], 4).unwrap();
    assert!(
        post_all_to_all_v(&mut rec, 1, &uneven_self).is_err(),
        "own rows must match"
    );
    assert!(
        rec.calls.is_empty(),
        "nothing posted for a refused layout: {:?}",
        rec.calls
    );
    assert!(PeerLayout::new(&[1, 2], &[1], 4).is_err());
    let err = PeerLayout::new(&[usize::MAX / 2, 3], &[0, 0], 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("overflow"), "{err}");
}

/// The host twin checks what a device transport cannot: a peer sending more or fewer rows
/// than this rank's plan expects is an error naming the peer.
#[test]
fn a_receive_count_that_disagrees_with_the_sender_is_an_error() {
    let results = LocalGroup::run_each(short(), 2, |ctx| {
        // Rank 0 sends one row to rank 1, but rank 1 expects two.
        let (send_rows, recv_rows) = if ctx.rank == 0 {
            ([0, 1], [0, 0])
        } else {
            ([0, 0], [2, 0])
        };
        let send = vec![7u8; send_rows.iter().sum::<usize>() * 4];
        host_all_to_all_v(ctx.comm.as_ref(), "mismatch", &send, 4, &send_rows, &recv_rows).map(|_| ())
    });
    let err = results[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("rank 0 sent 4 bytes, the plan expected 8"), "{err}");
}

/// A row path that counts its calls and hands them to the host twin.
#[derive(Debug, Default)]
struct Counted(AtomicUsize);

impl RowExchange<NdArray> for Counted {
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: FloatTensor<NdArray>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> mpipemoe::Result<FloatTensor<NdArray>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        RowExchange::<NdArray>::all_to_all(&HostRows, comm, x, send_rows, recv_rows)
    }
}

impl OffloadPath<NdArray> for Counted {
    fn offload(
        &self,
        x: FloatTensor<NdArray>,
        host: &HostStore,
    ) -> mpipemoe::Result<Arc<dyn Offloaded<NdArray>>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        OffloadPath::<NdArray>::offload(&HostOffload, x, host)
    }
}

/// The fused exchange takes a communicator's own paths when it has them for the backend (how
/// NCCL keeps rows on the device and CUDA offloads to pinned memory): every case, through the
/// host twins of both paths, at 2 and 3 ranks, n 1 to 3 and every strategy, matches the case
/// and is bit-identical to the plain path, and both paths are really taken (two all-to-alls
/// per partition each way, an offload wherever the strategy offloads).
#[test]
fn the_fused_exchange_moves_rows_through_the_communicators_row_path() {
    let device = Default::default();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cases");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    for file in &files {
        let case = Case::load(file).unwrap();
        for (n_ranks, n, strategy) in [
            (2, 1, Strategy::None),
            (2, 3, Strategy::S2),
            (3, 3, Strategy::S4),
            (2, 2, Strategy::S1),
            (3, 2, Strategy::S3),
        ] {
            if !case.config.n_experts.is_multiple_of(n_ranks) {
                continue;
            }
            let options = CheckOptions {
                path: ExchangePath::Fused,
                n_ranks,
                partitions: Partitions::Fixed(n),
                strategy,
                ..CheckOptions::default()
            };
            let counted = Arc::new(Counted::default());
            let offloads = Arc::new(Counted::default());
            let paths = RowPaths::new()
                .with::<NdArray>(counted.clone())
                .with_offload::<NdArray>(offloads.clone());
            let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
                Arc::new(WithRowPaths::new(comm, paths.clone()))
            };
            let through = check_case_through::<B>(&case, &options, &device, &wrap).unwrap();
            let plain = check_case::<B>(&case, &options, &device).unwrap();
            let what = format!("{} ranks {n_ranks} n {n} {strategy:?}", case.name);
            assert!(through.passed(1e-4), "{what}: {:?}", through.worst());
            assert!(
                counted.0.load(Ordering::Relaxed) >= 4 * n_ranks,
                "{what}: row path not taken"
            );
            let offloading =
                strategy.dispatched() == Restore::Offload || strategy.hidden() == Restore::Offload;
            assert_eq!(
                offloads.0.load(Ordering::Relaxed) > 0,
                offloading,
                "{what}: offload path taken wrongly"
            );
            for (name, values) in &plain.tensors {
                let same = values
                    .iter()
                    .zip(&through.tensors[name])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: {name} differs from the host-bytes path");
            }
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

/// The broadcast copies the root's values to every rank and leaves the root's own alone, for
/// every root; through the tensor path (`broadcast_tensor`, the host path here) a bf16 tensor
/// arrives in its dtype; a root outside the group and a length that differs from the root's
/// are errors naming them.
#[test]
fn broadcast_copies_the_roots_values_to_every_rank() {
    use burn::backend::Flex;
    use burn::tensor::{DType, TensorData, TensorPrimitive};
    use mpipemoe::comm::broadcast_tensor;
    let results = LocalGroup::run(3, |ctx| {
        let mut seen = Vec::new();
        for root in 0..3 {
            let mut values: Vec<f32> = (0..5).map(|i| (10 * ctx.rank + i) as f32).collect();
            ctx.comm.broadcast_f32(root, &mut values)?;
            seen.push(values);
        }
        let device = Default::default();
        let data = TensorData::new(vec![ctx.rank as f32 + 0.5; 4], [2, 2]);
        // Flex holds a bf16 tensor as bf16 (NdArray stores its own float type).
        let x = Tensor::<Flex, 2>::from_data(data, &device).cast(DType::BF16);
        assert_eq!(x.dtype(), DType::BF16);
        let out = broadcast_tensor::<Flex>(ctx.comm.as_ref(), x.into_primitive().tensor(), 2)?;
        let out = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(out)).into_data();
        Ok((seen, out.dtype, out.convert::<f32>().to_vec::<f32>().unwrap()))
    })
    .unwrap();
    for (seen, dtype, tensor) in results {
        for (root, values) in seen.into_iter().enumerate() {
            let want: Vec<f32> = (0..5).map(|i| (10 * root + i) as f32).collect();
            assert_eq!(values, want, "root {root}");
        }
        assert_eq!((dtype, tensor), (DType::BF16, vec![2.5; 4]));
    }
    let bad_root = LocalGroup::run_each(short(), 2, |ctx| ctx.comm.broadcast_f32(2, &mut [1.0]));
    bad_root
        .iter()
        .for_each(|r| expect_comm_error(r, "root 2 is not a rank of 2"));
    let bad_len = LocalGroup::run_each(short(), 2, |ctx| {
        ctx.comm.broadcast_f32(0, &mut vec![1.0; 3 + ctx.rank])
    });
    expect_comm_error(&bad_len[1], "root 0 sent 3 values where this rank has 4");
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
            ..GroupOptions::default()
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
            ..GroupOptions::default()
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
                ..CheckOptions::default()
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

/// `threads_per_rank` (issue 45): each rank's closure runs on a rayon pool of its own with
/// that many threads, so its kernels cannot borrow another rank's cores; 0 is refused by name.
#[test]
fn each_rank_computes_on_a_pool_of_its_own() {
    // Three threads each: neither the global pool's size here (the machine's cores) nor one.
    let options = GroupOptions {
        threads_per_rank: Some(3),
        ..GroupOptions::default()
    };
    let seen = LocalGroup::run_with(options, 2, |ctx| {
        let name = std::thread::current().name().unwrap_or_default().to_string();
        Ok((
            ctx.rank,
            rayon::current_num_threads(),
            rayon::current_thread_index(),
            name,
        ))
    })
    .unwrap();
    for (rank, threads, index, name) in seen {
        assert_eq!(threads, 3, "rank {rank}");
        assert!(index.is_some(), "rank {rank} runs outside its pool");
        assert!(
            name.starts_with(&format!("rank{rank}-compute")),
            "rank {rank} on thread {name}"
        );
    }
    let zero = GroupOptions {
        threads_per_rank: Some(0),
        ..GroupOptions::default()
    };
    let err = LocalGroup::run_with(zero, 2, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("threads_per_rank"), "{err}");
}

/// Rank 0 "writes a checkpoint" for longer than the transfer timeout while the other ranks
/// wait for it: an arrival barrier (its own, longer bound) lets them, where a plain barrier
/// (the transfer timeout) fails the run that succeeded.
#[test]
fn an_arrival_barrier_outlasts_the_transfer_timeout() {
    let options = GroupOptions {
        timeout: Duration::from_millis(200),
        arrival_timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    };
    let save = Duration::from_millis(1200);
    let run = |arrival: bool| {
        LocalGroup::run_with(options, 3, |ctx| {
            if ctx.rank == 0 {
                std::thread::sleep(save);
            }
            match arrival {
                true => ctx.comm.arrival_barrier(),
                false => ctx.comm.barrier(),
            }?;
            // The group is whole afterwards: a transfer still works under the short bound.
            let mut x = [ctx.rank as f64];
            ctx.comm.all_reduce_sum(&mut x)?;
            Ok(x[0])
        })
    };
    assert_eq!(run(true).unwrap(), vec![3.0; 3]);
    let err = run(false).unwrap_err().to_string();
    assert!(err.contains("timed out") && err.contains("[0]"), "{err}");
}

/// The arrival bound still ends a wait for a rank that never comes (named), and a rank
/// that fails while the others wait in an arrival barrier is reported at once, not at the
/// bound.
#[test]
fn an_arrival_barrier_is_bounded_and_hears_of_failures_at_once() {
    let options = GroupOptions {
        timeout: Duration::from_millis(100),
        arrival_timeout: Duration::from_millis(800),
        ..GroupOptions::default()
    };
    let start = Instant::now();
    let results = LocalGroup::run_each(options, 2, |ctx| {
        if ctx.rank == 1 {
            // Stuck far longer than the arrival bound.
            std::thread::sleep(Duration::from_millis(2500));
            return Ok(());
        }
        ctx.comm.arrival_barrier()
    });
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("timed out after 800") && err.contains("[1]"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));

    let options = GroupOptions {
        arrival_timeout: Duration::from_secs(60),
        ..options
    };
    let start = Instant::now();
    let results = LocalGroup::run_each(options, 2, |ctx| {
        if ctx.rank == 1 {
            std::thread::sleep(Duration::from_millis(200));
            return Err(MoeError::Input("rank 1 could not write its shard".into()));
        }
        ctx.comm.arrival_barrier()
    });
    let err = results[0].as_ref().unwrap_err();
    assert!(err.is_peer_failure(), "{err}");
    assert!(err.to_string().contains("could not write its shard"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
}

/// The shadowing cost model prices a shadow's broadcast by whether the backend has a device
/// path: a path registered for the inner backend (NCCL's for `CudaMoe`) must be seen through
/// `Autodiff<..>`, which hands the broadcast to its inner backend, or training would price
/// NCCL as the host broadcast.
#[test]
fn a_device_reduce_is_seen_through_autodiff() {
    use mpipemoe::comm::HostReduce;
    use mpipemoe::MoeBackend;
    let bare: Arc<dyn Communicator> = LocalGroup::communicators(GroupOptions::default(), 1)
        .pop()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .unwrap();
    let plain = WithRowPaths::new(bare.clone(), RowPaths::new());
    assert!(!<NdArray as MoeBackend>::has_device_reduce(&plain));
    assert!(!<Autodiff<NdArray> as MoeBackend>::has_device_reduce(&plain));
    let reduce: Arc<dyn mpipemoe::comm::TensorReduce<NdArray>> = Arc::new(HostReduce);
    let with = WithRowPaths::new(bare, RowPaths::new().with_reduce::<NdArray>(reduce));
    assert!(<NdArray as MoeBackend>::has_device_reduce(&with));
    assert!(<Autodiff<NdArray> as MoeBackend>::has_device_reduce(&with));
}

/// Fallback paths fill only what a communicator lacks (`RowPaths::absent_from`): how CUDA's
/// page-locked host rows and offload join a group of thread ranks without replacing NCCL's
/// device rows where a communicator has them.
#[test]
fn fallback_paths_fill_only_what_a_communicator_lacks() {
    let own_rows = Arc::new(Counted::default());
    let fallback_rows = Arc::new(Counted::default());
    let fallback_offload = Arc::new(Counted::default());
    let own = RowPaths::new().with::<NdArray>(own_rows.clone());
    let fallback = RowPaths::new()
        .with::<NdArray>(fallback_rows.clone())
        .with_offload::<NdArray>(fallback_offload.clone());
    let same = |found: Option<Arc<dyn RowExchange<NdArray>>>, want: &Arc<Counted>| {
        found.is_some_and(|f| std::ptr::eq(Arc::as_ptr(&f) as *const (), Arc::as_ptr(want) as *const ()))
    };
    // Over a communicator with rows of its own: its rows stay, the offload is added.
    let merged = own.clone().merged(&fallback.clone().absent_from(&own));
    assert!(
        same(merged.get::<NdArray>(), &own_rows),
        "the communicator's own rows were replaced"
    );
    let offload = merged
        .offload::<NdArray>()
        .expect("the fallback offload is added");
    assert!(std::ptr::eq(
        Arc::as_ptr(&offload) as *const (),
        Arc::as_ptr(&fallback_offload) as *const ()
    ));
    // Over one without paths: both fallbacks.
    let bare = RowPaths::new().merged(&fallback.clone().absent_from(&RowPaths::new()));
    assert!(
        same(bare.get::<NdArray>(), &fallback_rows),
        "the fallback rows were not added"
    );
    assert!(bare.offload::<NdArray>().is_some());
    // Another backend's entry is not this backend's: a fallback for NdArray is added beside it.
    let other = RowPaths::new().with::<burn::backend::Flex>(Arc::new(FlexRows));
    let beside = other.clone().merged(&fallback.absent_from(&other));
    assert!(same(beside.get::<NdArray>(), &fallback_rows));
    assert!(beside.get::<burn::backend::Flex>().is_some());
}

#[derive(Debug)]
struct FlexRows;

impl RowExchange<burn::backend::Flex> for FlexRows {
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: FloatTensor<burn::backend::Flex>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> mpipemoe::Result<FloatTensor<burn::backend::Flex>> {
        RowExchange::<burn::backend::Flex>::all_to_all(&HostRows, comm, x, send_rows, recv_rows)
    }
}
