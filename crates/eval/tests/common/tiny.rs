//! The tiny random Llama of the integration tests, written as GGUF (F32,
//! Q8_0 and Q4_1 tensors) and loaded back.

use half::f16;
use kv_model::gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};
use kv_model::model::LlamaModel;

use super::Rng;

pub(crate) const VOCAB: usize = 64;
pub(crate) const DIM: usize = 32;
pub(crate) const HEADS: usize = 4;
pub(crate) const KV_HEADS: usize = 2;
pub(crate) const FFN: usize = 48;
pub(crate) const LAYERS: usize = 2;

/// Q8_0 blocks of `x` (ggml's layout: f16 scale, 32 signed bytes).
pub(crate) fn q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for &v in b {
            let q = if d == 0.0 { 0.0 } else { (v / d).round() };
            out.push(q as i8 as u8);
        }
    }
    out
}

/// Q4_1 blocks of `x` (f16 scale and minimum, 16 bytes of nibbles).
pub(crate) fn q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(32) {
        let min = b.iter().copied().fold(f32::INFINITY, f32::min);
        let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        let q = |v: f32| ((v - min) / d).round().clamp(0.0, 15.0) as u8;
        for j in 0..16 {
            out.push(q(b[j]) | (q(b[j + 16]) << 4));
        }
    }
    out
}

pub(crate) fn tiny_gguf() -> Vec<u8> {
    tiny_gguf_eps(1e-5)
}

/// The tiny model with RMSNorm epsilon `eps`.
pub(crate) fn tiny_gguf_eps(eps: f32) -> Vec<u8> {
    tiny_gguf_with(eps, LAYERS as u32)
}

/// The tiny model with RMSNorm epsilon `eps` whose header says it has
/// `block_count` blocks (its tensors are always `LAYERS` blocks').
pub(crate) fn tiny_gguf_with(eps: f32, block_count: u32) -> Vec<u8> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let kvc = KV_HEADS * DIM / HEADS;
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("llama.embedding_length", MetaValue::U32(DIM as u32))
        .meta("llama.block_count", MetaValue::U32(block_count))
        .meta("llama.feed_forward_length", MetaValue::U32(FFN as u32))
        .meta("llama.attention.head_count", MetaValue::U32(HEADS as u32))
        .meta(
            "llama.attention.head_count_kv",
            MetaValue::U32(KV_HEADS as u32),
        )
        .meta("llama.rope.freq_base", MetaValue::F32(10_000.0))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(eps),
        )
        .meta("llama.context_length", MetaValue::U32(512))
        .meta("llama.vocab_size", MetaValue::U32(VOCAB as u32));
    let embed = rng.vec(VOCAB * DIM, 1.0);
    w.tensor(
        "token_embd.weight",
        &[DIM as u64, VOCAB as u64],
        GgmlType::from_name("Q8_0").unwrap(),
        q8_0(&embed),
    );
    let s = 1.0 / (DIM as f32).sqrt();
    for l in 0..LAYERS {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        let norm: Vec<f32> = (0..DIM).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
        w.tensor_f32(&n("attn_norm"), &[DIM as u64], &norm);
        w.tensor_f32(
            &n("attn_q"),
            &[DIM as u64, DIM as u64],
            &rng.vec(DIM * DIM, 2.0 * s),
        );
        w.tensor_f32(
            &n("attn_k"),
            &[DIM as u64, kvc as u64],
            &rng.vec(kvc * DIM, 2.0 * s),
        );
        w.tensor_f32(
            &n("attn_v"),
            &[DIM as u64, kvc as u64],
            &rng.vec(kvc * DIM, s),
        );
        w.tensor_f32(
            &n("attn_output"),
            &[DIM as u64, DIM as u64],
            &rng.vec(DIM * DIM, s),
        );
        w.tensor_f32(&n("ffn_norm"), &[DIM as u64], &norm);
        w.tensor(
            &n("ffn_gate"),
            &[DIM as u64, FFN as u64],
            GgmlType::from_name("Q4_1").unwrap(),
            q4_1(&rng.vec(FFN * DIM, s)),
        );
        w.tensor_f32(
            &n("ffn_up"),
            &[DIM as u64, FFN as u64],
            &rng.vec(FFN * DIM, s),
        );
        let down_s = 1.0 / (FFN as f32).sqrt();
        w.tensor_f32(
            &n("ffn_down"),
            &[FFN as u64, DIM as u64],
            &rng.vec(DIM * FFN, down_s),
        );
    }
    w.tensor_f32("output_norm.weight", &[DIM as u64], &[1.0; DIM]);
    w.to_bytes()
}

pub(crate) fn model() -> LlamaModel {
    let file = GgufFile::from_bytes(tiny_gguf()).unwrap();
    LlamaModel::from_gguf(&file).unwrap()
}

pub(crate) fn tokens(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % VOCAB) as u32).collect()
}

/// The logits of `toks` through `model` on a fresh re-encode cache in
/// `mode` with faults `f`, and the cache (its statistics).
pub(crate) fn run(
    model: &LlamaModel,
    toks: &[u32],
    mode: kv_eval::cache::CacheMode,
    f: Option<kv_eval::cache::FaultSpec>,
) -> (Vec<f32>, kv_eval::cache::KvCache) {
    let mut cache = kv_eval::cache::KvCache::new(mode, f, 0).unwrap();
    let logits = model.forward(toks, &mut cache, 0).unwrap();
    (logits, cache)
}
