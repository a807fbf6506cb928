//! Where metadata groups lie in a `tokens × channels` matrix.
//!
//! Every scaled form groups values into rectangles of `tokens_per_block`
//! consecutive tokens by `channels_per_group` consecutive channels. Groups are
//! numbered block-major: value `(t, c)` belongs to group
//! `(t / tokens_per_block) · groups_per_block + c / channels_per_group`, and
//! the metadata buffers hold one entry per group in that order.
//!
//! | form | tokens per block | channels per group |
//! |---|---|---|
//! | per token, group `g` (`int4-g64`, `nf4`) | 1 | `g` (whole row without `-g`) |
//! | per channel over `T` tokens (`int4-ch32`) | `T` (all tokens without a number) | 1 |
//! | per tensor (`int4-t`, `fp8-e4m3`) | all tokens | all channels |
//! | per head of `h` channels (`fp8-e4m3-h64`) | all tokens | `h` |

use std::ops::Range;

use crate::error::{KvQuantError, Result};

/// The grouping of values under shared metadata (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupLayout {
    /// Consecutive tokens sharing a group.
    pub tokens_per_block: usize,
    /// Consecutive channels sharing a group.
    pub channels_per_group: usize,
    /// Groups across one block of tokens (`channels / channels_per_group`).
    pub groups_per_block: usize,
    /// Token blocks (`⌈tokens / tokens_per_block⌉`).
    pub blocks: usize,
}

impl GroupLayout {
    /// Checks divisibility and builds the layout.
    pub(crate) fn new(
        tokens: usize,
        channels: usize,
        tokens_per_block: usize,
        channels_per_group: usize,
    ) -> Result<Self> {
        if channels_per_group == 0 || !channels.is_multiple_of(channels_per_group) {
            return Err(KvQuantError::InvalidParameter {
                name: "group size",
                reason: format!(
                    "groups of {channels_per_group} channels do not divide the {channels} channels"
                ),
            });
        }
        let tokens_per_block = tokens_per_block.max(1);
        Ok(GroupLayout {
            tokens_per_block,
            channels_per_group,
            groups_per_block: channels / channels_per_group,
            blocks: tokens.div_ceil(tokens_per_block),
        })
    }

    /// Number of groups (metadata entries).
    pub const fn groups(&self) -> usize {
        self.blocks * self.groups_per_block
    }

    /// The group of value `(token, channel)`.
    #[inline]
    pub const fn group(&self, token: usize, channel: usize) -> usize {
        token / self.tokens_per_block * self.groups_per_block + channel / self.channels_per_group
    }

    /// The contiguous range of groups touched by tokens `start..end` (non-empty range).
    pub fn groups_of_rows(&self, start: usize, end: usize) -> Range<usize> {
        let first = start / self.tokens_per_block * self.groups_per_block;
        let last = ((end - 1) / self.tokens_per_block + 1) * self.groups_per_block;
        first..last
    }

    /// The groups of rows `start..end` whose metadata words a decode of
    /// those rows counts: the groups of the blocks whose first token is in
    /// `start..end` ([`first_token`](Self::first_token)).
    pub fn counted_groups(&self, start: usize, end: usize) -> Range<usize> {
        let (tpb, gpb) = (self.tokens_per_block, self.groups_per_block);
        let first = start.div_ceil(tpb) * gpb;
        first..(end.div_ceil(tpb) * gpb).max(first)
    }

    /// First token of group `g`: decode statistics count a metadata word in
    /// the tile that holds this token, so that tile-by-tile statistics add up
    /// to those of one whole decode.
    pub const fn first_token(&self, g: usize) -> usize {
        g / self.groups_per_block * self.tokens_per_block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_the_matrix_block_major() {
        let per_token = GroupLayout::new(5, 8, 1, 4).unwrap();
        assert_eq!(per_token.groups(), 10);
        assert_eq!(per_token.group(2, 5), 5);
        assert_eq!(per_token.groups_of_rows(1, 3), 2..6);
        let per_channel = GroupLayout::new(5, 8, 2, 1).unwrap();
        assert_eq!(per_channel.blocks, 3);
        assert_eq!(per_channel.group(4, 7), 23);
        assert_eq!(per_channel.groups_of_rows(1, 3), 0..16);
        assert_eq!(per_channel.first_token(9), 2);
        assert!(GroupLayout::new(5, 8, 1, 3).is_err());
        assert!(GroupLayout::new(5, 8, 1, 0).is_err());
    }

    /// The counted groups of every row range are the groups of those rows
    /// whose first token lies in the range.
    #[test]
    fn counted_groups_are_those_whose_first_token_is_inside() {
        for (tokens, tokens_per_block) in [(7, 1), (7, 2), (9, 4), (5, 5)] {
            let layout = GroupLayout::new(tokens, 8, tokens_per_block, 4).unwrap();
            for start in 0..tokens {
                for end in start + 1..=tokens {
                    let want: Vec<usize> = layout
                        .groups_of_rows(start, end)
                        .filter(|&g| (start..end).contains(&layout.first_token(g)))
                        .collect();
                    let got: Vec<usize> = layout.counted_groups(start, end).collect();
                    assert_eq!(
                        got, want,
                        "{tokens_per_block} tokens per block, {start}..{end}"
                    );
                }
            }
        }
    }
}
