//! Groups of blocks sealed together (per-channel groups over several
//! blocks: attention's `GroupedPart`), as the cache sees them through
//! [`BlockStorage`]: which prefixes may be shared, which blocks a write or
//! a cut stages again, and staging them again. The manager keeps a
//! group's blocks held by one set of sequences, so that no block is ever
//! sealed into two groups.

use std::ops::Range;

use attention::stored::StoredPart;

use super::{BlockStorage, read, write};
use crate::error::Result;
use crate::pool::BlockId;

impl BlockStorage {
    /// Of a sequence's first `blocks` whole blocks, how many lead a prefix
    /// another sequence may share in every layer part
    /// ([`StoredPart::shareable_blocks`]: per-channel groups over several
    /// blocks are shared whole), taken until every part agrees (parts
    /// whose groups do not line up cut each other back).
    pub fn shareable_blocks(&self, blocks: usize) -> usize {
        if !self.grouped {
            return blocks;
        }
        self.agreed(blocks, |p, n| p.shareable_blocks(n))
    }

    /// Of the blocks a prefix cache found for a prompt (`hit`, matched by
    /// their tokens), how many lead a prefix a new sequence may take in
    /// every layer part ([`StoredPart::shareable_hit`]: the groups of
    /// several blocks whose blocks were all sealed together).
    pub fn shareable_hit(&self, hit: &[BlockId]) -> usize {
        if !self.grouped {
            return hit.len();
        }
        let pages: Vec<u32> = hit.iter().map(|b| b.0).collect();
        self.agreed(hit.len(), |p, n| p.shareable_hit(&pages[..n]))
    }

    /// The largest `n ≤ blocks` that `keep(part, n)` leaves as it is for
    /// every layer part (each `keep(part, n) ≤ n`).
    fn agreed(&self, blocks: usize, keep: impl Fn(&dyn StoredPart, usize) -> usize) -> usize {
        let mut n = blocks;
        loop {
            let m = self
                .parts
                .iter()
                .flatten()
                .map(|p| keep(read(p).as_ref(), n).min(n))
                .min()
                .unwrap_or(n);
            if m == n {
                return n;
            }
            n = m;
        }
    }

    /// The block-table positions sealed together with position `index` in
    /// some layer part ([`StoredPart::sealed_with`]: a per-channel group
    /// over several blocks), whether or not they are sealed now.
    pub fn group_with(&self, index: usize) -> Range<usize> {
        if !self.grouped {
            return index..index + 1;
        }
        self.union(index..index + 1, |p| p.sealed_with(index))
    }

    /// The positions of [`group_with`](Self::group_with)`(index)` where
    /// some layer part holds them sealed now on `table` (the group's first
    /// block sealed), which a row written at `index` stages again
    /// ([`unseal`](Self::unseal)); `index` alone otherwise.
    pub fn sealed_with(&self, table: &[BlockId], index: usize) -> Range<usize> {
        let mut out = index..index + 1;
        if !self.grouped {
            return out;
        }
        for p in self.parts.iter().flatten() {
            let p = read(p);
            let r = p.sealed_with(index);
            if r.len() > 1 && r.end <= table.len() && !p.is_staged(table[r.start].index()) {
                out = out.start.min(r.start)..out.end.max(r.end);
            }
        }
        out
    }

    /// `base` widened by the non-empty range `range` gives for each layer
    /// part.
    fn union(
        &self,
        base: Range<usize>,
        range: impl Fn(&dyn StoredPart) -> Range<usize>,
    ) -> Range<usize> {
        let mut out = base;
        for p in self.parts.iter().flatten() {
            let r = range(read(p).as_ref());
            if !r.is_empty() {
                out = if out.is_empty() {
                    r
                } else {
                    out.start.min(r.start)..out.end.max(r.end)
                };
            }
        }
        out
    }

    /// Stages again, in every layer part, the blocks of the sequence on
    /// `table` sealed together with position `index`
    /// ([`StoredPart::unseal`]), before a row is written there.
    pub fn unseal(&self, table: &[BlockId], index: usize) -> Result<()> {
        if self.sealed_with(table, index).len() <= 1 {
            return Ok(());
        }
        let pages: Vec<u32> = table.iter().map(|b| b.0).collect();
        for p in self.parts.iter().flatten() {
            write(p).unseal(&pages, index)?;
        }
        Ok(())
    }

    /// The block-table positions of `table`'s kept blocks of a group of
    /// blocks sealed together that cutting the sequence back to `tokens`
    /// tokens splits, in the layer parts where that group is whole in
    /// `table` ([`StoredPart::cut_blocks`]; a group the sequence is still
    /// filling is its own): the cache makes them the sequence's own, and
    /// [`cut`](Self::cut) stages a sealed group's again.
    pub fn cut_blocks(&self, table: &[BlockId], tokens: usize) -> Range<usize> {
        if !self.grouped {
            return 0..0;
        }
        self.union(0..0, |p| {
            let kept = p.cut_blocks(tokens);
            let whole = p.sealed_with(kept.start).end <= table.len();
            if whole { kept } else { 0..0 }
        })
    }

    /// Prepares every layer part for a sequence on `table` being cut back
    /// to `tokens` tokens ([`StoredPart::cut`]), before the blocks past
    /// them are released.
    pub fn cut(&self, table: &[BlockId], tokens: usize) -> Result<()> {
        if self.cut_blocks(table, tokens).is_empty() {
            return Ok(());
        }
        let pages: Vec<u32> = table.iter().map(|b| b.0).collect();
        for p in self.parts.iter().flatten() {
            write(p).cut(&pages, tokens)?;
        }
        Ok(())
    }
}
