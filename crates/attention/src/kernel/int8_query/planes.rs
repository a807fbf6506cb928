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
#[inline(always)]
pub(crate) fn split_planes(codes: &[i8], planes: &mut [i8]) {
    for (block, out) in codes
        .chunks(PLANE_BLOCK)
        .zip(planes.chunks_mut(PLANE_BLOCK))
    {
        if let (Ok(block), Ok(out)) = (
            <&[i8; PLANE_BLOCK]>::try_from(block),
            <&mut [i8; PLANE_BLOCK]>::try_from(&mut *out),
        ) {
            split_block(block, out);
            continue;
        }
        let (even, odd) = out.split_at_mut(block.len() / 2);
        for ((pair, e), o) in block.chunks_exact(2).zip(even).zip(odd) {
            (*e, *o) = (pair[0], pair[1]);
        }
    }
}

/// One whole block, as 16-bit words whose low bytes are the even codes and
/// high bytes the odd ones: fixed sizes and narrowing casts, which the
/// compiler vectorises (the byte loop stayed scalar: 6% of a per-channel
/// decode that folds its keys' scales into the query, `perf`).
#[inline(always)]
fn split_block(block: &[i8; PLANE_BLOCK], out: &mut [i8; PLANE_BLOCK]) {
    let words: [u16; PLANE_BLOCK / 2] =
        std::array::from_fn(|i| u16::from_le_bytes([block[2 * i] as u8, block[2 * i + 1] as u8]));
    let (even, odd) = out.split_at_mut(PLANE_BLOCK / 2);
    for ((e, o), w) in even.iter_mut().zip(odd.iter_mut()).zip(words) {
        *e = w as u8 as i8;
        *o = (w >> 8) as u8 as i8;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole blocks and a shorter last block put channel `c` where
    /// [`plane_index`] says.
    #[test]
    fn codes_land_where_plane_index_says() {
        for len in [128, 256, 64, 96, 320, 2] {
            let codes: Vec<i8> = (0..len).map(|c| (c * 7 % 251) as u8 as i8).collect();
            let mut planes = vec![0i8; len];
            split_planes(&codes, &mut planes);
            for (c, &code) in codes.iter().enumerate() {
                assert_eq!(planes[plane_index(c, len)], code, "channel {c} of {len}");
            }
        }
    }
}
