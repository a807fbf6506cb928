//! Writing a token's K and V rows into its block allocates nothing once the
//! storage's encoders are warm: through [`BlockStorage::write`] and through
//! a [`PagedBackend`] step's appends for every layer (counted by a
//! per-thread counting allocator).

use attention::{HeadShape, KvBackend, ModelKvShape};
use paged_cache::{BlockId, BlockStorage, LayerSpec, PagedBackend};

use test_support::allocations;

#[global_allocator]
static GLOBAL: test_support::CountingAllocator = test_support::CountingAllocator;

const FORMS: [&str; 6] = [
    "int4+secded84",
    "int4",
    "int8",
    "fp16",
    "int4-g32+golay24+interp",
    "fp8-e4m3-tok",
];

#[test]
fn block_writes_do_not_allocate_once_warm() {
    let channels = 192;
    let row: Vec<f32> = (0..channels).map(|i| (i as f32 * 0.3).sin()).collect();
    for form in FORMS {
        let spec = LayerSpec::uniform(form.parse().unwrap(), channels);
        let storage = BlockStorage::new(4, 16, &[spec, spec]).unwrap();
        storage.write(BlockId(0), 0, 0, &row, &row).unwrap();
        storage.write(BlockId(0), 0, 1, &row, &row).unwrap();
        let before = allocations();
        for slot in 0..16usize {
            for layer in 0..2 {
                storage
                    .write(BlockId(slot as u32 % 4), slot, layer, &row, &row)
                    .unwrap();
            }
        }
        assert_eq!(allocations(), before, "{form}");
    }
}

#[test]
fn a_steps_appends_for_every_layer_do_not_allocate() {
    let (layers, heads) = (30, HeadShape::new(9, 3, 64).unwrap());
    let channels = heads.kv_channels();
    let spec = LayerSpec::uniform("int4+secded84".parse().unwrap(), channels);
    let mut backend = PagedBackend::new(&vec![spec; layers], 16, 8).unwrap();
    backend
        .fit(&ModelKvShape {
            layers,
            heads,
            rope: None,
        })
        .unwrap();
    let row: Vec<f32> = (0..channels).map(|i| (i as f32 * 0.7).cos()).collect();
    for step in 0..40 {
        backend.begin(&[step]).unwrap();
        let before = allocations();
        for layer in 0..layers {
            backend.append(layer, &row, &row).unwrap();
        }
        if step > 0 {
            assert_eq!(allocations(), before, "step {step}");
        }
        backend.commit().unwrap();
    }
}
