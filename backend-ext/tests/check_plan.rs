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
