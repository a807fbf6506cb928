//! A `shard` layer of SmolLM2-135M's shape (9 query heads, 3 KV heads of
//! 64) over 16K synthetic tokens: its bytes against f16, decode attention
//! on its compressed forms against the dequantise-then-attend result, and
//! the time of each call against FP16 decode attention over the same rows.
//!
//! `cargo run --release -p attention --example shard_decode [tokens] [form]`;
//! `REPS` sets the timed calls of each kind (default 50).

use std::time::Instant;

use attention::{Attention, HeadShape, Mask, Rope, RopeLayout, ShardLayer, reference_attention};
use kv_quant::{CacheForm, KvStore};

/// Timed calls of each kind unless `REPS` says otherwise.
const REPEATS: usize = 50;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let tokens: usize = args.next().map_or(Ok(16384), |a| a.parse())?;
    let form: CacheForm = args.next().unwrap_or_else(|| "shard".into()).parse()?;
    let repeats: usize = std::env::var("REPS").map_or(Ok(REPEATS), |r| r.parse())?;
    let shape = HeadShape::new(9, 3, 64)?;
    let ch = shape.kv_channels();
    let rope = Rope::new(RopeLayout::Adjacent, 64, 64, 100_000.0)?;
    // Keys near a 24-dimensional subspace (RoPE applied), smooth values.
    let mix: Vec<f32> = (0..24 * ch)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let mut k = vec![0f32; tokens * ch];
    for (t, row) in k.chunks_exact_mut(ch).enumerate() {
        for j in 0..24 {
            let c = (t as f32 * 0.01 * (j + 1) as f32).sin() / (1.0 + j as f32 * 0.2);
            for (x, m) in row.iter_mut().zip(&mix[j * ch..][..ch]) {
                *x += c * m;
            }
        }
        rope.apply(row, t)?;
    }
    let v: Vec<f32> = (0..tokens * ch)
        .map(|i| ((i % 977) as f32 * 0.37).sin())
        .collect();
    let started = Instant::now();
    let layer = ShardLayer::build(form, &k, &v, tokens, tokens, &rope)?;
    println!(
        "{form}: {tokens} tokens in {:.2}x fewer bytes than f16 ({:?}), built in {:.2} s",
        (4 * tokens * ch) as f64 / layer.stored_bytes() as f64,
        layer.bytes(),
        started.elapsed().as_secs_f64()
    );
    let mut q: Vec<f32> = (0..shape.q_len())
        .map(|i| (i as f32 * 0.13).cos())
        .collect();
    rope.apply(&mut q, tokens - 1)?;
    let attn = Attention::new(shape);
    let p = [tokens - 1];
    let (dk, dv) = layer.dequantize()?;
    // One decode query, and 32 queries at the end (the prefill path: each
    // key tile built once for all of them).
    let last: Vec<usize> = (tokens.saturating_sub(32)..tokens).collect();
    let mut many: Vec<f32> = Vec::with_capacity(last.len() * shape.q_len());
    for &t in &last {
        let mut row: Vec<f32> = (0..shape.q_len())
            .map(|i| ((i + 7 * t) as f32 * 0.13).cos())
            .collect();
        rope.apply(&mut row, t)?;
        many.extend(row);
    }
    for (what, q, p) in [
        ("decode", &q[..], &p[..]),
        ("32 queries", &many[..], &last[..]),
    ] {
        let out = layer.attend(&attn, q, p, &Mask::Causal)?;
        let want = reference_attention(q, p, &dk, &dv, tokens, &shape, &Mask::Causal)?;
        let err = out
            .out
            .iter()
            .zip(&want.out)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        println!("{what}: max |compressed − dequantised oracle| = {err:.2e}");
        if err > 1e-5 || out.non_finite > 0 {
            return Err(format!("{what}: {err:e} from the oracle, above 1e-5").into());
        }
    }
    let fp16: CacheForm = "fp16".parse()?;
    let (ks, vs) = (
        KvStore::quantize(fp16, &k, tokens, ch)?,
        KvStore::quantize(fp16, &v, tokens, ch)?,
    );
    let time = |f: &dyn Fn()| {
        f();
        let started = Instant::now();
        for _ in 0..repeats {
            f();
        }
        started.elapsed().as_secs_f64() / repeats as f64
    };
    let shard = time(&|| {
        layer
            .attend(&attn, &q, &p, &Mask::Causal)
            .expect("shard decode");
    });
    let half = time(&|| {
        attn.decode(&q, tokens - 1, &ks, &vs, &Mask::Causal)
            .expect("fp16 decode");
    });
    println!(
        "decode: shard {:.3} ms, fp16 {:.3} ms ({:.2}x fp16's speed)",
        shard * 1e3,
        half * 1e3,
        half / shard
    );
    Ok(())
}
