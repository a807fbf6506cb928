//! The models kv-eval runs and what they share: the [`CausalLm`] interface
//! (a forward pass over any [`KvBackend`], the [`ModelCache`]), the
//! projections ([`Projection`]: weights as stored, multiplied by kv-model's
//! kernels, or dense f32 through abft-gemm's linear layer) and their GEMM
//! checks. Llama-family models in [`llama`], GPT-2 in [`gpt2`].

pub mod gpt2;
pub mod llama;
mod weights;

pub use gpt2::{Gpt2Config, Gpt2Layer, Gpt2Model};
pub use llama::{LlamaArch, LlamaConfig, LlamaLayer, LlamaModel};
pub use weights::Projection;
pub(crate) use weights::{project, project_dense};

pub use abft_gemm::Matrix;
use attention::{KvBackend, Rope};

use crate::error::{EvalError, Result};

/// The KV cache a forward pass talks to: any [`KvBackend`] whose errors are
/// this crate's (the re-encoding [`KvCache`](crate::cache::KvCache), the
/// f32 oracle, the paged cache).
pub type ModelCache = dyn KvBackend<Error = EvalError>;

/// A causal language model whose K and V go through a [`KvBackend`].
pub trait CausalLm: Send + Sync {
    /// Vocabulary size (logits per token).
    fn vocab(&self) -> usize;
    /// Transformer blocks.
    fn layers(&self) -> usize;
    /// K (or V) channels per token and layer.
    fn kv_channels(&self) -> usize;
    /// Channels per attention head.
    fn head_dim(&self) -> usize;
    /// The rotary embedding of the keys, if the model has one (forms that
    /// project keys before RoPE undo and redo it).
    fn rope(&self) -> Option<&Rope> {
        None
    }
    /// The context the model was trained to (positions past it are
    /// refused by learned-position models and unreliable for RoPE ones).
    fn context(&self) -> Option<usize> {
        None
    }
    /// Checks every projection from now on as `config` says (`None`
    /// switches the checks off). Stored weights are dequantised to f32
    /// first (the checksums are taken over f32 weights).
    fn set_gemm_checks(&mut self, config: Option<GemmCheckConfig>) -> Result<()>;
    /// What the projection checks found, when they are on.
    fn gemm_checks(&self) -> Option<GemmCheckStats>;
    /// How attention scores integer-coded keys from now on.
    fn set_numerics(&mut self, numerics: attention::Numerics);
    /// A one-line description (architecture and shape).
    fn describe(&self) -> String;
    /// Bytes the weights take in memory.
    fn weight_bytes(&self) -> usize;
    /// Runs `tokens` after what `cache` already holds (their positions
    /// follow the cache's), appends their K and V to it as one step
    /// (committed on success, rolled back on error), and returns the logits
    /// (`vocab` per token) of the tokens from index `logits_from` on.
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache,
        logits_from: usize,
    ) -> Result<Vec<f32>>;

    /// Runs several sequences as one batch: each item's tokens after what
    /// its cache holds, its logits from `logits_from` on (as
    /// [`forward`](Self::forward) returns them, one vector per item).
    /// Llama-family models share every projection's GEMM across the batch
    /// (the weights are read once per step, not once per sequence) and
    /// attend per sequence; an error rolls every item's step back. This
    /// default runs the items one after the other (an error leaves the
    /// items before it committed).
    fn forward_batch(&self, batch: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter_mut()
            .map(|item| self.forward(item.tokens, &mut *item.cache, item.logits_from))
            .collect()
    }
}

/// One sequence of a batched forward pass ([`CausalLm::forward_batch`]).
pub struct BatchItem<'a> {
    /// Its new tokens.
    pub tokens: &'a [u32],
    /// Its cache.
    pub cache: &'a mut ModelCache,
    /// Index of its first token whose logits are returned.
    pub logits_from: usize,
}

impl std::fmt::Debug for BatchItem<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchItem")
            .field("tokens", &self.tokens)
            .field("cached", &self.cache.tokens())
            .field("logits_from", &self.logits_from)
            .finish()
    }
}

/// Refuses an empty call, a `logits_from` past the tokens and ids outside
/// the vocabulary.
fn check_tokens(tokens: &[u32], vocab: usize, logits_from: usize) -> Result<()> {
    let t = tokens.len();
    if t == 0 || logits_from > t {
        return Err(EvalError::EmptyForward {
            tokens: t,
            logits_from,
        });
    }
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(EvalError::TokenId { id, vocab });
    }
    Ok(())
}

/// [`forward_step`] for a batch: checks every item and sizes its cache,
/// opens a step on each, runs `step` over them all, then commits every
/// step, or rolls every open step back if anything failed.
pub(crate) fn forward_steps(
    batch: &mut [BatchItem<'_>],
    vocab: usize,
    model: &attention::ModelKvShape<'_>,
    step: impl FnOnce(&mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    for item in batch.iter_mut() {
        check_tokens(item.tokens, vocab, item.logits_from)?;
        item.cache.fit(model)?;
    }
    for i in 0..batch.len() {
        let item = &mut batch[i];
        if let Err(e) = item.cache.begin(item.tokens) {
            for open in &mut batch[..i] {
                open.cache.rollback();
            }
            return Err(e);
        }
    }
    match step(batch) {
        Ok(out) => {
            for item in batch.iter_mut() {
                item.cache.commit()?;
            }
            Ok(out)
        }
        Err(e) => {
            for item in batch.iter_mut() {
                item.cache.rollback();
            }
            Err(e)
        }
    }
}

/// The set-up every forward pass shares: refuses an empty call, a
/// `logits_from` past the tokens and ids outside the vocabulary, sizes
/// `cache` for `model`, then runs `step` as one cache step (committed on
/// success, rolled back on error).
pub(crate) fn forward_step(
    tokens: &[u32],
    vocab: usize,
    logits_from: usize,
    model: &attention::ModelKvShape<'_>,
    cache: &mut ModelCache,
    step: impl FnOnce(&mut ModelCache) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    check_tokens(tokens, vocab, logits_from)?;
    cache.fit(model)?;
    attention::run_step(cache, tokens, step)
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
    /// Prepared weights, by the address of their data.
    prepared: std::collections::HashMap<usize, abft_gemm::CheckedLinear>,
    products: std::sync::atomic::AtomicU64,
    rows: std::sync::atomic::AtomicU64,
    flagged: std::sync::atomic::AtomicU64,
    false_alarms: std::sync::atomic::AtomicU64,
    injected: [std::sync::atomic::AtomicU64; 32],
    eligible: [std::sync::atomic::AtomicU64; 32],
    detected: [std::sync::atomic::AtomicU64; 32],
}

/// A model's projection checks, if switched on. A cloned model starts with
/// them off (its weights live elsewhere, and the checks are keyed by them).
#[derive(Debug, Default)]
pub(crate) struct ChecksSlot(pub(crate) Option<Box<GemmChecks>>);

impl Clone for ChecksSlot {
    fn clone(&self) -> Self {
        Self(None)
    }
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
    /// Prepares `weights` for `config`.
    pub fn new(config: GemmCheckConfig, weights: &[&Matrix]) -> Self {
        let rule = config.rule;
        Self {
            flips: config.flips,
            correct: config.correct,
            corrected: Default::default(),
            uncorrected: Default::default(),
            prepared: weights
                .iter()
                .map(|w| {
                    (
                        w.data.as_ptr() as usize,
                        abft_gemm::CheckedLinear::new(w, rule),
                    )
                })
                .collect(),
            products: Default::default(),
            rows: Default::default(),
            flagged: Default::default(),
            false_alarms: Default::default(),
            injected: Default::default(),
            eligible: Default::default(),
            detected: Default::default(),
        }
    }

    pub(crate) fn check(&self, w: &Matrix, x: &[f32], product: &mut [f32]) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let prepared = self
            .prepared
            .get(&(w.data.as_ptr() as usize))
            .ok_or_else(|| {
                crate::error::EvalError::Model(
                    "a projection whose weights were not prepared for checks".into(),
                )
            })?;
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

/// Refuses a normalisation epsilon that is NaN, infinite or not positive
/// (it would turn every hidden state into NaN or ∞ without a word).
pub(crate) fn check_norm_eps(eps: f32) -> Result<()> {
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(crate::error::EvalError::Model(format!(
            "normalisation epsilon {eps} is not a positive finite number"
        )))
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
