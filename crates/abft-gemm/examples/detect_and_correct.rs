//! Injects a single bit flip into a BF16 product, detects it with V-ABFT,
//! locates it with row and column checks, and corrects it:
//! `cargo run --release -p abft-gemm --example detect_and_correct -- [BIT]`.

use abft_gemm::{
    Correction, Distribution, FlipDirection, Matrix, Precision, VAbft, flip_bit, gemm,
    locate_and_correct, verify_rows,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bit: u32 = std::env::args().nth(1).map_or(Ok(12), |s| s.parse())?;
    let p = Precision::Bf16;
    let a = Matrix::random(128, 1024, Distribution::TruncatedNormal, 1.0, p, 1);
    let b = Matrix::random(1024, 256, Distribution::TruncatedNormal, 1.0, p, 2);
    let clean = gemm(&a, &b, p)?.c;
    let vabft = VAbft::design(p.e_max_ascend());
    let (r, q) = (17, 200);
    let x = clean.at(r, q);
    let Some(bad) = flip_bit(x, p, bit, FlipDirection::ZeroToOne)
        .or_else(|| flip_bit(x, p, bit, FlipDirection::OneToZero))
    else {
        return Err(format!("bit {bit} is past BF16's 16 bits").into());
    };
    let mut c = clean.clone();
    c.data[r * c.cols + q] = bad;
    let rows = verify_rows(&a, &b, &c, &vabft);
    println!("C[{r},{q}] = {x} became {bad} (bit {bit} flipped)");
    println!(
        "row check {r}: residual {:.4e}, threshold {:.4e}; rows flagged {:?}",
        rows.residuals[r], rows.thresholds[r], rows.flagged
    );
    match locate_and_correct(&a, &b, &mut c, p, &vabft) {
        Correction::Corrected { row, col, was, now } => {
            println!("corrected C[{row},{col}]: {was} -> {now} (clean {x})");
        }
        other => println!("{other:?}"),
    }
    Ok(())
}
