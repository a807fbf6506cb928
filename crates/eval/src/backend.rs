//! The KV backends a model can run on ([`BackendKind`]: the f32 oracle, the
//! paper's re-encode protocol, the paged cache); kv-model's
//! [`Adapted`](kv_model::model::Adapted) hands the first and the last to
//! the forward passes, the re-encode [`KvCache`](crate::cache::KvCache)
//! is one itself.

use attention::stored::{Fitted, SequenceFit};
use paged_cache::{KvPart, LayerSpec, NoPrefixCache, PagedBackend};

use crate::cache::{CacheMode, CacheStats, FaultSpec};
use crate::calibration::Part;
use crate::error::{EvalError, Result};
use kv_model::model::CausalLm;

/// Which KV backend a run uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// f32 rows as computed ([`attention::DenseBackend`]): `plain` only.
    Dense,
    /// The paper's protocol ([`KvCache`](crate::cache::KvCache)): each
    /// forward call quantises, encodes and faults the layer's whole window.
    #[default]
    Reencode,
    /// The paged cache ([`PagedBackend`]): each token encoded once, when
    /// written, into a block of `block_size` tokens.
    Paged {
        /// Tokens per block.
        block_size: usize,
    },
}

/// Refuses, before any work, what token eviction cannot run: the
/// re-encode protocol (each call codes the whole window again, evicted
/// tokens included) and forms that read a row's position from where it is
/// stored (keys coded before RoPE, `+pre` and the `-pre` low-rank forms;
/// shard forms), which evicted rows would read at the wrong positions.
pub fn check_eviction(mode: &CacheMode, backend: BackendKind) -> Result<()> {
    let refuse = |reason: String| EvalError::InvalidParameter {
        name: "evict",
        reason,
    };
    if backend == BackendKind::Reencode {
        return Err(refuse(
            "the re-encode protocol codes each window whole, evicted tokens included (use \
             --backend paged or dense)"
                .into(),
        ));
    }
    let positional =
        |form: &kv_quant::CacheForm| form.quantizer().is_shard() || form.codes_before_rope();
    match mode.forms().into_iter().find(|(f, _)| positional(f)) {
        Some((form, _)) => Err(refuse(format!(
            "{form} reads each row at the position it is stored at; evicted rows are stored \
             compactly (use a form coded after RoPE)"
        ))),
        None => Ok(()),
    }
}

/// Refuses an eviction whose f32 copies of a `tokens`-token prompt (the
/// rows as computed, kept until the eviction, and the kept rows while
/// they are written) would pass the memory budget.
pub fn check_eviction_memory(model: &dyn CausalLm, tokens: usize) -> Result<()> {
    let values = (model.layers() as u64)
        .saturating_mul(model.kv_channels() as u64)
        .saturating_mul(tokens as u64)
        .saturating_mul(2);
    crate::budget::check(
        &format!("eviction's f32 copies of a {tokens}-token prompt"),
        values.saturating_mul(2 * 4),
    )
}

/// Whether `mode` stores blocks in forms of their own (`BlockForms`).
fn has_block_forms(mode: &CacheMode) -> bool {
    matches!(mode, CacheMode::Stored(s) if s.blocks.is_some())
}

/// The paged cache's refusal of per-block forms.
fn per_block_refusal() -> EvalError {
    EvalError::InvalidParameter {
        name: "backend",
        reason: "per-block forms (adaptive protection per block) are stored by the re-encode \
                 backend"
            .into(),
    }
}

impl BackendKind {
    /// Refuses, before any work, what this backend cannot run: the dense
    /// backend anything but `plain` without faults; the paged backend
    /// per-call faults, per-block forms, blocks of no token and forms a
    /// block cannot hold.
    pub fn check(&self, mode: &CacheMode, faults: Option<FaultSpec>) -> Result<()> {
        let faulted = faults.is_some_and(|f| f.is_faulted());
        let hierarchical = mode
            .forms()
            .iter()
            .find(|(f, _)| f.quantizer().is_hierarchical())
            .map(|(f, _)| *f);
        match *self {
            Self::Reencode if hierarchical.is_some() => Err(EvalError::InvalidParameter {
                name: "backend",
                reason: format!(
                    "{} keeps two 4-bit planes for the paged cache to read whole or, for \
                     self-speculation, upper plane only (use --backend paged)",
                    hierarchical.expect("matched")
                ),
            }),
            Self::Reencode => {
                if let Some((form, _)) = mode.forms().iter().find(|(f, _)| f.sparse().is_some()) {
                    return Err(EvalError::InvalidParameter {
                        name: "backend",
                        reason: format!(
                            "{form} splits sparse outliers off each sealed block of a paged \
                             cache; the re-encode protocol codes each window whole (use \
                             --backend paged)"
                        ),
                    });
                }
                // Pair codebooks of keys before RoPE keep no exact window.
                for (form, _) in mode.forms() {
                    if matches!(form.quantizer(), kv_quant::Quantizer::Vq(s) if s.pre_rope) {
                        attention::stored::RopePairPart::fits(form, 1)?;
                    }
                }
                Ok(())
            }
            Self::Dense if *mode == CacheMode::Plain && !faulted => Ok(()),
            Self::Dense => Err(EvalError::InvalidParameter {
                name: "backend",
                reason: "the dense backend holds f32 rows: it runs `plain` without faults".into(),
            }),
            Self::Paged { .. } if faulted => Err(EvalError::InvalidParameter {
                name: "backend",
                reason: "the paged backend takes no per-call faults: faults in a paged cache \
                         accumulate over decode steps (`kv-eval generate --ber-per-step`); the \
                         paper's per-call protocol is `--backend reencode`"
                    .into(),
            }),
            Self::Paged { .. } if has_block_forms(mode) => Err(per_block_refusal()),
            Self::Paged { block_size: 0 } => Err(EvalError::InvalidParameter {
                name: "block-size",
                reason: "blocks hold at least one token".into(),
            }),
            Self::Paged { block_size } if block_size > MAX_BLOCK_SIZE => {
                Err(EvalError::InvalidParameter {
                    name: "block-size",
                    reason: format!(
                        "{block_size}: a block holds at most {MAX_BLOCK_SIZE} tokens (16 to 64 \
                         is what paged caches use)"
                    ),
                })
            }
            Self::Paged { block_size } => {
                for (form, part) in mode.forms() {
                    if part == Part::Value && form.codes_before_rope() {
                        return Err(EvalError::InvalidParameter {
                            name: "form",
                            reason: format!(
                                "{form} codes keys before RoPE (+pre, -pre); values carry no \
                                 RoPE (drop it from the value form)"
                            ),
                        });
                    }
                    paged_cache::check_pageable(&form, block_size)?;
                }
                Ok(())
            }
        }
    }

    /// The backend a perplexity run uses when none is named: the paged
    /// cache (blocks of `block_size`) wherever it reproduces the re-encode
    /// protocol, that is for forms a block can hold and no per-call faults;
    /// the re-encode backend otherwise (forms that share parameters across
    /// tokens, online low-rank forms, the paper's fault protocol) and for
    /// calibrated forms (which `--backend paged` serves with their fitted
    /// codebooks and bases).
    pub fn auto(mode: &CacheMode, faults: Option<FaultSpec>, block_size: usize) -> Self {
        let paged = Self::Paged { block_size };
        // Calibrated forms stay on the re-encode protocol their tables
        // were measured on; `--backend paged` serves them.
        // So do the Shard forms fitted per sequence: `--backend paged`
        // fits them on the rows committed when a block first seals, the
        // re-encode protocol on each whole window.
        // Hierarchical forms live on the paged cache only: its own check
        // says why, where it refuses them.
        if mode
            .forms()
            .iter()
            .any(|(f, _)| f.quantizer().is_hierarchical())
        {
            return paged;
        }
        let calibrated = mode.forms().iter().any(|(f, _)| {
            let q = f.quantizer();
            q.needs_codebook() || q.needs_bases() || q.is_shard()
        });
        if !calibrated && paged.check(mode, faults).is_ok() {
            paged
        } else {
            Self::Reencode
        }
    }

    /// Refuses self-speculation (`--speculate self`) where the cache keeps
    /// no draft view, before any work: every layer's key and value forms
    /// must be hierarchical (`int8h…`, whose upper 4-bit plane the draft
    /// reads) on the paged backend.
    pub fn check_draft_view(&self, mode: &CacheMode) -> Result<()> {
        let forms = mode.forms();
        let flat = forms.iter().find(|(f, _)| !f.quantizer().is_hierarchical());
        match (self, flat) {
            (Self::Paged { .. }, None) if !forms.is_empty() => Ok(()),
            _ => Err(EvalError::InvalidParameter {
                name: "speculate",
                reason: format!(
                    "self-speculation drafts through the upper 4-bit plane of a hierarchical \
                     cache: every key and value form int8h, int8h-g<N> or int8h-ch[+sink<S>] \
                     on --backend paged ({} on the {} backend keeps no 4-bit view)",
                    flat.map_or_else(|| mode.label(), |(f, _)| f.to_string()),
                    self.name()
                ),
            }),
        }
    }

    /// The command-line name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Reencode => "reencode",
            Self::Paged { .. } => "paged",
        }
    }
}

/// The largest block size the paged backend takes (a block is one page of
/// a sequence; larger ones only waste memory).
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

/// Whether any form of `mode` is staged in blocks of `block_size` (per-channel
/// scales, exact sinks or windows: attention's `stored::part_seals`), so that its
/// blocks are sealed when a step commits and a step reads its own rows
/// exact.
pub fn seals_blocks(mode: &CacheMode, block_size: usize) -> bool {
    mode.forms()
        .into_iter()
        .any(|(form, _)| attention::stored::part_seals(form, block_size))
}

/// A paged backend for one sequence of up to `tokens` tokens of `model`,
/// in `mode`'s forms per layer (`plain` keeps `fp32` rows). Refuses faults
/// (the paged cache's faults accumulate over steps; the per-call protocol
/// is the re-encode backend's), forms a block cannot hold, and a pool over
/// the memory budget ([`crate::budget`]), before any work.
pub fn paged_backend(
    model: &dyn CausalLm,
    mode: &CacheMode,
    faults: Option<FaultSpec>,
    block_size: usize,
    tokens: usize,
) -> Result<PagedBackend> {
    BackendKind::Paged { block_size }.check(mode, faults)?;
    let specs = layer_specs(model, mode)?;
    let fitted = fitted_tables(model, mode)?;
    let blocks = tokens.div_ceil(block_size).max(1);
    crate::budget::check(
        &format!("a paged cache of {tokens} tokens ({blocks} blocks of {block_size})"),
        paged_cache::BlockStorage::pool_bytes_fitted(blocks, block_size, &specs, &fitted)?
            .saturating_add(paged_cache::BlockStorage::sequence_bytes_fitted(
                block_size, &specs, &fitted,
            )?),
    )?;
    let storage = paged_cache::BlockStorage::with_fitted(blocks, block_size, &specs, &fitted)?;
    let backend = PagedBackend::with_storage(std::sync::Arc::new(storage), NoPrefixCache)?;
    keep_non_finite(backend.storage());
    Ok(backend)
}

/// Makes `storage` store NaN and infinite K/V values as their forms store
/// numbers (kv-quant's `NonFinite::Keep`, counted by
/// `BlockStorage::non_finite_written`): in a fault experiment, a flipped
/// exponent in an unprotected cache makes the next layers' rows NaN, and
/// that outcome (NaN logits, infinite perplexity, wrong tokens) is a
/// result to report, not an error that ends the run.
pub fn keep_non_finite(storage: &paged_cache::BlockStorage) {
    storage.set_non_finite(kv_quant::NonFinite::Keep);
}

/// The paged cache's layer specs for `model` in `mode`'s forms (`plain`
/// keeps `fp32` rows).
pub fn layer_specs(model: &dyn CausalLm, mode: &CacheMode) -> Result<Vec<LayerSpec>> {
    let channels = model.kv_channels();
    if has_block_forms(mode) {
        return Err(per_block_refusal());
    }
    Ok(match mode {
        CacheMode::Plain => vec![LayerSpec::uniform("fp32".parse()?, channels); model.layers()],
        CacheMode::Stored(s) => s
            .layers
            .resolve(model.layers())?
            .into_iter()
            .map(|(key, value)| LayerSpec {
                key,
                value,
                channels,
            })
            .collect(),
    })
}

/// The fitted tables (calibrated `vq` codebooks, `pca-*` bases, the
/// tables of `shard-*-cal` forms, the RoPE of `+pre` keys) of each of `model`'s layers' K and V
/// parts, from `mode`'s calibration: loaded once, shared by every block of
/// the paged cache.
pub fn fitted_tables(model: &dyn CausalLm, mode: &CacheMode) -> Result<Vec<[Fitted; 2]>> {
    let CacheMode::Stored(s) = mode else {
        return Ok(Vec::new());
    };
    let cal = s.calibration.as_ref();
    let shard = |form: &kv_quant::CacheForm, layer, part| {
        let cal = cal?;
        model
            .rope()
            .and_then(|rope| cal.shard_tables(form, layer, part, rope))
    };
    // What a Shard part fitting its tables on each sequence needs of the
    // model (its RoPE, its head width).
    let sequence = |form: &kv_quant::CacheForm, part| match (form.quantizer(), part) {
        (kv_quant::Quantizer::Shard(spec), Part::Key) if !spec.calibrated => {
            model.rope().map(|r| SequenceFit::Keys(r.clone()))
        }
        (kv_quant::Quantizer::Shard(spec), Part::Value) if !spec.calibrated => {
            Some(SequenceFit::Values {
                head_dim: model.head_dim(),
            })
        }
        _ => None,
    };
    // The model's RoPE for key forms coded before it (`+pre`, `cq-d2-pre`,
    // `pca-*-pre`).
    let pre_rope = |form: &kv_quant::CacheForm, part| match part {
        Part::Key if form.codes_before_rope() => model.rope().cloned(),
        _ => None,
    };
    Ok(s.layers
        .resolve(model.layers())?
        .into_iter()
        .enumerate()
        .map(|(i, (key, value))| {
            [(key, Part::Key), (value, Part::Value)].map(|(form, part)| Fitted {
                codebook: cal.and_then(|c| c.codebook(&form, i, part)),
                bases: cal.and_then(|c| c.bases(&form, i, part)),
                shard: shard(&form, i, part),
                sequence: sequence(&form, part),
                rope: pre_rope(&form, part),
            })
        })
        .collect())
}

/// The statistics of a paged backend that held `tokens` tokens, in the
/// re-encode backend's terms: decode statistics, and the bytes of the
/// blocks the sequence holds (the last block counted whole, staged exact
/// rows counted beside their blocks' rows).
pub fn paged_stats(
    backend: &PagedBackend,
    model: &dyn CausalLm,
    tokens: usize,
) -> Result<CacheStats> {
    let read = backend.read_stats();
    let storage = backend.storage();
    let blocks = match backend.sequence() {
        Some(seq) => backend.manager().block_table(seq)?,
        None => &[],
    };
    let mut part_bytes = [0u64; 2];
    for &block in blocks {
        for layer in 0..storage.layers().len() {
            for (i, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
                part_bytes[i] += storage.block_part_bytes(block, layer, part)? as u64;
            }
        }
    }
    // Fitted tables are stored once beside the blocks (calibrated) or once
    // per sequence (fitted on its rows), counted with the part that reads
    // them.
    let tables = match backend.sequence() {
        Some(seq) => backend.manager().sequence_tables(seq)?.clone(),
        None => paged_cache::SeqTables::default(),
    };
    for (i, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
        part_bytes[i] += (storage.shared_part_bytes(part) + tables.part_bytes(part)) as u64;
    }
    Ok(CacheStats {
        keys: read.keys,
        values: read.values,
        stored_bytes: part_bytes[0] + part_bytes[1],
        codebook_bytes: (storage.shared_bytes() + tables.stored_bytes()) as u64,
        stored_values: 2 * (tokens * model.kv_channels() * model.layers()) as u64,
        part_bytes,
        ..CacheStats::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ChannelKind;
    use kv_quant::FaultTarget;

    #[test]
    fn auto_is_paged_exactly_where_paged_reproduces_reencode() {
        let faults = |ber| {
            Some(FaultSpec {
                channel: ChannelKind::Bsc,
                ber,
                seed: 0,
                target: FaultTarget::Values,
                hot: None,
            })
        };
        let paged = BackendKind::Paged { block_size: 16 };
        for (form, ber, want) in [
            ("plain", 0.0, paged),
            ("int4+secded84", 0.0, paged),
            ("int4", 0.0, paged),
            ("int4+secded84", 1e-3, BackendKind::Reencode),
            ("int4-ch", 0.0, paged),
            ("int4+sink4+win16", 0.0, paged),
            ("int4-ch32", 0.0, paged),
            ("int4-ch24", 0.0, BackendKind::Reencode),
            ("fp8-e4m3", 0.0, BackendKind::Reencode),
            ("vq", 0.0, BackendKind::Reencode),
            ("pca-r32", 0.0, BackendKind::Reencode),
            ("shard-k3-cal", 0.0, BackendKind::Reencode),
            ("shard-k3", 0.0, BackendKind::Reencode),
        ] {
            let mode = CacheMode::parse(form).unwrap();
            assert_eq!(
                BackendKind::auto(&mode, faults(ber), 16),
                want,
                "{form} at {ber}"
            );
        }
        let blocked = CacheMode::parse("int4+secded84")
            .unwrap()
            .with_blocks(crate::cache::BlockForms::uniform(16, false));
        assert!(paged.check(&blocked, None).is_err());
        assert_eq!(BackendKind::auto(&blocked, None, 16), BackendKind::Reencode);
    }
}
