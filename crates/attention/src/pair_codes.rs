//! [`PairCodeRows`]: a tile of keys coded before RoPE on one codebook per
//! rotated pair, as codes, gains and the rows' rotation angles, which the
//! kernel scores against the codebook ([`TileRows::PairCodes`]).
//!
//! Row `t`'s key, rotated to its position, has in pair `i` of a head
//! (channels `a`, `b` of the model's layout, [`Rope::pair`]) the values
//! `g·(c₀·cos − c₁·sin, c₀·sin + c₁·cos)`, `c` the centroid its code names
//! in the pair's codebook, `g` its gain and the angle the row's. A query
//! pair `(q_a, q_b)` scores it as `g·(A·cos + B·sin)` with
//! `A = q_a·c₀ + q_b·c₁` and `B = q_b·c₀ − q_a·c₁`: two numbers per query
//! head, pair and centroid, taken once per query (the kernel's table), and
//! two multiply-adds per row and pair after.
//!
//! [`TileRows::PairCodes`]: crate::TileRows::PairCodes

use kv_quant::{DecodeScratch, KvStore, VqCodeRows};

use crate::error::{AttentionError, Result};
use crate::rope::{Rope, RopeLayout};
use crate::source::{Tile, TileRows};

/// Keys coded before RoPE on pair codebooks, as a tile (module docs).
#[derive(Clone, Copy, Debug)]
pub struct PairCodeRows<'s> {
    codes: VqCodeRows<'s>,
    /// Cosines then sines, pair-major ([`Rope::trig_rows`]), of
    /// `trig_rows` rows; this view's rows start at row `first` of them.
    trig: &'s [f32],
    trig_rows: usize,
    first: usize,
    layout: RopeLayout,
    head_dim: usize,
}

impl<'s> PairCodeRows<'s> {
    /// The tile of `codes` (rows coded in pair order, a `cq-d2` codebook
    /// with one codebook per pair) rotated by `trig` (what
    /// [`Rope::trig_rows`] gives for these rows) in heads of `rope`'s, or
    /// why they do not fit: codes of another shape, a RoPE that leaves
    /// channels unrotated, angles for other rows.
    pub fn new(codes: VqCodeRows<'s>, trig: &'s [f32], rope: &Rope) -> Result<Self> {
        let spec = codes.codebook.spec();
        let (d, ch) = (rope.head_dim(), codes.channels());
        let fits = spec.dim == 2
            && spec.coupled
            && rope.rotary_dims() == d
            && ch.is_multiple_of(d)
            && codes.codebook.codebooks() == ch / 2
            && trig.len() == codes.rows() * d;
        if !fits {
            return Err(AttentionError::InvalidParameter {
                name: "pair codes",
                reason: format!(
                    "{} rows of {ch} channels coded {}-d (coupled: {}, {} codebooks) with {} \
                     angles are not pairs of whole heads of {d} all rotated ({} rotated)",
                    codes.rows(),
                    spec.dim,
                    spec.coupled,
                    codes.codebook.codebooks(),
                    trig.len(),
                    rope.rotary_dims()
                ),
            });
        }
        Ok(Self {
            codes,
            trig,
            trig_rows: codes.rows(),
            first: 0,
            layout: rope.layout(),
            head_dim: d,
        })
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.codes.rows()
    }

    /// Channels per row.
    pub fn channels(&self) -> usize {
        self.codes.channels()
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The codes and gains.
    pub fn codes(&self) -> &VqCodeRows<'s> {
        &self.codes
    }

    /// The cosine and sine of pair `pair`'s angle at row `row`.
    #[inline]
    pub fn trig(&self, row: usize, pair: usize) -> (f32, f32) {
        let (n, p) = (self.trig_rows, self.head_dim / 2);
        let r = self.first + row;
        (self.trig[pair * n + r], self.trig[(p + pair) * n + r])
    }

    /// The cosines and the sines of pair `pair` over rows
    /// `row..row + count`.
    #[inline]
    pub(crate) fn trig_run(&self, pair: usize, row: usize, count: usize) -> (&[f32], &[f32]) {
        let (n, p) = (self.trig_rows, self.head_dim / 2);
        let r = self.first + row;
        (
            &self.trig[pair * n + r..][..count],
            &self.trig[(p + pair) * n + r..][..count],
        )
    }

    /// The two channels of pair `pair` within a head.
    #[inline]
    pub fn pair(&self, pair: usize) -> (usize, usize) {
        match self.layout {
            RopeLayout::Adjacent => (2 * pair, 2 * pair + 1),
            RopeLayout::RotateHalf => (pair, pair + self.head_dim / 2),
        }
    }

    /// Rows `first..first + count` of these.
    pub fn sub_rows(&self, first: usize, count: usize) -> Self {
        let (groups, gains) = (self.codes.codes.len(), self.codes.gains.len());
        let rows = self.rows();
        let mut codes = self.codes;
        codes.codes = &codes.codes[first * groups / rows..][..count * groups / rows];
        codes.gains = &codes.gains[first * gains / rows..][..count * gains / rows];
        Self {
            codes,
            first: self.first + first,
            ..*self
        }
    }

    /// The keys as f32 rows in the model's channel order, rotated to their
    /// positions (`rows × channels` values into `out`): each pair
    /// `g·c` turned by the row's angle in f32, as the kernel's scores
    /// read them.
    pub fn widen_into(&self, out: &mut [f32]) {
        let (ch, d) = (self.channels(), self.head_dim);
        let codebook = self.codes.codebook;
        let (k, block) = (codebook.spec().centroids, codebook.block());
        let centroids = codebook.centroids();
        let (groups, blocks) = (ch / 2, ch / block);
        for (r, row) in out.chunks_exact_mut(ch).enumerate().take(self.rows()) {
            let codes = &self.codes.codes[r * groups..][..groups];
            let gains = &self.codes.gains[r * blocks..][..blocks];
            // Pair j of the row is pair i of head h; it reads codebook j.
            for (j, &code) in codes.iter().enumerate() {
                let (h, i) = (j / (d / 2), j % (d / 2));
                let gain = gains[2 * j / block];
                let c = &centroids[2 * (j * k + usize::from(code))..][..2];
                let (x0, x1) = (gain * c[0], gain * c[1]);
                let (cos, sin) = self.trig(r, i);
                let (a, b) = self.pair(i);
                row[h * d + a] = x0 * cos - x1 * sin;
                row[h * d + b] = x0 * sin + x1 * cos;
            }
        }
    }
}

/// Rows `start..start + count` of `store` (keys coded before RoPE in pair
/// order, row `r` at position `position + r`) as a pair-code tile, with
/// the angles in `trig`; `None` where the store cannot give them as codes
/// (exact sink rows among them, an erased value) or `rope` leaves
/// channels unrotated: read those decoded.
pub(crate) fn pair_tile<'s>(
    store: &'s KvStore,
    rope: &Rope,
    (start, count, position): (usize, usize, usize),
    decode: &'s mut DecodeScratch,
    trig: &'s mut Vec<f32>,
) -> Result<Option<Tile<'s>>> {
    if rope.rotary_dims() != rope.head_dim() {
        return Ok(None);
    }
    let Some((codes, stats)) = store.decode_vq_codes(start, count, decode)? else {
        return Ok(None);
    };
    rope.trig_rows(position, count, trig);
    let rows = PairCodeRows::new(codes, trig, rope)?;
    Ok(Some(Tile {
        rows: TileRows::PairCodes(rows),
        stats,
    }))
}
