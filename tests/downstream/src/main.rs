//! A burn model with an `MoeLayer` in place of its FFN, trained with burn's optimizer on
//! burn's default GPU backend (`Autodiff<Wgpu>`, which burn's default features wrap in
//! fusion): what a user's crate looks like. Exits non-zero if the loss does not fall.

use burn::backend::{Autodiff, Wgpu};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use mpipemoe::{MoeBackend, MoeLayer, MoeLayerConfig};

/// A pre-norm residual block whose FFN is a mixture of experts, and a read-out.
#[derive(Module, Debug)]
struct Block<B: Backend> {
    norm: LayerNorm<B>,
    moe: MoeLayer<B>,
    head: Linear<B>,
}

impl<B: MoeBackend> Block<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            norm: LayerNormConfig::new(32).init(device),
            moe: MoeLayerConfig::new(32, 64, 4, 2).init(device),
            head: LinearConfig::new(32, 8).init(device),
        }
    }

    /// `[n_tokens, 32]` → (`[n_tokens, 8]`, the router's auxiliary loss).
    fn forward(&self, x: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 1>) {
        let moe = self.moe.forward(self.norm.forward(x.clone()));
        (self.head.forward(x + moe.output), moe.aux_loss + moe.z_loss)
    }
}

type B = Autodiff<Wgpu>;

fn main() {
    let device = Default::default();
    let mut model = Block::<B>::new(&device);
    let mut optim = AdamWConfig::new().init::<B, Block<B>>();
    let x = Tensor::<B, 2>::random([64, 32], Distribution::Normal(0.0, 1.0), &device);
    let target = Tensor::<B, 2>::random([64, 8], Distribution::Normal(0.0, 1.0), &device);
    let mut losses = Vec::new();
    for _ in 0..8 {
        let (y, aux) = model.forward(x.clone());
        let loss = MseLoss::new().forward(y, target.clone(), Reduction::Mean) + aux;
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    println!("backend {}: losses {losses:?}", <B as Backend>::name(&device));
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    if !(last < first) {
        eprintln!("error: the loss did not fall ({first} -> {last})");
        std::process::exit(1);
    }
}
