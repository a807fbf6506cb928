//! Products of activations with stored weights: `out = x · Wᵀ` for `t`
//! rows of activations, each output the row kernel of its weight row and
//! token ([`RowDot`]), so an output does not depend on how many tokens or
//! which rows share the call: a token's logits are the same alone, in a
//! prompt or in a batch.
//!
//! Work is split over the rayon pool by runs of weight rows. One token
//! (decode) writes its outputs in place; several tokens (prefill, batches)
//! go through token passes whose activations fit in half the L1 cache
//! ([`PASS_BYTES`]), each weight row meeting the pass eight tokens at a
//! time (the weights unpacked once per eight; the pass's last three to
//! seven tokens in lanes too where the type has token-lane kernels, else
//! four, then one by one), and each run's tile is then copied into the
//! output rows.

use rayon::prelude::*;

use super::activations::Activations;
use super::dot::{Isa, RowDot};
use super::matrix::{QuantMatrix, StoredLinear};
use crate::error::{ModelError, Result};

/// Tasks per pool thread a product is split into: enough to even out
/// threads that start late, few enough that each task's work (tens of
/// microseconds in a decode step) dwarfs rayon's cost of handing it out
/// (measured on SmolLM2: tasks of 16 rows spent 40% of a decode step in
/// the pool's scheduling).
const TASKS_PER_THREAD: usize = 4;
/// The fewest weight rows a task gets.
const MIN_ROWS_PER_TASK: usize = 16;

/// Weight rows per task of a product over `rows` rows.
fn rows_per_task(rows: usize) -> usize {
    rows.div_ceil(TASKS_PER_THREAD * rayon::current_num_threads())
        .max(MIN_ROWS_PER_TASK)
}
/// The fewest tokens left after the groups of eight that go through the
/// token lanes (filled up to eight) rather than the grouped kernels.
const LANES_FROM: usize = 3;

/// Bytes of activations a token pass over a run of weight rows reads
/// again for every row: half of a 32 KiB L1 data cache (measured on
/// Qwen2.5-0.5B's prefill: passes of 32 tokens, 36 KB of Q8_0 rows,
/// spent most of the product waiting for activation loads from L2).
const PASS_BYTES: usize = 16 << 10;

/// Tokens per pass for activation rows of `row_bytes`: a multiple of
/// [`RowDot::WIDEST`] (the widest grouped kernel), between that and 64.
fn tokens_per_pass(row_bytes: usize) -> usize {
    let w = RowDot::WIDEST;
    (PASS_BYTES / row_bytes.max(1)).clamp(w, 64) / w * w
}

/// The bytes [`prefetch_ahead`] asks for: the row of `len` bytes
/// [`PREFETCH_BYTES`] past `at`, cut to `0..total`; `None` where nothing
/// of it is inside.
#[inline(always)]
fn prefetch_range(total: usize, at: usize, len: usize) -> Option<std::ops::Range<usize>> {
    let start = at.checked_add(PREFETCH_BYTES)?;
    let end = start.saturating_add(len).min(total);
    (start < end).then_some(start..end)
}

/// How far ahead of the row being multiplied a one-token product asks
/// for the weight bytes: the hardware prefetcher alone left the one-token
/// kernels waiting on their weight loads (SmolLM2's decode on the Intel
/// host: over half of the `Q4_1` kernel's samples on the first
/// instruction after the load, `perf annotate`).
const PREFETCH_BYTES: usize = 2048;

/// Asks the CPU to bring the cache lines of `data[at + PREFETCH_BYTES ..
/// at + PREFETCH_BYTES + len]` into its caches (those inside `data`): the
/// row [`PREFETCH_BYTES`] ahead of the one at `at`, `len` bytes long.
#[inline(always)]
fn prefetch_ahead(data: &[u8], at: usize, len: usize) {
    let Some(ahead) = prefetch_range(data.len(), at, len).and_then(|r| data.get(r)) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    for line in ahead.chunks(64) {
        // SAFETY: a prefetch reads nothing and never faults; the address
        // is inside `data`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ahead;
}

impl QuantMatrix {
    /// `out[i·stride + offset + r] (=|+=) Σ_c a[i][c]·w[r][c]` for every
    /// token `i` of `a` and row `r` of this matrix; `a` must be quantised
    /// as this type's product needs ([`WeightType::activation`](super::WeightType::activation)).
    pub fn product_into(
        &self,
        a: &Activations,
        out: &mut [f32],
        stride: usize,
        offset: usize,
        accumulate: bool,
        isa: Isa,
    ) -> Result<()> {
        let kernel = RowDot::new(self.ty(), isa)?;
        if Some(a.kind()) != self.ty().activation() || a.cols() != self.cols() {
            return Err(ModelError::ShapeMismatch {
                what: "activation columns (in the form of the weights' type)",
                expected: self.cols(),
                got: a.cols(),
            });
        }
        let (t, rows) = (a.rows(), self.rows());
        if offset + rows > stride || out.len() != t * stride {
            return Err(ModelError::ShapeMismatch {
                what: "product outputs (tokens × stride)",
                expected: t * stride.max(offset + rows),
                got: out.len(),
            });
        }
        let put = |o: &mut f32, v: f32| {
            if accumulate { *o += v } else { *o = v }
        };
        let per_task = rows_per_task(rows);
        if t == 1 {
            out[offset..offset + rows]
                .par_chunks_mut(per_task)
                .enumerate()
                .for_each(|(c, out)| {
                    for (k, o) in out.iter_mut().enumerate() {
                        let r = c * per_task + k;
                        prefetch_ahead(self.data(), r * self.row_bytes(), self.row_bytes());
                        let w = self.row(r).expect("row in range");
                        put(o, kernel.dot(w, a, 0));
                    }
                });
            return Ok(());
        }
        // Built once here rather than by the first task to ask.
        kernel.prepare(a);
        let lanes = kernel.reads_token_lanes();
        let tasks = rows.div_ceil(per_task);
        let per_pass = tokens_per_pass(a.row_bytes());
        let tiles: Vec<Vec<f32>> = (0..tasks)
            .into_par_iter()
            .map(|c| {
                let first = c * per_task;
                let len = per_task.min(rows - first);
                let mut tile = vec![0.0f32; t * len];
                for pass in (0..t).step_by(per_pass) {
                    let tokens = pass..(pass + per_pass).min(t);
                    for k in 0..len {
                        let w = self.row(first + k).expect("row in range");
                        let mut i = tokens.start;
                        while i + 8 <= tokens.end {
                            for (n, v) in kernel.dot8(w, a, i).into_iter().enumerate() {
                                tile[(i + n) * len + k] = v;
                            }
                            i += 8;
                        }
                        // A last group of three to seven tokens in lanes
                        // (filled up): the eight lanes cost less than four
                        // tokens through the grouped kernels (measured:
                        // a decode step of four sequences on Qwen2.5-0.5B).
                        if tokens.end - i >= LANES_FROM && lanes {
                            let v = kernel.dot8(w, a, i);
                            for (n, &v) in v.iter().enumerate().take(tokens.end - i) {
                                tile[(i + n) * len + k] = v;
                            }
                            i = tokens.end;
                        }
                        while i + 4 <= tokens.end {
                            for (n, v) in kernel.dot4(w, a, i).into_iter().enumerate() {
                                tile[(i + n) * len + k] = v;
                            }
                            i += 4;
                        }
                        for i in i..tokens.end {
                            tile[i * len + k] = kernel.dot(w, a, i);
                        }
                    }
                }
                tile
            })
            .collect();
        out.par_chunks_mut(stride).enumerate().for_each(|(i, out)| {
            for (c, tile) in tiles.iter().enumerate() {
                let len = tile.len() / t;
                let dst = &mut out[offset + c * per_task..][..len];
                for (o, &v) in dst.iter_mut().zip(&tile[i * len..(i + 1) * len]) {
                    put(o, v);
                }
            }
        });
        Ok(())
    }
}

impl StoredLinear {
    /// `out (t × rows) (=|+=) x (t × cols) · Wᵀ`: the activations are
    /// quantised once per form the parts need, then each part writes its
    /// columns of `out`.
    pub fn product_into(
        &self,
        out: &mut [f32],
        x: &[f32],
        accumulate: bool,
        isa: Isa,
    ) -> Result<()> {
        let cols = self.cols();
        if !x.len().is_multiple_of(cols.max(1)) || out.len() != x.len() / cols.max(1) * self.rows()
        {
            return Err(ModelError::ShapeMismatch {
                what: "product outputs (tokens × rows)",
                expected: x.len() / cols.max(1) * self.rows(),
                got: out.len(),
            });
        }
        let mut forms: Vec<Activations> = Vec::new();
        let mut offset = 0;
        for part in self.parts() {
            let kind = part
                .ty()
                .activation()
                .ok_or(ModelError::NoKernel(part.ty()))?;
            let a = match forms.iter().position(|a| a.kind() == kind) {
                Some(i) => &forms[i],
                None => {
                    forms.push(Activations::new(kind, x, cols)?);
                    forms.last().expect("just pushed")
                }
            };
            part.product_into(a, out, self.rows(), offset, accumulate, isa)?;
            offset += part.rows();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefetch names the row `PREFETCH_BYTES` ahead, cut to the
    /// weights: rows near the end, past the end, of no bytes and at the
    /// largest offsets ask for nothing outside.
    #[test]
    fn prefetches_stay_inside_the_weights() {
        assert_eq!(
            prefetch_range(10_000, 0, 360),
            Some(PREFETCH_BYTES..PREFETCH_BYTES + 360)
        );
        assert_eq!(
            prefetch_range(PREFETCH_BYTES + 100, 0, 360),
            Some(PREFETCH_BYTES..PREFETCH_BYTES + 100)
        );
        assert_eq!(
            prefetch_range(PREFETCH_BYTES, 0, 360),
            None,
            "nothing ahead"
        );
        assert_eq!(prefetch_range(10_000, 0, 0), None, "a row of no bytes");
        assert_eq!(
            prefetch_range(10_000, usize::MAX - 1, 360),
            None,
            "no overflow"
        );
        assert_eq!(
            prefetch_range(usize::MAX, usize::MAX - PREFETCH_BYTES - 1, usize::MAX),
            Some(usize::MAX - 1..usize::MAX)
        );
        for total in [
            0,
            1,
            63,
            PREFETCH_BYTES,
            PREFETCH_BYTES + 1,
            3 * PREFETCH_BYTES,
        ] {
            let data = vec![7u8; total];
            for at in [
                0,
                1,
                total / 2,
                total.saturating_sub(1),
                total,
                total + PREFETCH_BYTES,
            ] {
                for len in [0, 1, 64, 500] {
                    if let Some(r) = prefetch_range(total, at, len) {
                        assert!(r.start == at + PREFETCH_BYTES && r.end <= total && r.len() <= len);
                    }
                    prefetch_ahead(&data, at, len);
                }
            }
        }
    }
}
