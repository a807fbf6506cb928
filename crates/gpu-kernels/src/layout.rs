//! [`KernelForm`]: a paged layer's cache form as the fused attention kernel
//! reads it — which bytes of a block hold what, in kv-quant's canonical
//! layout (the block's [`KvStore`](kv_quant::KvStore) buffers, unchanged) —
//! checked on the host, so unsupported forms fail with a typed error before
//! anything reaches the device.

use gf2_codes::Int4Code;
use kv_quant::spec::{Granularity, IntSpec};
use kv_quant::{
    CacheForm, ErasurePolicy, LevelMap, MetaProtection, Quantizer, RowBufferSizes, RowEncoder,
    ScaleType,
};

use crate::error::{GpuError, Result};

/// Channels each thread of the attention kernel reads from one row: the
/// channels of one metadata group must be a multiple of this.
pub const LANE_CHANNELS: usize = 16;

/// How the values of a row are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueCoding {
    /// Little-endian f16 per value.
    F16,
    /// Packed INT4 levels, value `j` in bits `4j..4j+4` of the row.
    Int4,
    /// One SECDED(8,4) byte per INT4 level.
    Int4Secded84,
}

impl ValueCoding {
    /// The device's number for the coding (`RKV_F16`, `RKV_INT4`, `RKV_SECDED` in `common.cuh`).
    pub const fn id(self) -> u32 {
        match self {
            ValueCoding::F16 => 0,
            ValueCoding::Int4 => 1,
            ValueCoding::Int4Secded84 => 2,
        }
    }
}

/// A layer's form as the fused paged attention kernel handles it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelForm {
    /// The form it was made from.
    pub form: CacheForm,
    /// The value coding.
    pub coding: ValueCoding,
    /// Channels per token (`kv_heads × head_dim`).
    pub channels: usize,
    /// Bytes of one token row of the value buffer.
    pub row_bytes: usize,
    /// Channels of a row sharing one scale (and offset); 0 for f16.
    pub channels_per_group: usize,
    /// Scale and offset type.
    pub scale: ScaleType,
    /// Symmetric levels (`(level − 8)·a`) rather than affine (`b + level·a`).
    pub symmetric: bool,
    /// Scales and offsets carry SECDED check bytes.
    pub meta_checks: bool,
    /// What an erased value becomes.
    pub policy: ErasurePolicy,
    /// kv-quant's buffer lengths of one row.
    pub row_sizes: RowBufferSizes,
}

/// Byte lengths of the four buffers of one block (one K or V store of
/// `block_size` tokens).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockBytes {
    /// Value bytes.
    pub data: usize,
    /// Scale bytes.
    pub scales: usize,
    /// Offset bytes.
    pub offsets: usize,
    /// Metadata check bytes.
    pub checks: usize,
}

impl KernelForm {
    /// Checks that the kernel handles `form` over `channels` channels with
    /// `head_dim`-channel heads, and describes its bytes.
    ///
    /// Handled: `fp16`; INT4 per token (whole row or groups of a multiple of
    /// [`LANE_CHANNELS`] channels), symmetric or not, f16 or f32 scales; and
    /// the same protected by `+secded84` with any erasure policy and with or
    /// without metadata checks.
    pub fn new(form: CacheForm, channels: usize, head_dim: usize) -> Result<Self> {
        let unsupported = |reason: String| GpuError::Unsupported {
            what: "cache form",
            reason: format!("{form}: {reason}"),
        };
        if head_dim == 0 || !head_dim.is_multiple_of(LANE_CHANNELS) || head_dim > 256 {
            return Err(GpuError::Unsupported {
                what: "head_dim",
                reason: format!("{head_dim}: must be a multiple of {LANE_CHANNELS} up to 256"),
            });
        }
        if channels == 0 || !channels.is_multiple_of(head_dim) {
            return Err(GpuError::InvalidParameter {
                name: "channels",
                reason: format!("{channels} is not a multiple of head_dim {head_dim}"),
            });
        }
        let coding = match *form.quantizer() {
            Quantizer::Fp16 => ValueCoding::F16,
            Quantizer::Int(IntSpec {
                bits: 4,
                granularity: Granularity::PerToken { .. },
                ..
            }) => match form.protection() {
                None => ValueCoding::Int4,
                Some(p) if p.code == Int4Code::Secded84 => ValueCoding::Int4Secded84,
                Some(p) => {
                    return Err(unsupported(format!(
                        "{} inside attention (use the batch decoder)",
                        p.code
                    )));
                }
            },
            _ => {
                return Err(unsupported(
                    "the fused kernel reads fp16, int4 per token and int4+secded84".into(),
                ));
            }
        };
        // Row bytes, groups, scale type and the level map come from
        // kv-quant's own row encoder: the kernel re-derives none of them.
        let encoder = RowEncoder::new(form, channels, None)?;
        let (scale, symmetric, channels_per_group) = match coding {
            ValueCoding::F16 => (ScaleType::F16, false, 0),
            ValueCoding::Int4 | ValueCoding::Int4Secded84 => {
                let symmetric = match encoder.level_map() {
                    Some(LevelMap::Centered { mid: 8.0 }) => true,
                    Some(LevelMap::Affine) => false,
                    other => return Err(unsupported(format!("level map {other:?}"))),
                };
                let cpg = encoder.channels_per_group();
                if !cpg.is_multiple_of(LANE_CHANNELS) || !channels.is_multiple_of(cpg) {
                    return Err(unsupported(format!(
                        "groups of {cpg} channels: need a multiple of {LANE_CHANNELS} dividing {channels}"
                    )));
                }
                (encoder.scale_type(), symmetric, cpg)
            }
        };
        let (meta_checks, policy) = match form.protection() {
            Some(p) if p.metadata == MetaProtection::ReedMuller => {
                return Err(unsupported(
                    "RM(2,5) metadata (the default under +secded84): the device decodes \
                     SECDED metadata; spell +meta-secded"
                        .into(),
                ));
            }
            Some(p) => (p.metadata == MetaProtection::Secded, p.policy),
            None => (false, ErasurePolicy::Keep),
        };
        Ok(KernelForm {
            form,
            coding,
            channels,
            row_bytes: encoder.row_bytes(),
            channels_per_group,
            scale,
            symmetric,
            meta_checks,
            policy,
            row_sizes: encoder.buffer_sizes(1),
        })
    }

    /// Metadata groups per token row.
    pub fn groups_per_row(&self) -> usize {
        self.channels
            .checked_div(self.channels_per_group)
            .unwrap_or(0)
    }

    /// Whether the tensor-core kernels (`paged_mma_*`) read this form at
    /// `head_dim` in blocks of `block_size` tokens: INT4 or SECDED INT4
    /// whose groups cover whole heads (a group size that is a multiple of
    /// `head_dim`), with rows and blocks of a multiple of 16 bytes (their
    /// vector loads).
    pub fn reads_on_tensor_cores(&self, head_dim: usize, block_size: usize) -> bool {
        self.coding != ValueCoding::F16
            && head_dim > 0
            && self.channels_per_group > 0
            && self.channels_per_group.is_multiple_of(head_dim)
            && self.row_bytes.is_multiple_of(16)
            && self.block_bytes(block_size).data.is_multiple_of(16)
    }

    /// Whether the form stores offsets.
    pub fn has_offsets(&self) -> bool {
        self.coding != ValueCoding::F16 && !self.symmetric
    }

    /// Buffer lengths of one block of `block_size` tokens, as kv-quant's
    /// row encoder sizes them.
    pub fn block_bytes(&self, block_size: usize) -> BlockBytes {
        let r = self.row_sizes;
        BlockBytes {
            data: block_size * r.data,
            scales: block_size * r.scales,
            offsets: block_size * r.offsets,
            checks: block_size * (r.scale_checks + r.offset_checks),
        }
    }

    /// The erasure policy as the device reads it: `(kind, reach)` with kind
    /// 0 keep, 1 zero, 2 interpolate; under keep the reach is the one that
    /// rebuilds groups whose metadata was erased (kv-quant's rule).
    pub fn policy_code(&self) -> (u32, u32) {
        match self.policy {
            ErasurePolicy::Keep => (0, kv_quant::spec::DEFAULT_INTERP_REACH),
            ErasurePolicy::Zero => (1, 0),
            ErasurePolicy::Interpolate { reach } => (2, reach),
        }
    }
}

/// Applies `f` to the one kv-quant store holding every block's sealed rows
/// of one part of `layer` (block `b` at rows `b·block_size..`), the pool
/// the device copies; a part kept in another layout is refused.
pub fn with_pool_store<R>(
    storage: &paged_cache::BlockStorage,
    layer: usize,
    part: paged_cache::KvPart,
    f: impl FnOnce(&kv_quant::KvStore) -> Result<R>,
) -> Result<R> {
    let guard = storage.part(layer, part)?;
    let store = guard.sealed_store().ok_or_else(|| GpuError::Unsupported {
        what: "cache form",
        reason: format!(
            "{}: its blocks are not one kv-quant store, which the device pools copy",
            guard.form()
        ),
    })?;
    f(store)
}

/// The device pools of one part of a layer: `[codes, scales, offsets,
/// checks]`, each the concatenation of every block's buffers in block order.
/// paged-cache's layer store spans every block, so codes, scales and
/// offsets are its buffers as they are; its check bytes hold all scale
/// checks, then all offset checks, and are regrouped per block here.
pub fn block_pool_bytes(
    storage: &paged_cache::BlockStorage,
    layer: usize,
    part: paged_cache::KvPart,
) -> Result<[Vec<u8>; 4]> {
    with_pool_store(storage, layer, part, |store| {
        pool_bytes_of(store, storage.num_blocks())
    })
}

/// [`block_pool_bytes`] of the pool store of `num_blocks` blocks.
fn pool_bytes_of(store: &kv_quant::KvStore, num_blocks: usize) -> Result<[Vec<u8>; 4]> {
    let checks = store.meta_checks();
    let has_offsets = !store.offsets().is_empty();
    let per_block = checks.len().checked_div(num_blocks).unwrap_or(0);
    let groups = if has_offsets {
        per_block / 2
    } else {
        per_block
    };
    let total = groups * num_blocks;
    let mut blocked = Vec::with_capacity(checks.len());
    for b in 0..num_blocks {
        blocked.extend_from_slice(&checks[b * groups..(b + 1) * groups]);
        if has_offsets {
            blocked.extend_from_slice(&checks[total + b * groups..total + (b + 1) * groups]);
        }
    }
    Ok([
        store.data().to_vec(),
        store.scales().to_vec(),
        store.offsets().to_vec(),
        blocked,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_quant::KvStore;

    #[test]
    fn tensor_cores_read_int4_groups_of_whole_heads() {
        // (form, channels, head_dim, tensor cores)
        for (form, channels, hd, want) in [
            ("int4", 1024, 128, true),
            ("int4", 256, 64, true),
            ("int4-g128", 512, 128, true),
            ("int4-g128", 256, 64, true),
            ("int4-g64", 256, 64, true),
            ("int4-g64", 512, 128, false),
            ("int4-sym-g32-sf32", 256, 64, false),
            ("int4-sym-sf32", 256, 64, true),
            ("int4+secded84+meta-secded", 1024, 128, true),
            ("int4-sym+secded84+meta-secded", 192, 64, true),
            ("int4-sf32+secded84+interp+meta-secded", 384, 128, true),
            ("int4-g64+secded84+interp+meta-secded", 256, 128, false),
            ("fp16", 1024, 128, false),
        ] {
            let k = KernelForm::new(form.parse().unwrap(), channels, hd).unwrap();
            assert_eq!(k.reads_on_tensor_cores(hd, 16), want, "{form} at {hd}");
        }
    }

    #[test]
    fn block_pools_are_every_blocks_buffers_in_block_order() {
        use paged_cache::{BlockId, BlockStorage, KvPart, LayerSpec};
        for form in [
            "int4+secded84+meta-secded",
            "int4",
            "fp16",
            "int4-sym-g32+secded84+meta-secded",
        ] {
            let ch = 128;
            let spec = LayerSpec::uniform(form.parse().unwrap(), ch);
            let storage = BlockStorage::new(5, 4, &[spec]).unwrap();
            for t in 0..20usize {
                let row: Vec<f32> = (0..ch)
                    .map(|c| ((t * ch + c) as f32 * 0.37).sin())
                    .collect();
                storage
                    .write(BlockId((t / 4) as u32), t % 4, 0, &row, &row)
                    .unwrap();
            }
            for part in [KvPart::Keys, KvPart::Values] {
                let got = block_pool_bytes(&storage, 0, part).unwrap();
                let mut want: [Vec<u8>; 4] = Default::default();
                for b in 0..5 {
                    storage
                        .with_store(BlockId(b), 0, part, |st| {
                            want[0].extend_from_slice(st.data());
                            want[1].extend_from_slice(st.scales());
                            want[2].extend_from_slice(st.offsets());
                            want[3].extend_from_slice(st.meta_checks());
                        })
                        .unwrap();
                }
                assert_eq!(got, want, "{form}");
            }
        }
    }

    /// The computed block buffer lengths equal those of real kv-quant stores.
    #[test]
    fn block_bytes_match_kv_quant_stores() {
        let (block, ch, hd) = (16, 256, 128);
        let data: Vec<f32> = (0..block * ch)
            .map(|i| (i % 37) as f32 * 0.1 - 1.5)
            .collect();
        for spelling in [
            "fp16",
            "int4",
            "int4-g64",
            "int4-sym-g32",
            "int4-g128-sf32",
            "int4+secded84+meta-secded",
            "int4-g64+secded84+interp+meta-secded",
            "int4+secded84+zero+meta-none",
        ] {
            let form: CacheForm = spelling.parse().unwrap();
            let kf = KernelForm::new(form, ch, hd).unwrap();
            let store = KvStore::quantize(form, &data, block, ch).unwrap();
            let b = kf.block_bytes(block);
            assert_eq!(b.data, store.data().len(), "{spelling}");
            assert_eq!(b.scales, store.scales().len(), "{spelling}");
            assert_eq!(b.offsets, store.offsets().len(), "{spelling}");
            assert_eq!(b.checks, store.meta_checks().len(), "{spelling}");
            assert_eq!(kf.row_bytes, store.row_bytes(), "{spelling}");
        }
    }

    #[test]
    fn unsupported_forms_and_shapes_are_typed_errors() {
        let f = |s: &str| s.parse::<CacheForm>().unwrap();
        for (form, ch, hd) in [
            (f("int4-ch"), 256, 128),
            (f("int4-g8"), 256, 128),
            (f("int4+golay24"), 256, 128),
            (f("int4+secded84"), 256, 128),
            (f("int4+secded84+meta-rm"), 256, 128),
            (f("int8"), 256, 128),
            (f("fp8-e4m3"), 256, 128),
        ] {
            assert!(matches!(
                KernelForm::new(form, ch, hd),
                Err(GpuError::Unsupported { .. })
            ));
        }
        assert!(matches!(
            KernelForm::new(f("fp16"), 256, 24),
            Err(GpuError::Unsupported { .. })
        ));
        assert!(matches!(
            KernelForm::new(f("fp16"), 200, 128),
            Err(GpuError::InvalidParameter { .. })
        ));
    }
}
