//! The query codes of levels packed two per byte
//! ([`LevelPacking::Nibbles`](kv_quant::LevelPacking::Nibbles)): a row's
//! low nibbles are its even channels and its high nibbles its odd ones, so
//! each head's int8 codes are also kept split, block by block, the even
//! channels' codes before the odd ones', and one byte vector meets two
//! code vectors.

/// Channels per block of the split codes of packed levels.
pub(crate) const PLANE_BLOCK: usize = 128;

/// Splits one head's int8 codes (an even number) block by block: each
/// block of [`PLANE_BLOCK`] channels (the last one shorter) holds its even
/// channels' codes, then its odd channels'.
pub(crate) fn split_planes(codes: &[i8], planes: &mut [i8]) {
    for (block, out) in codes
        .chunks(PLANE_BLOCK)
        .zip(planes.chunks_mut(PLANE_BLOCK))
    {
        let (even, odd) = out.split_at_mut(block.len() / 2);
        for ((pair, e), o) in block.chunks_exact(2).zip(even).zip(odd) {
            (*e, *o) = (pair[0], pair[1]);
        }
    }
}

/// Where [`split_planes`] puts channel `c` of a segment of `len` channels
/// that starts a block.
#[inline(always)]
pub(crate) fn plane_index(c: usize, len: usize) -> usize {
    let base = c / PLANE_BLOCK * PLANE_BLOCK;
    let half = (len - base).min(PLANE_BLOCK) / 2;
    base + (c - base) / 2 + if c % 2 == 1 { half } else { 0 }
}
