//! [`CountingAllocator`]: the system allocator, counting the allocations
//! (and reallocations) each thread makes, for tests that prove a path does
//! not allocate. A test binary installs it as its global allocator:
//!
//! ```
//! #[global_allocator]
//! static GLOBAL: test_support::CountingAllocator = test_support::CountingAllocator;
//!
//! let before = test_support::allocations();
//! let x = [1u8; 16].iter().map(|&b| u32::from(b)).sum::<u32>();
//! assert_eq!(test_support::allocations(), before);
//! let v = vec![x; 4];
//! assert_eq!(test_support::allocations(), before + 1);
//! # drop(v);
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

/// Forwards to [`System`], counting each allocation and reallocation of the
/// calling thread (see [`allocations`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CountingAllocator;

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter is a thread-local cell that never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations and reallocations the calling thread has made through
/// [`CountingAllocator`] (zero when it is not the global allocator).
pub fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}
