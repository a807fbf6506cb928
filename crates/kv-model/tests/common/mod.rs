//! The tiny Llama the integration tests run: 2 layers of width 16, a
//! vocabulary of 40, weights from seeded values.
#![allow(dead_code, unreachable_pub)] // each test file uses part of it

use attention::RopeLayout;
use kv_model::model::{LlamaArch, LlamaConfig, LlamaLayer, LlamaModel, Matrix, Projection};
use kv_model::weights::{QuantMatrix, StoredLinear};

pub const VOCAB: usize = 40;
pub const DIM: usize = 16;
pub const FFN: usize = 24;
pub const LAYERS: usize = 2;

/// Seeded values in about ±0.5.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Stored (F32 blocks) projections in even layers, dense ones in odd
/// layers, so both kinds meet the hook.
pub fn projection(rows: usize, cols: usize, seed: u64, stored: bool) -> Projection {
    let v = values(rows * cols, seed);
    if stored {
        let m = QuantMatrix::from_f32(rows, cols, &v).unwrap();
        Projection::Stored(StoredLinear::new(vec![m]).unwrap())
    } else {
        Projection::Dense(Matrix::new(rows, cols, v).unwrap())
    }
}

/// The tiny model: stored (F32 blocks) projections in even layers, dense
/// ones in odd layers.
pub fn model() -> LlamaModel {
    tiny(0, |l| l % 2 == 0)
}

/// A tiny Llama whose weights come from seeds offset by `seed`, layer `l`
/// stored where `stored(l)` (else dense f32).
pub fn tiny(seed: u64, stored: impl Fn(usize) -> bool) -> LlamaModel {
    let config = LlamaConfig {
        arch: LlamaArch::Llama,
        vocab: VOCAB,
        dim: DIM,
        layers: LAYERS,
        ffn: FFN,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 4,
        rope_base: 10_000.0,
        rope_dims: 4,
        rope_layout: RopeLayout::Adjacent,
        norm_eps: 1e-5,
        context: 64,
    };
    let kvc = config.kv_channels();
    let layers = (0..LAYERS)
        .map(|l| {
            let (seed, stored) = (seed + 100 * l as u64, stored(l));
            LlamaLayer {
                attn_norm: vec![1.0; DIM],
                qkv: projection(DIM + 2 * kvc, DIM, seed + 1, stored),
                qkv_bias: None,
                out: projection(DIM, DIM, seed + 2, stored),
                ffn_norm: vec![1.0; DIM],
                gate_up: projection(2 * FFN, DIM, seed + 3, stored),
                down: projection(DIM, FFN, seed + 4, stored),
            }
        })
        .collect();
    let embed = projection(VOCAB, DIM, seed + 7, true);
    LlamaModel::from_parts(config, embed, layers, vec![1.0; DIM], None).unwrap()
}
