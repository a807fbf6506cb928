//! Batch codecs for INT4 values: the byte layouts that `kv-quant` and the GPU
//! kernels reuse byte for byte.
//!
//! Input and output values are one per `u8`, in the low nibble (`0..=15`).
//! A value's bit `i` is data bit `dᵢ` of the paper, so the data word of
//! Hamming/SECDED is the value itself, and codeword bit `i` is bit `i` of the
//! stored word (LSB first).
//!
//! | code | layout | bits/value |
//! |---|---|---|
//! | [`Hamming74`] | the 7-bit codewords of values `8g..8g+8` form the 56-bit little-endian word of bytes `7g..7g+7`: codeword `j` in bits `7j..7j+7`; a final partial group uses `⌈7m/8⌉` bytes | 7 |
//! | [`Secded84`] | one byte per value: bits 0-3 the value, 4-6 the Hamming parity, 7 the overall parity | 8 |
//! | [`Golay24`] | values `3i, 3i+1, 3i+2` form data word `v₀ \| v₁<<4 \| v₂<<8`; the 24-bit codeword `d \| p<<12` is stored little-endian in bytes `3i..3i+3`; a final partial triple is padded with zero values | 8 |
//!
//! Every decode writes the decoded values, a bitmap of erased values (bit
//! `i % 64` of word `i / 64` set when value `i` sits in a detected-uncorrectable
//! codeword; such values are returned as received), and [`DecodeStats`]
//! counted per codeword. Decoding tables are derived once from the paper's
//! matrices through [`LinearCode`](crate::LinearCode), so the fast paths and the
//! generic decoder cannot drift apart.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod golay24;
mod hamming74;
pub mod interleaved;
mod nibble;
mod secded84;

use std::str::FromStr;

use crate::error::{Gf2Error, Result, check_len};
use crate::stats::DecodeStats;

pub use golay24::Golay24;
pub use hamming74::Hamming74;
pub use interleaved::Interleaved;
pub use secded84::Secded84;

/// Which implementation of a batch kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// Portable table-driven code; always available.
    Scalar,
    /// x86-64 AVX2 (with POPCNT): 32-byte `vpshufb` nibble lookups.
    Avx2,
    /// x86-64 AVX-512 F/BW/VBMI with GFNI (Ice Lake, Zen 4 and later):
    /// syndromes by `vgf2p8affineqb`, bit-field unpacking by `vpmultishiftqb`,
    /// 64 bytes per instruction.
    Avx512,
}

impl Backend {
    /// Every backend, slowest first.
    pub const ALL: [Backend; 3] = [Backend::Scalar, Backend::Avx2, Backend::Avx512];

    /// The fastest backend this CPU supports (checked at run time).
    pub fn detect() -> Backend {
        Backend::ALL
            .into_iter()
            .rev()
            .find(|b| b.is_supported())
            .unwrap_or(Backend::Scalar)
    }

    /// Whether this CPU can run the backend.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Backend::Scalar => true,
                Backend::Avx2 => has!("avx2") && has!("popcnt"),
                Backend::Avx512 => {
                    has!("avx512f")
                        && has!("avx512bw")
                        && has!("avx512vbmi")
                        && has!("gfni")
                        && has!("popcnt")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Backend::Scalar
        }
    }

    /// All backends this CPU supports (for tests and benchmarks).
    pub fn available() -> Vec<Backend> {
        Backend::ALL
            .into_iter()
            .filter(|b| b.is_supported())
            .collect()
    }

    fn ensure_supported(self) -> Result<()> {
        if self.is_supported() {
            Ok(())
        } else {
            Err(Gf2Error::InvalidParameter {
                name: "backend",
                reason: format!("{self:?} is not supported by this CPU"),
            })
        }
    }
}

/// Number of `u64` words of an erasure bitmap for `values` values.
pub const fn erasure_words(values: usize) -> usize {
    values.div_ceil(64)
}

/// The result of an owned-data decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// Decoded values, one per byte.
    pub values: Vec<u8>,
    /// Erasure bitmap (see the module docs).
    pub erasures: Vec<u64>,
    /// Outcome counts per codeword.
    pub stats: DecodeStats,
}

impl Decoded {
    /// Whether value `i` was flagged as erased.
    ///
    /// # Panics
    /// If `i` is out of range.
    pub fn is_erased(&self, i: usize) -> bool {
        assert!(i < self.values.len(), "value index {i} out of range");
        self.erasures[i / 64] >> (i % 64) & 1 == 1
    }
}

/// A batch codec for INT4 values in one of the layouts of this module.
///
/// The `_into` calls work on caller-provided slices and never allocate; the
/// others are conveniences over them. On error nothing useful is written.
pub trait Int4Codec {
    /// Short name, as used in cache-form spellings (`hamming74`, `secded84`,
    /// `golay24`, `secded84x8`, `golay24x8`).
    fn name(&self) -> &'static str;

    /// INT4 values held by one codeword.
    fn values_per_codeword(&self) -> usize;

    /// Stored bits per value (7 or 8).
    fn bits_per_value(&self) -> u32;

    /// Bytes of encoded storage for `values` values.
    fn encoded_len(&self, values: usize) -> usize;

    /// Codewords holding `values` values.
    fn codewords(&self, values: usize) -> usize {
        values.div_ceil(self.values_per_codeword())
    }

    /// The codeword of an encoding of `values` values that stored bit `bit`
    /// belongs to (bit `8i + j` is bit `j` of byte `i`). In the plain
    /// layouts codewords lie end to end.
    fn codeword_of_bit(&self, bit: u64, values: usize) -> usize {
        let _ = values;
        let per_codeword = u64::from(self.bits_per_value()) * self.values_per_codeword() as u64;
        (bit / per_codeword) as usize
    }

    /// Whether encodings of `values` values each, laid end to end, are the
    /// encoding of all their values (so several can be decoded in one call).
    /// True for the plain layouts once `values` fills whole codewords.
    fn concatenates(&self, values: usize) -> bool {
        values.is_multiple_of(self.values_per_codeword())
            && self.encoded_len(values) * 8 == values * self.bits_per_value() as usize
    }

    /// Encodes `values` (each `<= 15`) into `encoded` (`encoded_len(values.len())` bytes).
    fn encode_into(&self, values: &[u8], encoded: &mut [u8]) -> Result<()>;

    /// Decodes `values.len()` values from `encoded` with the given backend.
    fn decode_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats>;

    /// As [`decode_into_with`](Self::decode_into_with), comparing each decoded
    /// codeword's data with `truth` to count miscorrected and silent words.
    fn decode_with_truth_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats>;

    /// Scrubbing: decodes every codeword of the `values` values held in
    /// `encoded` and rewrites corrected codewords in place (detected ones are
    /// left as they are).
    fn scrub(&self, encoded: &mut [u8], values: usize) -> Result<DecodeStats>;

    /// Decodes with the fastest backend of this CPU.
    fn decode_into(
        &self,
        encoded: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.decode_into_with(Backend::detect(), encoded, values, erasures)
    }

    /// Truth-aware decode with the fastest backend of this CPU.
    fn decode_with_truth_into(
        &self,
        encoded: &[u8],
        truth: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.decode_with_truth_into_with(Backend::detect(), encoded, truth, values, erasures)
    }

    /// Encodes into a new buffer.
    fn encode(&self, values: &[u8]) -> Result<Vec<u8>> {
        let mut out = vec![0; self.encoded_len(values.len())];
        self.encode_into(values, &mut out)?;
        Ok(out)
    }

    /// Decodes `count` values into new buffers.
    fn decode(&self, encoded: &[u8], count: usize) -> Result<Decoded> {
        let mut values = vec![0; count];
        let mut erasures = vec![0; erasure_words(count)];
        let stats = self.decode_into(encoded, &mut values, &mut erasures)?;
        Ok(Decoded {
            values,
            erasures,
            stats,
        })
    }
}

/// The three codes of the paper and the interleaved layouts of two of them,
/// for choosing one at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int4Code {
    /// Hamming(7,4), 7 bits per value.
    Hamming74,
    /// Extended Hamming(8,4) SECDED, 8 bits per value.
    Secded84,
    /// Extended Golay(24,12), 24 bits per 3 values.
    Golay24,
    /// SECDED(8,4) with eight codewords bit-interleaved over their 8 bytes
    /// ([`interleaved`]): one byte holds one bit of each.
    Secded84x8,
    /// Golay(24,12) with eight codewords bit-interleaved over their 24 bytes.
    Golay24x8,
}

impl Int4Code {
    /// The paper's three codes, weakest first.
    pub const ALL: [Int4Code; 3] = [Int4Code::Hamming74, Int4Code::Secded84, Int4Code::Golay24];

    /// The interleaved layouts of SECDED and Golay.
    pub const INTERLEAVED: [Int4Code; 2] = [Int4Code::Secded84x8, Int4Code::Golay24x8];

    /// The code whose codewords this one stores (itself unless interleaved).
    pub fn base(self) -> Int4Code {
        match self {
            Int4Code::Secded84x8 => Int4Code::Secded84,
            Int4Code::Golay24x8 => Int4Code::Golay24,
            other => other,
        }
    }

    /// Whether codewords are bit-interleaved across bytes.
    pub fn is_interleaved(self) -> bool {
        self.base() != self
    }

    /// The codec as a trait object.
    pub fn codec(self) -> &'static dyn Int4Codec {
        match self {
            Int4Code::Hamming74 => &Hamming74,
            Int4Code::Secded84 => &Secded84,
            Int4Code::Golay24 => &Golay24,
            Int4Code::Secded84x8 => &interleaved::SECDED84_X8,
            Int4Code::Golay24x8 => &interleaved::GOLAY24_X8,
        }
    }

    /// The generic [`LinearCode`](crate::LinearCode) with the paper's
    /// matrices (of the base code for interleaved layouts: interleaving
    /// moves bits, the codewords are the same).
    pub fn linear_code(self) -> &'static crate::LinearCode {
        match self.base() {
            Int4Code::Hamming74 => hamming74::code(),
            Int4Code::Secded84 => secded84::code(),
            _ => golay24::code(),
        }
    }
}

impl std::fmt::Display for Int4Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.codec().name())
    }
}

impl FromStr for Int4Code {
    type Err = Gf2Error;

    fn from_str(s: &str) -> Result<Self> {
        Int4Code::ALL
            .into_iter()
            .chain(Int4Code::INTERLEAVED)
            .find(|c| c.codec().name() == s)
            .ok_or_else(|| Gf2Error::InvalidParameter {
                name: "code",
                reason: format!(
                    "unknown code {s:?}; expected one of hamming74, secded84, golay24, \
                     secded84x8, golay24x8"
                ),
            })
    }
}

/// The `vgf2p8affineqb` matrix operand computing, for every byte `x`, the byte
/// whose bit `i` is `parity(rows[i] & x)`: row `i` goes in byte `7 − i`.
pub(crate) fn affine_matrix(rows: [u8; 8]) -> u64 {
    rows.iter()
        .enumerate()
        .fold(0, |m, (i, &r)| m | u64::from(r) << (8 * (7 - i)))
}

/// Rows of the byte map that takes 8 received bits (`bit_syndrome(j)` is the
/// syndrome of bit j alone) to syndrome bits `8·half .. 8·half + 8`.
pub(crate) fn syndrome_rows(bit_syndrome: impl Fn(usize) -> u64, half: u32) -> [u8; 8] {
    let mut rows = [0u8; 8];
    for (i, row) in rows.iter_mut().enumerate() {
        for j in 0..8 {
            *row |= ((bit_syndrome(j) >> (8 * half as usize + i) & 1) as u8) << j;
        }
    }
    rows
}

/// Splits eight decode-table entries packed in a `u64` (entry j in byte j:
/// value in bits 0-3, flags in bits 6-7) into the eight values (one per byte)
/// and 8-bit masks of detected and corrected entries. The multiply gathers bit
/// 0 of byte k into bit 56 + k: the partial products `2^(8j + 56 − 7k)` are
/// distinct powers, so nothing carries into the top byte.
#[inline(always)]
pub(crate) fn split_entries(entries: u64) -> (u64, u64, u64) {
    const LSB_OF_EACH_BYTE: u64 = 0x0101_0101_0101_0101;
    const GATHER: u64 = 0x0102_0408_1020_4080;
    let values = entries & 0x0F0F_0F0F_0F0F_0F0F;
    let det = ((entries >> 7) & LSB_OF_EACH_BYTE).wrapping_mul(GATHER) >> 56;
    let corr = ((entries >> 6) & LSB_OF_EACH_BYTE).wrapping_mul(GATHER) >> 56;
    (values, det, corr)
}

/// Checks that every value fits in a nibble.
pub(crate) fn check_nibbles(values: &[u8]) -> Result<()> {
    // One branch-free pass (vectorised by the compiler) and a search only on failure.
    if values.iter().fold(0u8, |acc, &v| acc | v) <= 15 {
        return Ok(());
    }
    let index = values
        .iter()
        .position(|&v| v > 15)
        .expect("some value is > 15");
    Err(Gf2Error::NibbleOutOfRange {
        index,
        value: values[index],
    })
}

/// Checks the slices of a decode call.
pub(crate) fn check_decode_shapes(
    codec: &dyn Int4Codec,
    encoded: usize,
    values: usize,
    erasures: usize,
    truth: Option<usize>,
) -> Result<()> {
    check_len("encoded", codec.encoded_len(values), encoded)?;
    check_len("erasures", erasure_words(values), erasures)?;
    if let Some(t) = truth {
        check_len("truth", values, t)?;
    }
    Ok(())
}

/// Bit `i` set where `a[i] != b[i]` (slices of at most 64).
#[inline]
pub(crate) fn mismatch_mask(a: &[u8], b: &[u8]) -> u64 {
    a.iter()
        .zip(b)
        .enumerate()
        .fold(0u64, |m, (i, (x, y))| m | (u64::from(x != y) << i))
}

/// Decodes 64 values of a one-value-per-codeword layout from `encoded`
/// (at least [`CHUNK_READ`] readable bytes) into `out`; returns the masks of
/// detected and corrected values.
pub(crate) trait ChunkKernel {
    /// Encoded bytes per 64 values.
    const CHUNK_BYTES: usize;

    /// The kernel proper, on raw pointers so the hot loop carries no bounds checks.
    ///
    /// # Safety
    /// `encoded` must point to [`CHUNK_READ`] readable bytes and `out` to 64
    /// writable bytes; the CPU features of the kernel's backend must be present.
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64);

    /// Checked entry point for the tail and the truth-aware path.
    #[inline(always)]
    fn decode_chunk(&self, encoded: &[u8], out: &mut [u8; 64]) -> (u64, u64) {
        assert!(
            encoded.len() >= CHUNK_READ,
            "chunk kernels read {CHUNK_READ} bytes"
        );
        // SAFETY: lengths asserted above; backends are only constructed after
        // `Backend::ensure_supported` (see each codec's `run`).
        unsafe { self.decode_chunk_raw(encoded.as_ptr(), out.as_mut_ptr()) }
    }

    /// Decodes [`BLOCK_CHUNKS`] consecutive chunks. Returns `true` when every
    /// value was clean, leaving `masks` untouched (a kernel that can test a
    /// whole block at once skips the masks and their counts); otherwise
    /// fills `masks` with each chunk's and returns `false`. The default
    /// decodes chunk by chunk and always fills the masks.
    ///
    /// # Safety
    /// `encoded` must point to `(BLOCK_CHUNKS - 1) * CHUNK_BYTES + CHUNK_READ`
    /// readable bytes and `out` to `64 * BLOCK_CHUNKS` writable bytes; the CPU
    /// features of the kernel's backend must be present.
    #[inline(always)]
    unsafe fn decode_block_raw(
        &self,
        encoded: *const u8,
        out: *mut u8,
        masks: &mut [(u64, u64); BLOCK_CHUNKS],
    ) -> bool {
        for (j, m) in masks.iter_mut().enumerate() {
            // SAFETY: chunk j < BLOCK_CHUNKS reads CHUNK_READ bytes from
            // j·CHUNK_BYTES and writes 64 from 64·j, inside the caller's bounds.
            *m = unsafe {
                self.decode_chunk_raw(encoded.add(j * Self::CHUNK_BYTES), out.add(64 * j))
            };
        }
        false
    }
}

/// Bytes a chunk kernel may read from the start of its chunk.
pub(crate) const CHUNK_READ: usize = 64;

/// Chunks decoded together by [`ChunkKernel::decode_block_raw`].
pub(crate) const BLOCK_CHUNKS: usize = 4;

/// The shared loop of the one-value-per-codeword codes: full chunks straight
/// from the input, in blocks of [`BLOCK_CHUNKS`] through
/// [`ChunkKernel::decode_block_raw`] and then the leftover ones singly, then
/// the tail (and every chunk, when the truth is known) through
/// [`account_chunk`].
/// Two call sites of one inlined body, so that each copy sees a constant
/// `truth` (the clean loop then carries no truth test).
#[inline(always)]
pub(crate) fn drive_chunks<K: ChunkKernel>(
    kernel: &K,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    match truth {
        None => drive_chunks_with(kernel, encoded, values, None, erasures),
        Some(t) => drive_chunks_with(kernel, encoded, values, Some(t), erasures),
    }
}

/// The body of [`drive_chunks`].
#[inline(always)]
fn drive_chunks_with<K: ChunkKernel>(
    kernel: &K,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    let n = values.len();
    let mut stats = DecodeStats::default();
    // Chunks with 64 values whose kernel read stays inside `encoded`.
    let readable = (encoded.len() + K::CHUNK_BYTES).saturating_sub(CHUNK_READ) / K::CHUNK_BYTES;
    let fast = if truth.is_none() {
        (n / 64).min(readable)
    } else {
        0
    };
    let (mut detected, mut corrected) = (0u64, 0u64);
    assert!(fast <= erasures.len() && 64 * fast <= n);
    let (src, dst) = (encoded.as_ptr(), values.as_mut_ptr());
    let blocked = fast - fast % BLOCK_CHUNKS;
    for (b, block) in erasures[..blocked]
        .chunks_exact_mut(BLOCK_CHUNKS)
        .enumerate()
    {
        let c = b * BLOCK_CHUNKS;
        let mut masks = [(0u64, 0u64); BLOCK_CHUNKS];
        // SAFETY: chunks c..c + BLOCK_CHUNKS are all below `fast`, so each has
        // 64 values and its kernel read ends inside `encoded` (as below).
        let clean = unsafe {
            kernel.decode_block_raw(src.add(c * K::CHUNK_BYTES), dst.add(64 * c), &mut masks)
        };
        if clean {
            block.fill(0);
        } else {
            for (erasure, (det, corr)) in block.iter_mut().zip(masks) {
                *erasure = det;
                detected += u64::from(det.count_ones());
                corrected += u64::from(corr.count_ones());
            }
        }
    }
    for (c, erasure) in erasures[..fast].iter_mut().enumerate().skip(blocked) {
        // SAFETY: for c < fast, chunk c has 64 values (64·fast <= n, asserted)
        // and its kernel read ends inside `encoded` (definition of `readable`).
        let (det, corr) =
            unsafe { kernel.decode_chunk_raw(src.add(c * K::CHUNK_BYTES), dst.add(64 * c)) };
        *erasure = det;
        detected += u64::from(det.count_ones());
        corrected += u64::from(corr.count_ones());
    }
    stats.words = 64 * fast as u64;
    stats.detected = detected;
    stats.corrected = corrected;
    stats.clean = stats.words - detected - corrected;
    for c in fast..n.div_ceil(64) {
        let out = &mut values[64 * c..(64 * c + 64).min(n)];
        let t = truth.map(|t| &t[64 * c..64 * c + out.len()]);
        stats += account_chunk(
            kernel,
            &encoded[c * K::CHUNK_BYTES..],
            out,
            t,
            &mut erasures[c],
        );
    }
    stats
}

/// Decodes one chunk of up to 64 values (through a zero-padded buffer when the
/// kernel could read past `encoded`) and counts it, with or without truth.
#[inline(always)]
fn account_chunk<K: ChunkKernel>(
    kernel: &K,
    encoded: &[u8],
    out: &mut [u8],
    truth: Option<&[u8]>,
    erasure: &mut u64,
) -> DecodeStats {
    let count = out.len();
    let (det, corr) = if let (Ok(out64), true) = (
        <&mut [u8; 64]>::try_from(&mut *out),
        encoded.len() >= CHUNK_READ,
    ) {
        kernel.decode_chunk(encoded, out64)
    } else {
        let mut buf = [0u8; CHUNK_READ];
        let used = encoded.len().min(CHUNK_READ);
        buf[..used].copy_from_slice(&encoded[..used]);
        let mut tmp = [0u8; 64];
        let masks = kernel.decode_chunk(&buf, &mut tmp);
        out.copy_from_slice(&tmp[..count]);
        masks
    };
    let valid = crate::bitvec::low_mask(count);
    let (det, corr) = (det & valid, corr & valid);
    *erasure = det;
    let mut stats = DecodeStats {
        words: count as u64,
        detected: u64::from(det.count_ones()),
        ..DecodeStats::default()
    };
    let clean = valid & !det & !corr;
    let wrong = truth.map_or(0, |t| mismatch_mask(out, t)) & !det;
    stats.corrected = u64::from((corr & !wrong).count_ones());
    stats.miscorrected = u64::from((corr & wrong).count_ones());
    stats.clean = u64::from((clean & !wrong).count_ones());
    stats.silent = u64::from((clean & wrong).count_ones());
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for code in Int4Code::ALL {
            assert_eq!(code.to_string().parse::<Int4Code>().unwrap(), code);
        }
        assert!(matches!(
            "golay23".parse::<Int4Code>(),
            Err(Gf2Error::InvalidParameter { .. })
        ));
    }

    #[test]
    fn nibble_check_finds_first_bad_value() {
        assert!(check_nibbles(&[0, 15, 7]).is_ok());
        assert_eq!(
            check_nibbles(&[1, 2, 16, 200]).unwrap_err(),
            Gf2Error::NibbleOutOfRange {
                index: 2,
                value: 16
            }
        );
    }

    #[test]
    fn split_entries_gathers_flags() {
        for mask in 0u64..256 {
            let det = mask;
            let corr = mask.reverse_bits() >> 56;
            let entries = (0..8).fold(0u64, |e, k| {
                let byte = (k as u64 & 0xF) | (det >> k & 1) << 7 | (corr >> k & 1) << 6;
                e | byte << (8 * k)
            });
            let (values, d, c) = split_entries(entries);
            assert_eq!((d, c), (det, corr));
            assert_eq!(values, 0x0706_0504_0302_0100);
        }
    }

    #[test]
    fn mismatch_mask_marks_differences() {
        assert_eq!(mismatch_mask(&[1, 2, 3, 4], &[1, 0, 3, 0]), 0b1010);
    }
}
