//! The router's choice of experts made on the device (`RouterKernels::router_choose`) against
//! the host's (`group_limited_top_k`), column for column: a check of the GPU check's kernel
//! list (`kernel_checks`), so that CUDA, where the kernel is compiled for a GPU, holds it as
//! WGPU does in the tests.
//!
//! The routers cover top-1 to a choice of every expert, and group limits (groups of one expert
//! too); the values have many ties (`tied_values`: the tie rule decides) or none, from
//! contiguous tensors and from transposed views. A backend that does not choose on the device
//! fails the check: on CUDA that is a kernel that did not run.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor, TensorData};

use super::KernelCheck;
use crate::router::topk::{group_limited_top_k, tied_values};
use crate::router::DeviceChoice;
use crate::{MoeBackend, RoutingRule};

/// The routers checked: `(n_experts, top_k, n_group, topk_group)`.
const ROUTERS: [(usize, usize, usize, usize); 9] = [
    (8, 1, 1, 1),
    (8, 2, 1, 1),
    (12, 4, 1, 1),
    (6, 6, 1, 1),
    (64, 6, 1, 1),
    (16, 3, 4, 2),
    (32, 8, 8, 4),
    (8, 2, 8, 3),
    (12, 5, 3, 2),
];

/// Tokens a check routes: no multiple of a cube's threads.
const N_TOKENS: usize = 301;

/// One check per router: every token's choice on the device is the host's.
pub(super) fn choice_checks<B: MoeBackend>(device: &B::Device) -> Vec<KernelCheck> {
    ROUTERS
        .iter()
        .enumerate()
        .map(|(i, &(n_experts, top_k, n_group, topk_group))| {
            let label = format!(
                "kernel router choice, {n_experts} experts top-{top_k}, {topk_group} of {n_group} groups"
            );
            let rule = RoutingRule {
                n_group,
                topk_group,
                ..RoutingRule::top_k(top_k, true)
            };
            let continuous =
                Tensor::<B, 2>::random([N_TOKENS, n_experts], Distribution::Normal(0.0, 1.0), device)
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap_or_default();
            let inputs = [
                ("tied", tied_values(N_TOKENS * n_experts, i as u64)),
                ("continuous", continuous),
            ];
            let outcome = inputs.iter().try_fold(0, |tokens, (kind, values)| {
                let want = group_limited_top_k(values, n_experts, top_k, n_group, topk_group);
                for (layout, tensor) in layouts::<B>(values, n_experts, device) {
                    let what = format!("{kind} values, {layout}");
                    match B::router_choose(tensor.clone(), tensor, &rule).and_then(|read| read.wait()) {
                        Some(DeviceChoice::Chosen(got)) => {
                            if let Some(at) = (0..want.len()).find(|&j| got.get(j) != Some(&want[j])) {
                                return Err(format!(
                                    "{what}: token {} choice {} is column {:?}, the host's {}",
                                    at / top_k,
                                    at % top_k,
                                    got.get(at),
                                    want[at]
                                ));
                            }
                        }
                        other => return Err(format!("{what}: the device's choice is {other:?}")),
                    }
                }
                Ok(tokens + 2 * N_TOKENS)
            });
            (
                label,
                outcome.map(|tokens| format!("the host's choice for {tokens} tokens")),
            )
        })
        .collect()
}

/// `values` as `[N_TOKENS, n_experts]`, contiguous and as the transposed view of a contiguous
/// `[n_experts, N_TOKENS]`.
fn layouts<B: MoeBackend>(
    values: &[f32],
    n_experts: usize,
    device: &B::Device,
) -> [(&'static str, FloatTensor<B>); 2] {
    let data = TensorData::new(values.to_vec(), [N_TOKENS, n_experts]);
    let contiguous = Tensor::<B, 2>::from_data(data, device);
    let flipped = Tensor::<B, 2>::from_data(contiguous.clone().transpose().into_data(), device);
    [
        ("contiguous", contiguous.into_primitive().tensor()),
        ("strided", flipped.transpose().into_primitive().tensor()),
    ]
}
