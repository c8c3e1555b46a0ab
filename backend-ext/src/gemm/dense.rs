//! The layer's dense products on cuBLAS: one (`ExpertPath::matmul`: the router's logits, the
//! shared expert, and their gradients) as one `cublasGemmEx` at the precision, into a new
//! tensor; or many independent ones (`ExpertPath::matmuls`: one step of the primitives'
//! experts, those with adapters) in one section, each into a new tensor.

use burn::tensor::DType;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::tensor::CubeTensor;
use mpipemoe::{GemmPrecision, MoeError, Result};

use std::sync::{Arc, Mutex};

use super::blas::{Product, Role};
use super::lane::Lane;
use super::operands::{ready, Addresses, Halves};
use super::CublasExperts;

/// The shape check of `lhs · rhs`, and the new `[m, n]` tensor its result goes to.
fn output(lhs: &CubeTensor<CudaRuntime>, rhs: &CubeTensor<CudaRuntime>) -> Result<CubeTensor<CudaRuntime>> {
    let (ls, rs) = (lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
    if ls.len() != 2 || rs.len() != 2 || ls[1] != rs[0] || ls[1] == 0 {
        return Err(MoeError::Backend(format!(
            "CUDA dense product: {ls:?} times {rs:?}"
        )));
    }
    let (m, n) = (ls[0], rs[1]);
    let client = lhs.client.clone();
    Ok(CubeTensor::new_contiguous(
        client.clone(),
        lhs.device.clone(),
        [m, n].into(),
        client.empty((m * n * 4).max(4)),
        DType::F32,
    ))
}

/// Independent products, each into a new tensor, in one section: grouped by the operands'
/// transpositions into roles, each role run as the experts' are (`Inner::run`: batched where
/// products share a shape, grouped or looped otherwise).
pub(crate) fn matmuls(
    path: &CublasExperts,
    pairs: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
    precision: GemmPrecision,
) -> Result<Vec<CubeTensor<CudaRuntime>>> {
    let mut outs = Vec::with_capacity(pairs.len());
    let mut work = Vec::with_capacity(pairs.len());
    for (lhs, rhs) in pairs {
        let out = output(&lhs, &rhs)?;
        if out.meta.shape().num_elements() > 0 {
            work.push((lhs, rhs, out.clone()));
        }
        outs.push(out);
    }
    let Some(client) = work.first().map(|(_, _, out)| out.client.clone()) else {
        return Ok(outs);
    };
    path.on_device_thread(&client, |lane| products_on(path, work, precision, lane))?;
    Ok(outs)
}

fn products_on(
    path: &CublasExperts,
    work: Vec<(
        CubeTensor<CudaRuntime>,
        CubeTensor<CudaRuntime>,
        CubeTensor<CudaRuntime>,
    )>,
    precision: GemmPrecision,
    lane: Arc<Mutex<Lane>>,
) -> Result<()> {
    let client = work[0].2.client.clone();
    let ord = path.inner.ordinal;
    let mut at = Addresses::new(&client);
    let half = precision == GemmPrecision::Bf16;
    let mut operands = Vec::with_capacity(work.len());
    let mut list = Vec::with_capacity(2 * work.len());
    for (lhs, rhs, out) in work {
        let (m, k, n) = (lhs.meta.shape()[0], lhs.meta.shape()[1], rhs.meta.shape()[1]);
        let (lhs, lda, trans_a) = batched_operand(lhs, ord, "a product's left operand")?;
        let (rhs, ldb, trans_b) = batched_operand(rhs, ord, "a product's right operand")?;
        // A transposed view covers the same elements as its storage: the copy converts it.
        list.push((at.of(&lhs)?, m * k));
        list.push((at.of(&rhs)?, k * n));
        operands.push((trans_a, trans_b, lda, ldb, at.of(&out)?, m, n, k));
    }
    let (halves, ops) = Halves::plan(&mut at, half, &list)?;
    // One role per pair of transpositions, its products in the order asked.
    let mut roles: Vec<Role> = Vec::new();
    for (i, &(trans_a, trans_b, lda, ldb, c, m, n, k)) in operands.iter().enumerate() {
        let product = Product::new(ops[2 * i], lda, ops[2 * i + 1], ldb, c, n, m, n, k);
        match roles
            .iter_mut()
            .find(|r| r.trans_a == trans_a && r.trans_b == trans_b)
        {
            Some(role) => role.products.push(product),
            None => roles.push(Role::new(trans_a, trans_b, false, half, vec![product])),
        }
    }
    path.inner.section(
        &client,
        |inner, lane| {
            if !halves.is_empty() {
                halves.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert dense operands")?;
            }
            roles
                .iter()
                .try_for_each(|role| inner.run(lane, role, precision))?;
            lane.mark("dense products")
        },
        &lane,
    )?;
    drop(at);
    Ok(())
}

pub(crate) fn matmul(
    path: &CublasExperts,
    lhs: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
    precision: GemmPrecision,
) -> Result<CubeTensor<CudaRuntime>> {
    let out = output(&lhs, &rhs)?;
    if out.meta.shape().num_elements() == 0 {
        return Ok(out);
    }
    let client = out.client.clone();
    path.on_device_thread(&client, |lane| product_on(path, lhs, rhs, out, precision, lane))
}

fn product_on(
    path: &CublasExperts,
    lhs: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
    out: CubeTensor<CudaRuntime>,
    precision: GemmPrecision,
    lane: Arc<Mutex<Lane>>,
) -> Result<CubeTensor<CudaRuntime>> {
    let (m, k, n) = (lhs.meta.shape()[0], lhs.meta.shape()[1], rhs.meta.shape()[1]);
    let client = out.client.clone();
    let ord = path.inner.ordinal;
    let mut at = Addresses::new(&client);
    let (lhs, lda, trans_a) = batched_operand(lhs, ord, "a dense product's left operand")?;
    let (rhs, ldb, trans_b) = batched_operand(rhs, ord, "a dense product's right operand")?;
    let half = precision == GemmPrecision::Bf16;
    // A transposed view covers the same elements as its storage: the copy converts the storage.
    let list = [(at.of(&lhs)?, m * k), (at.of(&rhs)?, k * n)];
    let (halves, ops) = Halves::plan(&mut at, half, &list)?;
    let c = at.of(&out)?;
    let role = Role::new(
        trans_a,
        trans_b,
        false,
        half,
        vec![Product::new(ops[0], lda, ops[1], ldb, c, n, m, n, k)],
    );
    path.inner.section(
        &client,
        |inner, lane| {
            if !halves.is_empty() {
                halves.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert dense operands")?;
            }
            role.run_looped(lane.handle(), precision)?;
            lane.mark("dense product")
        },
        &lane,
    )?;
    drop(at);
    Ok(out)
}

/// A matrix, or a batch of them one every `rows · cols` elements, as cuBLAS reads it:
/// contiguous (`transposed` false, `ld` the width), or the view of a contiguous batch with its
/// last two dimensions swapped (`transposed` true, `ld` the view's height), which a dense
/// product's backward passes, and attention for the keys; anything else is made contiguous
/// first. Every dense and per-head product reads its operands here.
fn batched_operand(
    t: CubeTensor<CudaRuntime>,
    ordinal: usize,
    what: &str,
) -> Result<(CubeTensor<CudaRuntime>, usize, bool)> {
    let shape = t.meta.shape().to_vec();
    let strides = t.meta.strides().to_vec();
    let rank = shape.len();
    if rank < 2 {
        return Err(MoeError::Backend(format!(
            "CUDA product: {what} is {shape:?}, not a matrix or a batch of them"
        )));
    }
    let (rows, cols) = (shape[rank - 2], shape[rank - 1]);
    // Each leading dimension a whole number of matrices apart, as in a contiguous batch.
    let mut expected = rows * cols;
    let mut batch_contiguous = true;
    for i in (0..rank - 2).rev() {
        batch_contiguous &= shape[i] == 1 || strides[i] == expected;
        expected *= shape[i];
    }
    let swapped = strides[rank - 2] == 1 && (strides[rank - 1] == rows || cols == 1);
    if t.dtype == DType::F32 && t.device.index == ordinal && batch_contiguous && swapped && rows > 1 {
        return Ok((t, rows, true));
    }
    let t = ready(t, ordinal, what)?;
    Ok((t, cols, false))
}

/// Attention's per-head products (`ExpertPath::heads_matmul`): `lhs[i] · rhs[i]` for every
/// matrix `i` of the batch, into a new `[.., m, n]` tensor, in one section. Every product has
/// the same shape and its operands lie a whole matrix apart, so the role runs as one strided
/// batched call where cuBLAS takes it (`Inner::run`), looped otherwise.
///
/// # Shapes
/// - lhs: `[.., m, k]`, rhs: `[.., k, n]` with the same leading dimensions → `[.., m, n]`
pub(crate) fn heads_matmul(
    path: &CublasExperts,
    lhs: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
    precision: GemmPrecision,
) -> Result<CubeTensor<CudaRuntime>> {
    let (ls, rs) = (lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
    let rank = ls.len();
    if rank < 2 || rs.len() != rank || ls[..rank - 2] != rs[..rank - 2] || ls[rank - 1] != rs[rank - 2] {
        return Err(MoeError::Backend(format!(
            "CUDA per-head product: {ls:?} times {rs:?}"
        )));
    }
    let (m, k, n) = (ls[rank - 2], ls[rank - 1], rs[rank - 1]);
    let batch: usize = ls[..rank - 2].iter().product();
    let mut shape = ls.clone();
    shape[rank - 1] = n;
    let client = lhs.client.clone();
    let out = CubeTensor::new_contiguous(
        client.clone(),
        lhs.device.clone(),
        shape.into(),
        client.empty((batch * m * n * 4).max(4)),
        DType::F32,
    );
    if batch * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        // No terms: the products are zeros, which cuBLAS would not write with `beta = 0` and
        // no `A` or `B` to read.
        return Ok(burn_cubecl::ops::numeric::zeros_client(
            client,
            out.device.clone(),
            out.meta.shape().clone(),
            DType::F32,
        ));
    }
    path.on_device_thread(&client, |lane| {
        heads_on(path, (lhs, rhs, out), (batch, m, k, n), precision, lane)
    })
}

fn heads_on(
    path: &CublasExperts,
    (lhs, rhs, out): (
        CubeTensor<CudaRuntime>,
        CubeTensor<CudaRuntime>,
        CubeTensor<CudaRuntime>,
    ),
    (batch, m, k, n): (usize, usize, usize, usize),
    precision: GemmPrecision,
    lane: Arc<Mutex<Lane>>,
) -> Result<CubeTensor<CudaRuntime>> {
    let client = out.client.clone();
    let ord = path.inner.ordinal;
    let mut at = Addresses::new(&client);
    let (lhs, lda, trans_a) = batched_operand(lhs, ord, "a per-head product's left operand")?;
    let (rhs, ldb, trans_b) = batched_operand(rhs, ord, "a per-head product's right operand")?;
    let half = precision == GemmPrecision::Bf16;
    let bytes = if half { 2 } else { 4 };
    // A swapped view covers the same elements as its storage: the copy converts the storage.
    let list = [(at.of(&lhs)?, batch * m * k), (at.of(&rhs)?, batch * k * n)];
    let (halves, ops) = Halves::plan(&mut at, half, &list)?;
    let c = at.of(&out)?;
    let products = (0..batch)
        .map(|i| {
            Product::new(
                ops[0] + (i * m * k * bytes) as u64,
                lda,
                ops[1] + (i * k * n * bytes) as u64,
                ldb,
                c + (i * m * n * 4) as u64,
                n,
                m,
                n,
                k,
            )
        })
        .collect();
    let role = Role::new(trans_a, trans_b, false, half, products);
    path.inner.section(
        &client,
        |inner, lane| {
            if !halves.is_empty() {
                halves.convert(&inner.kernels, &lane.stream)?;
                lane.mark("convert per-head operands")?;
            }
            inner.run(lane, &role, precision)?;
            lane.mark("per-head products")
        },
        &lane,
    )?;
    drop(at);
    Ok(out)
}
