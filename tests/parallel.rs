//! Training on many ranks: sub-groups and the f32 all-reduce of the communicators, the
//! gradient synchronisation of replicated and expert parameters against the same model on one
//! rank, expert × data parallelism, and records that know their experts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::record::{BinFileRecorder, FullPrecisionSettings};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::comm::{rank_range, GroupOptions};
use mpipemoe::parallel::{
    param_roles, path_id, sync_grads_of, sync_replicated_grads, with_path_ids, ParallelGroups, ParamRole,
};
use mpipemoe::{seeded_uniform, LocalGroup, MoeError, MoeLayer, MoeLayerConfig};

mod common;

type B = Autodiff<NdArray>;
type I = NdArray;

const D: usize = 8;
const N_TOKENS: usize = 12;
/// The first global rows also pass through `extra`: at 2 and 4 ranks they are all on rank 0,
/// so `extra` has no gradient on the other ranks.
const FLAGGED: usize = 2;

#[test]
fn sub_groups_reduce_among_their_members_only() {
    let sums = LocalGroup::run(4, |ctx| {
        let half = ctx.comm.split(ctx.rank % 2)?;
        assert_eq!((half.rank(), half.n_ranks()), (ctx.rank / 2, 2));
        // Lengths that leave some ranks' chunks empty, and one longer than the group.
        let mut short = [ctx.rank as f32 + 0.5];
        half.all_reduce_sum_f32(&mut short)?;
        let mut long: Vec<f32> = (0..7).map(|i| (i * 10 + ctx.rank) as f32).collect();
        half.all_reduce_sum_f32(&mut long)?;
        // The world still works after the split, and sub-groups of sub-groups.
        let mut world = [1.0f32; 3];
        ctx.comm.all_reduce_sum_f32(&mut world)?;
        let alone = half.split(half.rank())?;
        assert_eq!(alone.n_ranks(), 1);
        Ok((short[0], long, world))
    })
    .unwrap();
    for (rank, (short, long, world)) in sums.into_iter().enumerate() {
        // Members of rank r's half: r % 2 and r % 2 + 2.
        let members = [rank % 2, rank % 2 + 2];
        assert_eq!(short, members.iter().map(|&m| m as f32 + 0.5).sum::<f32>());
        let expected: Vec<f32> = (0..7)
            .map(|i| members.iter().map(|&m| (i * 10 + m) as f32).sum())
            .collect();
        assert_eq!(long, expected, "rank {rank}");
        assert_eq!(world, [4.0; 3]);
    }
}

#[test]
fn a_rank_that_fails_is_reported_in_its_sub_group_before_the_timeout() {
    let options = GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    };
    let start = Instant::now();
    let results = LocalGroup::run_each(options, 4, |ctx| {
        let half = ctx.comm.split(ctx.rank % 2)?;
        if ctx.rank == 3 {
            return Err(MoeError::Input("rank 3 gives up".into()));
        }
        let mut v = [1.0f32];
        half.all_reduce_sum_f32(&mut v)?;
        Ok(())
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        start.elapsed()
    );
    // Rank 1 shares a sub-group with rank 3 and must learn of its failure, naming it.
    match &results[1] {
        Err(MoeError::PeerFailed { peer, .. }) => assert_eq!(*peer, 3),
        other => panic!("rank 1: expected rank 3's failure, got {other:?}"),
    }
}

/// The test model: a replicated projection, a MoE layer, and a replicated layer that only the
/// flagged rows reach.
#[derive(Module, Debug)]
struct Net<B: Backend> {
    proj: Linear<B>,
    moe: MoeLayer<B>,
    extra: Linear<B>,
}

fn moe_config() -> MoeLayerConfig {
    MoeLayerConfig::new(D, 16, 4, 2)
        .with_aux_loss_coef(0.05)
        .with_z_loss_coef(0.01)
        .with_shared_expert(Some(8))
        .with_seed(7)
}

/// Every parameter outside the MoE layer from a stream keyed by its path, so that every rank
/// (and every rank count) builds the same replicas.
struct Seeded(Vec<String>);

impl<Bk: Backend> ModuleMapper<Bk> for Seeded {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.0.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.0.pop();
    }

    fn map_float<const R: usize>(&mut self, param: Param<Tensor<Bk, R>>) -> Param<Tensor<Bk, R>> {
        let (id, tensor, mapper) = param.consume();
        if self.0.iter().any(|p| p == "moe") {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let dims = tensor.dims();
        let values = seeded_uniform(3, &self.0.join("."), dims.iter().product(), 0.5);
        let fresh =
            Tensor::<Bk, R>::from_data(TensorData::new(values, dims), &tensor.device()).require_grad();
        Param::from_mapped_value(id, fresh, mapper)
    }
}

fn net(moe: MoeLayer<B>) -> Net<B> {
    let device = Default::default();
    Net {
        proj: LinearConfig::new(D, D).init(&device),
        moe,
        extra: LinearConfig::new(D, D).init(&device),
    }
    .map(&mut Seeded(Vec::new()))
}

/// This rank's share of the global-batch loss for rows `rows` of the global batch.
fn loss(net: &Net<B>, rows: std::ops::Range<usize>) -> mpipemoe::Result<Tensor<B, 1>> {
    let device = Default::default();
    let values = seeded_uniform(11, "x", N_TOKENS * D, 1.0)[rows.start * D..rows.end * D].to_vec();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values, [rows.len(), D]), &device);
    let out = net.moe.try_forward(net.proj.forward(x))?;
    let y = out.output;
    let mut loss = y.clone().powi_scalar(2).sum() / N_TOKENS as f64 + out.aux_loss + out.z_loss;
    let flagged = FLAGGED.saturating_sub(rows.start).min(rows.len());
    if flagged > 0 {
        let hit = net.extra.forward(y.slice([0..flagged, 0..D]));
        loss = loss + hit.powi_scalar(2).sum() / N_TOKENS as f64;
    }
    Ok(loss)
}

/// Every gradient by parameter path, as f64.
fn grads_by_path(net: &Net<B>, grads: &GradientsParams) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    struct Read<'a> {
        grads: &'a GradientsParams,
        path: Vec<String>,
        out: BTreeMap<String, (Vec<usize>, Vec<f64>)>,
    }
    impl ModuleVisitor<B> for Read<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const R: usize>(&mut self, param: &Param<Tensor<B, R>>) {
            if let Some(g) = self.grads.get::<I, R>(param.id) {
                let dims = g.dims().to_vec();
                let values = g.into_data().convert::<f64>().into_vec().unwrap();
                self.out.insert(self.path.join("."), (dims, values));
            }
        }
    }
    let mut read = Read {
        grads,
        path: Vec::new(),
        out: BTreeMap::new(),
    };
    net.visit(&mut read);
    read.out
}

type Grads = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

/// The model on one rank: its loss and every gradient.
fn one_rank() -> (f64, Grads) {
    let net = net(moe_config().init::<B>(&Default::default()));
    let loss = loss(&net, 0..N_TOKENS).unwrap();
    let value = loss.clone().into_scalar() as f64;
    let grads = GradientsParams::from_grads(loss.backward(), &net);
    (value, grads_by_path(&net, &grads))
}

/// Compares a rank's gradients with the one-rank model's: replicated parameters whole, expert
/// parameters as the rank's slice of experts `first..first + n_local`.
fn assert_matches_one_rank(rank: usize, got: &Grads, want: &Grads, first: usize) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "rank {rank}: the parameters with a gradient"
    );
    for (path, (dims, values)) in got {
        let (want_dims, want_values) = &want[path];
        let expected: &[f64] = if path.starts_with("moe.experts.") {
            let per_expert: usize = want_dims[1..].iter().product();
            &want_values[first * per_expert..(first + dims[0]) * per_expert]
        } else {
            assert_eq!(dims, want_dims, "{path}");
            want_values
        };
        let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let worst = values
            .iter()
            .zip(expected)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "rank {rank}, {path}: {worst:.3e} from the one-rank gradient (scale {scale:.3e})"
        );
    }
}

#[test]
fn replicated_gradients_after_sync_equal_the_one_rank_models() {
    let (want_loss, want) = one_rank();
    assert!(want.contains_key("extra.weight"));
    for n_ranks in [2, 4] {
        let results = LocalGroup::run(n_ranks, |ctx| {
            let net = net(moe_config().init_rank::<B>(&Default::default(), ctx.comm.clone())?);
            let loss = loss(&net, rank_range(N_TOKENS, n_ranks, ctx.rank))?;
            let mut total = [loss.clone().into_scalar() as f64];
            ctx.comm.all_reduce_sum(&mut total)?;
            let mut grads = GradientsParams::from_grads(loss.backward(), &net);
            let unsynced = grads_by_path(&net, &grads);
            let report = sync_replicated_grads(&net, &mut grads, ctx.comm.as_ref())?;
            Ok((
                total[0],
                report,
                unsynced,
                grads_by_path(&net, &grads),
                net.moe.experts.first_expert(),
            ))
        })
        .unwrap();
        for (rank, (total, report, unsynced, got, first)) in results.into_iter().enumerate() {
            assert!(
                (total - want_loss).abs() <= 1e-5 * want_loss.abs(),
                "{n_ranks} ranks: loss {total} vs {want_loss}"
            );
            // proj (2), router, shared expert with its gate (3), extra (2): not the experts.
            assert_eq!(report.params, 8, "{report:?}");
            // Only rank 0 holds the flagged rows: the others had no gradient for `extra`.
            assert_eq!(
                report.missing,
                if rank == 0 { 0 } else { 2 },
                "rank {rank}: {report:?}"
            );
            assert_eq!(unsynced.contains_key("extra.weight"), rank == 0);
            assert_matches_one_rank(rank, &got, &want, first);
        }
    }
}

#[test]
fn small_buckets_give_the_same_sums_one_all_reduce_each() {
    let (_, want) = one_rank();
    let results = LocalGroup::run(2, |ctx| {
        let net = net(moe_config().init_rank::<B>(&Default::default(), ctx.comm.clone())?);
        let loss = loss(&net, rank_range(N_TOKENS, 2, ctx.rank))?;
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        // 300 bytes: a weight of 64 elements and its bias of 8 share a bucket, larger pairs
        // do not.
        let report = sync_grads_of(&net, &mut grads, ctx.comm.as_ref(), ParamRole::Replicated, 300)?;
        Ok((
            report,
            grads_by_path(&net, &grads),
            net.moe.experts.first_expert(),
        ))
    })
    .unwrap();
    for (rank, (report, got, first)) in results.into_iter().enumerate() {
        assert!(report.buckets > 1 && report.buckets < report.params, "{report:?}");
        assert_matches_one_rank(rank, &got, &want, first);
    }
}

#[test]
fn expert_parallel_two_by_data_parallel_two_equals_one_rank() {
    let (want_loss, want) = one_rank();
    let results = LocalGroup::run(4, |ctx| {
        let groups = ParallelGroups::new(ctx.comm.clone(), 2)?;
        assert_eq!(groups.data_parallel(), 2);
        let net = net(moe_config().init_groups::<B>(&Default::default(), &groups)?);
        let loss = loss(&net, rank_range(N_TOKENS, 4, ctx.rank))?;
        let mut total = [loss.clone().into_scalar() as f64];
        ctx.comm.all_reduce_sum(&mut total)?;
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        let (replicated, experts) = groups.sync_grads(&net, &mut grads)?;
        Ok((
            total[0],
            replicated,
            experts,
            grads_by_path(&net, &grads),
            net.moe.experts.first_expert(),
        ))
    })
    .unwrap();
    for (rank, (total, replicated, experts, got, first)) in results.into_iter().enumerate() {
        // Ranks 0, 1 and 2, 3 are the expert-parallel groups: two experts each.
        assert_eq!(first, (rank % 2) * 2, "rank {rank}");
        assert!(
            (total - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "loss {total} vs {want_loss}"
        );
        assert_eq!((replicated.params, experts.params), (8, 2), "rank {rank}");
        assert_matches_one_rank(rank, &got, &want, first);
    }
}

#[test]
fn groups_that_do_not_divide_the_world_or_the_experts_are_refused_by_name() {
    let errors = LocalGroup::run(4, |ctx| {
        let bad_split = ParallelGroups::new(ctx.comm.clone(), 3).unwrap_err().to_string();
        // 4 experts over expert-parallel groups of 4 is fine; 6 experts are not.
        let groups = ParallelGroups::new(ctx.comm.clone(), 4)?;
        let bad_layer = MoeLayerConfig::new(D, 16, 6, 2)
            .init_groups::<B>(&Default::default(), &groups)
            .unwrap_err()
            .to_string();
        Ok((bad_split, bad_layer))
    })
    .unwrap();
    for (bad_split, bad_layer) in errors {
        assert!(
            bad_split.contains("expert_parallel") && bad_split.contains("4 ranks"),
            "{bad_split}"
        );
        assert!(bad_layer.contains("n_experts"), "{bad_layer}");
    }
}

#[test]
fn every_parameter_has_a_role_and_ids_from_paths_agree_across_ranks() {
    let ids = LocalGroup::run(2, |ctx| {
        let net = with_path_ids(net(
            moe_config().init_rank::<B>(&Default::default(), ctx.comm.clone())?
        ));
        Ok(param_roles::<B, _>(&net))
    })
    .unwrap();
    assert_eq!(ids[0], ids[1], "paths, ids, roles and shapes agree");
    let role = |path: &str| ids[0].iter().find(|e| e.path == path).map(|e| e.role);
    assert_eq!(role("moe.experts.w_in"), Some(ParamRole::Expert));
    assert_eq!(role("moe.router.weight"), Some(ParamRole::Replicated));
    assert_eq!(role("moe.shared.w_in"), Some(ParamRole::Replicated));
    assert_eq!(role("proj.weight"), Some(ParamRole::Replicated));
    let replicated: Vec<&str> = ids[0]
        .iter()
        .filter(|e| e.role == ParamRole::Replicated)
        .map(|e| e.path.as_str())
        .collect();
    assert_eq!(
        replicated,
        [
            "proj.weight",
            "proj.bias",
            "moe.router.weight",
            "moe.shared.w_in",
            "moe.shared.w_out",
            "moe.shared.gate",
            "extra.weight",
            "extra.bias"
        ]
    );
    assert_eq!(
        ids[0].iter().find(|e| e.path == "proj.weight").unwrap().id,
        path_id("proj.weight")
    );
}

#[test]
fn ranks_with_different_models_are_refused_instead_of_summing_unrelated_gradients() {
    let results = LocalGroup::run_each(GroupOptions::default(), 2, |ctx| {
        let device = Default::default();
        let moe = moe_config().init_rank::<B>(&device, ctx.comm.clone())?;
        let mut net = net(moe);
        if ctx.rank == 1 {
            net.extra = LinearConfig::new(D, D + 1).init(&device);
        }
        let loss = loss(&net, rank_range(N_TOKENS, 2, ctx.rank))?;
        let mut grads = GradientsParams::from_grads(loss.backward(), &net);
        sync_replicated_grads(&net, &mut grads, ctx.comm.as_ref()).map(|_| ())
    });
    for result in results {
        let err = result.unwrap_err().to_string();
        assert!(err.contains("rank 1's model"), "{err}");
    }
}

#[test]
fn a_record_of_another_ranks_experts_is_refused_naming_both() {
    let dir = common::scratch_dir("parallel-record");
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    let messages = LocalGroup::run(2, |ctx| {
        let device = Default::default();
        let layer = moe_config().init_rank::<I>(&device, ctx.comm.clone())?;
        let file = dir.join(format!("rank{}", ctx.rank));
        layer.clone().save_file(&file, &recorder).unwrap();
        ctx.comm.barrier()?;
        let x = Tensor::<I, 2>::ones([3, D], &device);
        // Its own record loads and runs.
        let own = layer.clone().load_file(&file, &recorder, &device).unwrap();
        own.try_forward(x.clone())?;
        // The other rank's record has the same shapes, and must not run.
        let other = dir.join(format!("rank{}", 1 - ctx.rank));
        let swapped = layer.load_file(&other, &recorder, &device).unwrap();
        let err = swapped.try_forward(x).map(|_| ()).unwrap_err();
        // Every rank fails the same way before any collective, so the group stays in step.
        Ok((err.to_string(), swapped.experts.check_shard().is_err()))
    })
    .unwrap();
    assert!(
        messages[0].0.contains("experts 2..4 of 4 (rank 1 of 2)"),
        "{}",
        messages[0].0
    );
    assert!(
        messages[0].0.contains("experts 0..2 of 4 (rank 0 of 2)"),
        "{}",
        messages[0].0
    );
    assert!(messages[1].1);
    std::fs::remove_dir_all(&dir).unwrap();
}
