//! A tiny random Qwen2 model written as GGUF: biases on Q/K/V, rotate-half
//! RoPE, a separate output matrix, Q4_K/Q6_K/Q5_0 tensors among the F32
//! ones, and a byte-level BPE vocabulary with the `qwen2` pre-tokenizer, so
//! llama.cpp can load the same bytes (`scripts/llama_cpp_logits.py`).

use half::f16;
use kv_model::gguf::{GgmlType, GgufWriter, MetaValue};

use super::Rng;

pub(crate) const DIM: usize = 64;
pub(crate) const HEADS: usize = 4;
pub(crate) const KV_HEADS: usize = 2;
pub(crate) const HEAD_DIM: usize = DIM / HEADS;
pub(crate) const FFN: usize = 256;
pub(crate) const LAYERS: usize = 2;

/// Merges of the tiny vocabulary, in rank order (byte-level strings).
const MERGES: [&str; 12] = [
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ s", "o n", "Ġ 1", "r e", "a t", "Ġt h",
];

/// GPT-2's byte-to-character map of byte-level BPE vocabularies.
pub(crate) fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap()
}

/// The vocabulary: the 256 bytes, one token per merge, then `<|endoftext|>`.
pub(crate) fn vocab() -> Vec<String> {
    let mut v: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    v.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    v.push("<|endoftext|>".into());
    v
}

/// Random k-quant blocks: random code bytes with the f16 fields at
/// `f16_fields` set to small random scales.
fn random_blocks(rng: &mut Rng, ty: &str, values: usize, f16_fields: &[(usize, f32)]) -> Vec<u8> {
    let t = GgmlType::from_name(ty).unwrap();
    let blocks = values / t.block_elems() as usize;
    let bytes = t.block_bytes() as usize;
    let mut out = Vec::with_capacity(blocks * bytes);
    for _ in 0..blocks {
        let mut b: Vec<u8> = (0..bytes)
            .map(|_| ((rng.uniform() + 1.0) * 128.0) as u8)
            .collect();
        for &(at, scale) in f16_fields {
            let v = f16::from_f32(scale * (0.5 + 0.5 * rng.uniform().abs()));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        out.extend(b);
    }
    out
}

/// The tiny Qwen2 GGUF (deterministic: the same bytes every run).
pub(crate) fn tiny_qwen2_gguf() -> Vec<u8> {
    let mut rng = Rng(0x5157_454e_3200_0001);
    let vocab = vocab();
    let n_vocab = vocab.len();
    let kvc = KV_HEADS * HEAD_DIM;
    let mut w = GgufWriter::new();
    let u = |v: usize| MetaValue::U32(v as u32);
    w.meta("general.architecture", MetaValue::String("qwen2".into()))
        .meta("qwen2.block_count", u(LAYERS))
        .meta("qwen2.context_length", u(1024))
        .meta("qwen2.embedding_length", u(DIM))
        .meta("qwen2.feed_forward_length", u(FFN))
        .meta("qwen2.attention.head_count", u(HEADS))
        .meta("qwen2.attention.head_count_kv", u(KV_HEADS))
        .meta("qwen2.rope.freq_base", MetaValue::F32(1_000_000.0))
        .meta(
            "qwen2.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-6),
        )
        .meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String("qwen2".into()))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vocab.iter().map(|t| MetaValue::String(t.clone())).collect()),
        )
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(
                (0..n_vocab)
                    .map(|i| MetaValue::I32(if i + 1 == n_vocab { 3 } else { 1 }))
                    .collect(),
            ),
        )
        .meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(
                MERGES
                    .iter()
                    .map(|m| MetaValue::String((*m).into()))
                    .collect(),
            ),
        )
        .meta("tokenizer.ggml.bos_token_id", u(n_vocab - 1))
        .meta("tokenizer.ggml.eos_token_id", u(n_vocab - 1))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    let d = |n: usize| [DIM as u64, n as u64];
    w.tensor_f32(
        "token_embd.weight",
        &d(n_vocab),
        &rng.vec(n_vocab * DIM, 1.0),
    );
    let s = 1.0 / (DIM as f32).sqrt();
    for l in 0..LAYERS {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        let bias = |x: &str| format!("blk.{l}.{x}.bias");
        let norm: Vec<f32> = (0..DIM).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
        w.tensor_f32(&n("attn_norm"), &[DIM as u64], &norm);
        w.tensor(
            &n("attn_q"),
            &d(DIM),
            GgmlType::from_name("Q5_0").unwrap(),
            random_blocks(&mut rng, "Q5_0", DIM * DIM, &[(0, 2.0 * s / 16.0)]),
        );
        w.tensor_f32(&bias("attn_q"), &[DIM as u64], &rng.vec(DIM, 0.5));
        w.tensor_f32(&n("attn_k"), &d(kvc), &rng.vec(kvc * DIM, 2.0 * s));
        w.tensor_f32(&bias("attn_k"), &[kvc as u64], &rng.vec(kvc, 0.5));
        w.tensor_f32(&n("attn_v"), &d(kvc), &rng.vec(kvc * DIM, s));
        w.tensor_f32(&bias("attn_v"), &[kvc as u64], &rng.vec(kvc, 0.2));
        w.tensor_f32(&n("attn_output"), &d(DIM), &rng.vec(DIM * DIM, s));
        w.tensor_f32(&n("ffn_norm"), &[DIM as u64], &norm);
        w.tensor_f32(&n("ffn_gate"), &d(FFN), &rng.vec(FFN * DIM, s));
        w.tensor_f32(&n("ffn_up"), &d(FFN), &rng.vec(FFN * DIM, s));
        // Rows of 256 values: one k-quant super-block each. Q4_K's codes
        // (0..15, minus the min) and Q6_K's (−32..31) scaled to about ±1/√FFN.
        let down_s = 1.0 / (FFN as f32).sqrt();
        let (ty, fields): (&str, Vec<(usize, f32)>) = if l == 0 {
            ("Q4_K", vec![(0, down_s / 8.0 / 40.0), (2, down_s / 40.0)])
        } else {
            ("Q6_K", vec![(208, down_s / 32.0 / 64.0)])
        };
        w.tensor(
            &n("ffn_down"),
            &[FFN as u64, DIM as u64],
            GgmlType::from_name(ty).unwrap(),
            random_blocks(&mut rng, ty, DIM * FFN, &fields),
        );
    }
    let norm: Vec<f32> = (0..DIM).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
    w.tensor_f32("output_norm.weight", &[DIM as u64], &norm);
    w.tensor_f32(
        "output.weight",
        &d(n_vocab),
        &rng.vec(n_vocab * DIM, s * 4.0),
    );
    w.to_bytes()
}

/// The same model with every tensor dequantised to F32 (by kv-eval's own
/// dequantisers): llama.cpp computes it without quantising activations, so
/// its logits can be compared tightly.
pub(crate) fn as_f32(bytes: Vec<u8>) -> Vec<u8> {
    use kv_model::gguf::GgufFile;
    let file = GgufFile::from_bytes(bytes).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.meta(k, v.clone());
    }
    for t in file.tensors() {
        let values = file.tensor(&t.name).unwrap().to_f32().unwrap();
        w.tensor_f32(&t.name, &t.dims, &values);
    }
    w.to_bytes()
}
