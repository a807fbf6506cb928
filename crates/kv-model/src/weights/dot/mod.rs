//! Row kernels: one weight row (whole blocks of its type) times one row of
//! activations, per instruction set, chosen once per product.
//!
//! [`Isa`] is the caller's choice of instruction set: detected once by
//! [`Isa::detect`], pinnable by tests and users, checked before use. The
//! kernels of every set compute the same bits (`scalar.rs` states the
//! arithmetic), so pinning one changes the speed, never the result.

pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;

use super::WeightType;
use super::activations::{Activations, Q8Block, Q8KBlock};
use super::token_lanes::{Q8Kx8Block, Q8x8Block};
use crate::error::{ModelError, Result};

/// The instruction set the product kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust; always available.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C (Haswell, Zen and later).
    Avx2,
    /// [`Avx2`](Self::Avx2) plus AVX-512 F/BW/VL with VNNI (Ice Lake,
    /// Sapphire Rapids, Zen 4 and later): the token-lane kernels of
    /// `Q4_0`, `Q5_0`, `Q4_K` and `Q6_K` sum their runs with `vpdpbusd`;
    /// every other kernel is AVX2's.
    Avx512Vnni,
}

impl Isa {
    /// Every set, slowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni];

    /// The fastest set this CPU runs (checked at run time).
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU runs the set.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx2") && has!("fma") && has!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                use std::arch::is_x86_feature_detected as has;
                Isa::Avx2.is_supported()
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512vl")
                    && has!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512Vnni => false,
        }
    }

    /// `Ok(self)` if this CPU runs the set, else
    /// [`ModelError::IsaUnavailable`].
    pub fn checked(self) -> Result<Isa> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(ModelError::IsaUnavailable(self))
        }
    }
}

/// One weight row against `N` tokens' activation rows (blocks of `A`).
pub(crate) type Group<A, const N: usize> = fn(&[u8], [&[A]; N]) -> [f32; N];

/// The kernels of one weight type against one activation form: a token
/// alone, four and eight at once (the weights unpacked once per group),
/// every token getting the bits it gets alone.
#[derive(Clone, Copy)]
pub(crate) struct Grouped<A: 'static> {
    one: fn(&[u8], &[A]) -> f32,
    four: Group<A, 4>,
    eight: Group<A, 8>,
}

/// One weight row against eight tokens in lanes (`token_lanes.rs`).
pub(crate) type Lanes8 = fn(&[u8], &[Q8x8Block]) -> [f32; 8];

/// One k-quant weight row against eight tokens in lanes.
pub(crate) type Lanes8K = fn(&[u8], &[Q8Kx8Block]) -> [f32; 8];

/// A row kernel, by the activation form it reads.
#[derive(Clone, Copy)]
pub(crate) enum RowDot {
    /// Against Q8_0/Q8_1 blocks, and against eight tokens' Q8_0 blocks in
    /// lanes where the type has such a kernel on this instruction set.
    Q8(Grouped<Q8Block>, Option<Lanes8>),
    /// Against Q8_K blocks, and against eight tokens' in lanes where the
    /// type has such a kernel on this instruction set.
    Q8K(Grouped<Q8KBlock>, Option<Lanes8K>),
    /// Against f32 values.
    F32(fn(&[u8], &[f32]) -> f32),
}

impl RowDot {
    /// The tokens the largest grouped kernel takes at once.
    pub(crate) const WIDEST: usize = 8;

    /// The kernel of `ty` on `isa`, if `ty` has one. `isa` must be
    /// supported ([`Isa::checked`]): the AVX2 kernels are only handed out
    /// behind that check.
    pub(crate) fn new(ty: WeightType, isa: Isa) -> Result<RowDot> {
        let isa = isa.checked()?;
        match isa {
            Isa::Scalar => scalar_kernel(ty),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2_kernel(ty),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => avx512_vnni_kernel(ty),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512Vnni => return Err(ModelError::IsaUnavailable(isa)),
        }
        .ok_or(ModelError::NoKernel(ty))
    }

    /// Weight row `w` times activation row `i` of `a`.
    #[inline]
    pub(crate) fn dot(self, w: &[u8], a: &Activations, i: usize) -> f32 {
        match self {
            RowDot::Q8(k, _) => (k.one)(w, a.q8_row(i)),
            RowDot::Q8K(k, _) => (k.one)(w, a.q8k_row(i)),
            RowDot::F32(f) => f(w, a.f32_row(i)),
        }
    }

    /// Weight row `w` times activation rows `i .. i + 4` of `a`: the bits
    /// of four [`dot`](Self::dot)s, the weights unpacked once where a
    /// kernel does that.
    #[inline]
    pub(crate) fn dot4(self, w: &[u8], a: &Activations, i: usize) -> [f32; 4] {
        match self {
            RowDot::Q8(k, _) => (k.four)(w, std::array::from_fn(|n| a.q8_row(i + n))),
            RowDot::Q8K(k, _) => (k.four)(w, std::array::from_fn(|n| a.q8k_row(i + n))),
            _ => std::array::from_fn(|n| self.dot(w, a, i + n)),
        }
    }

    /// Whether [`dot8`](Self::dot8) reads `a`'s tokens in lanes (and so
    /// costs about as much for a group of eight as for fewer: a last
    /// group of fewer tokens is filled up in the lanes).
    pub(crate) fn reads_token_lanes(self) -> bool {
        matches!(self, RowDot::Q8(_, Some(_)) | RowDot::Q8K(_, Some(_)))
    }

    /// Builds the tokens in lanes that [`dot8`](Self::dot8) will read, if
    /// it reads them (once, before a product's tasks start).
    pub(crate) fn prepare(self, a: &Activations) {
        match self {
            RowDot::Q8(_, Some(_)) => {
                a.token_lanes();
            }
            RowDot::Q8K(_, Some(_)) => {
                a.token_lanes_k();
            }
            _ => {}
        }
    }

    /// Weight row `w` times activation rows `i .. i + 8` of `a`: the bits
    /// of eight [`dot`](Self::dot)s. `i` is a multiple of 8 where the
    /// kernel reads tokens in lanes.
    #[inline]
    pub(crate) fn dot8(self, w: &[u8], a: &Activations, i: usize) -> [f32; 8] {
        match self {
            RowDot::Q8(_, Some(lanes)) => {
                debug_assert!(i.is_multiple_of(8));
                let blocks = a.cols() / 32;
                lanes(w, &a.token_lanes()[i / 8 * blocks..][..blocks])
            }
            RowDot::Q8(k, None) => (k.eight)(w, std::array::from_fn(|n| a.q8_row(i + n))),
            RowDot::Q8K(_, Some(lanes)) => {
                debug_assert!(i.is_multiple_of(8));
                let blocks = a.cols() / 256;
                lanes(w, &a.token_lanes_k()[i / 8 * blocks..][..blocks])
            }
            RowDot::Q8K(k, None) => (k.eight)(w, std::array::from_fn(|n| a.q8k_row(i + n))),
            _ => std::array::from_fn(|n| self.dot(w, a, i + n)),
        }
    }
}

/// The scalar kernels of one type: a group is its tokens one by one (the
/// bits of the AVX2 grouped kernels by the same definition).
macro_rules! scalar_grouped {
    ($f:path, $a:ty) => {{
        fn group<const N: usize>(w: &[u8], a: [&[$a]; N]) -> [f32; N] {
            a.map(|a| $f(w, a))
        }
        Grouped::<$a> {
            one: $f,
            four: group::<4>,
            eight: group::<8>,
        }
    }};
}

fn scalar_kernel(ty: WeightType) -> Option<RowDot> {
    use scalar as s;
    Some(match ty {
        WeightType::Q4_0 => RowDot::Q8(scalar_grouped!(s::q4_0, Q8Block), None),
        WeightType::Q4_1 => RowDot::Q8(scalar_grouped!(s::q4_1, Q8Block), None),
        WeightType::Q5_0 => RowDot::Q8(scalar_grouped!(s::q5_0, Q8Block), None),
        WeightType::Q5_1 => RowDot::Q8(scalar_grouped!(s::q5_1, Q8Block), None),
        WeightType::Q8_0 => RowDot::Q8(scalar_grouped!(s::q8_0, Q8Block), None),
        WeightType::Q4_K => RowDot::Q8K(scalar_grouped!(s::q4_k, Q8KBlock), None),
        WeightType::Q5_K => RowDot::Q8K(scalar_grouped!(s::q5_k, Q8KBlock), None),
        WeightType::Q6_K => RowDot::Q8K(scalar_grouped!(s::q6_k, Q8KBlock), None),
        WeightType::F32 => RowDot::F32(s::f32_row),
        WeightType::F16 => RowDot::F32(s::f16_row),
        WeightType::BF16 => RowDot::F32(s::bf16_row),
        _ => return None,
    })
}

/// A safe entry point to the token-lane kernel `avx2::$f` (of AVX2, or of
/// AVX-512 VNNI), as a [`Lanes8`].
#[cfg(target_arch = "x86_64")]
macro_rules! lanes {
    ($f:ident) => {{
        fn lanes(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
            // SAFETY: used only by `avx2_kernel` and `avx512_vnni_kernel`,
            // whose kernels `RowDot::new` hands out only after
            // `Isa::checked()` found the features of that set, the ones
            // `avx2::$f` enables.
            unsafe { avx2::$f(w, y) }
        }
        Some(lanes as Lanes8)
    }};
}

/// [`lanes!`] for the k-quants' lanes, as a [`Lanes8K`].
#[cfg(target_arch = "x86_64")]
macro_rules! lanes_k {
    ($f:ident) => {{
        fn lanes(w: &[u8], y: &[Q8Kx8Block]) -> [f32; 8] {
            // SAFETY: as in `lanes!`.
            unsafe { avx2::$f(w, y) }
        }
        Some(lanes as Lanes8K)
    }};
}

/// Safe entry points to the grouped kernel `avx2::$f` (of AVX2, or of
/// AVX-512 VNNI) for one, four and eight tokens, as a [`Grouped`].
#[cfg(target_arch = "x86_64")]
macro_rules! grouped {
    ($f:ident, $a:ty) => {{
        fn group<const N: usize>(w: &[u8], a: [&[$a]; N]) -> [f32; N] {
            // SAFETY: as in `lanes!`.
            unsafe { avx2::$f::<N>(w, a) }
        }
        fn one(w: &[u8], a: &[$a]) -> f32 {
            group::<1>(w, [a])[0]
        }
        Grouped::<$a> {
            one,
            four: group::<4>,
            eight: group::<8>,
        }
    }};
}

/// Safe entry points to the AVX2 kernels. They are reachable only through
/// [`RowDot::new`], which hands them out after [`Isa::checked`] has found
/// AVX2, FMA and F16C on this CPU.
#[cfg(target_arch = "x86_64")]
fn avx2_kernel(ty: WeightType) -> Option<RowDot> {
    macro_rules! wrap {
        ($variant:ident, $f:ident, $a:ty) => {{
            fn entry(w: &[u8], a: &[$a]) -> f32 {
                // SAFETY: handed out only after `Isa::Avx2.checked()`
                // succeeded, so the CPU has AVX2, FMA and F16C.
                unsafe { avx2::$f(w, a) }
            }
            RowDot::$variant(entry)
        }};
    }
    Some(match ty {
        WeightType::Q4_0 => RowDot::Q8(grouped!(q4_0, Q8Block), lanes!(q4_0_lanes)),
        WeightType::Q4_1 => RowDot::Q8(grouped!(q4_1, Q8Block), lanes!(q4_1_lanes)),
        WeightType::Q5_0 => RowDot::Q8(grouped!(q5_0, Q8Block), lanes!(q5_0_lanes)),
        WeightType::Q5_1 => RowDot::Q8(grouped!(q5_1, Q8Block), lanes!(q5_1_lanes)),
        WeightType::Q8_0 => RowDot::Q8(grouped!(q8_0, Q8Block), None),
        WeightType::Q4_K => RowDot::Q8K(grouped!(q4_k, Q8KBlock), lanes_k!(q4_k_lanes)),
        WeightType::Q5_K => RowDot::Q8K(grouped!(q5_k, Q8KBlock), None),
        WeightType::Q6_K => RowDot::Q8K(grouped!(q6_k, Q8KBlock), lanes_k!(q6_k_lanes)),
        WeightType::F32 => wrap!(F32, f32_row, f32),
        WeightType::F16 => wrap!(F32, f16_row, f32),
        WeightType::BF16 => wrap!(F32, bf16_row, f32),
        _ => return None,
    })
}

/// The AVX-512 VNNI kernels: the 32-value types' one-token and grouped
/// kernels summing each block by `vpdpbusd` (one instruction where AVX2
/// takes `vpmaddubsw` and `vpmaddwd`), and the token-lane kernels of
/// `Q4_0`, `Q5_0`, `Q4_K` and `Q6_K` summing their runs by it. The other
/// kernels are AVX2's: a k-quant's one-token and grouped products weight
/// each run of 32 by its scale through `vpmaddwd`, which `vpdpbusd` would
/// need a `vpmulld` for (no instruction saved; llama.cpp's x86 k-quant
/// products are AVX2 code on AVX-512 hosts too), and the float types have
/// nothing to sum in integers. Reachable only through [`RowDot::new`]
/// after `Isa::Avx512Vnni.checked()`, which implies AVX2's check.
#[cfg(target_arch = "x86_64")]
fn avx512_vnni_kernel(ty: WeightType) -> Option<RowDot> {
    Some(match (ty, avx2_kernel(ty)?) {
        (WeightType::Q4_0, _) => RowDot::Q8(grouped!(q4_0_vnni, Q8Block), lanes!(q4_0_lanes_vnni)),
        (WeightType::Q4_1, RowDot::Q8(_, l)) => RowDot::Q8(grouped!(q4_1_vnni, Q8Block), l),
        (WeightType::Q5_0, _) => RowDot::Q8(grouped!(q5_0_vnni, Q8Block), lanes!(q5_0_lanes_vnni)),
        (WeightType::Q5_1, RowDot::Q8(_, l)) => RowDot::Q8(grouped!(q5_1_vnni, Q8Block), l),
        (WeightType::Q8_0, RowDot::Q8(_, l)) => RowDot::Q8(grouped!(q8_0_vnni, Q8Block), l),
        (WeightType::Q4_K, RowDot::Q8K(g, _)) => RowDot::Q8K(g, lanes_k!(q4_k_lanes_vnni)),
        (WeightType::Q6_K, RowDot::Q8K(g, _)) => RowDot::Q8K(g, lanes_k!(q6_k_lanes_vnni)),
        (_, other) => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::ActivationKind;

    /// `Q4_0`/`Q5_0` rows whose codes are all the largest (or all the
    /// smallest) against activations at ±127: the 16-bit sums of the
    /// token-lane kernels at their bound.
    fn extreme_rows(ty: WeightType, high: bool) -> Vec<u8> {
        let (bytes, nibbles) = match ty {
            WeightType::Q4_0 => (18, 2),
            _ => (22, 6),
        };
        let mut block = vec![if high { 0xff } else { 0x00 }; bytes];
        block[..2].copy_from_slice(&half::f16::from_f32(0.75).to_le_bytes());
        assert_eq!(block.len() - nibbles, 16);
        block.repeat(3)
    }

    #[test]
    fn k_quant_token_lanes_at_their_sixteen_bit_bound_give_each_token_its_own_bits() {
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            k_quant_bounds_on(isa);
        }
    }

    fn k_quant_bounds_on(isa: Isa) {
        // Every code at its largest (all bits set), every scale large,
        // against tokens of ±127 codes: the 16-bit run sums at their bound.
        for ty in [WeightType::Q4_K, WeightType::Q6_K] {
            let bytes = ty.block_bytes();
            let mut block = vec![0xffu8; bytes];
            let d = half::f16::from_f32(0.01).to_le_bytes();
            if ty == WeightType::Q4_K {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
            } else {
                block[192..208].fill(127);
                block[208..210].copy_from_slice(&d);
            }
            let w = block.repeat(2);
            let x: Vec<f32> = (0..9 * 512)
                .map(|i| match i / 512 {
                    0..=3 => 1.0,
                    4..=6 => -2.0,
                    _ => ((i * 37 % 101) as f32 - 50.0) * 0.03,
                })
                .collect();
            let a = Activations::new(ActivationKind::Q8_K, &x, 512).unwrap();
            let kernel = RowDot::new(ty, isa).unwrap();
            for (t, got) in kernel.dot8(&w, &a, 0).into_iter().enumerate() {
                let alone = RowDot::new(ty, Isa::Scalar).unwrap().dot(&w, &a, t);
                assert_eq!(got.to_bits(), alone.to_bits(), "{ty} token {t}");
            }
        }
    }

    #[test]
    fn token_lanes_give_each_token_its_own_bits() {
        // Every set this CPU has (the others are skipped by
        // `tests/products.rs` with a printed reason).
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            token_lanes_on(isa);
        }
    }

    fn token_lanes_on(isa: Isa) {
        for ty in [
            WeightType::Q4_0,
            WeightType::Q5_0,
            WeightType::Q4_1,
            WeightType::Q5_1,
            WeightType::Q4_K,
            WeightType::Q6_K,
        ] {
            assert_eq!(
                RowDot::new(ty, isa).unwrap().reads_token_lanes(),
                isa != Isa::Scalar,
                "{ty}"
            );
        }
        for ty in [WeightType::Q4_0, WeightType::Q5_0] {
            let kernel = RowDot::new(ty, isa).unwrap();
            for high in [false, true] {
                let w = extreme_rows(ty, high);
                // Tokens of ±127 codes, and one of mixed values.
                let x: Vec<f32> = (0..9 * 96)
                    .map(|i| match i / 96 {
                        0..=3 => 1.0,
                        4..=6 => -2.0,
                        _ => ((i * 37 % 101) as f32 - 50.0) * 0.03,
                    })
                    .collect();
                let a = Activations::new(ActivationKind::Q8_0, &x, 96).unwrap();
                let eight = kernel.dot8(&w, &a, 0);
                for (t, &got) in eight.iter().enumerate() {
                    let alone = RowDot::new(ty, Isa::Scalar).unwrap().dot(&w, &a, t);
                    assert_eq!(got.to_bits(), alone.to_bits(), "{ty} high={high} token {t}");
                    let want = if t < 4 { 1.0 } else { -2.0 }
                        * 96.0
                        * 0.75
                        * match (ty, high) {
                            (WeightType::Q4_0, true) => 7.0,
                            (WeightType::Q4_0, false) => -8.0,
                            (_, true) => 15.0,
                            _ => -16.0,
                        };
                    if t < 7 {
                        assert!((got - want).abs() <= want.abs() * 1e-2, "{got} {want}");
                    }
                }
            }
        }
    }
}
