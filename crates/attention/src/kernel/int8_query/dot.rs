//! Which integer dot-product kernel runs: AVX-512 VNNI, AVX2 or the
//! portable loop, detected once per process. All three give the same sums.

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
    /// The fastest one this CPU runs, detected once.
    pub(crate) fn detect() -> Self {
        static DOT: std::sync::OnceLock<Dot> = std::sync::OnceLock::new();
        *DOT.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Dot::Vnni;
            }
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                return Dot::Avx2;
            }
            Dot::Portable
        })
    }

    /// Every way this CPU runs, the portable loop first: the tests check
    /// each against it.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut dots = vec![Dot::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                dots.push(Dot::Avx2);
            }
            if Dot::detect() == Dot::Vnni {
                dots.push(Dot::Vnni);
            }
        }
        dots
    }
}
