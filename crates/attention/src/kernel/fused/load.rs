//! The float tile kernel's loaders ([`Load`]): a tile's rows read sixteen
//! channels at a time as f32 [`Lanes`] of either width, as they are
//! stored: f32 ([`Floats`]), IEEE half floats widened exactly
//! ([`Halves`]), or levels and FP8 codes with their group parameters
//! dequantized in registers as kv-quant defines it ([`Levels`], one
//! monomorphic loader per level map and grouping, [`with_levels!`]).

use kv_quant::{LevelMap, LevelRows};

use super::lanes::Lanes;

/// Values of a tile (`rows × ch`) read 16 lanes at a time as f32.
///
/// # Safety
/// The loads are only called from code compiled with the features of the
/// [`Lanes`] width, with a [`Row`](Self::Row) of a row `< rows` and
/// `col + 16 <= ch` (`col + n <= ch` for partial loads).
pub(super) trait Load: Copy {
    /// Where a row starts, computed once per row and pass ([`row`](Self::row)).
    type Row: Copy;

    /// Channels per row: the stride [`row`](Self::row) steps by.
    fn ch(self) -> usize;

    /// Values held.
    fn len(self) -> usize;

    /// The start of row `t`.
    fn row(self, t: usize) -> Self::Row;

    /// Channels `col..col + 16` of a row as f32.
    unsafe fn load<V: Lanes>(self, row: Self::Row, col: usize) -> V;

    /// Channels `col..col + n` of a row as f32 (`n < 16`, a head's last
    /// channels when its dimension is not a multiple of 16), zeros above.
    unsafe fn load_partial<V: Lanes>(self, row: Self::Row, col: usize, n: usize) -> V;
}

/// f32 rows of `.1` channels.
#[derive(Clone, Copy)]
pub(super) struct Floats<'a>(pub(super) &'a [f32], pub(super) usize);

impl Load for Floats<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn row(self, t: usize) -> usize {
        t * self.1
    }

    #[inline(always)]
    unsafe fn load<V: Lanes>(self, row: usize, col: usize) -> V {
        debug_assert!(row + col + 16 <= self.0.len());
        // SAFETY: the caller keeps the 16 values inside the slice.
        unsafe { V::load(self.0.as_ptr().add(row + col)) }
    }

    #[inline(always)]
    unsafe fn load_partial<V: Lanes>(self, row: usize, col: usize, n: usize) -> V {
        debug_assert!(row + col + n <= self.0.len() && n < 16);
        // SAFETY: the `n` values read are inside the slice.
        unsafe { V::load_partial(self.0.as_ptr().add(row + col), n) }
    }
}

/// Little-endian IEEE half floats, two bytes per value, rows of `.1` channels.
#[derive(Clone, Copy)]
pub(super) struct Halves<'a>(pub(super) &'a [u8], pub(super) usize);

impl Load for Halves<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len() / 2
    }

    #[inline(always)]
    fn row(self, t: usize) -> usize {
        t * self.1
    }

    #[inline(always)]
    unsafe fn load<V: Lanes>(self, row: usize, col: usize) -> V {
        let i = row + col;
        debug_assert!(2 * (i + 16) <= self.0.len());
        // SAFETY: bytes `2i..2i + 32` are inside the slice; x86 is little-endian.
        unsafe { V::halves(self.0.as_ptr().add(2 * i)) }
    }

    #[inline(always)]
    unsafe fn load_partial<V: Lanes>(self, row: usize, col: usize, n: usize) -> V {
        let i = row + col;
        debug_assert!(2 * (i + n) <= self.0.len() && n < 16);
        // SAFETY: the `2n` bytes read are inside the slice.
        unsafe { V::halves_partial(self.0.as_ptr().add(2 * i), n) }
    }
}

/// Integer levels or FP8 codes with their group parameters
/// ([`LevelRows`]), as the loader reads them: only for layouts where 16
/// consecutive channels of a head share one group (`channels_per_group` a
/// multiple of 16, like SmolLM2's whole-row groups of 192, and of the head
/// dimension where that is not a multiple of 16) or each have their own
/// (`channels_per_group == 1`).
#[derive(Clone, Copy)]
pub(super) struct LevelLayout<'a> {
    rows: LevelRows<'a>,
    ch: usize,
    /// Channel → group within a row for shared groups; `None` for one
    /// group per channel.
    shared: Option<GroupDivisor>,
    /// The step between consecutive rows' first groups where it is
    /// constant, so that row `t` starts at group `t·row_step`, found
    /// without a division: groups per row for per-token groups, 0 when
    /// every row lies in one block of tokens (FP8's per-tensor scale).
    row_step: Option<usize>,
}

impl<'a> LevelLayout<'a> {
    /// `None` for levels packed two per byte, group tables shorter than
    /// the rows name, and groupings the loader does not handle: groups of a multiple of 16 channels are read a group per
    /// 16-channel load, which holds for heads of `d` channels only where
    /// `d` is a multiple of 16 or groups hold whole heads; a head starting
    /// inside a group would have its loads straddle two.
    pub(super) fn new(rows: LevelRows<'a>, d: usize) -> Option<Self> {
        if rows.packing != kv_quant::LevelPacking::Bytes {
            return None;
        }
        let cpg = rows.channels_per_group();
        let shared = match cpg {
            1 => None,
            n if n % 16 == 0 && (d.is_multiple_of(16) || n.is_multiple_of(d)) => {
                Some(GroupDivisor::new(n, rows.channels())?)
            }
            _ => return None,
        };
        // Every group a row or channel can name is held: `KvSource` is a
        // public trait, so its level rows are checked before the loads that
        // skip bounds checks (a short table is widened by kv-quant, which
        // checks its own reads).
        let last = rows.group_index(rows.rows().checked_sub(1)?, rows.channels().checked_sub(1)?);
        if rows.scale.len() <= last || rows.offset.len() <= last {
            return None;
        }
        let row_step = if rows.tokens_per_group() == 1 {
            Some(rows.channels() / cpg)
        } else {
            let last = rows.rows().saturating_sub(1);
            (rows.group_index(last, 0) == 0).then_some(0)
        };
        Some(Self {
            ch: rows.channels(),
            rows,
            shared,
            row_step,
        })
    }
}

/// A level map as a constant ([`map_code`]), so that a loader's choice of
/// arithmetic is made once per tile, not at every load: with the map a
/// run-time value, every 16 values of an FP8 tile went through a jump
/// table and reloaded their constants (`perf`).
pub(super) const AFFINE: u8 = 0;
/// [`LevelMap::Centered`].
pub(super) const CENTERED: u8 = 1;
/// [`LevelMap::Nf4`] and [`LevelMap::Codebook`]: a 16-entry table.
pub(super) const TABLE: u8 = 2;
/// [`LevelMap::Fp8`] E5M2.
pub(super) const E5M2: u8 = 3;
/// [`LevelMap::Fp8`] E4M3.
pub(super) const E4M3: u8 = 4;

/// The constant of `map`, the middle level of a centered map (0 for the
/// others) and the table of a table map (NF4's for the others, unread).
pub(super) fn map_code(map: LevelMap) -> (u8, f32, &'static [f32; 16]) {
    let table = map.table16().unwrap_or(&kv_quant::NF4_LEVELS);
    match map {
        LevelMap::Affine => (AFFINE, 0.0, table),
        LevelMap::Centered { mid } => (CENTERED, mid, table),
        LevelMap::Nf4 | LevelMap::Codebook(_) => (TABLE, 0.0, table),
        LevelMap::Fp8(kv_quant::Fp8Format::E5M2) => (E5M2, 0.0, table),
        LevelMap::Fp8(kv_quant::Fp8Format::E4M3) => (E4M3, 0.0, table),
    }
}

/// A [`LevelLayout`] compiled for one level map (`MAP`, a [`map_code`])
/// and one grouping (`SHARED`: 16 consecutive channels in one group, else
/// each channel in its own).
#[derive(Clone, Copy)]
pub(super) struct Levels<'a, const MAP: u8, const SHARED: bool> {
    pub(super) layout: LevelLayout<'a>,
    /// The middle level of a centered map.
    pub(super) mid: f32,
    /// The entries of a table map.
    pub(super) table: &'static [f32; 16],
}

/// Binds `$l` to `$layout` as the [`Levels`] of its map and grouping and
/// evaluates `$body` with it: one monomorphic copy of `$body` per pair.
macro_rules! with_levels {
    ($layout:expr, $l:ident => $body:expr) => {{
        use $crate::kernel::fused::load::{AFFINE, CENTERED, E4M3, E5M2, TABLE};
        let layout: $crate::kernel::fused::load::LevelLayout<'_> = $layout;
        let (code, mid, table) = $crate::kernel::fused::load::map_code(layout.map());
        match (code, layout.is_shared()) {
            (AFFINE, true) => with_levels!(@ layout, mid, table, AFFINE, true, $l => $body),
            (AFFINE, false) => with_levels!(@ layout, mid, table, AFFINE, false, $l => $body),
            (CENTERED, true) => with_levels!(@ layout, mid, table, CENTERED, true, $l => $body),
            (CENTERED, false) => with_levels!(@ layout, mid, table, CENTERED, false, $l => $body),
            (TABLE, true) => with_levels!(@ layout, mid, table, TABLE, true, $l => $body),
            (TABLE, false) => with_levels!(@ layout, mid, table, TABLE, false, $l => $body),
            (E5M2, true) => with_levels!(@ layout, mid, table, E5M2, true, $l => $body),
            (E5M2, false) => with_levels!(@ layout, mid, table, E5M2, false, $l => $body),
            (E4M3, true) => with_levels!(@ layout, mid, table, E4M3, true, $l => $body),
            (E4M3, false) => with_levels!(@ layout, mid, table, E4M3, false, $l => $body),
            _ => unreachable!("map_code gives one of the five map constants"),
        }
    }};
    (@ $layout:ident, $mid:ident, $table:ident, $map:ident, $shared:literal, $l:ident => $body:expr) => {{
        let $l = $crate::kernel::fused::load::Levels::<$map, $shared> {
            layout: $layout,
            mid: $mid,
            table: $table,
        };
        $body
    }};
}
pub(super) use with_levels;

impl LevelLayout<'_> {
    /// How a level becomes a value.
    pub(super) fn map(&self) -> LevelMap {
        self.rows.map
    }

    /// Whether 16 consecutive channels share a group.
    pub(super) fn is_shared(&self) -> bool {
        self.shared.is_some()
    }
}

impl<const MAP: u8, const SHARED: bool> Levels<'_, MAP, SHARED> {
    /// Scales and offsets of channels `col..col + 16` (`n` of them read
    /// for one group per channel) of the row whose first group is `g`.
    ///
    /// # Safety
    /// Group `g + col / cpg` (or `g + col + n − 1` for one group per
    /// channel) exists, as `LevelRows::value` would read it.
    #[inline(always)]
    unsafe fn parameters<V: Lanes>(self, g: usize, col: usize, n: usize) -> (V, V) {
        let rows = self.layout.rows;
        debug_assert_eq!(SHARED, self.layout.shared.is_some());
        // SAFETY: the groups read exist (the caller's contract); the
        // caller has `V`'s features.
        unsafe {
            match self.layout.shared {
                // 16 channels from a multiple of 16 lie in one group; so do
                // any 16 of a head where groups hold whole heads
                // (`LevelLayout::new`), its last partial chunk included.
                Some(div) if SHARED => {
                    let j = g + div.of(col);
                    (
                        V::splat(*rows.scale.get_unchecked(j)),
                        V::splat(*rows.offset.get_unchecked(j)),
                    )
                }
                _ => {
                    let (s, o) = (
                        rows.scale.as_ptr().add(g + col),
                        rows.offset.as_ptr().add(g + col),
                    );
                    if n == 16 {
                        (V::load(s), V::load(o))
                    } else {
                        (V::load_partial(s, n), V::load_partial(o, n))
                    }
                }
            }
        }
    }
}

/// Sixteen levels (bytes) as values under the map `MAP` (a [`map_code`];
/// `mid` is a centered map's middle level, `table` a table map's entries)
/// with scales `a` and offsets `b`: `b + level·a` (product, then sum),
/// `(level − mid)·a`, `table[level & 15]·a`, or FP8 through IEEE half
/// precision (E4M3 as `half·(2^8·a)`: scaling by 2^8 is exact, so the one
/// rounding is the product's).
///
/// # Safety
/// Only called from code compiled with the features of `V`.
#[inline(always)]
pub(super) unsafe fn dequantize<V: Lanes, const MAP: u8>(
    mid: f32,
    table: &[f32; 16],
    bytes: V::Bytes,
    a: V,
    b: V,
) -> V {
    // SAFETY: the caller has `V`'s features; registers only.
    unsafe {
        match MAP {
            AFFINE => V::add(b, V::mul(V::levels(bytes), a)),
            CENTERED => V::mul(V::sub(V::levels(bytes), V::splat(mid)), a),
            TABLE => V::mul(V::lookup(bytes, table), a),
            E5M2 => V::mul(V::e5m2(bytes), a),
            E4M3 => V::mul(V::e4m3_scaled(bytes), V::mul(a, V::splat(256.0))),
            _ => unreachable!("not a level map constant"),
        }
    }
}

impl<const MAP: u8, const SHARED: bool> Load for Levels<'_, MAP, SHARED> {
    /// The row's first level and its first group.
    type Row = (usize, usize);

    fn ch(self) -> usize {
        self.layout.ch
    }

    fn len(self) -> usize {
        self.layout.rows.levels.len()
    }

    #[inline(always)]
    fn row(self, t: usize) -> (usize, usize) {
        let g = match self.layout.row_step {
            Some(n) => t * n,
            None => self.layout.rows.group_index(t, 0),
        };
        (t * self.layout.ch, g)
    }

    #[inline(always)]
    unsafe fn load<V: Lanes>(self, (row, g): (usize, usize), col: usize) -> V {
        let i = row + col;
        debug_assert!(i + 16 <= self.layout.rows.levels.len());
        // SAFETY: bytes `i..i + 16` are inside the slice; the groups read
        // exist ([`Levels::parameters`]).
        unsafe {
            let bytes = V::bytes(self.layout.rows.levels.as_ptr().add(i));
            let (a, b) = self.parameters::<V>(g, col, 16);
            dequantize::<V, MAP>(self.mid, self.table, bytes, a, b)
        }
    }

    /// [`load`](Self::load)'s arithmetic on the `n` levels and their
    /// parameters (zero above `n`, so those lanes hold `b + 0·a` with
    /// finite parameters: the passes never use them).
    #[inline(always)]
    unsafe fn load_partial<V: Lanes>(self, (row, g): (usize, usize), col: usize, n: usize) -> V {
        let i = row + col;
        debug_assert!(i + n <= self.layout.rows.levels.len() && n < 16);
        // SAFETY: the `n` bytes read are inside the slice; the groups read
        // exist ([`Levels::parameters`]).
        unsafe {
            let bytes = V::bytes_partial(self.layout.rows.levels.as_ptr().add(i), n);
            let (a, b) = self.parameters::<V>(g, col, n);
            dequantize::<V, MAP>(self.mid, self.table, bytes, a, b)
        }
    }
}

/// `channel / channels_per_group` without a division instruction: a shift
/// for powers of two, else a multiply by `⌈2^32 / cpg⌉` and a shift, exact
/// for every channel of the row ([`GroupDivisor::new`] checks the bound).
#[derive(Clone, Copy, Debug)]
pub(super) struct GroupDivisor {
    magic: u64,
    shift: u32,
}

impl GroupDivisor {
    /// The divisor for groups of `cpg` channels in rows of `ch` channels;
    /// `None` if the multiply-shift is not exact up to `ch`.
    pub(super) fn new(cpg: usize, ch: usize) -> Option<Self> {
        if cpg.is_power_of_two() {
            return Some(Self {
                magic: 1,
                shift: cpg.trailing_zeros(),
            });
        }
        // With m = ⌈2^32 / cpg⌉ = (2^32 + e) / cpg and x = q·cpg + r,
        // x·m / 2^32 = q + r/cpg + x·e / (cpg·2^32), whose floor is q while
        // x·e < 2^32 (as r <= cpg − 1): true for every x < ch if ch·e < 2^32.
        let magic = (1u64 << 32).div_ceil(cpg as u64);
        let excess = magic * cpg as u64 - (1u64 << 32);
        ((ch as u64).checked_mul(excess)? < 1u64 << 32).then_some(Self { magic, shift: 32 })
    }

    #[inline(always)]
    pub(super) fn of(self, channel: usize) -> usize {
        ((channel as u64 * self.magic) >> self.shift) as usize
    }
}
