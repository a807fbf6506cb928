//! Shard's key path (`shard-kv-compression-blog.md`, section 5): one PCA
//! basis per layer over the keys of all KV heads concatenated, with RoPE
//! undone by the caller; a dynamic program that gives each group of
//! principal components 0, 2, 4, 6 or 8 bits under a budget, dropping a
//! component costing four times its variance; symmetric integer
//! coefficients with one f16 scale per component; an int8 basis with one
//! f16 scale per component.
//!
//! Layout of the stored codes: one row of `row_bytes` bytes per token, the
//! kept groups one after another in component order, each group's codes
//! packed least-significant bit first at its width, biased by `2^(b−1)` so a
//! `b`-bit code `u ∈ [1, 2^b − 1]` stands for `(u − 2^(b−1))·scale`. Group
//! sizes are multiples of 4, so every group fills whole bytes.

use std::sync::Arc;

use crate::basis::{Basis, BasisStorage, Spectrum};
use crate::error::{LowRankError, Result, check_finite, check_len};
use half::f16;

mod allocation;
mod fit;
pub use allocation::{BIT_OPTIONS, DROP_PENALTY, allocate_bits, allocation_error};
use fit::fit_basis;

/// One group of kept components as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyGroup {
    /// First kept component of the group.
    pub start: usize,
    /// Components in the group (a multiple of 4).
    pub len: usize,
    /// Bits per coefficient (2, 4, 6 or 8).
    pub bits: u8,
    /// Byte offset of the group within a token's row of codes.
    pub offset: usize,
}

/// The keys of one layer's compressed middle (`tokens × dim`, RoPE undone,
/// all KV heads concatenated) as Shard stores them.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardKeys {
    dim: usize,
    tokens: usize,
    basis: Arc<Basis>,
    spectrum: Spectrum,
    allocation: Vec<u8>,
    groups: Vec<KeyGroup>,
    /// Per kept component, f16-rounded.
    scales: Vec<f32>,
    /// `tokens × row_bytes`.
    codes: Vec<u8>,
    row_bytes: usize,
}

impl ShardKeys {
    /// Fits the basis on `rows` (`tokens × dim`), allocates `budget` code
    /// bits per key value (of `dim` values per token) over groups of
    /// `group` components among the first `rank` (all when `None`, at most
    /// `tokens − 1`), and stores the coefficients.
    pub fn fit(
        rows: &[f32],
        tokens: usize,
        dim: usize,
        budget: f64,
        group: usize,
        rank: Option<usize>,
    ) -> Result<Self> {
        let full = fit_basis(rows, tokens, dim, budget, group, rank)?;
        Self::encode(rows, tokens, full, budget, group)
    }

    /// The tables [`fit`](Self::fit) fits on these rows
    /// (`fit(..)?.tables()`), without coding the rows: what a cache fitting
    /// a sequence's tables on its prefill keeps, before it codes the rows
    /// block by block with [`encode_chunk`](Self::encode_chunk).
    pub fn fit_tables(
        rows: &[f32],
        tokens: usize,
        dim: usize,
        budget: f64,
        group: usize,
        rank: Option<usize>,
    ) -> Result<Self> {
        let full = fit_basis(rows, tokens, dim, budget, group, rank)?;
        Ok(Self::allocate(rows, tokens, full, budget, group)?
            .0
            .tables())
    }

    /// Stores `rows` (`tokens × dim`) on a basis fitted elsewhere (a
    /// calibration text's keys, RoPE undone), allocating `budget` bits per
    /// key value over groups of `group` of its components.
    pub fn with_basis(
        rows: &[f32],
        tokens: usize,
        basis: &Basis,
        budget: f64,
        group: usize,
    ) -> Result<Self> {
        let dim = basis.dim();
        if rows.len() != tokens * dim {
            return Err(LowRankError::Bases(format!(
                "a basis of {dim} channels cannot store {tokens} rows of {} values \
                 (a calibration of another model?)",
                rows.len().checked_div(tokens).unwrap_or(0)
            )));
        }
        check_finite(rows, dim)?;
        if group == 0 || !group.is_multiple_of(4) || !basis.rank().is_multiple_of(4) {
            return Err(LowRankError::InvalidParameter {
                name: "group",
                reason: format!(
                    "groups of {group} over a basis of rank {} (both multiples of 4)",
                    basis.rank()
                ),
            });
        }
        if !(budget.is_finite() && budget > 0.0 && budget <= 8.0) {
            return Err(LowRankError::InvalidParameter {
                name: "key budget",
                reason: format!("{budget} bits per value cannot be met (more than 0, at most 8)"),
            });
        }
        Self::encode(rows, tokens, basis.clone(), budget, group)
    }

    /// Allocates bits over the components of `full` from their energies
    /// over `rows` and stores the kept ones' coefficients.
    fn encode(rows: &[f32], tokens: usize, full: Basis, budget: f64, group: usize) -> Result<Self> {
        let (header, spectrum) = Self::allocate(rows, tokens, full, budget, group)?;
        let (scales, codes) = quantize(
            &header.basis,
            &header.groups,
            header.row_bytes,
            rows,
            tokens,
        );
        Ok(Self {
            tokens,
            spectrum,
            scales,
            codes,
            ..header
        })
    }

    /// The kept components of `full` and their bits, allocated from their
    /// energies over `rows` (a store of no tokens), and those energies.
    fn allocate(
        rows: &[f32],
        tokens: usize,
        full: Basis,
        budget: f64,
        group: usize,
    ) -> Result<(Self, Spectrum)> {
        let dim = full.dim();
        let considered = full.rank();
        let budget_bits = (budget * dim as f64).floor() as usize;
        let sizes: Vec<usize> = (0..considered)
            .step_by(group)
            .map(|s| group.min(considered - s))
            .collect();
        let cheapest = 2 * sizes.iter().copied().min().unwrap_or(group);
        if budget_bits < cheapest {
            return Err(LowRankError::InvalidParameter {
                name: "key budget",
                reason: format!(
                    "{budget} bits per value ({budget_bits} bits per token of {dim} channels) \
                     cannot pay for one group of components at 2 bits ({cheapest} bits)"
                ),
            });
        }
        // Each component's energy over these rows (its eigenvalue when the
        // basis was fitted on them).
        let mut energy = vec![0.0f64; considered];
        let mut c = vec![0.0f32; considered];
        for row in rows.chunks_exact(dim) {
            full.project(row, &mut c);
            for (e, &x) in energy.iter_mut().zip(&c) {
                *e += f64::from(x) * f64::from(x);
            }
        }
        for e in &mut energy {
            *e /= tokens.max(1) as f64;
        }
        let spectrum = Spectrum {
            eigenvalues: energy,
        };
        let mut variances: Vec<f64> = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in &sizes {
            variances.push(spectrum.eigenvalues[start..start + len].iter().sum());
            start += len;
        }
        let allocation = allocate_bits(&variances, &sizes, budget_bits)?;
        Ok((Self::keep(&full, &sizes, allocation)?, spectrum))
    }

    /// A store of no tokens on `full`'s components kept by `allocation` (bits
    /// per group of `sizes` components): the kept rows (int8) and the
    /// groups as stored.
    fn keep(full: &Basis, sizes: &[usize], allocation: Vec<u8>) -> Result<Self> {
        let dim = full.dim();
        let (mut kept_rows, mut groups, mut offset, mut first) = (Vec::new(), Vec::new(), 0, 0);
        let mut start = 0;
        for (&len, &bits) in sizes.iter().zip(&allocation) {
            if bits > 0 {
                kept_rows.extend_from_slice(&full.rows()[start * dim..(start + len) * dim]);
                groups.push(KeyGroup {
                    start: first,
                    len,
                    bits,
                    offset,
                });
                first += len;
                offset += len * usize::from(bits) / 8;
            }
            start += len;
        }
        let basis = Arc::new(Basis::from_parts(
            dim,
            &kept_rows,
            full.mean(),
            BasisStorage::Int8,
        )?);
        Ok(Self {
            dim,
            tokens: 0,
            basis,
            spectrum: Spectrum::default(),
            allocation,
            groups,
            scales: Vec::new(),
            codes: Vec::new(),
            row_bytes: offset,
        })
    }

    /// The tables alone: the kept basis, the allocation and the groups, no
    /// tokens, and no spectrum (the energies are the fitted rows'). What a
    /// calibration keeps and writes for blocks coded with
    /// [`encode_chunk`](Self::encode_chunk); [`from_tables`](Self::from_tables)
    /// rebuilds it.
    pub fn tables(&self) -> Self {
        Self {
            spectrum: Spectrum::default(),
            ..self.clone_header()
        }
    }

    /// [`tables`](Self::tables) rebuilt from the full basis the allocation
    /// was made on (`considered × dim`, the components in order) and the
    /// bits of each group of `group` components (a calibration file's
    /// tables), or why they do not fit together.
    pub fn from_tables(full: &Basis, allocation: Vec<u8>, group: usize) -> Result<Self> {
        let considered = full.rank();
        if group == 0 || !group.is_multiple_of(4) || !considered.is_multiple_of(4) {
            return Err(LowRankError::InvalidParameter {
                name: "group",
                reason: format!(
                    "groups of {group} over a basis of rank {considered} (both multiples of 4)"
                ),
            });
        }
        let sizes: Vec<usize> = (0..considered)
            .step_by(group)
            .map(|s| group.min(considered - s))
            .collect();
        if allocation.len() != sizes.len() {
            return Err(LowRankError::InvalidParameter {
                name: "allocation",
                reason: format!(
                    "{} groups' bits for {} groups of {group} of {considered} components",
                    allocation.len(),
                    sizes.len()
                ),
            });
        }
        if let Some(b) = allocation
            .iter()
            .find(|&&b| !matches!(b, 0 | 2 | 4 | 6 | 8))
        {
            return Err(LowRankError::InvalidParameter {
                name: "allocation",
                reason: format!("{b} bits per coefficient (0, 2, 4, 6 or 8)"),
            });
        }
        Self::keep(full, &sizes, allocation)
    }

    /// Stores `rows` (`tokens × dim`, RoPE undone) on this basis and bit
    /// allocation, with scales of their own: a chunk of tokens folded into
    /// the compressed middle after the fit. The basis is shared, not copied
    /// ([`ShardKeys::shared_bytes`]).
    pub fn encode_chunk(&self, rows: &[f32], tokens: usize) -> Result<Self> {
        check_len("key rows (tokens × dim)", tokens * self.dim, rows.len())?;
        check_finite(rows, self.dim)?;
        let (scales, codes) = quantize(&self.basis, &self.groups, self.row_bytes, rows, tokens);
        Ok(Self {
            tokens,
            scales,
            codes,
            ..self.clone_header()
        })
    }

    /// Everything but the per-token codes and the scales.
    fn clone_header(&self) -> Self {
        Self {
            dim: self.dim,
            tokens: 0,
            basis: Arc::clone(&self.basis),
            spectrum: self.spectrum.clone(),
            allocation: self.allocation.clone(),
            groups: self.groups.clone(),
            scales: Vec::new(),
            codes: Vec::new(),
            row_bytes: self.row_bytes,
        }
    }

    /// Reads through the basis of `tables` (the same shape: a fitted table
    /// as faults left it, [`TableBytes`](kv_quant::TableBytes)), shared
    /// rather than copied.
    pub fn share_basis(&mut self, tables: &ShardKeys) -> Result<()> {
        if tables.basis.dim() != self.dim || tables.basis.rank() != self.basis.rank() {
            return Err(LowRankError::Bases(format!(
                "a basis of {} × {} for keys on {} × {}",
                tables.basis.rank(),
                tables.basis.dim(),
                self.basis.rank(),
                self.dim
            )));
        }
        self.basis = Arc::clone(&tables.basis);
        Ok(())
    }

    /// Key channels per token (all KV heads).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Tokens stored.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Components kept (those of groups with bits).
    pub fn kept(&self) -> usize {
        self.basis.rank()
    }

    /// The kept basis (`kept × dim`, int8 with f16 scales) and the mean.
    pub fn basis(&self) -> &Basis {
        &self.basis
    }

    /// The eigenvalues of the fitted covariance, descending.
    pub fn spectrum(&self) -> &Spectrum {
        &self.spectrum
    }

    /// Bits of each considered group, in component order (0: dropped).
    pub fn allocation(&self) -> &[u8] {
        &self.allocation
    }

    /// The kept groups as stored.
    pub fn groups(&self) -> &[KeyGroup] {
        &self.groups
    }

    /// Per kept component, the step of its codes.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Per kept component, the step of its codes, writable (f16 values held
    /// in f32: a fault experiment flips their f16 bits).
    pub fn scales_mut(&mut self) -> &mut [f32] {
        &mut self.scales
    }

    /// The packed codes, `tokens × row_bytes`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The packed codes, writable (fault injection, decoding through an
    /// error-correcting code).
    pub fn codes_mut(&mut self) -> &mut [u8] {
        &mut self.codes
    }

    /// The packed codes and the per-component steps, writable together (a
    /// block's stored bits decoded through its codes into both).
    pub fn codes_and_scales_mut(&mut self) -> (&mut [u8], &mut [f32]) {
        (&mut self.codes, &mut self.scales)
    }

    /// Bytes of one token's codes.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes held: codes, per-component scales (f16) and the basis
    /// (int8 rows, f16 row scales, f16 mean).
    pub fn stored_bytes(&self) -> usize {
        self.codes.len() + 2 * self.scales.len() + self.shared_bytes()
    }

    /// Bytes of the basis, which chunks encoded by
    /// [`encode_chunk`](Self::encode_chunk) share with this store.
    pub fn shared_bytes(&self) -> usize {
        self.basis.stored_bytes()
    }

    /// Coefficients of tokens `start..start + count` (`count × kept`).
    pub fn coefficients_into(&self, start: usize, count: usize, out: &mut [f32]) -> Result<()> {
        let kept = self.kept();
        check_len("coefficient tile (count × kept)", count * kept, out.len())?;
        if start + count > self.tokens {
            return Err(LowRankError::InvalidParameter {
                name: "token range",
                reason: format!("{start}..{} of {} tokens", start + count, self.tokens),
            });
        }
        if kept == 0 {
            return Ok(());
        }
        let rows = self.codes[start * self.row_bytes..(start + count) * self.row_bytes]
            .chunks_exact(self.row_bytes);
        for (row, c) in rows.zip(out.chunks_exact_mut(kept)) {
            for g in &self.groups {
                let bytes = &row[g.offset..g.offset + g.len * usize::from(g.bits) / 8];
                let scales = &self.scales[g.start..g.start + g.len];
                decode_group(bytes, g.bits, scales, &mut c[g.start..g.start + g.len]);
            }
        }
        Ok(())
    }

    /// The stored key of token `t` (`dim` values): `μ + c·B`.
    pub fn reconstruct_into(&self, t: usize, out: &mut [f32]) -> Result<()> {
        check_len("key row", self.dim, out.len())?;
        let mut c = vec![0.0f32; self.kept()];
        self.coefficients_into(t, 1, &mut c)?;
        self.basis.reconstruct(&c, out);
        Ok(())
    }
}

/// The kept basis as [`Basis::table_bytes`] lays it out: the table every
/// chunk coded on these tables reads.
impl kv_quant::TableBytes for ShardKeys {
    fn table_bytes(&self) -> Vec<u8> {
        self.basis.table_bytes()
    }

    fn with_table_bytes(&self, bytes: &[u8]) -> kv_quant::Result<Self> {
        let basis = self.basis.with_table_bytes(bytes).map_err(|e| {
            kv_quant::KvQuantError::InvalidParameter {
                name: "shard key basis",
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            basis: Arc::new(basis),
            ..self.clone()
        })
    }

    fn f16_words(&self) -> bool {
        self.basis.storage() == BasisStorage::F16
    }
}

/// Projects `rows` (`tokens × dim`) on `basis` and stores each kept
/// component's coefficients in its group's bits: the scale of a component
/// is its largest magnitude over these rows over the group's largest code
/// (f16-rounded), the codes symmetric and biased, packed per group.
fn quantize(
    basis: &Basis,
    groups: &[KeyGroup],
    row_bytes: usize,
    rows: &[f32],
    tokens: usize,
) -> (Vec<f32>, Vec<u8>) {
    let (dim, kept) = (basis.dim(), basis.rank());
    if kept == 0 {
        // No component kept (keys without variance): every key is the mean.
        return (Vec::new(), vec![0u8; tokens * row_bytes]);
    }
    let mut coeffs = vec![0.0f32; tokens * kept];
    for (row, c) in rows.chunks_exact(dim).zip(coeffs.chunks_exact_mut(kept)) {
        basis.project(row, c);
    }
    let mut scales = vec![0.0f32; kept];
    for g in groups {
        let qmax = f64::from((1u32 << (g.bits - 1)) - 1);
        for (j, s) in scales[g.start..g.start + g.len].iter_mut().enumerate() {
            let max = coeffs
                .chunks_exact(kept)
                .map(|c| c[g.start + j].abs())
                .fold(0.0f32, f32::max);
            *s = f16::from_f64(f64::from(max) / qmax).to_f32();
        }
    }
    let mut codes = vec![0u8; tokens * row_bytes];
    for (c, out) in coeffs
        .chunks_exact(kept)
        .zip(codes.chunks_exact_mut(row_bytes.max(1)))
    {
        for g in groups {
            let bias = 1i32 << (g.bits - 1);
            let qmax = bias - 1;
            let codes = c[g.start..g.start + g.len]
                .iter()
                .zip(&scales[g.start..g.start + g.len])
                .map(|(&x, &s)| {
                    let q = if s > 0.0 {
                        ((x / s).round() as i32).clamp(-qmax, qmax)
                    } else {
                        0
                    };
                    (q + bias) as u8
                });
            pack(
                codes,
                g.bits,
                &mut out[g.offset..g.offset + g.len * usize::from(g.bits) / 8],
            );
        }
    }
    (scales, codes)
}

/// The coefficients of one group of one token: `b`-bit biased codes
/// (`bits` of 2, 4, 6 or 8; the group a multiple of 4 components long)
/// times their scales. Each width in whole bytes (four 2-bit codes a byte,
/// four 6-bit codes in three), so the loops have no carried state: the
/// scores' hot loop (attention rebuilds keys tile by tile from these).
#[inline]
fn decode_group(bytes: &[u8], bits: u8, scales: &[f32], dst: &mut [f32]) {
    let bias = 1i32 << (bits - 1);
    let value = |u: u32, s: f32| (u as i32 - bias) as f32 * s;
    match bits {
        4 => {
            for ((o, &u), s) in dst
                .chunks_exact_mut(2)
                .zip(bytes)
                .zip(scales.chunks_exact(2))
            {
                o[0] = value(u32::from(u & 15), s[0]);
                o[1] = value(u32::from(u >> 4), s[1]);
            }
        }
        2 => {
            for ((o, &u), s) in dst
                .chunks_exact_mut(4)
                .zip(bytes)
                .zip(scales.chunks_exact(4))
            {
                let u = u32::from(u);
                for k in 0..4 {
                    o[k] = value(u >> (2 * k) & 3, s[k]);
                }
            }
        }
        6 => {
            for ((o, b), s) in dst
                .chunks_exact_mut(4)
                .zip(bytes.chunks_exact(3))
                .zip(scales.chunks_exact(4))
            {
                let w = u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16;
                for k in 0..4 {
                    o[k] = value(w >> (6 * k) & 63, s[k]);
                }
            }
        }
        _ => {
            debug_assert_eq!(bits, 8, "groups hold 2, 4, 6 or 8 bits");
            for ((o, &u), &s) in dst.iter_mut().zip(bytes).zip(scales) {
                *o = value(u32::from(u), s);
            }
        }
    }
}

/// Packs `b`-bit codes least-significant bit first into `out`.
fn pack(codes: impl Iterator<Item = u8>, bits: u8, out: &mut [u8]) {
    let (mut acc, mut held, mut at) = (0u32, 0u8, 0);
    for u in codes {
        acc |= u32::from(u) << held;
        held += bits;
        while held >= 8 {
            out[at] = acc as u8;
            at += 1;
            acc >>= 8;
            held -= 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_quant::RankRule;
    use proptest::prelude::*;

    /// Calls `f(j, code)` for each `b`-bit code packed in `bytes`.
    fn unpack(bytes: &[u8], bits: u8, mut f: impl FnMut(usize, u8)) {
        let mask = (1u32 << bits) - 1;
        let (mut acc, mut held, mut j) = (0u32, 0u8, 0);
        for &byte in bytes {
            acc |= u32::from(byte) << held;
            held += 8;
            while held >= bits {
                f(j, (acc & mask) as u8);
                j += 1;
                acc >>= bits;
                held -= bits;
            }
        }
    }

    /// The least allocation error over every assignment, by enumeration.
    fn brute_force(variances: &[f64], sizes: &[usize], budget: usize) -> f64 {
        let n = variances.len();
        let mut least = f64::INFINITY;
        for mut k in 0..5usize.pow(n as u32) {
            let (mut cost, mut err) = (0, 0.0);
            for g in 0..n {
                let b = BIT_OPTIONS[k % 5];
                k /= 5;
                cost += usize::from(b) * sizes[g];
                err += allocation_error(variances[g], b);
            }
            if cost <= budget {
                least = least.min(err);
            }
        }
        least
    }

    proptest! {
        #[test]
        fn allocation_is_optimal_and_within_budget(
            groups in prop::collection::vec((0.0f64..100.0, 1usize..4), 1..6),
            budget in 0usize..200,
        ) {
            let variances: Vec<f64> = groups.iter().map(|g| g.0).collect();
            let sizes: Vec<usize> = groups.iter().map(|g| 4 * g.1).collect();
            let bits = allocate_bits(&variances, &sizes, budget).unwrap();
            let cost: usize = bits.iter().zip(&sizes).map(|(&b, &s)| usize::from(b) * s).sum();
            prop_assert!(cost <= budget);
            let err: f64 = bits.iter().zip(&variances).map(|(&b, &v)| allocation_error(v, b)).sum();
            let best = brute_force(&variances, &sizes, budget);
            prop_assert!((err - best).abs() <= 1e-9 * best.max(1.0), "{err} vs {best}");
        }

        #[test]
        fn group_decoding_equals_the_generic_unpacking(
            bits in prop::sample::select(vec![2u8, 4, 6, 8]),
            n in 1usize..8,
            seed: u64,
        ) {
            let len = 4 * n;
            let mut x = seed;
            let mut next = || {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 33) as u32
            };
            let bytes: Vec<u8> = (0..len * usize::from(bits) / 8).map(|_| next() as u8).collect();
            let scales: Vec<f32> = (0..len).map(|_| next() as f32 / 4e9).collect();
            let bias = 1i32 << (bits - 1);
            let mut want = vec![0.0f32; len];
            unpack(&bytes, bits, |j, u| want[j] = (i32::from(u) - bias) as f32 * scales[j]);
            let mut got = vec![0.0f32; len];
            decode_group(&bytes, bits, &scales, &mut got);
            prop_assert_eq!(got, want);
        }

        #[test]
        fn packing_round_trips(bits in prop::sample::select(vec![2u8, 4, 6, 8]), n in 1usize..8, seed: u64) {
            let len = 4 * n;
            let mut x = seed;
            let codes: Vec<u8> = (0..len).map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as u32 & ((1 << bits) - 1)) as u8
            }).collect();
            let mut out = vec![0u8; len * usize::from(bits) / 8];
            pack(codes.iter().copied(), bits, &mut out);
            let mut back = vec![0u8; len];
            unpack(&out, bits, |j, u| back[j] = u);
            prop_assert_eq!(back, codes);
        }
    }

    #[test]
    fn the_drop_penalty_keeps_components_quantized() {
        // A budget of one group at 2 bits: the larger variance gets it.
        let bits = allocate_bits(&[10.0, 1.0], &[4, 4], 8).unwrap();
        assert_eq!(bits, vec![2, 0]);
        // With room for both at 2 bits, dropping (4·v) loses to quantizing.
        let bits = allocate_bits(&[10.0, 1.0], &[4, 4], 16).unwrap();
        assert_eq!(bits, vec![2, 2]);
        assert!(allocate_bits(&[f64::NAN], &[4], 8).is_err());
    }

    /// Keys near a 6-dimensional subspace of 16 channels.
    fn low_rank_keys(tokens: usize) -> Vec<f32> {
        (0..tokens * 16)
            .map(|i| {
                let (t, c) = (i / 16, i % 16);
                let mut v = 0.0;
                for k in 0..6 {
                    let w = ((c * 7 + k * 3) % 11) as f32 / 11.0 - 0.5;
                    v += w * ((t * (k + 1)) as f32 * 0.37 + k as f32).sin() * (6 - k) as f32;
                }
                v + 0.5
            })
            .collect()
    }

    #[test]
    fn keys_round_trip_within_their_quantization() {
        let (tokens, dim) = (300, 16);
        let rows = low_rank_keys(tokens);
        let keys = ShardKeys::fit(&rows, tokens, dim, 4.0, 4, None).unwrap();
        assert!(keys.kept() >= 6, "{:?}", keys.allocation());
        let mut out = vec![0.0f32; dim];
        let mut worst = 0.0f32;
        for t in 0..tokens {
            keys.reconstruct_into(t, &mut out).unwrap();
            for (a, b) in out.iter().zip(&rows[t * dim..][..dim]) {
                worst = worst.max((a - b).abs());
            }
        }
        // 8-bit coefficients of an int8 basis: about 1% of the scale (~10).
        assert!(worst < 0.15, "{worst}");
        let bytes = keys.stored_bytes();
        assert_eq!(
            bytes,
            tokens * keys.row_bytes()
                + 2 * keys.kept()
                + keys.kept() * dim
                + 2 * keys.kept()
                + 2 * dim
        );
        // The budget holds: at most 4 bits per value of codes.
        assert!(keys.row_bytes() * 8 <= 4 * dim);
    }

    #[test]
    fn a_basis_fitted_elsewhere_stores_other_rows() {
        let (tokens, dim) = (300, 16);
        let rows = low_rank_keys(tokens);
        let (basis, _) = Basis::fit(
            &rows[..200 * dim],
            200,
            dim,
            RankRule::Fixed(8),
            BasisStorage::F16,
        )
        .unwrap();
        let keys = ShardKeys::with_basis(&rows[200 * dim..], 100, &basis, 4.0, 4).unwrap();
        assert_eq!(keys.tokens(), 100);
        let mut out = vec![0.0f32; dim];
        keys.reconstruct_into(50, &mut out).unwrap();
        let want = &rows[250 * dim..251 * dim];
        let err: f32 = out
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 0.2, "{err}");
        // A basis of another width (a calibration of another model).
        let e = ShardKeys::with_basis(&rows[..100 * 12], 100, &basis, 4.0, 4).unwrap_err();
        assert!(matches!(e, LowRankError::Bases(_)), "{e}");
    }

    #[test]
    fn folded_chunks_share_the_basis_and_carry_their_own_scales() {
        let (tokens, dim) = (300, 16);
        let rows = low_rank_keys(tokens);
        let keys = ShardKeys::fit(&rows[..200 * dim], 200, dim, 4.0, 4, None).unwrap();
        // The fit's own rows again: the same codes and scales.
        let again = keys.encode_chunk(&rows[..200 * dim], 200).unwrap();
        assert_eq!(again, keys);
        // Later rows on the same basis and allocation, scaled by their own maxima.
        let chunk = keys.encode_chunk(&rows[200 * dim..], 100).unwrap();
        assert_eq!(
            (chunk.tokens(), chunk.allocation()),
            (100, keys.allocation())
        );
        assert!(std::ptr::eq(chunk.basis(), keys.basis()));
        assert_eq!(
            chunk.stored_bytes() - chunk.shared_bytes(),
            100 * keys.row_bytes() + 2 * keys.kept()
        );
        let (mut out, mut worst) = (vec![0.0f32; dim], 0.0f32);
        for t in 0..100 {
            chunk.reconstruct_into(t, &mut out).unwrap();
            for (a, b) in out.iter().zip(&rows[(200 + t) * dim..][..dim]) {
                worst = worst.max((a - b).abs());
            }
        }
        assert!(worst < 0.2, "{worst}");
        for g in keys.groups() {
            let qmax = f64::from((1u32 << (g.bits - 1)) - 1);
            for j in g.start..g.start + g.len {
                let mut c = vec![0.0f32; keys.kept()];
                let max = rows[200 * dim..]
                    .chunks_exact(dim)
                    .map(|r| {
                        keys.basis().project(r, &mut c);
                        c[j].abs()
                    })
                    .fold(0.0f32, f32::max);
                let want = f16::from_f64(f64::from(max) / qmax).to_f32();
                assert_eq!(chunk.scales()[j], want);
            }
        }
        assert!(matches!(
            keys.encode_chunk(&rows[..10 * dim], 11),
            Err(LowRankError::ShapeMismatch { .. })
        ));
        let mut bad = rows[..dim].to_vec();
        bad[3] = f32::INFINITY;
        assert!(matches!(
            keys.encode_chunk(&bad, 1),
            Err(LowRankError::NonFinite { .. })
        ));
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let rows = low_rank_keys(100);
        let fit = |b: f64, g: usize, r: Option<usize>| ShardKeys::fit(&rows, 100, 16, b, g, r);
        assert!(matches!(
            fit(1.0, 4, Some(32)),
            Err(LowRankError::InvalidParameter { name: "rank", .. })
        ));
        assert!(matches!(
            fit(0.1, 4, None),
            Err(LowRankError::InvalidParameter {
                name: "key budget",
                ..
            })
        ));
        assert!(matches!(
            fit(9.0, 4, None),
            Err(LowRankError::InvalidParameter {
                name: "key budget",
                ..
            })
        ));
        assert!(matches!(
            fit(1.0, 6, None),
            Err(LowRankError::InvalidParameter { name: "group", .. })
        ));
        assert!(matches!(
            ShardKeys::fit(&rows[..16], 1, 16, 1.0, 4, None),
            Err(LowRankError::TooFewRows { .. })
        ));
        let mut bad = rows.clone();
        bad[37] = f32::NAN;
        assert!(matches!(
            ShardKeys::fit(&bad, 100, 16, 1.0, 4, None),
            Err(LowRankError::NonFinite {
                row: 2,
                channel: 5,
                ..
            })
        ));
        assert!(matches!(
            ShardKeys::fit(&rows, 99, 16, 1.0, 4, None),
            Err(LowRankError::ShapeMismatch { .. })
        ));
    }
}
