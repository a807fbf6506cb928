//! [`Isa`]: the instruction set attention's CPU kernels run with, detected
//! once and carried by [`AttentionConfig`](crate::AttentionConfig), so that
//! a caller or a test can pin it (as gf2-codes' `Backend` is pinned).
//!
//! Every choice among attention's kernels reads it: the width of the one
//! float tile body (sixteen lanes in an AVX-512 register, two AVX2
//! registers or an array; the scalar set has kv-quant widen FP16 and FP8
//! tiles first), the pair-codebook lookups, and the integer dot products
//! of int8 query codes and of value sums (AVX-512 VNNI's `vpdpbusd`,
//! AVX2's `vpmaddubsw`/`vpmaddwd`, or the portable loop; plain AVX-512
//! takes AVX2's). The integer paths give the same bits on every set; the
//! float kernels give the same bits on both vector sets and agree to
//! rounding on the scalar one (`tests/isa.rs`).
//! kv-quant's exact conversions that attention calls (f16 widening,
//! nibble unpacking) pick their instructions themselves: their results
//! are the same bits on every CPU. A CPU with AVX2 and FMA but no F16C
//! (none is known) runs the scalar set.

use std::fmt;
use std::str::FromStr;

use crate::error::AttentionError;
use crate::kernel::Dot;

/// The instruction set of attention's CPU kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust loops (vectorised by the compiler where it can):
    /// every CPU.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with AVX2, FMA and F16C.
    Avx512,
    /// [`Avx512`](Isa::Avx512) with VNNI (`vpdpbusd`): Cascade Lake, Ice
    /// Lake, Sapphire Rapids, Zen 4 and later.
    Avx512Vnni,
}

impl Isa {
    /// Every set, slowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

    /// The fastest set this CPU supports, detected once per process.
    pub fn detect() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .rev()
                .find(|isa| isa.is_supported())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Whether this CPU can run the set.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = || has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = || avx2() && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2(),
                Isa::Avx512 => avx512(),
                Isa::Avx512Vnni => avx512() && has!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// Every set this CPU supports, slowest first (for tests and
    /// benchmarks).
    pub fn available() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The set's name as [`FromStr`] reads it: `scalar`, `avx2`, `avx512`,
    /// `avx512-vnni`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// `Ok` where this CPU runs the set, else the error a configuration
    /// naming it gets (it names the sets the CPU runs).
    pub fn ensure_supported(self) -> crate::Result<()> {
        if self.is_supported() {
            Ok(())
        } else {
            Err(AttentionError::InvalidParameter {
                name: "isa",
                reason: format!(
                    "{self} is not supported by this CPU (it runs {})",
                    Isa::available()
                        .iter()
                        .map(|isa| isa.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
        }
    }

    /// The integer dot products this set runs.
    pub(crate) fn dot(self) -> Dot {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Dot::Vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Dot::Avx2,
            _ => Dot::Portable,
        }
    }
}

impl Default for Isa {
    /// [`Isa::detect`].
    fn default() -> Self {
        Isa::detect()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = AttentionError;

    fn from_str(s: &str) -> crate::Result<Self> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == s)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "isa",
                reason: format!("{s:?} is not one of scalar, avx2, avx512, avx512-vnni"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names read back; detection picks the fastest supported set, and
    /// every set below a supported one is supported too.
    #[test]
    fn names_round_trip_and_detection_is_the_fastest_supported() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
            assert_eq!(isa.to_string(), isa.name());
        }
        assert!("avx-512".parse::<Isa>().is_err());
        let available = Isa::available();
        assert_eq!(available.first(), Some(&Isa::Scalar));
        assert_eq!(available.last(), Some(&Isa::detect()));
        assert_eq!(available, Isa::ALL[..available.len()].to_vec());
        for isa in Isa::ALL {
            assert_eq!(isa.ensure_supported().is_ok(), available.contains(&isa));
        }
    }
}
