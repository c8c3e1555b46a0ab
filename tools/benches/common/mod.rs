//! What every bench of this folder shares: criterion set up as the training example runs.

use criterion::Criterion;

/// Criterion for the layer's benches: freed memory kept for the next step, as the training
/// example runs (`mpipemoe::heap::keep_freed_memory`), and criterion's own plots off, since
/// they need a system font (the benches that chart draw their charts themselves).
pub fn criterion() -> Criterion {
    mpipemoe::heap::keep_freed_memory();
    Criterion::default().without_plots()
}
