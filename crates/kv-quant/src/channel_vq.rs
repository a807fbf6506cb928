//! Shard's value path (`shard-kv-compression-blog.md`, section 6, option
//! 3): each head's channels rotated by the randomized Hadamard transform,
//! divided by the per-channel maximum over the stored tokens, and cut into
//! groups of 4 channels, each replaced by the index of its nearest centroid
//! in one 256-entry codebook per layer fitted by k-means on the data
//! itself: 2 bits per value, plus the codebook and one f16 maximum per
//! channel amortised over the tokens.
//!
//! A value row is `v = H⁻¹(ṽ)` with `ṽ[c] = centroid[idx][c mod 4]·max[c]`:
//! attention sums the rotated rows `ṽ` with the softmax weights and
//! rotates the sum back once (section 10), reading [`ChannelVq::indices`],
//! [`ChannelVq::centroids`] and [`ChannelVq::max`];
//! [`ChannelVq::rotated_rows_into`] gives the rotated rows themselves.
//!
//! Layout: `tokens × channels/4` indices, one byte each, token after token.

use std::sync::Arc;

use gf2_codes::channel::FaultRng;
use half::f16;

use crate::error::{KvQuantError, Result, check_len};
use crate::rotation::Hadamard;
use crate::vq::{FitOptions, kmeans, nearest_in, subsample};

/// Channels per code.
pub const GROUP: usize = 4;

/// Centroids in the codebook (one byte per index).
pub const CENTROIDS: usize = 256;

/// One layer's values as Shard stores them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelVq {
    channels: usize,
    tokens: usize,
    hadamard: &'static Hadamard,
    /// Per rotated channel, f16-rounded.
    max: Vec<f32>,
    /// `CENTROIDS × GROUP`, f16-rounded; shared by folded chunks.
    centroids: Arc<Vec<f32>>,
    /// The codebook by coordinate (`GROUP × CENTROIDS`), for the search.
    columns: Arc<Vec<f32>>,
    /// `tokens × channels/GROUP`.
    indices: Vec<u8>,
}

impl ChannelVq {
    /// Rotates `rows` (`tokens × channels`) per head of `head_dim` channels
    /// (a power of two), scales each channel by its maximum, fits the
    /// codebook on the groups (a seeded sample of at most
    /// `options.max_samples`) and stores each group's nearest centroid.
    pub fn fit(
        rows: &[f32],
        tokens: usize,
        channels: usize,
        head_dim: usize,
        options: FitOptions,
    ) -> Result<Self> {
        check_rows(rows, tokens, channels)?;
        let hadamard = head_rotation(channels, head_dim)?;
        let (rotated, max) = rotate_and_scale(hadamard, rows, channels);
        let groups = tokens * channels / GROUP;
        if groups < CENTROIDS {
            return Err(KvQuantError::Calibration {
                form: "shard values".into(),
                what: "enough groups to fit a codebook",
                reason: format!("{groups} groups of {GROUP} for {CENTROIDS} centroids"),
            });
        }
        let mut rng = FaultRng::with_stream(options.seed, 0);
        let samples = subsample(rotated.clone(), GROUP, options.max_samples, &mut rng);
        let centroids: Vec<f32> = kmeans(&samples, GROUP, CENTROIDS, options.iterations, &mut rng)
            .iter()
            .map(|&c| f16::from_f32(c).to_f32())
            .collect();
        let columns = columns_of(&centroids);
        let indices = assign(&columns, &rotated);
        Ok(Self {
            channels,
            tokens,
            hadamard,
            max,
            centroids: Arc::new(centroids),
            columns: Arc::new(columns),
            indices,
        })
    }

    /// The tables alone: the codebook, no tokens and no channel maxima (those
    /// are the fitted rows'). What a calibration keeps and writes for
    /// chunks coded with [`encode_chunk`](Self::encode_chunk);
    /// [`from_codebook`](Self::from_codebook) rebuilds it.
    pub fn tables(&self) -> Self {
        Self {
            tokens: 0,
            max: Vec::new(),
            indices: Vec::new(),
            centroids: Arc::clone(&self.centroids),
            columns: Arc::clone(&self.columns),
            ..*self
        }
    }

    /// [`tables`](Self::tables) rebuilt from a codebook (`CENTROIDS × GROUP`
    /// values, each an f16 as stored) for `channels` channels in heads of
    /// `head_dim`, or why it cannot be one.
    pub fn from_codebook(channels: usize, head_dim: usize, centroids: &[f32]) -> Result<Self> {
        let hadamard = head_rotation(channels, head_dim)?;
        check_len(
            "codebook (centroids × group)",
            CENTROIDS * GROUP,
            centroids.len(),
        )?;
        if let Some(i) = centroids
            .iter()
            .position(|&c| !c.is_finite() || f16::from_f32(c).to_f32().to_bits() != c.to_bits())
        {
            return Err(KvQuantError::InvalidParameter {
                name: "codebook",
                reason: format!("value {i} ({}) is not a finite f16", centroids[i]),
            });
        }
        Ok(Self {
            channels,
            tokens: 0,
            hadamard,
            max: Vec::new(),
            centroids: Arc::new(centroids.to_vec()),
            columns: Arc::new(columns_of(centroids)),
            indices: Vec::new(),
        })
    }

    /// Reads through the codebook of `tables` (a fitted table as faults left
    /// it, [`TableBytes`](crate::TableBytes)), shared rather than copied.
    pub fn share_codebook(&mut self, tables: &ChannelVq) {
        self.centroids = Arc::clone(&tables.centroids);
        self.columns = Arc::clone(&tables.columns);
    }

    /// Stores `rows` (`tokens × channels`) on this codebook, scaled by their
    /// own per-channel maxima: a chunk of tokens folded into the compressed
    /// middle after the fit. The codebook is shared, not copied
    /// ([`ChannelVq::shared_bytes`]).
    pub fn encode_chunk(&self, rows: &[f32], tokens: usize) -> Result<Self> {
        let channels = self.channels;
        check_rows(rows, tokens, channels)?;
        let (rotated, max) = rotate_and_scale(self.hadamard, rows, channels);
        Ok(Self {
            channels,
            tokens,
            hadamard: self.hadamard,
            max,
            centroids: Arc::clone(&self.centroids),
            columns: Arc::clone(&self.columns),
            indices: assign(&self.columns, &rotated),
        })
    }

    /// Tokens stored.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Channels per token.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The rotation of each head.
    pub fn hadamard(&self) -> &'static Hadamard {
        self.hadamard
    }

    /// Per rotated channel, its maximum magnitude (the scale of its coordinate).
    pub fn max(&self) -> &[f32] {
        &self.max
    }

    /// The channel maxima, writable (f16 values held in f32: a fault
    /// experiment flips their f16 bits).
    pub fn max_mut(&mut self) -> &mut [f32] {
        &mut self.max
    }

    /// The codebook, `CENTROIDS × GROUP`.
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    /// The indices, `tokens × channels/GROUP`.
    pub fn indices(&self) -> &[u8] {
        &self.indices
    }

    /// The indices, writable (fault injection, decoding through an
    /// error-correcting code).
    pub fn indices_mut(&mut self) -> &mut [u8] {
        &mut self.indices
    }

    /// The indices and the channel maxima, writable together (a block's
    /// stored bits decoded through its codes into both).
    pub fn indices_and_max_mut(&mut self) -> (&mut [u8], &mut [f32]) {
        (&mut self.indices, &mut self.max)
    }

    /// Bytes held: indices, the f16 codebook and the f16 channel maxima.
    pub fn stored_bytes(&self) -> usize {
        self.indices.len() + 2 * self.max.len() + self.shared_bytes()
    }

    /// Bytes of the f16 codebook, which chunks encoded by
    /// [`encode_chunk`](Self::encode_chunk) share with this store.
    pub fn shared_bytes(&self) -> usize {
        2 * self.centroids.len()
    }

    /// Rows `start..start + count` in the rotated space (`ṽ`, `count × channels`).
    pub fn rotated_rows_into(&self, start: usize, count: usize, out: &mut [f32]) -> Result<()> {
        check_len(
            "rotated rows (count × channels)",
            count * self.channels,
            out.len(),
        )?;
        self.check_range(start, count)?;
        let per = self.channels / GROUP;
        for (idx, row) in self.indices[start * per..(start + count) * per]
            .chunks_exact(per)
            .zip(out.chunks_exact_mut(self.channels))
        {
            for ((&i, g), m) in idx
                .iter()
                .zip(row.chunks_exact_mut(GROUP))
                .zip(self.max.chunks_exact(GROUP))
            {
                let c = &self.centroids[usize::from(i) * GROUP..][..GROUP];
                for ((o, &c), &m) in g.iter_mut().zip(c).zip(m) {
                    *o = c * m;
                }
            }
        }
        Ok(())
    }

    /// Rows `start..start + count` as values (`count × channels`).
    pub fn decode_rows_into(&self, start: usize, count: usize, out: &mut [f32]) -> Result<()> {
        self.rotated_rows_into(start, count, out)?;
        for row in out.chunks_exact_mut(self.channels) {
            self.hadamard.unrotate(row);
        }
        Ok(())
    }

    fn check_range(&self, start: usize, count: usize) -> Result<()> {
        if start + count > self.tokens {
            return Err(KvQuantError::InvalidParameter {
                name: "token range",
                reason: format!("{start}..{} of {} tokens", start + count, self.tokens),
            });
        }
        Ok(())
    }
}

/// `rows` holds `tokens × channels` finite values.
fn check_rows(rows: &[f32], tokens: usize, channels: usize) -> Result<()> {
    check_len(
        "value rows (tokens × channels)",
        tokens * channels,
        rows.len(),
    )?;
    crate::error::check_finite(rows, channels)
}

/// The codebook's f16 centroids, little-endian: the table every chunk coded
/// on it reads.
impl crate::table::TableBytes for ChannelVq {
    fn table_bytes(&self) -> Vec<u8> {
        self.centroids
            .iter()
            .flat_map(|&c| f16::from_f32(c).to_le_bytes())
            .collect()
    }

    fn with_table_bytes(&self, bytes: &[u8]) -> Result<Self> {
        check_len("codebook bytes", 2 * self.centroids.len(), bytes.len())?;
        let centroids: Vec<f32> = bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        Ok(Self {
            columns: Arc::new(columns_of(&centroids)),
            centroids: Arc::new(centroids),
            ..self.clone()
        })
    }

    fn f16_words(&self) -> bool {
        true
    }
}

/// The rotation of each head of `head_dim` of `channels` channels, or why
/// they are not whole heads of a multiple of [`GROUP`].
fn head_rotation(channels: usize, head_dim: usize) -> Result<&'static Hadamard> {
    if head_dim == 0 || !channels.is_multiple_of(head_dim) || !head_dim.is_multiple_of(GROUP) {
        return Err(KvQuantError::InvalidParameter {
            name: "head_dim",
            reason: format!(
                "{channels} channels are not whole heads of {head_dim} (a multiple of {GROUP})"
            ),
        });
    }
    Hadamard::of(head_dim)
}

/// `rows` rotated per head and divided by each channel's maximum magnitude
/// over them, with the maxima (f16-rounded).
fn rotate_and_scale(hadamard: &Hadamard, rows: &[f32], channels: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rotated = rows.to_vec();
    for row in rotated.chunks_exact_mut(channels) {
        hadamard.rotate(row);
    }
    let mut max = vec![0.0f32; channels];
    for row in rotated.chunks_exact(channels) {
        for (m, v) in max.iter_mut().zip(row) {
            *m = m.max(v.abs());
        }
    }
    for m in &mut max {
        *m = f16::from_f32(*m).to_f32();
    }
    let inverse: Vec<f32> = max
        .iter()
        .map(|&m| if m > 0.0 { 1.0 / m } else { 0.0 })
        .collect();
    for row in rotated.chunks_exact_mut(channels) {
        for (v, i) in row.iter_mut().zip(&inverse) {
            *v *= i;
        }
    }
    (rotated, max)
}

/// The codebook by coordinate, `GROUP × CENTROIDS`.
fn columns_of(centroids: &[f32]) -> Vec<f32> {
    let mut columns = vec![0.0f32; CENTROIDS * GROUP];
    for (c, centroid) in centroids.chunks_exact(GROUP).enumerate() {
        for (j, &v) in centroid.iter().enumerate() {
            columns[j * CENTROIDS + c] = v;
        }
    }
    columns
}

/// Each group of `GROUP` scaled rotated values' nearest centroid.
fn assign(columns: &[f32], rotated: &[f32]) -> Vec<u8> {
    rotated
        .chunks_exact(GROUP)
        .map(|g| nearest_in(columns, CENTROIDS, g) as u8)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(tokens: usize, channels: usize) -> Vec<f32> {
        let mut rng = FaultRng::with_stream(7, 1);
        (0..tokens * channels)
            .map(|i| (rng.next_f64() as f32 - 0.5) * (1.0 + (i % channels) as f32 * 0.1))
            .collect()
    }

    #[test]
    fn a_codebook_alone_rebuilds_the_tables_and_codes_chunks_alike() {
        let (tokens, ch) = (512, 32);
        let x = rows(tokens, ch);
        let fitted = ChannelVq::fit(&x, tokens, ch, 16, FitOptions::default()).unwrap();
        let tables = fitted.tables();
        assert_eq!((tables.tokens(), tables.indices().len()), (0, 0));
        assert_eq!(tables.shared_bytes(), fitted.shared_bytes());
        let rebuilt = ChannelVq::from_codebook(ch, 16, fitted.centroids()).unwrap();
        assert_eq!(rebuilt, tables);
        let chunk = &x[64 * ch..128 * ch];
        assert_eq!(
            rebuilt.encode_chunk(chunk, 64).unwrap(),
            fitted.encode_chunk(chunk, 64).unwrap()
        );
        let mut bad = fitted.centroids().to_vec();
        bad[5] = 0.1; // not an f16
        for (c, h, cb) in [
            (ch, 16, &bad[..]),
            (ch, 16, &fitted.centroids()[1..]),
            (ch, 12, fitted.centroids()),
            (30, 16, fitted.centroids()),
        ] {
            assert!(
                ChannelVq::from_codebook(c, h, cb).is_err(),
                "{c} {h} {}",
                cb.len()
            );
        }
        bad[5] = f32::NAN;
        assert!(ChannelVq::from_codebook(ch, 16, &bad).is_err());
    }

    #[test]
    fn values_round_trip_near_the_data_and_count_their_bytes() {
        let (tokens, channels, head_dim) = (512, 32, 16);
        let x = rows(tokens, channels);
        let vq = ChannelVq::fit(&x, tokens, channels, head_dim, FitOptions::default()).unwrap();
        let mut back = vec![0.0; x.len()];
        vq.decode_rows_into(0, tokens, &mut back).unwrap();
        let err: f32 = x.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum();
        let energy: f32 = x.iter().map(|a| a * a).sum();
        // 2 bits per value of near-uniform data: well under a tenth of the energy.
        assert!(err / energy < 0.1, "{}", err / energy);
        assert_eq!(
            vq.stored_bytes(),
            tokens * channels / 4 + 2 * 1024 + 2 * channels
        );
        // Rotated rows are the values before the inverse rotation.
        let mut rot = vec![0.0; channels];
        vq.rotated_rows_into(5, 1, &mut rot).unwrap();
        vq.hadamard().unrotate(&mut rot);
        assert_eq!(rot, back[5 * channels..6 * channels]);
        // Same seed, same bytes.
        let again = ChannelVq::fit(&x, tokens, channels, head_dim, FitOptions::default()).unwrap();
        assert_eq!(again, vq);
    }

    #[test]
    fn folded_chunks_share_the_codebook_and_carry_their_own_maxima() {
        let (tokens, channels, head_dim) = (512, 32, 16);
        let x = rows(tokens + 64, channels);
        let (fit_rows, later) = x.split_at(tokens * channels);
        let vq =
            ChannelVq::fit(fit_rows, tokens, channels, head_dim, FitOptions::default()).unwrap();
        assert_eq!(vq.encode_chunk(fit_rows, tokens).unwrap(), vq);
        let chunk = vq.encode_chunk(later, 64).unwrap();
        assert!(std::ptr::eq(chunk.centroids(), vq.centroids()));
        assert_eq!(chunk.stored_bytes() - chunk.shared_bytes(), 64 * 8 + 2 * 32);
        // Each channel's maximum is the chunk's own.
        let mut rotated = later.to_vec();
        for row in rotated.chunks_exact_mut(channels) {
            vq.hadamard().rotate(row);
        }
        for (c, &m) in chunk.max().iter().enumerate() {
            let want = rotated
                .chunks_exact(channels)
                .map(|r| r[c].abs())
                .fold(0.0f32, f32::max);
            assert_eq!(m, f16::from_f32(want).to_f32());
        }
        let mut back = vec![0.0; later.len()];
        chunk.decode_rows_into(0, 64, &mut back).unwrap();
        let err: f32 = later
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b) * (a - b))
            .sum();
        let energy: f32 = later.iter().map(|a| a * a).sum();
        // A codebook fitted on other rows: a little above the fit's own error.
        assert!(err / energy < 0.15, "{}", err / energy);
        assert!(matches!(
            vq.encode_chunk(&later[..31], 1),
            Err(KvQuantError::ShapeMismatch { .. })
        ));
        let mut bad = later[..32].to_vec();
        bad[1] = f32::NAN;
        assert!(matches!(
            vq.encode_chunk(&bad, 1),
            Err(KvQuantError::NonFinite { channel: 1, .. })
        ));
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let x = rows(512, 32);
        let fit = |x: &[f32], t, c, h| ChannelVq::fit(x, t, c, h, FitOptions::default());
        assert!(matches!(
            fit(&x, 512, 32, 12),
            Err(KvQuantError::InvalidParameter { .. })
        ));
        assert!(matches!(
            fit(&x, 511, 32, 16),
            Err(KvQuantError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            fit(&x[..32 * 8], 8, 32, 16),
            Err(KvQuantError::Calibration { .. })
        ));
        let mut bad = x.clone();
        bad[40] = f32::INFINITY;
        assert!(matches!(
            fit(&bad, 512, 32, 16),
            Err(KvQuantError::NonFinite {
                token: 1,
                channel: 8,
                ..
            })
        ));
        let vq = fit(&x, 512, 32, 16).unwrap();
        assert!(vq.rotated_rows_into(510, 4, &mut [0.0; 128]).is_err());
    }
}
