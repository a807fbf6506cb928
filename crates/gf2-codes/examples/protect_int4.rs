//! Protect a buffer of INT4 values with each of the paper's codes, push it
//! through a binary symmetric channel, and count what the decoder did.
//!
//! Run: `cargo run --release -p gf2-codes --example protect_int4 [BER] [SEED]`

use gf2_codes::batch::erasure_words;
use gf2_codes::channel::{BinarySymmetric, FaultChannel, FaultRng};
use gf2_codes::{Gf2Error, Int4Code};

fn main() -> Result<(), Gf2Error> {
    let mut args = std::env::args().skip(1);
    let ber: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1e-2);
    let seed: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2026);
    let channel = BinarySymmetric::new(ber)?;

    // One million random INT4 values (a stand-in for a quantized K or V block).
    let mut rng = FaultRng::new(seed);
    let values: Vec<u8> = (0..1_000_000)
        .map(|_| (rng.next_u64() & 0xF) as u8)
        .collect();

    println!("BER {ber:e}, seed {seed}, {} values", values.len());
    println!(
        "{:<10} {:>10} {:>8} {:>10} {:>10} {:>9} {:>12} {:>7}",
        "code", "bytes", "flips", "clean", "corrected", "detected", "miscorrected", "silent"
    );
    for code in Int4Code::ALL {
        let codec = code.codec();
        let mut stored = codec.encode(&values)?;
        let flips = channel.inject(&mut stored, seed);
        let mut decoded = vec![0u8; values.len()];
        let mut erasures = vec![0u64; erasure_words(values.len())];
        let s = codec.decode_with_truth_into(&stored, &values, &mut decoded, &mut erasures)?;
        println!(
            "{:<10} {:>10} {:>8} {:>10} {:>10} {:>9} {:>12} {:>7}",
            code.to_string(),
            stored.len(),
            flips.len(),
            s.clean,
            s.corrected,
            s.detected,
            s.miscorrected,
            s.silent
        );
    }
    Ok(())
}
