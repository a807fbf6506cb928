//! [`WeightGuard`]: integrity of one projection's stored weights. Each row
//! of stored bytes carries a CRC-32, and each group of interleaved rows
//! one XOR parity row. A damaged row is found by its CRC, then repaired in
//! two ways:
//!
//! - **one flipped bit, by the CRC alone**: CRC-32 (IEEE) has Hamming
//!   distance 4 for messages up to 91,607 bits (Koopman), so in rows of
//!   up to 11,450 bytes a single-bit error's syndrome (the CRC of the row
//!   as read XOR the stored one) names its bit, and no double-bit error
//!   has the syndrome of a single one: single-error correction and
//!   double-error detection per row;
//! - **anything else, by parity**: the row is rebuilt as the parity row
//!   XOR the group's other rows, as a RAID-5 stripe rebuilds a lost disk,
//!   where it is the only row of its group the CRC could not repair.
//!
//! Rows are grouped by interleaving (row `r` in group `r mod groups`), so
//! a burst across neighbouring rows lands in different groups. Rows left
//! (two or more with multi-bit damage in one group, or one beside a
//! damaged parity row) are reported. A damaged parity row beside clean
//! data rows is recomputed. The guard costs
//! `1/rows_per_group` of the weights for parity plus 4 bytes per row, and
//! a check reads every stored byte once (CRC-32 with carry-less multiply,
//! crc32fast).
//!
//! The guard covers the projections' bytes as stored (each part of a
//! stacked [`StoredLinear`](crate::weights::StoredLinear), or a dense f32
//! matrix's values); norms and biases are not projections and are not
//! covered.

use rayon::prelude::*;

use super::Projection;
use crate::error::{ModelError, Result};

/// Rows per parity group unless told otherwise: 1/32 of the weights in
/// parity.
pub const DEFAULT_ROWS_PER_GROUP: usize = 32;

/// What one [`WeightGuard::check`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardReport {
    /// Rows whose CRC was checked.
    pub rows: u64,
    /// Rows whose CRC did not match.
    pub damaged: u64,
    /// Damaged rows repaired (their CRC matches again).
    pub repaired: u64,
    /// Of those, rows repaired from their CRC alone (one flipped bit).
    pub repaired_by_crc: u64,
    /// Damaged rows left as they are (another damaged row or a damaged
    /// parity row in their group).
    pub unrepaired: u64,
    /// Parity rows found damaged and recomputed from clean data rows.
    pub parity_rebuilt: u64,
}

impl std::ops::AddAssign for GuardReport {
    fn add_assign(&mut self, o: Self) {
        self.rows += o.rows;
        self.damaged += o.damaged;
        self.repaired += o.repaired;
        self.repaired_by_crc += o.repaired_by_crc;
        self.unrepaired += o.unrepaired;
        self.parity_rebuilt += o.parity_rebuilt;
    }
}

/// How a damaged row was repaired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowRepair {
    /// One flipped bit, located by the row's CRC syndrome.
    SingleBit,
    /// Rebuilt from its group's parity row and other rows.
    Parity,
}

/// The fate of one damaged row in a [`WeightGuard::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DamagedRow {
    /// The stored segment (a stacked part) the row is in.
    pub segment: usize,
    /// The row within its segment.
    pub row: usize,
    /// How it was repaired, or `None` where it was left.
    pub repair: Option<RowRepair>,
}

/// One projection's CRCs and parity rows: a CRC-32 per row of stored
/// bytes, an XOR parity row per group of interleaved rows.
#[derive(Clone, Debug)]
pub struct WeightGuard {
    segments: Vec<SegmentGuard>,
}

/// The guard of one segment: `rows` rows of `row_bytes` bytes.
#[derive(Clone, Debug)]
struct SegmentGuard {
    row_bytes: usize,
    rows: usize,
    groups: usize,
    row_crcs: Vec<u32>,
    /// `groups` parity rows, `row_bytes` each.
    parity: Vec<u8>,
    parity_crcs: Vec<u32>,
}

impl WeightGuard {
    /// The guard of `weights` as they are now, in groups of
    /// `rows_per_group` interleaved rows (at least 1; a segment with fewer
    /// rows forms one group).
    pub fn new(weights: &Projection, rows_per_group: usize) -> Result<Self> {
        if rows_per_group == 0 {
            return Err(ModelError::InvalidParameter {
                name: "rows_per_group",
                reason: "must be at least 1".into(),
            });
        }
        let segments = weights
            .byte_rows()
            .into_iter()
            .map(|(bytes, row_bytes)| SegmentGuard::new(bytes, row_bytes, rows_per_group))
            .collect();
        Ok(Self { segments })
    }

    /// Bytes the guard keeps (CRCs and parity rows).
    pub fn bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.parity.len() + 4 * (s.row_crcs.len() + s.parity_crcs.len()))
            .sum()
    }

    /// Checks every row of `weights` against its CRC without changing
    /// anything: the damaged rows, none marked repaired.
    pub fn verify(&self, weights: &Projection) -> Result<Vec<DamagedRow>> {
        let rows = weights.byte_rows();
        self.check_shape(rows.iter().map(|&(b, rb)| (b.len(), rb)))?;
        Ok(self
            .segments
            .iter()
            .zip(&rows)
            .enumerate()
            .flat_map(|(segment, (guard, &(bytes, _)))| {
                guard
                    .damaged_rows(bytes)
                    .into_iter()
                    .map(move |row| DamagedRow {
                        segment,
                        row,
                        repair: None,
                    })
            })
            .collect())
    }

    /// Checks every row of `weights` and repairs what it can: a row with
    /// one flipped bit from its CRC, then each group with one row left
    /// damaged and a clean parity row gets the row back from parity; a
    /// damaged parity row beside clean rows is recomputed. Returns the
    /// counts and every damaged row's fate.
    pub fn check(&mut self, weights: &mut Projection) -> Result<(GuardReport, Vec<DamagedRow>)> {
        let mut rows = weights.byte_rows_mut();
        self.check_shape(rows.iter().map(|(b, rb)| (b.len(), *rb)))?;
        let mut report = GuardReport::default();
        let mut fates = Vec::new();
        for (segment, (guard, (bytes, _))) in self.segments.iter_mut().zip(&mut rows).enumerate() {
            report.rows += guard.rows as u64;
            for (row, repair) in guard.check(bytes, &mut report) {
                fates.push(DamagedRow {
                    segment,
                    row,
                    repair,
                });
            }
        }
        Ok((report, fates))
    }

    /// Refuses weights of another layout than the guard was built for.
    fn check_shape(&self, rows: impl ExactSizeIterator<Item = (usize, usize)>) -> Result<()> {
        if rows.len() != self.segments.len() {
            return Err(ModelError::ShapeMismatch {
                what: "stored segments guarded (segments)",
                expected: self.segments.len(),
                got: rows.len(),
            });
        }
        for (guard, (len, row_bytes)) in self.segments.iter().zip(rows) {
            if row_bytes != guard.row_bytes || len != guard.rows * guard.row_bytes {
                return Err(ModelError::ShapeMismatch {
                    what: "guarded segment (bytes)",
                    expected: guard.rows * guard.row_bytes,
                    got: len,
                });
            }
        }
        Ok(())
    }
}

impl SegmentGuard {
    fn new(bytes: &[u8], row_bytes: usize, rows_per_group: usize) -> Self {
        let rows = bytes.len().checked_div(row_bytes).unwrap_or(0);
        let groups = rows.div_ceil(rows_per_group).max(1);
        let row_crcs: Vec<u32> = bytes
            .par_chunks(row_bytes.max(1))
            .map(crc32fast::hash)
            .collect();
        let mut parity = vec![0u8; groups * row_bytes];
        for (r, row) in bytes.chunks(row_bytes.max(1)).enumerate() {
            xor_into(&mut parity[(r % groups) * row_bytes..][..row_bytes], row);
        }
        let parity_crcs = parity
            .chunks(row_bytes.max(1))
            .map(crc32fast::hash)
            .collect();
        Self {
            row_bytes,
            rows,
            groups,
            row_crcs,
            parity,
            parity_crcs,
        }
    }

    /// Rows of `bytes` whose CRC does not match, in order.
    fn damaged_rows(&self, bytes: &[u8]) -> Vec<usize> {
        if self.row_bytes == 0 {
            return Vec::new();
        }
        bytes
            .par_chunks(self.row_bytes)
            .zip(&self.row_crcs)
            .enumerate()
            .filter_map(|(r, (row, &crc))| (crc32fast::hash(row) != crc).then_some(r))
            .collect()
    }

    /// Checks and repairs (see [`WeightGuard::check`]); each damaged row
    /// with how it was repaired.
    fn check(
        &mut self,
        bytes: &mut [u8],
        report: &mut GuardReport,
    ) -> Vec<(usize, Option<RowRepair>)> {
        let rb = self.row_bytes;
        let mut fates = Vec::new();
        let mut left = Vec::new();
        for r in self.damaged_rows(bytes) {
            let row = &mut bytes[r * rb..][..rb];
            let syndrome = crc32fast::hash(row) ^ self.row_crcs[r];
            match single_bit_error(syndrome, rb) {
                Some(bit) => {
                    row[bit / 8] ^= 1 << (bit % 8);
                    debug_assert_eq!(crc32fast::hash(row), self.row_crcs[r]);
                    fates.push((r, Some(RowRepair::SingleBit)));
                }
                None => left.push(r),
            }
        }
        let mut by_group = vec![0usize; self.groups];
        for &r in &left {
            by_group[r % self.groups] += 1;
        }
        for &r in &left {
            let g = r % self.groups;
            let parity = &self.parity[g * rb..][..rb];
            let parity_clean = crc32fast::hash(parity) == self.parity_crcs[g];
            let repaired = by_group[g] == 1 && parity_clean && {
                let mut rebuilt = parity.to_vec();
                for other in (g..self.rows).step_by(self.groups).filter(|&o| o != r) {
                    xor_into(&mut rebuilt, &bytes[other * rb..][..rb]);
                }
                // The rebuilt row is taken only if its CRC matches: the
                // other rows passed theirs, so it does unless a CRC missed.
                crc32fast::hash(&rebuilt) == self.row_crcs[r] && {
                    bytes[r * rb..][..rb].copy_from_slice(&rebuilt);
                    true
                }
            };
            fates.push((r, repaired.then_some(RowRepair::Parity)));
        }
        for &(_, repair) in &fates {
            report.damaged += 1;
            match repair {
                Some(how) => {
                    report.repaired += 1;
                    report.repaired_by_crc += u64::from(how == RowRepair::SingleBit);
                }
                None => report.unrepaired += 1,
            }
        }
        // Parity rows of groups whose data rows are all clean.
        for (g, &left_in_group) in by_group.iter().enumerate() {
            let parity = &self.parity[g * rb..][..rb];
            if left_in_group == 0 && crc32fast::hash(parity) != self.parity_crcs[g] {
                let mut fresh = vec![0u8; rb];
                for r in (g..self.rows).step_by(self.groups) {
                    xor_into(&mut fresh, &bytes[r * rb..][..rb]);
                }
                self.parity[g * rb..][..rb].copy_from_slice(&fresh);
                self.parity_crcs[g] = crc32fast::hash(&fresh);
                report.parity_rebuilt += 1;
            }
        }
        fates
    }
}

/// Longest row (in bits) over which CRC-32 keeps Hamming distance 4
/// (Koopman's tables for 0x04C11DB7), so that a single-bit syndrome is
/// unique and no double-bit error shares one.
const SINGLE_BIT_MAX_BITS: usize = 91_607;

/// The reflected CRC-32 table (polynomial 0xEDB88320), as crc32fast
/// computes the IEEE CRC.
const CRC_TABLE: [u32; 256] = crc_table();

const fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

/// The bit (`8·byte + bit`) whose flip in a row of `row_bytes` bytes
/// gives CRC syndrome `syndrome`, if one does. The CRC is affine, so for
/// rows of one length `crc(a) ^ crc(b)` is the register-only CRC of
/// `a ^ b`: a lone set bit `b` of byte `j` leaves `TABLE[1 << b]` in the
/// register, shifted through the `row_bytes − 1 − j` zero bytes after it.
/// Scans 8 registers from the last byte to the first: `8·row_bytes`
/// steps.
fn single_bit_error(syndrome: u32, row_bytes: usize) -> Option<usize> {
    if syndrome == 0 || row_bytes.saturating_mul(8) > SINGLE_BIT_MAX_BITS {
        return None;
    }
    let mut registers: [u32; 8] = std::array::from_fn(|b| CRC_TABLE[1 << b]);
    for j in (0..row_bytes).rev() {
        if let Some(b) = registers.iter().position(|&r| r == syndrome) {
            return Some(8 * j + b);
        }
        for r in &mut registers {
            *r = (*r >> 8) ^ CRC_TABLE[(*r & 0xFF) as usize];
        }
    }
    None
}

/// `acc ^= row`, byte by byte (the compiler vectorises it).
fn xor_into(acc: &mut [u8], row: &[u8]) {
    for (a, b) in acc.iter_mut().zip(row) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{QuantMatrix, StoredLinear, WeightType};
    use abft_gemm::Matrix;
    use proptest::prelude::*;

    /// Stacked Q4_1 (5 rows) and Q8_0 (3 rows) parts of 64 columns, bytes
    /// from `seed`.
    fn stacked(seed: u64) -> Projection {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect()
        };
        let part = |ty, rows, bytes: &mut dyn FnMut(usize) -> Vec<u8>| {
            let len = QuantMatrix::data_len(ty, rows, 64).unwrap();
            QuantMatrix::new(ty, rows, 64, bytes(len)).unwrap()
        };
        let a = part(WeightType::Q4_1, 5, &mut bytes);
        let b = part(WeightType::Q8_0, 3, &mut bytes);
        Projection::Stored(StoredLinear::new(vec![a, b]).unwrap())
    }

    fn flip(p: &mut Projection, segment: usize, bit: usize) {
        p.byte_rows_mut()[segment].0[bit / 8] ^= 1 << (bit % 8);
    }

    fn same_bytes(a: &Projection, b: &Projection) -> bool {
        a.byte_rows() == b.byte_rows()
    }

    #[test]
    fn clean_weights_pass_and_stay() {
        let mut p = stacked(1);
        let before = p.clone();
        let mut guard = WeightGuard::new(&p, 2).unwrap();
        assert!(guard.verify(&p).unwrap().is_empty());
        let (report, fates) = guard.check(&mut p).unwrap();
        assert_eq!(report.rows, 8);
        assert_eq!((report.damaged, report.parity_rebuilt), (0, 0));
        assert!(fates.is_empty());
        assert!(same_bytes(&p, &before));
        // Parity: ceil(5/2) + ceil(3/2) rows; a CRC per row and parity row.
        let (q41, q80) = (2 * 20, 2 * 34); // bytes per row
        assert_eq!(guard.bytes(), 3 * q41 + 2 * q80 + 4 * (8 + 5));
    }

    /// Every single bit flip of every segment is found and repaired from
    /// the row's CRC alone to the original bytes (exhaustive: 3,232
    /// flips).
    #[test]
    fn every_single_flip_is_repaired_exactly() {
        let clean = stacked(2);
        let mut guard = WeightGuard::new(&clean, 3).unwrap();
        let sizes: Vec<usize> = clean.byte_rows().iter().map(|(b, _)| b.len()).collect();
        for (segment, &len) in sizes.iter().enumerate() {
            let row_bytes = clean.byte_rows()[segment].1;
            for bit in 0..8 * len {
                let mut p = clean.clone();
                flip(&mut p, segment, bit);
                let damaged = guard.verify(&p).unwrap();
                let row = bit / 8 / row_bytes;
                assert_eq!(
                    damaged,
                    [DamagedRow {
                        segment,
                        row,
                        repair: None
                    }]
                );
                let (report, fates) = guard.check(&mut p).unwrap();
                assert_eq!(
                    (report.damaged, report.repaired, report.repaired_by_crc),
                    (1, 1, 1),
                    "bit {bit}"
                );
                assert_eq!(fates[0].repair, Some(RowRepair::SingleBit));
                assert!(same_bytes(&p, &clean), "segment {segment} bit {bit}");
            }
        }
    }

    proptest! {
        /// A single-bit syndrome names its bit; no double-bit error in a
        /// row of up to 11,450 bytes has a single bit's syndrome.
        #[test]
        fn syndromes_name_single_bits_and_never_double_ones(
            row in proptest::collection::vec(any::<u8>(), 1..2000),
            a in any::<usize>(),
            b in any::<usize>(),
        ) {
            let bits = 8 * row.len();
            let (a, b) = (a % bits, b % bits);
            let crc = crc32fast::hash(&row);
            let mut one = row.clone();
            one[a / 8] ^= 1 << (a % 8);
            prop_assert_eq!(single_bit_error(crc32fast::hash(&one) ^ crc, row.len()), Some(a));
            if a != b {
                one[b / 8] ^= 1 << (b % 8);
                prop_assert_eq!(single_bit_error(crc32fast::hash(&one) ^ crc, row.len()), None);
            }
        }

        /// Random flips: a row with one flipped bit is repaired by its
        /// CRC; a row with more is rebuilt from parity exactly when it is
        /// the only such row of its group; every repaired row is the
        /// original.
        #[test]
        fn rows_are_repaired_by_crc_or_parity(
            seed in 0u64..1000,
            per_group in 1usize..6,
            flips in proptest::collection::vec((0usize..2, 0usize..8 * 5 * 40), 1..8),
        ) {
            let clean = stacked(seed);
            let mut guard = WeightGuard::new(&clean, per_group).unwrap();
            let mut p = clean.clone();
            let geometry: Vec<(usize, usize)> =
                clean.byte_rows().iter().map(|(b, rb)| (b.len(), *rb)).collect();
            for &(segment, bit) in &flips {
                // Clustered in the first rows, so rows take several flips.
                let bit = bit % (8 * geometry[segment].0);
                flip(&mut p, segment, bit);
            }
            // Differing bits per damaged row (segment, row).
            let mut damaged = std::collections::BTreeMap::new();
            for (s, &(_, rb)) in geometry.iter().enumerate() {
                let (a, b) = (clean.byte_rows()[s].0.to_vec(), p.byte_rows()[s].0.to_vec());
                for r in 0..a.len() / rb {
                    let bits: u32 = (r * rb..(r + 1) * rb).map(|i| (a[i] ^ b[i]).count_ones()).sum();
                    if bits > 0 {
                        damaged.insert((s, r), bits);
                    }
                }
            }
            let (report, fates) = guard.check(&mut p).unwrap();
            prop_assert_eq!(report.damaged as usize, damaged.len());
            for f in &fates {
                let bits = damaged[&(f.segment, f.row)];
                let groups = (geometry[f.segment].0 / geometry[f.segment].1).div_ceil(per_group);
                let multi_in_group = damaged
                    .iter()
                    .filter(|&(&(s, r), &n)| s == f.segment && r % groups == f.row % groups && n > 1)
                    .count();
                let expected = match bits {
                    1 => Some(RowRepair::SingleBit),
                    _ if multi_in_group == 1 => Some(RowRepair::Parity),
                    _ => None,
                };
                prop_assert_eq!(f.repair, expected);
                if f.repair.is_some() {
                    let rb = geometry[f.segment].1;
                    prop_assert_eq!(
                        &p.byte_rows()[f.segment].0[f.row * rb..][..rb],
                        &clean.byte_rows()[f.segment].0[f.row * rb..][..rb]
                    );
                }
            }
        }
    }

    #[test]
    fn a_damaged_parity_row_is_recomputed_or_blocks_its_group() {
        let clean = stacked(3);
        let mut guard = WeightGuard::new(&clean, 2).unwrap();
        // Parity alone: recomputed, the data untouched.
        guard.segments[0].parity[5] ^= 0x10;
        let mut p = clean.clone();
        let (report, _) = guard.check(&mut p).unwrap();
        assert_eq!((report.damaged, report.parity_rebuilt), (0, 1));
        assert!(same_bytes(&p, &clean));
        // Two bits of row 0 (group 0): rebuilt from parity.
        flip(&mut p, 0, 3);
        flip(&mut p, 0, 77);
        let (report, fates) = guard.check(&mut p).unwrap();
        assert_eq!((report.repaired, report.repaired_by_crc), (1, 0));
        assert_eq!(fates[0].repair, Some(RowRepair::Parity));
        assert!(same_bytes(&p, &clean));
        // The same beside a damaged parity row: the row is left, reported.
        guard.segments[0].parity[5] ^= 0x10;
        flip(&mut p, 0, 3);
        flip(&mut p, 0, 77);
        let (report, fates) = guard.check(&mut p).unwrap();
        assert_eq!((report.damaged, report.unrepaired), (1, 1));
        assert_eq!(fates[0].repair, None);
    }

    #[test]
    fn dense_weights_are_guarded_as_their_f32_bytes() {
        let values: Vec<f32> = (0..6 * 10).map(|i| i as f32 * 0.25 - 3.0).collect();
        let clean = Projection::Dense(Matrix::new(6, 10, values).unwrap());
        let mut guard = WeightGuard::new(&clean, 4).unwrap();
        let mut p = clean.clone();
        flip(&mut p, 0, 8 * 4 * 23 + 30); // an exponent bit of value 23
        assert_ne!(p.dense().unwrap().data[23], clean.dense().unwrap().data[23]);
        let (report, _) = guard.check(&mut p).unwrap();
        assert_eq!(report.repaired, 1);
        assert_eq!(p.dense().unwrap().data, clean.dense().unwrap().data);
    }

    #[test]
    fn rows_past_hamming_distance_four_are_left_to_parity() {
        assert_eq!(single_bit_error(CRC_TABLE[1], 11_451), None);
        assert_eq!(single_bit_error(CRC_TABLE[1], 11_450), Some(8 * 11_449));
        assert_eq!(single_bit_error(0, 10), None);
    }

    #[test]
    fn other_shapes_and_empty_groups_are_refused() {
        assert!(matches!(
            WeightGuard::new(&stacked(4), 0),
            Err(ModelError::InvalidParameter {
                name: "rows_per_group",
                ..
            })
        ));
        let mut guard = WeightGuard::new(&stacked(4), 2).unwrap();
        let mut other = Projection::Dense(Matrix::new(8, 16, vec![0.0; 128]).unwrap());
        assert!(matches!(
            guard.verify(&other),
            Err(ModelError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            guard.check(&mut other),
            Err(ModelError::ShapeMismatch { .. })
        ));
    }
}
