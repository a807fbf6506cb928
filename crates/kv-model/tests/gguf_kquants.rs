//! Dequantisation of Q5_0, Q5_1 and the k-quants (Q2_K .. Q6_K) against an
//! independent implementation: `tests/data/gguf_quants.gguf` was written by
//! the `gguf` Python package (llama.cpp's own, `scripts/gguf_quant_fixture.py`)
//! with random blocks of each type and the values its NumPy dequantisers give;
//! ours must equal them bit for bit, whole tensors and row by row.

use std::path::Path;

use kv_model::ModelError;
use kv_model::gguf::{GgmlType, GgufFile, GgufWriter};

const TYPES: [&str; 7] = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"];

fn fixture() -> GgufFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_quants.gguf");
    GgufFile::open(&path).unwrap()
}

#[test]
fn every_type_equals_the_gguf_package_bit_for_bit() {
    let f = fixture();
    for ty in TYPES {
        let t = f.tensor(ty).unwrap();
        assert_eq!(t.info.ty.name(), ty);
        let got = t.to_f32().unwrap();
        let want = f
            .tensor(&format!("{ty}.expected"))
            .unwrap()
            .to_f32()
            .unwrap();
        assert_eq!(got.len(), want.len(), "{ty}");
        assert!(got.len() >= 256, "{ty}: the fixture holds too few values");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ty} value {i}: {g} vs {w}");
        }
        // Row access reads the same bytes.
        let len = t.info.row_len();
        let mut row = vec![0.0f32; len];
        for r in 0..t.info.rows() {
            t.row_to_f32(r, &mut row).unwrap();
            let want_row = &want[r * len..(r + 1) * len];
            assert!(
                row.iter()
                    .zip(want_row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty} row {r}"
            );
        }
    }
}

#[test]
fn the_fixture_exercises_negative_scales_and_every_code() {
    // A check on the fixture itself: values of both signs and many distinct
    // levels per type, so a wrong nibble order or sign could not pass.
    let f = fixture();
    for ty in TYPES {
        let want = f
            .tensor(&format!("{ty}.expected"))
            .unwrap()
            .to_f32()
            .unwrap();
        let mut distinct: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(
            want.iter().any(|&v| v < 0.0) && want.iter().any(|&v| v > 0.0),
            "{ty}"
        );
        assert!(
            distinct.len() >= 16,
            "{ty}: {} distinct values",
            distinct.len()
        );
    }
}

#[test]
fn a_k_quant_tensor_whose_size_does_not_match_its_shape_is_refused() {
    for (ty, block) in [("Q4_K", 144usize), ("Q6_K", 210), ("Q5_0", 22)] {
        let t = GgmlType::from_name(ty).unwrap();
        let elems = t.block_elems();
        // A row of 1.5 blocks is not a whole number of blocks.
        let mut w = GgufWriter::new();
        w.tensor("bad", &[elems + elems / 2], t, vec![0u8; block * 2]);
        match GgufFile::from_bytes(w.to_bytes()) {
            Err(ModelError::Gguf(m)) => assert!(m.contains("not a multiple"), "{ty}: {m}"),
            other => panic!("{ty}: {other:?}"),
        }
        // Two blocks declared, one block of bytes present: the tensor runs
        // past the file.
        let mut w = GgufWriter::new();
        w.tensor("short", &[2 * elems], t, vec![0u8; block]);
        match GgufFile::from_bytes(w.to_bytes()) {
            Err(ModelError::Gguf(m)) => assert!(m.contains("outside"), "{ty}: {m}"),
            other => panic!("{ty}: {other:?}"),
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Byte flips and truncations of the k-quant fixture: a typed error or a
    /// file whose tensors all dequantise, never a panic (random scale bits
    /// may decode to ∞ or NaN; the values are not checked here).
    #[test]
    fn corrupted_k_quant_files_never_panic(
        flips in proptest::collection::vec(
            (proptest::prelude::any::<proptest::sample::Index>(), 1u8..),
            1..8,
        ),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
        truncate in proptest::prelude::any::<bool>(),
    ) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_quants.gguf");
        let mut b = std::fs::read(path).unwrap();
        for (i, x) in flips {
            let i = i.index(b.len());
            b[i] ^= x;
        }
        if truncate {
            let n = cut.index(b.len());
            b.truncate(n);
        }
        if let Ok(f) = GgufFile::from_bytes(b) {
            for t in f.tensors() {
                let _ = f.tensor(&t.name).map(|t| t.to_f32());
            }
        }
    }
}
