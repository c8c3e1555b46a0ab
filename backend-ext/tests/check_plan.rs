//! The GPU check's plan: without NCCL every single-GPU check still runs; with it, the NCCL
//! checks come after all of them (so a failing NCCL cannot hide another result).

use mpipemoe_cuda::check_plan::{check_runs, CheckRun};

#[test]
fn without_nccl_every_other_check_still_runs() {
    let with = check_runs(true);
    let without = check_runs(false);
    let others: Vec<CheckRun> = with.iter().copied().filter(|r| !r.needs_nccl()).collect();
    assert_eq!(without, others, "the same single-GPU checks, in the same order");
    assert!(without.iter().all(|r| !r.needs_nccl()));
    assert!(with.iter().any(|r| r.needs_nccl()));
    let first_nccl = with.iter().position(|r| r.needs_nccl()).unwrap();
    assert!(
        with[first_nccl..].iter().all(|r| r.needs_nccl()),
        "NCCL checks run last"
    );
    // Every strategy at n = 1 and at several partitions, in f32 and bf16, and in order.
    for strategy in mpipemoe::memory::Strategy::ALL {
        for n in [1, 4] {
            for bf16 in [false, true] {
                assert!(without.contains(&CheckRun::Fused { n, strategy, bf16 }));
            }
        }
        assert!(without.contains(&CheckRun::InOrderArena { n: 3, strategy }));
    }
    // Two thread ranks on the one GPU, with and without a shadowed expert.
    for shadowed in [false, true] {
        assert!(without.contains(&CheckRun::TwoRanks {
            n: 3,
            strategy: mpipemoe::memory::Strategy::S4,
            shadowed
        }));
    }
}

/// The cuBLAS checks come first in the whole plan and are the short plan alone: every precision,
/// both hand-overs, two ranks with a shadowed expert and the arena, each held to its tolerance.
#[test]
fn the_cublas_checks_come_first_and_cover_each_path() {
    use mpipemoe::GemmPrecision;
    use mpipemoe_cuda::check_plan::{cublas_runs, plan_runs, Plan};
    let cublas = cublas_runs();
    assert_eq!(plan_runs(Plan::Cublas, true), cublas);
    let all = plan_runs(Plan::All, true);
    assert_eq!(all[..cublas.len()], cublas[..]);
    assert_eq!(all[cublas.len()..], check_runs(true)[..]);
    let has = |f: &dyn Fn(&CheckRun) -> bool| cublas.iter().any(f);
    for precision in GemmPrecision::ALL {
        assert!(has(
            &|r| matches!(r, CheckRun::Cublas { precision: p, strategy: mpipemoe::memory::Strategy::S4, .. } if *p == precision)
        ));
    }
    assert!(has(&|r| matches!(
        r,
        CheckRun::Cublas {
            host_handover: true,
            ..
        }
    )));
    assert!(has(&|r| matches!(
        r,
        CheckRun::Cublas {
            ranks: 2,
            shadowed: true,
            ..
        }
    )));
    // Two thread ranks offloading S1's partitions: the page-locked host rows and offload.
    assert!(has(&|r| matches!(
        r,
        CheckRun::Cublas {
            ranks: 2,
            strategy: mpipemoe::memory::Strategy::S1,
            ..
        }
    )));
    assert!(has(&|r| matches!(r, CheckRun::Cublas { in_order: true, .. })));
    assert!(has(&|r| matches!(r, CheckRun::Cublas { fusion: true, .. })));
    assert_eq!(Plan::parse("cublas"), Some(Plan::Cublas));
    assert_eq!(Plan::parse("all"), Some(Plan::All));
    assert_eq!(Plan::parse("fast"), None);
}
