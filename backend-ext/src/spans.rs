//! The f32 spans a section converts to bf16 (the bf16 precision), one copy per distinct span
//! however many of the section's products read it. No CUDA here, so it is tested on every
//! machine; `gemm/operands.rs` (`Halves::plan`) makes the copies.
//!
//! Why: the products of one section often share an operand. A dense product's backward reads
//! its output gradient twice (`g · rhsᵀ` and `lhsᵀ · g`), a model's q, k and v projections read
//! one input three times, and the experts' adapters share their inputs with the base products.
//! A copy per read converted the same floats again for each, a pass over the operand's memory
//! each time.

use std::collections::HashMap;

/// The distinct spans of `list` (`(address, floats)`) in the order they first occur, and for
/// each entry of `list` the index of its span among them. Spans are the same only where both
/// the address and the length agree: a shorter read of the same memory keeps a copy of its own
/// (the copy of the longer one would do, but the case does not occur and would need care).
pub(crate) fn distinct(list: &[(u64, usize)]) -> (Vec<(u64, usize)>, Vec<usize>) {
    let mut seen: HashMap<(u64, usize), usize> = HashMap::new();
    let mut spans = Vec::new();
    let index = list
        .iter()
        .map(|&span| {
            *seen.entry(span).or_insert_with(|| {
                spans.push(span);
                spans.len() - 1
            })
        })
        .collect();
    (spans, index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_read_by_several_products_is_converted_once() {
        // q, k and v of one input: the input three times, three weights.
        let list = [
            (100, 64),
            (1000, 4096),
            (100, 64),
            (9000, 2048),
            (100, 64),
            (20_000, 2048),
        ];
        let (spans, index) = distinct(&list);
        assert_eq!(spans, vec![(100, 64), (1000, 4096), (9000, 2048), (20_000, 2048)]);
        assert_eq!(index, vec![0, 1, 0, 2, 0, 3]);
        for (i, &span) in list.iter().enumerate() {
            assert_eq!(spans[index[i]], span, "entry {i} maps to its own span");
        }
    }

    #[test]
    fn the_same_address_with_another_length_keeps_its_own_copy() {
        let list = [(100, 64), (100, 32), (100, 64)];
        let (spans, index) = distinct(&list);
        assert_eq!(spans, vec![(100, 64), (100, 32)]);
        assert_eq!(index, vec![0, 1, 0]);
    }

    #[test]
    fn distinct_spans_stay_in_order() {
        let list = [(300, 8), (200, 8), (100, 8)];
        let (spans, index) = distinct(&list);
        assert_eq!(spans, list.to_vec());
        assert_eq!(index, vec![0, 1, 2]);
        assert_eq!(distinct(&[]), (vec![], vec![]));
    }
}
