//! The experts' steps in the replay where a path's job takes the whole partition
//! ([`ExpertRoute::Tasks`], [`ExpertRoute::PartitionScratch`]): the partition buffers that
//! `exchange/ffn/library.rs` hands the job, the path's own transients, and the stacked weight
//! gradients, whole from the backward's first job.

use super::replay::Replay;
use crate::experts::Activation;
use crate::memory::{ExpertRoute, GemmOperands, Restore};

/// The live name of the bf16 copies of the experts' matrices that a pass's jobs read.
pub(super) const WEIGHT_COPIES: &str = "bf16 weight copies";

/// The same copies kept from the forward for the backward (the step's).
pub(super) const SAVED_WEIGHT_COPIES: &str = "saved: bf16 weight copies";

impl Replay<'_> {
    /// Partition `i`'s experts with rows, largest first: `(expert, rows)`.
    fn experts_by_size(&self, i: usize) -> Vec<(usize, f64)> {
        let mut experts: Vec<(usize, f64)> = self.rows.recv[i]
            .iter()
            .enumerate()
            .filter(|(_, &r)| r > 0)
            .map(|(e, &r)| (e, r as f64))
            .collect();
        experts.sort_by(|a, b| b.1.total_cmp(&a.1));
        experts
    }

    /// The most that the `concurrent` largest experts of partition `i` hold at once, if
    /// each holds `per_expert(rows)`.
    fn largest_at_once(&self, i: usize, concurrent: usize, per_expert: impl Fn(f64) -> f64) -> f64 {
        self.experts_by_size(i)
            .iter()
            .take(concurrent.max(1))
            .map(|&(_, r)| per_expert(r))
            .sum()
    }

    /// The bf16 copies of every slot's two matrices (half an element each), made by a pass's
    /// first job that converts (`gemm/operands.rs`, `PassHalves::copies`: once per lane and
    /// pass or step, the shadows' copies among the slots) unless the pass already holds
    /// them: this pass's, or the forward's kept for the step.
    pub(super) fn make_weight_copies(&mut self, step: &str) {
        let GemmOperands::Bf16 { weights_for_step } = self.route.operands() else {
            return;
        };
        let held =
            self.ledger.holds(WEIGHT_COPIES) || (weights_for_step && self.ledger.holds(SAVED_WEIGHT_COPIES));
        if !held {
            let slots = self.grads_seen.len() as f64;
            self.ledger.alloc(step, WEIGHT_COPIES, 0.5 * slots * self.params);
        }
    }

    /// The end of the forward's exchange: its pass store goes with it (`ExpertGroups::pass`),
    /// while the step's is handed to the backward (`ExpertGroups::step`).
    pub(super) fn forward_weight_copies_end(&mut self) {
        match self.route.operands() {
            GemmOperands::Bf16 {
                weights_for_step: true,
            } => self.ledger.rename(WEIGHT_COPIES, SAVED_WEIGHT_COPIES),
            _ => {
                self.ledger.free(WEIGHT_COPIES);
            }
        }
    }

    /// `C_i` as one job over the partition (`exchange/ffn/library.rs`, `compute_on`): `T_M`'s
    /// and `T_DO`'s buffers, whole, then the path's transients.
    pub(super) fn library_compute(&mut self, i: usize) {
        let (m, h, f) = (self.m, self.h, self.f);
        let name = format!("C_{i}");
        let rows = self.recv(i);
        // A job without rows returns before it converts anything (`gemm/forward.rs`).
        if rows > 0.0 {
            self.make_weight_copies(&name);
        }
        let transient = match self.route {
            // Flex (`flex_experts.rs`, `forward`): each running expert's `z` in a vector of
            // its own, then its activation (Flex's activation kernels hold nothing besides
            // their result, `experts/flex_swiglu.rs`); its second product is written into
            // `T_DO`.
            ExpertRoute::Tasks { concurrent } => self.largest_at_once(i, concurrent, |r| r * f + r * h),
            // cuBLAS (`gemm/forward.rs`): the activation of every row in one scratch buffer;
            // both GEMMs write into the partition buffers. At bf16 the activation is bf16
            // (the second GEMM reads it) beside a bf16 copy of `T_DI`.
            _ => match self.route.operands() {
                GemmOperands::F32 => rows * h,
                GemmOperands::Bf16 { .. } => 0.5 * rows * (h + m),
            },
        };
        self.ledger.at(
            &name,
            &[
                ("T_M (partition buffer)", rows * f),
                ("T_DO (partition buffer)", rows * m),
                ("path transients", transient),
            ],
        );
        self.after_compute(&name, i, rows);
    }

    /// `C'_i` as one job over the partition (`compute_backward_on`): `dT_DI`'s buffer, the
    /// stacked running sums (made whole by the backward's first job), then the path's
    /// transients.
    pub(super) fn library_compute_backward(&mut self, i: usize) {
        let (m, h, f) = (self.m, self.h, self.f);
        let name = format!("C'_{i}");
        let rows = self.recv(i);
        self.ledger.alloc(&name, format!("dT_DI[{i}]"), rows * m);
        let fresh = !self.backward_started;
        self.backward_started = true;
        // The backward's first job converts even without rows, since it zeroes the fresh
        // sums of every slot (`gemm/backward.rs`); a later one without rows returns first.
        if fresh || rows > 0.0 {
            self.make_weight_copies(&name);
        }
        if fresh {
            // Every slot's sums at once (`ExpertGradAcc::take_stacked`), written whole by
            // this first job.
            let slots = self.grads_seen.len() as f64;
            self.grads_seen.iter_mut().for_each(|seen| *seen = true);
            self.ledger
                .grow(&name, "expert weight gradients", slots * self.params);
        }
        let recompute = self.strategy.hidden() == Restore::Recompute;
        // The width of the activation's backward result besides `dA` (Flex's kernels hold
        // nothing else): SwiGLU's `[r, 2H]`, ReLU's `[r, H]`; none for GELU, whose
        // derivative is written over `dA` (as `experts.rs` counts it).
        let grad_width = match self.activation {
            Activation::SwiGlu | Activation::ClampedSwiGlu { .. } => f,
            Activation::Relu => h,
            Activation::Gelu => 0.0,
        };
        // `dT_M`, what the first GEMM's gradient reads: the backward's result, or `dA` where
        // the derivative was written over it.
        let grad_z = if grad_width > 0.0 { grad_width } else { h };
        let transient = match self.route {
            // Flex (`flex_experts.rs`, `backward`), one running expert's moments: `dW_out`'s
            // product (into a temporary of a slot's size when the sums are not fresh), then
            // `dA` and the activation's backward, then `dW_in`'s product likewise; its `dX`
            // is written into `dT_DI`.
            ExpertRoute::Tasks { concurrent } => {
                let slot_temp = |size: f64| if fresh { 0.0 } else { size };
                let per_expert = |r: f64| {
                    let z = if recompute { r * f } else { 0.0 };
                    // The activation's value, recomputed.
                    let a = r * h;
                    let w_out = z + a + slot_temp(h * m);
                    let grad = z + a + r * h + r * grad_width;
                    let w_in = z + a + r * grad_z + slot_temp(m * f);
                    w_out.max(grad).max(w_in)
                };
                self.largest_at_once(i, concurrent, per_expert)
            }
            // cuBLAS (`gemm/backward.rs`): `dA`, `A` and `dT_M` for every row, and `T_M`
            // recomputed into scratch where it was dropped (f32: the path writes it as the
            // forward does); the weight GEMMs add into the sums in place. At bf16, `A` and
            // `dT_M` (which GEMMs read) are bf16, `dA` (which one writes) f32, and `T_DI` and
            // `dT_DO` have bf16 copies.
            _ => {
                let z = if recompute { rows * f } else { 0.0 };
                match self.route.operands() {
                    GemmOperands::F32 => z + rows * (2.0 * h + f),
                    GemmOperands::Bf16 { .. } => z + rows * (m + 1.5 * h + 0.5 * f),
                }
            }
        };
        self.ledger.at(&name, &[("path transients", transient)]);
        let hidden_name = self.hidden_name(i);
        let l = &mut self.ledger;
        l.free(&hidden_name);
        l.free(&format!("dT_DO[{i}]"));
        l.free(&format!("T_DI[{i}]"));
        l.free(&format!("saved T_DI[{i}]"));
    }

    /// The backward's end on a whole-partition route (`ExpertGradAcc::finish` and
    /// `finish_on_caller`): the stacked sums are the gradients as they stand, but with
    /// shadows (whose slots are unstacked, folded and stacked again: the new stack made while
    /// the sums are held), and with the threaded executor (the gradients handed back are a
    /// copy made on the caller's stream while the sums are still held).
    pub(super) fn library_finish(&mut self) {
        let own = self.grads_seen.len() as f64 * self.params;
        let restack = if self.shadows > 0.0 { own } else { 0.0 };
        let threaded = if self.threaded { own } else { 0.0 };
        self.ledger.at(
            "stack weight gradients",
            &[
                ("stacked again", restack),
                ("copy on the caller's stream", threaded),
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::memory::{
        Execution, ExpertRoute, GemmOperands, ImplementationModel, LayerShape, RankRows, Strategy,
    };
    use crate::GemmPrecision;

    /// `experts` experts on one rank (GELU, 1,024 tokens, `M = 128`, `H = 512`), balanced.
    fn model(experts: usize, n: usize, strategy: Strategy, route: ExpertRoute) -> ImplementationModel {
        let shape = LayerShape {
            n_experts: experts,
            ..LayerShape::paper(1024, 128, 512, 1, n)
        };
        model_of(&shape, strategy, route)
    }

    /// `shape` on one rank, balanced, in issue order.
    fn model_of(shape: &LayerShape, strategy: Strategy, route: ExpertRoute) -> ImplementationModel {
        ImplementationModel::for_execution(
            shape,
            &RankRows::balanced(shape),
            strategy,
            Execution::in_order(route),
        )
    }

    /// The elements of `name` live at `phase`.
    fn live(phase: &super::super::Phase, name: &str) -> f64 {
        phase
            .terms
            .iter()
            .filter(|t| t.name == name)
            .map(|t| t.elements)
            .sum()
    }

    /// The elements of `name` live at the higher of the two passes' peaks.
    fn term(model: &ImplementationModel, name: &str) -> f64 {
        live(&model.forward, name).max(live(&model.backward, name))
    }

    /// Experts as tasks: as many transients at once as experts run at once, never more than
    /// the partition has experts; the stacked sums of every slot; the partition's scratch on a
    /// library. A route that ignored its concurrency, counted more running experts than there
    /// are, left slots out of the sums or sized the scratch by one expert fails it. (Each
    /// check reads the terms live at a pass's peak.)
    #[test]
    fn each_route_holds_what_its_code_holds() {
        let tasks =
            |experts, concurrent| model(experts, 1, Strategy::None, ExpertRoute::Tasks { concurrent });
        let transients = |m: &ImplementationModel| term(m, "path transients");
        // Four experts of 256 rows: two at once hold twice one's transients.
        let (one, two, four) = (tasks(4, 1), tasks(4, 2), tasks(4, 4));
        assert!(transients(&one) > 0.0);
        assert_eq!(transients(&two), 2.0 * transients(&one));
        assert_eq!(transients(&four), 4.0 * transients(&one));
        // One expert: more threads than experts change nothing.
        assert_eq!(tasks(1, 8).peak_device(), tasks(1, 1).peak_device());
        // The sums: every slot's parameters, made at once by the backward's first job.
        let params = 4.0 * 2.0 * 128.0 * 512.0;
        assert_eq!(term(&one, "expert weight gradients"), params);
        // A library's scratch: the whole partition's activation forward (1,024 rows of H),
        // backward `dA`, the activation and `dT_M`, and `T_M` again where S4 recomputes it.
        let scratch = |strategy| model(4, 1, strategy, ExpertRoute::partition_scratch(GemmPrecision::F32));
        assert_eq!(
            term(&scratch(Strategy::None), "path transients"),
            1024.0 * 3.0 * 512.0
        );
        assert_eq!(
            term(&scratch(Strategy::S4), "path transients"),
            1024.0 * 4.0 * 512.0
        );
    }

    /// The bf16 operands of the cuBLAS route: half an element for each copy and for the
    /// scratch a GEMM reads, and the copies of every slot's matrices, held through each pass
    /// (made again by the backward), or from the forward through the backward once where
    /// they are the step's. A model that ignored the copies, counted them whole, made them
    /// twice a step where the step keeps them, or saved a pass's for the backward fails it.
    #[test]
    fn bf16_operands_hold_their_copies() {
        let bf16 = |weights_for_step| ExpertRoute::PartitionScratch {
            operands: GemmOperands::Bf16 { weights_for_step },
        };
        let f32 = model(
            4,
            4,
            Strategy::None,
            ExpertRoute::partition_scratch(GemmPrecision::F32),
        );
        let pass = model(4, 4, Strategy::None, bf16(false));
        let step = model(4, 4, Strategy::None, bf16(true));
        // Four slots' two 128 × 512 matrices, half an element each.
        let copies = 0.5 * 4.0 * 2.0 * 128.0 * 512.0;
        for (m, name) in [
            (&pass, "bf16 weight copies"),
            (&step, "saved: bf16 weight copies"),
        ] {
            assert_eq!(live(&m.backward, name), copies, "{name} at the backward's peak");
        }
        assert_eq!(live(&pass.forward, "bf16 weight copies"), copies);
        // The step's copies are the forward's, kept for the backward: once, and saved.
        assert_eq!(live(&step.backward, "bf16 weight copies"), 0.0);
        assert!(step.saved.iter().any(|t| t.name == "saved: bf16 weight copies"));
        assert!(!pass.saved.iter().any(|t| t.name.contains("bf16")));
        // A pass's copies go with it: nothing of them is saved, and the pass store of the
        // forward is not live at the backward's peak besides the backward's own.
        assert_eq!(live(&pass.backward, "saved: bf16 weight copies"), 0.0);
        // The scratch of a partition of 256 rows: forward the bf16 activation and `T_DI`'s
        // copy; backward `dA` in f32, the activation and `dT_M` in bf16, the copies of
        // `T_DI` and `dT_DO` (GELU: the inner width is the hidden one).
        let rows = 256.0;
        let backward = rows * (128.0 + 1.5 * 512.0 + 0.5 * 512.0);
        assert_eq!(term(&pass, "path transients"), backward);
        assert_eq!(term(&f32, "path transients"), rows * 3.0 * 512.0);
        assert_eq!(
            live(&pass.forward, "path transients"),
            rows * 0.5 * (512.0 + 128.0),
            "{:?}",
            pass.forward
        );
        // Where the copies dominate (these small partitions), bf16 peaks above f32.
        assert!(pass.peak_device() > f32.peak_device());
    }

    /// The primitives' products on a bf16 library (experts with adapters on CUDA): each
    /// batch's section holds half an element for each element of its products' operands,
    /// both products of a backward batch at once. At the test shape (64 rows an expert and
    /// partition) the backward's peak is at `dW_out`'s batch with `aᵀ · g` and `g · w_outᵀ`:
    /// a, g, g and w_out. With wide experts and few rows (32 rows, `M` 1,024, `H` 4,096), the
    /// output GEMM's copy of `w_out` sets the forward's peak: 4.6 times the primitives' own.
    /// On f32 operands the route replays as the primitives do. A replay that ignored the
    /// copies, counted them whole, or counted one product of a batch fails it.
    #[test]
    fn the_primitives_products_on_a_bf16_library_hold_their_copies() {
        let route = |precision| ExpertRoute::LibraryProducts {
            operands: GemmOperands::at(precision, false),
        };
        let plain = model(4, 4, Strategy::None, ExpertRoute::ExpertByExpert);
        assert_eq!(model(4, 4, Strategy::None, route(GemmPrecision::F32)), plain);
        let bf16 = model(4, 4, Strategy::None, route(GemmPrecision::Bf16));
        let (r, m, h) = (64.0, 128.0, 512.0);
        let batch = 0.5 * ((r * h + r * m) + (r * m + h * m));
        assert_eq!(live(&bf16.backward, "bf16 operand copies"), batch);
        assert_eq!(bf16.backward.elements, plain.backward.elements + batch);
        // Wide experts, few rows: 64 tokens on 2 experts, one partition.
        let shape = LayerShape {
            n_experts: 2,
            ..LayerShape::paper(64, 1024, 4096, 1, 1)
        };
        let wide = |route| model_of(&shape, Strategy::None, route);
        let (plain, bf16) = (
            wide(ExpertRoute::ExpertByExpert),
            wide(route(GemmPrecision::Bf16)),
        );
        let (r, m, h) = (32.0, 1024.0, 4096.0);
        assert_eq!(live(&bf16.forward, "bf16 operand copies"), 0.5 * (r * h + h * m));
        assert!(bf16.forward.elements > 4.5 * plain.forward.elements);
    }

    /// The shared expert's products on a bf16 library: each converts its operands for its
    /// section. A shape where they are the passes' peaks (a wide shared expert, tiny routed
    /// experts, `M` above half the tokens): the forward's at the first product (x and
    /// `w_in`), the backward's at the first product's backward (the SwiGLU's gradient,
    /// `w_in` and x). A replay that ignored the copies, or counted them whole, fails it.
    #[test]
    fn the_shared_experts_bf16_products_hold_their_copies() {
        let (t, m, hs) = (256.0, 1024.0, 8192.0);
        let shape = LayerShape {
            n_experts: 2,
            shared_expert: Some(8192),
            ..LayerShape::paper(256, 1024, 16, 1, 1)
        };
        let run = |precision| model_of(&shape, Strategy::None, ExpertRoute::partition_scratch(precision));
        let (f32, bf16) = (run(GemmPrecision::F32), run(GemmPrecision::Bf16));
        assert_eq!(bf16.forward.step, "shared expert", "{:?}", bf16.forward);
        assert_eq!(
            live(&bf16.forward, "bf16 operand copies"),
            0.5 * (t * m + 2.0 * m * hs)
        );
        assert_eq!(
            bf16.backward.step, "shared expert backward",
            "{:?}",
            bf16.backward
        );
        assert_eq!(
            live(&bf16.backward, "bf16 operand copies"),
            0.5 * (2.0 * t * hs + 2.0 * m * hs + t * m)
        );
        for pass in [&f32.forward, &f32.backward] {
            assert_eq!(live(pass, "bf16 operand copies"), 0.0);
        }
        assert!(bf16.peak_device() > f32.peak_device());
    }

    /// The threaded executor: the assembled rows in a buffer made before the first step
    /// (one partition too), what a step read held to the step's end (the primitives' `z`,
    /// which issue order lets go expert by expert), and the gradients handed back as copies
    /// made while the running sums are held (every role at once on the primitives; the
    /// stacked sums on a library). A replay that ignored any of the four fails it.
    #[test]
    fn the_threaded_executor_holds_what_its_code_holds() {
        let run = |tokens, route, threaded| {
            let shape = LayerShape {
                n_experts: 4,
                ..LayerShape::paper(tokens, 128, 512, 1, 1)
            };
            let execution = Execution { route, threaded };
            ImplementationModel::for_execution(&shape, &RankRows::balanced(&shape), Strategy::None, execution)
        };
        let tasks = ExpertRoute::Tasks { concurrent: 1 };
        let (in_order, threaded) = (run(1024, tasks, false), run(1024, tasks, true));
        // `dT_I` at the backward's peak (`C'_0`): assembled from the start, or not yet made.
        assert_eq!(threaded.backward.step, "C'_0");
        assert_eq!(live(&threaded.backward, "dT_I"), 1024.0 * 128.0);
        assert_eq!(live(&in_order.backward, "dT_I"), 0.0);
        // The primitives' `z`: whole at the end of `C'_0` where the step holds it.
        let primitives = ExpertRoute::ExpertByExpert;
        let (in_order, threaded) = (run(1024, primitives, false), run(1024, primitives, true));
        let z = 1024.0 * 512.0;
        assert_eq!(
            live(&threaded.backward, "saved T_M[0]"),
            z,
            "{:?}",
            threaded.backward
        );
        assert!(
            live(&in_order.backward, "saved T_M[0]") < z,
            "{:?}",
            in_order.backward
        );
        // Few tokens: the gradients' hand-back is the peak. Four experts' parameters.
        let params = 4.0 * 2.0 * 128.0 * 512.0;
        let scratch = ExpertRoute::partition_scratch(GemmPrecision::F32);
        let (in_order, threaded) = (run(16, scratch, false), run(16, scratch, true));
        assert_eq!(live(&threaded.backward, "copy on the caller's stream"), params);
        assert_eq!(live(&in_order.backward, "copy on the caller's stream"), 0.0);
        let (in_order, threaded) = (run(16, primitives, false), run(16, primitives, true));
        assert_eq!(live(&threaded.backward, "stacked copies of every role"), params);
        assert_eq!(
            live(&in_order.backward, "stacked copy of one role"),
            params / 8.0 * 4.0
        );
    }
}
