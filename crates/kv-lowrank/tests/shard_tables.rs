//! `ShardKeys::tables` and `ShardKeys::from_tables`: the tables a
//! calibration keeps and writes (the kept basis, the allocation, the
//! groups) rebuilt from the full basis and the allocation alone code every
//! chunk as the fitted store does, and tables that do not fit together are
//! refused.

use kv_lowrank::{Basis, BasisStorage, LowRankError, ShardKeys};
use kv_quant::RankRule;

/// Keys near a rank-6 subspace of 16 channels, plus a little noise.
fn keys(tokens: usize) -> Vec<f32> {
    (0..tokens * 16)
        .map(|i| {
            let (t, c) = ((i / 16) as f32, (i % 16) as f32);
            (0..6)
                .map(|k| {
                    ((k as f32 + 1.0) * 0.13 * t + c * 0.7 * k as f32).sin() / (k as f32 + 1.0)
                })
                .sum::<f32>()
                + 0.01 * ((i * 7919 % 101) as f32 / 101.0 - 0.5)
        })
        .collect()
}

#[test]
fn tables_rebuilt_from_the_allocation_code_chunks_as_the_fitted_store() {
    let rows = keys(400);
    let (full, _) = Basis::fit(&rows, 400, 16, RankRule::Fixed(12), BasisStorage::Int8).unwrap();
    let fitted = ShardKeys::with_basis(&rows, 400, &full, 3.0, 4).unwrap();
    let tables = fitted.tables();
    assert_eq!((tables.tokens(), tables.codes().len()), (0, 0));
    assert!(tables.spectrum().eigenvalues.is_empty());
    let rebuilt = ShardKeys::from_tables(&full, fitted.allocation().to_vec(), 4).unwrap();
    assert_eq!(rebuilt, tables);
    assert_eq!(rebuilt.shared_bytes(), fitted.shared_bytes());
    let chunk = &rows[64 * 16..128 * 16];
    let (got, want) = (
        rebuilt.encode_chunk(chunk, 64).unwrap(),
        fitted.encode_chunk(chunk, 64).unwrap(),
    );
    assert_eq!(got, tables.encode_chunk(chunk, 64).unwrap());
    assert_eq!(
        (got.codes(), got.scales(), got.basis(), got.groups()),
        (want.codes(), want.scales(), want.basis(), want.groups())
    );
}

#[test]
fn tables_that_do_not_fit_together_are_refused() {
    let rows = keys(200);
    let (full, _) = Basis::fit(&rows, 200, 16, RankRule::Fixed(12), BasisStorage::Int8).unwrap();
    for (allocation, group) in [
        (vec![4, 2], 4),       // two groups' bits for three groups
        (vec![4, 2, 0, 0], 4), // four
        (vec![4, 3, 0], 4),    // odd bits
        (vec![4, 9, 0], 4),    // more than 8
        (vec![4, 2, 0], 6),    // a group not a multiple of 4
        (vec![4], 0),
    ] {
        let e = ShardKeys::from_tables(&full, allocation.clone(), group).unwrap_err();
        assert!(
            matches!(e, LowRankError::InvalidParameter { .. }),
            "{allocation:?} in groups of {group}: {e}"
        );
    }
}

/// `fit_tables` is `fit(..).tables()` without coding the rows, refusals
/// included.
#[test]
fn tables_fitted_without_coding_are_the_fitted_stores_tables() {
    let rows = keys(300);
    for (budget, group, rank) in [(3.0, 4, None), (2.0, 8, Some(8)), (4.5, 4, Some(12))] {
        let fitted = ShardKeys::fit(&rows, 300, 16, budget, group, rank).unwrap();
        let tables = ShardKeys::fit_tables(&rows, 300, 16, budget, group, rank).unwrap();
        assert_eq!(tables, fitted.tables(), "{budget} {group} {rank:?}");
    }
    for (tokens, dim, budget, group, rank) in [
        (300, 16, 3.0, 4, Some(20)),
        (300, 16, 9.0, 4, None),
        (300, 16, 3.0, 6, None),
        (1, 16, 3.0, 4, None),
        // Past the shared checks: the allocation's own refusal.
        (300, 16, 0.1, 4, None),
    ] {
        let rows = &rows[..tokens * dim];
        let a = ShardKeys::fit(rows, tokens, dim, budget, group, rank).unwrap_err();
        let b = ShardKeys::fit_tables(rows, tokens, dim, budget, group, rank).unwrap_err();
        assert_eq!(a.to_string(), b.to_string());
    }
}

/// Keys with no variance (every row the same) fit a store that keeps no
/// component: every key is the mean, coded in no bits.
#[test]
fn constant_keys_fit_a_store_of_no_components() {
    let row: Vec<f32> = (0..16).map(|c| c as f32 * 0.25 - 1.0).collect();
    let rows: Vec<f32> = row.iter().copied().cycle().take(64 * 16).collect();
    let fitted = ShardKeys::fit(&rows, 64, 16, 3.0, 4, None).unwrap();
    let mut out = vec![0.0; 16];
    fitted.reconstruct_into(5, &mut out).unwrap();
    for (a, b) in out.iter().zip(&row) {
        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{out:?} {row:?}");
    }
    assert_eq!(
        ShardKeys::fit_tables(&rows, 64, 16, 3.0, 4, None).unwrap(),
        fitted.tables()
    );
}
