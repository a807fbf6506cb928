//! The calibrated Shard tables of a calibration file: what its tensors
//! make of one form's layer (see the parent module's docs for the format).

use std::collections::BTreeMap;
use std::sync::Arc;

use kv_lowrank::{HeadBases, ShardKeys};
use kv_quant::{CacheForm, ChannelVq, Quantizer};

use super::{Part, ShardPrototypes, basis_shape};

/// The little-endian f16 bytes of `values` (f16 as stored, held in f32):
/// the words a Shard value codebook's check words cover.
pub(super) fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&c| half::f16::from_f32(c).to_le_bytes())
        .collect()
}

/// The tables of the calibrated Shard `form`'s `layer` from a file's
/// tensors: the keys' allocation over the groups of the form's key basis
/// (a `pca/` tensor of the same file), the values' codebook (for heads of
/// `head_dim` of `kv_channels`), or why they do not make one.
pub(super) fn shard_tables_of(
    form: &str,
    layer: usize,
    (allocation, centroids): (Option<Vec<u8>>, Option<Vec<f32>>),
    bases: &BTreeMap<(String, usize, Part), Arc<HeadBases>>,
    (kv_channels, head_dim): (usize, Option<usize>),
) -> std::result::Result<ShardPrototypes, String> {
    let at = format!("shard/{form}/{layer}");
    let parsed: CacheForm = form.parse().map_err(|e| format!("{at}: {e}"))?;
    let Quantizer::Shard(spec) = *parsed.quantizer() else {
        return Err(format!("{at}: {form} is not a Shard form"));
    };
    if parsed.to_string() != form {
        return Err(format!("{at}: {form} is not spelled as written ({parsed})"));
    }
    let shape = basis_shape(&parsed, Part::Key).ok_or(format!("{at}: {form} is not calibrated"))?;
    let full = bases
        .get(&(shape.clone(), layer, Part::Key))
        .ok_or(format!("{at}: no key basis (pca/{shape}/{layer}/k/0)"))?;
    let [full] = &full.heads[..] else {
        return Err(format!(
            "{at}: its key basis is not one basis over the layer's keys"
        ));
    };
    let allocation = allocation.ok_or(format!("{at}: no allocation ({at}/k/allocation)"))?;
    let keys = ShardKeys::from_tables(full, allocation, spec.group)
        .map_err(|e| format!("{at}/k/allocation: {e}"))?;
    // What the form's budget allows (`with_basis` allocates within it).
    let budget = (spec.key_bits() * full.dim() as f64).floor() as usize;
    if keys.kept() == 0 || 8 * keys.row_bytes() > budget {
        return Err(format!(
            "{at}/k/allocation: {} bits per token over {} components, where {form} allows \
             1 to {budget}",
            8 * keys.row_bytes(),
            keys.kept()
        ));
    }
    let values = match (spec.values, centroids) {
        (kv_quant::ShardValues::Vq, Some(c)) => {
            let d = head_dim.ok_or("no `shard_head_dim` in its metadata")?;
            let v = ChannelVq::from_codebook(kv_channels, d, &c)
                .map_err(|e| format!("{at}/v/centroids: {e}"))?;
            Some(Arc::new(v))
        }
        (kv_quant::ShardValues::Nf4, None) => None,
        (kv_quant::ShardValues::Vq, None) => return Err(format!("{at}: no value codebook")),
        (kv_quant::ShardValues::Nf4, Some(_)) => {
            return Err(format!("{at}: NF4 values hold no codebook"));
        }
    };
    Ok((Arc::new(keys), values))
}
