//! The tables the state machine's fitted forms read, fitted once on rows
//! like the harness's and shared by every block.

use std::sync::Arc;

use attention::stored::{Fitted, ShardTables};
use attention::{Rope, RopeLayout};
use kv_lowrank::{Basis, BasisStorage, HeadBases, ShardKeys};
use kv_quant::{CacheForm, ChannelVq, FitOptions, Quantizer, RankRule, VqCodebook};

use super::{CH, HEAD_DIM, canonical};

/// The tables `form`'s keys and values read, fitted on rows like the
/// harness's and shared by every block (the calibrated tables of the paged
/// cache): a `vq` codebook, `pca-*` bases, Shard's key basis and value
/// codebook; none for the other forms.
pub(super) fn fitted(form: CacheForm) -> [Fitted; 2] {
    let n = 256;
    let rows = |part: usize| -> Vec<f32> {
        (0..n as u32)
            .flat_map(|t| canonical(&[t % 7, t / 7], 0, part, 0))
            .collect()
    };
    match form.quantizer() {
        Quantizer::LowRank(_) => [0, 1].map(|part| {
            let rows = rows(part);
            let heads = (0..CH / HEAD_DIM)
                .map(|h| {
                    let head: Vec<f32> = rows
                        .chunks_exact(CH)
                        .flat_map(|r| r[h * HEAD_DIM..][..HEAD_DIM].to_vec())
                        .collect();
                    let rule = RankRule::Fixed(2);
                    let (b, _) = Basis::fit(&head, n, HEAD_DIM, rule, BasisStorage::F16).unwrap();
                    Arc::new(b)
                })
                .collect();
            Fitted {
                bases: Some(Arc::new(HeadBases { heads })),
                rope: form.codes_before_rope().then(harness_rope),
                ..Fitted::default()
            }
        }),
        Quantizer::Shard(_) => {
            let rope = harness_rope();
            let mut keys = rows(0);
            for (t, row) in keys.chunks_exact_mut(CH).enumerate() {
                rope.undo(row, t % 16).unwrap();
            }
            let rule = RankRule::Fixed(4);
            let (basis, _) = Basis::fit(&keys, n, CH, rule, BasisStorage::Int8).unwrap();
            let keys = ShardKeys::with_basis(&keys, n, &basis, 3.0, 4).unwrap();
            let values = ChannelVq::fit(&rows(1), n, CH, HEAD_DIM, FitOptions::default()).unwrap();
            let tables = [
                ShardTables::Keys {
                    prototype: Arc::new(keys),
                    rope,
                },
                ShardTables::Values {
                    prototype: Some(Arc::new(values)),
                    head_dim: HEAD_DIM,
                },
            ];
            tables.map(|t| Fitted {
                shard: Some(t),
                ..Fitted::default()
            })
        }
        q if q.needs_codebook() => {
            let rows: Vec<f32> = (0..n as u32)
                .flat_map(|t| canonical(&[t % 7, t / 7], 0, (t % 2) as usize, 0))
                .collect();
            let cb = Arc::new(VqCodebook::fit(&form, &rows, n, CH, FitOptions::default()).unwrap());
            [0, 1].map(|_| Fitted {
                codebook: Some(cb.clone()),
                ..Fitted::default()
            })
        }
        _ => Default::default(),
    }
}

/// The RoPE of the harness's heads (Shard's keys, `-pre` forms).
pub(super) fn harness_rope() -> Rope {
    Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap()
}
