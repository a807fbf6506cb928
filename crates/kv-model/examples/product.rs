//! A Q4_K matrix times a vector on every instruction set this CPU has,
//! beside the f64 product of the dequantised weights and activations.
//!
//! `cargo run --release -p kv-model --example product`

use kv_model::weights::{ActivationKind, Activations, Isa, QuantMatrix, StoredLinear, WeightType};

fn main() -> Result<(), kv_model::ModelError> {
    let (rows, cols) = (4, 512);
    // Codes from a fixed pattern, scales 0.01 and mins 0.02 (f16).
    let mut data: Vec<u8> = (0..QuantMatrix::data_len(WeightType::Q4_K, rows, cols)?)
        .map(|i| (i * 37 % 251) as u8)
        .collect();
    for block in data.chunks_exact_mut(WeightType::Q4_K.block_bytes()) {
        block[0..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        block[2..4].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
    }
    let w = QuantMatrix::new(WeightType::Q4_K, rows, cols, data)?;
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();

    let a = Activations::new(ActivationKind::Q8_K, &x, cols)?;
    let (wf, af) = (w.to_f32(), a.dequantized());
    let layer = StoredLinear::new(vec![w])?;
    println!(
        "row  f64 oracle      {}",
        Isa::ALL.map(|i| format!("{i:?}")).join("  ")
    );
    let mut outs = Vec::new();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let mut out = vec![0.0; rows];
        layer.product_into(&mut out, &x, false, isa)?;
        outs.push(out);
    }
    for r in 0..rows {
        let exact: f64 = (0..cols)
            .map(|c| f64::from(wf[r * cols + c]) * f64::from(af[c]))
            .sum();
        let got: Vec<String> = outs.iter().map(|o| format!("{:.6}", o[r])).collect();
        println!("{r:>3}  {exact:>13.6}  {}", got.join("  "));
    }
    Ok(())
}
