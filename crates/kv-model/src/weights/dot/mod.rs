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
use crate::error::{ModelError, Result};

/// The instruction set the product kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust; always available.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C (Haswell, Zen and later).
    Avx2,
}

impl Isa {
    /// Every set, slowest first.
    pub const ALL: [Isa; 2] = [Isa::Scalar, Isa::Avx2];

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
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => false,
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

/// Four tokens' Q8_0/Q8_1 rows against one weight row.
pub(crate) type Dot4 = fn(&[u8], [&[Q8Block]; 4]) -> [f32; 4];

/// Four tokens' Q8_K rows against one weight row.
pub(crate) type Dot4K = fn(&[u8], [&[Q8KBlock]; 4]) -> [f32; 4];

/// A row kernel, by the activation form it reads.
#[derive(Clone, Copy)]
pub(crate) enum RowDot {
    /// Against Q8_0/Q8_1 blocks, one token and four at once.
    Q8(fn(&[u8], &[Q8Block]) -> f32, Dot4),
    /// Against Q8_K blocks, one token and four at once.
    Q8K(fn(&[u8], &[Q8KBlock]) -> f32, Dot4K),
    /// Against f32 values.
    F32(fn(&[u8], &[f32]) -> f32),
}

impl RowDot {
    /// The kernel of `ty` on `isa`, if `ty` has one. `isa` must be
    /// supported ([`Isa::checked`]): the AVX2 kernels are only handed out
    /// behind that check.
    pub(crate) fn new(ty: WeightType, isa: Isa) -> Result<RowDot> {
        let isa = isa.checked()?;
        match isa {
            Isa::Scalar => scalar_kernel(ty),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2_kernel(ty),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => Err(ModelError::IsaUnavailable(isa)),
        }
        .ok_or(ModelError::NoKernel(ty))
    }

    /// Weight row `w` times activation row `i` of `a`.
    #[inline]
    pub(crate) fn dot(self, w: &[u8], a: &Activations, i: usize) -> f32 {
        match self {
            RowDot::Q8(f, _) => f(w, a.q8_row(i)),
            RowDot::Q8K(f, _) => f(w, a.q8k_row(i)),
            RowDot::F32(f) => f(w, a.f32_row(i)),
        }
    }

    /// Weight row `w` times activation rows `i .. i + 4` of `a`: the bits
    /// of four [`dot`](Self::dot)s, the weights unpacked once where a
    /// kernel does that.
    #[inline]
    pub(crate) fn dot4(self, w: &[u8], a: &Activations, i: usize) -> [f32; 4] {
        match self {
            RowDot::Q8(_, f) => f(w, std::array::from_fn(|k| a.q8_row(i + k))),
            RowDot::Q8K(_, f) => f(w, std::array::from_fn(|k| a.q8k_row(i + k))),
            _ => std::array::from_fn(|k| self.dot(w, a, i + k)),
        }
    }
}

/// Four scalar dots (the scalar kernels unpack per token; the bits are
/// those of the AVX2 four-token kernels by the same definition).
fn four<const K: usize>(w: &[u8], a: [&[Q8Block]; 4]) -> [f32; 4] {
    let one = match K {
        0 => scalar::q4_0,
        1 => scalar::q4_1,
        2 => scalar::q5_0,
        3 => scalar::q5_1,
        _ => scalar::q8_0,
    };
    a.map(|a| one(w, a))
}

/// Four scalar k-quant dots.
fn four_k<const K: usize>(w: &[u8], a: [&[Q8KBlock]; 4]) -> [f32; 4] {
    let one = match K {
        0 => scalar::q4_k,
        1 => scalar::q5_k,
        _ => scalar::q6_k,
    };
    a.map(|a| one(w, a))
}

fn scalar_kernel(ty: WeightType) -> Option<RowDot> {
    use scalar as s;
    Some(match ty {
        WeightType::Q4_0 => RowDot::Q8(s::q4_0, four::<0>),
        WeightType::Q4_1 => RowDot::Q8(s::q4_1, four::<1>),
        WeightType::Q5_0 => RowDot::Q8(s::q5_0, four::<2>),
        WeightType::Q5_1 => RowDot::Q8(s::q5_1, four::<3>),
        WeightType::Q8_0 => RowDot::Q8(s::q8_0, four::<4>),
        WeightType::Q4_K => RowDot::Q8K(s::q4_k, four_k::<0>),
        WeightType::Q5_K => RowDot::Q8K(s::q5_k, four_k::<1>),
        WeightType::Q6_K => RowDot::Q8K(s::q6_k, four_k::<2>),
        WeightType::F32 => RowDot::F32(s::f32_row),
        WeightType::F16 => RowDot::F32(s::f16_row),
        WeightType::BF16 => RowDot::F32(s::bf16_row),
        _ => return None,
    })
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
    macro_rules! grouped {
        ($variant:ident, $f:ident, $a:ty) => {{
            fn one(w: &[u8], a: &[$a]) -> f32 {
                // SAFETY: as in `wrap!`.
                unsafe { avx2::$f::<1>(w, [a])[0] }
            }
            fn four(w: &[u8], a: [&[$a]; 4]) -> [f32; 4] {
                // SAFETY: as in `wrap!`.
                unsafe { avx2::$f::<4>(w, a) }
            }
            RowDot::$variant(one, four)
        }};
    }
    Some(match ty {
        WeightType::Q4_0 => grouped!(Q8, q4_0, Q8Block),
        WeightType::Q4_1 => grouped!(Q8, q4_1, Q8Block),
        WeightType::Q5_0 => grouped!(Q8, q5_0, Q8Block),
        WeightType::Q5_1 => grouped!(Q8, q5_1, Q8Block),
        WeightType::Q8_0 => grouped!(Q8, q8_0, Q8Block),
        WeightType::Q4_K => grouped!(Q8K, q4_k, Q8KBlock),
        WeightType::Q5_K => grouped!(Q8K, q5_k, Q8KBlock),
        WeightType::Q6_K => grouped!(Q8K, q6_k, Q8KBlock),
        WeightType::F32 => wrap!(F32, f32_row, f32),
        WeightType::F16 => wrap!(F32, f16_row, f32),
        WeightType::BF16 => wrap!(F32, bf16_row, f32),
        _ => return None,
    })
}
