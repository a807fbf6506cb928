//! The full basis a Shard key store is fitted on: [`fit_basis`], the
//! checks [`ShardKeys::fit`](super::ShardKeys::fit) and
//! [`ShardKeys::fit_tables`](super::ShardKeys::fit_tables) share, then a
//! PCA of the rows.

use kv_quant::RankRule;

use crate::basis::{Basis, BasisStorage};
use crate::error::{LowRankError, Result, check_finite, check_len};

/// The full basis [`ShardKeys::fit`] allocates over: its checks, then a
/// PCA of `rows` over the first `rank` components (at most `tokens − 1`,
/// in whole groups of 4).
pub(super) fn fit_basis(
    rows: &[f32],
    tokens: usize,
    dim: usize,
    budget: f64,
    group: usize,
    rank: Option<usize>,
) -> Result<Basis> {
    check_len("key rows (tokens × dim)", tokens * dim, rows.len())?;
    check_finite(rows, dim)?;
    if dim == 0 || !dim.is_multiple_of(4) {
        return Err(LowRankError::InvalidParameter {
            name: "key dimension",
            reason: format!("{dim} key channels are not a positive multiple of 4"),
        });
    }
    if group == 0 || !group.is_multiple_of(4) {
        return Err(LowRankError::InvalidParameter {
            name: "group",
            reason: format!("{group} components per group are not a positive multiple of 4"),
        });
    }
    let considered = rank.unwrap_or(dim);
    if considered > dim {
        return Err(LowRankError::InvalidParameter {
            name: "rank",
            reason: format!("a rank of {considered} is above the key dimension {dim}"),
        });
    }
    if !(budget.is_finite() && budget > 0.0 && budget <= 8.0) {
        return Err(LowRankError::InvalidParameter {
            name: "key budget",
            reason: format!("{budget} bits per value cannot be met (more than 0, at most 8)"),
        });
    }
    // PCA needs more rows than components.
    let considered = considered.min(tokens.saturating_sub(1) / 4 * 4);
    if considered == 0 {
        return Err(LowRankError::TooFewRows {
            rows: tokens,
            rank: 4,
        });
    }
    let (full, _) = Basis::fit(
        rows,
        tokens,
        dim,
        RankRule::Fixed(considered),
        BasisStorage::Int8,
    )?;
    Ok(full)
}
