//! The product kernels against an f64 oracle over the dequantised weights
//! and activations, every instruction set against the scalar definition bit
//! for bit, and the products' independence from how tokens and rows are
//! grouped.

use half::{bf16, f16};
use kv_model::weights::{
    ActivationKind, Activations, Isa, QuantMatrix, StoredLinear, WeightType, dequantize_into,
};
use proptest::prelude::*;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use test_support::{Requirement, skip};

/// Every type with a kernel.
const KERNEL_TYPES: [WeightType; 11] = [
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
    WeightType::Q4_K,
    WeightType::Q5_K,
    WeightType::Q6_K,
    WeightType::F32,
    WeightType::F16,
    WeightType::BF16,
];

fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
}

/// The byte offsets of a block's f16 scale (and min) fields.
fn scale_fields(ty: WeightType) -> &'static [usize] {
    match ty {
        WeightType::Q4_0 | WeightType::Q5_0 | WeightType::Q8_0 => &[0],
        WeightType::Q4_1 | WeightType::Q5_1 | WeightType::Q4_K | WeightType::Q5_K => &[0, 2],
        WeightType::Q6_K => &[208],
        _ => &[],
    }
}

/// `rows × cols` weights of `ty`: random codes, finite random scales.
fn random_matrix(ty: WeightType, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let len = QuantMatrix::data_len(ty, rows, cols).unwrap();
    let mut data: Vec<u8> = (0..len).map(|_| rng.next_u32() as u8).collect();
    match ty {
        WeightType::F32 => {
            for v in data.chunks_exact_mut(4) {
                v.copy_from_slice(&uniform(&mut rng).to_le_bytes());
            }
        }
        WeightType::F16 => {
            for v in data.chunks_exact_mut(2) {
                v.copy_from_slice(&f16::from_f32(uniform(&mut rng)).to_le_bytes());
            }
        }
        WeightType::BF16 => {
            for v in data.chunks_exact_mut(2) {
                v.copy_from_slice(&bf16::from_f32(uniform(&mut rng)).to_le_bytes());
            }
        }
        _ => {
            for block in data.chunks_exact_mut(ty.block_bytes()) {
                for &at in scale_fields(ty) {
                    let s = f16::from_f32(uniform(&mut rng) * 0.05);
                    block[at..at + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
    }
    QuantMatrix::new(ty, rows, cols, data).unwrap()
}

fn random_activations(t: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    (0..t * cols)
        .map(|i| uniform(&mut rng) * if i % 97 == 3 { 20.0 } else { 1.0 })
        .collect()
}

/// The f64 oracle: dequantised weights times dequantised activations, and
/// the sum of the terms' magnitudes (the scale of its rounding error).
/// For `Q4_1`/`Q5_1` (Q8_1 activations) the min term is `m·s` per block,
/// `s = d·Σq` rounded to f16 as llama.cpp stores it; the codes' part is
/// exact.
fn oracle(w: &QuantMatrix, a: &Activations) -> (Vec<f64>, Vec<f64>) {
    if a.kind() == ActivationKind::Q8_1 {
        let bytes = w.ty().block_bytes();
        let mut data = w.data().to_vec();
        let mut mins = Vec::new();
        for block in data.chunks_exact_mut(bytes) {
            mins.push(f64::from(f16::from_le_bytes([block[2], block[3]]).to_f32()));
            block[2..4].fill(0);
        }
        let codes = QuantMatrix::new(w.ty(), w.rows(), w.cols(), data).unwrap();
        let (mut out, mut scale) = products_f64(&codes, a);
        let per_row = w.cols() / 32;
        for i in 0..a.rows() {
            let s = a.q8_row(i);
            for r in 0..w.rows() {
                let m = &mins[r * per_row..(r + 1) * per_row];
                let terms = m.iter().zip(s).map(|(m, b)| m * f64::from(b.s));
                out[i * w.rows() + r] += terms.clone().sum::<f64>();
                scale[i * w.rows() + r] += terms.map(f64::abs).sum::<f64>();
            }
        }
        return (out, scale);
    }
    products_f64(w, a)
}

fn products_f64(w: &QuantMatrix, a: &Activations) -> (Vec<f64>, Vec<f64>) {
    let weights = w.to_f32();
    let acts = a.dequantized();
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = Vec::new();
    let mut scale = Vec::new();
    for i in 0..a.rows() {
        for r in 0..rows {
            let terms =
                (0..cols).map(|c| f64::from(weights[r * cols + c]) * f64::from(acts[i * cols + c]));
            let (s, m) = terms.fold((0.0, 0.0), |(s, m), v| (s + v, m + v.abs()));
            out.push(s);
            scale.push(m);
        }
    }
    (out, scale)
}

fn product(w: &QuantMatrix, x: &[f32], isa: Isa) -> Vec<f32> {
    let layer = StoredLinear::new(vec![w.clone()]).unwrap();
    let mut out = vec![0.0; x.len() / w.cols() * w.rows()];
    layer.product_into(&mut out, x, false, isa).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn every_kernel_matches_the_f64_oracle() {
    for (n, ty) in KERNEL_TYPES.into_iter().enumerate() {
        // Rows of 2 (k-quant) super-blocks or 18 blocks, plus a ragged tail
        // for the float types.
        let cols = match ty.block_elems() {
            256 => 512,
            32 => 576,
            _ => 200,
        };
        let w = random_matrix(ty, 37, cols, n as u64);
        let x = random_activations(3, cols, n as u64);
        let a = Activations::new(ty.activation().unwrap(), &x, cols).unwrap();
        let (want, scale) = oracle(&w, &a);
        let got = product(&w, &x, Isa::Scalar);
        for (k, ((&g, &e), &s)) in got.iter().zip(&want).zip(&scale).enumerate() {
            let tol = 2e-6 * s + 1e-12;
            assert!(
                (f64::from(g) - e).abs() <= tol,
                "{ty} output {k}: {g} against {e} (tolerance {tol:e})"
            );
        }
    }
}

#[test]
fn every_instruction_set_computes_the_scalar_bits() {
    for isa in Isa::ALL {
        if !isa.is_supported() {
            skip(
                Requirement::Isa,
                env!("CARGO_PKG_NAME"),
                "every_instruction_set_computes_the_scalar_bits",
                &format!("this CPU has no {isa:?}"),
            );
            continue;
        }
        for (n, ty) in KERNEL_TYPES.into_iter().enumerate() {
            // 41 blocks of 32 or 9 super-blocks: past one segment of the
            // token-lane kernels (32 blocks, 8 super-blocks), and ten quads
            // and a tail of the one-token `Q4_0`/`Q5_0` kernels.
            let cols = match ty.block_elems() {
                256 => 9 * 256,
                32 => 41 * 32,
                _ => 3 * 32 + 13,
            };
            let w = random_matrix(ty, 21, cols, 100 + n as u64);
            // 21 tokens: two groups of eight and five (in lanes filled up
            // to eight where the type has token lanes, else four and one).
            let x = random_activations(21, cols, 100 + n as u64);
            assert_eq!(
                bits(&product(&w, &x, isa)),
                bits(&product(&w, &x, Isa::Scalar)),
                "{ty} on {isa:?}"
            );
        }
    }
}

#[test]
fn a_token_gets_the_same_bits_alone_and_in_a_batch() {
    let isa = Isa::detect();
    for (n, ty) in [
        WeightType::Q4_0,
        WeightType::Q5_0,
        WeightType::Q4_1,
        WeightType::Q8_0,
        WeightType::Q4_K,
        WeightType::Q6_K,
    ]
    .into_iter()
    .enumerate()
    {
        let cols = 256;
        // 41 rows (two whole tasks and a ragged one), 70 tokens (two whole
        // passes and a ragged one).
        let w = random_matrix(ty, 41, cols, 200 + n as u64);
        let x = random_activations(70, cols, 200 + n as u64);
        let batch = product(&w, &x, isa);
        for (i, x) in x.chunks_exact(cols).enumerate() {
            assert_eq!(
                bits(&product(&w, x, isa)),
                bits(&batch[i * 41..(i + 1) * 41]),
                "{ty} token {i}"
            );
        }
    }
}

#[test]
fn stacked_parts_of_different_types_write_their_own_columns() {
    let cols = 512;
    let parts = vec![
        random_matrix(WeightType::Q4_K, 5, cols, 1),
        random_matrix(WeightType::Q8_0, 3, cols, 2),
        random_matrix(WeightType::Q6_K, 4, cols, 3),
    ];
    let x = random_activations(4, cols, 9);
    let layer = StoredLinear::new(parts.clone()).unwrap();
    let mut out = vec![1.5; 4 * 12];
    layer
        .product_into(&mut out, &x, true, Isa::detect())
        .unwrap();
    let mut at = 0;
    for p in &parts {
        let alone = product(p, &x, Isa::detect());
        for i in 0..4 {
            for r in 0..p.rows() {
                assert_eq!(out[i * 12 + at + r], 1.5 + alone[i * p.rows() + r]);
            }
        }
        at += p.rows();
    }
}

#[test]
fn non_finite_activations_make_non_finite_outputs() {
    for ty in [WeightType::Q4_K, WeightType::Q5_0] {
        let w = random_matrix(ty, 2, 256, 5);
        // One token alone, and the third of a group of eight.
        for (tokens, bad) in [(1, 10), (8, 2 * 256 + 10)] {
            let mut x = random_activations(tokens, 256, 5);
            x[bad] = f32::NAN;
            let out = product(&w, &x, Isa::detect());
            for (i, out) in out.chunks_exact(2).enumerate() {
                assert_eq!(out.iter().all(|v| v.is_nan()), i == bad / 256, "{ty} {i}");
            }
        }
    }
}

#[test]
fn mismatched_buffers_are_refused() {
    let layer = StoredLinear::new(vec![random_matrix(WeightType::Q4_0, 4, 64, 1)]).unwrap();
    let mut out = vec![0.0; 5];
    assert!(
        layer
            .product_into(&mut out, &[0.0; 64], false, Isa::Scalar)
            .is_err()
    );
    let mut out = vec![0.0; 4];
    assert!(
        layer
            .product_into(&mut out, &[0.0; 60], false, Isa::Scalar)
            .is_err()
    );
    let a = Activations::new(ActivationKind::Q8_K, &[0.0; 256], 256).unwrap();
    let mut out = vec![0.0; 4];
    let m = random_matrix(WeightType::Q4_0, 4, 256, 1);
    assert!(
        m.product_into(&a, &mut out, 4, 0, false, Isa::Scalar)
            .is_err()
    );
    let q = QuantMatrix::new(WeightType::Q2_K, 1, 256, vec![0; 84]).unwrap();
    assert!(
        StoredLinear::new(vec![q])
            .unwrap()
            .product_into(&mut [0.0], &[0.0; 256], false, Isa::Scalar)
            .is_err()
    );
}

#[test]
fn dequantize_into_checks_lengths() {
    let mut out = vec![0.0; 31];
    assert!(dequantize_into(WeightType::Q4_0, &[0; 18], &mut out).is_err());
    let mut out = vec![0.0; 32];
    dequantize_into(WeightType::Q4_0, &[0; 18], &mut out).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random shapes and seeds: the detected set equals scalar bit for bit.
    #[test]
    fn random_shapes_agree(ty in 0usize..11, rows in 1usize..40, blocks in 1usize..5, t in 1usize..40, seed: u64) {
        let ty = KERNEL_TYPES[ty];
        let cols = blocks * ty.block_elems().max(32);
        let w = random_matrix(ty, rows, cols, seed);
        let x = random_activations(t, cols, seed);
        prop_assert_eq!(bits(&product(&w, &x, Isa::detect())), bits(&product(&w, &x, Isa::Scalar)));
    }
}
