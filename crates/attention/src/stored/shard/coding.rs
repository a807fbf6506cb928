//! How a [`ShardPart`](super::ShardPart) codes and reads one sealed block:
//! a block's rows coded on a part's or a sequence's tables, rows rebuilt
//! from a sealed block, a restored block re-pointed at the tables as read,
//! the f16 scales' fault channel, and the forms a part refuses.

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use gf2_codes::channel::{FaultChannel, FaultRng, Flips};
use half::f16;
use kv_quant::{
    CacheForm, DecodeScratch, KvDecodeStats, KvQuantError, KvStore, Protection, Quantizer,
    ShardSpec, ShardValues,
};

use super::{BlockGuard, ShardBlock, ShardTables};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;

/// Makes `sealed` read through `tables` (the part's table as read now).
pub(super) fn repoint(sealed: &mut ShardBlock, tables: &ShardTables) -> Result<()> {
    match (sealed, tables) {
        (ShardBlock::Keys { keys, .. }, ShardTables::Keys { prototype, .. }) => {
            keys.share_basis(prototype)?;
        }
        (
            ShardBlock::Vq { values, .. },
            ShardTables::Values {
                prototype: Some(p), ..
            },
        ) => values.share_codebook(p),
        _ => {}
    }
    Ok(())
}

/// Whether `sealed` reads the very table of `tables` (the same allocation,
/// not an equal copy: blocks coded on another sequence's tables of equal
/// values are another sequence's).
pub(super) fn coded_on(sealed: &ShardBlock, tables: &ShardTables) -> bool {
    match (sealed, tables) {
        (ShardBlock::Keys { keys, .. }, ShardTables::Keys { prototype, .. }) => {
            std::ptr::eq(keys.basis(), prototype.basis())
        }
        (
            ShardBlock::Vq { values, .. },
            ShardTables::Values {
                prototype: Some(p), ..
            },
        ) => std::ptr::eq(values.centroids().as_ptr(), p.centroids().as_ptr()),
        _ => false,
    }
}

/// `rows` (one block of `channels`-value rows, as written) coded on
/// `tables`, its codes and scales stored under `protection`'s codes where
/// the form has them; `first` is the position of the first row.
pub(super) fn code(
    tables: &ShardTables,
    protection: Option<Protection>,
    (channels, rows): (usize, &[f32]),
    first: usize,
) -> Result<ShardBlock> {
    let mut block = code_bare(tables, channels, rows, first)?;
    if let Some(p) = protection {
        let (codes, scales, guard) = match &mut block {
            ShardBlock::Keys { keys, guard, .. } => (keys.codes(), keys.scales(), guard),
            ShardBlock::Vq { values, guard } => (values.indices(), values.max(), guard),
            ShardBlock::Nf4(_) => {
                return Err(AttentionError::InvalidParameter {
                    name: "tables",
                    reason: "NF4 values (tables without a codebook) are not coded on paged \
                             blocks; a coded Shard form's values need their codebook"
                        .into(),
                });
            }
        };
        *guard = Some(Box::new(BlockGuard::new(
            p.code, p.metadata, codes, scales,
        )?));
    }
    Ok(block)
}

/// [`code`] without codes.
fn code_bare(
    tables: &ShardTables,
    channels: usize,
    rows: &[f32],
    first: usize,
) -> Result<ShardBlock> {
    let bs = rows.len() / channels;
    Ok(match tables {
        ShardTables::Keys { prototype, rope } => {
            let mut unrotated = rows.to_vec();
            for (i, row) in unrotated.chunks_exact_mut(channels).enumerate() {
                rope.undo(row, first + i)?;
            }
            ShardBlock::Keys {
                keys: Box::new(prototype.encode_chunk(&unrotated, bs)?),
                first,
                guard: None,
            }
        }
        ShardTables::Values {
            prototype: Some(vq),
            ..
        } => ShardBlock::Vq {
            values: vq.encode_chunk(rows, bs)?,
            guard: None,
        },
        ShardTables::Values {
            prototype: None,
            head_dim,
        } => {
            let nf4 = crate::shard::nf4_form(*head_dim)?;
            ShardBlock::Nf4(Box::new(KvStore::quantize_with(
                nf4,
                rows,
                bs,
                channels,
                crate::stored::clamped(),
            )?))
        }
    })
}

/// Rows `offset..offset + out.len() / channels` of a sealed block (keys
/// rotated back to their positions by `rope`).
pub(super) fn decode_sealed(
    rope: Option<&Rope>,
    channels: usize,
    sealed: &ShardBlock,
    offset: usize,
    out: &mut [f32],
    (scratch, coeffs): (&mut DecodeScratch, &mut Vec<f32>),
) -> Result<KvDecodeStats> {
    match sealed {
        ShardBlock::Keys { keys, first, .. } => {
            let Some(rope) = rope else {
                unreachable!("a key part holds key blocks");
            };
            // The rows' coefficients at once, then `K = μ + C·B` as one
            // small GEMM (faer's kernels, as `ShardLayer` rebuilds a tile:
            // row by row the axpy loops ran 10x slower), then RoPE.
            let (n, kept) = (out.len() / channels, keys.kept());
            coeffs.resize(n * kept, 0.0);
            keys.coefficients_into(offset, n, &mut coeffs[..n * kept])?;
            let basis = keys.basis();
            for row in out.chunks_exact_mut(channels) {
                row.copy_from_slice(basis.mean());
            }
            if kept > 0 {
                matmul(
                    MatMut::from_row_major_slice_mut(out, n, channels),
                    Accum::Add,
                    MatRef::from_row_major_slice(&coeffs[..n * kept], n, kept),
                    MatRef::from_row_major_slice(basis.rows(), kept, channels),
                    1.0f32,
                    Par::Seq,
                );
            }
            rope.apply_rows(out, channels, first + offset)?;
        }
        ShardBlock::Vq { values, .. } => {
            values.decode_rows_into(offset, out.len() / channels, out)?;
        }
        ShardBlock::Nf4(store) => {
            scratch.limit_neighbours(None);
            return Ok(store.decode_rows_into(offset, out.len() / channels, out, scratch)?);
        }
    }
    Ok(sealed.read_stats(offset))
}

/// Flips the f16 bits of `values` (f16 values held in f32) from stream 1 of
/// `channel`'s `seed`, positions counted in the f16 bytes laid end to end.
pub(super) fn inject_f16(values: &mut [f32], channel: &dyn FaultChannel, seed: u64) -> Flips {
    let mut bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let flips = channel.inject_with(&mut bytes, &mut FaultRng::with_stream(seed, 1));
    for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
        *v = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
    flips
}

/// Whether blocks of `block_size` tokens can hold the Shard `form`
/// (what this part refuses, before anything is built).
pub(crate) fn check_shard_form(form: CacheForm, block_size: usize) -> Result<ShardSpec> {
    let refuse = |reason: &str| {
        Err(AttentionError::Store(KvQuantError::InvalidSpec {
            spec: form.to_string(),
            reason: reason.into(),
        }))
    };
    let Quantizer::Shard(spec) = form.quantizer() else {
        return refuse("is not a shard form");
    };
    if form.protection().is_some() && spec.values == ShardValues::Nf4 {
        return refuse(
            "codes its VQ values' indices; NF4 values (-vnf4) are not coded on paged blocks \
             (drop the code, or use --backend reencode)",
        );
    }
    if spec.fold.is_some() {
        return refuse(
            "folds chunks of its decode stream; on paged blocks every block is folded as it leaves the window (drop -f)",
        );
    }
    if block_size < 4 {
        return refuse("needs blocks of at least 4 tokens");
    }
    Ok(*spec)
}
