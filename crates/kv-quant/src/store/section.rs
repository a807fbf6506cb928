//! [`Section`]: a run of token rows stored in one coding, the unit every
//! encoder, decoder, injector and scrubber works on. A [`KvStore`](super::KvStore)
//! is one section, or, for forms with exact sink and window tokens, a
//! quantized middle section and an f16 section holding the exact rows.
//!
//! # Row layout
//! Each value (or, for vector quantization, each group of `dim` values) has
//! a code of `code_bits` bits. A row's codes are packed into a little-endian
//! bit stream (code `j` at bits `[b·j, b·j + b)`), which is the row's bytes
//! for unprotected forms. A protected row takes that stream four bits at a
//! time (nibble `i` is bits `[4i, 4i + 4)`, `⌈b·codes/4⌉` nibbles) and
//! stores them through the form's gf2-codes batch codec, so one codec
//! protects codes of every width. For 4-bit codes the nibbles are the codes,
//! which is the paper's INT4 layout byte for byte.

use std::sync::Arc;

use gf2_codes::batch::Int4Codec;

use crate::error::{KvQuantError, Result};
use crate::fp8::Fp8Format;
use crate::layout::GroupLayout;
use crate::meta::MetaCode;
use crate::rotation::Hadamard;
use crate::spec::{CacheForm, Granularity, Protection, Quantizer, ScaleType, VqSpec};
use crate::vq::VqCodebook;

use super::bound::ParamBound;
use super::ledger::FaultLedger;

/// How stored codes become values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    F32,
    F16,
    Bf16,
    Fp8(Fp8Format),
    Asym(u8),
    Sym(u8),
    Nf4,
    LloydMax {
        bits: u8,
        qjl: bool,
    },
    Vq {
        dim: usize,
    },
    /// Low-rank, Shard and hierarchical forms, which sections refuse (other
    /// crates store them).
    LowRank,
}

impl Kind {
    pub(crate) fn of(q: &Quantizer) -> Kind {
        match *q {
            Quantizer::Fp32 => Kind::F32,
            Quantizer::Fp16 => Kind::F16,
            Quantizer::Bf16 => Kind::Bf16,
            Quantizer::Fp8(s) => Kind::Fp8(s.format),
            Quantizer::Int(s) if s.symmetric => Kind::Sym(s.bits),
            Quantizer::Int(s) => Kind::Asym(s.bits),
            Quantizer::Nf4(_) => Kind::Nf4,
            Quantizer::LloydMax(s) => Kind::LloydMax {
                bits: s.bits,
                qjl: s.qjl,
            },
            Quantizer::Vq(s) => Kind::Vq { dim: s.dim },
            Quantizer::LowRank(_) | Quantizer::Shard(_) | Quantizer::Hierarchical(_) => {
                Kind::LowRank
            }
        }
    }

    /// How a level becomes a value, for the integer, FP8, NF4 and Lloyd-Max
    /// (up to 4 bits, no QJL) forms (the one
    /// description attention's in-register dequantisation and the GPU
    /// kernels read); `None` for every other kind.
    pub(crate) fn level_map(self) -> Option<super::LevelMap> {
        match self {
            Kind::Asym(_) => Some(super::LevelMap::Affine),
            Kind::Sym(bits) => Some(super::LevelMap::Centered {
                mid: f32::from(1u8 << (bits - 1)),
            }),
            Kind::Fp8(format) => Some(super::LevelMap::Fp8(format)),
            Kind::Nf4 => Some(super::LevelMap::Nf4),
            Kind::LloydMax { bits, qjl: false } => crate::lloyd_max::LloydMax::of(bits)
                .padded16()
                .map(super::LevelMap::Codebook),
            _ => None,
        }
    }

    /// Bytes per value of the float forms, whose codes are the values' bits.
    pub(crate) fn float_bytes(self) -> Option<usize> {
        match self {
            Kind::F32 => Some(4),
            Kind::F16 | Kind::Bf16 => Some(2),
            _ => None,
        }
    }

    /// Value of one level (or FP8 code) in a group with parameters `(a, b)`
    /// (scale and offset; absmax; scale; gain), for the one-value-per-code
    /// forms other than QJL.
    #[inline]
    pub(crate) fn dequant(self, level: u8, a: f32, b: f32) -> f32 {
        match self {
            Kind::Asym(_) => b + f32::from(level) * a,
            Kind::Sym(bits) => (f32::from(level) - f32::from(1u8 << (bits - 1))) * a,
            Kind::Fp8(format) => format.table()[usize::from(level)] * a,
            Kind::LloydMax { bits, .. } => {
                crate::lloyd_max::LloydMax::of(bits).centroids()[usize::from(level)] * a
            }
            _ => crate::nf4::NF4_LEVELS[usize::from(level & 15)] * a,
        }
    }
}

/// What a section's bytes mean: the form of its codes and the numbers
/// derived from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Coding {
    /// The form of the codes (never with segments).
    pub(crate) form: CacheForm,
    pub(crate) kind: Kind,
    pub(crate) code_bits: u32,
    pub(crate) values_per_code: usize,
}

impl Coding {
    pub(crate) fn of(form: CacheForm) -> Coding {
        let q = form.quantizer();
        Coding {
            form,
            kind: Kind::of(q),
            code_bits: q.code_bits(),
            values_per_code: q.values_per_code(),
        }
    }

    pub(crate) fn protection(&self) -> Option<&Protection> {
        self.form.protection()
    }

    pub(crate) fn codec(&self) -> Option<&'static dyn Int4Codec> {
        self.form.protection().map(|p| p.code.codec())
    }

    /// Whether the row's nibbles are its codes (4-bit codes, one value each).
    pub(crate) fn nibbles_are_levels(&self) -> bool {
        self.code_bits == 4 && self.values_per_code == 1
    }

    /// Codes per row.
    pub(crate) fn codes(&self, channels: usize) -> usize {
        channels / self.values_per_code
    }

    /// Bytes of a row's packed code stream.
    pub(crate) fn packed_bytes(&self, channels: usize) -> usize {
        (self.code_bits as usize * self.codes(channels)).div_ceil(8)
    }

    /// Nibbles of a row's code stream (what a code protects).
    pub(crate) fn nibbles(&self, channels: usize) -> usize {
        (self.code_bits as usize * self.codes(channels)).div_ceil(4)
    }

    /// Bytes of one stored row.
    pub(crate) fn row_bytes(&self, channels: usize) -> usize {
        match self.codec() {
            Some(codec) => codec.encoded_len(self.nibbles(channels)),
            None => self.packed_bytes(channels),
        }
    }

    /// Storage type of the metadata words.
    pub(crate) fn scale_type(&self) -> ScaleType {
        match self.form.quantizer() {
            Quantizer::Int(s) => s.scale,
            Quantizer::Nf4(s) => s.scale,
            Quantizer::LloydMax(s) => s.scale,
            Quantizer::Vq(s) => s.scale,
            _ => ScaleType::F32,
        }
    }

    /// Whether groups carry a second word: the offset of asymmetric integer
    /// forms, the residual norm of QJL forms.
    pub(crate) fn has_offsets(&self) -> bool {
        matches!(self.kind, Kind::Asym(_) | Kind::LloydMax { qjl: true, .. })
    }

    pub(crate) fn meta_code(&self) -> Option<&'static MetaCode> {
        let p = self.form.protection()?;
        MetaCode::for_protection(p.metadata, 8 * self.scale_type().bytes())
    }

    /// Bytes of one metadata word's check word (0 when unprotected).
    pub(crate) fn check_bytes(&self) -> usize {
        self.meta_code().map_or(0, MetaCode::check_bytes)
    }

    pub(crate) fn hadamard(&self) -> Result<Option<&'static Hadamard>> {
        self.form
            .rotation()
            .map(|r| Hadamard::of(r.block))
            .transpose()
    }

    /// The metadata grouping of a `tokens × channels` section, or `None`
    /// for the float forms.
    pub(crate) fn layout(&self, tokens: usize, channels: usize) -> Result<Option<GroupLayout>> {
        if self.form.sparse().is_some() {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{} keeps sparse outliers beside its codes: a SparseStore holds it \
                     (on a paged cache, attention's SparsePart)",
                    self.form
                ),
            });
        }
        let block = self.form.rotation().map(|r| r.block);
        if let Some(b) = block
            && !channels.is_multiple_of(b)
        {
            return Err(KvQuantError::InvalidParameter {
                name: "rotation block",
                reason: format!(
                    "blocks of {b} channels do not divide the {channels} channels ({}; write +rot<N> with N dividing the head dimension)",
                    self.form
                ),
            });
        }
        let (tpb, cpg) = match *self.form.quantizer() {
            Quantizer::Fp32 | Quantizer::Fp16 | Quantizer::Bf16 => return Ok(None),
            Quantizer::Fp8(s) => (
                if s.per_token { 1 } else { tokens },
                s.head_dim.unwrap_or(channels),
            ),
            Quantizer::Nf4(s) => (1, s.group),
            Quantizer::Int(s) => match s.granularity {
                Granularity::PerToken { group } => (1, group.unwrap_or(channels)),
                Granularity::PerChannel { tokens: block } => (block.unwrap_or(tokens), 1),
                Granularity::PerTensor => (tokens, channels),
            },
            Quantizer::Vq(VqSpec {
                coupled: true,
                gain_block,
                ..
            }) => (1, gain_block.unwrap_or(channels)),
            Quantizer::LloydMax(_) | Quantizer::Vq(_) => (1, block.unwrap_or(channels)),
            Quantizer::LowRank(_) => {
                return Err(KvQuantError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{} is a low-rank form: the kv-lowrank crate stores it (LowRankStore)",
                        self.form
                    ),
                });
            }
            Quantizer::Shard(_) => {
                return Err(KvQuantError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{} is the Shard pipeline: the attention crate stores it (ShardLayer)",
                        self.form
                    ),
                });
            }
            Quantizer::Hierarchical(_) => {
                return Err(KvQuantError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{} keeps two 4-bit planes: the attention crate stores it \
                         (HierarchicalPart), one kv-quant store per plane",
                        self.form
                    ),
                });
            }
        };
        GroupLayout::new(tokens, channels, tpb, cpg).map(Some)
    }
}

/// A run of `tokens` rows of `channels` values in one coding.
#[derive(Clone, Debug)]
pub(crate) struct Section {
    pub(crate) coding: Coding,
    pub(crate) tokens: usize,
    pub(crate) channels: usize,
    pub(crate) row_bytes: usize,
    pub(crate) layout: Option<GroupLayout>,
    /// Token rows of `row_bytes` bytes.
    pub(crate) data: Vec<u8>,
    /// One scale (absmax, gain) per group.
    pub(crate) scales: Vec<u8>,
    /// One offset (QJL residual norm) per group, for forms that have them.
    pub(crate) offsets: Vec<u8>,
    /// One check word per scale, then one per offset (protected metadata;
    /// one, two or four bytes each, little-endian).
    pub(crate) checks: Vec<u8>,
    /// The codebooks of a vq form (shared, not counted in `stored_bytes`).
    pub(crate) codebook: Option<Arc<VqCodebook>>,
    /// The bits faults changed since the rows were written (`None` until
    /// the first fault). Not part of a section's equality, which is that of
    /// its form, shape and bytes.
    pub(crate) ledger: Option<Box<FaultLedger>>,
    /// The range of the scales and offsets written (protected metadata
    /// only; [`ParamBound`]). Like the ledger, write history: not part of
    /// equality.
    pub(crate) bound: ParamBound,
}

impl PartialEq for Section {
    fn eq(&self, other: &Self) -> bool {
        self.coding == other.coding
            && self.tokens == other.tokens
            && self.channels == other.channels
            && self.row_bytes == other.row_bytes
            && self.layout == other.layout
            && self.data == other.data
            && self.scales == other.scales
            && self.offsets == other.offsets
            && self.checks == other.checks
            && self.codebook == other.codebook
    }
}

impl Eq for Section {}

impl Section {
    /// An all-zero-bytes section of the right size (its contents are
    /// written by the encoder before use).
    pub(crate) fn empty(
        coding: Coding,
        tokens: usize,
        channels: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Section> {
        if coding.form.quantizer().needs_codebook() {
            match &codebook {
                Some(cb) => cb.check_fits(&coding.form, channels)?,
                None => {
                    return Err(KvQuantError::Calibration {
                        form: coding.form.to_string(),
                        what: "a fitted codebook",
                        reason: "no codebook was given (fit one with VqCodebook::fit on \
                                 calibration rows and quantize with KvStore::quantize_with_codebook)"
                            .into(),
                    });
                }
            }
        }
        coding.hadamard()?;
        let layout = coding.layout(tokens, channels)?;
        let row_bytes = coding.row_bytes(channels);
        let groups = layout.map_or(0, |l| l.groups());
        let width = coding.scale_type().bytes();
        let words = groups * (1 + usize::from(coding.has_offsets()));
        let bytes = |n: usize, what: &str| {
            n.checked_mul(tokens)
                .ok_or_else(|| KvQuantError::InvalidParameter {
                    name: "shape",
                    reason: format!("{tokens} rows of {n} {what} overflow"),
                })
        };
        Ok(Section {
            coding,
            tokens,
            channels,
            row_bytes,
            layout,
            data: vec![0; bytes(row_bytes, "bytes")?],
            scales: vec![0; groups * width],
            offsets: if coding.has_offsets() {
                vec![0; groups * width]
            } else {
                Vec::new()
            },
            checks: if coding.meta_code().is_some() {
                vec![0; words * coding.check_bytes()]
            } else {
                Vec::new()
            },
            codebook: if coding.form.quantizer().needs_codebook() {
                codebook
            } else {
                None
            },
            ledger: None,
            bound: ParamBound::default(),
        })
    }

    /// The section's fault ledger, created on first use.
    pub(crate) fn ledger_mut(&mut self) -> &mut FaultLedger {
        self.ledger.get_or_insert_default()
    }

    pub(crate) fn stored_bytes(&self) -> usize {
        self.data.len() + self.scales.len() + self.offsets.len() + self.checks.len()
    }

    /// Value words per token: codewords for coded forms, codes otherwise.
    pub(crate) fn words_per_row(&self) -> usize {
        match self.coding.codec() {
            Some(codec) => codec.codewords(self.coding.nibbles(self.channels)),
            None => self.coding.codes(self.channels),
        }
    }
}
