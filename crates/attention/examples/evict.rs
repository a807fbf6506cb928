//! SnapKV eviction on a dense cache: a synthetic prompt whose last
//! queries look for one key, evicted to a quarter, then a decode step
//! compared with the same step on the whole prompt.
//!
//! `cargo run --release -p attention --example evict`

use attention::{
    Attention, DenseBackend, Evicting, HeadShape, KvBackend, Mask, ModelKvShape, SnapKv,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = HeadShape::new(8, 2, 64)?;
    let (layers, prompt) = (2, 512);
    let model = ModelKvShape {
        layers,
        heads: shape,
        rope: None,
    };
    let kv = shape.kv_channels();
    // Keys and values that vary smoothly, and one key (token 100) that the
    // window's queries point at.
    let row = |t: usize, salt: f32| -> Vec<f32> {
        (0..kv)
            .map(|c| ((t * kv + c) as f32 * 0.013 + salt).sin() * 0.5)
            .collect()
    };
    let needle: Vec<f32> = (0..kv)
        .map(|c| if c % 64 == 0 { 6.0 } else { 0.0 })
        .collect();
    let query: Vec<f32> = (0..shape.q_len())
        .map(|c| if c % 64 == 0 { 1.0 } else { 0.0 })
        .collect();
    let attn = Attention::new(shape);
    let mut whole = DenseBackend::new();
    let mut evicting = Evicting::new(DenseBackend::new(), SnapKv::new(0.25, 32, 7)?)?;
    for cache in [&mut whole as &mut dyn KvBackend<Error = _>, &mut evicting] {
        cache.fit(&model)?;
        cache.begin(&vec![0; prompt])?;
        for layer in 0..layers {
            let mut k: Vec<f32> = (0..prompt).flat_map(|t| row(t, 0.0)).collect();
            k[100 * kv..101 * kv].copy_from_slice(&needle);
            let v: Vec<f32> = (0..prompt).flat_map(|t| row(t, 1.0)).collect();
            cache.append(layer, &k, &v)?;
            let q = query.repeat(prompt);
            let positions: Vec<usize> = (0..prompt).collect();
            cache.attend(layer, &attn, &q, &positions, &Mask::Causal)?;
        }
        cache.commit()?;
    }
    let done = evicting.evict()?;
    println!(
        "kept {} of {} prompt tokens per key head; the cache holds {} rows for the model's {}",
        done.kept,
        done.prefill,
        evicting.inner().tokens(),
        evicting.tokens()
    );
    // One decode step on both: the same row, the same query.
    let mut worst = 0.0f32;
    for cache in [&mut whole as &mut dyn KvBackend<Error = _>, &mut evicting] {
        cache.begin(&[0])?;
        for layer in 0..layers {
            cache.append(layer, &row(prompt, 0.0), &row(prompt, 1.0))?;
        }
        cache.commit()?;
    }
    for layer in 0..layers {
        let a = whole.attend(layer, &attn, &query, &[prompt], &Mask::Causal)?;
        let b = evicting.attend(layer, &attn, &query, &[prompt], &Mask::Causal)?;
        for (x, y) in a.out.iter().zip(&b.out) {
            worst = worst.max((x - y).abs());
        }
    }
    println!(
        "decode step after eviction: max |output difference| {worst:.2e} against the whole prompt"
    );
    Ok(())
}
