//! Dense matrices over GF(2), rows packed into `u64` words.
//!
//! Row `r` occupies `words_per_row` consecutive words; column `c` of that row is
//! bit `c % 64` of its word `c / 64` (LSB first), the same convention as
//! [`BitVec`]. Elimination works a whole word of columns at a time.

use crate::bitvec::{BitVec, dot_words, low_mask, words_for, xor_words};
use crate::error::{Gf2Error, Result};

/// A `rows x cols` matrix over GF(2).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BitMatrix {
    rows: usize,
    cols: usize,
    stride: usize,
    data: Vec<u64>,
}

/// The reduced row echelon form of a matrix and where its pivots are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowEchelon {
    /// The reduced matrix: zero rows last, each pivot column a unit column.
    pub reduced: BitMatrix,
    /// Pivot column of each non-zero row, ascending; its length is the rank.
    pub pivots: Vec<usize>,
}

impl BitMatrix {
    /// The all-zero `rows x cols` matrix.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        let stride = words_for(cols);
        Self {
            rows,
            cols,
            stride,
            data: vec![0; rows * stride],
        }
    }

    /// The `n x n` identity.
    pub fn identity(n: usize) -> Self {
        let mut m = Self::zeros(n, n);
        for i in 0..n {
            m.set(i, i, true);
        }
        m
    }

    /// A matrix from rows of booleans; all rows must have the same length.
    pub fn from_bool_rows(rows: &[Vec<bool>]) -> Result<Self> {
        let cols = rows.first().map_or(0, Vec::len);
        let mut m = Self::zeros(rows.len(), cols);
        for (r, row) in rows.iter().enumerate() {
            if row.len() != cols {
                return Err(Gf2Error::DimensionMismatch {
                    op: "from_bool_rows (ragged rows)",
                    expected: cols,
                    found: row.len(),
                });
            }
            for (c, &b) in row.iter().enumerate() {
                m.set(r, c, b);
            }
        }
        Ok(m)
    }

    /// A matrix from rows written as strings of `0` and `1` (spaces ignored),
    /// column 0 first, the way the paper prints its matrices.
    pub fn from_str_rows(rows: &[&str]) -> Result<Self> {
        let parsed: Result<Vec<Vec<bool>>> = rows
            .iter()
            .map(|row| {
                row.chars()
                    .filter(|c| !c.is_whitespace())
                    .map(|c| match c {
                        '0' => Ok(false),
                        '1' => Ok(true),
                        other => Err(Gf2Error::Parse {
                            reason: format!("unexpected character {other:?} in row {row:?}"),
                        }),
                    })
                    .collect()
            })
            .collect();
        Self::from_bool_rows(&parsed?).map_err(|e| match e {
            Gf2Error::DimensionMismatch {
                expected, found, ..
            } => Gf2Error::Parse {
                reason: format!("ragged rows: {found} columns where {expected} were expected"),
            },
            other => other,
        })
    }

    /// A matrix of `cols <= 64` columns from one word per row (column `c` = bit `c`).
    pub fn from_u64_rows(rows: &[u64], cols: usize) -> Result<Self> {
        if cols > 64 {
            return Err(Gf2Error::InvalidParameter {
                name: "cols",
                reason: format!("{cols} columns do not fit in one u64 per row"),
            });
        }
        let mut m = Self::zeros(rows.len(), cols);
        if cols > 0 {
            for (r, &w) in rows.iter().enumerate() {
                m.data[r] = w & low_mask(cols);
            }
        }
        Ok(m)
    }

    /// A matrix whose rows are the given vectors (all of one length).
    pub fn from_rows(rows: &[BitVec]) -> Result<Self> {
        let cols = rows.first().map_or(0, BitVec::len);
        let mut m = Self::zeros(rows.len(), cols);
        for (r, v) in rows.iter().enumerate() {
            if v.len() != cols {
                return Err(Gf2Error::DimensionMismatch {
                    op: "from_rows",
                    expected: cols,
                    found: v.len(),
                });
            }
            m.row_words_mut(r).copy_from_slice(v.words());
        }
        Ok(m)
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Entry `(r, c)`.
    ///
    /// # Panics
    /// If `r` or `c` is out of range.
    pub fn get(&self, r: usize, c: usize) -> bool {
        self.check_index(r, c);
        self.data[r * self.stride + c / 64] >> (c % 64) & 1 == 1
    }

    /// Sets entry `(r, c)`.
    ///
    /// # Panics
    /// If `r` or `c` is out of range.
    pub fn set(&mut self, r: usize, c: usize, value: bool) {
        self.check_index(r, c);
        let w = &mut self.data[r * self.stride + c / 64];
        let mask = 1u64 << (c % 64);
        if value {
            *w |= mask;
        } else {
            *w &= !mask;
        }
    }

    /// Row `r` as packed words.
    ///
    /// # Panics
    /// If `r >= rows`.
    pub fn row_words(&self, r: usize) -> &[u64] {
        &self.data[r * self.stride..(r + 1) * self.stride]
    }

    fn row_words_mut(&mut self, r: usize) -> &mut [u64] {
        &mut self.data[r * self.stride..(r + 1) * self.stride]
    }

    /// Row `r` as a vector.
    ///
    /// # Panics
    /// If `r >= rows`.
    pub fn row(&self, r: usize) -> BitVec {
        BitVec::from_words(self.row_words(r), self.cols).expect("row has stride words")
    }

    /// Column `c` as a vector.
    ///
    /// # Panics
    /// If `c >= cols`.
    pub fn column(&self, c: usize) -> BitVec {
        let mut v = BitVec::zeros(self.rows);
        for r in 0..self.rows {
            if self.get(r, c) {
                v.set(r, true);
            }
        }
        v
    }

    /// Rows as single words, for matrices of at most 64 columns.
    pub fn to_u64_rows(&self) -> Result<Vec<u64>> {
        if self.cols > 64 {
            return Err(Gf2Error::InvalidParameter {
                name: "cols",
                reason: format!("{} columns do not fit in one u64 per row", self.cols),
            });
        }
        Ok((0..self.rows)
            .map(|r| self.row_words(r).first().copied().unwrap_or(0))
            .collect())
    }

    /// The transpose.
    pub fn transpose(&self) -> BitMatrix {
        let mut t = BitMatrix::zeros(self.cols, self.rows);
        for r in 0..self.rows {
            for (wi, &w) in self.row_words(r).iter().enumerate() {
                let mut rest = w;
                while rest != 0 {
                    let c = wi * 64 + rest.trailing_zeros() as usize;
                    rest &= rest - 1;
                    t.data[c * t.stride + r / 64] |= 1 << (r % 64);
                }
            }
        }
        t
    }

    /// The product `self · other`.
    pub fn mul(&self, other: &BitMatrix) -> Result<BitMatrix> {
        if self.cols != other.rows {
            return Err(Gf2Error::DimensionMismatch {
                op: "matrix multiply (left cols vs right rows)",
                expected: self.cols,
                found: other.rows,
            });
        }
        let mut out = BitMatrix::zeros(self.rows, other.cols);
        for r in 0..self.rows {
            // Row r of the product is the XOR of the rows of `other` selected by row r of `self`.
            let (start, end) = (r * out.stride, (r + 1) * out.stride);
            for k in self.row(r).iter_ones() {
                let src = other.row_words(k);
                xor_words(&mut out.data[start..end], src);
            }
        }
        Ok(out)
    }

    /// The row vector `v · self` (`v` has `rows` bits; the result `cols` bits).
    pub fn vec_mul(&self, v: &BitVec) -> Result<BitVec> {
        if v.len() != self.rows {
            return Err(Gf2Error::DimensionMismatch {
                op: "vector-matrix multiply",
                expected: self.rows,
                found: v.len(),
            });
        }
        let mut out = vec![0u64; self.stride];
        for r in v.iter_ones() {
            xor_words(&mut out, self.row_words(r));
        }
        BitVec::from_words(&out, self.cols)
    }

    /// The column vector `self · vᵀ` (`v` has `cols` bits; the result `rows` bits).
    pub fn mul_vec(&self, v: &BitVec) -> Result<BitVec> {
        if v.len() != self.cols {
            return Err(Gf2Error::DimensionMismatch {
                op: "matrix-vector multiply",
                expected: self.cols,
                found: v.len(),
            });
        }
        let mut out = BitVec::zeros(self.rows);
        for r in 0..self.rows {
            if dot_words(self.row_words(r), v.words()) {
                out.set(r, true);
            }
        }
        Ok(out)
    }

    /// Reduced row echelon form by Gauss-Jordan elimination.
    pub fn row_echelon(&self) -> RowEchelon {
        let mut m = self.clone();
        let mut pivots = Vec::new();
        let mut next_row = 0;
        for c in 0..self.cols {
            if next_row == self.rows {
                break;
            }
            let (wi, bit) = (c / 64, 1u64 << (c % 64));
            let Some(p) = (next_row..self.rows).find(|&r| m.data[r * m.stride + wi] & bit != 0)
            else {
                continue;
            };
            m.swap_rows(p, next_row);
            let pivot_row: Vec<u64> = m.row_words(next_row).to_vec();
            for r in 0..self.rows {
                if r != next_row && m.data[r * m.stride + wi] & bit != 0 {
                    xor_words(m.row_words_mut(r), &pivot_row);
                }
            }
            pivots.push(c);
            next_row += 1;
        }
        RowEchelon { reduced: m, pivots }
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.row_echelon().pivots.len()
    }

    /// A basis of the right null space `{x : self · xᵀ = 0}`, one vector per row.
    ///
    /// The result has `cols - rank` rows and `cols` columns; it is a
    /// parity-check matrix for the code whose generator is `self`.
    pub fn null_space(&self) -> BitMatrix {
        let RowEchelon { reduced, pivots } = self.row_echelon();
        let free: Vec<usize> = (0..self.cols).filter(|c| !pivots.contains(c)).collect();
        let mut basis = BitMatrix::zeros(free.len(), self.cols);
        for (i, &f) in free.iter().enumerate() {
            // x_f = 1, other free variables 0, each pivot variable fixed by its row.
            basis.set(i, f, true);
            for (row, &p) in pivots.iter().enumerate() {
                if reduced.get(row, f) {
                    basis.set(i, p, true);
                }
            }
        }
        basis
    }

    /// The inverse of a square matrix.
    pub fn inverse(&self) -> Result<BitMatrix> {
        if self.rows != self.cols {
            return Err(Gf2Error::DimensionMismatch {
                op: "inverse (matrix must be square)",
                expected: self.rows,
                found: self.cols,
            });
        }
        let n = self.rows;
        let augmented = self.hstack(&BitMatrix::identity(n))?;
        let RowEchelon { reduced, pivots } = augmented.row_echelon();
        let rank = pivots.iter().filter(|&&p| p < n).count();
        if rank < n {
            return Err(Gf2Error::Singular { rank, size: n });
        }
        Ok(reduced.select_columns(&(n..2 * n).collect::<Vec<_>>()))
    }

    /// `[self | other]`.
    pub fn hstack(&self, other: &BitMatrix) -> Result<BitMatrix> {
        if self.rows != other.rows {
            return Err(Gf2Error::DimensionMismatch {
                op: "hstack (row counts)",
                expected: self.rows,
                found: other.rows,
            });
        }
        let mut m = BitMatrix::zeros(self.rows, self.cols + other.cols);
        for r in 0..self.rows {
            for c in self.row(r).iter_ones() {
                m.set(r, c, true);
            }
            for c in other.row(r).iter_ones() {
                m.set(r, self.cols + c, true);
            }
        }
        Ok(m)
    }

    /// The matrix formed by the given columns, in the given order.
    ///
    /// # Panics
    /// If a column index is out of range.
    pub fn select_columns(&self, columns: &[usize]) -> BitMatrix {
        let mut m = BitMatrix::zeros(self.rows, columns.len());
        for r in 0..self.rows {
            for (j, &c) in columns.iter().enumerate() {
                if self.get(r, c) {
                    m.set(r, j, true);
                }
            }
        }
        m
    }

    /// Whether every entry is zero.
    pub fn is_zero(&self) -> bool {
        self.data.iter().all(|&w| w == 0)
    }

    fn swap_rows(&mut self, a: usize, b: usize) {
        if a != b {
            for w in 0..self.stride {
                self.data.swap(a * self.stride + w, b * self.stride + w);
            }
        }
    }

    fn check_index(&self, r: usize, c: usize) {
        assert!(
            r < self.rows && c < self.cols,
            "index ({r}, {c}) out of range for a {}x{} matrix",
            self.rows,
            self.cols
        );
    }
}

impl std::fmt::Debug for BitMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "BitMatrix {}x{} [", self.rows, self.cols)?;
        for r in 0..self.rows {
            write!(f, "  ")?;
            for c in 0..self.cols {
                f.write_str(if self.get(r, c) { "1" } else { "0" })?;
            }
            writeln!(f)?;
        }
        write!(f, "]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The naive reference: a matrix as `Vec<Vec<bool>>`.
    type Naive = Vec<Vec<bool>>;

    fn naive_mul(a: &Naive, b: &Naive, inner: usize, cols: usize) -> Naive {
        a.iter()
            .map(|row| {
                (0..cols)
                    .map(|j| (0..inner).filter(|&k| row[k] && b[k][j]).count() % 2 == 1)
                    .collect()
            })
            .collect()
    }

    fn naive_rank(mut m: Naive, cols: usize) -> usize {
        let mut rank = 0;
        for c in 0..cols {
            if let Some(p) = (rank..m.len()).find(|&r| m[r][c]) {
                m.swap(rank, p);
                for r in 0..m.len() {
                    if r != rank && m[r][c] {
                        let pivot = m[rank].clone();
                        for (x, y) in m[r].iter_mut().zip(pivot) {
                            *x ^= y;
                        }
                    }
                }
                rank += 1;
            }
        }
        rank
    }

    fn to_naive(m: &BitMatrix) -> Naive {
        (0..m.rows())
            .map(|r| (0..m.cols()).map(|c| m.get(r, c)).collect())
            .collect()
    }

    fn matrix(rows: usize, cols: usize) -> impl Strategy<Value = Naive> {
        proptest::collection::vec(proptest::collection::vec(any::<bool>(), cols), rows)
    }

    fn dims() -> impl Strategy<Value = (usize, usize, usize)> {
        (1usize..40, 1usize..140, 1usize..40)
    }

    proptest! {
        #[test]
        fn multiply_matches_naive(
            (a, b, n, k, m) in dims().prop_flat_map(|(n, k, m)| (matrix(n, k), matrix(k, m), Just(n), Just(k), Just(m)))
        ) {
            let ma = BitMatrix::from_bool_rows(&a).unwrap();
            let mb = BitMatrix::from_bool_rows(&b).unwrap();
            let prod = ma.mul(&mb).unwrap();
            prop_assert_eq!(to_naive(&prod), naive_mul(&a, &b, k, m));
            prop_assert_eq!(prod.rows(), n);
            // (AB)ᵀ = BᵀAᵀ
            let lhs = prod.transpose();
            let rhs = mb.transpose().mul(&ma.transpose()).unwrap();
            prop_assert_eq!(lhs, rhs);
        }

        #[test]
        fn transpose_matches_naive(a in (1usize..70, 1usize..140).prop_flat_map(|(r, c)| matrix(r, c))) {
            let m = BitMatrix::from_bool_rows(&a).unwrap();
            let t = to_naive(&m.transpose());
            for (r, row) in a.iter().enumerate() {
                for (c, &b) in row.iter().enumerate() {
                    prop_assert_eq!(t[c][r], b);
                }
            }
        }

        #[test]
        fn rank_and_null_space_match_naive(a in (1usize..30, 1usize..100).prop_flat_map(|(r, c)| matrix(r, c))) {
            let m = BitMatrix::from_bool_rows(&a).unwrap();
            let cols = m.cols();
            let rank = m.rank();
            prop_assert_eq!(rank, naive_rank(a.clone(), cols));
            let ns = m.null_space();
            // dimension theorem, independence, and orthogonality
            prop_assert_eq!(ns.rows(), cols - rank);
            prop_assert_eq!(ns.rank(), cols - rank);
            prop_assert!(m.mul(&ns.transpose()).unwrap().is_zero());
            // the echelon form spans the same row space
            let ech = m.row_echelon();
            prop_assert_eq!(ech.pivots.len(), rank);
            let stacked = BitMatrix::from_bool_rows(&[a.clone(), to_naive(&ech.reduced)].concat()).unwrap();
            prop_assert_eq!(stacked.rank(), rank);
        }

        #[test]
        fn inverse_is_inverse_or_singular(a in (1usize..70).prop_flat_map(|n| matrix(n, n))) {
            let m = BitMatrix::from_bool_rows(&a).unwrap();
            let n = m.rows();
            match m.inverse() {
                Ok(inv) => {
                    prop_assert_eq!(m.mul(&inv).unwrap(), BitMatrix::identity(n));
                    prop_assert_eq!(inv.mul(&m).unwrap(), BitMatrix::identity(n));
                }
                Err(Gf2Error::Singular { rank, size }) => {
                    prop_assert!(rank < size);
                    prop_assert_eq!(rank, naive_rank(a.clone(), n));
                }
                Err(e) => prop_assert!(false, "unexpected error {e}"),
            }
        }

        #[test]
        fn vector_products_match_matrix_products(
            (a, v, w) in (1usize..30, 1usize..100).prop_flat_map(|(r, c)| (
                matrix(r, c),
                proptest::collection::vec(any::<bool>(), r),
                proptest::collection::vec(any::<bool>(), c),
            ))
        ) {
            let m = BitMatrix::from_bool_rows(&a).unwrap();
            let vm = m.vec_mul(&BitVec::from_bools(&v)).unwrap();
            let naive_vm = naive_mul(&vec![v.clone()], &a, a.len(), m.cols());
            prop_assert_eq!(vm.to_bools(), naive_vm[0].clone());
            let mv = m.mul_vec(&BitVec::from_bools(&w)).unwrap();
            let naive_mv: Vec<bool> = a.iter().map(|row| row.iter().zip(&w).filter(|(x, y)| **x && **y).count() % 2 == 1).collect();
            prop_assert_eq!(mv.to_bools(), naive_mv);
        }
    }

    #[test]
    fn shape_errors() {
        let a = BitMatrix::zeros(3, 4);
        let b = BitMatrix::zeros(5, 2);
        assert!(matches!(a.mul(&b), Err(Gf2Error::DimensionMismatch { .. })));
        assert!(a.inverse().is_err());
        assert!(a.vec_mul(&BitVec::zeros(4)).is_err());
        assert!(a.mul_vec(&BitVec::zeros(3)).is_err());
        assert!(a.hstack(&b).is_err());
        assert!(BitMatrix::from_str_rows(&["101", "10"]).is_err());
        assert!(matches!(
            BitMatrix::from_str_rows(&["10x"]),
            Err(Gf2Error::Parse { .. })
        ));
        assert!(BitMatrix::from_u64_rows(&[1], 65).is_err());
        assert!(matches!(
            BitMatrix::from_str_rows(&["11", "11"]).unwrap().inverse(),
            Err(Gf2Error::Singular { rank: 1, size: 2 })
        ));
    }
}
