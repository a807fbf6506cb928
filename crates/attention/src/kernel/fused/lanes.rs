//! [`Lanes`]: sixteen f32 lanes, the one vector the float tile kernel is
//! written over: one AVX-512 register (`Zmm`), two AVX2 registers (`Ymm2`,
//! both in [`x86`](super::x86)), or a plain array ([`Portable`], every
//! CPU). The vector widths give the same bits (NaN payloads aside), so the
//! kernel body is written once and its results do not depend on the width;
//! [`Portable`] rounds each multiply and add on its own (no fused
//! multiply-add), as the scalar set always has. What differs is register
//! blocking, read from [`Lanes::SCORE_ROWS`] and [`Lanes::VALUE_BLOCKS`],
//! and how scores are folded in batches ([`Lanes::finish_scores`]: sixteen
//! at once in one AVX-512 register, eight rows at a time with AVX2, one at
//! a time in an array).

/// Sixteen f32 lanes and the operations the float tile kernel needs.
///
/// # Safety
/// Every function is only called from code compiled with the features of
/// the implementation's width (inlined into the kernel's entry for it).
/// Pointers must be valid for the lanes read or written: 16, or `n < 16`
/// for the partial forms.
pub(in crate::kernel) trait Lanes: Copy {
    /// Whether multiply-adds are fused (rounded once): softmax follows.
    const FMA: bool;
    /// Whether half floats and FP8 codes are read as stored, widened in
    /// registers; else kv-quant widens their tiles first (its bulk
    /// conversions, exact and faster than sixteen lanes at a time).
    const WIDENS_IN_REGISTERS: bool;
    /// Key rows scored per step: each query chunk loaded feeds this many
    /// rows (four with AVX-512's 32 registers, one with AVX2's 16).
    const SCORE_ROWS: usize;
    /// Value accumulators (`heads × blocks of 16 channels`) held in
    /// registers while the rows stream by.
    const VALUE_BLOCKS: usize;

    /// All lanes zero.
    unsafe fn zero() -> Self;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self;
    /// Sixteen floats.
    unsafe fn load(p: *const f32) -> Self;
    /// `n < 16` floats, zero above.
    unsafe fn load_partial(p: *const f32, n: usize) -> Self;
    /// Sixteen little-endian IEEE half floats, widened exactly.
    unsafe fn halves(p: *const u8) -> Self;
    /// `n < 16` half floats, zero above.
    unsafe fn halves_partial(p: *const u8, n: usize) -> Self;
    /// Sixteen bytes as the width holds them.
    type Bytes: Copy;
    /// Sixteen bytes.
    unsafe fn bytes(p: *const u8) -> Self::Bytes;
    /// `n < 16` bytes, zero above.
    unsafe fn bytes_partial(p: *const u8, n: usize) -> Self::Bytes;
    /// Writes the sixteen lanes.
    unsafe fn store(self, p: *mut f32);
    /// `a·b + c`, rounded once.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    /// [`fmadd`](Self::fmadd) in lanes `< n`; lanes above keep `c`.
    unsafe fn fmadd_low(a: Self, b: Self, c: Self, n: usize) -> Self;
    /// `a + b`.
    unsafe fn add(a: Self, b: Self) -> Self;
    /// `a − b`.
    unsafe fn sub(a: Self, b: Self) -> Self;
    /// `a · b`.
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// Sixteen bytes as f32 `0..=255`.
    unsafe fn levels(bytes: Self::Bytes) -> Self;
    /// `table[byte & 15]` per lane.
    unsafe fn lookup(bytes: Self::Bytes, table: &[f32; 16]) -> Self;
    /// `table[codes[l]]` in lane `l` (every code below `table.len()`): on
    /// the vector widths a register permutation for tables of 16 and 32
    /// entries, else (and for [`Portable`]) [`gathered`].
    unsafe fn lookup_codes(codes: &[u8; 16], table: &[f32]) -> Self;
    /// E5M2 codes' values: the code is the top byte of the IEEE half with
    /// the same value.
    unsafe fn e5m2(bytes: Self::Bytes) -> Self;
    /// E4M3 codes' values times 2^-8 (exponent and mantissa moved into a
    /// half's fields: the biases differ by 8, subnormals included), NaN
    /// for `S.1111.111`.
    unsafe fn e4m3_scaled(bytes: Self::Bytes) -> Self;
    /// Folds the accumulators of `H` heads and rows `t..t + R` (`R` is
    /// 1 or [`SCORE_ROWS`](Self::SCORE_ROWS)) into scores at
    /// `w[j·rows + t + r]`, adding each one's lanes as the parent module's
    /// `reduce` does: lane `k` gets `k + 8`, then `k + 4`, `k + 2` and
    /// `k + 1`. `stash` holds folded rows between calls where a width
    /// batches rows across them.
    unsafe fn finish_scores<const H: usize, const R: usize>(
        acc: [[Self; R]; H],
        stash: &mut Stash<H>,
        w: &mut [f32],
        rows: usize,
        t: usize,
    );
}

/// `table[codes[l]]` in lane `l`, read one lane at a time.
///
/// # Safety
/// As [`Lanes::load`]; every code is below `table.len()` (checked).
#[inline(always)]
pub(super) unsafe fn gathered<V: Lanes>(codes: &[u8; 16], table: &[f32]) -> V {
    let mut lanes = [0.0f32; 16];
    for (v, &c) in lanes.iter_mut().zip(codes) {
        *v = table[usize::from(c)];
    }
    // SAFETY: `lanes` holds 16 floats; the caller has `V`'s features.
    unsafe { V::load(lanes.as_ptr()) }
}

/// Rows of `H` heads after the tree's first step (`k + (k + 8)`, eight
/// lanes), kept until eight rows can be folded at once.
pub(in crate::kernel) type Stash<const H: usize> = [[[f32; 8]; 8]; H];

/// Sixteen lanes in an array, each multiply and add rounded on its own:
/// the scalar set, on every CPU (the compiler vectorises the loops where
/// it can).
#[derive(Clone, Copy)]
pub(in crate::kernel) struct Portable([f32; 16]);

impl Portable {
    #[inline(always)]
    fn map(self, f: impl Fn(f32) -> f32) -> Self {
        Self(self.0.map(f))
    }

    #[inline(always)]
    fn zip(a: Self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        Self(std::array::from_fn(|i| f(a.0[i], b.0[i])))
    }
}

// SAFETY (every method's block): the caller keeps pointers valid for the
// lanes read or written.
#[allow(clippy::undocumented_unsafe_blocks)] // one contract, stated above
impl Lanes for Portable {
    const FMA: bool = false;
    const WIDENS_IN_REGISTERS: bool = false;
    const SCORE_ROWS: usize = 4;
    const VALUE_BLOCKS: usize = 16;
    type Bytes = [u8; 16];

    #[inline(always)]
    unsafe fn zero() -> Self {
        Self([0.0; 16])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Self([x; 16])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { Self(p.cast::<[f32; 16]>().read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        let mut lanes = [0.0f32; 16];
        unsafe { std::ptr::copy_nonoverlapping(p, lanes.as_mut_ptr(), n) };
        Self(lanes)
    }
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> Self {
        unsafe { Self::halves_partial(p, 16) }
    }
    #[inline(always)]
    unsafe fn halves_partial(p: *const u8, n: usize) -> Self {
        let mut halves = [0u8; 32];
        unsafe { std::ptr::copy_nonoverlapping(p, halves.as_mut_ptr(), 2 * n) };
        let mut lanes = [0.0f32; 16];
        kv_quant::widen_f16(&halves, &mut lanes);
        Self(lanes)
    }
    #[inline(always)]
    unsafe fn bytes(p: *const u8) -> [u8; 16] {
        unsafe { p.cast::<[u8; 16]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn bytes_partial(p: *const u8, n: usize) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        unsafe { std::ptr::copy_nonoverlapping(p, bytes.as_mut_ptr(), n) };
        bytes
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { p.cast::<[f32; 16]>().write_unaligned(self.0) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        Self(std::array::from_fn(|i| a.0[i] * b.0[i] + c.0[i]))
    }
    #[inline(always)]
    unsafe fn fmadd_low(a: Self, b: Self, c: Self, n: usize) -> Self {
        Self(std::array::from_fn(|i| {
            if i < n {
                a.0[i] * b.0[i] + c.0[i]
            } else {
                c.0[i]
            }
        }))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Self::zip(a, b, |a, b| a + b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Self::zip(a, b, |a, b| a - b)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Self::zip(a, b, |a, b| a * b)
    }
    #[inline(always)]
    unsafe fn levels(bytes: [u8; 16]) -> Self {
        Self(bytes.map(f32::from))
    }
    #[inline(always)]
    unsafe fn lookup(bytes: [u8; 16], table: &[f32; 16]) -> Self {
        Self(bytes.map(|b| table[usize::from(b & 15)]))
    }
    #[inline(always)]
    unsafe fn lookup_codes(codes: &[u8; 16], table: &[f32]) -> Self {
        unsafe { gathered(codes, table) }
    }
    #[inline(always)]
    unsafe fn e5m2(bytes: [u8; 16]) -> Self {
        Self(bytes.map(|b| kv_quant::Fp8Format::E5M2.decode(b)))
    }
    /// Scaling by 2^-8 is exact for every E4M3 value.
    #[inline(always)]
    unsafe fn e4m3_scaled(bytes: [u8; 16]) -> Self {
        Self(bytes.map(|b| kv_quant::Fp8Format::E4M3.decode(b))).map(|v| v * (1.0 / 256.0))
    }
    /// Each score reduced on its own by the parent module's `reduce`.
    #[inline(always)]
    unsafe fn finish_scores<const H: usize, const R: usize>(
        acc: [[Self; R]; H],
        _stash: &mut Stash<H>,
        w: &mut [f32],
        rows: usize,
        t: usize,
    ) {
        for (j, a) in acc.iter().enumerate() {
            for (r, a) in a.iter().enumerate() {
                w[j * rows + t + r] = crate::kernel::reduce(a.0);
            }
        }
    }
}
