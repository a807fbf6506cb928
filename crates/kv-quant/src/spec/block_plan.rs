//! [`BlockPlan`]: how a form is kept in a paged cache's fixed-size blocks,
//! written one token at a time.
//!
//! A row-local form (each token's bytes its own) is written straight into
//! its block. Every other form the blocks can hold is *staged*: a block's
//! rows are written exact (f16, under the form's protection, as a
//! segmented store keeps its sink and window rows) and the block is
//! *sealed* (its rows quantized in the block's form, the exact rows
//! dropped) once the step that makes it sealable commits:
//!
//! - per-channel integer forms (KIVI's keys) get one scale and offset per
//!   channel per group of `G` tokens, `G` a multiple `m·B` of the block
//!   size (a group never splits a block): `int4-ch` seals each block of
//!   `B` tokens as `int4-ch<B>` (`m = 1`), `int4-ch<G>` seals each run of
//!   `m` blocks at once (`group_blocks`), once its last block commits; the
//!   blocks of the group still being written are KIVI's full-precision
//!   residual;
//! - the first `⌈sink / B⌉` blocks are never sealed (`+sink<S>`: exact
//!   segments are whole blocks, so a paged `+sink4` keeps a whole first
//!   block exact, and counts it);
//! - a block is sealed only once all its rows are at least `window` tokens
//!   behind the sequence's end (`+win<W>`): the last `W` to `W + B − 1`
//!   tokens are exact, and read in place, without a second copy.
//!
//! Sealing at commit means that rolling back a step only ever drops exact
//! rows: nothing sealed is undone.

use super::{CacheForm, Granularity, IntSpec, Quantizer, Segments};
use crate::error::{KvQuantError, Result};

/// How one form is kept in blocks of `block_size` tokens (see the module
/// docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockPlan {
    /// The form asked for.
    pub form: CacheForm,
    /// The form a sealed block (or, for forms that are not staged, every
    /// written row) is stored in: the form without segments, per-channel
    /// groups of `group_blocks` blocks.
    pub sealed: CacheForm,
    /// The form of staged (exact) rows: f16 under the form's protection.
    pub exact: CacheForm,
    /// Whether rows are staged exact until their block is sealed.
    pub staged: bool,
    /// Leading blocks of a sequence that are never sealed (sink tokens).
    pub sink_blocks: usize,
    /// Tokens at the end of a sequence that are never sealed.
    pub window: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per per-channel group, sealed together (1 for every other
    /// form): groups start after the sink blocks, at every `group_blocks`-th
    /// block.
    pub group_blocks: usize,
}

impl BlockPlan {
    /// The plan of `form` in blocks of `block_size` tokens, or why blocks
    /// cannot hold it (shard and low-rank forms; per-tensor scales; a
    /// per-channel group that is not a multiple of the block; a rotated
    /// form grouped over several blocks). A codebook form (`vq`) is
    /// row-local given its fitted codebook, which whoever builds its
    /// stores supplies.
    pub fn new(form: CacheForm, block_size: usize) -> Result<Self> {
        let refuse = |reason: String| {
            Err(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason,
            })
        };
        if block_size == 0 {
            return refuse("blocks hold at least one token".into());
        }
        let q = *form.quantizer();
        if q.is_shard() {
            return refuse(
                "is a shard form: its middle is fitted on the whole prefill and stored by \
                 attention's ShardLayer, not written into blocks (use --backend reencode)"
                    .into(),
            );
        }
        if q.is_low_rank() {
            return refuse(
                "is a low-rank form: its coefficients and bases live in kv-lowrank stores, \
                 not blocks (use --backend reencode)"
                    .into(),
            );
        }
        if form.sparse().is_some() {
            return refuse(
                "keeps sparse outliers beside each sealed block: attention's SparsePart \
                 keeps them"
                    .into(),
            );
        }
        if q.is_hierarchical() {
            return refuse(
                "keeps two 4-bit planes, each planned in blocks on its own \
                 (CacheForm::planes): attention's HierarchicalPart keeps them"
                    .into(),
            );
        }
        let middle = form.without_segments();
        let (sealed, per_block, group_blocks) = match q {
            Quantizer::Int(
                spec @ IntSpec {
                    granularity: Granularity::PerChannel { tokens },
                    ..
                },
            ) if tokens != Some(1) => {
                let group = tokens.unwrap_or(block_size);
                if !group.is_multiple_of(block_size) {
                    return refuse(format!(
                        "groups {group} tokens per channel scale, and a group never splits a \
                         paged block: use blocks of a size dividing {group} (--block-size), or \
                         the spelling without a group size, which groups one block"
                    ));
                }
                let group_blocks = group / block_size;
                if group_blocks > 1 && middle.rotation().is_some() {
                    return refuse(format!(
                        "groups {group_blocks} blocks per channel scale and rotates its rows: a \
                         group over several blocks is kept in channel slices, which a rotation \
                         would mix (use blocks of {group} tokens, or the form without +rot)"
                    ));
                }
                let quantizer = Quantizer::Int(IntSpec {
                    granularity: Granularity::PerChannel {
                        tokens: Some(group),
                    },
                    ..spec
                });
                let sealed = CacheForm::build(
                    quantizer,
                    middle.rotation(),
                    Segments::default(),
                    middle.protection().copied(),
                )?;
                (sealed, true, group_blocks)
            }
            _ if middle.is_row_local() => (middle, false, 1),
            _ => {
                return refuse(
                    "shares one scale across all tokens (per-tensor scales): blocks are written \
                     a token at a time; use a per-token form (fp8-e4m3-tok, int8, …) or \
                     per-channel scales (int8-ch, int4-ch)"
                        .into(),
                );
            }
        };
        let Segments { sink, window } = form.segments();
        Ok(Self {
            form,
            sealed,
            exact: form.exact_rows_form(),
            staged: per_block || !form.segments().is_empty(),
            sink_blocks: sink.div_ceil(block_size),
            window,
            block_size,
            group_blocks,
        })
    }

    /// Blocks of a sequence of `tokens` committed tokens that may be
    /// sealed: every block from the first after the sinks whose rows all
    /// lie at least `window` tokens before the end, in whole groups. Blocks
    /// `sealable(before)..sealable(after)` (and none before
    /// `sink_blocks`) become sealable when a step takes a sequence from
    /// `before` to `after` tokens.
    pub fn sealable(&self, tokens: usize) -> usize {
        if !self.staged {
            return 0;
        }
        let blocks = tokens.saturating_sub(self.window) / self.block_size;
        self.whole_groups(blocks)
    }

    /// Of a sequence's first `blocks` blocks, those that end a whole group
    /// (every block of the sinks, and the groups after them that `blocks`
    /// covers entirely): the prefix of blocks whose sealed contents depend
    /// on nothing past it, and so may be shared with another sequence.
    pub fn whole_groups(&self, blocks: usize) -> usize {
        let m = self.group_blocks.max(1);
        match blocks.checked_sub(self.sink_blocks) {
            Some(past) => self.sink_blocks + past / m * m,
            None => blocks,
        }
    }

    /// Exact rows of a sequence of `tokens` tokens (the rows of its
    /// unsealed blocks, the last one counted to `tokens`).
    pub fn exact_rows(&self, tokens: usize) -> usize {
        if !self.staged {
            return 0;
        }
        let sealed = self.sealable(tokens).saturating_sub(self.sink_blocks);
        tokens - sealed * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(s: &str, bs: usize) -> Result<BlockPlan> {
        BlockPlan::new(s.parse().unwrap(), bs)
    }

    #[test]
    fn per_channel_forms_seal_one_block_per_group() {
        let p = plan("int4-ch", 16).unwrap();
        assert!(p.staged);
        assert_eq!(p.sealed.to_string(), "int4-ch16");
        assert_eq!((p.sink_blocks, p.window), (0, 0));
        assert_eq!(
            plan("int4-ch32", 32).unwrap().sealed.to_string(),
            "int4-ch32"
        );
        assert!(matches!(
            plan("int4-ch24", 16),
            Err(KvQuantError::InvalidSpec { .. })
        ));
        let p = plan("int4-ch+secded84", 64).unwrap();
        assert_eq!(p.sealed.to_string(), "int4-ch64+secded84");
        assert_eq!(p.exact.to_string(), "fp16+secded84");
    }

    #[test]
    fn per_channel_groups_span_whole_blocks_after_the_sinks() {
        let p = plan("int4-ch64", 16).unwrap();
        assert_eq!(
            (p.group_blocks, p.sealed.to_string().as_str()),
            (4, "int4-ch64")
        );
        assert_eq!(plan("int4-ch", 16).unwrap().group_blocks, 1);
        // Four blocks a group: sealable only once a whole group is written.
        for t in 0..200 {
            assert_eq!(p.sealable(t), t / 64 * 4, "{t}");
            assert_eq!(p.exact_rows(t), t % 64, "{t}");
        }
        // A sink block, then groups of two blocks of 16 past a window of 8.
        let p = plan("int2-ch32+sink4+win8", 16).unwrap();
        assert_eq!((p.sink_blocks, p.group_blocks), (1, 2));
        assert_eq!(p.sealable(16 + 8), 1);
        assert_eq!(p.sealable(16 + 16 + 8), 1);
        assert_eq!(p.sealable(16 + 32 + 8), 3);
        assert_eq!(p.exact_rows(16 + 32 + 8), 16 + 8);
        assert_eq!(
            (0..8).map(|b| p.whole_groups(b)).collect::<Vec<_>>(),
            [0, 1, 1, 3, 3, 5, 5, 7]
        );
        // A group over several blocks keeps channel slices: no rotation.
        assert!(plan("int4-ch64+rot16", 16).is_err());
        assert!(plan("int4-ch64+rot16", 64).is_ok());
    }

    #[test]
    fn row_local_forms_are_written_in_place_unless_segmented() {
        // (`vq` and `cq` with the fitted codebook their store is built with.)
        for s in [
            "int4",
            "fp16",
            "int4+secded84",
            "lm4",
            "nf4",
            "int4-ch1",
            "vq",
            "cq-d2-k16",
        ] {
            let p = plan(s, 16).unwrap();
            assert!(!p.staged, "{s}");
            assert_eq!(p.sealed, p.form, "{s}");
            assert_eq!(p.sealable(1000), 0);
            assert_eq!(p.exact_rows(1000), 0);
        }
        let p = plan("lm4+sink4", 16).unwrap();
        assert!(p.staged);
        assert_eq!(p.sealed.to_string(), "lm4");
        assert_eq!(p.sink_blocks, 1);
    }

    #[test]
    fn sinks_and_windows_count_whole_blocks() {
        // 16-token blocks, 4 sinks, 32-token window.
        let p = plan("int4-ch+sink4+win32", 16).unwrap();
        assert_eq!(p.sink_blocks, 1);
        assert_eq!(p.sealable(47), 0);
        assert_eq!(p.sealable(48), 1); // block 0 (a sink block: never sealed)
        assert_eq!(p.sealable(64), 2);
        assert_eq!(p.exact_rows(47), 47);
        assert_eq!(p.exact_rows(64), 64 - 16);
        assert_eq!(p.exact_rows(100), 100 - 16 * 3);
        // Without segments, only the block being written is exact.
        let p = plan("int4-ch", 16).unwrap();
        for t in 0..100 {
            assert_eq!(p.exact_rows(t), t % 16, "{t}");
            assert_eq!(p.sealable(t), t / 16);
        }
    }

    #[test]
    fn forms_blocks_cannot_hold_are_refused_with_a_reason() {
        for s in ["shard", "pca-r4", "fp8-e4m3", "int4-t"] {
            match plan(s, 16) {
                Err(KvQuantError::InvalidSpec { reason, .. }) => assert!(!reason.is_empty()),
                other => panic!("{s}: {other:?}"),
            }
        }
        assert!(plan("int4", 0).is_err());
    }
}
