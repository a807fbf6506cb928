//! [`Partial`]: the running softmax state of a set of query heads, and the
//! exact log-sum-exp merge of states over disjoint keys (section 3.3 of
//! `lowrank-kv-subspace-paper.md`, "blockwise softmax across chunks"),
//! folded in f64 so long contexts lose nothing to the running sums.

/// Running softmax state of a set of query heads: per head the running
/// maximum score `m`, the sum `l = Σ exp(s − m)` and `acc = Σ exp(s − m)·v`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Partial {
    d: usize,
    m: Vec<f32>,
    l: Vec<f64>,
    acc: Vec<f64>,
}

impl Partial {
    /// The empty state (every key masked so far) of `heads` heads of `d` channels.
    pub(crate) fn new(heads: usize, d: usize) -> Self {
        Self {
            d,
            m: vec![f32::NEG_INFINITY; heads],
            l: vec![0.0; heads],
            acc: vec![0.0; heads * d],
        }
    }

    /// Makes this the empty state of `heads` heads of `d` channels, reusing
    /// its buffers.
    pub(crate) fn reset(&mut self, heads: usize, d: usize) {
        self.d = d;
        self.m.clear();
        self.m.resize(heads, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(heads, 0.0);
        self.acc.clear();
        self.acc.resize(heads * d, 0.0);
    }

    /// Folds in one head's tile result: maximum `m`, `Σ exp(s − m)` and the weighted sum.
    /// (Inlined, so that the tile kernels' instruction sets vectorise it:
    /// the same operations in the same order, so the same bits.)
    #[inline(always)]
    pub(crate) fn fold(&mut self, head: usize, m: f32, l: f32, acc: &[f32]) {
        self.fold_f64(head, m, f64::from(l), acc.iter().map(|&a| f64::from(a)));
    }

    #[inline(always)]
    fn fold_f64(&mut self, head: usize, m: f32, l: f64, acc: impl Iterator<Item = f64>) {
        if l == 0.0 {
            return;
        }
        let acc_run = &mut self.acc[head * self.d..][..self.d];
        let m_run = self.m[head];
        if self.l[head] == 0.0 {
            self.m[head] = m;
            self.l[head] = l;
            acc_run.iter_mut().zip(acc).for_each(|(r, a)| *r = a);
            return;
        }
        let m_new = m_run.max(m);
        // One of the two factors is `exp(0) = 1` exactly (for maxima that
        // are not NaN, as the kernels' are not): one `exp` per fold.
        let (a, b) = if m >= m_run {
            ((f64::from(m_run) - f64::from(m_new)).exp(), 1.0)
        } else {
            (1.0, (f64::from(m) - f64::from(m_new)).exp())
        };
        self.m[head] = m_new;
        self.l[head] = self.l[head] * a + l * b;
        acc_run
            .iter_mut()
            .zip(acc)
            .for_each(|(r, x)| *r = *r * a + x * b);
    }

    /// Merges another partial over other keys (log-sum-exp merge; exact up
    /// to the f64 rounding of the rescaling).
    pub(crate) fn merge(&mut self, other: &Partial) {
        for h in 0..self.m.len() {
            let acc = other.acc[h * self.d..][..self.d].iter().copied();
            self.fold_f64(h, other.m[h], other.l[h], acc);
        }
    }

    /// Writes the normalised output (`acc / l`, zero where every key was
    /// masked) and the log-sum-exp (`m + ln l`, `-inf` there).
    pub(crate) fn finish(&self, out: &mut [f32], lse: &mut [f32]) {
        for (h, (o, lse)) in out.chunks_exact_mut(self.d).zip(lse).enumerate() {
            let l = self.l[h];
            if l == 0.0 {
                o.fill(0.0);
                *lse = f32::NEG_INFINITY;
            } else {
                for (o, a) in o.iter_mut().zip(&self.acc[h * self.d..][..self.d]) {
                    *o = (a / l) as f32;
                }
                *lse = (f64::from(self.m[h]) + l.ln()) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_two_halves_equals_one_pass() {
        let mut whole = Partial::new(1, 2);
        whole.fold(0, 3.0, 2.0, &[1.0, 4.0]);
        whole.fold(0, 1.0, 5.0, &[2.0, -1.0]);
        let mut first = Partial::new(1, 2);
        first.fold(0, 3.0, 2.0, &[1.0, 4.0]);
        let mut second = Partial::new(1, 2);
        second.fold(0, 1.0, 5.0, &[2.0, -1.0]);
        let mut merged = Partial::new(1, 2);
        merged.merge(&first);
        merged.merge(&second);
        assert_eq!(merged, whole);
        // l = 2 + 5e^-2, acc = [1 + 2e^-2, 4 − e^-2], relative to m = 3.
        let e = (-2f64).exp();
        let (mut out, mut lse) = ([0.0f32; 2], [0.0f32]);
        whole.finish(&mut out, &mut lse);
        let l = 2.0 + 5.0 * e;
        approx::assert_abs_diff_eq!(f64::from(out[0]), (1.0 + 2.0 * e) / l, epsilon = 1e-7);
        approx::assert_abs_diff_eq!(f64::from(out[1]), (4.0 - e) / l, epsilon = 1e-7);
        approx::assert_abs_diff_eq!(f64::from(lse[0]), 3.0 + l.ln(), epsilon = 1e-6);
        // An empty state finishes as zeros and -inf.
        Partial::new(1, 2).finish(&mut out, &mut lse);
        assert_eq!((out, lse), ([0.0; 2], [f32::NEG_INFINITY]));
    }
}
