//! Attention reads stored forms tile by tile and never builds an f32 copy
//! of the cache: the bytes a decode call allocates (per-thread scratch,
//! partial states, the output) stay a small fraction of what an f32 copy
//! of the keys and values would take. Counted by a global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use attention::{Attention, HeadShape, Mask};
use kv_quant::{CacheForm, KvStore};

struct Counting;

static BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        BYTES.fetch_add(new_size, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_allocates_far_less_than_an_f32_copy() {
    let shape = HeadShape::new(8, 2, 64).unwrap();
    let (tokens, ch) = (32_768, shape.kv_channels());
    let data: Vec<f32> = (0..tokens * ch)
        .map(|i| ((i % 977) as f32 * 0.01).sin())
        .collect();
    let q: Vec<f32> = (0..shape.q_len()).map(|i| (i as f32 * 0.3).cos()).collect();
    let attn = Attention::new(shape);
    for spelling in ["fp16", "int4", "int4+secded84+interp", "int8"] {
        let form: CacheForm = spelling.parse().unwrap();
        let k = KvStore::quantize(form, &data, tokens, ch).unwrap();
        let v = KvStore::quantize(form, &data, tokens, ch).unwrap();
        attn.decode(&q, tokens - 1, &k, &v, &Mask::Causal).unwrap();
        let before = BYTES.load(Ordering::Relaxed);
        attn.decode(&q, tokens - 1, &k, &v, &Mask::Causal).unwrap();
        let allocated = BYTES.load(Ordering::Relaxed) - before;
        let f32_copy = 2 * tokens * ch * 4;
        assert!(
            allocated * 32 < f32_copy,
            "{spelling}: a decode allocated {allocated} bytes; an f32 copy of K and V is {f32_copy}"
        );
    }
}
