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
//!
//! Where the MoE layers' communicator offers a device library for the backend (cuBLAS on CUDA),
//! the products go through it instead, at the MoE layers' GEMM precision ([`DenseProducts`]),
//! as the layers' own router and shared-expert products do; attention's per-head products too
//! ([`DenseProducts::heads_matmul`]).

use std::sync::Arc;

use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use mpipemoe::{Communicator, GemmPrecision, MoeBackend, Result};

/// Where a model's dense products multiply: through the communicator's device library for the
/// backend at the MoE layers' GEMM precision where it offers one (cuBLAS on CUDA, as the
/// experts' products do: IEEE f32, TF32 or bf16 as asked, where cubecl's kernels multiply f32
/// in TF32 whatever is asked and run at a fraction of cuBLAS's rate), the backend's row product
/// otherwise ([`DenseProducts::backend`], the default: every CPU backend and WGPU).
#[derive(Clone, Default)]
pub struct DenseProducts {
    library: Option<(Arc<dyn Communicator>, GemmPrecision)>,
}

impl std::fmt::Debug for DenseProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.library {
            Some((_, precision)) => write!(f, "DenseProducts(library, {precision})"),
            None => f.write_str("DenseProducts(backend)"),
        }
    }
}

impl DenseProducts {
    /// The backend's row product, [`MoeBackend::expert_matmul`].
    pub fn backend() -> Self {
        Self::default()
    }

    /// `comm`'s device library for `B` at `precision` where it offers one, else the backend's
    /// product.
    pub fn of<B: MoeBackend>(comm: &Arc<dyn Communicator>, precision: GemmPrecision) -> Self {
        Self {
            library: B::dense_library(comm.as_ref()).then(|| (comm.clone(), precision)),
        }
    }

    /// `x · w`, `x`'s leading dimensions kept (the backend's row product where there is no
    /// library).
    ///
    /// # Shapes
    /// - x: `[..., d_in]`; w: `[d_in, d_out]` → `[..., d_out]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](mpipemoe::MoeError::Backend) if the device library fails.
    pub fn matmul<B: MoeBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        w: Tensor<B, 2>,
    ) -> Result<Tensor<B, D>> {
        let Some((comm, precision)) = &self.library else {
            return Ok(matmul(x, w));
        };
        let (out, x, w) = flatten(x, w);
        Ok(unflatten(B::dense_matmul(x, w, comm, *precision)?, out))
    }

    /// Each `x_i · w_i` of `pairs`, in one call of the device library where there is one (on
    /// CUDA one cuBLAS section, where each product alone takes one: attention's q, k and v
    /// projections of one input, say), each as [`matmul`](Self::matmul) makes it otherwise.
    ///
    /// # Shapes
    /// - each x: `[..., d_in]`; its w: `[d_in, d_out]` → `[..., d_out]`
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul).
    pub fn matmuls<B: MoeBackend, const D: usize>(
        &self,
        pairs: Vec<(Tensor<B, D>, Tensor<B, 2>)>,
    ) -> Result<Vec<Tensor<B, D>>> {
        let Some((comm, precision)) = self.library.as_ref().filter(|_| !pairs.is_empty()) else {
            return Ok(pairs.into_iter().map(|(x, w)| matmul(x, w)).collect());
        };
        let (shapes, flat): (Vec<_>, Vec<_>) = pairs
            .into_iter()
            .map(|(x, w)| {
                let (out, x, w) = flatten(x, w);
                (out, (x, w))
            })
            .unzip();
        let ys = B::dense_matmuls(flat, comm, *precision)?;
        Ok(ys
            .into_iter()
            .zip(shapes)
            .map(|(y, out)| unflatten(y, out))
            .collect())
    }

    /// Attention's per-head products `lhs · rhs` over matching leading dimensions: through
    /// the library at its precision where there is one
    /// ([`MoeBackend::dense_heads_matmul`]), the backend's
    /// [`heads_matmul`](MoeBackend::heads_matmul) otherwise (on Flex, a decode step's few rows
    /// read the cache where it lies).
    ///
    /// # Shapes
    /// - lhs: `[.., m, k]`, rhs: `[.., k, n]` → `[.., m, n]`
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul).
    pub fn heads_matmul<B: MoeBackend, const D: usize>(
        &self,
        lhs: Tensor<B, D>,
        rhs: Tensor<B, D>,
    ) -> Result<Tensor<B, D>> {
        let (lhs, rhs) = (lhs.into_primitive().tensor(), rhs.into_primitive().tensor());
        let product = match &self.library {
            Some((comm, precision)) => B::dense_heads_matmul(lhs, rhs, comm, *precision)?,
            None => B::heads_matmul(lhs, rhs),
        };
        Ok(Tensor::from_primitive(TensorPrimitive::Float(product)))
    }

    /// `layer(x)`: `x · weight + bias`, the product as [`matmul`](Self::matmul) makes it.
    ///
    /// # Shapes
    /// - x: `[..., d_in]` → `[..., d_out]`
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul).
    pub fn linear<B: MoeBackend, const D: usize>(
        &self,
        layer: &Linear<B>,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>> {
        let y = self.matmul(x, layer.weight.val())?;
        Ok(with_bias(y, layer))
    }
}

/// `y + bias` where `layer` has a bias, with `y` seen as rows: the bias broadcast over one
/// dimension, so that its gradient is one sum over the rows (one reduction launch on a GPU
/// backend) rather than one sum per leading dimension of `y`.
///
/// # Shapes
/// - y: `[..., d_out]` → the same
pub(crate) fn with_bias<B: Backend, const D: usize>(y: Tensor<B, D>, layer: &Linear<B>) -> Tensor<B, D> {
    let Some(bias) = &layer.bias else {
        return y;
    };
    let dims = y.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    (y.reshape([rows, dims[D - 1]]) + bias.val().unsqueeze::<2>()).reshape(dims)
}

/// `x · w`, `x`'s leading dimensions kept.
///
/// # Shapes
/// - x: `[..., d_in]`; w: `[d_in, d_out]`
/// - output: `[..., d_out]`
pub(crate) fn matmul<B: MoeBackend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>) -> Tensor<B, D> {
    let (out, x, w) = flatten(x, w);
    unflatten(B::expert_matmul(x, w), out)
}

/// `x · w`'s operands as a row product takes them, and the shape its `[rows, d_out]` result
/// goes back to.
///
/// # Shapes
/// - x: `[..., d_in]` → `[rows, d_in]`; w: `[d_in, d_out]`; returned shape `[..., d_out]`
fn flatten<B: MoeBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
) -> ([usize; D], FloatTensor<B>, FloatTensor<B>) {
    let mut out = x.dims();
    let [d_in, d_out] = w.dims();
    let rows = out[..D - 1].iter().product::<usize>();
    out[D - 1] = d_out;
    let x = x.reshape([rows, d_in]).into_primitive().tensor();
    (out, x, w.into_primitive().tensor())
}

/// A row product's `[rows, d_out]` result in the shape [`flatten`] gave.
fn unflatten<B: MoeBackend, const D: usize>(y: FloatTensor<B>, out: [usize; D]) -> Tensor<B, D> {
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(out)
}
