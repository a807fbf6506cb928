//! Bit-interleaved layouts: eight codewords spread over the bytes they
//! occupy, so that a fault confined to one byte, or a burst of up to eight
//! adjacent bits, touches each codeword at most once.
//!
//! A block is eight consecutive codewords of the inner code (8 bytes of
//! SECDED(8,4), 24 of Golay(24,12)). Stored byte `8p + j` of a block holds,
//! in bit `i`, bit `8p + j` of codeword `i` (codeword bits as the inner
//! layout stores them, LSB first): plane `p` of the block is the 8×8 bit
//! transpose of byte `p` of the eight codewords. A final partial block (fewer
//! than eight codewords) keeps the inner layout, so it has the inner code's
//! protection against clustered faults only: buffers of a multiple of eight
//! codewords are interleaved throughout.
//!
//! Decoding transposes a chunk of blocks back into the inner layout on the
//! stack and runs the inner codec's decoder on it, so every backend of the
//! inner code serves the interleaved one and the two cannot disagree on
//! anything but the byte order. SECDED on AVX-512 skips the buffer: its
//! kernel transposes each 64-byte chunk in registers before correcting it.
//! (The permutation itself uses GFNI whenever the CPU has it, whatever
//! backend is asked for: it is exact either way.)

use std::ops::Range;

use super::{Backend, Int4Code, Int4Codec, check_decode_shapes, check_nibbles};
use crate::error::{Result, check_len};
use crate::stats::DecodeStats;

/// Codewords per interleaving block.
pub const DEPTH: usize = 8;

/// Bytes decoded per pass through the stack buffer: whole blocks of both
/// codes (8 and 24 bytes) and whole 64-value words of the erasure bitmap
/// (both codes store 8 bits per value): 64 × lcm(8, 24, 64).
const CHUNK: usize = 12288;

/// SECDED(8,4) or Golay(24,12) with eight codewords bit-interleaved per
/// block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Interleaved {
    inner: Int4Code,
    name: &'static str,
}

/// SECDED(8,4), eight codewords (8 bytes) per block.
pub const SECDED84_X8: Interleaved = Interleaved {
    inner: Int4Code::Secded84,
    name: "secded84x8",
};

/// Golay(24,12), eight codewords (24 bytes) per block.
pub const GOLAY24_X8: Interleaved = Interleaved {
    inner: Int4Code::Golay24,
    name: "golay24x8",
};

impl Interleaved {
    /// The code whose codewords are interleaved.
    pub fn inner(&self) -> Int4Code {
        self.inner
    }

    /// Bytes of one inner codeword.
    fn codeword_bytes(&self) -> usize {
        self.inner
            .codec()
            .encoded_len(self.inner.codec().values_per_codeword())
    }

    /// Bytes of one block of [`DEPTH`] codewords.
    pub fn block_bytes(&self) -> usize {
        DEPTH * self.codeword_bytes()
    }

    /// Writes `src` to `dst` (same length) with its whole blocks moved from
    /// the inner layout to the interleaved one (`forward`) or back.
    fn permute_into(&self, src: &[u8], dst: &mut [u8], forward: bool) {
        #[cfg(target_arch = "x86_64")]
        if Backend::Avx512.is_supported() {
            // SAFETY: the CPU supports AVX-512 F/BW/VBMI and GFNI (checked
            // just above); the kernel touches `src` and `dst` only.
            unsafe { gfni::permute_into(src, dst, self.codeword_bytes(), forward) };
            return;
        }
        self.permute_scalar(src, dst, forward);
    }

    /// [`Self::permute_into`] one plane at a time with [`transpose8`] (the
    /// reference the AVX-512 kernel is tested against), reading `src` and
    /// writing `dst` directly, with the codeword size a constant so that each
    /// block's gathers and scatters compile to fixed offsets (a copy of each
    /// block into a buffer and back, a `memmove` call per 8 or 24 bytes, and
    /// the bounds checks of run-time offsets took most of its time).
    fn permute_scalar(&self, src: &[u8], dst: &mut [u8], forward: bool) {
        assert_eq!(src.len(), dst.len(), "a permutation keeps the length");
        match self.codeword_bytes() {
            1 => permute_blocks::<1, 8>(src, dst, forward),
            3 => permute_blocks::<3, 24>(src, dst, forward),
            cb => unreachable!("inner codewords of 1 or 3 bytes, not {cb}"),
        }
    }

    /// The chunks of an encoding of `values` values: first value, value
    /// count and encoded byte range of each (whole blocks but for the last).
    fn chunk_spans(&self, values: usize) -> impl Iterator<Item = (usize, usize, Range<usize>)> {
        let codec = self.inner.codec();
        (0..values).step_by(CHUNK).map(move |first| {
            let count = (values - first).min(CHUNK);
            let span = codec.encoded_len(first)..codec.encoded_len(first + count);
            (first, count, span)
        })
    }

    /// Decodes the longest prefix of whole chunks in one pass where a fused
    /// kernel exists (on AVX-512 and AVX2: SECDED in chunks of 64 values, Golay
    /// without truth in blocks of 192; the transposes in registers before
    /// the correction) and the backend asked for is that one; returns
    /// the values decoded and their statistics. Backends are checked by the
    /// inner decoder for the rest.
    fn fused_head(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: Option<&[u8]>,
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> (usize, DecodeStats) {
        #[cfg(target_arch = "x86_64")]
        if backend != Backend::Scalar && backend.is_supported() {
            let avx512 = backend == Backend::Avx512;
            match self.inner {
                Int4Code::Secded84 => {
                    let head = values.len() / 64 * 64;
                    let (encoded, values) = (&encoded[..head], &mut values[..head]);
                    let (truth, erasures) = (truth.map(|t| &t[..head]), &mut erasures[..head / 64]);
                    let t = super::secded84::tables();
                    // SAFETY: the CPU supports the kernel's features (checked
                    // just above); shapes were checked by the caller (one byte
                    // per value) and `head` is a multiple of 64.
                    let stats = unsafe {
                        if avx512 {
                            super::avx512::secded_x8_decode_avx512(
                                t,
                                &gfni::REVERSE,
                                encoded,
                                values,
                                truth,
                                erasures,
                            )
                        } else {
                            super::avx2::secded_x8_decode_avx2(t, encoded, values, truth, erasures)
                        }
                    };
                    return (head, stats);
                }
                Int4Code::Golay24 if truth.is_none() => {
                    let head = values.len() / 192 * 192;
                    let (encoded, values) = (&encoded[..head], &mut values[..head]);
                    let (t, erasures) = (super::golay24::tables(), &mut erasures[..head / 64]);
                    // SAFETY: as above; `head` values are `head` bytes (64
                    // codewords per 192) and a multiple of 192.
                    let stats = unsafe {
                        if avx512 {
                            super::avx512::golay_decode_avx512::<true>(t, encoded, values, erasures)
                        } else {
                            super::avx2::golay_decode_avx2::<true>(t, encoded, values, erasures)
                        }
                    };
                    return (head, stats);
                }
                _ => {}
            }
        }
        let _ = (backend, encoded, truth, values, erasures);
        (0, DecodeStats::default())
    }

    /// Decodes (comparing with `truth` when given): the fused head, then
    /// the rest chunk by chunk through the inner decoder.
    fn run(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: Option<&[u8]>,
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        let truth_len = truth.map(<[u8]>::len);
        check_decode_shapes(self, encoded.len(), values.len(), erasures.len(), truth_len)?;
        backend.ensure_supported()?;
        let (head, mut stats) = self.fused_head(backend, encoded, truth, values, erasures);
        let (encoded, truth) = (&encoded[head..], truth.map(|t| &t[head..]));
        let (values, erasures) = (&mut values[head..], &mut erasures[head / 64..]);
        let codec = self.inner.codec();
        stats += self.for_each_chunk(encoded, values.len(), |chunk, first, count| {
            let (values, erasures) = (
                &mut values[first..first + count],
                &mut erasures[first / 64..(first + count).div_ceil(64)],
            );
            match truth {
                None => codec.decode_into_with(backend, chunk, values, erasures),
                Some(t) => codec.decode_with_truth_into_with(
                    backend,
                    chunk,
                    &t[first..first + count],
                    values,
                    erasures,
                ),
            }
        })?;
        Ok(stats)
    }

    /// Runs `f` on each chunk of `encoded` brought back to the inner layout:
    /// `f(inner bytes, first value, values)`.
    fn for_each_chunk(
        &self,
        encoded: &[u8],
        values: usize,
        mut f: impl FnMut(&[u8], usize, usize) -> Result<DecodeStats>,
    ) -> Result<DecodeStats> {
        let mut stats = DecodeStats::default();
        let mut buffer = [0u8; CHUNK];
        for (first, count, span) in self.chunk_spans(values) {
            let chunk = &mut buffer[..span.len()];
            self.permute_into(&encoded[span], chunk, false);
            stats += f(chunk, first, count)?;
        }
        Ok(stats)
    }
}

/// The 8×8 bit transposes by GFNI: `vgf2p8affineqb` with the data as the
/// matrix operand and the unit bytes `1 << b` as the vector transposes every
/// 8-byte plane in one instruction once the plane's bytes are reversed
/// (byte `b` of the result gets bit `b` of matrix rows `7 − i`). Golay's
/// three planes per block are gathered from and scattered to their
/// codewords' bytes by one `vpermb` over two blocks (48 bytes) at a time.
#[cfg(target_arch = "x86_64")]
mod gfni {
    use std::arch::x86_64::*;

    /// `index[k]`: the byte of the window that lands at `k` when gathering
    /// interleaved planes back into codewords (`to_codewords`) or codewords
    /// into planes, for codewords of `cb` bytes.
    const fn index(cb: usize, to_codewords: bool) -> [u8; 64] {
        let block = 8 * cb;
        let mut out = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            let (b, r) = (k / block, k % block);
            // Plane byte 8p + i ↔ codeword byte cb·i + p.
            out[k] = if k >= 64 / block * block {
                k as u8
            } else if to_codewords {
                (b * block + 8 * (r % cb) + r / cb) as u8
            } else {
                (b * block + cb * (r % 8) + r / 8) as u8
            };
            k += 1;
        }
        out
    }

    /// Golay's gathers, codewords to planes and back.
    const GOLAY_TO_PLANES: [u8; 64] = index(3, false);
    const GOLAY_TO_CODEWORDS: [u8; 64] = index(3, true);

    /// Reverses the bytes of every 8-byte plane.
    pub(super) const REVERSE: [u8; 64] = {
        let mut out = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            out[k] = (k / 8 * 8 + 7 - k % 8) as u8;
            k += 1;
        }
        out
    };

    /// Writes `src` to `dst` (of the same length) with its whole blocks
    /// (codewords of `cb` = 1 or 3 bytes: SECDED or Golay) moved to the
    /// interleaved layout (`forward`) or back, and a final partial block
    /// copied. Reading and writing separate buffers keeps each load clear of
    /// the masked stores before it (in place, Golay's 48-byte windows stall
    /// on store forwarding and run ten times slower).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VBMI and GFNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni")]
    pub(super) unsafe fn permute_into(src: &[u8], dst: &mut [u8], cb: usize, forward: bool) {
        debug_assert!(cb == 1 || cb == 3, "SECDED or Golay codewords");
        assert_eq!(src.len(), dst.len(), "same lengths");
        let block = 8 * cb;
        let window = 64 / block * block;
        let whole = src.len() / block * block;
        // SAFETY: 64 readable bytes each.
        let (reverse, gather) = unsafe {
            (
                _mm512_loadu_si512(REVERSE.as_ptr().cast()),
                _mm512_loadu_si512(
                    if forward {
                        &GOLAY_TO_PLANES
                    } else {
                        &GOLAY_TO_CODEWORDS
                    }
                    .as_ptr()
                    .cast(),
                ),
            )
        };
        let units = _mm512_set1_epi64(0x8040_2010_0804_0201_u64 as i64);
        let mut at = 0;
        while at < whole {
            let len = window.min(whole - at);
            let mask: u64 = if len == 64 { !0 } else { (1 << len) - 1 };
            // A full load where 64 bytes are readable: masked loads from
            // memory not in cache ran Golay's 48-byte windows at 0.6 of the
            // speed (masked and full stores measured the same).
            // SAFETY: the full load reads at..at + 64 ⊆ src, the masked one
            // bytes at..at + len (masked-out lanes are not read).
            let v = unsafe {
                if at + 64 <= src.len() {
                    _mm512_loadu_si512(src.as_ptr().add(at).cast())
                } else {
                    _mm512_maskz_loadu_epi8(mask, src.as_ptr().add(at).cast())
                }
            };
            let v = if forward && cb > 1 {
                _mm512_permutexvar_epi8(gather, v)
            } else {
                v
            };
            let t = _mm512_gf2p8affine_epi64_epi8::<0>(units, _mm512_permutexvar_epi8(reverse, v));
            let t = if !forward && cb > 1 {
                _mm512_permutexvar_epi8(gather, t)
            } else {
                t
            };
            // SAFETY: writes bytes at..at + len of `dst` (same length as
            // `src`); masked-out lanes are not written.
            unsafe { _mm512_mask_storeu_epi8(dst.as_mut_ptr().add(at).cast(), mask, t) };
            at += len;
        }
        dst[whole..].copy_from_slice(&src[whole..]);
    }
}

/// The whole blocks of `BLOCK = DEPTH · CB` bytes of `src` (codewords of `CB`
/// bytes) moved to the interleaved layout (`forward`) or back into `dst`;
/// the final partial block copied as it is.
fn permute_blocks<const CB: usize, const BLOCK: usize>(src: &[u8], dst: &mut [u8], forward: bool) {
    debug_assert_eq!(BLOCK, DEPTH * CB);
    let whole = src.len() - src.len() % BLOCK;
    let (blocks, _) = src[..whole].as_chunks::<BLOCK>();
    let (outs, _) = dst[..whole].as_chunks_mut::<BLOCK>();
    for (s, d) in blocks.iter().zip(outs) {
        for p in 0..CB {
            if forward {
                let rows = (0..DEPTH).fold(0u64, |w, i| w | u64::from(s[CB * i + p]) << (8 * i));
                d[8 * p..8 * p + 8].copy_from_slice(&transpose8(rows).to_le_bytes());
            } else {
                let mut plane = [0u8; 8];
                plane.copy_from_slice(&s[8 * p..8 * p + 8]);
                let bytes = transpose8(u64::from_le_bytes(plane)).to_le_bytes();
                for (i, byte) in bytes.into_iter().enumerate() {
                    d[CB * i + p] = byte;
                }
            }
        }
    }
    dst[whole..].copy_from_slice(&src[whole..]);
}

/// Transposes the 8×8 bit matrix whose row `i` is byte `i` of `x` (bit
/// `8i + j` ↔ bit `8j + i`), by three delta swaps (Hacker's Delight, 7-3).
#[inline]
pub fn transpose8(mut x: u64) -> u64 {
    let t = (x ^ (x >> 7)) & 0x00AA_00AA_00AA_00AA;
    x ^= t ^ (t << 7);
    let t = (x ^ (x >> 14)) & 0x0000_CCCC_0000_CCCC;
    x ^= t ^ (t << 14);
    let t = (x ^ (x >> 28)) & 0x0000_0000_F0F0_F0F0;
    x ^ t ^ (t << 28)
}

impl Int4Codec for Interleaved {
    fn name(&self) -> &'static str {
        self.name
    }

    fn values_per_codeword(&self) -> usize {
        self.inner.codec().values_per_codeword()
    }

    fn bits_per_value(&self) -> u32 {
        self.inner.codec().bits_per_value()
    }

    fn encoded_len(&self, values: usize) -> usize {
        self.inner.codec().encoded_len(values)
    }

    fn encode_into(&self, values: &[u8], encoded: &mut [u8]) -> Result<()> {
        check_len("encoded", self.encoded_len(values.len()), encoded.len())?;
        check_nibbles(values)?;
        let codec = self.inner.codec();
        let mut buffer = [0u8; CHUNK];
        for (first, count, span) in self.chunk_spans(values.len()) {
            let chunk = &mut buffer[..span.len()];
            codec.encode_into(&values[first..first + count], chunk)?;
            self.permute_into(chunk, &mut encoded[span], true);
        }
        Ok(())
    }

    fn decode_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.run(backend, encoded, None, values, erasures)
    }

    fn decode_with_truth_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.run(backend, encoded, Some(truth), values, erasures)
    }

    fn scrub(&self, encoded: &mut [u8], values: usize) -> Result<DecodeStats> {
        check_len("encoded", self.encoded_len(values), encoded.len())?;
        let codec = self.inner.codec();
        let mut stats = DecodeStats::default();
        let mut buffer = [0u8; CHUNK];
        for (_, count, span) in self.chunk_spans(values) {
            let chunk = &mut buffer[..span.len()];
            self.permute_into(&encoded[span.clone()], chunk, false);
            stats += codec.scrub(chunk, count)?;
            self.permute_into(chunk, &mut encoded[span], true);
        }
        Ok(stats)
    }

    /// In a whole block of eight codewords bit `j` of every byte belongs to
    /// codeword `j` of the block; a final partial block lies end to end.
    fn codeword_of_bit(&self, bit: u64, values: usize) -> usize {
        let block_bits = 8 * self.block_bytes() as u64;
        let whole_blocks = (self.codewords(values) / DEPTH) as u64;
        if bit / block_bits < whole_blocks {
            (DEPTH as u64 * (bit / block_bits) + bit % 8) as usize
        } else {
            self.inner.codec().codeword_of_bit(bit, values)
        }
    }

    /// Blocks start with each encoding: rows join only as whole blocks.
    fn concatenates(&self, values: usize) -> bool {
        self.inner.codec().concatenates(values) && self.codewords(values).is_multiple_of(DEPTH)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64)
            .map(|i| ((i.wrapping_mul(0x9E37_79B9) ^ seed) >> 7) as u8 & 0xF)
            .collect()
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        for x in [
            0u64,
            1,
            0x8000_0000_0000_0000,
            0x0123_4567_89AB_CDEF,
            u64::MAX,
            0xF0E1_D2C3_B4A5_9687,
        ] {
            let t = transpose8(x);
            for (i, j) in (0..8).flat_map(|i| (0..8).map(move |j| (i, j))) {
                assert_eq!(
                    t >> (8 * j + i) & 1,
                    x >> (8 * i + j) & 1,
                    "{x:#x} ({i},{j})"
                );
            }
            assert_eq!(transpose8(t), x);
        }
    }

    /// Stored byte `8p + j`, bit `i`, is bit `8p + j` of codeword `i`.
    #[test]
    fn a_block_holds_one_bit_of_each_codeword_per_byte() {
        for code in [SECDED84_X8, GOLAY24_X8] {
            let v = values(3 * 8 * 2, 1);
            let plain = code.inner.codec().encode(&v).unwrap();
            let woven = code.encode(&v).unwrap();
            let cb = code.codeword_bytes();
            for block in 0..plain.len() / code.block_bytes() {
                let base = block * code.block_bytes();
                for (i, bit) in (0..DEPTH).flat_map(|i| (0..8 * cb).map(move |b| (i, b))) {
                    let codeword_bit = plain[base + cb * i + bit / 8] >> (bit % 8) & 1;
                    assert_eq!(woven[base + bit] >> i & 1, codeword_bit, "{}", code.name());
                }
            }
        }
    }

    /// The GFNI kernel against the plane-by-plane reference, both ways,
    /// on buffers of every length up to several windows.
    #[test]
    fn gfni_permutation_equals_the_scalar_one() {
        if !Backend::Avx512.is_supported() {
            eprintln!("skipped: this CPU has no AVX-512 with GFNI");
            return;
        }
        for code in [SECDED84_X8, GOLAY24_X8] {
            for len in 0..300 {
                let bytes: Vec<u8> = (0..len as u64)
                    .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
                    .collect();
                for forward in [true, false] {
                    let (mut fast, mut slow) = (vec![0; len], vec![0; len]);
                    // SAFETY: support checked above.
                    unsafe {
                        gfni::permute_into(&bytes, &mut fast, code.codeword_bytes(), forward)
                    };
                    code.permute_scalar(&bytes, &mut slow, forward);
                    assert_eq!(fast, slow, "{} len {len} forward {forward}", code.name());
                }
            }
        }
    }

    #[test]
    fn every_length_round_trips_on_every_backend() {
        for code in [SECDED84_X8, GOLAY24_X8] {
            for n in [0, 1, 7, 8, 23, 24, 25, 383, 384, 385, 1000, 2 * CHUNK + 17] {
                let v = values(n, n as u64);
                let encoded = code.encode(&v).unwrap();
                for backend in Backend::available() {
                    let mut out = vec![0xFF; n];
                    let mut erasures = vec![!0; n.div_ceil(64)];
                    let stats = code
                        .decode_into_with(backend, &encoded, &mut out, &mut erasures)
                        .unwrap();
                    assert_eq!(out, v, "{} n={n} {backend:?}", code.name());
                    assert!(erasures.iter().all(|&w| w == 0));
                    assert_eq!(stats.clean, code.codewords(n) as u64);
                }
            }
        }
    }

    /// Every fault confined to one byte (all 255 patterns, every byte of 24
    /// whole blocks followed by a partial one) touches each codeword at most
    /// once: SECDED corrects all of them, which it cannot do without
    /// interleaving.
    #[test]
    fn every_multi_bit_upset_in_one_byte_is_corrected() {
        for code in [SECDED84_X8, GOLAY24_X8] {
            // 192 codewords and a partial block: the fused AVX-512 kernels
            // and the chunked path both see faults.
            let v = values((24 * DEPTH + 3) * code.values_per_codeword(), 5);
            let clean = code.encode(&v).unwrap();
            for byte in 0..24 * code.block_bytes() {
                for pattern in 1..=255u8 {
                    let mut hit = clean.clone();
                    hit[byte] ^= pattern;
                    let d = code.decode(&hit, v.len()).unwrap();
                    assert_eq!(d.values, v, "{} byte {byte} {pattern:#x}", code.name());
                    assert_eq!(d.stats.corrected, u64::from(pattern.count_ones()));
                    let mut scrubbed = hit.clone();
                    code.scrub(&mut scrubbed, v.len()).unwrap();
                    assert_eq!(scrubbed, clean);
                }
            }
        }
    }

    /// Every burst of 2 to 8 adjacent bits, at every start, is corrected too:
    /// a burst of at most eight bits reaches each codeword once.
    #[test]
    fn every_burst_of_up_to_eight_bits_is_corrected() {
        for code in [SECDED84_X8, GOLAY24_X8] {
            let v = values(24 * DEPTH * code.values_per_codeword(), 9);
            let clean = code.encode(&v).unwrap();
            for len in 2..=8 {
                for start in 0..8 * clean.len() - len + 1 {
                    let mut hit = clean.clone();
                    for b in start..start + len {
                        hit[b / 8] ^= 1 << (b % 8);
                    }
                    let truth = v.clone();
                    let mut out = vec![0; v.len()];
                    let mut erasures = vec![0; v.len().div_ceil(64)];
                    let stats = code
                        .decode_with_truth_into(&hit, &truth, &mut out, &mut erasures)
                        .unwrap();
                    assert_eq!(out, v, "{} burst {len} at {start}", code.name());
                    assert_eq!((stats.detected, stats.miscorrected), (0, 0));
                }
            }
        }
    }

    /// Past its promise the layout still reports what the code sees: two
    /// upsets in one byte pair hit SECDED codewords twice and are detected.
    #[test]
    fn two_flips_of_one_codeword_are_detected() {
        let code = SECDED84_X8;
        let v = values(8, 2);
        let mut hit = code.encode(&v).unwrap();
        // Bits 0 and 1 of codeword 3 live in bytes 0 and 1, bit 3.
        hit[0] ^= 1 << 3;
        hit[1] ^= 1 << 3;
        let d = code.decode(&hit, 8).unwrap();
        assert_eq!(d.stats.detected, 1);
        assert!(d.is_erased(3) && !d.is_erased(2));
        // The same two flips without interleaving would be two single flips
        // of codewords 0 and 1, both corrected: the layouts differ.
        assert_eq!(d.values[..3], v[..3]);
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let code = GOLAY24_X8;
        let encoded = code.encode(&values(30, 0)).unwrap();
        assert!(code.decode(&encoded[..29], 30).is_err());
        assert!(code.decode_into(&encoded, &mut [0; 30], &mut []).is_err());
        assert!(code.scrub(&mut encoded.clone()[..10], 30).is_err());
        assert!(code.encode_into(&[16], &mut [0; 3]).is_err());
    }
}
