//! Which integer dot-product kernel runs: AVX-512 VNNI, AVX2 or the
//! portable loop, as the configured [`Isa`](crate::Isa) says. All three
//! give the same sums.

/// How the integer dot products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dot {
    /// AVX-512 VNNI `vpdpbusd` (with BW for byte masks).
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// AVX2 `vpmaddubsw`/`vpmaddwd`, where AVX-512 VNNI is missing.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// A plain loop (vectorized by the compiler where it can).
    Portable,
}

impl Dot {
    /// Every way this CPU runs, the portable loop first: the tests check
    /// each against it (one per supported [`Isa`](crate::Isa)).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut dots: Vec<Dot> = crate::Isa::available()
            .into_iter()
            .map(crate::Isa::dot)
            .collect();
        dots.dedup();
        dots
    }
}
