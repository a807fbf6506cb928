//! [`Prefetcher`]: the next tile's stored rows requested into L2 while the
//! current tile is worked on: its keys while this tile's keys are scored,
//! its values while this tile's values are summed ([`NextTile`]), on every
//! instruction set (the float passes are one body).

use std::ops::Range;

/// Address ranges of one side (keys or values) of the next tile's stored
/// rows, to prefetch while the current tile is worked on: one per run of
/// contiguous rows (a
/// contiguous store's tile is one run, a paged tile one per page; a range
/// that starts where the last one ends extends it), at most
/// [`Upcoming::MAX`] (the rest are not prefetched; a prefetch is a hint).
#[derive(Clone, Debug)]
pub(crate) struct Upcoming {
    ranges: [Range<usize>; Self::MAX],
    len: usize,
}

impl Default for Upcoming {
    fn default() -> Self {
        Self {
            ranges: std::array::from_fn(|_| 0..0),
            len: 0,
        }
    }
}

impl Upcoming {
    /// Ranges held: a 256-row tile over pages of 4 rows, or of 8 rows
    /// read in two planes (a hierarchical source's upper and residual).
    pub(crate) const MAX: usize = 64;

    /// Adds a range: extends the last one when it starts where that one
    /// ends, and is dropped once [`MAX`](Self::MAX) are held.
    pub(crate) fn push(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        if let Some(last) = self.ranges[..self.len].last_mut()
            && last.end == range.start
        {
            last.end = range.end;
        } else if self.len < Self::MAX {
            self.ranges[self.len] = range;
            self.len += 1;
        }
    }

    /// The ranges pushed.
    fn ranges(&self) -> &[Range<usize>] {
        &self.ranges[..self.len]
    }
}

/// The next tile's stored keys and values, apart: each pass of a tile
/// requests the next tile's rows of its own side, so that memory is read
/// through both passes. Requested all during the score pass, the next
/// tile's lines queued behind each other there (the instruction after the
/// prefetch held half the score pass's samples, `perf annotate`) and none
/// were read while values were summed: FP16 at 32/8/128 over 64K tokens
/// took 19.0-20.6 ms that way and 14.5-15.3 ms with the values' lines
/// requested in the value pass (`decode_timing`, builds alternated).
#[derive(Clone, Debug, Default)]
pub(crate) struct NextTile {
    /// The next tile's key rows.
    pub(crate) keys: Upcoming,
    /// The next tile's value rows.
    pub(crate) values: Upcoming,
}

/// Walks the cache lines of an [`Upcoming`] a few at a time, asking the
/// CPU to bring each into its L2 cache, so that the next tile's rows
/// arrive while this tile's arithmetic runs (the hardware prefetcher alone
/// left the AVX-512 kernel waiting on memory for most of its time at 64K
/// tokens, measured with `perf annotate`).
#[derive(Clone, Debug)]
pub(crate) struct Prefetcher {
    upcoming: Upcoming,
    /// The range being walked.
    at: usize,
    per_step: usize,
}

impl Prefetcher {
    const LINE: usize = 64;

    /// Spreads the lines of `upcoming` over `steps` calls of
    /// [`step`](Self::step) (an estimate: a pass that steps less
    /// [`finish`](Self::finish)es).
    pub(crate) fn new(upcoming: Option<&Upcoming>, steps: usize) -> Self {
        let upcoming = upcoming.cloned().unwrap_or_default();
        let lines: usize = upcoming
            .ranges()
            .iter()
            .map(|r| r.len().div_ceil(Self::LINE))
            .sum();
        Self {
            upcoming,
            at: 0,
            per_step: lines.div_ceil(steps.max(1)),
        }
    }

    /// Prefetches every line not requested yet: the end of a pass whose
    /// steps fell short of the count it was made for.
    pub(crate) fn finish(&mut self) {
        while self.at < self.upcoming.len {
            self.step();
        }
    }

    /// Prefetches the next few lines.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        for _ in 0..self.per_step {
            let Some(r) = self.upcoming.ranges[..self.upcoming.len].get_mut(self.at) else {
                return;
            };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch never faults, whatever the address; nothing is read.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    r.start as *const i8,
                );
            }
            #[cfg(test)]
            issued::note(r.start);
            r.start = (r.start + Self::LINE).min(r.end);
            if r.start == r.end {
                self.at += 1;
            }
        }
    }
}

/// The lines the prefetchers of this thread request while a closure runs
/// (tests only: which lines each kernel path asks for).
#[cfg(test)]
pub(crate) mod issued {
    use std::cell::RefCell;

    thread_local! {
        static LINES: RefCell<Option<Vec<usize>>> = const { RefCell::new(None) };
    }

    /// Records the line `address` when a [`record`] is running.
    pub(super) fn note(address: usize) {
        LINES.with(|l| {
            if let Some(lines) = l.borrow_mut().as_mut() {
                lines.push(address);
            }
        });
    }

    /// Runs `f`, returning its result and the lines requested meanwhile,
    /// in order.
    pub(crate) fn record<R>(f: impl FnOnce() -> R) -> (R, Vec<usize>) {
        LINES.with(|l| *l.borrow_mut() = Some(Vec::new()));
        let out = f();
        let lines = LINES.with(|l| l.borrow_mut().take()).unwrap_or_default();
        (out, lines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of every range is visited once, in order, over the steps;
    /// ranges past `MAX` and empty ones are dropped.
    #[test]
    fn lines_of_every_range_are_walked_in_order() {
        let mut upcoming = Upcoming::default();
        upcoming.push(0..100);
        upcoming.push(100..130);
        upcoming.push(5..5);
        upcoming.push(1000..1064);
        assert_eq!(
            upcoming.ranges(),
            &[0..130, 1000..1064],
            "adjacent ranges merge"
        );
        let mut p = Prefetcher::new(Some(&upcoming), 2);
        assert_eq!(p.per_step, 2);
        p.step();
        assert_eq!((p.at, p.upcoming.ranges[0].start), (0, 128));
        p.step();
        assert_eq!(p.at, 2, "the last line of the first range, then the second");
        p.step();
        for i in 0..80 {
            upcoming.push(i * 64..i * 64 + 1);
        }
        assert_eq!(upcoming.ranges().len(), Upcoming::MAX);
    }

    /// A pass that steps fewer times than it was made for requests the
    /// rest at its end; one with nothing to fetch finishes at once.
    #[test]
    fn finish_requests_the_lines_the_steps_left() {
        let mut upcoming = Upcoming::default();
        upcoming.push(0..640);
        upcoming.push(4096..4160);
        let mut p = Prefetcher::new(Some(&upcoming), 100);
        assert_eq!(p.per_step, 1);
        p.step();
        assert_eq!((p.at, p.upcoming.ranges[0].start), (0, 64));
        p.finish();
        assert_eq!(p.at, 2, "every range walked");
        let mut none = Prefetcher::new(None, 10);
        none.finish();
        assert_eq!(none.at, 0);
    }
}
