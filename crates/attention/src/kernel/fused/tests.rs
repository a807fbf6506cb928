//! The lane operations against kv-quant's definitions, at every width this
//! CPU has; the tile kernel's bits at each width against the others are in the
//! parent module's tests.

use kv_quant::{Fp8Format, LevelMap, LloydMax, NF4_LEVELS};

use super::lanes::{Lanes, Portable};
use super::load::{AFFINE, CENTERED, E4M3, E5M2, GroupDivisor, TABLE, dequantize, map_code};
#[cfg(target_arch = "x86_64")]
use super::x86::{Ymm2, Zmm};

/// Sixteen bytes dequantized under `map` with scale `a` and offset `b` by
/// the loaders' [`dequantize`] on [`Lanes`] `V` (its features enabled by
/// the caller).
#[inline(always)]
unsafe fn dequantized<V: Lanes>(map: LevelMap, bytes: [u8; 16], a: f32, b: f32) -> [f32; 16] {
    let (code, mid, table) = map_code(map);
    let mut out = [0.0f32; 16];
    // SAFETY: the caller has `V`'s features; `bytes` and `out` hold 16 lanes.
    unsafe {
        let bytes = V::bytes(bytes.as_ptr());
        let (a, b) = (V::splat(a), V::splat(b));
        let v = match code {
            AFFINE => dequantize::<V, AFFINE>(mid, table, bytes, a, b),
            CENTERED => dequantize::<V, CENTERED>(mid, table, bytes, a, b),
            TABLE => dequantize::<V, TABLE>(mid, table, bytes, a, b),
            E5M2 => dequantize::<V, E5M2>(mid, table, bytes, a, b),
            _ => dequantize::<V, E4M3>(mid, table, bytes, a, b),
        };
        v.store(out.as_mut_ptr());
    }
    out
}

fn dequantized_portable(map: LevelMap, bytes: [u8; 16], a: f32, b: f32) -> [f32; 16] {
    // SAFETY: `Portable` needs no CPU feature.
    unsafe { dequantized::<Portable>(map, bytes, a, b) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dequantized_avx512(map: LevelMap, bytes: [u8; 16], a: f32, b: f32) -> [f32; 16] {
    // SAFETY: compiled with `Zmm`'s features; the caller checked them.
    unsafe { dequantized::<Zmm>(map, bytes, a, b) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dequantized_avx2(map: LevelMap, bytes: [u8; 16], a: f32, b: f32) -> [f32; 16] {
    // SAFETY: compiled with `Ymm2`'s features; the caller checked them.
    unsafe { dequantized::<Ymm2>(map, bytes, a, b) }
}

/// Every byte under every level map gives kv-quant's value (the formulas
/// of `LevelMap`'s docs), NaN for FP8's NaN codes, at every width.
#[test]
fn every_byte_dequantizes_as_kv_quant_defines_it() {
    type Width = unsafe fn(LevelMap, [u8; 16], f32, f32) -> [f32; 16];
    let widths: Vec<(crate::Isa, Width)> = vec![
        (crate::Isa::Scalar, dequantized_portable),
        #[cfg(target_arch = "x86_64")]
        (crate::Isa::Avx2, dequantized_avx2),
        #[cfg(target_arch = "x86_64")]
        (crate::Isa::Avx512, dequantized_avx512),
    ];
    let (a, b) = (0.371_2f32, -1.25f32);
    for (isa, lanes) in widths {
        if !isa.is_supported() {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "every_byte_dequantizes_as_kv_quant_defines_it",
                &format!("no {isa}: its lanes are not used here"),
            );
            continue;
        }
        for map in [
            LevelMap::Affine,
            LevelMap::Centered { mid: 8.0 },
            LevelMap::Nf4,
            LevelMap::Codebook(LloydMax::of(4).padded16().expect("4 bits")),
            LevelMap::Codebook(LloydMax::of(3).padded16().expect("3 bits")),
            LevelMap::Fp8(Fp8Format::E5M2),
            LevelMap::Fp8(Fp8Format::E4M3),
        ] {
            let mut nans = 0;
            for base in (0..256).step_by(16) {
                let bytes: [u8; 16] = std::array::from_fn(|i| (base + i) as u8);
                // SAFETY: the width's features were detected above.
                let got = unsafe { lanes(map, bytes, a, b) };
                for (&byte, &v) in bytes.iter().zip(&got) {
                    let want = match map {
                        LevelMap::Affine => b + f32::from(byte) * a,
                        LevelMap::Centered { mid } => (f32::from(byte) - mid) * a,
                        LevelMap::Nf4 => NF4_LEVELS[usize::from(byte & 15)] * a,
                        // Codes past the codebook are never stored; the
                        // lookup reads the low 4 bits (a padded entry).
                        LevelMap::Codebook(table) => table[usize::from(byte & 15)] * a,
                        LevelMap::Fp8(format) => format.decode(byte) * a,
                    };
                    nans += usize::from(v.is_nan());
                    assert!(
                        v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                        "{isa} {map:?} byte {byte:#04x}: {v} vs {want}"
                    );
                }
            }
            let want_nans = match map {
                LevelMap::Fp8(Fp8Format::E4M3) => 2,
                LevelMap::Fp8(Fp8Format::E5M2) => 6,
                _ => 0,
            };
            assert_eq!(nans, want_nans, "{isa} {map:?}");
        }
    }
}

#[test]
fn group_divisors_divide_every_channel_of_a_row_exactly() {
    for cpg in (16..=4096).step_by(16) {
        for ch in [cpg, 3 * cpg, 40 * cpg] {
            let div = GroupDivisor::new(cpg, ch).expect("rows of realistic width");
            for x in 0..ch {
                assert_eq!(div.of(x), x / cpg, "{x} / {cpg} in rows of {ch}");
            }
        }
    }
    // Refused where the multiply-shift could be off (ch · e >= 2^32).
    assert!(GroupDivisor::new(48, 1 << 31).is_none());
}
