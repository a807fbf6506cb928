//! The Qwen2 architecture against llama.cpp on a tiny random model the test
//! writes (`common/qwen2.rs`: Q/K/V biases, rotate-half RoPE, a separate
//! output matrix, Q5_0/Q4_K/Q6_K tensors, the `qwen2` pre-tokenizer): the
//! tokenizer id for id, and the logits of every eighth position against
//! llama.cpp's on the same bytes (within 2%, llama.cpp quantising
//! activations) and on an all-F32 copy (within 1e-5); the references are
//! committed in `tests/data`. Then the malformed Qwen2 files a loader must
//! refuse.
//!
//! To regenerate the references (after changing the model on purpose):
//!
//! ```text
//! KV_EVAL_FIXTURE_OUT=/tmp cargo test -p kv-eval --test qwen2 -- written
//! for m in tiny-qwen2 tiny-qwen2-f32; do
//!   python3 crates/eval/scripts/llama_cpp_logits.py /tmp/$m.gguf \
//!     crates/eval/tests/data/${m//-/_}_llama_cpp_logits.bin "$PARAGRAPH"
//! done
//! ```
//!
//! and paste the printed ids and SHA-256 below.

mod common;

use common::qwen2::{DIM, HEADS, as_f32, tiny_qwen2_gguf, vocab};
use kv_eval::cache::{CacheMode, KvCache};
use kv_model::ModelError;
use kv_model::gguf::{GgufFile, GgufWriter, MetaValue};
use kv_model::model::{CausalLm, LlamaArch, LlamaModel};
use kv_model::tokenizer::{ReadLimits, TextTokenizer};
use sha2::{Digest, Sha256};

/// The paragraph both tokenizers and both forward passes read: words,
/// contractions, digit runs, punctuation, runs of spaces and line breaks,
/// accented letters and CJK.
const PARAGRAPH: &str = "Hello, the world! In 2024 there're 1,234.5 cats;\n\n  they ate   at 10:30 -- naïve café, 東京 ok?\n";

/// SHA-256 of the bytes of `tiny_qwen2_gguf()` that llama.cpp scored.
const GGUF_SHA256: &str = "6e1f04be0cc941d5a04360e36897d6060c2d51cdffd8f5b384c68602d9549000";

/// llama.cpp's ids of `PARAGRAPH` on the tiny vocabulary
/// (llama-cpp-python 0.3.36, `tokenize(text, add_bos=False, special=False)`).
const LLAMA_CPP_IDS: &[u32] = &[
    72, 101, 108, 108, 111, 44, 258, 32, 119, 111, 114, 108, 100, 33, 32, 73, 110, 32, 50, 48, 50,
    52, 258, 265, 39, 265, 32, 49, 44, 50, 51, 52, 46, 53, 32, 99, 266, 115, 59, 10, 10, 32, 258,
    121, 260, 116, 101, 32, 32, 260, 116, 32, 49, 48, 58, 51, 48, 32, 45, 45, 32, 110, 97, 195,
    175, 118, 101, 32, 99, 97, 102, 195, 169, 44, 32, 230, 157, 177, 228, 186, 172, 32, 111, 107,
    63, 10,
];

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn model_and_tokenizer() -> (LlamaModel, TextTokenizer) {
    let file = GgufFile::from_bytes(tiny_qwen2_gguf()).unwrap();
    (
        LlamaModel::from_gguf(&file).unwrap(),
        TextTokenizer::from_gguf(&file).unwrap(),
    )
}

#[test]
fn the_tiny_model_is_the_one_llama_cpp_scored_and_is_written() {
    let bytes = tiny_qwen2_gguf();
    if let Some(dir) = std::env::var_os("KV_EVAL_FIXTURE_OUT") {
        let dir = std::path::PathBuf::from(dir);
        let copies = [
            ("tiny-qwen2", bytes.clone()),
            ("tiny-qwen2-f32", as_f32(bytes.clone())),
        ];
        for (name, b) in copies {
            let out = dir.join(format!("{name}.gguf"));
            std::fs::write(&out, &b).unwrap();
            eprintln!("wrote {} (sha256 {})", out.display(), sha256_hex(&b));
        }
    }
    assert_eq!(
        sha256_hex(&bytes),
        GGUF_SHA256,
        "the tiny model's bytes changed"
    );
    let (model, _) = model_and_tokenizer();
    let c = model.config();
    assert_eq!(c.arch, LlamaArch::Qwen2);
    assert_eq!(
        (c.dim, c.q_heads, c.kv_heads, c.vocab),
        (DIM, HEADS, 2, vocab().len())
    );
    assert_eq!(c.rope_layout, attention::RopeLayout::RotateHalf);
    assert!(model.describe().starts_with("qwen2:"));
}

#[test]
fn the_tokenizer_equals_llama_cpp_id_for_id() {
    let (_, tok) = model_and_tokenizer();
    let ids = tok.encode(PARAGRAPH).unwrap();
    assert_eq!(ids, LLAMA_CPP_IDS);
    assert_eq!(tok.decode(&ids).unwrap(), PARAGRAPH);
    // Read a few bytes at a time, the text splits only where the qwen2
    // regex ends a piece anyway: the same ids.
    let text = PARAGRAPH.repeat(5) + "a.\nb;\nc\n1\n2 x\ny";
    let whole = tok.encode(&text).unwrap();
    for block_bytes in [1, 7, 16, 64] {
        let limits = ReadLimits {
            block_bytes,
            ..ReadLimits::default()
        };
        let read = tok.encode_reader(text.as_bytes(), limits).unwrap();
        assert_eq!(read, whole, "blocks of {block_bytes} bytes");
    }
}

/// Every token spells as the file's vocabulary does (the byte-level form,
/// the check a draft model's tokenizer goes through), none past it.
#[test]
fn each_token_spells_as_the_vocabulary_does() {
    let (_, tok) = model_and_tokenizer();
    let vocab = common::qwen2::vocab();
    assert_eq!(tok.vocab_size(), vocab.len());
    for (id, spelled) in vocab.iter().enumerate() {
        assert_eq!(tok.token(id as u32).as_ref(), Some(spelled), "token {id}");
    }
    assert_eq!(tok.token(vocab.len() as u32), None);
    // Two byte tokens that decode alike (each half a UTF-8 character)
    // still spell apart.
    assert_ne!(tok.token(0xc3), tok.token(0xc4));
}

/// The positions whose logits the reference holds: 7, 15, 23, ... and the last.
fn reference_positions(n: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (7..n).step_by(8).collect();
    if p.last() != Some(&(n - 1)) {
        p.push(n - 1);
    }
    p
}

/// Our logits of `LLAMA_CPP_IDS` on the model in `gguf` against llama.cpp's
/// in `tests/data/<reference>`: at most `bound × max|logit|` apart at every
/// reference position, with the same argmax. Returns the largest ratio.
fn compare_logits(gguf: Vec<u8>, reference: &str, bound: f32) -> f32 {
    let file = GgufFile::from_bytes(gguf).unwrap();
    let model = LlamaModel::from_gguf(&file).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(reference);
    let reference: Vec<f32> = std::fs::read(&path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let n_vocab = vocab().len();
    let positions = reference_positions(LLAMA_CPP_IDS.len());
    assert_eq!(reference.len(), positions.len() * n_vocab);
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let all = model.forward(LLAMA_CPP_IDS, &mut cache, 0).unwrap();
    let mut worst = 0f32;
    for (theirs, &p) in reference.chunks_exact(n_vocab).zip(&positions) {
        let ours = &all[p * n_vocab..(p + 1) * n_vocab];
        let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = ours
            .iter()
            .zip(theirs)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
        assert!(
            diff <= bound * scale,
            "position {p}: max |Δlogit| {diff} against scale {scale}"
        );
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        assert_eq!(argmax(ours), argmax(theirs), "position {p}");
    }
    worst
}

/// On the quantised file llama.cpp multiplies Q5_0/Q4_K/Q6_K weights by
/// activations it quantises to 8 bits (Q8_0, Q8_K), so its logits differ
/// from our f32 pass by that rounding: measured 8.0e-3 of the largest
/// |logit|; the bound is 2%.
#[test]
fn logits_match_llama_cpp_on_the_quantised_model() {
    let worst = compare_logits(tiny_qwen2_gguf(), "tiny_qwen2_llama_cpp_logits.bin", 0.02);
    eprintln!("quantised: largest |Δlogit| / max|logit| {worst:.2e}");
}

/// On the all-F32 copy both passes compute in f32 and differ only in
/// summation order: measured 3.4e-7 of the largest |logit|; the bound is 1e-5.
#[test]
fn logits_match_llama_cpp_on_the_f32_copy() {
    let worst = compare_logits(
        as_f32(tiny_qwen2_gguf()),
        "tiny_qwen2_f32_llama_cpp_logits.bin",
        1e-5,
    );
    eprintln!("f32: largest |Δlogit| / max|logit| {worst:.2e}");
}

/// The tiny file with metadata `drop` removed and `replace` set.
fn edited(drop: &[&str], replace: &[(&str, MetaValue)], drop_tensor: Option<&str>) -> Vec<u8> {
    let file = GgufFile::from_bytes(tiny_qwen2_gguf()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if !drop.contains(&k.as_str()) {
            let v = replace.iter().find(|(r, _)| r == k).map_or(v, |(_, v)| v);
            w.meta(k, v.clone());
        }
    }
    for t in file.tensors() {
        if Some(t.name.as_str()) != drop_tensor {
            let data = file.tensor(&t.name).unwrap().data.to_vec();
            w.tensor(&t.name, &t.dims, t.ty, data);
        }
    }
    w.to_bytes()
}

fn load_err(bytes: Vec<u8>) -> String {
    let file = GgufFile::from_bytes(bytes).unwrap();
    match LlamaModel::from_gguf(&file) {
        Err(ModelError::ModelFile(m)) => m,
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("a malformed Qwen2 file loaded"),
    }
}

#[test]
fn malformed_qwen2_files_are_refused_with_a_reason() {
    // The rebuilt file itself loads (the edits below are the only defects).
    let file = GgufFile::from_bytes(edited(&[], &[], None)).unwrap();
    LlamaModel::from_gguf(&file).unwrap();
    let m = load_err(edited(&["qwen2.block_count"], &[], None));
    assert!(m.contains("qwen2.block_count"), "{m}");
    let m = load_err(edited(&["qwen2.feed_forward_length"], &[], None));
    assert!(m.contains("qwen2.feed_forward_length"), "{m}");
    let m = load_err(edited(
        &[],
        &[("qwen2.attention.head_count", MetaValue::U32(5))],
        None,
    ));
    assert!(m.contains("not a multiple of 5 heads"), "{m}");
    let m = load_err(edited(
        &[],
        &[("qwen2.attention.head_count_kv", MetaValue::U32(3))],
        None,
    ));
    assert!(m.contains("3 KV heads"), "{m}");
    let m = load_err(edited(&[], &[], Some("blk.1.attn_k.bias")));
    assert!(m.contains("blk.1.attn_k.bias"), "{m}");
    let m = load_err(edited(
        &[],
        &[("general.architecture", MetaValue::String("qwen3".into()))],
        None,
    ));
    assert!(m.contains("qwen3"), "{m}");
}
