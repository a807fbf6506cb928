//! Attention reads stored forms tile by tile and never builds an f32 copy
//! of the cache: the bytes a decode call allocates (per-thread scratch,
//! partial states, the output) stay a small fraction of what an f32 copy
//! of the keys and values would take; and `decode_into` / `prefill_into`
//! with a reused `Workspace` give the same bits as `decode` / `prefill`,
//! refuse buffers of the wrong size, and allocate nothing once the
//! workspace has grown. Counted by a global allocator; the tests take a
//! lock so that none allocates while another counts.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use attention::{Attention, AttentionError, HeadShape, Mask, Numerics, Workspace};
use common::uniform;
use kv_quant::{CacheForm, KvStore};

struct Counting;

/// Bytes and calls allocated so far.
static BYTES: AtomicUsize = AtomicUsize::new(0);
static CALLS: AtomicUsize = AtomicUsize::new(0);
/// Held by each test while it counts.
static SERIAL: Mutex<()> = Mutex::new(());

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        BYTES.fetch_add(new_size, Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_allocates_far_less_than_an_f32_copy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let shape = HeadShape::new(8, 2, 64).unwrap();
    let (tokens, ch) = (32_768, shape.kv_channels());
    let data: Vec<f32> = (0..tokens * ch)
        .map(|i| ((i % 977) as f32 * 0.01).sin())
        .collect();
    let q: Vec<f32> = (0..shape.q_len()).map(|i| (i as f32 * 0.3).cos()).collect();
    for numerics in [Numerics::Auto, Numerics::Exact, Numerics::Int8Query] {
        let mut attn = Attention::new(shape);
        attn.set_numerics(numerics);
        for spelling in ["fp16", "int4", "int4+secded84+interp", "int8"] {
            let form: CacheForm = spelling.parse().unwrap();
            let k = KvStore::quantize(form, &data, tokens, ch).unwrap();
            let v = KvStore::quantize(form, &data, tokens, ch).unwrap();
            // Two threads, as CI has: the scratch grows with the threads.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            let decode = || attn.decode(&q, tokens - 1, &k, &v, &Mask::Causal).unwrap();
            pool.install(decode);
            let before = BYTES.load(Ordering::Relaxed);
            pool.install(decode);
            let allocated = BYTES.load(Ordering::Relaxed) - before;
            // `decode` builds a fresh workspace: each group of work items
            // (two per thread) allocates its tile and kernel scratch, up to
            // 256-row tiles of unpacked levels and the integer path's
            // buffers, and without AVX-512 the f32 key and value tiles the
            // AVX2 kernel reads (1.28 MB in all for fp16 on a Zen 3 host,
            // over the 1 MiB a 32nd of the f32 copy allowed). A 16th of
            // the f32 copy (2 MiB) is half the two INT4 stores' data, so a
            // copy of both stores, or of the f32 rows, still fails.
            let f32_copy = 2 * tokens * ch * 4;
            assert!(
                allocated * 16 < f32_copy,
                "{spelling}, {numerics:?}: a decode allocated {allocated} bytes; an f32 copy of K and V is {f32_copy}"
            );
        }
    }
}

#[test]
fn workspace_calls_equal_the_conveniences_and_reuse_allocates_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let shape = HeadShape::new(9, 3, 64).unwrap();
    let ch = shape.kv_channels();
    let tokens = 5000;
    let (k, v) = (uniform(1, tokens * ch, 1.0), uniform(2, tokens * ch, 1.0));
    let form = "int4+secded84+interp".parse().unwrap();
    let (ks, vs) = (
        KvStore::quantize(form, &k, tokens, ch).unwrap(),
        KvStore::quantize(form, &v, tokens, ch).unwrap(),
    );
    for numerics in [Numerics::Auto, Numerics::Exact, Numerics::Int8Query] {
        let mut attn = Attention::new(shape);
        attn.set_numerics(numerics);
        let mut ws = Workspace::new();
        let (mut out, mut lse) = (vec![0.0; shape.q_len()], vec![0.0; shape.q_heads()]);
        // Decode steps at growing positions, as generation runs them.
        for (step, position) in [tokens - 40, tokens - 20, tokens - 1]
            .into_iter()
            .enumerate()
        {
            let q = uniform(10 + step as u64, shape.q_len(), 1.0);
            let want = attn.decode(&q, position, &ks, &vs, &Mask::Causal).unwrap();
            let before = CALLS.load(Ordering::Relaxed);
            let info = attn
                .decode_into(
                    &q,
                    position,
                    &ks,
                    &vs,
                    &Mask::Causal,
                    &mut out,
                    &mut lse,
                    &mut ws,
                )
                .unwrap();
            let allocations = CALLS.load(Ordering::Relaxed) - before;
            assert_eq!(
                (&out, &lse),
                (&want.out, &want.lse),
                "{numerics:?}, step {step}"
            );
            assert_eq!(info.stats, want.stats);
            if step == 0 {
                // The first call grows the workspace (and shows the counter counts).
                assert!(allocations > 0, "{numerics:?}: a fresh workspace must grow");
            } else {
                assert_eq!(
                    allocations, 0,
                    "{numerics:?}: step {step} allocated {allocations} times"
                );
            }
        }
        // Prefill of 20 queries (two blocks) into the same workspace.
        let positions: Vec<usize> = (0..20).map(|i| 100 * i + 7).collect();
        let q = uniform(50, positions.len() * shape.q_len(), 1.0);
        let want = attn
            .prefill(&q, &positions, &ks, &vs, &Mask::Causal)
            .unwrap();
        let (mut out, mut lse) = (vec![0.0; want.out.len()], vec![0.0; want.lse.len()]);
        let info = attn
            .prefill_into(
                &q,
                &positions,
                &ks,
                &vs,
                &Mask::Causal,
                &mut out,
                &mut lse,
                &mut ws,
            )
            .unwrap();
        assert_eq!((out, lse, info.stats), (want.out, want.lse, want.stats));
    }
    // Output buffers of the wrong size are refused.
    let attn = Attention::new(shape);
    let mut ws = Workspace::new();
    let q = uniform(3, shape.q_len(), 1.0);
    let (mut out, mut lse) = (vec![0.0; shape.q_len() - 1], vec![0.0; shape.q_heads()]);
    let err = attn
        .decode_into(&q, 10, &ks, &vs, &Mask::Causal, &mut out, &mut lse, &mut ws)
        .unwrap_err();
    assert!(matches!(err, AttentionError::ShapeMismatch { .. }), "{err}");
    let (mut out, mut lse) = (vec![0.0; shape.q_len()], vec![0.0; 2]);
    let err = attn
        .decode_into(&q, 10, &ks, &vs, &Mask::Causal, &mut out, &mut lse, &mut ws)
        .unwrap_err();
    assert!(matches!(err, AttentionError::ShapeMismatch { .. }), "{err}");
}
