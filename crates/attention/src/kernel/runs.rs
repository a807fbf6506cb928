//! Runs of tile rows that share a block of tokens: the unit the
//! per-channel score and value passes apply one block's scales to.

use kv_quant::LevelRows;

/// The runs of rows of `levels` that share a block of tokens (per-channel
/// groups): `(first row, end, index of the block's first group)`.
pub(crate) fn block_runs<'a>(
    levels: &'a LevelRows<'_>,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let rows = levels.rows();
    let mut t0 = 0;
    std::iter::from_fn(move || {
        if t0 >= rows {
            return None;
        }
        let base = levels.group_index(t0, 0);
        let mut t1 = t0 + 1;
        while t1 < rows && levels.group_index(t1, 0) == base {
            t1 += 1;
        }
        let run = (t0, t1, base);
        t0 = t1;
        Some(run)
    })
}
