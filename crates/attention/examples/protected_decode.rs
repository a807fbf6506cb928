//! Decode attention over a SECDED-protected INT4 cache (with midpoint
//! interpolation of erased values) after injecting bit flips at several
//! bit-error rates: prints the largest output error against the
//! fault-free cache and the decode statistics of the keys and values.
//!
//! `cargo run --release -p attention --example protected_decode`

use attention::{Attention, HeadShape, Mask, Rope, RopeLayout};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::{CacheForm, FaultTarget, KvStore};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = HeadShape::new(9, 3, 64)?; // SmolLM2-135M
    let (tokens, ch) = (4096, shape.kv_channels());
    let rope = Rope::new(RopeLayout::RotateHalf, 64, 64, 100_000.0)?;
    let mut k: Vec<f32> = (0..tokens * ch)
        .map(|i| ((i / ch) as f32 * 0.013 + (i % ch) as f32 * 0.37).sin())
        .collect();
    for (t, row) in k.chunks_mut(ch).enumerate() {
        rope.apply(row, t)?;
    }
    let v: Vec<f32> = (0..tokens * ch)
        .map(|i| ((i / ch) as f32 * 0.011 + (i % ch) as f32 * 0.29).cos())
        .collect();
    let mut q: Vec<f32> = (0..shape.q_len()).map(|i| (i as f32 * 0.3).sin()).collect();
    rope.apply(&mut q, tokens - 1)?;
    let attn = Attention::new(shape);
    for spelling in ["int4", "int4+secded84+interp"] {
        let form: CacheForm = spelling.parse()?;
        let (ks, vs) = (
            KvStore::quantize(form, &k, tokens, ch)?,
            KvStore::quantize(form, &v, tokens, ch)?,
        );
        let clean = attn.decode(&q, tokens - 1, &ks, &vs, &Mask::Causal)?;
        println!("{spelling}");
        for ber in [1e-5, 1e-4, 1e-3, 1e-2] {
            let channel = BinarySymmetric::new(ber)?;
            let (mut kf, mut vf) = (ks.clone(), vs.clone());
            let flips = kf.inject(&channel, 7, FaultTarget::Everything).total()
                + vf.inject(&channel, 8, FaultTarget::Everything).total();
            let out = attn.decode(&q, tokens - 1, &kf, &vf, &Mask::Causal);
            let (k_stats, v_stats) = match &out {
                Ok(o) => (o.stats.keys, o.stats.values),
                Err(e) => {
                    println!("  BER {ber:.0e}: {flips} flips, attention refused: {e}");
                    continue;
                }
            };
            let out = out?;
            let error = clean
                .out
                .iter()
                .zip(&out.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!(
                "  BER {ber:.0e}: {flips} flips, max |output error| {error:.3e}; \
                 corrected {} detected {} (keys+values), erased values {}",
                k_stats.values.corrected + v_stats.values.corrected,
                k_stats.values.detected + v_stats.values.detected,
                k_stats.erased_values + v_stats.erased_values,
            );
        }
    }
    Ok(())
}
