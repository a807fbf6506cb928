//! Shared inputs of the level-view tests.

/// Rows of the stores the level-view tests read.
pub(crate) const TOKENS: usize = 40;
/// Channels of those rows.
pub(crate) const CHANNELS: usize = 64;

/// `TOKENS × CHANNELS` values in `[−0.5, 0.5)`, different for each seed.
pub(crate) fn values(seed: u32) -> Vec<f32> {
    (0..TOKENS * CHANNELS)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .collect()
}
