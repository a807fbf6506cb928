//! Cache forms: what a stored K or V matrix is made of, as one value type
//! ([`CacheForm`]) with one spelling, parsed and printed in `parse`
//! (`int4-g64`, `int4+secded84+interp`, `lm4+sink4+win64`, …), and the
//! per-layer key/value form policies of a whole model ([`LayerForms`]).
//!
//! A form is a quantizer ([`Quantizer`]), optionally a randomized Hadamard
//! rotation of its channels ([`Rotation`]), optionally exact f16 sink and
//! recent-window tokens ([`Segments`]), and optionally an error-correcting
//! code over its stored codes ([`Protection`]). Every combination a
//! [`CacheForm`] value can hold is valid: [`CacheForm::new`] and the parser
//! reject contradictory ones.

mod block_plan;
mod layers;
mod parse;
mod shard;
mod validate;

pub use block_plan::BlockPlan;
pub use layers::{LAYER_GRAMMAR, LayerForms, LayerRule};
pub use parse::GRAMMAR;
pub use shard::{
    DEFAULT_SHARD_GROUP, DEFAULT_SHARD_KEY_BUDGET, DEFAULT_SHARD_SINK, DEFAULT_SHARD_STREAM,
    DEFAULT_SHARD_WINDOW, MAX_SHARD_FOLD, MIN_SHARD_FOLD, ShardSpec, ShardValues,
};

use gf2_codes::Int4Code;

use crate::error::{KvQuantError, Result};
use crate::fp8::Fp8Format;

/// Reach of [`ErasurePolicy::Interpolate`] when a spelling gives none: how many
/// tokens on each side are searched for a valid neighbour.
pub const DEFAULT_INTERP_REACH: u32 = 16;

/// Group size of `nf4` when a spelling gives none (QLoRA's block size).
pub const DEFAULT_NF4_GROUP: usize = 64;

/// Channels per Hadamard block when a spelling gives none (`+rot`, `lm*`,
/// `vq`): the smallest head dimension of common models, so a block never
/// straddles two heads.
pub const DEFAULT_ROTATION_BLOCK: usize = 64;

/// Largest Hadamard block.
pub const MAX_ROTATION_BLOCK: usize = 4096;

/// Channels per vector-quantized code when a spelling gives none.
pub const DEFAULT_VQ_DIM: usize = 4;

/// Centroids per codebook when a spelling gives none (one byte per code).
pub const DEFAULT_VQ_CENTROIDS: usize = 256;

/// Storage type of scales, offsets, absmax values and norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleType {
    /// IEEE binary16, two bytes.
    F16,
    /// IEEE binary32, four bytes.
    F32,
}

impl ScaleType {
    /// Bytes per stored scale.
    pub const fn bytes(self) -> usize {
        match self {
            ScaleType::F16 => 2,
            ScaleType::F32 => 4,
        }
    }
}

/// Which values share one scale (and offset) in an integer form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// One scale per token, over groups of `group` consecutive channels, or
    /// over the whole row when `None` (KIVI's choice for values).
    PerToken {
        /// Channels per group; must divide the channel count.
        group: Option<usize>,
    },
    /// One scale per channel, over blocks of `tokens` consecutive tokens, or
    /// over all stored tokens when `None` (KIVI's choice for keys). The last
    /// block may be shorter.
    PerChannel {
        /// Tokens per block.
        tokens: Option<usize>,
    },
    /// One scale for the whole matrix.
    PerTensor,
}

/// An integer quantizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IntSpec {
    /// Bits per value: 2, 3, 4 or 8.
    pub bits: u8,
    /// Symmetric (`x ≈ (q − 2^(b−1))·s`) rather than asymmetric (`x ≈ o + q·s`).
    pub symmetric: bool,
    /// Which values share a scale.
    pub granularity: Granularity,
    /// Storage type of the scales and offsets.
    pub scale: ScaleType,
}

impl IntSpec {
    /// Asymmetric, per token over the whole row, f16 scales: the default of `int<bits>`.
    pub const fn new(bits: u8) -> Self {
        IntSpec {
            bits,
            symmetric: false,
            granularity: Granularity::PerToken { group: None },
            scale: ScaleType::F16,
        }
    }
}

/// An FP8 quantizer: values divided by a scale, then rounded to FP8.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Spec {
    /// E4M3 or E5M2.
    pub format: Fp8Format,
    /// One f32 scale per head of this many channels, or one across all
    /// channels when `None`.
    pub head_dim: Option<usize>,
    /// Scales per token (`-tok`) rather than across all tokens: each token's
    /// bytes then depend on that token alone, so rows can be written one at a
    /// time (what a paged cache needs).
    pub per_token: bool,
}

/// An NF4 quantizer: 16-level normal-float codebook with per-group absmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Nf4Spec {
    /// Channels per group (within one token).
    pub group: usize,
    /// Storage type of the absmax values.
    pub scale: ScaleType,
}

/// A Lloyd-Max scalar quantizer of rotated coordinates (TurboQuant's MSE
/// variant): each rotation block of a token stores its RMS, and every
/// coordinate divided by it is rounded to the nearest of the `2^bits`
/// Lloyd-Max centroids of the standard normal ([`crate::lloyd_max`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LloydMaxSpec {
    /// Bits per value, 1 to 8.
    pub bits: u8,
    /// Adds TurboQuant's 1-bit QJL sketch of the residual (one more bit per
    /// value and a residual norm per block), decoded to an unbiased estimate
    /// of the residual ([`crate::qjl`]).
    pub qjl: bool,
    /// Storage type of the RMS (and residual norm).
    pub scale: ScaleType,
}

/// Vector quantization: every `dim` consecutive coordinates of a token's
/// gain block, divided by the block's RMS, are replaced by the index of the
/// nearest of `centroids` codebook vectors fitted on calibration data
/// ([`crate::VqCodebook`]), and the block stores the least-squares gain of
/// the chosen centroids. Two kinds:
/// - `vq`: coordinates rotated (the rotation block is the gain block), one
///   codebook per block shared by its groups (Shard's value path);
/// - `cq` (`coupled`): Coupled Quantization (Zhang et al. 2024): the
///   channels as they are, one codebook per group of `dim` channels, so
///   each group's codebook learns its channels' joint distribution; the
///   gain block is the whole row, or `gain_block` channels (`-g<N>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VqSpec {
    /// Channels per code (1, 2, 4 or 8).
    pub dim: usize,
    /// Codebook size: a power of two from 2 to 256.
    pub centroids: usize,
    /// Storage type of the gain.
    pub scale: ScaleType,
    /// One codebook per group of `dim` channels, unrotated (`cq`), rather
    /// than one per rotation block (`vq`).
    pub coupled: bool,
    /// `cq` only: channels sharing a gain (`-g<N>`, a multiple of `dim`
    /// dividing the row); `None`: the whole row. `vq`'s gain block is its
    /// rotation block.
    pub gain_block: Option<usize>,
    /// `cq-d2` only (`-pre`): keys coded before RoPE, each code one rotated
    /// pair. kv-quant codes the rows it is handed like any `cq` rows; the
    /// cache hands them rotated back to position 0 and with each pair's two
    /// channels side by side (attention's `RopePairPart`), and rotates the
    /// decoded rows to their positions again.
    pub pre_rope: bool,
}

impl VqSpec {
    /// Bits of one stored index.
    pub const fn index_bits(&self) -> u32 {
        self.centroids.trailing_zeros()
    }
}

/// How a low-rank form picks its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RankRule {
    /// A fixed rank per head.
    Fixed(usize),
    /// The smallest rank retaining this share of the head's energy (sum of
    /// eigenvalues), in millionths: `pca-e0.99` is 990 000.
    Energy(u32),
}

/// Where a low-rank form's bases come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LowRankMethod {
    /// SubSpace-G: one basis per layer and KV head, fitted by PCA on a
    /// calibration text (`pca-r<R>`, `pca-e<E>`).
    Pca(RankRule),
    /// SubSpace-A: online chunked frequent directions (`fd-r<R>`): chunks
    /// of at most `chunk` tokens, a new chunk when a token's relative
    /// residual passes `threshold` (millionths), bases from a sketch of
    /// `sketch` rows.
    Fd {
        /// Rank of each chunk's basis.
        rank: usize,
        /// Rows of the frequent-directions sketch (at least twice the rank).
        sketch: usize,
        /// Largest chunk length L.
        chunk: usize,
        /// Relative residual `‖(I − P)x‖/‖x‖` past which a chunk closes, in millionths.
        threshold: u32,
    },
}

/// Storage of low-rank coefficients (one scale per row and head for the
/// integer ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoeffCode {
    /// IEEE binary16.
    F16,
    /// Symmetric INT8 with an f16 scale per token and head.
    Int8,
    /// Symmetric INT4 with an f16 scale per token and head.
    Int4,
}

impl CoeffCode {
    /// Bits per coefficient.
    pub const fn bits(self) -> u32 {
        match self {
            CoeffCode::F16 => 16,
            CoeffCode::Int8 => 8,
            CoeffCode::Int4 => 4,
        }
    }
}

/// A low-rank subspace form: keys or values projected on a per-head basis
/// and stored as coefficients (the `kv-lowrank` crate stores them; this
/// crate only spells them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowRankSpec {
    /// Global calibrated bases or online chunks.
    pub method: LowRankMethod,
    /// How coefficients are stored.
    pub coeffs: CoeffCode,
    /// Project keys before RoPE (`-pre`) rather than after.
    pub pre_rope: bool,
}

/// Default largest chunk of `fd` forms.
pub const DEFAULT_FD_CHUNK: usize = 128;

/// Default relative residual threshold of `fd` forms, in millionths (0.5).
pub const DEFAULT_FD_THRESHOLD: u32 = 500_000;

/// How values are turned into stored codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quantizer {
    /// Unquantized f32.
    Fp32,
    /// IEEE binary16.
    Fp16,
    /// bfloat16.
    Bf16,
    /// FP8 with f32 scales.
    Fp8(Fp8Spec),
    /// Integer quantization.
    Int(IntSpec),
    /// NF4.
    Nf4(Nf4Spec),
    /// Lloyd-Max codebook over rotated coordinates.
    LloydMax(LloydMaxSpec),
    /// Vector quantization over rotated coordinates.
    Vq(VqSpec),
    /// Low-rank subspace coefficients (stored by `kv-lowrank`).
    LowRank(LowRankSpec),
    /// The Shard pipeline (stored by the `attention` crate's `ShardLayer`).
    Shard(ShardSpec),
    /// A hierarchical INT8-class form (QuantSpec's hierarchical cache,
    /// arXiv 2502.10424): an **upper plane**, the 4-bit integer form this
    /// [`IntSpec`] describes, and a **residual plane**, the same 4-bit form
    /// of what the upper plane leaves (`x − x̂₄`, with scales of its own on
    /// the same groups). Read whole (upper plus residual, about INT8's
    /// error) or, for self-speculative drafting, the upper plane alone
    /// (half the bytes). Each plane is its own store under the form's
    /// protection; stored by the `attention` crate's `HierarchicalPart` on
    /// a paged cache, not by [`KvStore`](crate::KvStore) (see
    /// [`CacheForm::planes`]).
    Hierarchical(IntSpec),
}

impl Quantizer {
    /// Bits of one stored code (before any error-correcting code): per value,
    /// except for vector quantization, where one code stands for
    /// [`values_per_code`](Self::values_per_code) values.
    pub const fn code_bits(&self) -> u32 {
        match self {
            Quantizer::Fp32 => 32,
            Quantizer::Fp16 | Quantizer::Bf16 => 16,
            Quantizer::Fp8(_) => 8,
            Quantizer::Int(s) => s.bits as u32,
            Quantizer::Nf4(_) => 4,
            Quantizer::LloydMax(s) => s.bits as u32 + s.qjl as u32,
            Quantizer::Vq(s) => s.index_bits(),
            Quantizer::LowRank(s) => s.coeffs.bits(),
            Quantizer::Shard(_) => 4,
            Quantizer::Hierarchical(_) => 8,
        }
    }

    /// Consecutive channels of a row one code stands for.
    pub const fn values_per_code(&self) -> usize {
        match self {
            Quantizer::Vq(s) => s.dim,
            _ => 1,
        }
    }

    /// Whether the quantizer keeps the input's own bits (fp32, fp16, bf16):
    /// nothing to rotate and nothing to keep exact.
    pub const fn is_float(&self) -> bool {
        matches!(self, Quantizer::Fp32 | Quantizer::Fp16 | Quantizer::Bf16)
    }

    /// Whether the quantizer only works on rotated coordinates (Lloyd-Max and
    /// `vq`; not `cq`, which codes the channels as they are).
    pub const fn needs_rotation(&self) -> bool {
        matches!(
            self,
            Quantizer::LloydMax(_) | Quantizer::Vq(VqSpec { coupled: false, .. })
        )
    }

    /// Whether stores of this quantizer need a fitted codebook.
    pub const fn needs_codebook(&self) -> bool {
        matches!(self, Quantizer::Vq(_))
    }

    /// Whether this is a low-rank form, stored by the `kv-lowrank` crate
    /// rather than by [`KvStore`](crate::KvStore).
    pub const fn is_low_rank(&self) -> bool {
        matches!(self, Quantizer::LowRank(_))
    }

    /// Whether this is the Shard pipeline, stored by the `attention` crate
    /// rather than by [`KvStore`](crate::KvStore).
    pub const fn is_shard(&self) -> bool {
        matches!(self, Quantizer::Shard(_))
    }

    /// Whether this is a hierarchical form of two 4-bit planes, stored by
    /// the `attention` crate rather than by [`KvStore`](crate::KvStore).
    pub const fn is_hierarchical(&self) -> bool {
        matches!(self, Quantizer::Hierarchical(_))
    }

    /// Whether the form needs bases fitted on a calibration text (`pca-*`,
    /// `shard-cal`).
    pub const fn needs_bases(&self) -> bool {
        matches!(
            self,
            Quantizer::LowRank(LowRankSpec {
                method: LowRankMethod::Pca(_),
                ..
            }) | Quantizer::Shard(ShardSpec {
                calibrated: true,
                ..
            })
        )
    }
}

/// A randomized Hadamard rotation of each block of `block` consecutive
/// channels (`x ↦ H·D·x / √block`, D a fixed diagonal of random signs; see
/// [`crate::Hadamard`]). Spreading outliers over a block makes every
/// coordinate nearly Gaussian, which scalar and vector codebooks exploit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rotation {
    /// Channels per Hadamard block: a power of two dividing the channels
    /// and, for attention, the head dimension.
    pub block: usize,
}

/// Tokens held exactly (f16) around the quantized middle of a store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Segments {
    /// The first `sink` tokens (StreamingLLM's attention sinks).
    pub sink: usize,
    /// At least the last `window` tokens; with token blocks (per-channel
    /// scales over `T` tokens), also the tokens of the last incomplete
    /// block, so that only whole blocks are ever quantized (KIVI's
    /// full-precision residual).
    pub window: usize,
}

impl Segments {
    /// Whether any token is kept exact.
    pub const fn is_empty(&self) -> bool {
        self.sink == 0 && self.window == 0
    }
}

/// The dense-and-sparse options of an integer form sealed block by block
/// (KVQuant's recipe for keys, rebuilt on paged blocks):
///
/// - `+out<P>`: the P percent of a block's values that stretch their
///   groups' ranges most are kept exact (f16, with their positions) beside
///   the quantized rest. Counted in basis points (1% is 100), 1 to
///   [`MAX_OUTLIER_BASIS_POINTS`].
/// - `+clip`: the dense part's groups are also clamped, when a block seals,
///   to the range that minimises each group's squared error under the
///   form's uniform levels (kv-quant's `outliers::clip_groups`).
/// - `+pre`: keys are coded before RoPE (a block's rows rotated back to
///   position 0 when it seals, rotated to their positions again when
///   read), so channel pairs that RoPE turns within a block keep their
///   own ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SparseSpec {
    basis_points: u16,
    clip: bool,
    pre_rope: bool,
}

/// The largest outlier share, 20% (the bound: past it a form keeps
/// more exact than quantized values worth splitting).
pub const MAX_OUTLIER_BASIS_POINTS: u16 = 2000;

impl SparseSpec {
    /// A share of `basis_points` hundredths of a percent, or why not.
    pub fn new(basis_points: u16) -> Result<Self> {
        if basis_points == 0 || basis_points > MAX_OUTLIER_BASIS_POINTS {
            return Err(KvQuantError::InvalidParameter {
                name: "outlier share",
                reason: format!("{}% is not in (0, 20]", f64::from(basis_points) / 100.0),
            });
        }
        Ok(Self {
            basis_points,
            clip: false,
            pre_rope: false,
        })
    }

    /// The same options, keys coded before RoPE (`+pre`) or after.
    pub const fn with_pre_rope(self, pre_rope: bool) -> Self {
        Self { pre_rope, ..self }
    }

    /// Whether keys are coded before RoPE (`+pre`).
    pub const fn pre_rope(&self) -> bool {
        self.pre_rope
    }

    /// The same share, the dense groups clipped (`+clip`) or not.
    pub const fn with_clip(self, clip: bool) -> Self {
        Self { clip, ..self }
    }

    /// Whether the dense groups are clipped at their best range (`+clip`).
    pub const fn clip(&self) -> bool {
        self.clip
    }

    /// Hundredths of a percent.
    pub const fn basis_points(&self) -> u16 {
        self.basis_points
    }

    /// The share as a fraction in (0, 0.2].
    pub fn fraction(&self) -> f64 {
        f64::from(self.basis_points) / 10_000.0
    }

    /// How many of `values` values are kept exact: the share rounded up,
    /// so any block keeps at least one.
    pub fn count(&self, values: usize) -> usize {
        (values * usize::from(self.basis_points)).div_ceil(10_000)
    }
}

/// What a decode puts in place of a value whose codeword (or whose group's
/// scale) was detected as corrupted but could not be corrected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErasurePolicy {
    /// Keep the received (corrupted) value: the paper's plain "Hamming(8,4)" row.
    Keep,
    /// Replace it by 0.0.
    Zero,
    /// Interpolate along the token axis, per channel: the paper's midpoint of
    /// the previous and next tokens (eq. 29), clamped at the sequence ends
    /// (section 5.3.3). Where a neighbour is itself erased, the nearest valid
    /// token within `reach` on each side is used, weighted by distance
    /// (`(d_r·v_l + d_l·v_r) / (d_l + d_r)`); with one side only, its value;
    /// with neither, 0.0. Neighbours are searched within the erased value's
    /// segment (sink, middle or window) and, for rotated forms, in the
    /// rotated coordinates, where the codes live.
    Interpolate {
        /// Tokens searched on each side.
        reach: u32,
    },
}

/// Protection of scales, offsets and absmax values (the metadata).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetaProtection {
    /// Stored as they are: a fault changes a whole group silently.
    Unprotected,
    /// Each metadata word carries one check byte of an extended Hamming code
    /// (SECDED (22,16) for f16, (39,32) for f32): single flips corrected,
    /// double flips detected, and a detected word erases its whole group.
    /// The default under Hamming values (`+meta-secded`).
    Secded,
    /// Each 16 bits of a metadata word carry two check bytes of the
    /// Reed-Muller RM(2,5) \[32,16,8\] code (`+meta-rm`): up to three flips per
    /// codeword corrected, four detected, a detected word erases its group.
    /// The default under SECDED and Golay values: metadata at least as
    /// strong as the values.
    ReedMuller,
}

impl MetaProtection {
    /// The metadata code a form gets unless its spelling names one: SECDED
    /// under Hamming(7,4) values (distance 4 against their 3), RM(2,5)
    /// (distance 8) under SECDED and Golay values. A SECDED (22,16) word
    /// takes three flips about once in 800 at a bit error rate of 1e-2,
    /// and one wrong scale is a wrong row: measured on SmolLM2 with every
    /// stored bit exposed, `int4+secded84+interp` at 1e-2 went from a PPL of
    /// 150,724 under SECDED metadata to +5.4% under RM(2,5), for 0.083 more
    /// bits per value (kv-eval's README, "Metadata faults").
    pub const fn default_for(code: Int4Code) -> Self {
        match code {
            Int4Code::Hamming74 => MetaProtection::Secded,
            _ => MetaProtection::ReedMuller,
        }
    }
}

/// The error-correcting code of a protected form and its recovery. The code
/// runs over the row's stored code bits taken four at a time (the nibbles of
/// the packed row), so one gf2-codes codec protects codes of any width: a
/// 4-bit level is one nibble, an 8-bit code two, an f16 four, and two 2-bit
/// levels share one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Protection {
    /// The code over the nibbles of the stored codes.
    pub code: Int4Code,
    /// What replaces detected values.
    pub policy: ErasurePolicy,
    /// How the metadata is protected.
    pub metadata: MetaProtection,
}

impl Protection {
    /// The code with the defaults: keep detected values (the paper's),
    /// metadata under [`MetaProtection::default_for`] the code.
    pub const fn new(code: Int4Code) -> Self {
        Protection {
            code,
            policy: ErasurePolicy::Keep,
            metadata: MetaProtection::default_for(code),
        }
    }
}

/// A complete stored KV form.
///
/// Built by parsing a spelling or by [`CacheForm::new`] and the `with_*`
/// builders, all of which reject contradictory combinations, so every
/// `CacheForm` value is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheForm {
    quantizer: Quantizer,
    rotation: Option<Rotation>,
    segments: Segments,
    protection: Option<Protection>,
    sparse: Option<SparseSpec>,
}

impl CacheForm {
    /// Checks and builds a form without rotation or segments (Lloyd-Max and
    /// `vq` get their default rotation).
    pub fn new(quantizer: Quantizer, protection: Option<Protection>) -> Result<Self> {
        let rotation = quantizer.needs_rotation().then_some(Rotation {
            block: DEFAULT_ROTATION_BLOCK,
        });
        Self::build(quantizer, rotation, Segments::default(), protection)
    }

    /// Checks and builds a form from every part.
    pub fn build(
        quantizer: Quantizer,
        rotation: Option<Rotation>,
        segments: Segments,
        protection: Option<Protection>,
    ) -> Result<Self> {
        let form = CacheForm {
            quantizer,
            rotation,
            segments,
            protection,
            sparse: None,
        };
        form.validate()
            .map_err(|reason| KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason,
            })?;
        Ok(form)
    }

    /// An unprotected form.
    pub fn plain(quantizer: Quantizer) -> Result<Self> {
        Self::new(quantizer, None)
    }

    /// The quantizer.
    pub fn quantizer(&self) -> &Quantizer {
        &self.quantizer
    }

    /// The rotation, if any.
    pub fn rotation(&self) -> Option<Rotation> {
        self.rotation
    }

    /// The exact sink and window tokens.
    pub fn segments(&self) -> Segments {
        self.segments
    }

    /// The share of each block's values kept exact as sparse outliers
    /// (`+out<P>`), if any.
    pub fn sparse(&self) -> Option<SparseSpec> {
        self.sparse
    }

    /// Whether the form codes keys before RoPE (`+out<P>+pre`, `cq-d2-pre`,
    /// `pca-*-pre`, `fd-*-pre`): a key form whose cache rotates rows back
    /// to position 0 before coding them and to their positions when read,
    /// so the model's RoPE goes with it and values cannot take it.
    pub fn codes_before_rope(&self) -> bool {
        self.sparse.is_some_and(|s| s.pre_rope())
            || matches!(
                self.quantizer,
                Quantizer::Vq(VqSpec { pre_rope: true, .. })
                    | Quantizer::LowRank(LowRankSpec { pre_rope: true, .. })
            )
    }

    /// The same form with another outlier share (or none).
    pub fn with_sparse(mut self, sparse: Option<SparseSpec>) -> Result<Self> {
        self.sparse = sparse;
        self.checked()
    }

    /// The form of the dense part of a form with sparse outliers: the same
    /// codes, segments and protection, no outliers.
    pub fn without_sparse(&self) -> CacheForm {
        CacheForm {
            sparse: None,
            ..*self
        }
    }

    /// The protection, if any.
    pub fn protection(&self) -> Option<&Protection> {
        self.protection.as_ref()
    }

    /// The same form with another erasure policy (an error for unprotected forms).
    pub fn with_policy(mut self, policy: ErasurePolicy) -> Result<Self> {
        match &mut self.protection {
            Some(p) => p.policy = policy,
            None => {
                return Err(KvQuantError::InvalidSpec {
                    spec: self.to_string(),
                    reason: "an erasure policy needs a code".into(),
                });
            }
        }
        self.checked()
    }

    /// The same form with another protection (or none).
    pub fn with_protection(mut self, protection: Option<Protection>) -> Result<Self> {
        self.protection = protection;
        self.checked()
    }

    /// The same form with other exact segments.
    pub fn with_segments(mut self, segments: Segments) -> Result<Self> {
        self.segments = segments;
        self.checked()
    }

    /// The same form with another rotation (or none).
    pub fn with_rotation(mut self, rotation: Option<Rotation>) -> Result<Self> {
        self.rotation = rotation;
        self.checked()
    }

    /// The form of the same codes without segments: what the quantized
    /// middle of a segmented store holds.
    pub fn without_segments(&self) -> CacheForm {
        CacheForm {
            segments: Segments::default(),
            ..*self
        }
    }

    /// The form of the exact sink and window rows of a segmented store:
    /// f16 under the same protection.
    pub fn exact_rows_form(&self) -> CacheForm {
        CacheForm {
            quantizer: Quantizer::Fp16,
            rotation: None,
            segments: Segments::default(),
            protection: self.protection,
            sparse: None,
        }
    }

    /// The two planes of a [hierarchical](Quantizer::Hierarchical) form:
    /// the upper plane (the 4-bit integer form with the form's segments
    /// and protection) and the residual plane (the same 4-bit form under
    /// the same protection, without segments: exact tokens have no
    /// residual). `None` for every other form.
    pub fn planes(&self) -> Option<(CacheForm, CacheForm)> {
        let Quantizer::Hierarchical(spec) = self.quantizer else {
            return None;
        };
        let upper = CacheForm {
            quantizer: Quantizer::Int(spec),
            ..*self
        };
        Some((upper, upper.without_segments()))
    }

    fn checked(self) -> Result<Self> {
        self.validate()
            .map_err(|reason| KvQuantError::InvalidSpec {
                spec: self.to_string(),
                reason,
            })?;
        Ok(self)
    }

    /// Whether each token's stored bytes depend on that token alone (no
    /// scale or offset shared across tokens, no segment that depends on the
    /// token count): fp32/fp16/bf16, FP8 with `-tok`, per-token integer,
    /// NF4, Lloyd-Max and VQ forms, per-channel forms over blocks of one
    /// token, all without sink or window. Only these forms support
    /// [`KvStore::write_rows`](crate::KvStore::write_rows) and
    /// [`RowEncoder`](crate::RowEncoder).
    pub fn is_row_local(&self) -> bool {
        self.segments.is_empty()
            && self.sparse.is_none()
            && match self.quantizer {
                Quantizer::Fp32
                | Quantizer::Fp16
                | Quantizer::Bf16
                | Quantizer::Nf4(_)
                | Quantizer::LloydMax(_)
                | Quantizer::Vq(_)
                | Quantizer::LowRank(_) => true,
                Quantizer::Shard(_) | Quantizer::Hierarchical(_) => false,
                Quantizer::Fp8(s) => s.per_token,
                Quantizer::Int(s) => match s.granularity {
                    Granularity::PerToken { .. } => true,
                    Granularity::PerChannel { tokens } => tokens == Some(1),
                    Granularity::PerTensor => false,
                },
            }
    }

    /// Rows that form a unit of their own in a store of this form: 1 for
    /// [row-local](Self::is_row_local) forms, `T` for per-channel integer
    /// forms over blocks of `T` tokens without segments (a row range that
    /// starts and ends on a multiple of `T` owns its groups' scales), `None`
    /// for forms whose bytes depend on every token (per-tensor scales,
    /// segments, per-channel scales over all tokens).
    pub fn row_unit(&self) -> Option<usize> {
        if self.is_row_local() {
            return Some(1);
        }
        match self.quantizer {
            Quantizer::Int(IntSpec {
                granularity: Granularity::PerChannel { tokens: Some(t) },
                ..
            }) if self.segments.is_empty() && self.sparse.is_none() => Some(t),
            _ => None,
        }
    }

    /// Consecutive tokens that share metadata and are quantized together
    /// (1 for per-token forms; `None` when all tokens share it).
    pub fn token_block(&self) -> Option<usize> {
        match self.quantizer {
            Quantizer::Int(IntSpec {
                granularity: Granularity::PerChannel { tokens },
                ..
            }) => tokens,
            Quantizer::Int(IntSpec {
                granularity: Granularity::PerTensor,
                ..
            }) => None,
            Quantizer::Fp8(s) if !s.per_token => None,
            _ => Some(1),
        }
    }
}

#[cfg(test)]
mod tests;
