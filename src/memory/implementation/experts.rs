//! The experts' steps in the replay: `C_i` forward and `C'_i` backward, expert by expert,
//! and the weight gradients stacked at the end of the backward.

use super::replay::Replay;
use crate::experts::Activation;
use crate::memory::Restore;

/// The name of a library section's bf16 copies of its products' operands.
const COPIES: &str = "bf16 operand copies";

impl Replay<'_> {
    /// `C_i`: every local expert's FFN on its rows.
    pub(super) fn compute(&mut self, i: usize) {
        if self.route.whole_partition() {
            return self.library_compute(i);
        }
        let (m, h, f) = (self.m, self.h, self.f);
        let name = format!("C_{i}");
        let keeps_hidden =
            self.strategy.hidden() != Restore::Recompute && self.strategy.hidden() != Restore::Recommunicate;
        // SwiGLU's silu(gate) · up holds one [r, H] temporary besides its result.
        let act_temp = match self.activation {
            Activation::SwiGlu => 1.0,
            // The clamped form measures as SwiGLU does with the counting allocator (the model
            // 4% above the measurement, tests/memory.rs): its extra temporaries are freed as
            // it goes, and counting them all at once overstated the peak by 45%.
            Activation::ClampedSwiGlu { .. } => 1.0,
            _ => 0.0,
        };
        let (mut outs, mut zs) = (0.0, 0.0);
        let copies = self.library_half();
        let experts: Vec<f64> = self.rows.recv[i].iter().map(|&r| r as f64).collect();
        for &r in experts.iter().filter(|&&r| r > 0.0) {
            let l = &mut self.ledger;
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z GEMM", 2.0 * r * f),
                    (COPIES, copies * (r * m + m * f)),
                ],
            );
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z", r * f),
                    ("activation", r * h),
                    ("activation temporaries", act_temp * r * h),
                ],
            );
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z", r * f),
                    ("activation", r * h),
                    ("output GEMM", 2.0 * r * m),
                    (COPIES, copies * (r * h + h * m)),
                ],
            );
            outs += r * m;
            if keeps_hidden {
                zs += r * f;
            }
        }
        let rows = self.recv(i);
        if experts.iter().filter(|&&r| r > 0.0).count() > 1 {
            self.ledger.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("concatenated", rows * m),
                ],
            );
        }
        self.after_compute(&name, i, rows);
    }

    /// The name of partition `i`'s `T_M` as the backward finds it: kept since the forward,
    /// or restored (prefetched, re-communicated or recomputed).
    pub(super) fn hidden_name(&self, i: usize) -> String {
        match self.strategy.hidden() {
            Restore::Keep => format!("saved T_M[{i}]"),
            _ => format!("T_M[{i}]"),
        }
    }

    /// The end of `C_i` on every route: `T_M` kept, staged for its offload or dropped as the
    /// strategy says, `T_DI` kept or dropped likewise, and `T_DO` made.
    pub(super) fn after_compute(&mut self, name: &str, i: usize, rows: f64) {
        let (m, f) = (self.m, self.f);
        let l = &mut self.ledger;
        match self.strategy.hidden() {
            Restore::Keep => l.alloc(name, format!("saved T_M[{i}]"), rows * f),
            Restore::Offload => l.alloc(name, "T_M buffer", rows * f),
            _ => {}
        }
        let di = format!("T_DI[{i}]");
        if self.strategy.dispatched() == Restore::Keep {
            l.rename(&di, format!("saved T_DI[{i}]"));
        } else {
            l.free(&di);
        }
        l.alloc(name, format!("T_DO[{i}]"), rows * m);
    }

    /// `C'_i`: every local expert's FFN backward on its rows (recomputing `T_M` where it was
    /// dropped), accumulating the weight gradients.
    pub(super) fn compute_backward(&mut self, i: usize) {
        if self.route.whole_partition() {
            return self.library_compute_backward(i);
        }
        let m = self.m;
        let name = format!("C'_{i}");
        let experts: Vec<f64> = self.rows.recv[i].iter().map(|&r| r as f64).collect();
        let mut grads_x = 0.0;
        // The partition's T_M is freed expert by expert as each expert's z is consumed.
        let hidden_name = self.hidden_name(i);
        for (e, &r) in experts.iter().enumerate().filter(|(_, &r)| r > 0.0) {
            self.expert_backward(&name, e, r, &hidden_name, grads_x);
            grads_x += r * m;
        }
        let rows = self.recv(i);
        let l = &mut self.ledger;
        if experts.iter().filter(|&&r| r > 0.0).count() > 1 {
            l.at(
                &name,
                &[("input gradients so far", grads_x), ("concatenated", rows * m)],
            );
        }
        l.free(&hidden_name);
        l.free(&format!("dT_DO[{i}]"));
        l.free(&format!("T_DI[{i}]"));
        l.free(&format!("saved T_DI[{i}]"));
        l.alloc(&name, format!("dT_DI[{i}]"), rows * m);
    }

    /// One expert's share of `C'_i` on its `r` rows, with `grads_x` elements of the
    /// partition's input gradients already made by the experts before it.
    ///
    /// One ledger entry per buffer of `exchange/ffn/`'s expert backward, in its order: kept in one
    /// sequence so that it reads against that code line by line.
    fn expert_backward(&mut self, name: &str, e: usize, r: f64, hidden_name: &str, grads_x: f64) {
        let (m, h, f) = (self.m, self.h, self.f);
        let recompute = self.strategy.hidden() == Restore::Recompute;
        let (act_temp, grad_temp, grad_width) = match self.activation {
            Activation::Gelu => (0.0, 0.0, 0.0),
            Activation::Relu => (0.0, 0.0, h),
            // SwiGLU's backward: two [r, H] temporaries and the [r, 2H] result.
            Activation::SwiGlu => (h, 2.0 * h, f),
            // Measured like SwiGLU's, as above.
            Activation::ClampedSwiGlu { .. } => (h, 2.0 * h, f),
        };
        // On a bf16 library a batch's products hold their operands' copies together: the
        // second GEMM's weight and input gradients are one batch, the first GEMM's likewise
        // (`exchange/ffn/backward.rs`).
        let copies = self.library_half();
        let second_batch = copies * ((r * h + r * m) + (r * m + h * m));
        let first_batch = copies * ((r * m + r * f) + (r * f + m * f));
        // An expert's weight gradients are allocated by its first backward GEMMs and
        // added to in place by later partitions.
        let first = !self.grads_seen[e];
        self.grads_seen[e] = true;
        let l = &mut self.ledger;
        let z = if recompute {
            l.at(
                name,
                &[
                    ("input gradients so far", grads_x),
                    ("z GEMM (recompute)", 2.0 * r * f),
                    (COPIES, copies * (r * m + m * f)),
                ],
            );
            r * f
        } else {
            0.0
        };
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("z (recomputed)", z),
                ("activation", r * h),
                ("activation temporaries", act_temp * r),
            ],
        );
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("z (recomputed)", z),
                ("activation", r * h),
                ("dW_out GEMM", 2.0 * h * m),
                (COPIES, second_batch),
            ],
        );
        if first {
            l.grow(name, "expert weight gradients", h * m);
        }
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("z (recomputed)", z),
                ("dA GEMM", 2.0 * r * h),
                (COPIES, second_batch),
            ],
        );
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("z (recomputed)", z),
                ("dA", r * h),
                ("activation backward temporaries", r * (grad_temp + grad_width)),
            ],
        );
        // z is consumed by the activation's backward: let go here in issue order, but held to
        // the step's end by the threaded executor, which keeps what a step read until it has
        // fenced the step's stream (`fused/slots.rs`, `Slots::hold`).
        if !self.threaded {
            let consumed = r * f;
            if let Some(t) = l.live.iter_mut().find(|t| t.name == hidden_name) {
                t.elements = (t.elements - consumed).max(0.0);
            }
        }
        let dz = if grad_width > 0.0 { r * grad_width } else { r * h };
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("dZ", dz),
                ("dW_in GEMM", 2.0 * m * f),
                (COPIES, first_batch),
            ],
        );
        if first {
            l.grow(name, "expert weight gradients", m * f);
        }
        l.at(
            name,
            &[
                ("input gradients so far", grads_x),
                ("dZ", dz),
                ("dX GEMM", 2.0 * r * m),
                (COPIES, first_batch),
            ],
        );
    }

    /// The end of the backward: the weight gradients are stacked role by role
    /// (`ffn/grad_acc.rs`, `ExpertGradAcc::finish`). An expert that received no rows gets zeros, and with
    /// more than one local expert the concatenation copies a role's gradients while its
    /// per-expert parts are still held; with the threaded executor every role's, since the
    /// parts are held until the caller's stream has read them (`finish_on_caller`).
    pub(super) fn stack_weight_gradients(&mut self) {
        if self.route.whole_partition() {
            return self.library_finish();
        }
        let (m, h, f) = (self.m, self.h, self.f);
        let experts = self.grads_seen.len() as f64;
        let unseen = self.grads_seen.iter().filter(|&&seen| !seen).count() as f64;
        self.grads_seen.iter_mut().for_each(|seen| *seen = true);
        let l = &mut self.ledger;
        if unseen > 0.0 {
            l.grow(
                "stack weight gradients",
                "expert weight gradients",
                unseen * (h * m + m * f),
            );
        }
        if self.threaded {
            // `ExpertGradAcc::finish_on_caller`: every role stacked (or, one expert, copied)
            // while the running sums are held until the caller's stream has read them.
            l.at(
                "stack weight gradients",
                &[("stacked copies of every role", experts * (h * m + m * f))],
            );
        } else if experts > 1.0 {
            l.at(
                "stack weight gradients",
                &[("stacked copy of one role", experts * (m * f).max(h * m))],
            );
        }
    }
}
