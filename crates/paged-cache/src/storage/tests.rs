//! Unit tests of [`BlockStorage`](super::BlockStorage): refusals, NaN
//! policies and pool sizing.

use super::*;

#[test]
fn shared_scale_forms_and_bad_rows_are_refused() {
    let spec = |s: &str| LayerSpec::uniform(s.parse().unwrap(), 8);
    assert!(matches!(
        BlockStorage::new(2, 4, &[spec("fp8-e4m3")]),
        Err(PagedCacheError::InvalidParameter { name: "form", .. })
    ));
    assert!(BlockStorage::new(2, 4, &[]).is_err());
    for refused in ["int4-ch6", "fp8-e4m3", "vq", "pca-r4", "shard"] {
        assert!(
            matches!(
                BlockStorage::new(2, 4, &[spec(refused)]),
                Err(PagedCacheError::InvalidParameter { name: "form", .. })
            ),
            "{refused}"
        );
    }
    let storage = BlockStorage::new(2, 4, &[spec("int4+secded84")]).unwrap();
    let row = [0.25f32; 8];
    assert!(matches!(
        storage.write(BlockId(0), 0, 0, &row[..7], &row),
        Err(PagedCacheError::ShapeMismatch { .. })
    ));
    assert!(storage.write(BlockId(0), 4, 0, &row, &row).is_err());
    assert!(storage.write(BlockId(2), 0, 0, &row, &row).is_err());
    assert!(storage.write(BlockId(0), 0, 1, &row, &row).is_err());
    // A NaN value row leaves the key row untouched too.
    let before = storage.snapshot(BlockId(0)).unwrap();
    let mut bad = row;
    bad[3] = f32::NAN;
    assert!(matches!(
        storage.write(BlockId(0), 1, 0, &row, &bad),
        Err(PagedCacheError::Quant(_))
    ));
    assert_eq!(storage.snapshot(BlockId(0)).unwrap(), before);
    storage.write(BlockId(0), 1, 0, &row, &row).unwrap();
    let mut out = [0.0; 8];
    storage
        .read(
            BlockId(0),
            0,
            KvPart::Values,
            1,
            &mut out,
            &mut DecodeScratch::new(),
        )
        .unwrap();
    assert!(out.iter().all(|&x| (x - 0.25).abs() < 1e-6), "{out:?}");
}

/// `pool_bytes` is what `new` holds: the stores' bytes plus the
/// transient f32 matrix of one store.
#[test]
fn pool_bytes_count_what_new_allocates() {
    let layers = [
        LayerSpec::uniform("int4+secded84".parse().unwrap(), 64),
        LayerSpec {
            key: "int4-ch+sink4".parse().unwrap(),
            value: "lm4".parse().unwrap(),
            channels: 64,
        },
    ];
    let (blocks, bs) = (10, 16);
    let storage = BlockStorage::new(blocks, bs, &layers).unwrap();
    let stores: usize = (0..2)
        .map(|l| storage.layer_block_bytes(l).unwrap() * blocks)
        .sum();
    let want = stores as u64 + (blocks * bs * 64 * 4) as u64;
    assert_eq!(BlockStorage::pool_bytes(blocks, bs, &layers).unwrap(), want);
    let shard = [LayerSpec::uniform("shard".parse().unwrap(), 64)];
    assert!(BlockStorage::pool_bytes(blocks, bs, &shard).is_err());
}

/// Under `NonFinite::Keep` a NaN row is stored as its form stores
/// numbers (fp16 keys keep it, int4 values and staged-then-sealed
/// per-channel keys saturate) and counted; `Reject` stays the default.
#[test]
fn kept_non_finite_rows_are_stored_and_counted() {
    let layers = [
        LayerSpec {
            key: "fp16".parse().unwrap(),
            value: "int4".parse().unwrap(),
            channels: 8,
        },
        LayerSpec::uniform("int4-ch".parse().unwrap(), 8),
    ];
    let storage = BlockStorage::new(2, 4, &layers).unwrap();
    let mut bad = [0.25f32; 8];
    bad[3] = f32::NAN;
    bad[5] = f32::INFINITY;
    assert!(storage.write(BlockId(0), 0, 0, &bad, &bad).is_err());
    storage.set_non_finite(NonFinite::Keep);
    for t in 0..4 {
        for layer in 0..2 {
            storage.write(BlockId(0), t, layer, &bad, &bad).unwrap();
        }
    }
    assert_eq!(storage.non_finite_written(), 4 * 2 * 2 * 2);
    let read = |layer, part| {
        let mut out = [0.0; 8];
        storage
            .read(
                BlockId(0),
                layer,
                part,
                2,
                &mut out,
                &mut DecodeScratch::new(),
            )
            .unwrap();
        out
    };
    let keys = read(0, KvPart::Keys);
    assert!(keys[3].is_nan() && keys[5] == f32::INFINITY, "{keys:?}");
    assert!(read(0, KvPart::Values).iter().all(|x| x.is_finite()));
    // Staged per-channel rows are exact (kept), sealed ones saturated.
    assert!(read(1, KvPart::Keys)[3].is_nan());
    storage
        .seal_blocks(&[BlockId(0)], 0, 4, &mut crate::SeqTables::default())
        .unwrap();
    assert!(read(1, KvPart::Keys).iter().all(|x| x.is_finite()));
}
