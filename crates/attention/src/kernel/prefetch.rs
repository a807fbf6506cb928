//! [`Prefetcher`]: the next tile's stored rows requested into L2 while the
//! current tile is worked on.

/// Address ranges of the next tile's stored keys and values (either unknown),
/// to prefetch while the current tile is worked on.
pub(crate) type Upcoming = [Option<std::ops::Range<usize>>; 2];

/// Walks the cache lines of an [`Upcoming`] a few at a time, asking the
/// CPU to bring each into its L2 cache, so that the next tile's rows
/// arrive while this tile's arithmetic runs (the hardware prefetcher alone
/// left the AVX-512 kernel waiting on memory for most of its time at 64K
/// tokens, measured with `perf annotate`).
#[derive(Clone, Debug)]
pub(crate) struct Prefetcher {
    ranges: [std::ops::Range<usize>; 2],
    per_step: usize,
}

impl Prefetcher {
    const LINE: usize = 64;

    /// Spreads the lines of `upcoming` over `steps` calls of [`step`](Self::step).
    pub(crate) fn new(upcoming: Option<&Upcoming>, steps: usize) -> Self {
        let ranges = upcoming.map_or([0..0, 0..0], |[k, v]| {
            [k.clone().unwrap_or(0..0), v.clone().unwrap_or(0..0)]
        });
        let lines: usize = ranges.iter().map(|r| r.len().div_ceil(Self::LINE)).sum();
        Self {
            ranges,
            per_step: lines.div_ceil(steps.max(1)),
        }
    }

    /// Prefetches the next few lines.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        for _ in 0..self.per_step {
            let Some(r) = self.ranges.iter_mut().find(|r| r.start < r.end) else {
                return;
            };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch never faults, whatever the address; nothing is read.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    r.start as *const i8,
                );
            }
            r.start = (r.start + Self::LINE).min(r.end);
        }
    }
}
