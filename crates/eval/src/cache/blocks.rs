//! Per-block forms in the re-encode backend: adaptive protection per block
//! of rows rather than per layer (the ECC paper's future work, at the
//! granularity of a paged cache's blocks).
//!
//! [`BlockForms`] gives each block of `block` rows of each layer's keys and
//! values its own form; the forms of one part differ only in their
//! protection (one quantizer, rotation and segment layout), so a block's
//! values are the same under every code. A part is then stored as [`BlockedPart`]: one kv-quant
//! store per run of consecutive blocks of one form, read by attention as
//! one source. A tile inside one run is that store's tile (FP16 halves or
//! integer levels for the fused kernels); a tile across runs is decoded
//! block by block into f32 rows. Interpolation of erased values reads the
//! erased row's own block only, on both paths, as in the paged cache, and
//! the uniform forms read through `BlockForms::uniform` see the same rule.
//!
//! With `observe` set, every read also counts each block's value codewords
//! (a scrubber's view of each block, `CacheStats::blocks`), from which
//! `adaptive::choose_blocks` picks each block's code.

use std::ops::Range;

use attention::{BlockedScratch, KvSource, Tile};
use kv_quant::{CacheForm, DecodeScratch, KvStore, NonFinite, QuantizeOptions, Quantizer};

use super::{Faults, LayerCodewords, mix};
use crate::adaptive::Level;
use crate::error::{EvalError, Result};

/// Each block's form (for adaptive protection per block).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockForms {
    /// Rows per block.
    pub block: usize,
    /// Per layer, the forms of the key blocks and of the value blocks, in
    /// row order; a block past the end of its list (or a layer past the
    /// end of `layers`) takes the layer's own form.
    pub layers: Vec<[Vec<CacheForm>; 2]>,
    /// Whether every read counts each block's value codewords
    /// (`CacheStats::blocks`).
    pub observe: bool,
}

impl BlockForms {
    /// Every block in its layer's form: the layer forms read block by
    /// block, interpolation limited to each block.
    pub fn uniform(block: usize, observe: bool) -> Self {
        Self {
            block,
            layers: Vec::new(),
            observe,
        }
    }

    /// The forms of per-block levels (`levels[2·layer + part][block]`, as
    /// `adaptive::choose_blocks` gives them), each level's form taken from
    /// `forms` (Hamming, SECDED, Golay).
    pub fn from_levels(block: usize, levels: &[Vec<Level>], forms: [CacheForm; 3]) -> Self {
        let form = |l: &Level| match l {
            Level::Hamming => forms[0],
            Level::Secded => forms[1],
            Level::Golay => forms[2],
        };
        let layers = levels
            .chunks(2)
            .map(|kv| {
                let part = |p: usize| {
                    kv.get(p)
                        .map_or(Vec::new(), |b| b.iter().map(form).collect())
                };
                [part(0), part(1)]
            })
            .collect();
        Self {
            block,
            layers,
            observe: false,
        }
    }

    /// The form of block `b` of `layer`'s part `part`, `default` where the
    /// table has none.
    fn form(&self, layer: usize, part: usize, b: usize, default: CacheForm) -> CacheForm {
        self.layers
            .get(layer)
            .and_then(|parts| parts[part].get(b))
            .copied()
            .unwrap_or(default)
    }

    /// Refuses blocks of no rows, a table longer than the model, layer
    /// forms that are not row-local codebook-free kv-quant forms, and block
    /// forms that differ from their layer's in more than their protection
    /// (quantizer, rotation and segments must match, so every block form is
    /// row-local and reads in the layer's coordinates).
    pub(super) fn check(&self, layer_forms: &[[CacheForm; 2]]) -> Result<()> {
        let bad = |reason: String| {
            Err(EvalError::InvalidParameter {
                name: "block forms",
                reason,
            })
        };
        if self.block == 0 {
            return bad("blocks of 0 rows".into());
        }
        if self.layers.len() > layer_forms.len() {
            return bad(format!(
                "forms for {} layers of a model of {}",
                self.layers.len(),
                layer_forms.len()
            ));
        }
        for (l, parts) in layer_forms.iter().enumerate() {
            for (p, &own) in parts.iter().enumerate() {
                let q = own.quantizer();
                if !own.is_row_local()
                    || matches!(q, Quantizer::LowRank(_) | Quantizer::Shard(_))
                    || q.needs_codebook()
                {
                    return bad(format!(
                        "{own} (layer {l}): per-block forms take row-local kv-quant forms \
                         without a codebook"
                    ));
                }
                let list = self.layers.get(l).map_or(&[][..], |parts| &parts[p][..]);
                let same_values = |f: &CacheForm| {
                    f.quantizer() == q
                        && f.rotation() == own.rotation()
                        && f.segments() == own.segments()
                };
                if let Some(f) = list.iter().find(|f| !same_values(f)) {
                    return bad(format!(
                        "block form {f} of layer {l} stores values differently from the layer's \
                         {own}: the blocks of one part may differ in their protection only"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A run of consecutive blocks of one form, stored as one store.
#[derive(Clone, Debug)]
struct Segment {
    /// The part's row of the store's row 0.
    start: usize,
    store: KvStore,
}

/// One part of a layer stored block by block ([`BlockForms`]).
#[derive(Clone, Debug)]
pub(super) struct BlockedPart {
    block: usize,
    tokens: usize,
    channels: usize,
    segments: Vec<Segment>,
}

impl BlockedPart {
    /// Stores `rows` (`tokens × channels`) of `layer`'s part `part` in the
    /// blocks' forms (`own` where the table has none).
    pub(super) fn build(
        forms: &BlockForms,
        (layer, part, own): (usize, usize, CacheForm),
        rows: &[f32],
        tokens: usize,
        channels: usize,
    ) -> Result<Self> {
        let (bs, blocks) = (forms.block, tokens.div_ceil(forms.block));
        let mut segments = Vec::new();
        let mut b = 0;
        while b < blocks {
            let form = forms.form(layer, part, b, own);
            let end = (b + 1..blocks)
                .find(|&e| forms.form(layer, part, e, own) != form)
                .unwrap_or(blocks);
            let rows_of = b * bs..(end * bs).min(tokens);
            let store = KvStore::quantize_with(
                form,
                &rows[rows_of.start * channels..rows_of.end * channels],
                rows_of.len(),
                channels,
                QuantizeOptions {
                    non_finite: NonFinite::Clamp,
                },
            )?;
            segments.push(Segment {
                start: rows_of.start,
                store,
            });
            b = end;
        }
        Ok(Self {
            block: bs,
            tokens,
            channels,
            segments,
        })
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| s.store.stored_bytes() as u64)
            .sum()
    }

    /// The segment holding row `row`.
    fn segment(&self, row: usize) -> &Segment {
        let i = self.segments.partition_point(|s| s.start <= row);
        &self.segments[i - 1]
    }

    /// Injects this call's faults into every segment, run by run within
    /// each block ([`PartFaults`]); returns the flips.
    pub(super) fn inject(&mut self, faults: &PartFaults<'_>) -> Result<u64> {
        self.segments
            .iter_mut()
            .map(|s| faults.inject(&mut s.store, s.start))
            .sum()
    }

    /// Adds each block's value codewords read, corrected and detected to
    /// `into` (one entry per block, grown as needed).
    pub(super) fn observe(&self, into: &mut Vec<LayerCodewords>) -> Result<()> {
        let blocks = self.tokens.div_ceil(self.block);
        if into.len() < blocks {
            into.resize(blocks, LayerCodewords::default());
        }
        let mut rows = vec![0.0; self.block.min(self.tokens) * self.channels];
        let mut scratch = DecodeScratch::default();
        for s in &self.segments {
            for local in (0..s.store.tokens()).step_by(self.block) {
                let n = self.block.min(s.store.tokens() - local);
                let out = &mut rows[..n * self.channels];
                let stats = s
                    .store
                    .decode_rows_rotated_into(local, n, out, &mut scratch)?;
                into[(s.start + local) / self.block] += LayerCodewords::of(&stats.values);
            }
        }
        Ok(())
    }
}

/// The faults of one call on one part of one layer. Under a row-resolved
/// [`HotMap`] (or for a part stored block by block) each run of rows that
/// are all hot or all not, within one block, is injected with its channel,
/// on a stream of its own derived from `seed` and the run's first row.
///
/// [`HotMap`]: crate::cache::HotMap
pub(super) struct PartFaults<'a> {
    /// The run's faults: its map, target and channels.
    pub faults: &'a Faults,
    /// The layer.
    pub layer: usize,
    /// Keys 0, values 1.
    pub part: usize,
    /// Seed of this call's flips on this part.
    pub seed: u64,
    /// Rows per block where the part is stored block by block: runs then
    /// also end at block boundaries, so the flips a block sees do not
    /// depend on how blocks are grouped into stores.
    pub block: Option<usize>,
}

impl PartFaults<'_> {
    /// Injects into `store`, whose row 0 is the part's row `first`; row-
    /// local forms only (a typed error otherwise). Returns the flips.
    pub(super) fn inject(&self, store: &mut KvStore, first: usize) -> Result<u64> {
        let spec = &self.faults.spec;
        let hot = |r: usize| spec.is_hot(self.layer, self.part, first + r);
        let tokens = store.tokens();
        let mut flips = 0;
        let mut r = 0;
        while r < tokens {
            let is_hot = hot(r);
            let block_end = self
                .block
                .map_or(tokens, |b| ((first + r) / b + 1) * b - first)
                .min(tokens);
            let end = (r + 1..block_end)
                .find(|&e| hot(e) != is_hot)
                .unwrap_or(block_end);
            let channel = self.faults.channel(is_hot);
            let seed = mix(self.seed ^ mix((first + r) as u64));
            flips += store
                .inject_rows(r..end, channel, seed, spec.target)?
                .total() as u64;
            r = end;
        }
        Ok(flips)
    }
}

impl KvSource for BlockedPart {
    type Scratch = BlockedScratch;

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn stored_bytes(&self) -> usize {
        self.bytes() as usize
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut BlockedScratch,
    ) -> attention::Result<Tile<'s>> {
        let seg = self.segment(start);
        if start + count <= seg.start + seg.store.tokens() {
            // Segments start at block boundaries: the store's blocks are
            // the part's.
            return scratch.read_run(&seg.store, start - seg.start, count, self.block);
        }
        scratch.decode_blocks(start, count, self.block, self.channels, |t| {
            let seg = self.segment(t);
            (&seg.store, t - seg.start)
        })
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        let seg = self.segment(start);
        (start + count <= seg.start + seg.store.tokens())
            .then(|| KvSource::row_addresses(&seg.store, start - seg.start, count))
            .flatten()
    }

    fn rotation(&self) -> Option<&'static kv_quant::Hadamard> {
        self.segments
            .first()
            .and_then(|s| KvSource::rotation(&s.store))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{ChannelKind, FaultSpec};
    use gf2_codes::channel::BinarySymmetric;
    use kv_quant::FaultTarget;

    const TOKENS: usize = 150;
    const CH: usize = 32;
    const BLOCK: usize = 24;

    /// Tiles read through a part stored in runs of codes, inside runs,
    /// across them and over the partial last block, equal each block
    /// decoded on its own with interpolation limited to it, under faults
    /// that erase values.
    #[test]
    fn tiles_equal_each_block_decoded_alone() {
        let forms: Vec<CacheForm> = ["secded84", "secded84", "golay24", "golay24", "golay24"]
            .iter()
            .chain(&["secded84", "hamming74"])
            .map(|c| format!("int4+{c}+interp").parse().unwrap())
            .collect();
        let blocks = BlockForms {
            block: BLOCK,
            layers: vec![[forms.clone(), Vec::new()]],
            observe: false,
        };
        let rows: Vec<f32> = (0..TOKENS * CH)
            .map(|i| ((i / CH) as f32 * 0.11 + (i % CH) as f32 * 0.7).sin())
            .collect();
        let own = forms[0];
        let mut part = BlockedPart::build(&blocks, (0, 0, own), &rows, TOKENS, CH).unwrap();
        assert_eq!(
            part.segments.iter().map(|s| s.start).collect::<Vec<_>>(),
            [0, 48, 120, 144]
        );
        let spec = FaultSpec {
            channel: ChannelKind::Bsc,
            ber: 2e-2,
            seed: 3,
            target: FaultTarget::Values,
            hot: None,
        };
        let run = Faults {
            spec,
            channel: Box::new(BinarySymmetric::new(2e-2).unwrap()),
            hot: None,
        };
        let faults = PartFaults {
            faults: &run,
            layer: 0,
            part: 0,
            seed: 9,
            block: Some(BLOCK),
        };
        assert!(part.inject(&faults).unwrap() > 0);
        // The reference: each block decoded alone.
        let mut want = vec![0.0f32; TOKENS * CH];
        let mut erased = 0;
        let mut scratch = DecodeScratch::default();
        for b in 0..TOKENS.div_ceil(BLOCK) {
            let (t0, n) = (b * BLOCK, BLOCK.min(TOKENS - b * BLOCK));
            let seg = part.segment(t0);
            let local = t0 - seg.start;
            scratch.limit_neighbours(Some(local..local + n));
            let stats = seg
                .store
                .decode_rows_rotated_into(local, n, &mut want[t0 * CH..][..n * CH], &mut scratch)
                .unwrap();
            erased += stats.erased_values;
        }
        assert!(erased > 0, "no value erased: interpolation untested");
        for (start, count) in [
            (0, TOKENS),
            (50, 20),
            (60, 50),
            (40, 20),
            (100, 50),
            (144, 6),
            (147, 3),
            (23, 2),
        ] {
            let mut scratch = BlockedScratch::default();
            let tile = part.read_tile(start, count, &mut scratch).unwrap();
            let mut got = vec![0.0f32; count * CH];
            match tile.rows {
                attention::TileRows::F32(v) => got.copy_from_slice(v),
                attention::TileRows::Levels(l) => l.dequantize_into(&mut got),
                attention::TileRows::F16(_) | attention::TileRows::PairCodes(_) => {
                    panic!("int4 tiles are levels or f32")
                }
            }
            let expected = &want[start * CH..][..count * CH];
            assert!(
                got.iter()
                    .zip(expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rows {start}..{}",
                start + count
            );
        }
    }
}
