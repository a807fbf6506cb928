//! Codebooks of the vector-quantized forms: k-means over groups of `dim`
//! consecutive coordinates.
//!
//! - `vq` (Shard's value path, section 6): a store of `channels` channels
//!   with rotation blocks of `N` channels has `channels / N` blocks (one
//!   per head when `N` is the head dimension), and each block has its own
//!   codebook of `K` centroids in `dim` dimensions, shared by every group
//!   of `dim` rotated coordinates of the block.
//! - `cq` (Coupled Quantization, Zhang et al. 2024, "KV Cache is 1 Bit Per
//!   Channel"): no rotation, the whole row is one gain block (or blocks of
//!   N channels, `cq-g<N>`), and each group of `dim` channels has its own
//!   codebook (`channels / dim` of them), fitted on that group's
//!   calibration values, so a codebook learns how its channels vary
//!   together. CQ's own codebooks are fitted
//!   on raw activations with Fisher-weighted centroids; here they are
//!   fitted on RMS-normalised rows by plain k-means, as `vq`'s are.
//!
//! A token's gain block is rotated (vq), divided by its RMS, and each
//! group is replaced by the index of its nearest centroid; the block's
//! gain (the least-squares scale of the chosen centroids) is stored per
//! token.
//!
//! [`VqCodebook::fit`] fits the codebooks on calibration rows: k-means++
//! seeding and Lloyd iterations, deterministic for a seed (the workspace's
//! seeded stream, [`FaultRng`]). Centroids are stored as f16, and
//! [`VqCodebook::stored_bytes`] counts them, so compression ratios include
//! the codebook.

use gf2_codes::channel::FaultRng;
use half::f16;

use crate::error::{KvQuantError, Result};
use crate::rotation::Hadamard;
use crate::spec::{CacheForm, Quantizer, VqSpec};

/// How [`VqCodebook::fit`] runs k-means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FitOptions {
    /// Seed of the k-means++ draws and of the sample.
    pub seed: u64,
    /// Lloyd iterations after seeding.
    pub iterations: usize,
    /// At most this many groups per codebook are used (a seeded sample when
    /// the data holds more).
    pub max_samples: usize,
}

impl Default for FitOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            iterations: 25,
            max_samples: 1 << 16,
        }
    }
}

/// The codebooks of one `vq` or `cq` store shape.
#[derive(Clone, Debug)]
pub struct VqCodebook {
    spec: VqSpec,
    /// Channels of a gain block (the rotation block; `cq`: the row).
    block: usize,
    /// Codebooks: one per gain block (`vq`), one per group (`cq`).
    books: usize,
    /// Stored centroids (f16 bits): `books × K × dim`.
    bits: Vec<u16>,
    /// The same as f32, `books × K × dim` (for decoding).
    values: Vec<f32>,
    /// The same transposed per codebook, `books × dim × K` (for searching).
    columns: Vec<f32>,
}

impl PartialEq for VqCodebook {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec && self.block == other.block && self.bits == other.bits
    }
}

impl Eq for VqCodebook {}

/// `form`'s codebook parameters over `channels` channels: the spec, the
/// channels of a gain block and the number of codebooks.
fn vq_parts(form: &CacheForm, channels: usize) -> Result<(VqSpec, usize, usize)> {
    let Quantizer::Vq(spec) = *form.quantizer() else {
        return Err(KvQuantError::InvalidParameter {
            name: "form",
            reason: format!("{form} is not a vq or cq form"),
        });
    };
    if spec.coupled {
        let gain = spec.gain_block.unwrap_or(channels);
        if channels == 0 || !channels.is_multiple_of(gain) || !gain.is_multiple_of(spec.dim) {
            return Err(KvQuantError::InvalidParameter {
                name: "channels",
                reason: format!(
                    "{channels} channels are not whole gain blocks of {gain} in groups of {} \
                     ({form})",
                    spec.dim
                ),
            });
        }
        return Ok((spec, gain, channels / spec.dim));
    }
    let block = form.rotation().map_or(0, |r| r.block);
    if block == 0 || !channels.is_multiple_of(block) {
        return Err(KvQuantError::InvalidParameter {
            name: "channels",
            reason: format!(
                "{channels} channels are not whole rotation blocks of {block} ({form})"
            ),
        });
    }
    Ok((spec, block, channels / block))
}

impl VqCodebook {
    /// Codebooks from centroid values (`codebooks × K × dim`, rounded to
    /// f16 as stored; [`codebooks`](Self::codebooks) says how many).
    pub fn new(form: &CacheForm, channels: usize, centroids: &[f32]) -> Result<Self> {
        let (spec, block, blocks) = vq_parts(form, channels)?;
        let expected = blocks * spec.centroids * spec.dim;
        if centroids.len() != expected {
            return Err(KvQuantError::ShapeMismatch {
                what: "codebook centroids (codebooks × centroids × dim)",
                expected,
                found: centroids.len(),
            });
        }
        if let Some(i) = centroids.iter().position(|c| !c.is_finite()) {
            return Err(KvQuantError::Calibration {
                form: form.to_string(),
                what: "a finite codebook",
                reason: format!("centroid coordinate {i} is {}", centroids[i]),
            });
        }
        let bits: Vec<u16> = centroids
            .iter()
            .map(|&c| f16::from_f32(c).to_bits())
            .collect();
        Ok(Self::from_bits(spec, block, blocks, bits))
    }

    fn from_bits(spec: VqSpec, block: usize, blocks: usize, bits: Vec<u16>) -> Self {
        let values: Vec<f32> = bits.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
        let (k, d) = (spec.centroids, spec.dim);
        let mut columns = vec![0.0; values.len()];
        for b in 0..blocks {
            for c in 0..k {
                for j in 0..d {
                    columns[b * k * d + j * k + c] = values[b * k * d + c * d + j];
                }
            }
        }
        Self {
            spec,
            block,
            books: blocks,
            bits,
            values,
            columns,
        }
    }

    /// Fits the codebooks of `form` on `data` (`tokens × channels`, row-major,
    /// unrotated): each codebook's normalised groups (`vq`: every group of
    /// its rotated block; `cq`: its own group of every row), at most
    /// `options.max_samples` of them, clustered by k-means.
    pub fn fit(
        form: &CacheForm,
        data: &[f32],
        tokens: usize,
        channels: usize,
        options: FitOptions,
    ) -> Result<Self> {
        let (spec, block, blocks) = vq_parts(form, channels)?;
        crate::error::check_len("calibration rows", tokens * channels, data.len())?;
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(KvQuantError::NonFinite {
                token: i / channels,
                channel: i % channels,
                value: data[i],
            });
        }
        let (k, d) = (spec.centroids, spec.dim);
        let groups_per_token = if spec.coupled { 1 } else { block / d };
        let hadamard = if spec.coupled {
            None
        } else {
            Some(Hadamard::of(block)?)
        };
        // cq: every gain block's RMS, once (each codebook reads its own
        // group of its block).
        let gain_rms: Vec<f32> = if spec.coupled {
            data.chunks_exact(block).map(rms).collect()
        } else {
            Vec::new()
        };
        let gains_per_row = channels / block;
        let mut bits = Vec::with_capacity(blocks * k * d);
        for b in 0..blocks {
            // Every token's normalised block, split into groups (cq: group
            // `b` alone, divided by its gain block's RMS).
            let per_token = if spec.coupled { d } else { block };
            let mut samples: Vec<f32> = Vec::with_capacity(tokens * per_token);
            let mut y = vec![0.0f32; block];
            for (t, row) in data.chunks_exact(channels).enumerate() {
                match hadamard {
                    Some(h) => {
                        y.copy_from_slice(&row[b * block..][..block]);
                        h.rotate(&mut y);
                        let rms = rms(&y);
                        if rms > 0.0 {
                            samples.extend(y.iter().map(|v| v / rms));
                        }
                    }
                    None => {
                        let rms = gain_rms[t * gains_per_row + b * d / block];
                        if rms > 0.0 {
                            samples.extend(row[b * d..][..d].iter().map(|v| v / rms));
                        }
                    }
                }
            }
            let count = samples.len() / d;
            if count < k {
                return Err(KvQuantError::Calibration {
                    form: form.to_string(),
                    what: "enough calibration rows",
                    reason: format!(
                        "{count} non-zero groups of {d} for {k} centroids in codebook {b} \
                         ({} tokens give {groups_per_token} groups each)",
                        tokens
                    ),
                });
            }
            let mut rng = FaultRng::with_stream(options.seed, b as u64);
            let samples = subsample(samples, d, options.max_samples, &mut rng);
            let centroids = kmeans(&samples, d, k, options.iterations, &mut rng);
            bits.extend(centroids.iter().map(|&c| f16::from_f32(c).to_bits()));
        }
        Ok(Self::from_bits(spec, block, blocks, bits))
    }

    /// The form's codebook parameters.
    pub fn spec(&self) -> VqSpec {
        self.spec
    }

    /// Channels per gain block (`vq`: the rotation block; `cq`: the row).
    pub fn block(&self) -> usize {
        self.block
    }

    /// Codebooks: one per gain block (`vq`), one per group of `dim`
    /// channels (`cq`).
    pub fn codebooks(&self) -> usize {
        self.books
    }

    /// The codebook of group `group` (counted within its block) of gain
    /// block `block`: the block's own (`vq`) or the group's (`cq`).
    #[inline]
    pub fn codebook_of(&self, block: usize, group: usize) -> usize {
        if self.spec.coupled {
            block * (self.block / self.spec.dim) + group
        } else {
            block
        }
    }

    /// Checks that the codebooks serve `form` over `channels` channels.
    pub fn check_fits(&self, form: &CacheForm, channels: usize) -> Result<()> {
        let (spec, block, blocks) = vq_parts(form, channels)?;
        if (
            spec.dim,
            spec.centroids,
            spec.coupled,
            spec.pre_rope,
            block,
            blocks,
        ) != (
            self.spec.dim,
            self.spec.centroids,
            self.spec.coupled,
            self.spec.pre_rope,
            self.block,
            self.books,
        ) {
            return Err(KvQuantError::Calibration {
                form: form.to_string(),
                what: "a codebook of its shape",
                reason: format!(
                    "the codebook is {}: {} codebooks over blocks of {} channels, {} centroids \
                     of {} channels; the store needs {}: {blocks} over blocks of {block}, {} of {}",
                    kind(self.spec),
                    self.books,
                    self.block,
                    self.spec.centroids,
                    self.spec.dim,
                    kind(spec),
                    spec.centroids,
                    spec.dim
                ),
            });
        }
        Ok(())
    }

    /// The stored centroids as f32 (`codebooks × K × dim`).
    pub fn centroids(&self) -> &[f32] {
        &self.values
    }

    /// Centroid `index` of codebook `book` (`dim` values; see
    /// [`codebook_of`](Self::codebook_of)).
    #[inline]
    pub fn centroid(&self, book: usize, index: u8) -> &[f32] {
        let (k, d) = (self.spec.centroids, self.spec.dim);
        &self.values[(book * k + usize::from(index)) * d..][..d]
    }

    /// Bytes of the stored centroids (f16 each).
    pub fn stored_bytes(&self) -> usize {
        2 * self.bits.len()
    }

    /// Index of the centroid of codebook `book` nearest `x` (`dim` values).
    #[inline]
    pub fn nearest(&self, book: usize, x: &[f32]) -> u8 {
        let (k, d) = (self.spec.centroids, self.spec.dim);
        nearest_in(&self.columns[book * k * d..][..k * d], k, x) as u8
    }
}

/// The form kind a codebook serves, for messages.
fn kind(spec: VqSpec) -> &'static str {
    match (spec.coupled, spec.pre_rope) {
        (true, true) => "cq-pre (one per rotated pair, fitted on keys before RoPE)",
        (true, false) => "cq (one per group)",
        (false, _) => "vq (one per rotated block)",
    }
}

fn rms(y: &[f32]) -> f32 {
    (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt()
}

/// Index of the column-major (`dim × k`) centroid nearest `x`; ties go to
/// the lower index.
#[inline]
pub(crate) fn nearest_in(columns: &[f32], k: usize, x: &[f32]) -> usize {
    const LANES: usize = 16;
    let mut best = (f32::INFINITY, 0usize);
    let mut dist = [0.0f32; LANES];
    for start in (0..k).step_by(LANES) {
        let n = LANES.min(k - start);
        dist[..n].fill(0.0);
        for (j, &xj) in x.iter().enumerate() {
            let col = &columns[j * k + start..][..n];
            for (d, &c) in dist[..n].iter_mut().zip(col) {
                let e = xj - c;
                *d += e * e;
            }
        }
        for (i, &d) in dist[..n].iter().enumerate() {
            if d < best.0 {
                best = (d, start + i);
            }
        }
    }
    best.1
}

/// A seeded sample of at most `max` groups (partial Fisher–Yates).
pub(crate) fn subsample(
    mut samples: Vec<f32>,
    d: usize,
    max: usize,
    rng: &mut FaultRng,
) -> Vec<f32> {
    let n = samples.len() / d;
    if n <= max {
        return samples;
    }
    for i in 0..max {
        let j = i + rng.below((n - i) as u64) as usize;
        for c in 0..d {
            samples.swap(i * d + c, j * d + c);
        }
    }
    samples.truncate(max * d);
    samples
}

/// k-means++ seeding then Lloyd iterations; returns `k × d` centroids.
pub(crate) fn kmeans(
    samples: &[f32],
    d: usize,
    k: usize,
    iterations: usize,
    rng: &mut FaultRng,
) -> Vec<f32> {
    let n = samples.len() / d;
    let point = |i: usize| &samples[i * d..][..d];
    let dist2 = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>();
    // k-means++: each next centroid drawn with probability ∝ D(x)².
    let mut centroids: Vec<f32> = Vec::with_capacity(k * d);
    centroids.extend_from_slice(point(rng.below(n as u64) as usize));
    let mut nearest: Vec<f32> = (0..n).map(|i| dist2(point(i), &centroids[..d])).collect();
    for _ in 1..k {
        let total: f64 = nearest.iter().map(|&v| f64::from(v)).sum();
        let pick = if total > 0.0 {
            let target = rng.next_f64() * total;
            let mut acc = 0.0;
            nearest
                .iter()
                .position(|&v| {
                    acc += f64::from(v);
                    acc > target
                })
                .unwrap_or(n - 1)
        } else {
            rng.below(n as u64) as usize
        };
        let c = point(pick).to_vec();
        for (i, v) in nearest.iter_mut().enumerate() {
            *v = v.min(dist2(point(i), &c));
        }
        centroids.extend_from_slice(&c);
    }
    // Lloyd iterations, assignments by the column-major search.
    let mut columns = vec![0.0f32; k * d];
    let mut assignment = vec![0usize; n];
    for _ in 0..iterations {
        for c in 0..k {
            for j in 0..d {
                columns[j * k + c] = centroids[c * d + j];
            }
        }
        for (i, a) in assignment.iter_mut().enumerate() {
            *a = nearest_in(&columns, k, point(i));
        }
        let mut sums = vec![0.0f64; k * d];
        let mut counts = vec![0usize; k];
        for (i, &a) in assignment.iter().enumerate() {
            counts[a] += 1;
            for (s, &x) in sums[a * d..][..d].iter_mut().zip(point(i)) {
                *s += f64::from(x);
            }
        }
        for c in 0..k {
            if counts[c] > 0 {
                for j in 0..d {
                    centroids[c * d + j] = (sums[c * d + j] / counts[c] as f64) as f32;
                }
            } else {
                // An empty cluster restarts at the point farthest from its centroid.
                let far = (0..n)
                    .max_by(|&a, &b| {
                        let da = dist2(point(a), &centroids[assignment[a] * d..][..d]);
                        let db = dist2(point(b), &centroids[assignment[b] * d..][..d]);
                        da.total_cmp(&db)
                    })
                    .unwrap_or(0);
                centroids[c * d..][..d].copy_from_slice(point(far));
                assignment[far] = c;
            }
        }
    }
    centroids
}

impl crate::table::TableBytes for VqCodebook {
    /// The stored centroids, f16 little-endian, centroid by centroid.
    fn table_bytes(&self) -> Vec<u8> {
        self.bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    fn with_table_bytes(&self, bytes: &[u8]) -> Result<Self> {
        crate::error::check_len("codebook bytes", 2 * self.bits.len(), bytes.len())?;
        let bits = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Ok(Self::from_bits(self.spec, self.block, self.books, bits))
    }

    fn f16_words(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {

    /// The nearest centroid as a plain loop finds it (first strict minimum).
    fn nearest_plain(columns: &[f32], k: usize, x: &[f32]) -> usize {
        let mut best = (f32::INFINITY, 0);
        for c in 0..k {
            let d = x.iter().enumerate().fold(0.0f32, |acc, (j, &xj)| {
                let e = xj - columns[j * k + c];
                acc + e * e
            });
            if d < best.0 {
                best = (d, c);
            }
        }
        best.1
    }

    proptest::proptest! {
        #[test]
        fn nearest_in_is_the_plain_loops_argmin(
            k in 1usize..70,
            d in 1usize..9,
            seed in 0u64..1_000,
            ties in proptest::bool::ANY,
        ) {
            let mut rng = FaultRng::with_stream(seed, 0);
            // Values on a coarse grid when `ties`, so equal distances occur.
            let mut value = || {
                let u = rng.next_f64() as f32 * 4.0 - 2.0;
                if ties { u.round() } else { u }
            };
            let columns: Vec<f32> = (0..k * d).map(|_| value()).collect();
            for _ in 0..8 {
                let x: Vec<f32> = (0..d).map(|_| value()).collect();
                proptest::prop_assert_eq!(
                    nearest_in(&columns, k, &x),
                    nearest_plain(&columns, k, &x)
                );
            }
        }
    }
    use super::*;

    fn form(s: &str) -> CacheForm {
        s.parse().unwrap()
    }

    fn rows(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
        let mut rng = FaultRng::new(seed);
        (0..tokens * channels)
            .map(|i| (rng.next_f64() as f32 - 0.5) * (1.0 + (i % channels) as f32 * 0.05))
            .collect()
    }

    #[test]
    fn fitting_is_deterministic_and_beats_a_random_codebook() {
        let f = form("vq-k16");
        let (tokens, channels) = (300, 128);
        let data = rows(tokens, channels, 1);
        let opts = FitOptions {
            iterations: 10,
            ..FitOptions::default()
        };
        let a = VqCodebook::fit(&f, &data, tokens, channels, opts).unwrap();
        let b = VqCodebook::fit(&f, &data, tokens, channels, opts).unwrap();
        assert_eq!(a, b);
        assert_eq!((a.codebooks(), a.block()), (2, 64));
        assert_eq!(a.stored_bytes(), 2 * 2 * 16 * 4);
        let other =
            VqCodebook::fit(&f, &data, tokens, channels, FitOptions { seed: 9, ..opts }).unwrap();
        assert_ne!(a, other);
        // Fitted centroids quantize the training groups better than the
        // first centroids of the seeding (k-means only lowers the distortion).
        let seeded = VqCodebook::fit(
            &f,
            &data,
            tokens,
            channels,
            FitOptions {
                iterations: 0,
                ..opts
            },
        )
        .unwrap();
        let distortion = |cb: &VqCodebook| {
            let h = Hadamard::of(64).unwrap();
            let mut total = 0.0f64;
            for row in data.chunks_exact(channels) {
                for blk in 0..2 {
                    let mut y = row[blk * 64..][..64].to_vec();
                    h.rotate(&mut y);
                    let r = rms(&y);
                    for g in y.chunks_exact(4) {
                        let u: Vec<f32> = g.iter().map(|v| v / r).collect();
                        let c = cb.centroid(blk, cb.nearest(blk, &u));
                        total += u
                            .iter()
                            .zip(c)
                            .map(|(a, b)| f64::from((a - b) * (a - b)))
                            .sum::<f64>();
                    }
                }
            }
            total
        };
        assert!(
            distortion(&a) < distortion(&seeded),
            "{} {}",
            distortion(&a),
            distortion(&seeded)
        );
    }

    #[test]
    fn nearest_is_the_argmin() {
        let f = form("vq-d2-k8");
        let centroids: Vec<f32> = (0..16).map(|i| (i as f32 * 0.73).sin()).collect();
        let cb = VqCodebook::new(&f, 64, &centroids).unwrap();
        for i in 0..200 {
            let x = [(i as f32 * 0.1).cos(), (i as f32 * 0.37).sin()];
            let q = usize::from(cb.nearest(0, &x));
            let d = |c: &[f32]| (c[0] - x[0]).powi(2) + (c[1] - x[1]).powi(2);
            let best = (0..8)
                .map(|c| d(cb.centroid(0, c as u8)))
                .fold(f32::INFINITY, f32::min);
            assert_eq!(d(cb.centroid(0, q as u8)), best);
        }
    }

    #[test]
    fn bad_calibration_is_a_typed_error() {
        let f = form("vq");
        // Too few groups for 256 centroids.
        let data = rows(2, 64, 0);
        assert!(matches!(
            VqCodebook::fit(&f, &data, 2, 64, FitOptions::default()),
            Err(KvQuantError::Calibration { .. })
        ));
        // Channels that are not whole blocks, a non-vq form, wrong lengths, NaN.
        assert!(VqCodebook::fit(&f, &rows(300, 96, 0), 300, 96, FitOptions::default()).is_err());
        assert!(VqCodebook::fit(&form("int4"), &data, 2, 64, FitOptions::default()).is_err());
        assert!(matches!(
            VqCodebook::new(&f, 64, &[0.0; 5]),
            Err(KvQuantError::ShapeMismatch { .. })
        ));
        let mut nan = rows(300, 64, 0);
        nan[7] = f32::NAN;
        assert!(matches!(
            VqCodebook::fit(&f, &nan, 300, 64, FitOptions::default()),
            Err(KvQuantError::NonFinite {
                token: 0,
                channel: 7,
                ..
            })
        ));
        // A codebook of one shape refuses another.
        let cb = VqCodebook::fit(
            &form("vq-k16"),
            &rows(300, 64, 0),
            300,
            64,
            FitOptions::default(),
        )
        .unwrap();
        assert!(cb.check_fits(&form("vq-k16"), 64).is_ok());
        assert!(matches!(
            cb.check_fits(&form("vq-k16"), 128),
            Err(KvQuantError::Calibration { .. })
        ));
        assert!(cb.check_fits(&form("vq-k32"), 64).is_err());
    }
}
