//! [`TileGrid`]: where attention cuts a source's rows into tiles, and
//! decode's key chunks into pieces for threads.
//!
//! Cuts fall at multiples of the tile size from row 0, as they always
//! have, unless a source names a [`tile_origin`](crate::KvSource::tile_origin):
//! then at multiples of the size up to the origin, and at the origin plus
//! multiples of the size after it. A paged part whose per-channel groups
//! of several blocks start after exact sink blocks names its sink rows,
//! so every tile past them is one whole group, read as stored, instead of
//! a block at a time.

use std::ops::Range;

/// Tile cuts: every `size` rows from 0 up to `origin`, then every `size`
/// rows from `origin` (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileGrid {
    size: usize,
    origin: usize,
}

impl TileGrid {
    /// Cuts every `size` rows (at least 1), shifted after `origin`.
    pub(crate) fn new(size: usize, origin: usize) -> Self {
        Self {
            size: size.max(1),
            origin,
        }
    }

    /// The same origin with cuts every `size` rows (decode's chunks: a
    /// multiple of the tile size, so every chunk cut is a tile cut).
    pub(crate) fn with_size(self, size: usize) -> Self {
        Self::new(size, self.origin)
    }

    /// The last cut at or before row `t`.
    pub(crate) fn floor(self, t: usize) -> usize {
        if t < self.origin {
            t / self.size * self.size
        } else {
            self.origin + (t - self.origin) / self.size * self.size
        }
    }

    /// The first cut after row `t`.
    pub(crate) fn next(self, t: usize) -> usize {
        if t < self.origin {
            (t / self.size + 1)
                .saturating_mul(self.size)
                .min(self.origin)
        } else {
            ((t - self.origin) / self.size + 1)
                .saturating_mul(self.size)
                .saturating_add(self.origin)
        }
    }

    /// The first cut at or after row `t`.
    pub(crate) fn ceil(self, t: usize) -> usize {
        if self.floor(t) == t { t } else { self.next(t) }
    }

    /// The cut-aligned rows covering `range`, clipped to `tokens`.
    pub(crate) fn span(self, range: &Range<usize>, tokens: usize) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        self.floor(range.start)..self.ceil(range.end).min(tokens)
    }

    /// `span` cut at this grid's cuts, the first and last piece cut to
    /// the span.
    pub(crate) fn pieces(self, span: &Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        let mut at = self.floor(span.start);
        std::iter::from_fn(move || {
            if at >= span.end || span.is_empty() {
                return None;
            }
            let end = self.next(at);
            let piece = at.max(span.start)..end.min(span.end);
            at = end;
            Some(piece)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece of every span lies between two adjacent cuts, the
    /// pieces partition the span, and without an origin the cuts are the
    /// multiples of the size (the grid attention always used).
    #[test]
    fn pieces_partition_spans_between_adjacent_cuts() {
        for size in [1, 3, 16, 64] {
            for origin in [0, 1, 16, 48, 100] {
                let grid = TileGrid::new(size, origin);
                let is_cut = |t: usize| {
                    if t <= origin {
                        t.is_multiple_of(size) || t == origin
                    } else {
                        (t - origin).is_multiple_of(size)
                    }
                };
                for start in 0..200 {
                    assert!(is_cut(grid.floor(start)) && grid.floor(start) <= start);
                    assert!(is_cut(grid.next(start)) && grid.next(start) > start);
                    assert!((start + 1..grid.next(start)).all(|t| !is_cut(t)));
                    for end in start..200 {
                        let span = start..end;
                        let pieces: Vec<_> = grid.pieces(&span).collect();
                        let mut at = start;
                        for p in &pieces {
                            assert_eq!(p.start, at, "{size} {origin} {span:?}");
                            assert!(
                                p.end > p.start && p.end - p.start <= size,
                                "{size} {origin} {span:?} {p:?}"
                            );
                            assert_eq!(grid.next(p.start).min(end), p.end);
                            at = p.end;
                        }
                        assert_eq!(at, end.max(start));
                        let covered = grid.span(&span, 150);
                        if !span.is_empty() {
                            assert!(covered.start <= start && is_cut(covered.start));
                            assert!(covered.end >= end.min(150));
                        }
                    }
                }
                if origin == 0 {
                    assert_eq!(grid.floor(70), 70 / size * size);
                    assert_eq!(grid.next(70), (70 / size + 1) * size);
                }
            }
        }
    }

    #[test]
    fn a_coarser_grid_cuts_only_at_tile_cuts() {
        let (tiles, chunks) = (TileGrid::new(64, 16), TileGrid::new(64, 16).with_size(2048));
        let span = 0..10_000;
        for piece in chunks.pieces(&span) {
            assert_eq!(tiles.floor(piece.start), piece.start);
        }
        assert_eq!(chunks.pieces(&span).next(), Some(0..16));
        assert_eq!(chunks.pieces(&span).nth(1), Some(16..2064));
    }
}
