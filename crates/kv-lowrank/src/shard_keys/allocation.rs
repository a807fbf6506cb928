//! Shard's bit allocation (`shard-kv-compression-blog.md`, section 5): a
//! dynamic program that gives each group of principal components 0, 2, 4,
//! 6 or 8 bits under a budget, dropping a component costing four times its
//! variance.

use crate::error::{LowRankError, Result, check_len};

/// Bit widths a group of components can get.
pub const BIT_OPTIONS: [u8; 5] = [0, 2, 4, 6, 8];

/// Multiplier of a dropped group's variance in the allocation's error (the
/// blog's `DROP_PENALTY`: dropping a direction is worse than quantizing it).
pub const DROP_PENALTY: f64 = 4.0;

/// The error the allocation charges a group of total variance `variance`
/// at `bits` bits: `4·v` when dropped, the uniform quantizer's `v/(3·4^b)`
/// otherwise (section 5's one line).
pub fn allocation_error(variance: f64, bits: u8) -> f64 {
    if bits == 0 {
        variance * DROP_PENALTY
    } else {
        variance / (3.0 * f64::from(1u32 << (2 * u32::from(bits))))
    }
}

/// Bits per group (one of [`BIT_OPTIONS`]) minimising the summed
/// [`allocation_error`] with at most `budget` code bits per token, the
/// groups holding `sizes[g]` components of total variance `variances[g]`.
/// Exact (a dynamic program over the budget in steps of 2 bits per
/// component); ties go to fewer bits.
pub fn allocate_bits(variances: &[f64], sizes: &[usize], budget: usize) -> Result<Vec<u8>> {
    check_len("group sizes", variances.len(), sizes.len())?;
    if let Some(g) = variances.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
        return Err(LowRankError::InvalidParameter {
            name: "group variance",
            reason: format!("group {g} has variance {}", variances[g]),
        });
    }
    // Every cost is a multiple of 2 bits per component.
    let unit = 2;
    let units = budget / unit;
    let n = variances.len();
    // best[g][u]: least error of groups g.. with u units left.
    let mut best = vec![vec![0.0f64; units + 1]; n + 1];
    let mut choice = vec![vec![0u8; units + 1]; n];
    for g in (0..n).rev() {
        for u in 0..=units {
            let mut least = f64::INFINITY;
            for &b in &BIT_OPTIONS {
                let cost = usize::from(b) / unit * sizes[g];
                if cost > u {
                    break;
                }
                let e = allocation_error(variances[g], b) + best[g + 1][u - cost];
                if e < least {
                    least = e;
                    choice[g][u] = b;
                }
            }
            best[g][u] = least;
        }
    }
    let mut bits = Vec::with_capacity(n);
    let mut u = units;
    for row in &choice {
        let b = row[u];
        u -= usize::from(b) / unit * sizes[bits.len()];
        bits.push(b);
    }
    Ok(bits)
}
