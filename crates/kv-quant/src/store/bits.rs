//! Bit helpers of the stores: metadata words, erasure bitmaps, and the
//! nibble view of a packed code stream that the codes protect.

/// A little-endian metadata word of 2 or 4 bytes.
#[inline]
pub(crate) fn read_word(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .enumerate()
        .fold(0, |w, (i, &b)| w | u32::from(b) << (8 * i))
}

/// Sets bits `from..from + n` of a bitmap.
pub(crate) fn set_bits(words: &mut [u64], from: usize, n: usize) {
    let (mut bit, end) = (from, from + n);
    while bit < end {
        let (w, shift) = (bit / 64, bit % 64);
        let take = (64 - shift).min(end - bit);
        let mask = if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << shift
        };
        words[w] |= mask;
        bit += take;
    }
}

/// Copies bits `from..from + n` of the bitmap `src` to bits `0..n` of `dst`.
pub(crate) fn copy_bits(src: &[u64], from: usize, dst: &mut [u64], n: usize) {
    for (i, d) in dst.iter_mut().enumerate() {
        let bit = from + 64 * i;
        let (w, shift) = (bit / 64, bit % 64);
        let mut v = src[w] >> shift;
        if shift != 0
            && let Some(&next) = src.get(w + 1)
        {
            v |= next << (64 - shift);
        }
        let left = n - 64 * i;
        *d = if left < 64 {
            v & ((1u64 << left) - 1)
        } else {
            v
        };
    }
}

/// The first `out.len()` nibbles of `bytes` (nibble `2i` the low half of
/// byte `i`, `2i + 1` the high half).
#[inline]
pub(crate) fn bytes_to_nibbles(bytes: &[u8], out: &mut [u8]) {
    let mut pairs = out.chunks_exact_mut(2);
    for (pair, &b) in (&mut pairs).zip(bytes) {
        pair[0] = b & 0xF;
        pair[1] = b >> 4;
    }
    if let [last] = pairs.into_remainder() {
        *last = bytes[bytes.len() - 1] & 0xF;
    }
}

/// The bytes of a nibble stream (the inverse of [`bytes_to_nibbles`]; a
/// final odd nibble fills the low half of the last byte).
#[inline]
pub(crate) fn nibbles_to_bytes(nibbles: &[u8], out: &mut [u8]) {
    for (o, pair) in out.iter_mut().zip(nibbles.chunks(2)) {
        *o = pair[0] | pair.get(1).map_or(0, |&h| h << 4);
    }
}

/// Marks in `values` (a per-value bitmap of one row) the values whose code
/// bits overlap an erased nibble of `nibbles` (a per-nibble bitmap of the
/// same row, `count` nibbles). Codes are `code_bits` wide and stand for
/// `per_code` values each.
pub(crate) fn erase_values_of_nibbles(
    nibbles: &[u64],
    count: usize,
    code_bits: usize,
    per_code: usize,
    channels: usize,
    values: &mut [u64],
) {
    for (w, &word) in nibbles.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let i = 64 * w + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if i >= count {
                break;
            }
            let first = 4 * i / code_bits;
            let last = ((4 * i + 3) / code_bits).min(channels / per_code - 1);
            if first * per_code >= channels {
                continue;
            }
            set_bits(values, first * per_code, (last + 1 - first) * per_code);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibbles_round_trip_and_map_to_the_codes_they_hold() {
        let bytes = [0x21u8, 0x43, 0x65];
        let mut n = [0u8; 5];
        bytes_to_nibbles(&bytes, &mut n);
        assert_eq!(n, [1, 2, 3, 4, 5]);
        let mut back = [0u8; 3];
        nibbles_to_bytes(&n, &mut back);
        assert_eq!(back, [0x21, 0x43, 0x05]);
        // 3-bit codes: nibble 1 (bits 4..8) overlaps codes 1 (bits 3..6) and 2 (6..9).
        let mut values = [0u64];
        erase_values_of_nibbles(&[0b10], 6, 3, 1, 8, &mut values);
        assert_eq!(values[0], 0b110);
        // 8-bit codes: nibble 3 is the high half of code 1.
        let mut values = [0u64];
        erase_values_of_nibbles(&[0b1000], 8, 8, 1, 4, &mut values);
        assert_eq!(values[0], 0b10);
        // 16-bit codes: nibbles 4..8 are value 1.
        let mut values = [0u64];
        erase_values_of_nibbles(&[1 << 5], 16, 16, 1, 4, &mut values);
        assert_eq!(values[0], 0b10);
        // 8-bit vq codes of 4 values: nibble 2 is code 1, values 4..8.
        let mut values = [0u64];
        erase_values_of_nibbles(&[0b100], 4, 8, 4, 8, &mut values);
        assert_eq!(values[0], 0xF0);
        let mut bitmap = [0u64; 2];
        set_bits(&mut bitmap, 60, 8);
        assert_eq!(bitmap, [0xF << 60, 0xF]);
        let mut out = [0u64];
        copy_bits(&bitmap, 60, &mut out, 8);
        assert_eq!(out, [0xFF]);
    }
}
