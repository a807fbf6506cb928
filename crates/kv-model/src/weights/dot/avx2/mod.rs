//! The AVX2 + FMA + F16C kernels (x86-64). Each computes exactly what its
//! twin in `scalar.rs` computes (the integer sums are exact, and the float
//! accumulations run in the order that file defines), so the two are
//! tested for equality bit for bit.
//!
//! The 32-value types follow the shape of llama.cpp's AVX2 `vec_dot`s: a
//! block's 16 bytes of nibbles become 32 bytes (low nibbles, then high), the
//! codes times the activation codes are summed in pairs by `vpmaddubsw`
//! (unsigned × signed; signed weights go through `vpsignb` first) and in
//! fours by `vpmaddwd`, and each block's eight lane sums are scaled into
//! eight f32 accumulators. The k-quants sum whole super-blocks in integers
//! with each sub-block's scale applied by `vpmaddwd`.
//!
//! Every function is `unsafe` for its target features only: the caller
//! must have checked the CPU ([`Isa::Avx2`](crate::weights::Isa)). Loads
//! are unaligned and stay inside the `chunks_exact` block they belong to.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::super::activations::{Q8Block, Q8KBlock};
use super::super::kquants::scale_min_k4;

mod lanes;

pub(crate) use lanes::{
    q4_0_lanes, q4_0_lanes_vnni, q4_1_lanes, q4_k_lanes, q4_k_lanes_vnni, q5_0_lanes,
    q5_0_lanes_vnni, q5_1_lanes, q6_k_lanes, q6_k_lanes_vnni,
};

/// The f16 at byte `i` of a block, converted by F16C (the `half` crate's
/// conversion, without F16C enabled at compile time, costs more than the
/// rest of a 32-value block's product). Broadcast rather than inserted: an
/// insert into a register merges with its old contents, which tied every
/// block's scale to the accumulator of the block before (measured: 14
/// cycles a block instead of 5).
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], i: usize) -> f32 {
    let bits = i16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits)))
}

/// Adds the eight lanes in [`hsum8`](super::scalar::hsum8)'s order.
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The sums of the lanes of `a` and of `b`, reduced together.
#[inline(always)]
fn hsum2_epi32(a: __m256i, b: __m256i) -> (i32, i32) {
    // SAFETY: register-only AVX2 operations; only inlined into the
    // kernels below (AVX2).
    unsafe {
        // [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
        let s = _mm256_hadd_epi32(a, b);
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_hadd_epi32(s, s);
        (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
    }
}

/// 32 loaded bytes.
///
/// # Safety
/// `p` must have 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// 16 bytes of nibbles as 32 bytes: the low nibbles (values 0..16), then the
/// high ones (values 16..32).
///
/// # Safety
/// `p` must have 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
    let t = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(t), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// The 32 bits at `p` (little-endian) as 32 bytes, `0xff` where the bit of
/// that value is set.
///
/// # Safety
/// `p` must have 4 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_bytes(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes; read unaligned.
    let bits = unsafe { p.cast::<i32>().read_unaligned() };
    // Byte j takes byte j / 8 of the word, then is tested for bit j % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select)
}

/// The f16 scale and min at bytes 0..4 of a 32-value block, in lanes 0
/// and 1 (for `Q4_0`, `Q5_0` and `Q8_0` lane 1 is code bytes, unused).
/// Loaded whole by `vmovd`, which clears the register's other lanes: a
/// 16-bit insert would merge into a register that held the accumulator and
/// tie every block to the one before it (measured: 14 cycles a block
/// instead of 5).
#[target_feature(enable = "avx2,fma,f16c")]
fn block_scales(b: &[u8]) -> __m128 {
    let bits = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// How a 32-value block's codes meet a token's: 32 unsigned bytes times
/// 32 signed bytes, summed four products a lane into eight exact i32
/// lanes (the unsigned side is at most 128 and the signed one within
/// ±127 in every kernel here, so no pair sum saturates `vpmaddubsw`).
pub(super) trait PairSum {
    /// # Safety
    /// The CPU has the implementation's features: it is only inlined into
    /// kernels that enable them.
    unsafe fn sum32(x: __m256i, y: __m256i) -> __m256i;
}

/// AVX2: `vpmaddubsw` sums the products in pairs, `vpmaddwd` against
/// ones in fours.
impl PairSum for lanes::Madd {
    #[inline(always)]
    unsafe fn sum32(x: __m256i, y: __m256i) -> __m256i {
        // SAFETY: register-only AVX2 operations; the caller has AVX2.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)) }
    }
}

/// AVX-512 VNNI on 256-bit registers (VL): `vpdpbusd` sums the four
/// products of each lane in one instruction, as llama.cpp's
/// `mul_sum_us8_pairs_float` does where it has VNNI. The same integers as
/// [`lanes::Madd`]'s two.
impl PairSum for lanes::Vnni {
    #[inline(always)]
    unsafe fn sum32(x: __m256i, y: __m256i) -> __m256i {
        // SAFETY: a register-only AVX-512 VNNI/VL operation; the caller
        // has both.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y) }
    }
}

/// The 32-value types' accumulation for `N` tokens at once: `unpack(block)`
/// is a block's 32 weight codes as bytes (signed with `SIGNED`, else
/// unsigned), unpacked once and multiplied by each token's codes; with
/// `MIN`, each block adds `m·s` (`Q4_1`, `Q5_1`). Each token's arithmetic
/// is the same whatever `N` is, so a token gets the same bits alone and in
/// a group.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and what `S` needs: only inlined into the
/// entry points below, which enable them.
#[inline(always)]
unsafe fn lanes32<S: PairSum, const MIN: bool, const SIGNED: bool, const N: usize>(
    w: &[u8],
    block_bytes: usize,
    a: [&[Q8Block]; N],
    unpack: impl Fn(&[u8]) -> __m256i,
) -> [f32; N] {
    // Every row cut to the same length, so that indexing below needs no
    // bounds checks (they were a fifth of the loop's instructions).
    let blocks = a
        .iter()
        .map(|a| a.len())
        .fold(w.len() / block_bytes, usize::min);
    let a: [&[Q8Block]; N] = std::array::from_fn(|j| &a[j][..blocks]);
    // SAFETY: the caller has the features; loads as commented.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0f32; N];
        for (i, b) in w.chunks_exact(block_bytes).take(blocks).enumerate() {
            let x = unpack(b);
            let ax = if SIGNED { _mm256_sign_epi8(x, x) } else { x };
            let scales = block_scales(b);
            let dw = _mm256_broadcastss_ps(scales);
            for j in 0..N {
                // Every row of `a` was cut to `blocks` blocks above, and `i
                // < blocks` (`take(blocks)`). Unchecked because the checks,
                // which the compiler keeps, were a fifth of the
                // instructions of the four-token loop.
                let act = a[j].get_unchecked(i);
                // `qs` is 32 bytes.
                let y = load(act.qs.as_ptr().cast());
                let sy = if SIGNED { _mm256_sign_epi8(y, x) } else { y };
                let sum = S::sum32(ax, sy);
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(act.d));
                acc[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sum), acc[j]);
                if MIN {
                    mins[j] += _mm_cvtss_f32(_mm_movehdup_ps(scales)) * act.s;
                }
            }
        }
        let mut out = [0f32; N];
        for j in 0..N {
            out[j] = hsum_ps(acc[j]) + mins[j];
        }
        out
    }
}

/// The sum of the eight lanes (exact: integers).
#[inline(always)]
fn hsum_epi32(v: __m256i) -> i32 {
    // SAFETY: register-only AVX2 operations; only inlined into the
    // kernels below (AVX2).
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
    }
}

/// The serial accumulation of `Q4_0` and `Q5_0` (`scalar.rs`) for `N`
/// tokens' rows: `unpack(block)` is a block's 32 signed codes, unpacked
/// once; each token's block sum is added up across the lanes, exactly,
/// and accumulated by one fused multiply-add.
///
/// # Safety
/// As [`lanes32`].
#[inline(always)]
unsafe fn serial32<S: PairSum, const N: usize>(
    w: &[u8],
    block_bytes: usize,
    a: [&[Q8Block]; N],
    unpack: impl Fn(&[u8]) -> __m256i,
) -> [f32; N] {
    let blocks = a
        .iter()
        .map(|a| a.len())
        .fold(w.len() / block_bytes, usize::min);
    let a: [&[Q8Block]; N] = std::array::from_fn(|j| &a[j][..blocks]);
    if N == 1 {
        // SAFETY: as this function's.
        let one =
            unsafe { serial32_one::<S>(&w[..blocks * block_bytes], block_bytes, a[0], unpack) };
        return [one; N];
    }
    // The even and the odd chains apart, each indexed by the token alone
    // (a constant once unrolled): indexed by a block's parity too, they
    // lived on the stack and each block waited for the store of the one
    // before it.
    let (mut even, mut odd) = ([0f32; N], [0f32; N]);
    let mut pairs = w[..blocks * block_bytes].chunks_exact(2 * block_bytes);
    for (p, pair) in pairs.by_ref().enumerate() {
        // SAFETY: the caller has the features; every row of `a` was cut to
        // `blocks` blocks above, and both indices are below it.
        unsafe {
            serial_block::<S, N>(
                &a,
                2 * p,
                unpack(&pair[..block_bytes]),
                &pair[..block_bytes],
                &mut even,
            );
            serial_block::<S, N>(
                &a,
                2 * p + 1,
                unpack(&pair[block_bytes..]),
                &pair[block_bytes..],
                &mut odd,
            );
        }
    }
    if !pairs.remainder().is_empty() {
        let b = pairs.remainder();
        // SAFETY: as above; `blocks − 1` is the last block.
        unsafe { serial_block::<S, N>(&a, blocks - 1, unpack(b), b, &mut even) };
    }
    let mut out = [0f32; N];
    for j in 0..N {
        out[j] = even[j] + odd[j];
    }
    out
}

/// One block `b` (its signed codes `x`) of [`serial32`] for each of the
/// `N` tokens, accumulated into `acc` by one fused multiply-add each. A
/// function, not a closure: a closure written in a function without the
/// target features is compiled without them, and its intrinsics became
/// calls (seen in the binary).
///
/// # Safety
/// As [`lanes32`]; every row of `a` has more than `i` blocks.
#[inline(always)]
unsafe fn serial_block<S: PairSum, const N: usize>(
    a: &[&[Q8Block]; N],
    i: usize,
    x: __m256i,
    b: &[u8],
    acc: &mut [f32; N],
) {
    // SAFETY: the caller has the features and the bounds; `qs` is 32 bytes.
    unsafe {
        let ax = _mm256_sign_epi8(x, x);
        let dw = f16_at(b, 0);
        for j in 0..N {
            let act = a[j].get_unchecked(i);
            let y = load(act.qs.as_ptr().cast());
            let sum = S::sum32(ax, _mm256_sign_epi8(y, x));
            acc[j] = (dw * act.d).mul_add(hsum_epi32(sum) as f32, acc[j]);
        }
    }
}

/// A block's scale times a token's: the factor of its block sum.
///
/// # Safety
/// The CPU has F16C; `b` holds its block's scale in bytes 0..2 (and 4
/// bytes in all).
#[inline(always)]
unsafe fn block_factor(b: &[u8], y: &Q8Block) -> f32 {
    // SAFETY: the caller has F16C.
    unsafe { _mm_cvtss_f32(block_scales(b)) * y.d }
}

/// A block's 32 products of signed codes `x` and a token's codes, in
/// eight lanes (exact).
///
/// # Safety
/// As [`lanes32`].
#[inline(always)]
unsafe fn signed_block_sum<S: PairSum>(x: __m256i, y: &Q8Block) -> __m256i {
    // SAFETY: register-only operations and a load of `qs` (32 bytes); the
    // caller has the features.
    unsafe {
        let y = load(y.qs.as_ptr().cast());
        S::sum32(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
    }
}

/// [`serial32`] for one token: four blocks' lane sums are added up
/// together (three `vphaddd`, where one block's sum alone takes a chain of
/// six operations), then accumulated one by one into the two chains.
///
/// # Safety
/// As [`lanes32`].
#[inline(always)]
unsafe fn serial32_one<S: PairSum>(
    w: &[u8],
    block_bytes: usize,
    a: &[Q8Block],
    unpack: impl Fn(&[u8]) -> __m256i,
) -> f32 {
    let (mut even, mut odd) = (0f32, 0f32);
    let quads = w.chunks_exact(4 * block_bytes).zip(a.chunks_exact(4));
    for (w, a) in quads {
        let (b0, b1, b2, b3) = (
            &w[..block_bytes],
            &w[block_bytes..2 * block_bytes],
            &w[2 * block_bytes..3 * block_bytes],
            &w[3 * block_bytes..],
        );
        let mut sums = [0f32; 4];
        // SAFETY: the caller has the features; `sums` is four f32.
        unsafe {
            let s0 = signed_block_sum::<S>(unpack(b0), &a[0]);
            let s1 = signed_block_sum::<S>(unpack(b1), &a[1]);
            let s2 = signed_block_sum::<S>(unpack(b2), &a[2]);
            let s3 = signed_block_sum::<S>(unpack(b3), &a[3]);
            // [Σ s0, Σ s1, Σ s2, Σ s3] after the two halves are added.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            _mm_storeu_ps(sums.as_mut_ptr(), _mm_cvtepi32_ps(h));
        }
        // SAFETY: the caller has F16C; each block holds its scale.
        unsafe {
            even = block_factor(b0, &a[0]).mul_add(sums[0], even);
            odd = block_factor(b1, &a[1]).mul_add(sums[1], odd);
            even = block_factor(b2, &a[2]).mul_add(sums[2], even);
            odd = block_factor(b3, &a[3]).mul_add(sums[3], odd);
        }
    }
    let done = a.len() / 4 * 4;
    for (i, (b, y)) in w.chunks_exact(block_bytes).zip(a).enumerate().skip(done) {
        // SAFETY: as above.
        let (sum, factor) = unsafe {
            (
                hsum_epi32(signed_block_sum::<S>(unpack(b), y)) as f32,
                block_factor(b, y),
            )
        };
        let acc = if i % 2 == 0 { &mut even } else { &mut odd };
        *acc = factor.mul_add(sum, *acc);
    }
    even + odd
}

/// A `Q4_0` block's codes as stored (unsigned, `0 .. 16`).
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0_codes(b: &[u8]) -> __m256i {
    // SAFETY: a block is 18 bytes (nibbles at 2..18).
    unsafe { nibbles(b[..18].as_ptr().add(2)) }
}

/// A `Q5_0` block's codes as stored (unsigned, `0 .. 32`).
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0_codes(b: &[u8]) -> __m256i {
    let b = &b[..22];
    // SAFETY: a block is 22 bytes (`qh` at 2..6, nibbles at 6..22).
    let (low, high) = unsafe { (nibbles(b.as_ptr().add(6)), bit_bytes(b.as_ptr().add(2))) };
    _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)))
}

/// The 32-value kernels' entry points: `$avx2` with AVX2's block sums
/// ([`lanes::Madd`]), `$vnni` with `vpdpbusd`'s ([`lanes::Vnni`]), both
/// running `$body` with `$s` the [`PairSum`] (the same bits).
macro_rules! kernels32 {
    ($(#[$doc:meta])* $avx2:ident, $vnni:ident, |$w:ident, $a:ident, $s:ident| $body:expr) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) fn $avx2<const N: usize>($w: &[u8], $a: [&[Q8Block]; N]) -> [f32; N] {
            type $s = lanes::Madd;
            // SAFETY: this function enables what `Madd` needs.
            unsafe { $body }
        }

        $(#[$doc])*
        /// (Block sums by `vpdpbusd`.)
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(crate) fn $vnni<const N: usize>($w: &[u8], $a: [&[Q8Block]; N]) -> [f32; N] {
            type $s = lanes::Vnni;
            // SAFETY: this function enables what `Vnni` needs.
            unsafe { $body }
        }
    };
}

kernels32!(
    /// `Q4_0 · Q8_0`.
    q4_0,
    q4_0_vnni,
    |w, a, S| serial32::<S, N>(w, 18, a, |b| {
        _mm256_sub_epi8(q4_0_codes(b), _mm256_set1_epi8(8))
    })
);

kernels32!(
    /// `Q4_1 · Q8_1`.
    q4_1,
    q4_1_vnni,
    // A block is 20 bytes (nibbles at 4..20).
    |w, a, S| lanes32::<S, true, false, N>(w, 20, a, |b| nibbles(b.as_ptr().add(4)))
);

kernels32!(
    /// `Q5_0 · Q8_0`: the fifth bit clear makes a code `nibble − 16`, which
    /// as a byte is the nibble with its top four bits set.
    q5_0,
    q5_0_vnni,
    |w, a, S| serial32::<S, N>(w, 22, a, |b| {
        // A block is 22 bytes (`qh` at 2..6, nibbles at 6..22).
        let (low, high) = (nibbles(b.as_ptr().add(6)), bit_bytes(b.as_ptr().add(2)));
        _mm256_or_si256(
            low,
            _mm256_andnot_si256(high, _mm256_set1_epi8(0xf0u8 as i8)),
        )
    })
);

kernels32!(
    /// `Q5_1 · Q8_1`.
    q5_1,
    q5_1_vnni,
    |w, a, S| lanes32::<S, true, false, N>(w, 24, a, |b| {
        // A block is 24 bytes (`qh` at 4..8, nibbles at 8..24).
        let (low, high) = (nibbles(b.as_ptr().add(8)), bit_bytes(b.as_ptr().add(4)));
        _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)))
    })
);

kernels32!(
    /// `Q8_0 · Q8_0`.
    q8_0,
    q8_0_vnni,
    // A block is 34 bytes (codes at 2..34).
    |w, a, S| lanes32::<S, false, true, N>(w, 34, a, |b| load(b.as_ptr().add(2)))
);

/// The eight 6-bit scales of a `Q4_K`/`Q5_K` super-block, and its mins
/// each twice in order (`m_j` at lanes `2j` and `2j + 1`, the two
/// 16-value sums of run `j` in a Q8_K block's `bsums`).
#[inline(always)]
fn k4_scales(scales: &[u8]) -> ([i16; 8], [i16; 16]) {
    let mut sc = [0i16; 8];
    let mut mins = [0i16; 16];
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, scales);
        sc[j] = i16::from(s);
        mins[2 * j] = i16::from(m);
        mins[2 * j + 1] = i16::from(m);
    }
    (sc, mins)
}

/// A Q8_K block's sixteen 16-value sums.
#[inline(always)]
fn bsums(y: &Q8KBlock) -> __m256i {
    // SAFETY: `bsums` is 16 i16, 32 bytes.
    unsafe { load(y.bsums.as_ptr().cast()) }
}

/// The valid super-blocks of `N` activation rows against `w`.
fn k_blocks<const N: usize>(w: &[u8], block_bytes: usize, a: &[&[Q8KBlock]; N]) -> usize {
    a.iter()
        .map(|a| a.len())
        .fold(w.len() / block_bytes, usize::min)
}

/// `Σ_r Σ (codes_r · y_r)·scale_r` over a super-block's eight runs of 32,
/// in eight lanes to be summed (exact in integers).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_runs(codes: &[__m256i; 8], scales: &[__m256i; 8], y: &Q8KBlock) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for r in 0..8 {
        // SAFETY: run r is activation codes 32r .. 32r + 32 of 256.
        let y = unsafe { load(y.qs.as_ptr().add(32 * r).cast()) };
        sum = _mm256_add_epi32(
            sum,
            _mm256_madd_epi16(_mm256_maddubs_epi16(codes[r], y), scales[r]),
        );
    }
    sum
}

/// `Q4_K · Q8_K`, `N` tokens at once (the codes unpacked once per
/// super-block; each token's arithmetic as alone).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q4_k<const N: usize>(w: &[u8], a: [&[Q8KBlock]; N]) -> [f32; N] {
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [0f32; N];
    let blocks = k_blocks(w, 144, &a);
    let a: [&[Q8KBlock]; N] = std::array::from_fn(|j| &a[j][..blocks]);
    for (i, b) in w.chunks_exact(144).take(blocks).enumerate() {
        let (sc, mins) = k4_scales(&b[4..16]);
        let mut codes = [_mm256_setzero_si256(); 8];
        for j in 0..4 {
            // SAFETY: `qs` is bytes 16..144 of the block, 32 per pair of runs.
            let q = unsafe { load(b.as_ptr().add(16 + 32 * j)) };
            codes[2 * j] = _mm256_and_si256(q, mask);
            codes[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
        }
        let scales = sc.map(|s| _mm256_set1_epi16(s));
        // SAFETY: 16 i16, 32 bytes.
        let mins = unsafe { load(mins.as_ptr().cast()) };
        let (dw, dminw) = (f16_at(b, 0), f16_at(b, 2));
        for (acc, a) in acc.iter_mut().zip(&a) {
            let y = &a[i];
            // `Σ_j m_j·(bsums_2j + bsums_2j+1)`: one multiply-add, exact.
            let (sumi, summ) = hsum2_epi32(
                k_runs(&codes, &scales, y),
                _mm256_madd_epi16(bsums(y), mins),
            );
            let (d, dmin) = (y.d * dw, y.d * dminw);
            *acc = *acc + d * sumi as f32 - dmin * summ as f32;
        }
    }
    acc
}

/// `Q5_K · Q8_K`, `N` tokens at once. Its per-token tail is `q4_k`'s,
/// written again: a shared helper measured 11% slower generation on
/// Qwen2.5-1.5B (16.1 against 18.1 tokens/s; the call stayed out of line).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q5_k<const N: usize>(w: &[u8], a: [&[Q8KBlock]; N]) -> [f32; N] {
    let (mask, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let mut acc = [0f32; N];
    let blocks = k_blocks(w, 176, &a);
    let a: [&[Q8KBlock]; N] = std::array::from_fn(|j| &a[j][..blocks]);
    for (i, b) in w.chunks_exact(176).take(blocks).enumerate() {
        let (sc, mins) = k4_scales(&b[4..16]);
        // SAFETY: `qh` is bytes 16..48 of the block.
        let qh = unsafe { load(b.as_ptr().add(16)) };
        let mut codes = [_mm256_setzero_si256(); 8];
        for j in 0..4 {
            // SAFETY: `qs` is bytes 48..176 of the block, 32 per pair of runs.
            let q = unsafe { load(b.as_ptr().add(48 + 32 * j)) };
            // Bit 2j of `qh[l]` tops value l of run 2j, bit 2j + 1 of run 2j + 1.
            let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32));
            let h0 = _mm256_and_si256(h, one);
            let h1 = _mm256_and_si256(_mm256_srli_epi16::<1>(h), one);
            codes[2 * j] = _mm256_or_si256(_mm256_and_si256(q, mask), _mm256_slli_epi16::<4>(h0));
            codes[2 * j + 1] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask),
                _mm256_slli_epi16::<4>(h1),
            );
        }
        let scales = sc.map(|s| _mm256_set1_epi16(s));
        // SAFETY: 16 i16, 32 bytes.
        let mins = unsafe { load(mins.as_ptr().cast()) };
        let (dw, dminw) = (f16_at(b, 0), f16_at(b, 2));
        for (acc, a) in acc.iter_mut().zip(&a) {
            let y = &a[i];
            // `Σ_j m_j·(bsums_2j + bsums_2j+1)`: one multiply-add, exact.
            let (sumi, summ) = hsum2_epi32(
                k_runs(&codes, &scales, y),
                _mm256_madd_epi16(bsums(y), mins),
            );
            let (d, dmin) = (y.d * dw, y.d * dminw);
            *acc = *acc + d * sumi as f32 - dmin * summ as f32;
        }
    }
    acc
}

/// `Q6_K · Q8_K`, `N` tokens at once: `Σ_g sc_g·(Σ q·y − 32·Σy)_g`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q6_k<const N: usize>(w: &[u8], a: [&[Q8KBlock]; N]) -> [f32; N] {
    let (mask, pair) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    let mut acc = [0f32; N];
    let blocks = k_blocks(w, 210, &a);
    let a: [&[Q8KBlock]; N] = std::array::from_fn(|j| &a[j][..blocks]);
    for (i, b) in w.chunks_exact(210).take(blocks).enumerate() {
        let sc: [i16; 16] = std::array::from_fn(|g| i16::from(b[192 + g] as i8));
        let mut codes = [_mm256_setzero_si256(); 8];
        let mut scales = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            // SAFETY: `ql` is bytes 0..128 (64 per half), `qh` 128..192 (32
            // per half).
            let (l1, l2, h) = unsafe {
                (
                    load(b.as_ptr().add(64 * n)),
                    load(b.as_ptr().add(64 * n + 32)),
                    load(b.as_ptr().add(128 + 32 * n)),
                )
            };
            let high = |s: i32| {
                let h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(s));
                _mm256_slli_epi16::<4>(_mm256_and_si256(h, pair))
            };
            let runs = [
                _mm256_or_si256(_mm256_and_si256(l1, mask), high(0)),
                _mm256_or_si256(_mm256_and_si256(l2, mask), high(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), mask), high(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l2), mask), high(6)),
            ];
            for (k, q) in runs.into_iter().enumerate() {
                // Run k of half n: values 128n + 32k ..+ 32, groups g and g + 1.
                let g = 8 * n + 2 * k;
                codes[4 * n + k] = q;
                scales[4 * n + k] =
                    _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
            }
        }
        let dw = f16_at(b, 208);
        // SAFETY: `scales` is bytes 192..208 of the block.
        let group_scales =
            unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(b.as_ptr().add(192).cast())) };
        for (acc, a) in acc.iter_mut().zip(&a) {
            let y = &a[i];
            // `Σ_g sc_g·bsums_g`, exact either way: one multiply-add where
            // several tokens share the unpacked codes (the vector ports are
            // then free, 7% faster products over 4 tokens), in scalar code
            // for one token, whose vector ports unpack the codes (the
            // multiply-add there measured 15-25% slower matrix-vector
            // products; `kv-model/decode/Q6_K`).
            let (sumi, offset) = if N > 1 {
                hsum2_epi32(
                    k_runs(&codes, &scales, y),
                    _mm256_madd_epi16(bsums(y), group_scales),
                )
            } else {
                let offset: i32 = (0..16)
                    .map(|g| i32::from(sc[g]) * i32::from(y.bsums[g]))
                    .sum();
                (
                    hsum2_epi32(k_runs(&codes, &scales, y), _mm256_setzero_si256()).0,
                    offset,
                )
            };
            let d = y.d * dw;
            *acc += d * (sumi - 32 * offset) as f32;
        }
    }
    acc
}

/// The float types' accumulation: `load8(i)` gives weights `i .. i + 8` in
/// f32, `value(i)` weight `i`.
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_f32(x: &[f32], load8: impl Fn(usize) -> __m256, value: impl Fn(usize) -> f32) -> f32 {
    let n = x.len();
    let runs = n / 32;
    let mut acc = [_mm256_setzero_ps(); 4];
    for r in 0..runs {
        for (u, acc) in acc.iter_mut().enumerate() {
            let i = 32 * r + 8 * u;
            // SAFETY: i + 8 ≤ 32·runs ≤ n = x.len().
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            *acc = _mm256_fmadd_ps(load8(i), xv, *acc);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut total = hsum_ps(sum);
    for (i, &x) in x.iter().enumerate().skip(32 * runs) {
        total += value(i) * x;
    }
    total
}

/// `F32 · f32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f32_row(w: &[u8], x: &[f32]) -> f32 {
    let w = &w[..4 * x.len()];
    lanes_f32(
        x,
        // SAFETY: weights i .. i + 8 are bytes 4i .. 4i + 32 of `w`, inside it.
        |i| unsafe { _mm256_loadu_ps(w.as_ptr().add(4 * i).cast()) },
        |i| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
    )
}

/// `F16 · f32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f16_row(w: &[u8], x: &[f32]) -> f32 {
    let w = &w[..2 * x.len()];
    lanes_f32(
        x,
        // SAFETY: weights i .. i + 8 are bytes 2i .. 2i + 16 of `w`, inside it.
        |i| _mm256_cvtph_ps(unsafe { _mm_loadu_si128(w.as_ptr().add(2 * i).cast()) }),
        |i| f16_at(w, 2 * i),
    )
}

/// `BF16 · f32`: a bf16 is the top half of its f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
    let w = &w[..2 * x.len()];
    lanes_f32(
        x,
        |i| {
            // SAFETY: weights i .. i + 8 are bytes 2i .. 2i + 16 of `w`.
            let h = unsafe { _mm_loadu_si128(w.as_ptr().add(2 * i).cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        },
        |i| f32::from_bits(u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16),
    )
}
