//! Codes over every code width: INT8, INT3, INT2, FP8, NF4, Lloyd-Max,
//! VQ indices and f16 under Hamming(7,4), SECDED(8,4) and Golay(24,12),
//! through the nibbles of the packed code stream. Exhaustive over the bits
//! of small stores: every single flip is corrected, every double flip in a
//! SECDED word is detected and erases exactly the values whose code bits
//! share that nibble.

use std::sync::Arc;

use gf2_codes::channel::ExactFlips;
use kv_quant::{CacheForm, FaultTarget, FitOptions, KvStore, QuantizeOptions, VqCodebook};

const CHANNELS: usize = 64;
const TOKENS: usize = 2;

fn data() -> Vec<f32> {
    (0..TOKENS * CHANNELS)
        .map(|i| ((i as f32) * 0.61).sin() * (1.0 + (i % 7) as f32 * 0.3))
        .collect()
}

fn store(spelling: &str) -> KvStore {
    let form: CacheForm = spelling.parse().unwrap();
    let x = data();
    if form.quantizer().needs_codebook() {
        let train: Vec<f32> = (0..200 * CHANNELS)
            .map(|i| ((i as f32) * 0.37).cos())
            .collect();
        let cb = VqCodebook::fit(&form, &train, 200, CHANNELS, FitOptions::default()).unwrap();
        KvStore::quantize_with_codebook(
            form,
            &x,
            TOKENS,
            CHANNELS,
            QuantizeOptions::default(),
            Arc::new(cb),
        )
        .unwrap()
    } else {
        KvStore::quantize(form, &x, TOKENS, CHANNELS).unwrap()
    }
}

const BASES: [&str; 10] = [
    "int8",
    "int3",
    "int2",
    "fp8-e4m3-tok",
    "nf4",
    "lm3",
    "lm5",
    "fp16",
    "bf16",
    "vq-k16",
];

#[test]
fn clean_protected_stores_decode_like_unprotected_ones() {
    for base in BASES {
        let plain = store(base).decode().unwrap().values;
        for code in ["hamming74", "secded84", "golay24"] {
            let s = store(&format!("{base}+{code}"));
            assert_eq!(s.decode().unwrap().values, plain, "{base}+{code}");
            assert!(
                s.stored_bytes() > store(base).stored_bytes(),
                "{base}+{code}"
            );
        }
    }
}

#[test]
fn every_single_flip_is_corrected() {
    for base in BASES {
        for code in ["hamming74", "secded84", "golay24"] {
            let spelling = format!("{base}+{code}+meta-none");
            let clean = store(&spelling);
            let expect = clean.decode().unwrap().values;
            for bit in 0..8 * clean.data().len() as u64 {
                let mut faulty = clean.clone();
                faulty.inject(&ExactFlips::new(vec![bit]), 0, FaultTarget::Values);
                if faulty.word_of_bit(bit).is_none() {
                    continue; // a padding bit
                }
                let d = faulty.decode().unwrap();
                assert_eq!(d.values, expect, "{spelling}: bit {bit}");
                assert_eq!(d.stats.values.corrected, 1, "{spelling}: bit {bit}");
                assert_eq!(d.stats.erased_values, 0, "{spelling}: bit {bit}");
            }
        }
    }
}

#[test]
fn double_flips_in_a_secded_word_erase_the_codes_of_its_nibble() {
    for base in BASES {
        let spelling = format!("{base}+secded84+meta-none");
        let clean = store(&spelling);
        let form = *clean.form();
        let (code_bits, per_code) = (
            form.quantizer().code_bits() as usize,
            form.quantizer().values_per_code(),
        );
        let row_bytes = clean.row_bytes();
        // SECDED stores one nibble per byte: byte `i` of a row is nibble `i`.
        for nibble in 0..row_bytes {
            for (a, b) in [(0u64, 1u64), (2, 7), (4, 6)] {
                let mut faulty = clean.clone();
                let byte = (row_bytes + nibble) as u64; // second row
                faulty.inject(
                    &ExactFlips::new(vec![8 * byte + a, 8 * byte + b]),
                    0,
                    FaultTarget::Values,
                );
                let d = faulty.decode().unwrap();
                assert_eq!(d.stats.values.detected, 1, "{spelling} nibble {nibble}");
                let first = 4 * nibble / code_bits;
                let last = ((4 * nibble + 3) / code_bits).min(CHANNELS / per_code - 1);
                for c in 0..CHANNELS {
                    let code = c / per_code;
                    let expect = (first..=last).contains(&code);
                    assert_eq!(
                        d.is_erased(1, c),
                        expect,
                        "{spelling} nibble {nibble} channel {c}"
                    );
                    assert!(!d.is_erased(0, c));
                }
            }
        }
    }
}
