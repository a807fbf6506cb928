//! A BER sweep over the paper's protection modes on a synthetic smooth KV
//! matrix, plus the measured bits per value of every form.
//!
//! `cargo run --release -p kv-quant --example fault_sweep`

use gf2_codes::channel::BinarySymmetric;
use kv_quant::{CacheForm, FaultTarget, FitOptions, KvStore, QuantizeOptions, VqCodebook};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, channels) = (1024, 128);
    // Smooth along tokens (the paper's assumption), varied across channels.
    let keys: Vec<f32> = (0..tokens * channels)
        .map(|i| {
            let (t, c) = ((i / channels) as f32, (i % channels) as f32);
            (0.02 * t + 0.9 * c).sin() * (1.0 + 0.05 * c)
        })
        .collect();

    println!("bits per value at {tokens} x {channels} (counted from the buffers held):");
    for spelling in [
        "fp32",
        "fp16",
        "fp8-e4m3",
        "int8",
        "int4",
        "int4-g32",
        "int4-ch",
        "int3",
        "int2",
        "nf4",
        "int4+hamming74",
        "int4+secded84",
        "int4+golay24",
        "int4+secded84+meta-none",
        "int4+rot",
        "lm4",
        "lm3",
        "lm3+qjl",
        "lm2",
        "int4-ch32+win32",
        "int4+sink4+win64",
        "int8+secded84",
        "int2+golay24",
        "fp8-e4m3-tok+secded84",
        "lm3+hamming74",
    ] {
        let store = KvStore::quantize(spelling.parse()?, &keys, tokens, channels)?;
        println!("  {spelling:<26} {:>7.3}", store.bits_per_value());
    }
    // Vector quantization needs codebooks fitted on calibration rows (here
    // the same matrix; kv-eval fits them on a disjoint text).
    for spelling in ["vq", "vq-d8-k256", "vq+secded84", "cq-d2-k16"] {
        let form: CacheForm = spelling.parse()?;
        let codebook = VqCodebook::fit(&form, &keys, tokens, channels, FitOptions::default())?;
        let store = KvStore::quantize_with_codebook(
            form,
            &keys,
            tokens,
            channels,
            QuantizeOptions::default(),
            std::sync::Arc::new(codebook),
        )?;
        println!(
            "  {spelling:<26} {:>7.3} (codebook {} bytes)",
            store.bits_per_value(),
            store.codebook().map_or(0, |c| c.stored_bytes())
        );
    }

    for (target, title) in [
        (FaultTarget::Values, "values hit (the paper's setting)"),
        (FaultTarget::Everything, "values and scales/offsets hit"),
    ] {
        println!("\nBER sweep, {title}, 3 seeds summed; rmse against the fault-free decode:");
        println!(
            "  {:<22} {:>7} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10}",
            "form", "BER", "flips", "corrected", "detected", "miscorr", "silent", "erased", "rmse"
        );
        for spelling in [
            "int4",
            "int4+hamming74",
            "int4+secded84",
            "int4+secded84+interp",
            "int4+golay24",
        ] {
            let form: CacheForm = spelling.parse()?;
            let clean = KvStore::quantize(form, &keys, tokens, channels)?;
            let reference = clean.decode()?.values;
            for ber in [1e-4, 1e-3, 1e-2] {
                let channel = BinarySymmetric::new(ber)?;
                let (mut flips, mut sq, mut stats) = (0, 0.0, kv_quant::KvDecodeStats::default());
                for seed in 0..3 {
                    let mut faulty = clean.clone();
                    flips += faulty.inject(&channel, seed, target).total();
                    let d = faulty.decode()?;
                    sq += d
                        .values
                        .iter()
                        .zip(&reference)
                        .map(|(a, b)| f64::from(a - b).powi(2))
                        .sum::<f64>();
                    stats += d.stats;
                }
                let v = stats.values;
                let rmse = (sq / (3 * tokens * channels) as f64).sqrt();
                println!(
                    "  {spelling:<22} {ber:>7.0e} {flips:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {rmse:>10.5}",
                    v.corrected + stats.metadata.corrected,
                    v.detected + stats.metadata.detected,
                    v.miscorrected + stats.metadata.miscorrected,
                    v.silent + stats.metadata.silent,
                    stats.erased_values,
                );
            }
        }
    }
    Ok(())
}
