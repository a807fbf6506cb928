//! The `_into` calls of the batch codecs do not allocate, on every backend
//! this CPU has (a per-thread counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use gf2_codes::Int4Code;
use gf2_codes::batch::{Backend, Int4Codec, erasure_words};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn encode_into_and_decode_into_do_not_allocate() {
    let n = 4099;
    let values: Vec<u8> = (0..n).map(|i| (i * 7 % 16) as u8).collect();
    let backends = Backend::available();
    for code in Int4Code::ALL {
        let codec: &dyn Int4Codec = code.codec();
        let mut encoded = vec![0u8; codec.encoded_len(n)];
        let mut decoded = vec![0u8; n];
        let mut erasures = vec![0u64; erasure_words(n)];
        // Warm up (tables are built once, lazily).
        codec.encode_into(&values, &mut encoded).unwrap();
        for &b in &backends {
            codec
                .decode_into_with(b, &encoded, &mut decoded, &mut erasures)
                .unwrap();
            codec
                .decode_with_truth_into_with(b, &encoded, &values, &mut decoded, &mut erasures)
                .unwrap();
        }
        encoded[10] ^= 0b101;
        let before = ALLOCATIONS.with(Cell::get);
        codec.encode_into(&values, &mut encoded).unwrap();
        encoded[10] ^= 0b1;
        for &b in &backends {
            codec
                .decode_into_with(b, &encoded, &mut decoded, &mut erasures)
                .unwrap();
            codec
                .decode_with_truth_into_with(b, &encoded, &values, &mut decoded, &mut erasures)
                .unwrap();
        }
        codec.scrub(&mut encoded, n).unwrap();
        assert_eq!(ALLOCATIONS.with(Cell::get), before, "{code}");
        assert_eq!(decoded, values, "{code}");
    }
}
