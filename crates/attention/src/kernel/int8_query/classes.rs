//! Query codes with one scale per channel class, for per-channel keys
//! packed two per byte.
//!
//! Folding per-channel key scales into the query (`q'_c = q_c·a_c`) gives
//! the folded query the keys' outlier channels: one int8 scale per head,
//! `max|q'| / 127`, is then set by a few channels and every other channel
//! is coded coarsely (Qwen2.5-Coder-0.5B's perplexity moved by +0.073%
//! to +0.13% over 20,480 tokens and +0.49% over the first 4,096; +0.015%
//! by class: attention `docs/measurements.md`, "Per-channel keys coded by
//! channel class"). Here a head's
//! channels fall into [`CLASSES`] classes, channel `c` (counted from the
//! head's first) into class `(c mod 64) / 8`: exactly the i32 lane an AVX2
//! accumulator of packed levels sums channel `c` in (a 32-byte unit holds
//! 64 channels, and its lane `m` sums channels `8m..8m + 8`).
//!
//! Class `k` is coded on its own scale `u·w_k`: a unit `u = max|q'| /
//! (127·W)` shared by the head and an integer weight `w_k =
//! ⌈W·peak_k / max|q'|⌉ ≤ W` (`W` = [`max_weight`] of the head's
//! dimension), so each class's codes use
//! their full int8 range (within `1/w_k` of its own peak's scale). The
//! weights are the multipliers of the `vpmaddwd` that widens AVX2's pair
//! sums (ones for a single scale; AVX-512 VNNI multiplies its class lanes
//! by them once per row in its reduction, see `vnni.rs`), so a row's score
//! is still one integer sum `Σ_c w_class(c)·code_c·l_c` finished as
//! `u·sum + constant`: no work per row beyond the single scale's. `W` keeps
//! a row's whole weighted sum exact in i32 ([`weights_fit`]), and the sums
//! are the same on every instruction set (AVX-512 VNNI, AVX2 and the
//! portable loop).

/// Channel classes of a head, each with its own query scale.
pub(crate) const CLASSES: usize = 8;

/// The largest class weight at any head dimension: `2^12`, each class
/// then within 1/4096 of its own scale's resolution where it is the peak's.
pub(crate) const MAX_WEIGHT: i16 = 4096;

/// The largest class weight for a head of `len` channels: [`MAX_WEIGHT`],
/// or less where a row's weighted sum (at most `len·15·127·w` in
/// magnitude over 4-bit levels and int8 codes) would leave i32: from 276
/// channels on (550 at 2,048).
pub(crate) fn max_weight(len: usize) -> i16 {
    let bound = i32::MAX as usize / (15 * 127 * len.max(1));
    bound.min(MAX_WEIGHT as usize) as i16
}

/// The class of channel `c` of a head: the AVX2 accumulator lane it is
/// summed in.
#[inline(always)]
pub(crate) fn class_of(c: usize) -> usize {
    c % 64 / 8
}

/// Whether weighted sums over `len` channels stay exact in i32: every
/// weight in `0..=max_weight(len)`, at least 1.
pub(crate) fn weights_fit(weights: &[[i16; 16]], len: usize) -> bool {
    let top = max_weight(len);
    top >= 1
        && weights
            .iter()
            .all(|w| w.iter().all(|&x| (0..=top).contains(&x)))
}

/// Quantizes `x` (one head's folded query) to int8 codes, class `k` on
/// scale `u·w_k` (codes `round(x_c / (u·w_k))`, ties to even), and returns
/// the unit `u` and the weights, each twice (`[w_0, w_0, w_1, w_1, ...]`,
/// as `vpmaddwd` reads them); `None` when `x` is not finite. A class whose
/// channels are all zero has weight 0 and codes 0.
#[inline(always)]
pub(crate) fn quantize_classes(x: &[f32], codes: &mut [i8]) -> Option<(f32, [i16; 16])> {
    let non_finite = x.iter().fold(false, |bad, v| bad | !v.is_finite());
    if non_finite {
        return None;
    }
    // Per channel modulo 64 first, then per class; a last partial chunk is
    // read zero-padded.
    let (whole, rest) = x.as_chunks::<64>();
    let mut padded = [0.0f32; 64];
    padded[..rest.len()].copy_from_slice(rest);
    let mut peaks = [0.0f32; 64];
    for chunk in whole {
        peaks = peaks_with(peaks, chunk);
    }
    if !rest.is_empty() {
        peaks = peaks_with(peaks, &padded);
    }
    let class_peaks: [f32; CLASSES] = std::array::from_fn(|k| {
        peaks[8 * k..8 * k + 8]
            .iter()
            .fold(0.0f32, |m, &p| if p > m { p } else { m })
    });
    let peak = class_peaks
        .iter()
        .fold(0.0f32, |m, &p| if p > m { p } else { m });
    if peak == 0.0 {
        codes[..x.len()].fill(0);
        return Some((0.0, [0; 16]));
    }
    let max_weight = f32::from(max_weight(x.len()));
    let unit = peak / (127.0 * max_weight);
    // ⌈W·p / peak⌉: at least the class's own need, at most W (p ≤ peak).
    // Whole arrays, so the divisions vectorise. A class whose scale is
    // too small for its inverse to be finite (a peak below ~1e-32) is
    // coded 0.
    let w: [f32; CLASSES] =
        std::array::from_fn(|k| (max_weight * class_peaks[k] / peak).ceil().min(max_weight));
    let class_inv: [f32; CLASSES] = std::array::from_fn(|k| {
        let i = 1.0 / (unit * w[k]);
        if w[k] > 0.0 && i.is_finite() { i } else { 0.0 }
    });
    let weights: [i16; 16] = std::array::from_fn(|i| w[i / 2] as i16);
    let inv: [f32; 64] = std::array::from_fn(|i| class_inv[i / 8]);
    // As in `quantize`: adding 1.5·2^23 rounds to the nearest integer,
    // ties to even, so the loop vectorises; the clamp keeps a code at 127
    // where `v / (u·w)` rounds a hair above it.
    const ROUND: f32 = 12_582_912.0;
    let code = |v: f32, inv: f32| {
        let y = (v * inv).clamp(-127.0, 127.0);
        ((y + ROUND).to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32) as i8
    };
    let (whole_codes, rest_codes) = codes[..x.len()].as_chunks_mut::<64>();
    for (out, chunk) in whole_codes.iter_mut().zip(whole) {
        for ((o, &v), &i) in out.iter_mut().zip(chunk).zip(&inv) {
            *o = code(v, i);
        }
    }
    if !rest.is_empty() {
        let mut out = [0i8; 64];
        for ((o, &v), &i) in out.iter_mut().zip(&padded).zip(&inv) {
            *o = code(v, i);
        }
        rest_codes.copy_from_slice(&out[..rest_codes.len()]);
    }
    Some((unit, weights))
}

/// `peaks` raised to the magnitudes of `chunk`, lane by lane (by value, so
/// that the lanes stay in registers: updated in place they were kept in
/// memory behind masked stores, a third of the fold's time, `perf`).
#[inline(always)]
fn peaks_with(peaks: [f32; 64], chunk: &[f32; 64]) -> [f32; 64] {
    std::array::from_fn(|i| {
        let a = chunk[i].abs();
        if a > peaks[i] { a } else { peaks[i] }
    })
}

/// `Σ_c w_class(c)·code_c` over one head's codes (exact in i64), by
/// channel modulo 64 first so that the
/// loop vectorises.
#[inline(always)]
pub(crate) fn weighted_code_sum(codes: &[i8], weights: &[i16; 16]) -> i64 {
    let mut per = [0i32; 64];
    for chunk in codes.chunks(64) {
        for (p, &c) in per.iter_mut().zip(chunk) {
            *p += i32::from(c);
        }
    }
    (0..CLASSES)
        .map(|k| {
            let sum: i32 = per[8 * k..8 * k + 8].iter().sum();
            i64::from(sum) * i64::from(weights[2 * k])
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::tests::PACKED_SEGMENTS;
    use super::super::{
        Dot, DotBlock, IntScratch, Prefetcher, QueryCodes, TileGeometry, integer_sums, scores,
        split_planes,
    };
    use super::*;
    use crate::kernel::test_values;
    use kv_quant::{KvStore, LevelRows, RowsView};

    fn levels(view: RowsView<'_>) -> LevelRows<'_> {
        match view {
            RowsView::Levels(l) => l,
            RowsView::Values(_) => panic!("int4-ch reads as levels"),
        }
    }

    /// Weighted sums of every kernel equal the definition (a loop over the
    /// unpacked levels and plain codes, channel `c` weighted by its class
    /// `(c mod 64) / 8`'s weight), at the largest weights too: whole blocks
    /// of 128, a last block of 64, of fewer and of more, odd row counts,
    /// every head count.
    #[test]
    fn every_kernel_gives_the_weighted_sums_of_the_definition() {
        let dots = Dot::available();
        #[cfg(target_arch = "x86_64")]
        for (dot, name) in [(Dot::Avx2, "AVX2"), (Dot::Vnni, "AVX-512 VNNI")] {
            if !dots.contains(&dot) {
                test_support::skip(
                    test_support::Requirement::Isa,
                    "attention",
                    "every_kernel_gives_the_weighted_sums_of_the_definition",
                    &format!("no {name}: its weighted sums were not run"),
                );
            }
        }
        // The packed segments of the unweighted tests, a head of 256 (the
        // widest at the full weight) and one of 2,048 (weights cut to 550).
        let wide = [(256, 0, 256, 3, 2), (2048, 0, 2048, 3, 4)];
        for (ch, start, len, rows, heads) in PACKED_SEGMENTS.into_iter().chain(wide) {
            let top = max_weight(len);
            // Row 0 all at level 15 against head 0's codes all 127 and
            // weights all at the top: the largest sum a row can have. The
            // rest mixed, with weights 0, 1 and the top among them.
            let plain: Vec<u8> = (0..rows * ch)
                .map(|i| {
                    if i < ch || i % 3 == 0 {
                        15
                    } else {
                        (i * 37 % 256) as u8 & 15
                    }
                })
                .collect();
            let packed: Vec<u8> = plain.chunks_exact(2).map(|p| p[0] | p[1] << 4).collect();
            let stride = 2048;
            let codes: Vec<i8> = (0..4 * stride)
                .map(|i| {
                    if i < stride || i % 2 == 0 {
                        127
                    } else {
                        (i * 53 % 255) as i8
                    }
                })
                .collect();
            let mut split = vec![0i8; 4 * stride];
            for j in 0..heads {
                let seg = j * stride;
                split_planes(&codes[seg..seg + len], &mut split[seg..seg + len]);
            }
            let weights: Vec<[i16; 16]> = (0..heads)
                .map(|j| {
                    std::array::from_fn(|i| match (j, (i / 2 + j) % 4) {
                        (0, _) | (_, 0) => top,
                        (_, 1) => 0,
                        (_, 2) => 1,
                        _ => ((i as i16 / 2 + 1) * 97).min(top),
                    })
                })
                .collect();
            assert!(weights_fit(&weights, len));
            let mut want = vec![0i32; heads * rows];
            for t in 0..rows {
                for j in 0..heads {
                    let sum: i64 = (0..len)
                        .map(|c| {
                            i64::from(plain[t * ch + start + c])
                                * i64::from(codes[j * stride + c])
                                * i64::from(weights[j][2 * class_of(c)])
                        })
                        .sum();
                    want[j * rows + t] = i32::try_from(sum).expect("exact in i32");
                }
            }
            let block = DotBlock {
                levels: &packed,
                packed: true,
                ch,
                start,
                len,
                codes: &split,
                code_stride: stride,
                heads,
                rows,
                image: None,
                lane_weights: Some(&weights),
            };
            for &dot in &dots {
                let mut got = vec![i32::MIN; heads * rows];
                integer_sums(dot, block, &mut got, &mut Prefetcher::new(None, 1));
                assert_eq!(got, want, "{dot:?} at ch {ch}, start {start}, len {len}");
            }
        }
    }

    /// The weight's cap keeps the largest row sum in i32 and is the full
    /// weight up to 256 channels.
    #[test]
    fn weights_are_capped_where_a_row_sum_would_leave_i32() {
        for len in [64, 128, 256, 275, 276, 1000, 2048, 100_000] {
            let top = i64::from(max_weight(len));
            assert!(15 * 127 * top * len as i64 <= i64::from(i32::MAX), "{len}");
            assert!(15 * 127 * (top + 1) * len as i64 > i64::from(i32::MAX) || top == 4096);
        }
        assert_eq!(
            (max_weight(256), max_weight(276), max_weight(2048)),
            (4096, 4084, 550)
        );
        assert!(!weights_fit(&[[551; 16]], 2048) && weights_fit(&[[550; 16]], 2048));
    }

    /// Codes of a head whose dimension is not a multiple of 64 (a zero-
    /// padded last chunk) equal a plain loop's over the same scales.
    #[test]
    fn a_partial_last_chunk_is_coded_as_the_plain_loop_codes_it() {
        for d in [96, 72, 40] {
            let x = test_values(9, d, 2.0);
            let mut codes = vec![0i8; d];
            let (unit, weights) = quantize_classes(&x, &mut codes).unwrap();
            let peak = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(unit, peak / (127.0 * 4096.0));
            for (c, &v) in x.iter().enumerate() {
                let scale = unit * f32::from(weights[2 * class_of(c)]);
                let want = (v * (1.0 / scale)).clamp(-127.0, 127.0).round_ties_even();
                assert_eq!(f32::from(codes[c]), want, "channel {c} of {d}");
            }
        }
    }

    /// Each class is coded on its own scale `u·w_k`: an outlier in one
    /// class leaves the others' codes full-range; an all-zero class has
    /// weight and codes 0; the weighted code sum is the definition's; a
    /// non-finite query is refused.
    #[test]
    fn each_class_is_coded_on_its_own_scale() {
        let mut x = vec![0.0f32; 128];
        for (c, v) in x.iter_mut().enumerate() {
            *v = if class_of(c) == 7 {
                0.0
            } else {
                0.01 * (c % 5) as f32
            };
        }
        x[3] = 100.0; // class 0
        x[64 + 9] = -0.04; // class 1, in the second unit of 64
        let mut codes = vec![0i8; 128];
        let (unit, weights) = quantize_classes(&x, &mut codes).unwrap();
        assert_eq!(unit, 100.0 / (127.0 * 4096.0));
        // Class 1's weight is ⌈4096·0.04/100⌉ = 2: its scale is within
        // 1/w of its own peak's (here 2.0 against 1.64 needed).
        assert_eq!(
            (weights[0], weights[1], weights[2], weights[3]),
            (4096, 4096, 2, 2)
        );
        assert_eq!(weights[14], 0);
        assert_eq!(codes[3], 127);
        for (c, &code) in codes.iter().enumerate() {
            let w = f32::from(weights[2 * class_of(c)]);
            let want = if w == 0.0 {
                0.0
            } else {
                (x[c] / (unit * w)).round_ties_even().clamp(-127.0, 127.0)
            };
            assert!((f32::from(code) - want).abs() <= 1.0, "channel {c}");
            if class_of(c) == 7 {
                assert_eq!(code, 0);
            }
            assert!(
                w == 0.0 || (x[c] / (unit * w)).abs() <= 127.0 * 1.0001,
                "channel {c}"
            );
        }
        // Class 1 uses most of its range: −0.04 codes to about −100.
        assert!(codes[64 + 9] <= -95, "{}", codes[64 + 9]);
        for n in [128, 72] {
            let want: i64 = codes[..n]
                .iter()
                .enumerate()
                .map(|(c, &code)| i64::from(code) * i64::from(weights[2 * class_of(c)]))
                .sum();
            assert_eq!(
                weighted_code_sum(&codes[..n], &weights),
                want,
                "{n} channels"
            );
        }
        assert_eq!(
            quantize_classes(&[0.0; 64], &mut codes),
            Some((0.0, [0; 16]))
        );
        x[5] = f32::NAN;
        assert_eq!(quantize_classes(&x, &mut codes), None);
        x[5] = f32::INFINITY;
        assert_eq!(quantize_classes(&x, &mut codes), None);
    }

    /// Per-channel keys with outlier channels (two channels whose range is
    /// 60x the others'): scores with one scale per class stay within the
    /// bound their codes give (`Σ_c u·w_class(c)/2·|l_c − 8|`, plus f32
    /// rounding) of the exact scores of the same stored keys, in f64; and
    /// their worst error is under half of one head-wide scale's.
    #[test]
    fn class_scores_stay_within_their_bound_and_beat_one_scale_per_head() {
        let (group, kv_heads, d, rows) = (2, 2, 128, 40);
        let geometry = TileGeometry { group, kv_heads, d };
        let (ch, heads) = (kv_heads * d, kv_heads * group);
        let q = test_values(3, heads * d, 1.0);
        let mut k = test_values(4, rows * ch, 1.0);
        for row in k.chunks_exact_mut(ch) {
            for c in [5, d + 70] {
                row[c] *= 60.0;
            }
        }
        let store = KvStore::quantize("int4-ch".parse().unwrap(), &k, rows, ch).unwrap();
        let stored = store.decode().unwrap().values;
        let (mut a, mut b) = (
            kv_quant::DecodeScratch::new(),
            kv_quant::DecodeScratch::new(),
        );
        let plain = levels(store.decode_rows_view(0, rows, &mut a).unwrap().0);
        let packed = levels(store.decode_rows_view_packed(0, rows, &mut b).unwrap().0);
        assert_eq!(packed.packing, kv_quant::LevelPacking::Nibbles);
        let run = |levels: &LevelRows<'_>| {
            let mut w = vec![f32::NAN; heads * rows];
            assert!(scores(
                &q,
                levels,
                geometry,
                QueryCodes::Int8,
                crate::Isa::detect().dot(),
                &mut IntScratch::default(),
                &mut w,
                &mut Prefetcher::new(None, 1),
            ));
            w
        };
        let (classes, single) = (run(&packed), run(&plain));
        let (mut worst_classes, mut worst_single) = (0.0f64, 0.0f64);
        for h in 0..heads {
            let kvh = h / group;
            let qh = &q[h * d..][..d];
            let folded: Vec<f32> = (0..d).map(|c| qh[c] * plain.scale[kvh * d + c]).collect();
            let mut codes = vec![0i8; d];
            let (unit, weights) = quantize_classes(&folded, &mut codes).unwrap();
            for t in 0..rows {
                let key = &stored[t * ch + kvh * d..][..d];
                let exact: f64 = (0..d).map(|c| f64::from(qh[c]) * f64::from(key[c])).sum();
                let magnitude: f64 = (0..d)
                    .map(|c| (f64::from(qh[c]) * f64::from(key[c])).abs())
                    .sum();
                let bound: f64 = (0..d)
                    .map(|c| {
                        let l = f64::from(plain.levels[t * ch + kvh * d + c]);
                        let scale = f64::from(unit) * f64::from(weights[2 * class_of(c)]);
                        scale / 2.0 * (l - 8.0).abs()
                    })
                    .sum::<f64>()
                    + 1e-5 * magnitude;
                let e = (f64::from(classes[h * rows + t]) - exact).abs();
                assert!(e <= bound, "head {h} row {t}: error {e} > bound {bound}");
                worst_classes = worst_classes.max(e);
                worst_single = worst_single.max((f64::from(single[h * rows + t]) - exact).abs());
            }
        }
        assert!(
            worst_classes < worst_single / 2.0,
            "classes {worst_classes}, one scale {worst_single}"
        );
    }
}
