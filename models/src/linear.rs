//! The models' dense products (attention's projections, the dense MLP, the head) through the
//! backend's row product, [`MoeBackend::expert_matmul`], rather than burn's `Linear::forward`.
//!
//! On Flex that product is the one the experts use (`mpipemoe`'s `exchange/flex_gemm.rs`):
//! its output allocated once instead of zero-filled and copied, transposed operands read in
//! place (a backward's `g · wᵀ` and `xᵀ · g`, a tied head's `Eᵀ`), and a product of a few rows
//! — every projection of a decode step — cut by depth over the threads, where burn's matmul
//! runs it on one (its parallel threshold counts multiply-adds, and a decode step's products
//! are small in those though each reads a whole weight). Under `Autodiff` it is one
//! node whose backward products go the same way. Other backends multiply as burn's `Linear`
//! does.

use burn::nn::Linear;
use burn::tensor::{Tensor, TensorPrimitive};
use mpipemoe::MoeBackend;

/// `x · w`, `x`'s leading dimensions kept.
///
/// # Shapes
/// - x: `[..., d_in]`; w: `[d_in, d_out]`
/// - output: `[..., d_out]`
pub(crate) fn matmul<B: MoeBackend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>) -> Tensor<B, D> {
    let dims = x.dims();
    let [d_in, d_out] = w.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    let x = x.reshape([rows, d_in]);
    let y = B::expert_matmul(x.into_primitive().tensor(), w.into_primitive().tensor());
    let mut out = dims;
    out[D - 1] = d_out;
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(out)
}

/// `layer(x)`: `x · weight + bias`.
///
/// # Shapes
/// - x: `[..., d_in]` → `[..., d_out]`
pub(crate) fn linear<B: MoeBackend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let y = matmul(x, layer.weight.val());
    match &layer.bias {
        Some(bias) => y + bias.val().unsqueeze::<D>(),
        None => y,
    }
}
