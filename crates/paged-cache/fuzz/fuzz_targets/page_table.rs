//! Fuzzes page tables, a plain struct a caller fills: any fields give a
//! typed error or a correct read through validation, a paged source and
//! paged decode, without panicking or reading past the pool. Run with
//! `cargo +nightly fuzz run page_table` from `crates/paged-cache`.

#![no_main]

use std::sync::OnceLock;

use attention::{Attention, HeadShape, KvSource};
use kv_quant::CacheForm;
use libfuzzer_sys::fuzz_target;
use paged_cache::{BlockStorage, KvPart, LayerSpec, PageTable, PagedKv, paged_decode};

const BLOCKS: usize = 8;
const BLOCK_SIZE: usize = 4;

fn storage() -> &'static BlockStorage {
    static STORAGE: OnceLock<BlockStorage> = OnceLock::new();
    STORAGE.get_or_init(|| {
        let form: CacheForm = "int4+secded84".parse().expect("a form");
        BlockStorage::new(BLOCKS, BLOCK_SIZE, &[LayerSpec::uniform(form, 16)]).expect("storage")
    })
}

fuzz_target!(|input: (Vec<u32>, Vec<u32>, Vec<u32>, u8, u8)| {
    let (indptr, indices, last_page_len, block_size, seq) = input;
    if indptr.len() > 64 || indices.len() > 256 || last_page_len.len() > 64 {
        return;
    }
    let storage = storage();
    // Small values most of the time, so valid tables are common; the top
    // bit keeps any u32 reachable.
    let small = |v: Vec<u32>, m: u32| -> Vec<u32> {
        v.into_iter()
            .map(|x| if x >> 31 == 1 { x } else { x % m })
            .collect()
    };
    let table = PageTable {
        indptr: small(indptr, 16),
        indices: small(indices, BLOCKS as u32 + 2),
        last_page_len: small(last_page_len, BLOCK_SIZE as u32 + 2),
        block_size: usize::from(block_size % 8),
    };
    let _ = table.validate(storage.num_blocks());
    let seq = usize::from(seq % 8);
    let _ = table.check_sequence(seq);
    if let Ok(kv) = PagedKv::new(storage, &table, seq, 0, KvPart::Keys) {
        assert!(kv.tokens() <= table.indices.len() * BLOCK_SIZE);
    }
    let attn = Attention::new(HeadShape::new(2, 1, 16).expect("a shape"));
    if table.sequences() <= 64 {
        let q = vec![0.5; 32 * table.sequences()];
        let _ = paged_decode(&attn, storage, &table, 0, &q);
    }
});
