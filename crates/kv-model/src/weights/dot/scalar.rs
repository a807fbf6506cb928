//! The portable kernels, and the definition of every kernel's result.
//!
//! Each function computes exactly what the AVX2 kernel of `avx2/`
//! computes, bit for bit, so a product does not depend on the machine:
//!
//! - **`Q4_0`, `Q5_0`** (32 values, codes stored shifted): each block's
//!   32 products are summed exactly in integers, and the blocks are
//!   accumulated in order by one fused multiply-add each,
//!   `acc = fma(d_w·d_a, sum, acc)`, the even blocks into one accumulator
//!   and the odd ones into another (two chains of fused multiply-adds
//!   instead of one), added at the end: `even + odd`. The token-lane
//!   kernels of `avx2/lanes.rs` compute exactly this for eight tokens in eight
//!   lanes.
//! - **`Q4_1`, `Q5_1`, `Q8_0`** (32 values): the codes' products are summed
//!   exactly in integers over eight lanes of four consecutive values (lane
//!   `k` of a block holds values `4k .. 4k + 3`, as `vpmaddubsw` then
//!   `vpmaddwd` pair them); each lane accumulates `d_w·d_a · sum` with a
//!   fused multiply-add over the blocks in order; the eight lanes are then
//!   added as [`hsum8`] does (`(l0+l4) + (l2+l6)` and `(l1+l5) + (l3+l7)`,
//!   then those two). The min terms of `Q4_1`/`Q5_1` (`m·s` per block) are
//!   summed separately in block order and added last.
//! - **k-quants** (`Q4_K`, `Q5_K`, `Q6_K`): every super-block's integer sum
//!   is exact, and the float accumulation is serial:
//!   `acc = acc + d·Σ − dmin·Σm` per super-block, unfused.
//! - **float types**: four accumulators of eight lanes (value `e` of each
//!   run of 32 into lane `e`), fused multiply-adds in order, the four added
//!   as `(a0+a1) + (a2+a3)` then [`hsum8`]; values past the last whole run
//!   of 32 are added one by one at the end.

use half::{bf16, f16};

use super::super::activations::{Q8Block, Q8KBlock};
use super::super::dequant::{f16_at, q5_codes};
use super::super::kquants::scale_min_k4;

/// Adds eight lanes as the AVX2 horizontal sum does.
pub(crate) fn hsum8(l: [f32; 8]) -> f32 {
    let t = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// The eight-lane accumulation of the 32-value types: `codes(block)` gives
/// the weight codes (as the integer the product uses) of a block's 32
/// values in order, `scale(block)` its `d` (and the min term, if any).
fn lanes32(
    w: &[u8],
    block_bytes: usize,
    a: &[Q8Block],
    mut per_block: impl FnMut(&[u8], &Q8Block) -> ([i32; 32], f32, f32),
) -> f32 {
    let mut acc = [0f32; 8];
    let mut mins = 0f32;
    for (b, a) in w.chunks_exact(block_bytes).zip(a) {
        let (codes, d, min) = per_block(b, a);
        let d = d * a.d;
        for (k, acc) in acc.iter_mut().enumerate() {
            let sum: i32 = (4 * k..4 * k + 4)
                .map(|e| codes[e] * i32::from(a.qs[e]))
                .sum();
            *acc = d.mul_add(sum as f32, *acc);
        }
        mins += min;
    }
    hsum8(acc) + mins
}

/// The serial accumulation of `Q4_0` and `Q5_0`: `codes(block)` gives a
/// block's 32 weight codes in order, as the integers the product uses.
fn serial32(
    w: &[u8],
    block_bytes: usize,
    a: &[Q8Block],
    codes: impl Fn(&[u8]) -> [i32; 32],
) -> f32 {
    let mut acc = [0f32; 2];
    for (i, (b, a)) in w.chunks_exact(block_bytes).zip(a).enumerate() {
        let c = codes(b);
        let sum: i32 = c.iter().zip(&a.qs).map(|(&c, &y)| c * i32::from(y)).sum();
        acc[i % 2] = (f16_at(b, 0) * a.d).mul_add(sum as f32, acc[i % 2]);
    }
    acc[0] + acc[1]
}

/// `Q4_0 · Q8_0`.
pub(crate) fn q4_0(w: &[u8], a: &[Q8Block]) -> f32 {
    serial32(w, 18, a, |b| {
        let mut c = [0i32; 32];
        for (j, &q) in b[2..18].iter().enumerate() {
            c[j] = i32::from(q & 0x0f) - 8;
            c[j + 16] = i32::from(q >> 4) - 8;
        }
        c
    })
}

/// `Q4_1 · Q8_1`.
pub(crate) fn q4_1(w: &[u8], a: &[Q8Block]) -> f32 {
    lanes32(w, 20, a, |b, a| {
        let mut c = [0i32; 32];
        for (j, &q) in b[4..20].iter().enumerate() {
            c[j] = i32::from(q & 0x0f);
            c[j + 16] = i32::from(q >> 4);
        }
        (c, f16_at(b, 0), f16_at(b, 2) * a.s)
    })
}

/// `Q5_0 · Q8_0`.
pub(crate) fn q5_0(w: &[u8], a: &[Q8Block]) -> f32 {
    serial32(w, 22, a, |b| {
        let mut c = [0i32; 32];
        for (j, q0, q1) in q5_codes(&b[2..6], &b[6..22]) {
            c[j] = i32::from(q0) - 16;
            c[j + 16] = i32::from(q1) - 16;
        }
        c
    })
}

/// `Q5_1 · Q8_1`.
pub(crate) fn q5_1(w: &[u8], a: &[Q8Block]) -> f32 {
    lanes32(w, 24, a, |b, a| {
        let mut c = [0i32; 32];
        for (j, q0, q1) in q5_codes(&b[4..8], &b[8..24]) {
            c[j] = i32::from(q0);
            c[j + 16] = i32::from(q1);
        }
        (c, f16_at(b, 0), f16_at(b, 2) * a.s)
    })
}

/// `Q8_0 · Q8_0`.
pub(crate) fn q8_0(w: &[u8], a: &[Q8Block]) -> f32 {
    lanes32(w, 34, a, |b, _| {
        let c = std::array::from_fn(|e| i32::from(b[2 + e] as i8));
        (c, f16_at(b, 0), 0.0)
    })
}

/// `Σ_j sc_j·Σ(q·y)_j` and `Σ_j m_j·Σy_j` of a `Q4_K`/`Q5_K` super-block
/// whose 5-bit (or 4-bit, `qh` empty) codes are `code(e)`.
fn k4_sums(scales: &[u8], a: &Q8KBlock, code: impl Fn(usize) -> i32) -> (i32, i32) {
    let (mut sumi, mut summ) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        let dot: i32 = (32 * j..32 * j + 32)
            .map(|e| code(e) * i32::from(a.qs[e]))
            .sum();
        sumi += i32::from(sc) * dot;
        summ += i32::from(m) * (i32::from(a.bsums[2 * j]) + i32::from(a.bsums[2 * j + 1]));
    }
    (sumi, summ)
}

/// `Q4_K · Q8_K`.
pub(crate) fn q4_k(w: &[u8], a: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, a) in w.chunks_exact(144).zip(a) {
        let qs = &b[16..144];
        let (sumi, summ) = k4_sums(&b[4..16], a, |e| {
            i32::from((qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0f)
        });
        let (d, dmin) = (a.d * f16_at(b, 0), a.d * f16_at(b, 2));
        acc = acc + d * sumi as f32 - dmin * summ as f32;
    }
    acc
}

/// `Q5_K · Q8_K`.
pub(crate) fn q5_k(w: &[u8], a: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, a) in w.chunks_exact(176).zip(a) {
        let (qh, qs) = (&b[16..48], &b[48..176]);
        let (sumi, summ) = k4_sums(&b[4..16], a, |e| {
            let low = (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0f;
            let high = (qh[e % 32] >> (e / 32)) & 1;
            i32::from(low | (high << 4))
        });
        let (d, dmin) = (a.d * f16_at(b, 0), a.d * f16_at(b, 2));
        acc = acc + d * sumi as f32 - dmin * summ as f32;
    }
    acc
}

/// `Q6_K · Q8_K`: `Σ_g sc_g·(Σ q·y − 32·Σy)_g` over the 16 groups of 16.
pub(crate) fn q6_k(w: &[u8], a: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, a) in w.chunks_exact(210).zip(a) {
        let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
        let (mut sumi, mut offset) = (0i32, 0i32);
        for (g, &s) in sc.iter().enumerate() {
            let s = i32::from(s as i8);
            let dot: i32 = (16 * g..16 * g + 16)
                .map(|e| {
                    let (n, r) = (e / 128, e % 128);
                    let (k, l) = (r / 32, r % 32);
                    let low = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
                    let high = (qh[32 * n + l] >> (2 * k)) & 3;
                    i32::from(low | (high << 4)) * i32::from(a.qs[e])
                })
                .sum();
            sumi += s * dot;
            offset += s * i32::from(a.bsums[g]);
        }
        let d = a.d * f16_at(b, 208);
        acc += d * (sumi - 32 * offset) as f32;
    }
    acc
}

/// The float types' accumulation: `value(i)` is weight `i` in f32.
fn lanes_f32(n: usize, x: &[f32], value: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let runs = n / 32;
    for r in 0..runs {
        for (u, acc) in acc.iter_mut().enumerate() {
            for (l, acc) in acc.iter_mut().enumerate() {
                let i = 32 * r + 8 * u + l;
                *acc = value(i).mul_add(x[i], *acc);
            }
        }
    }
    let sum: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut total = hsum8(sum);
    for (i, &x) in x.iter().enumerate().skip(32 * runs) {
        total += value(i) * x;
    }
    total
}

/// `F32 · f32`.
pub(crate) fn f32_row(w: &[u8], x: &[f32]) -> f32 {
    lanes_f32(x.len(), x, |i| {
        f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]])
    })
}

/// `F16 · f32`.
pub(crate) fn f16_row(w: &[u8], x: &[f32]) -> f32 {
    lanes_f32(x.len(), x, |i| {
        f16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32()
    })
}

/// `BF16 · f32`.
pub(crate) fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
    lanes_f32(x.len(), x, |i| {
        bf16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32()
    })
}
