//! NF4: the 16-level "normal float" codebook of QLoRA (Dettmers et al. 2023,
//! appendix E; the constants as shipped in bitsandbytes' `NF4` table), used
//! with one absmax per group: `x ≈ NF4[q] · absmax`.

/// The 16 NF4 levels, ascending; index 7 is exactly 0 and the ends are ±1.
// The published digits are kept verbatim; each rounds to the same f32 as the
// bitsandbytes table holds.
#[allow(clippy::excessive_precision)]
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Decision thresholds: midpoints between consecutive levels.
const THRESHOLDS: [f32; 15] = {
    let mut t = [0.0; 15];
    let mut i = 0;
    while i < 15 {
        t[i] = (NF4_LEVELS[i] + NF4_LEVELS[i + 1]) / 2.0;
        i += 1;
    }
    t
};

/// Index of the level nearest to `x` (a value already divided by the absmax;
/// values beyond ±1 saturate). A value exactly on a midpoint goes to the lower level.
#[inline]
pub fn nearest_level(x: f32) -> u8 {
    // Branch-free count of thresholds strictly below x.
    THRESHOLDS.iter().map(|&t| u8::from(x > t)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn codebook_shape() {
        assert_eq!(NF4_LEVELS[0], -1.0);
        assert_eq!(NF4_LEVELS[7], 0.0);
        assert_eq!(NF4_LEVELS[15], 1.0);
        assert!(NF4_LEVELS.windows(2).all(|w| w[0] < w[1]));
        for (i, &v) in NF4_LEVELS.iter().enumerate() {
            assert_eq!(usize::from(nearest_level(v)), i);
        }
    }

    proptest! {
        #[test]
        fn nearest_level_is_the_argmin(x in -1.5f32..1.5) {
            let q = nearest_level(x);
            let err = (NF4_LEVELS[usize::from(q)] - x).abs();
            for v in NF4_LEVELS {
                prop_assert!(err <= (v - x).abs());
            }
        }
    }
}
