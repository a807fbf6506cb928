//! Malformed GGUF files: every defect gives a typed error, never a panic or a
//! huge allocation; random corruptions of a valid file never panic.

use kv_model::ModelError;
use kv_model::gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};
use proptest::prelude::*;

fn valid() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("general.alignment", MetaValue::U32(32))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::String("a".into()); 3]),
        )
        .tensor_f32("w", &[4, 2], &[1.0; 8])
        .tensor_f32("b", &[4], &[2.0; 4]);
    w.to_bytes()
}

fn gguf_err(bytes: Vec<u8>) -> String {
    match GgufFile::from_bytes(bytes) {
        Err(ModelError::Gguf(m)) => m,
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(f) => panic!("malformed file accepted: {f:?}"),
    }
}

/// Byte offset of the first tensor info (after the metadata of `valid()`).
fn tensor_info_start(bytes: &[u8]) -> usize {
    let name = b"\x01\x00\x00\x00\x00\x00\x00\x00w";
    bytes.windows(name.len()).position(|w| w == name).unwrap()
}

#[test]
fn the_valid_file_parses() {
    let f = GgufFile::from_bytes(valid()).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.tensor("b").unwrap().to_f32().unwrap(), vec![2.0; 4]);
}

#[test]
fn bad_magic_and_versions() {
    let mut b = valid();
    b[0] = b'X';
    assert!(gguf_err(b).contains("magic"));
    for v in [0u32, 1, 4, 0xffff_ffff] {
        let mut b = valid();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes(b),
            Err(ModelError::GgufVersion(x)) if x == v
        ));
    }
    assert!(gguf_err(b"GG".to_vec()).contains("truncated"));
    assert!(gguf_err(Vec::new()).contains("truncated"));
}

#[test]
fn counts_that_cannot_fit_are_refused_before_allocating() {
    let mut b = valid();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    assert!(gguf_err(b).contains("tensor count"));
    let mut b = valid();
    b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // metadata count
    assert!(gguf_err(b).contains("metadata count"));
    // An array claiming 2^62 strings.
    let mut w = GgufWriter::new();
    w.meta("x", MetaValue::Array(vec![MetaValue::String("a".into())]));
    let mut b = w.to_bytes();
    // The pair: key length (8), "x" (1), type (4), item type (4), then the
    // array length, right after the 24-byte header.
    let len_at = 24 + 8 + 1 + 4 + 4;
    assert_eq!(&b[len_at..len_at + 8], &1u64.to_le_bytes());
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(gguf_err(b).contains("array length"));
}

#[test]
fn strings_lengths_and_types() {
    // Key length past the end.
    let mut b = valid();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(gguf_err(b).contains("truncated"));
    // Invalid UTF-8 in the first key.
    let mut b = valid();
    b[32] = 0xff;
    assert!(gguf_err(b).contains("UTF-8"));
    // Unknown metadata type of the first pair (after its 20-byte key).
    let key_len = u64::from_le_bytes(valid()[24..32].try_into().unwrap()) as usize;
    let mut b = valid();
    b[32 + key_len..36 + key_len].copy_from_slice(&99u32.to_le_bytes());
    assert!(gguf_err(b).contains("unknown metadata type 99"));
}

#[test]
fn tensor_info_defects() {
    let base = valid();
    let at = tensor_info_start(&base) + 9; // after the name "w"
    // n_dims 0 and 5.
    for n in [0u32, 5] {
        let mut b = base.clone();
        b[at..at + 4].copy_from_slice(&n.to_le_bytes());
        assert!(gguf_err(b).contains("dimensions"));
    }
    // Dimensions whose product overflows.
    let mut b = base.clone();
    b[at + 4..at + 12].copy_from_slice(&u64::MAX.to_le_bytes());
    b[at + 12..at + 20].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(gguf_err(b).contains("overflows"));
    // A zero dimension.
    let mut b = base.clone();
    b[at + 4..at + 12].copy_from_slice(&0u64.to_le_bytes());
    assert!(gguf_err(b).contains("is 0"));
    // Unknown ggml type.
    let mut b = base.clone();
    b[at + 20..at + 24].copy_from_slice(&77u32.to_le_bytes());
    assert!(gguf_err(b).contains("unknown ggml type 77"));
    // Q4_0 rows must be multiples of 32 elements.
    let mut b = base.clone();
    b[at + 20..at + 24].copy_from_slice(&2u32.to_le_bytes());
    assert!(gguf_err(b).contains("multiple"));
    // Misaligned offset.
    let mut b = base.clone();
    b[at + 24..at + 32].copy_from_slice(&3u64.to_le_bytes());
    assert!(gguf_err(b).contains("aligned"));
    // Offset far past the end, and offset + size overflowing.
    for off in [1u64 << 40, u64::MAX - 31] {
        let mut b = base.clone();
        b[at + 24..at + 32].copy_from_slice(&off.to_le_bytes());
        assert!(gguf_err(b).contains("outside"), "{off}");
    }
}

#[test]
fn truncated_data_and_bad_alignment() {
    let b = valid();
    // The last tensor's 16 bytes are followed by 16 bytes of padding.
    for cut in [17, 24, 40] {
        let m = gguf_err(b[..b.len() - cut].to_vec());
        assert!(m.contains("outside") || m.contains("truncated"), "{m}");
    }
    for a in [0u32, 3, 48] {
        let mut w = GgufWriter::new();
        w.meta("general.alignment", MetaValue::U32(a));
        assert!(gguf_err(w.to_bytes()).contains("alignment"));
    }
    let mut w = GgufWriter::new();
    w.meta("k", MetaValue::U8(1)).meta("k", MetaValue::U8(2));
    assert!(gguf_err(w.to_bytes()).contains("duplicate"));
    let mut w = GgufWriter::new();
    w.meta("b", MetaValue::Bool(true));
    let mut b = w.to_bytes();
    // Header (24), key length (8), "b" (1), type (4), then the value.
    assert_eq!(b[37], 1);
    b[37] = 2;
    assert!(gguf_err(b).contains("bool"));
}

#[test]
fn unsupported_tensor_types_error_on_dequantisation() {
    // Q8_1 (an activation type, never stored in model files) and the
    // integer types are listed but not dequantised.
    for (ty, bytes) in [("Q8_1", 36), ("I8", 32)] {
        let t = GgmlType::from_name(ty).unwrap();
        let mut w = GgufWriter::new();
        w.tensor("k", &[t.block_elems().max(32)], t, vec![0; bytes]);
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert!(
            matches!(
                f.tensor("k").unwrap().to_f32(),
                Err(ModelError::UnsupportedType { .. })
            ),
            "{ty}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any byte flips and any truncation: an error or a file, never a panic.
    #[test]
    fn corrupted_files_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut b = valid();
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
