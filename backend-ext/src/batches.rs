//! Which of one role's expert products can share a batched cuBLAS call: products whose every
//! dimension and row stride agree (each expert with the same rows, as balanced or
//! capacity-padded routing gives), found in the order the role lists them, with the constant
//! address step of each operand where there is one. No CUDA here, so it is tested on every
//! machine; `gemm/blas.rs` makes the calls.
//!
//! Why batch: cuBLAS's grouped call runs warp-level MMA kernels, while its batched calls get
//! the kernels of a single GEMM (on Hopper, warpgroup MMA) over every product at once (NVIDIA,
//! "Introducing Grouped GEMM APIs in cuBLAS and More Performance Updates", 2024). The grouped
//! call reached 0.30-0.55 of cuBLAS's dense rate on one H200 at TF32 and bf16 (BENCHMARKS
//! §14b); one `cublasGemmEx` per expert gets the fast kernel but runs the experts one after
//! another, each too small to fill the GPU at 512 rows.

use std::collections::HashMap;

/// One product as a column-major cuBLAS call sees it: `C[m, n] = op(A) · op(B)` with leading
/// dimensions, the role's transpositions and scalars being common to all its products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CallShape {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) lda: usize,
    pub(crate) ldb: usize,
    pub(crate) ldc: usize,
}

/// How a batch addresses its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Addressing {
    /// Each operand's address advances by a constant positive number of elements from one
    /// product to the next (`cublasGemmStridedBatchedEx`: no pointer tables).
    Strided { a: i64, b: i64, c: i64 },
    /// Anything else (`cublasGemmBatchedEx` with device arrays of pointers).
    Pointers,
}

/// Products of one shape, to run as one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    /// The products' indices in the role, in the role's order.
    pub(crate) products: Vec<usize>,
    pub(crate) shape: CallShape,
    pub(crate) addressing: Addressing,
}

/// A role's products split into batches (two products or more each) and the rest, which keep
/// the grouped or looped calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Batches {
    pub(crate) batches: Vec<Batch>,
    pub(crate) rest: Vec<usize>,
}

/// The batches of products with `shapes[i]` and operand addresses `addresses[i]` (`[a, b, c]`,
/// in bytes), whose elements take `bytes` (`[a, b, c]`) each.
///
/// # Panics
/// If `shapes` and `addresses` differ in length (a caller's bug).
pub(crate) fn batches(shapes: &[CallShape], addresses: &[[u64; 3]], bytes: [usize; 3]) -> Batches {
    assert_eq!(shapes.len(), addresses.len(), "one address triple per product");
    let mut by_shape: HashMap<CallShape, usize> = HashMap::new();
    let mut groups: Vec<(CallShape, Vec<usize>)> = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let at = *by_shape.entry(*shape).or_insert_with(|| {
            groups.push((*shape, Vec::new()));
            groups.len() - 1
        });
        groups[at].1.push(i);
    }
    let mut out = Batches::default();
    for (shape, products) in groups {
        if products.len() < 2 {
            out.rest.extend(products);
            continue;
        }
        let step = |operand: usize| {
            let list: Vec<u64> = products.iter().map(|&i| addresses[i][operand]).collect();
            constant_step(&list, bytes[operand])
        };
        let addressing = match (step(0), step(1), step(2)) {
            (Some(a), Some(b), Some(c)) => Addressing::Strided { a, b, c },
            _ => Addressing::Pointers,
        };
        out.batches.push(Batch {
            products,
            shape,
            addressing,
        });
    }
    out.rest.sort_unstable();
    out
}

/// The constant step of `addresses` in elements of `bytes` bytes, where every step is the same
/// positive whole number of elements.
fn constant_step(addresses: &[u64], bytes: usize) -> Option<i64> {
    let first = addresses.get(1)?.checked_sub(addresses[0])?;
    if first == 0 || first % bytes as u64 != 0 {
        return None;
    }
    let all_same = addresses
        .windows(2)
        .all(|w| w[1].checked_sub(w[0]) == Some(first));
    all_same
        .then(|| i64::try_from(first / bytes as u64).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: usize, k: usize) -> CallShape {
        CallShape {
            m,
            n: 64,
            k,
            lda: k,
            ldb: 64,
            ldc: m,
        }
    }

    #[test]
    fn equal_shapes_with_even_steps_are_one_strided_batch() {
        let shapes = vec![shape(32, 16); 4];
        let addresses: Vec<[u64; 3]> = (0..4u64)
            .map(|e| [1000 + e * 512, 9000 + e * 256, 50_000 + e * 8192])
            .collect();
        let got = batches(&shapes, &addresses, [2, 2, 4]);
        assert_eq!(
            got,
            Batches {
                batches: vec![Batch {
                    products: vec![0, 1, 2, 3],
                    shape: shape(32, 16),
                    addressing: Addressing::Strided {
                        a: 256,
                        b: 128,
                        c: 2048
                    },
                }],
                rest: vec![],
            }
        );
    }

    #[test]
    fn uneven_rows_split_into_batches_of_equal_shape_and_the_rest() {
        // Rows 5, 3, 5, 7, 3, 5: the 5s and the 3s batch, the 7 stays alone.
        let rows = [5, 3, 5, 7, 3, 5];
        let shapes: Vec<CallShape> = rows.iter().map(|&r| shape(r, 16)).collect();
        let addresses: Vec<[u64; 3]> = (0..6u64).map(|e| [e * 4096, e * 4096, e * 4096]).collect();
        let got = batches(&shapes, &addresses, [4, 4, 4]);
        let products: Vec<Vec<usize>> = got.batches.iter().map(|b| b.products.clone()).collect();
        assert_eq!(products, vec![vec![0, 2, 5], vec![1, 4]]);
        assert_eq!(got.rest, vec![3]);
        // The 5s step by 2, then 3 experts' blocks: not a constant step.
        assert_eq!(got.batches[0].addressing, Addressing::Pointers);
        assert_eq!(
            got.batches[1].addressing,
            Addressing::Strided {
                a: 3072,
                b: 3072,
                c: 3072
            }
        );
    }

    #[test]
    fn a_shared_operand_or_an_odd_step_takes_pointer_tables() {
        let shapes = vec![shape(8, 8); 3];
        // A is the same ones row for every product (the bias gradients): step 0.
        let shared: Vec<[u64; 3]> = (0..3u64).map(|e| [4096, e * 1024, e * 1024]).collect();
        assert_eq!(
            batches(&shapes, &shared, [4, 4, 4]).batches[0].addressing,
            Addressing::Pointers
        );
        // A step that is not a whole number of elements.
        let odd: Vec<[u64; 3]> = (0..3u64).map(|e| [e * 1026, e * 1024, e * 1024]).collect();
        assert_eq!(
            batches(&shapes, &odd, [4, 4, 4]).batches[0].addressing,
            Addressing::Pointers
        );
        // Descending addresses.
        let down: Vec<[u64; 3]> = (0..3u64).map(|e| [8192 - e * 1024, e * 1024, e * 1024]).collect();
        assert_eq!(
            batches(&shapes, &down, [4, 4, 4]).batches[0].addressing,
            Addressing::Pointers
        );
    }

    #[test]
    fn products_differing_in_any_stride_do_not_batch() {
        let mut other = shape(8, 8);
        other.ldc = 9;
        let got = batches(&[shape(8, 8), other], &[[0, 0, 0], [64, 64, 64]], [4, 4, 4]);
        assert!(got.batches.is_empty());
        assert_eq!(got.rest, vec![0, 1]);
        assert_eq!(batches(&[], &[], [4, 4, 4]), Batches::default());
    }
}
