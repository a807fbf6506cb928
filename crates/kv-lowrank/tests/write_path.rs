//! The write path of a calibrated cache: one row at a time through a
//! [`Projector`] gives the same coefficients as a whole store, and projecting
//! does not allocate (a per-thread counting allocator).

use std::sync::Arc;

use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankStore, Projector};
use kv_quant::{CacheForm, RankRule};

#[global_allocator]
static GLOBAL: test_support::CountingAllocator = test_support::CountingAllocator;

#[test]
fn projecting_rows_matches_the_store_and_does_not_allocate() {
    let (tokens, heads, d, r) = (64, 3, 32, 8);
    let rows: Vec<f32> = (0..tokens * heads * d)
        .map(|i| ((i as f32) * 0.173).sin())
        .collect();
    let bases = HeadBases {
        heads: (0..heads)
            .map(|h| {
                let head: Vec<f32> = (0..tokens)
                    .flat_map(|t| rows[(t * heads + h) * d..][..d].to_vec())
                    .collect();
                Arc::new(
                    Basis::fit(&head, tokens, d, RankRule::Fixed(r), BasisStorage::F16)
                        .unwrap()
                        .0,
                )
            })
            .collect(),
    };
    let form: CacheForm = "pca-r8-c8".parse().unwrap();
    let projector = Projector::new(&form, bases.clone(), d).unwrap();
    assert_eq!(projector.coefficients(), heads * r);
    let store = LowRankStore::build(form, &rows, tokens, heads * d, d, Some(&bases)).unwrap();
    let mut coeffs = vec![0.0; heads * r];
    let mut residuals = vec![0.0; heads];
    projector
        .project_into(&rows[..heads * d], &mut coeffs, &mut residuals)
        .unwrap();
    let before = test_support::allocations();
    for row in rows.chunks_exact(heads * d) {
        projector
            .project_into(row, &mut coeffs, &mut residuals)
            .unwrap();
    }
    assert_eq!(test_support::allocations(), before, "projecting allocated");
    // The last row's residuals are within the store's (which also carry
    // the int8 rounding of the coefficients, and are rounded up).
    for (h, &res) in residuals.iter().enumerate() {
        assert!(
            res <= store.residual(tokens - 1, h) + 1e-3,
            "{res} vs {}",
            store.residual(tokens - 1, h)
        );
    }
    assert!(
        projector
            .project_into(&rows[..5], &mut coeffs, &mut residuals)
            .is_err()
    );
    assert!(Projector::new(&"fd-r8".parse().unwrap(), bases, d).is_err());
}
