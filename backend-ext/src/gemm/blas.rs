//! The experts' products on cuBLAS: one role (say, every expert's `x_e · W_in[e]`) as
//! - one batched call for the products of each shape that two or more experts share
//!   (`cublasGemmStridedBatchedEx` where every operand steps evenly, else `cublasGemmBatchedEx`;
//!   `batches.rs` finds them);
//! - one grouped call for the rest (`cublasGemmGroupedBatchedEx`, one group per expert with
//!   rows), the pointer tables of both written on the device by `fill_ptrs`;
//! - or, where the library has no grouped call or refuses the precision in it, one
//!   `cublasGemmEx` per expert.
//!
//! Tensors are row-major and cuBLAS is column-major: a row-major `C[m, n] = op(A) · op(B)` is
//! the column-major `Cᵀ[n, m] = op(B)ᵀ · op(A)ᵀ`, whose operands are the same buffers read as
//! their transposes; so each call swaps the operands and their flags ([`Role::call`]).

use std::ffi::c_void;

use cudarc::cublas::sys::{self as blas, cublasComputeType_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::CudaStream;
use mpipemoe::{GemmPrecision, MoeError, Result};

use super::kernels::Kernels;
use crate::batches::{batches, Addressing, Batch, Batches, CallShape};

/// One expert's product in row-major terms: `C[m, n] = op(A)[m, k] · op(B)[k, n] (+ C)`, each
/// operand a device address and its row stride in elements.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Product {
    pub(crate) a: u64,
    pub(crate) lda: usize,
    pub(crate) b: u64,
    pub(crate) ldb: usize,
    pub(crate) c: u64,
    pub(crate) ldc: usize,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
}

/// Every expert's product of one kind: the operands' transposition, whether the result is
/// added to `C` (the weight gradients' running sums), whether `A` and `B` are bf16 (the bf16
/// precision; `C` is f32 always) and the products.
#[derive(Debug, Clone)]
pub(crate) struct Role {
    pub(crate) trans_a: bool,
    pub(crate) trans_b: bool,
    pub(crate) accumulate: bool,
    pub(crate) bf16: bool,
    pub(crate) products: Vec<Product>,
}

impl Product {
    /// `C[m, n] = op(A) · op(B)` with each operand's address and row stride.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        c: u64,
        ldc: usize,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self {
        Self {
            a,
            lda,
            b,
            ldb,
            c,
            ldc,
            m,
            n,
            k,
        }
    }
}

fn op(transposed: bool) -> cublasOperation_t {
    match transposed {
        true => cublasOperation_t::CUBLAS_OP_T,
        false => cublasOperation_t::CUBLAS_OP_N,
    }
}

/// cuBLAS's compute type for a precision: IEEE f32 (PyTorch's `allow_tf32 = False`, with the
/// handle's default math mode), TF32 tensor cores, or (bf16) f32 accumulation of the bf16
/// operands the path converted. `CUBLAS_COMPUTE_32F_FAST_16BF` on f32 operands, tried first,
/// ran at exactly the TF32 rate on the H100 (BENCHMARKS §14), so bf16 converts its operands.
pub(crate) fn compute_type(precision: GemmPrecision) -> cublasComputeType_t {
    match precision {
        GemmPrecision::F32 | GemmPrecision::Bf16 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
        GemmPrecision::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
    }
}

impl Role {
    /// A role of `products`.
    pub(crate) fn new(
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
        bf16: bool,
        products: Vec<Product>,
    ) -> Self {
        Self {
            trans_a,
            trans_b,
            accumulate,
            bf16,
            products,
        }
    }

    /// The operands' data type.
    fn operands(&self) -> cudaDataType_t {
        match self.bf16 {
            true => cudaDataType_t::CUDA_R_16BF,
            false => cudaDataType_t::CUDA_R_32F,
        }
    }

    /// Bytes per element of `A` and `B`.
    fn operand_bytes(&self) -> usize {
        if self.bf16 {
            2
        } else {
            4
        }
    }

    /// The same role over the products at `indices`.
    pub(crate) fn subset(&self, indices: &[usize]) -> Self {
        Self {
            products: indices.iter().map(|&i| self.products[i]).collect(),
            ..Self::new(self.trans_a, self.trans_b, self.accumulate, self.bf16, Vec::new())
        }
    }

    /// The products that can share batched calls, in the column-major call's terms.
    pub(crate) fn batches(&self) -> Batches {
        let (shapes, addresses): (Vec<CallShape>, Vec<[u64; 3]>) = self
            .products
            .iter()
            .map(|p| {
                let (_, _, m, n, k, a, lda, b, ldb) = self.call(p);
                let shape = CallShape {
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc: p.ldc,
                };
                (shape, [a, b, p.c])
            })
            .unzip();
        let bytes = self.operand_bytes();
        batches(&shapes, &addresses, [bytes, bytes, 4])
    }
}

fn to_int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| MoeError::Backend(format!("cuBLAS: {what} {v} does not fit in an int")))
}

fn status(what: &str, s: blas::cublasStatus_t) -> Result<()> {
    s.result()
        .map_err(|e| MoeError::Backend(format!("cuBLAS {what}: {e:?}")))
}

/// Whether this process's cuBLAS has the grouped call (cuBLAS 12.5 and later).
pub(crate) fn has_grouped() -> bool {
    // SAFETY: looks the symbol up in the loaded library; calls nothing.
    unsafe {
        blas::is_culib_present()
            && blas::culib()
                .get::<unsafe extern "C" fn()>(b"cublasGemmGroupedBatchedEx\0")
                .is_ok()
    }
}

impl Role {
    /// The column-major call's `(transa, transb, m, n, k, A, lda, B, ldb)` for a product.
    fn call(&self, p: &Product) -> (bool, bool, usize, usize, usize, u64, usize, u64, usize) {
        (self.trans_b, self.trans_a, p.n, p.m, p.k, p.b, p.ldb, p.a, p.lda)
    }

    /// One `cublasGemmEx` per product, on the handle's stream.
    pub(crate) fn run_looped(&self, handle: blas::cublasHandle_t, precision: GemmPrecision) -> Result<()> {
        let alpha = 1.0f32;
        let beta = if self.accumulate { 1.0f32 } else { 0.0 };
        for p in &self.products {
            let (ta, tb, m, n, k, a, lda, b, ldb) = self.call(p);
            // SAFETY: every address covers its operand at its stride (the path builds them
            // from the partition's layout and live buffers), alpha and beta are host values
            // (the handle's default pointer mode).
            let s = unsafe {
                blas::cublasGemmEx(
                    handle,
                    op(ta),
                    op(tb),
                    to_int(m, "m")?,
                    to_int(n, "n")?,
                    to_int(k, "k")?,
                    (&alpha as *const f32).cast::<c_void>(),
                    a as *const c_void,
                    self.operands(),
                    to_int(lda, "lda")?,
                    b as *const c_void,
                    self.operands(),
                    to_int(ldb, "ldb")?,
                    (&beta as *const f32).cast::<c_void>(),
                    p.c as *mut c_void,
                    cudaDataType_t::CUDA_R_32F,
                    to_int(p.ldc, "ldc")?,
                    compute_type(precision),
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            status("cublasGemmEx", s)?;
        }
        Ok(())
    }

    /// One batched call for `batch`'s products (`Role::batches`): strided where each operand
    /// steps evenly, else with the pointer tables written to `table` (room for three pointers
    /// per product) by a kernel on `stream` first. Returns `Ok(false)` where cuBLAS refuses the
    /// call (`NOT_SUPPORTED` or `INVALID_VALUE` for this compute type): nothing ran, and the
    /// caller takes the grouped or looped calls instead.
    pub(crate) fn run_batched(
        &self,
        handle: blas::cublasHandle_t,
        stream: &CudaStream,
        kernels: &Kernels,
        table: u64,
        precision: GemmPrecision,
        batch: &Batch,
    ) -> Result<bool> {
        let count = batch.products.len();
        if count == 0 {
            return Ok(true);
        }
        let s = batch.shape;
        let (ta, tb) = (op(self.trans_b), op(self.trans_a));
        let alpha = 1.0f32;
        let beta = if self.accumulate { 1.0f32 } else { 0.0 };
        let (m, n, k) = (to_int(s.m, "m")?, to_int(s.n, "n")?, to_int(s.k, "k")?);
        let (lda, ldb, ldc) = (
            to_int(s.lda, "lda")?,
            to_int(s.ldb, "ldb")?,
            to_int(s.ldc, "ldc")?,
        );
        let first = &self.products[batch.products[0]];
        let status_of = match batch.addressing {
            Addressing::Strided { a, b, c } => {
                // SAFETY: the first product's operands start at these addresses and the i-th
                // product's lie `i` strides further (`batches.rs` checked the constant steps
                // on the role's own addresses, each covering its operand); alpha and beta are
                // host values (the handle's default pointer mode).
                unsafe {
                    blas::cublasGemmStridedBatchedEx(
                        handle,
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast::<c_void>(),
                        first.b as *const c_void,
                        self.operands(),
                        lda,
                        a,
                        first.a as *const c_void,
                        self.operands(),
                        ldb,
                        b,
                        (&beta as *const f32).cast::<c_void>(),
                        first.c as *mut c_void,
                        cudaDataType_t::CUDA_R_32F,
                        ldc,
                        c,
                        to_int(count, "batch count")?,
                        compute_type(precision),
                        blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
            Addressing::Pointers => {
                let mut ptrs = vec![0u64; 3 * count];
                for (i, &at) in batch.products.iter().enumerate() {
                    let p = &self.products[at];
                    // The column-major call's A is the row-major product's B (`Role::call`).
                    ptrs[i] = p.b;
                    ptrs[count + i] = p.a;
                    ptrs[2 * count + i] = p.c;
                }
                kernels.fill_ptrs(stream, &ptrs, table)?;
                // SAFETY: the three device pointer tables are written by the kernel queued
                // before on the same stream, each pointer covering its operand at the batch's
                // shape; alpha and beta are host values.
                unsafe {
                    blas::cublasGemmBatchedEx(
                        handle,
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast::<c_void>(),
                        table as *const *const c_void,
                        self.operands(),
                        lda,
                        (table + 8 * count as u64) as *const *const c_void,
                        self.operands(),
                        ldb,
                        (&beta as *const f32).cast::<c_void>(),
                        (table + 16 * count as u64) as *const *mut c_void,
                        cudaDataType_t::CUDA_R_32F,
                        ldc,
                        to_int(count, "batch count")?,
                        compute_type(precision),
                        blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
        };
        match status_of {
            blas::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
            | blas::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE => Ok(false),
            other => status("batched GEMM", other).map(|_| true),
        }
    }

    /// One `cublasGemmGroupedBatchedEx` for every product, its pointer tables written to
    /// `table` (room for three pointers per product) by a kernel on `stream` first. Returns
    /// `Ok(false)` where cuBLAS refuses the call (`NOT_SUPPORTED` or `INVALID_VALUE` for this
    /// compute type): nothing ran, and the caller loops instead.
    pub(crate) fn run_grouped(
        &self,
        handle: blas::cublasHandle_t,
        stream: &CudaStream,
        kernels: &Kernels,
        table: u64,
        precision: GemmPrecision,
    ) -> Result<bool> {
        let count = self.products.len();
        if count == 0 {
            return Ok(true);
        }
        let mut ta = Vec::with_capacity(count);
        let mut tb = Vec::with_capacity(count);
        let (mut m, mut n, mut k) = (Vec::new(), Vec::new(), Vec::new());
        let (mut lda, mut ldb, mut ldc) = (Vec::new(), Vec::new(), Vec::new());
        let mut ptrs = vec![0u64; 3 * count];
        for (i, p) in self.products.iter().enumerate() {
            let (t_a, t_b, mm, nn, kk, a, la, b, lb) = self.call(p);
            ta.push(op(t_a));
            tb.push(op(t_b));
            m.push(to_int(mm, "m")?);
            n.push(to_int(nn, "n")?);
            k.push(to_int(kk, "k")?);
            lda.push(to_int(la, "lda")?);
            ldb.push(to_int(lb, "ldb")?);
            ldc.push(to_int(p.ldc, "ldc")?);
            ptrs[i] = a;
            ptrs[count + i] = b;
            ptrs[2 * count + i] = p.c;
        }
        kernels.fill_ptrs(stream, &ptrs, table)?;
        let alpha = vec![1.0f32; count];
        let beta = vec![if self.accumulate { 1.0f32 } else { 0.0 }; count];
        let group_size = vec![1i32; count];
        // SAFETY: the host arrays hold one entry per group and live until the call returns
        // (cuBLAS reads them then); the three device pointer tables are written by the
        // kernel queued before on the same stream, each pointer covering its operand.
        let s = unsafe {
            blas::cublasGemmGroupedBatchedEx(
                handle,
                ta.as_ptr(),
                tb.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr().cast::<c_void>(),
                table as *const *const c_void,
                self.operands(),
                lda.as_ptr(),
                (table + 8 * count as u64) as *const *const c_void,
                self.operands(),
                ldb.as_ptr(),
                beta.as_ptr().cast::<c_void>(),
                (table + 16 * count as u64) as *const *mut c_void,
                cudaDataType_t::CUDA_R_32F,
                ldc.as_ptr(),
                to_int(count, "group count")?,
                group_size.as_ptr(),
                compute_type(precision),
            )
        };
        match s {
            blas::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
            | blas::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE => Ok(false),
            other => status("cublasGemmGroupedBatchedEx", other).map(|_| true),
        }
    }
}
