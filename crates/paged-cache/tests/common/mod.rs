//! The one-layer model and the rows the staged and hierarchical form
//! tests write.

use attention::{HeadShape, ModelKvShape};

/// Two query heads over one KV head of 64 channels.
pub(crate) fn shape() -> HeadShape {
    HeadShape::new(2, 1, 64).unwrap()
}

/// One layer of [`shape`].
pub(crate) fn model() -> ModelKvShape<'static> {
    ModelKvShape {
        layers: 1,
        heads: shape(),
        rope: None,
    }
}

/// Row `t`'s K (`part` 0) or V (1) values: a function of the token alone,
/// so a reference can rebuild any prefix.
pub(crate) fn row(t: usize, part: usize, ch: usize) -> Vec<f32> {
    (0..ch)
        .map(|c| {
            let x = (t * 131 + c * 17 + part * 7919) as f32;
            // Per-channel offsets, as keys have: channel `c` centred on c/16.
            (x * 0.618).sin() * 1.3 + (c % 16) as f32 / 16.0
        })
        .collect()
}
