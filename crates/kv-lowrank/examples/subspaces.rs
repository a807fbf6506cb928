//! SubSpace-G and SubSpace-A on a synthetic stream whose subspace drifts:
//! ranks by retained energy, bytes against f16, residuals and chunks.
//!
//! `cargo run --release -p kv-lowrank --example subspaces`

use std::sync::Arc;

use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankStore};
use kv_quant::{CacheForm, RankRule};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, d) = (2048, 64);
    // Eight active directions that rotate slowly over the stream, plus noise.
    let rows: Vec<f32> = (0..tokens * d)
        .map(|i| {
            let (t, c) = ((i / d) as f32, (i % d) as f32);
            let drift = t / tokens as f32;
            (0..8)
                .map(|j| {
                    ((0.05 + 0.01 * j as f32) * t).sin()
                        * ((c + 8.0 * drift) * (j as f32 + 1.0) * 0.09).cos()
                })
                .sum::<f32>()
                + 0.01 * ((i as f32) * 12.9898).sin()
        })
        .collect();
    let calib = &rows[..1024 * d];
    println!("SubSpace-G, bases fitted on the first 1,024 tokens:");
    for energy in [900_000, 990_000, 999_000] {
        let (basis, spectrum) =
            Basis::fit(calib, 1024, d, RankRule::Energy(energy), BasisStorage::F16)?;
        let rank = basis.rank();
        let bases = HeadBases {
            heads: vec![Arc::new(basis)],
        };
        let form: CacheForm = format!("pca-e{}", energy as f64 / 1e6).parse()?;
        let store = LowRankStore::build(form, &rows, tokens, d, d, Some(&bases))?;
        println!(
            "  {form:<12} rank {rank:>2} ({:.4} of the energy): {:>6} bytes ({:.3} of f16), worst residual {:.4} before / {:.4} after the drift",
            spectrum.energy_at(rank),
            store.stored_bytes(),
            store.stored_bytes() as f64 / (2 * tokens * d) as f64,
            store.max_residual(0, 0..1024),
            store.max_residual(0, 1024..tokens)
        );
    }
    println!("SubSpace-A, online chunks (no calibration):");
    for spelling in ["fd-r8-l256-t2", "fd-r8-l1024-t0.2", "fd-r16-m48-l512-t0.1"] {
        let store = LowRankStore::build(spelling.parse()?, &rows, tokens, d, d, None)?;
        println!(
            "  {spelling:<22} {:>3} chunks, {:>6} bytes ({:.3} of f16), worst residual {:.4}",
            store.chunks().len(),
            store.stored_bytes(),
            store.stored_bytes() as f64 / (2 * tokens * d) as f64,
            store.max_residual(0, 0..tokens)
        );
    }
    Ok(())
}
