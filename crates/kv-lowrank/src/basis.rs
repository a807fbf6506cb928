//! [`Basis`]: an orthonormal `r × d` basis of a head's keys or values with
//! their mean, fitted by PCA (the symmetric eigendecomposition of the
//! covariance, in f64, by nalgebra) with the rank fixed or chosen by
//! retained energy ([`Spectrum`]), and stored in f16 or in int8 with one
//! scale per basis row, with its true bytes counted.
//!
//! Projection and reconstruction use the basis as stored: `c = (x − μ)·Bᵀ`,
//! `x̂ = μ + c·B`. Rounding to f16 or int8 leaves the rows orthonormal only to
//! about 1e-3; every error certificate of this crate is computed from the
//! actual residual `x − x̂`, so none of them depends on exact orthonormality.

use half::f16;
use kv_quant::RankRule;
use nalgebra::{DMatrix, SymmetricEigen};

use crate::error::{LowRankError, Result, check_finite, check_len};

/// How basis entries are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BasisStorage {
    /// IEEE binary16 per entry.
    #[default]
    F16,
    /// Symmetric int8 per entry with an f16 scale per basis row.
    Int8,
}

/// The eigenvalues of a head's covariance, descending (negative rounding
/// noise clamped to 0).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Spectrum {
    /// Eigenvalues, largest first.
    pub eigenvalues: Vec<f64>,
}

impl Spectrum {
    /// The share of the total energy in the first `rank` eigenvalues.
    pub fn energy_at(&self, rank: usize) -> f64 {
        let total: f64 = self.eigenvalues.iter().sum();
        if total <= 0.0 {
            return 1.0;
        }
        self.eigenvalues.iter().take(rank).sum::<f64>() / total
    }

    /// The smallest rank retaining at least `energy` of the total (at least 1).
    pub fn rank_for_energy(&self, energy: f64) -> usize {
        let total: f64 = self.eigenvalues.iter().sum();
        if total <= 0.0 {
            return 1;
        }
        let mut acc = 0.0;
        for (i, &l) in self.eigenvalues.iter().enumerate() {
            acc += l;
            // A relative slack absorbs rounding at energy 1.
            if acc >= energy * total * (1.0 - 1e-12) {
                return i + 1;
            }
        }
        self.eigenvalues.len().max(1)
    }
}

/// An orthonormal basis of one head, with the mean it is centred on.
#[derive(Clone, Debug, PartialEq)]
pub struct Basis {
    dim: usize,
    /// `rank × dim`, row-major, as stored (rounded).
    rows: Vec<f32>,
    /// `dim` values (f16-rounded), zero for uncentred bases.
    mean: Vec<f32>,
    storage: BasisStorage,
    /// Whether `mean` is stored (centred bases).
    centred: bool,
}

/// Covariance (or, uncentred, second-moment) matrix of rows, in f64.
fn moment(rows: &[f32], n: usize, d: usize, centre: bool) -> (DMatrix<f64>, Vec<f64>) {
    let x = DMatrix::<f64>::from_row_iterator(n, d, rows.iter().map(|&v| f64::from(v)));
    let mean: Vec<f64> = if centre {
        (0..d).map(|j| x.column(j).sum() / n as f64).collect()
    } else {
        vec![0.0; d]
    };
    let mut m = x.transpose() * &x;
    for i in 0..d {
        for j in 0..d {
            m[(i, j)] = m[(i, j)] / n as f64 - mean[i] * mean[j];
        }
    }
    (m, mean)
}

/// The top-`rank` eigenvectors (as rows) and the spectrum of a symmetric matrix.
fn top_eigenvectors(
    m: DMatrix<f64>,
    rank: Option<usize>,
    rule: RankRule,
) -> (Vec<f64>, Spectrum, usize) {
    let d = m.nrows();
    let eig = SymmetricEigen::new(m);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
    let spectrum = Spectrum {
        eigenvalues: order.iter().map(|&i| eig.eigenvalues[i].max(0.0)).collect(),
    };
    let r = rank.unwrap_or_else(|| match rule {
        RankRule::Fixed(r) => r,
        RankRule::Energy(e) => spectrum.rank_for_energy(f64::from(e) / 1e6),
    });
    let mut rows = Vec::with_capacity(r * d);
    for &i in order.iter().take(r) {
        let v = eig.eigenvectors.column(i);
        // A fixed sign (largest entry positive) makes fits reproducible.
        let pivot = v
            .iter()
            .copied()
            .fold(0.0f64, |m, x| if x.abs() > m.abs() { x } else { m });
        let sign = if pivot < 0.0 { -1.0 } else { 1.0 };
        rows.extend(v.iter().map(|x| x * sign));
    }
    (rows, spectrum, r)
}

impl Basis {
    /// PCA of `rows` (`n × d`, row-major): the mean and the top
    /// eigenvectors of the covariance, `rule` choosing the rank; returns
    /// the basis and the full spectrum.
    pub fn fit(
        rows: &[f32],
        n: usize,
        d: usize,
        rule: RankRule,
        storage: BasisStorage,
    ) -> Result<(Basis, Spectrum)> {
        check_rule(rule, d)?;
        check_len("rows to fit (n × d)", n * d, rows.len())?;
        check_finite(rows, d)?;
        if let RankRule::Fixed(r) = rule
            && n <= r
        {
            return Err(LowRankError::TooFewRows { rows: n, rank: r });
        }
        if n < 2 {
            return Err(LowRankError::TooFewRows { rows: n, rank: 1 });
        }
        let (m, mean) = moment(rows, n, d, true);
        let (vectors, spectrum, r) = top_eigenvectors(m, None, rule);
        let mean: Vec<f32> = mean.iter().map(|&v| v as f32).collect();
        Ok((Self::store(d, &vectors, r, mean, true, storage), spectrum))
    }

    /// The top-`rank` right singular vectors of a sketch (`m × d`), as an
    /// uncentred basis (frequent directions: no mean).
    pub fn from_sketch(
        sketch: &[f32],
        m: usize,
        d: usize,
        rank: usize,
        storage: BasisStorage,
    ) -> Result<Basis> {
        check_rule(RankRule::Fixed(rank), d)?;
        check_len("sketch (m × d)", m * d, sketch.len())?;
        let (g, _) = moment(sketch, m.max(1), d, false);
        let (vectors, _, r) = top_eigenvectors(g, Some(rank), RankRule::Fixed(rank));
        Ok(Self::store(d, &vectors, r, vec![0.0; d], false, storage))
    }

    /// An uncentred basis from orthonormal directions (`rank × d`, f64).
    pub fn from_directions(d: usize, directions: &[f64], storage: BasisStorage) -> Result<Basis> {
        if d == 0 || directions.is_empty() || !directions.len().is_multiple_of(d) {
            return Err(LowRankError::Bases(format!(
                "{} direction values are not whole rows of {d}",
                directions.len()
            )));
        }
        let r = directions.len() / d;
        check_rule(RankRule::Fixed(r), d)?;
        Ok(Self::store(d, directions, r, vec![0.0; d], false, storage))
    }

    /// A basis from stored parts (a calibration file): `rank × dim` rows
    /// (none for a basis of rank 0, which rebuilds every row as the mean)
    /// and a mean of `dim` values (all zero for an uncentred basis).
    pub fn from_parts(
        dim: usize,
        rows: &[f32],
        mean: &[f32],
        storage: BasisStorage,
    ) -> Result<Basis> {
        if dim == 0 || !rows.len().is_multiple_of(dim) {
            return Err(LowRankError::Bases(format!(
                "{} basis values are not whole rows of {dim}",
                rows.len()
            )));
        }
        check_len("basis mean", dim, mean.len())?;
        check_finite(rows, dim)?;
        check_finite(mean, dim)?;
        let r = rows.len() / dim;
        if r > dim {
            return Err(LowRankError::InvalidParameter {
                name: "rank",
                reason: format!("{r} rows exceed the dimension {dim}"),
            });
        }
        let vectors: Vec<f64> = rows.iter().map(|&v| f64::from(v)).collect();
        let centred = mean.iter().any(|&v| v != 0.0);
        Ok(Self::store(
            dim,
            &vectors,
            r,
            mean.to_vec(),
            centred,
            storage,
        ))
    }

    /// Rounds rows and mean to the storage types.
    fn store(
        d: usize,
        vectors: &[f64],
        r: usize,
        mean: Vec<f32>,
        centred: bool,
        storage: BasisStorage,
    ) -> Basis {
        let round16 = |x: f64| f16::from_f64(x).to_f32();
        let rows = match storage {
            BasisStorage::F16 => vectors.iter().map(|&v| round16(v)).collect(),
            BasisStorage::Int8 => {
                let mut out = Vec::with_capacity(r * d);
                for row in vectors.chunks_exact(d) {
                    let max = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    let scale = round16(max / 127.0);
                    for &v in row {
                        let q = if scale > 0.0 {
                            (v / f64::from(scale)).round().clamp(-127.0, 127.0)
                        } else {
                            0.0
                        };
                        out.push(q as f32 * scale);
                    }
                }
                out
            }
        };
        Basis {
            dim: d,
            rows,
            mean: mean.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            storage,
            centred,
        }
    }

    /// Channels of the head.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rank (rows).
    pub fn rank(&self) -> usize {
        self.rows.len() / self.dim
    }

    /// The rows as stored, `rank × dim`.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }

    /// The mean (zero for uncentred bases).
    pub fn mean(&self) -> &[f32] {
        &self.mean
    }

    /// Whether the basis carries a mean.
    pub fn is_centred(&self) -> bool {
        self.centred
    }

    /// The storage of the entries.
    pub fn storage(&self) -> BasisStorage {
        self.storage
    }

    /// Bytes of the basis as stored: entries, per-row scales (int8) and the
    /// mean (f16, centred bases).
    pub fn stored_bytes(&self) -> usize {
        let entries = match self.storage {
            BasisStorage::F16 => 2 * self.rows.len(),
            BasisStorage::Int8 => self.rows.len() + 2 * self.rank(),
        };
        entries + if self.centred { 2 * self.dim } else { 0 }
    }

    /// Coefficients `c = (x − μ)·Bᵀ` of one vector.
    #[inline]
    pub fn project(&self, x: &[f32], coeffs: &mut [f32]) {
        for (c, b) in coeffs.iter_mut().zip(self.rows.chunks_exact(self.dim)) {
            *c = b
                .iter()
                .zip(x)
                .zip(&self.mean)
                .map(|((b, x), m)| b * (x - m))
                .sum();
        }
    }

    /// The vector `μ + c·B` of coefficients `c`.
    #[inline]
    pub fn reconstruct(&self, coeffs: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&self.mean);
        for (&c, b) in coeffs.iter().zip(self.rows.chunks_exact(self.dim)) {
            for (o, &b) in out.iter_mut().zip(b) {
                *o += c * b;
            }
        }
    }

    /// The query-side projection `q·Bᵀ` (no mean: scores shift by `q·μ`,
    /// which [`Basis::mean_score`] gives).
    #[inline]
    pub fn project_query(&self, q: &[f32], out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(self.rows.chunks_exact(self.dim)) {
            *o = b.iter().zip(q).map(|(b, q)| b * q).sum();
        }
    }

    /// `q·μ`, the score every key of this basis shares.
    #[inline]
    pub fn mean_score(&self, q: &[f32]) -> f32 {
        self.mean.iter().zip(q).map(|(m, q)| m * q).sum()
    }
}

/// Checks a rank rule against the head dimension.
pub(crate) fn check_rule(rule: RankRule, d: usize) -> Result<()> {
    match rule {
        RankRule::Fixed(r) if r == 0 || r > d => Err(LowRankError::InvalidParameter {
            name: "rank",
            reason: format!("{r} is not in 1..={d} (the head dimension)"),
        }),
        RankRule::Energy(e) if e == 0 || e > 1_000_000 => Err(LowRankError::InvalidParameter {
            name: "energy",
            reason: format!("{} is not in (0, 1]", f64::from(e) / 1e6),
        }),
        _ => Ok(()),
    }
}

/// Bytes of a basis as stored: the entries row by row (f16 each, or an f16
/// scale then `dim` int8 entries per row), then the mean (f16, centred
/// bases): what a protected table of the bases holds
/// ([`kv_quant::ProtectedTable`]).
impl Basis {
    /// The basis as stored, in bytes (little-endian).
    pub fn table_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.stored_bytes());
        let f16_bytes = |v: f32| f16::from_f32(v).to_le_bytes();
        match self.storage {
            BasisStorage::F16 => out.extend(self.rows.iter().flat_map(|&v| f16_bytes(v))),
            BasisStorage::Int8 => {
                for row in self.rows.chunks_exact(self.dim) {
                    // The stored rows are q·s with s an f16 and |q| ≤ 127,
                    // the largest 127 (s was rounded from max/127, within
                    // 2⁻¹¹): both products and this quotient are exact in
                    // f32, so the codes come back as written.
                    let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let scale = max / 127.0;
                    out.extend(f16_bytes(scale));
                    out.extend(row.iter().map(|&v| {
                        let q = if scale > 0.0 {
                            (v / scale).round()
                        } else {
                            0.0
                        };
                        (q.clamp(-127.0, 127.0) as i8) as u8
                    }));
                }
            }
        }
        if self.centred {
            out.extend(self.mean.iter().flat_map(|&v| f16_bytes(v)));
        }
        out
    }

    /// A basis of this shape holding `bytes` ([`table_bytes`](Self::table_bytes)'s
    /// layout), entries taken as read: a faulted entry may be infinite.
    pub fn with_table_bytes(&self, bytes: &[u8]) -> Result<Basis> {
        check_len("basis bytes", self.stored_bytes(), bytes.len())?;
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
        let (d, r) = (self.dim, self.rank());
        let (entries, mean) = bytes.split_at(bytes.len() - if self.centred { 2 * d } else { 0 });
        let rows = match self.storage {
            BasisStorage::F16 => entries.chunks_exact(2).map(half).collect(),
            BasisStorage::Int8 => {
                let mut rows = Vec::with_capacity(r * d);
                for row in entries.chunks_exact(2 + d) {
                    let scale = half(row);
                    rows.extend(row[2..].iter().map(|&q| f32::from(q as i8) * scale));
                }
                rows
            }
        };
        Ok(Basis {
            dim: d,
            rows,
            mean: if self.centred {
                mean.chunks_exact(2).map(half).collect()
            } else {
                self.mean.clone()
            },
            storage: self.storage,
            centred: self.centred,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows spread along two known directions plus a small isotropic part.
    fn plane(n: usize, d: usize) -> Vec<f32> {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut rows = Vec::with_capacity(n * d);
        for _ in 0..n {
            let (a, b) = (4.0 * next(), 2.0 * next());
            for j in 0..d {
                let e1 = if j == 0 { 1.0 } else { 0.0 };
                let e2 = if j == 1 { 1.0 } else { 0.0 };
                rows.push(3.0 + a * e1 + b * e2 + 0.01 * next());
            }
        }
        rows
    }

    #[test]
    fn table_bytes_give_the_basis_back_bit_for_bit() {
        let rows = plane(64, 8);
        for storage in [BasisStorage::F16, BasisStorage::Int8] {
            let (b, _) = Basis::fit(&rows, 64, 8, RankRule::Fixed(3), storage).unwrap();
            let bytes = b.table_bytes();
            assert_eq!(bytes.len(), b.stored_bytes(), "{storage:?}");
            let back = b.with_table_bytes(&bytes).unwrap();
            assert_eq!(back, b, "{storage:?}");
            assert_eq!(back.table_bytes(), bytes);
            // A flipped sign bit of the first entry (f16: byte 1 bit 7;
            // int8: the first code after the row scale) is read as written.
            let mut hit = bytes.clone();
            let at = if storage == BasisStorage::F16 { 1 } else { 2 };
            hit[at] ^= 0x80;
            let faulted = b.with_table_bytes(&hit).unwrap();
            assert_ne!(faulted.rows()[0], b.rows()[0]);
            assert_eq!(faulted.rows()[1..], b.rows()[1..]);
            assert!(b.with_table_bytes(&bytes[1..]).is_err());
        }
    }

    #[test]
    fn pca_finds_the_plane_the_mean_and_the_spectrum() {
        let (n, d) = (500, 8);
        let rows = plane(n, d);
        let (basis, spectrum) =
            Basis::fit(&rows, n, d, RankRule::Fixed(2), BasisStorage::F16).unwrap();
        assert_eq!(basis.rank(), 2);
        assert!((basis.mean()[3] - 3.0).abs() < 0.01);
        // The rows span e1 and e2.
        assert!(basis.rows()[0].abs() > 0.99 && basis.rows()[d + 1].abs() > 0.99);
        assert!(spectrum.energy_at(2) > 0.999);
        assert_eq!(spectrum.rank_for_energy(0.99), 2);
        assert_eq!(spectrum.rank_for_energy(1.0), d);
        // Orthonormal up to f16 rounding.
        let r = basis.rows();
        let dot = |a: usize, b: usize| (0..d).map(|j| r[a * d + j] * r[b * d + j]).sum::<f32>();
        assert!((dot(0, 0) - 1.0).abs() < 2e-3 && dot(0, 1).abs() < 2e-3);
        // Projection and reconstruction recover points of the plane.
        let mut c = [0.0; 2];
        let mut back = vec![0.0; d];
        basis.project(&rows[..d], &mut c);
        basis.reconstruct(&c, &mut back);
        for (a, b) in back.iter().zip(&rows[..d]) {
            assert!((a - b).abs() < 0.05, "{a} {b}");
        }
        let (e, _) =
            Basis::fit(&rows, n, d, RankRule::Energy(990_000), BasisStorage::Int8).unwrap();
        assert_eq!(e.rank(), 2);
        assert_eq!(e.stored_bytes(), 2 * d + 2 * 2 + 2 * d);
        assert_eq!(basis.stored_bytes(), 2 * 2 * d + 2 * d);
    }

    #[test]
    fn bad_fits_are_typed_errors() {
        let rows = plane(10, 8);
        for (rule, needle) in [
            (RankRule::Fixed(0), "rank"),
            (RankRule::Fixed(9), "rank"),
            (RankRule::Energy(0), "energy"),
            (RankRule::Energy(1_000_001), "energy"),
        ] {
            let e = Basis::fit(&rows, 10, 8, rule, BasisStorage::F16).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        assert!(matches!(
            Basis::fit(&rows[..3 * 8], 3, 8, RankRule::Fixed(4), BasisStorage::F16),
            Err(LowRankError::TooFewRows { rows: 3, rank: 4 })
        ));
        let mut nan = rows.clone();
        nan[17] = f32::NAN;
        assert!(matches!(
            Basis::fit(&nan, 10, 8, RankRule::Fixed(2), BasisStorage::F16),
            Err(LowRankError::NonFinite {
                row: 2,
                channel: 1,
                ..
            })
        ));
        assert!(matches!(
            Basis::fit(&rows[..7], 1, 8, RankRule::Fixed(2), BasisStorage::F16),
            Err(LowRankError::ShapeMismatch { .. })
        ));
        assert!(Basis::from_parts(8, &[0.0; 12], &[0.0; 8], BasisStorage::F16).is_err());
        assert!(Basis::from_parts(8, &[0.0; 16], &[0.0; 7], BasisStorage::F16).is_err());
        assert!(Basis::from_parts(2, &[0.0; 6], &[0.0; 2], BasisStorage::F16).is_err());
    }
}
