//! Dequantisation of ggml's k-quants (`Q2_K` .. `Q8_K`): super-blocks of
//! `QK_K = 256` values in sub-blocks of 16 or 32, each sub-block with its own
//! 4-, 6- or 8-bit scale (and min), the scales themselves scaled by one or two
//! f16 factors per super-block.
//!
//! Layouts and arithmetic follow ggml's `ggml-common.h` block structs and the
//! `dequantize_row_q*_K` reference loops of `ggml-quants.c`: every product is
//! formed in f32 in ggml's order (`d·sc` first, then `·q`, then `− d_min·m`),
//! unfused, so the results equal ggml's and the `gguf` Python package's bit
//! for bit (checked against that package's output in
//! kv-eval's `tests/gguf_kquants.rs`).

use super::dequant::f16_at;

/// Values per super-block (`QK_K`).
pub(crate) const QK_K: usize = 256;

/// `block_q2_K` (84 bytes): `scales[16]` (low nibble: scale, high nibble:
/// min, one pair per 16 values), `qs[64]` (2-bit codes), f16 `d`, f16
/// `dmin`; `x = d·sc·q − dmin·m`. Byte `l` of a 32-byte chunk of `qs` holds
/// four values 32 apart, the lowest in bits 0-1.
pub(crate) fn dequant_q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, out) in out.chunks_exact_mut(16).enumerate() {
        // Sub-block i: 128-value half i / 8, bit pair (i % 8) / 2, bytes 16·(i % 2)...
        let q = &qs[32 * (i / 8) + 16 * (i % 2)..][..16];
        let shift = 2 * ((i % 8) / 2);
        let sc = scales[i];
        let dl = d * f32::from(sc & 0x0f);
        let ml = dmin * f32::from(sc >> 4);
        for (o, &q) in out.iter_mut().zip(q) {
            *o = dl * f32::from((q >> shift) & 3) - ml;
        }
    }
}

/// The sixteen 6-bit signed scales of a `Q3_K` block (`scales[12]`): the low
/// nibbles in bytes 0-7 (scale `j` and `j + 8` share byte `j % 8`), the high
/// bit pairs in bytes 8-11, biased by 32.
fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = (s[j % 8] >> (4 * (j / 8))) & 0x0f;
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 0x03;
        ((low | (high << 4)) as i8) - 32
    })
}

/// `block_q3_K` (110 bytes): `hmask[32]` (the third bit of each code; a
/// clear bit subtracts 4), `qs[64]` (low two bits, laid out as in `Q2_K`),
/// `scales[12]` (sixteen 6-bit scales), f16 `d`; `x = d·(sc − 32)·q`.
pub(crate) fn dequant_q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs) = (&b[..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (i, out) in out.chunks_exact_mut(16).enumerate() {
        let half = i / 8;
        let lane = 16 * (i % 2);
        let q = &qs[32 * half + lane..][..16];
        let h = &hmask[lane..][..16];
        let shift = 2 * ((i % 8) / 2);
        // The high bit of sub-block i is bit 4·half + (i % 8) / 2 of hmask.
        let hbit = 4 * half + (i % 8) / 2;
        let dl = d * f32::from(scales[i]);
        for ((o, &q), &h) in out.iter_mut().zip(q).zip(h) {
            let low = ((q >> shift) & 3) as i8;
            let code = low - if (h >> hbit) & 1 == 1 { 0 } else { 4 };
            *o = dl * f32::from(code);
        }
    }
}

/// Scale and min `j` (0..8) of a `Q4_K`/`Q5_K` block's packed `scales[12]`
/// (ggml's `get_scale_min_k4`): 6 bits each; for `j < 4` the low six bits of
/// bytes `j` and `j + 4`, else a nibble of byte `j + 4` and the top two bits
/// of bytes `j − 4` and `j`.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K` (144 bytes): f16 `d`, f16 `dmin`, `scales[12]` (eight 6-bit
/// scale/min pairs, one per 32 values), `qs[128]`; 64 values share 32
/// bytes, the first 32 in the low nibbles; `x = d·sc·q − dmin·m`.
pub(crate) fn dequant_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let q = &qs[32 * (j / 2)..][..32];
        let shift = 4 * (j % 2);
        for (o, &q) in out.iter_mut().zip(q) {
            *o = d1 * f32::from((q >> shift) & 0x0f) - m1;
        }
    }
}

/// `block_q5_K` (176 bytes): as `Q4_K` with `qh[32]` between the scales and
/// `qs[128]`: bit `j` of `qh[l]` is the fifth bit of value `l` of the
/// `j`-th run of 32; `x = d·sc·q − dmin·m`.
pub(crate) fn dequant_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let q = &qs[32 * (j / 2)..][..32];
        let shift = 4 * (j % 2);
        for ((o, &q), &h) in out.iter_mut().zip(q).zip(qh) {
            let code = ((q >> shift) & 0x0f) | (((h >> j) & 1) << 4);
            *o = d1 * f32::from(code) - m1;
        }
    }
}

/// `block_q6_K` (210 bytes): `ql[128]` (low nibbles), `qh[64]` (high bit
/// pairs), `scales[16]` (`i8`, one per 16 values), f16 `d`;
/// `x = d·sc·(q − 32)`. In each 128-value half, `ql` byte `l` (of 64) holds
/// values `l` and `l + 64` (of that half); `qh` byte `l` (of 32) holds the
/// high pairs of values `l`, `l + 32`, `l + 64`, `l + 96`.
pub(crate) fn dequant_q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (n, out) in out.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (&ql[64 * n..][..64], &qh[32 * n..][..32], &sc[8 * n..][..8]);
        for (k, out) in out.chunks_exact_mut(32).enumerate() {
            // Run k of 32: low nibble of ql[l + 32·(k % 2)] (k < 2) or its high
            // nibble (k ≥ 2); high pair at bits 2k of qh[l].
            let low = &ql[32 * (k % 2)..][..32];
            let shift = 4 * (k / 2);
            for (l, o) in out.iter_mut().enumerate() {
                let code = ((low[l] >> shift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
                let scale = sc[2 * k + l / 16] as i8;
                *o = d * f32::from(scale) * f32::from(code as i8 - 32);
            }
        }
    }
}

/// `block_q8_K` (292 bytes): f32 `d`, `qs[256]` (`i8`), `bsums[16]` (`i16`
/// sums of 16 codes, used only by dot products); `x = d·q`.
pub(crate) fn dequant_q8_k(b: &[u8], out: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in out.iter_mut().zip(&b[4..4 + QK_K]) {
        *o = d * f32::from(q as i8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scale_packing_follows_get_scale_min_k4() {
        // Scales 1..8 and mins 11..18 packed as ggml's quantiser does.
        let sc: [u8; 8] = [1, 2, 3, 4, 45, 46, 47, 63];
        let m: [u8; 8] = [11, 12, 13, 14, 55, 56, 57, 62];
        let mut s = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                s[j] = sc[j];
                s[j + 4] = m[j];
            } else {
                s[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
                s[j - 4] |= (sc[j] >> 4) << 6;
                s[j] |= (m[j] >> 4) << 6;
            }
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &s), (sc[j], m[j]), "pair {j}");
        }
    }

    #[test]
    fn q3_k_scales_unpack_every_position() {
        let want: [i8; 16] = std::array::from_fn(|j| j as i8 * 4 - 32);
        let mut s = [0u8; 12];
        for (j, &w) in want.iter().enumerate() {
            let u = (w + 32) as u8;
            s[j % 8] |= (u & 0x0f) << (4 * (j / 8));
            s[8 + j % 4] |= (u >> 4) << (2 * (j / 4));
        }
        assert_eq!(q3_k_scales(&s), want);
    }

    #[test]
    fn q8_k_is_scale_times_code() {
        let mut b = vec![0u8; 292];
        b[..4].copy_from_slice(&0.5f32.to_le_bytes());
        b[4] = (-128i8) as u8;
        b[259] = 127;
        let mut out = [0.0f32; QK_K];
        dequant_q8_k(&b, &mut out);
        assert_eq!((out[0], out[255], out[1]), (-64.0, 63.5, 0.0));
    }
}
