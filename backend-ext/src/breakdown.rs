//! Where the cuBLAS expert path's time goes, piece by piece: the weights' bf16 conversion, each
//! GEMM role, the activation kernels, the hand-overs. No CUDA here, so it is tested on every
//! machine; the marks it reads are CUDA events that a timed path (`CublasOptions::timed`)
//! records on a lane's stream between the pieces of each section (`gemm/stopwatch.rs`).
//!
//! Why: a layer step's time says how far the path is from cuBLAS's dense rate, not where the
//! difference lies. The experts at GPT3-S took 1.3–1.7 ms against the dense GEMMs' 0.3–0.5 ms on
//! the same rows (BENCHMARKS §14), and bf16 was slower than TF32 there; whether the GEMMs, the
//! conversions, the element-wise kernels or the host's calls hold that time decides what to
//! change, and a lent GPU has minutes, not hours, to find out.

use std::fmt;

/// One piece's time over every section that ran it.
#[derive(Debug, Clone, PartialEq)]
pub struct PieceTime {
    /// What the piece is (`"X·W_in"`, `"convert weights"`, `"hand-over in"`, ...).
    pub piece: &'static str,
    /// How many sections ran it.
    pub runs: u64,
    /// Device time, ms: from the event before the piece to the event after it on the lane's
    /// stream, summed. Where the stream waited (the hand-over in waits for cubecl's stream),
    /// the wait is in it.
    pub device_ms: f64,
    /// Host time, ms: how long the calling thread took to queue the piece's calls, summed.
    pub host_ms: f64,
}

/// The pieces of the sections a path ran, in the order each piece first ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Breakdown {
    pieces: Vec<PieceTime>,
    sections: u64,
}

impl Breakdown {
    /// Every piece, in the order it first ran.
    pub fn pieces(&self) -> &[PieceTime] {
        &self.pieces
    }

    /// The piece named `piece`, if it ran.
    pub fn piece(&self, piece: &str) -> Option<&PieceTime> {
        self.pieces.iter().find(|p| p.piece == piece)
    }

    /// How many sections were read.
    pub fn sections(&self) -> u64 {
        self.sections
    }

    /// The device time of every piece together, ms.
    pub fn device_ms(&self) -> f64 {
        self.pieces.iter().map(|p| p.device_ms).sum()
    }

    /// The host time of every piece together, ms.
    pub fn host_ms(&self) -> f64 {
        self.pieces.iter().map(|p| p.host_ms).sum()
    }

    /// Adds `device_ms` and `host_ms` to `piece`'s time and counts one run of it.
    fn add(&mut self, piece: &'static str, device_ms: f64, host_ms: f64) {
        match self.pieces.iter_mut().find(|p| p.piece == piece) {
            Some(p) => {
                p.runs += 1;
                p.device_ms += device_ms;
                p.host_ms += host_ms;
            }
            None => self.pieces.push(PieceTime {
                piece,
                runs: 1,
                device_ms,
                host_ms,
            }),
        }
    }

    /// Adds one section's marks: `(piece, device ms, host ms)`, each time since any one
    /// origin, in the order they were made. The first mark opens the section (its name is not
    /// a piece); each later one closes the piece it names, which took the time since the mark
    /// before it. A section of one mark adds nothing but its count.
    ///
    /// # Panics
    /// Never; a mark whose device time runs backwards (which stream order rules out) adds its
    /// piece with zero device time rather than a negative one.
    pub(crate) fn add_section(&mut self, marks: &[(&'static str, f64, f64)]) {
        self.sections += 1;
        for pair in marks.windows(2) {
            let (_, d0, h0) = pair[0];
            let (piece, d1, h1) = pair[1];
            self.add(piece, (d1 - d0).max(0.0), (h1 - h0).max(0.0));
        }
    }

    /// Adds every piece and section of `other`, pieces new to `self` after its own.
    pub fn merge(&mut self, other: &Breakdown) {
        self.sections += other.sections;
        for p in &other.pieces {
            match self.pieces.iter_mut().find(|q| q.piece == p.piece) {
                Some(q) => {
                    q.runs += p.runs;
                    q.device_ms += p.device_ms;
                    q.host_ms += p.host_ms;
                }
                None => self.pieces.push(p.clone()),
            }
        }
    }

    /// Every time divided by `steps` (runs and sections too, rounded down): the breakdown of
    /// one step of `steps` alike. `steps` of 0 is taken as 1.
    pub fn per(&self, steps: u64) -> Breakdown {
        let s = steps.max(1);
        Breakdown {
            pieces: self
                .pieces
                .iter()
                .map(|p| PieceTime {
                    piece: p.piece,
                    runs: p.runs / s,
                    device_ms: p.device_ms / s as f64,
                    host_ms: p.host_ms / s as f64,
                })
                .collect(),
            sections: self.sections / s,
        }
    }
}

impl fmt::Display for Breakdown {
    /// A table: each piece's runs, device and host ms, and its share of the device time.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.device_ms();
        writeln!(
            f,
            "{:<28} {:>6} {:>10} {:>10} {:>6}",
            "piece", "runs", "device ms", "host ms", "share"
        )?;
        for p in &self.pieces {
            let share = if total > 0.0 {
                100.0 * p.device_ms / total
            } else {
                0.0
            };
            writeln!(
                f,
                "{:<28} {:>6} {:>10.3} {:>10.3} {:>5.1}%",
                p.piece, p.runs, p.device_ms, p.host_ms, share
            )?;
        }
        write!(
            f,
            "{:<28} {:>6} {:>10.3} {:>10.3}",
            "all pieces",
            self.sections,
            total,
            self.host_ms()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn each_mark_closes_the_piece_it_names() {
        let mut b = Breakdown::default();
        b.add_section(&[
            ("start", 10.0, 100.0),
            ("X·W_in", 11.5, 100.1),
            ("activation", 12.0, 100.3),
            ("A·W_out", 14.0, 100.35),
        ]);
        b.add_section(&[("start", 20.0, 200.0), ("X·W_in", 20.25, 200.5)]);
        let names: Vec<_> = b.pieces().iter().map(|p| p.piece).collect();
        assert_eq!(names, ["X·W_in", "activation", "A·W_out"]);
        let first = b.piece("X·W_in").unwrap();
        assert_eq!(first.runs, 2);
        assert!(close(first.device_ms, 1.75), "{first:?}");
        assert!(close(first.host_ms, 0.6), "{first:?}");
        let act = b.piece("activation").unwrap();
        assert!(close(act.device_ms, 0.5) && close(act.host_ms, 0.2), "{act:?}");
        assert!(b.piece("start").is_none());
        // The pieces of a section add up to its span, start to last mark.
        assert!(close(b.device_ms(), 4.0 + 0.25));
        assert_eq!(b.sections(), 2);
    }

    #[test]
    fn a_backward_mark_adds_no_negative_time() {
        let mut b = Breakdown::default();
        b.add_section(&[("start", 5.0, 1.0), ("hand-over in", 4.0, 1.5)]);
        let p = b.piece("hand-over in").unwrap();
        assert_eq!((p.runs, p.device_ms), (1, 0.0));
        assert!(close(p.host_ms, 0.5));
        // One mark: a section, no piece.
        b.add_section(&[("start", 1.0, 1.0)]);
        assert_eq!((b.sections(), b.pieces().len()), (2, 1));
    }

    #[test]
    fn merged_and_divided_breakdowns_keep_their_sums() {
        let mut a = Breakdown::default();
        a.add_section(&[("start", 0.0, 0.0), ("p", 2.0, 1.0)]);
        let mut b = Breakdown::default();
        b.add_section(&[("start", 0.0, 0.0), ("q", 3.0, 0.5), ("p", 7.0, 0.75)]);
        a.merge(&b);
        let names: Vec<_> = a.pieces().iter().map(|p| p.piece).collect();
        assert_eq!(names, ["p", "q"]);
        let p = a.piece("p").unwrap();
        assert_eq!(p.runs, 2);
        assert!(close(p.device_ms, 6.0) && close(p.host_ms, 1.25), "{p:?}");
        let half = a.per(2);
        assert!(close(half.device_ms(), 4.5), "{half:?}");
        assert_eq!((half.piece("p").unwrap().runs, half.sections()), (1, 1));
        assert_eq!(a.per(0), a);
        let text = a.to_string();
        assert!(text.contains("all pieces") && text.lines().count() == 4, "{text}");
    }
}
