//! kv-eval's GEMM checks: every projection of a model's forward pass
//! checked by row checksums (abft-gemm's V-ABFT, A-ABFT or a fixed
//! tolerance), optionally with faults injected into the products, plugged
//! into kv-model's models as their [`ProjectionHook`]. The checksums are
//! taken over f32 weights: [`install`] keeps a dense f32 copy of every
//! projection the model stores quantised (the model keeps its stored
//! weights for everything else).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use abft_gemm::Matrix;
use kv_model::ModelError;
use kv_model::model::{CausalLm, Projection, ProjectionHook, ProjectionId};

use crate::error::{EvalError, Result};

/// Checks every projection of `model` from now on as `config` says (`None`
/// switches the checks off) and returns the checks, whose
/// [`stats`](GemmChecks::stats) say what they found.
pub fn install(
    model: &mut dyn CausalLm,
    config: Option<GemmCheckConfig>,
) -> Result<Option<Arc<GemmChecks>>> {
    let Some(config) = config else {
        model.set_projection_hook(None);
        return Ok(None);
    };
    let checks = Arc::new(GemmChecks::new(config, &model.projections())?);
    model.set_projection_hook(Some(checks.clone()));
    Ok(Some(checks))
}

/// Faults injected into the checked products: each element of the chosen
/// site flips one uniformly chosen bit of its f32 with probability `rate`
/// (before the check; the model computes on with the faulty product).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmFlips {
    /// Probability that an element of the site is hit.
    pub rate: f64,
    /// Seed (product `i` draws from stream `i`).
    pub seed: u64,
    /// Where the flips land.
    pub site: FlipSite,
}

/// Where an injected GEMM flip lands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlipSite {
    /// An element of the product, after the GEMM.
    #[default]
    Output,
    /// An output element's running sum after a uniformly chosen number
    /// `j ∈ 1..=K` of its terms: the partial sum `Σ_{k<j} x_k·w_k` is
    /// recomputed in f32, flipped, and the product moves by the difference,
    /// as if the remaining terms had been added to the flipped sum.
    Accumulator,
    /// A weight element (the f32 the GEMM reads) while this product is
    /// computed: every row of its output column moves by `x_k·(w' − w)`.
    /// The stored weights stay clean, so the next product reads them
    /// correctly.
    Weight,
}

impl FlipSite {
    /// The site's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Output => "output",
            Self::Accumulator => "accumulator",
            Self::Weight => "weight",
        }
    }
}

/// How a model's projections are checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCheckConfig {
    /// The threshold rule (V-ABFT, A-ABFT or a fixed tolerance).
    pub rule: abft_gemm::LinearRule,
    /// Faults injected into the products, if any.
    pub flips: Option<GemmFlips>,
    /// Correct flagged rows (one corrupted element each, located by
    /// column checksums).
    pub correct: bool,
}

/// Every projection of a model's forward pass checked by row checksums
/// (abft-gemm) under one threshold rule, the weight side prepared once per
/// matrix.
#[derive(Debug)]
pub struct GemmChecks {
    flips: Option<GemmFlips>,
    correct: bool,
    corrected: std::sync::atomic::AtomicU64,
    uncorrected: std::sync::atomic::AtomicU64,
    /// Per projection: its f32 weights (a copy where the model stores them
    /// quantised) and their prepared checks.
    prepared: HashMap<ProjectionId, (Option<Matrix>, abft_gemm::CheckedLinear)>,
    products: std::sync::atomic::AtomicU64,
    rows: std::sync::atomic::AtomicU64,
    flagged: std::sync::atomic::AtomicU64,
    false_alarms: std::sync::atomic::AtomicU64,
    injected: [std::sync::atomic::AtomicU64; 32],
    eligible: [std::sync::atomic::AtomicU64; 32],
    detected: [std::sync::atomic::AtomicU64; 32],
}

/// What the GEMM checks of a run found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GemmCheckStats {
    /// Products checked.
    pub products: u64,
    /// Rows (token × product) checked.
    pub rows: u64,
    /// Rows whose checksum exceeded the rule's bound.
    pub flagged: u64,
    /// Rows that fired before any flip was injected into their product
    /// (false alarms, or inputs corrupted by an earlier product's flip).
    pub false_alarms: u64,
    /// Injected flips per bit position (0 = mantissa LSB, 31 = sign).
    pub injected: [u64; 32],
    /// Of those, flips alone in a row whose check passed before the flip
    /// (the ones whose detection can be judged bit by bit).
    pub eligible: [u64; 32],
    /// Injected flips that made their row's check fire, per bit position.
    pub detected: [u64; 32],
    /// Flagged rows whose corrupted element was located and rewritten.
    pub corrected: u64,
    /// Flagged rows left as they were (the rewrite did not pass), when
    /// correction is on.
    pub uncorrected: u64,
}

impl GemmChecks {
    /// Prepares the projections `weights` for `config` (stored ones
    /// dequantised to f32).
    pub fn new(config: GemmCheckConfig, weights: &[(ProjectionId, &Projection)]) -> Result<Self> {
        let rule = config.rule;
        let prepared = weights
            .iter()
            .map(|&(id, p)| {
                let dense = p.to_dense()?;
                let checked = abft_gemm::CheckedLinear::new(&dense, rule);
                // Kept only where the model's own weights are not f32.
                let copy = match dense {
                    Cow::Owned(m) => Some(m),
                    Cow::Borrowed(_) => None,
                };
                Ok((id, (copy, checked)))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            flips: config.flips,
            correct: config.correct,
            corrected: Default::default(),
            uncorrected: Default::default(),
            prepared,
            products: Default::default(),
            rows: Default::default(),
            flagged: Default::default(),
            false_alarms: Default::default(),
            injected: Default::default(),
            eligible: Default::default(),
            detected: Default::default(),
        })
    }

    /// Checks `product` (`x · wᵀ`, computed) of prepared weights `w`
    /// (injecting the configured flips first).
    fn check(
        &self,
        prepared: &abft_gemm::CheckedLinear,
        w: &Matrix,
        x: &[f32],
        product: &mut [f32],
    ) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let index = self.products.fetch_add(1, Relaxed);
        // The checks of the product as computed: a row that fires here has
        // no injected flip (a false alarm, or inputs already corrupted by
        // an earlier product's flip).
        let before = prepared.flags(x, product)?;
        let flags = match self.flips {
            Some(f) => {
                let hits = inject(product, x, w, f, index);
                let after = if hits.is_empty() {
                    before.clone()
                } else {
                    prepared.flags(x, product)?
                };
                let outputs = w.rows.max(1);
                // The rows each flip moves: its own for output and
                // accumulator flips, every row for a weight flip.
                let rows_of = |at: usize| match f.site {
                    FlipSite::Weight => 0..before.len(),
                    _ => at / outputs..at / outputs + 1,
                };
                let mut per_row = vec![0u32; before.len()];
                for &(at, _) in &hits {
                    for r in rows_of(at) {
                        per_row[r] += 1;
                    }
                }
                for &(at, bit) in &hits {
                    self.injected[bit as usize].fetch_add(1, Relaxed);
                    // Only a flip alone in rows that passed before it can
                    // tell whether a flip of its bit is caught.
                    if rows_of(at).all(|r| !before[r] && per_row[r] == 1) {
                        self.eligible[bit as usize].fetch_add(1, Relaxed);
                        if rows_of(at).any(|r| after[r]) {
                            self.detected[bit as usize].fetch_add(1, Relaxed);
                        }
                    }
                }
                after
            }
            None => before.clone(),
        };
        let count = |f: &[bool]| f.iter().filter(|&&f| f).count() as u64;
        if self.correct && flags.contains(&true) {
            let rows: Vec<usize> = (0..flags.len()).filter(|&r| flags[r]).collect();
            let fixed = prepared.correct_rows(x, w, product, &rows)?;
            self.corrected.fetch_add(fixed as u64, Relaxed);
            self.uncorrected
                .fetch_add((rows.len() - fixed) as u64, Relaxed);
        }
        self.rows.fetch_add(flags.len() as u64, Relaxed);
        self.flagged.fetch_add(count(&flags), Relaxed);
        self.false_alarms.fetch_add(count(&before), Relaxed);
        Ok(())
    }

    /// The counts so far.
    pub fn stats(&self) -> GemmCheckStats {
        use std::sync::atomic::Ordering::Relaxed;
        GemmCheckStats {
            products: self.products.load(Relaxed),
            rows: self.rows.load(Relaxed),
            flagged: self.flagged.load(Relaxed),
            false_alarms: self.false_alarms.load(Relaxed),
            injected: std::array::from_fn(|b| self.injected[b].load(Relaxed)),
            eligible: std::array::from_fn(|b| self.eligible[b].load(Relaxed)),
            detected: std::array::from_fn(|b| self.detected[b].load(Relaxed)),
            corrected: self.corrected.load(Relaxed),
            uncorrected: self.uncorrected.load(Relaxed),
        }
    }
}

/// Injects the flips of product `index` at `flips.site` into `product`
/// (`x · wᵀ`, computed); returns `(element of the site, bit)` of each.
fn inject(
    product: &mut [f32],
    x: &[f32],
    w: &Matrix,
    flips: GemmFlips,
    index: u64,
) -> Vec<(usize, u32)> {
    let (outputs, terms) = (w.rows, w.cols);
    let mut rng = gf2_codes::channel::FaultRng::with_stream(flips.seed, index);
    let flip = |v: f32, bit: u32| f32::from_bits(v.to_bits() ^ (1 << bit));
    match flips.site {
        FlipSite::Output => {
            let hits = draw_hits(product.len(), flips.rate, &mut rng);
            for &(i, bit) in &hits {
                product[i] = flip(product[i], bit);
            }
            hits
        }
        FlipSite::Accumulator => {
            let hits = draw_hits(product.len(), flips.rate, &mut rng);
            for &(i, bit) in &hits {
                let (row, col) = (i / outputs, i % outputs);
                let done = 1 + rng.below(terms.max(1) as u64) as usize;
                let partial = x[row * terms..][..done]
                    .iter()
                    .zip(&w.data[col * terms..][..done])
                    .fold(0f32, |acc, (a, b)| acc + a * b);
                product[i] += flip(partial, bit) - partial;
            }
            hits
        }
        FlipSite::Weight => {
            let hits = draw_hits(w.data.len(), flips.rate, &mut rng);
            for &(j, bit) in &hits {
                let (col, k) = (j / terms, j % terms);
                let delta = flip(w.data[j], bit) - w.data[j];
                for (row, out) in product.chunks_exact_mut(outputs).enumerate() {
                    out[col] += x[row * terms + k] * delta;
                }
            }
            hits
        }
    }
}

/// The elements of a site of `len` hit with probability `rate` each
/// (geometric gaps), each with a uniformly chosen bit.
fn draw_hits(len: usize, rate: f64, rng: &mut gf2_codes::channel::FaultRng) -> Vec<(usize, u32)> {
    let mut hits = Vec::new();
    if rate <= 0.0 {
        return hits;
    }
    let ln_q = (-rate).ln_1p();
    let gap = |rng: &mut gf2_codes::channel::FaultRng| -> usize {
        if rate >= 1.0 {
            return 0;
        }
        let g = (1.0 - rng.next_f64()).ln() / ln_q;
        if g.is_finite() && g < usize::MAX as f64 {
            g as usize
        } else {
            usize::MAX
        }
    };
    let mut i = gap(rng);
    while i < len {
        hits.push((i, rng.below(32) as u32));
        i = i.saturating_add(1).saturating_add(gap(rng));
    }
    hits
}

impl ProjectionHook for GemmChecks {
    /// The product through abft-gemm's linear layer on the f32 weights,
    /// verified by row checks before it is added: computed alone (not
    /// accumulated into `out` by the GEMM), which can change the last bit
    /// of a residual sum.
    fn project(
        &self,
        id: ProjectionId,
        weights: &Projection,
        x: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) -> std::result::Result<(), ModelError> {
        let (copy, prepared) = self.prepared.get(&id).ok_or_else(|| {
            ModelError::from(EvalError::Model(format!(
                "projection {id:?} was not prepared for checks"
            )))
        })?;
        let Some(w) = copy.as_ref().or(weights.dense()) else {
            return Err(EvalError::Model(format!("projection {id:?} has no f32 weights")).into());
        };
        if accumulate {
            let mut product = vec![0.0; out.len()];
            abft_gemm::linear_into(&mut product, x, w, false)?;
            self.check(prepared, w, x, &mut product)?;
            for (o, p) in out.iter_mut().zip(&product) {
                *o += p;
            }
        } else {
            abft_gemm::linear_into(out, x, w, false)?;
            self.check(prepared, w, x, out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · wᵀ` for a seeded `t × k` input and `n × k` weights.
    fn product(t: usize, k: usize, n: usize) -> (Vec<f32>, Matrix, Vec<f32>) {
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w = Matrix::new(
            n,
            k,
            (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 60.0)
                .collect(),
        )
        .unwrap();
        let mut out = vec![0.0; t * n];
        abft_gemm::linear_into(&mut out, &x, &w, false).unwrap();
        (x, w, out)
    }

    fn flips(site: FlipSite) -> GemmFlips {
        GemmFlips {
            rate: 0.02,
            seed: 9,
            site,
        }
    }

    fn flip(v: f32, bit: u32) -> f32 {
        f32::from_bits(v.to_bits() ^ (1 << bit))
    }

    #[test]
    fn output_flips_change_exactly_their_elements() {
        let (x, w, clean) = product(6, 40, 30);
        let mut faulty = clean.clone();
        let hits = inject(&mut faulty, &x, &w, flips(FlipSite::Output), 4);
        assert!(hits.len() > 1);
        let mut expected = clean.clone();
        for &(i, bit) in &hits {
            expected[i] = flip(expected[i], bit);
        }
        assert_eq!(
            faulty.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // The same seed and product index give the same flips.
        let mut again = clean.clone();
        assert_eq!(inject(&mut again, &x, &w, flips(FlipSite::Output), 4), hits);
    }

    #[test]
    fn accumulator_flips_move_an_element_by_a_flipped_partial_sum() {
        let (x, w, clean) = product(6, 40, 30);
        let mut faulty = clean.clone();
        let hits = inject(&mut faulty, &x, &w, flips(FlipSite::Accumulator), 2);
        assert!(hits.len() > 1);
        let (n, k) = (w.rows, w.cols);
        for (i, (&f, &c)) in faulty.iter().zip(&clean).enumerate() {
            let Some(&(_, bit)) = hits.iter().find(|h| h.0 == i) else {
                assert_eq!(f.to_bits(), c.to_bits(), "element {i} has no flip");
                continue;
            };
            let (row, col) = (i / n, i % n);
            // Some count of accumulated terms explains the value exactly.
            let explained = (1..=k).any(|j| {
                let p = (0..j).fold(0f32, |a, m| a + x[row * k + m] * w.data[col * k + m]);
                let moved = c + (flip(p, bit) - p);
                moved.to_bits() == f.to_bits() || moved.is_nan() && f.is_nan()
            });
            assert!(explained, "element {i} bit {bit}: {c} -> {f}");
        }
    }

    #[test]
    fn weight_flips_equal_the_product_with_the_flipped_weights() {
        let (x, w, clean) = product(5, 24, 20);
        let mut faulty = clean.clone();
        let hits = inject(&mut faulty, &x, &w, flips(FlipSite::Weight), 7);
        assert!(hits.len() > 1);
        let mut bad = w.data.clone();
        for &(j, bit) in &hits {
            bad[j] = flip(bad[j], bit);
        }
        let (n, k) = (w.rows, w.cols);
        for (i, &f) in faulty.iter().enumerate() {
            let (row, col) = (i / n, i % n);
            let terms = (0..k).map(|m| x[row * k + m] as f64 * bad[col * k + m] as f64);
            let (exact, scale) = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
            if !scale.is_finite() || scale > 1e30 {
                // An exponent flip made a weight huge: the row is huge too.
                assert!(f.abs() > 1e20 || !f.is_finite(), "element {i}: {f}");
                continue;
            }
            let tol = 1e-5 * scale + 1e-6;
            assert!(
                (f as f64 - exact).abs() <= tol,
                "element {i}: {f} against {exact}"
            );
        }
    }
}
