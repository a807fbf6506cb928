//! Cache-form names: the one parser and printer of spellings such as `int4-g64`
//! or `int4+secded84+interp`, used by the CLI, reports and benches alike.
//!
//! Grammar (see [`GRAMMAR`]): a base form with `-` options, then for 4-bit
//! forms an optional `+code`, an optional `+policy` and an optional `+meta-…`.
//! Printing omits defaults, so `parse(form.to_string()) == form` for every
//! form, and every form has exactly one printed spelling.

use std::fmt;
use std::str::FromStr;

use gf2_codes::Int4Code;

use crate::error::{KvQuantError, Result};
use crate::fp8::Fp8Format;

/// Every valid spelling, for error messages and `--help` texts.
pub const GRAMMAR: &str = "fp32 | fp16 | bf16 | fp8-e4m3[-h<N>][-tok] | fp8-e5m2[-h<N>][-tok] | \
int{2,3,4,8}[-sym][-g<N> | -ch | -ch<N> | -t][-sf32] | nf4[-g<N>][-sf32]; \
int4 and nf4 forms may add +hamming74 | +secded84 | +golay24, then +keep | +zero | +interp[<reach>] \
and +meta-none (e.g. int4, int4-g64, int4-ch, nf4, fp8-e4m3, int4+secded84+interp, int4+golay24)";

/// Reach of [`ErasurePolicy::Interpolate`] when a spelling gives none: how many
/// tokens on each side are searched for a valid neighbour.
pub const DEFAULT_INTERP_REACH: u32 = 16;

/// Group size of `nf4` when a spelling gives none (QLoRA's block size).
pub const DEFAULT_NF4_GROUP: usize = 64;

/// Storage type of scales, offsets and absmax values.
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
}

impl Quantizer {
    /// Bits of one stored code (before any error-correcting code).
    pub const fn code_bits(&self) -> u32 {
        match self {
            Quantizer::Fp32 => 32,
            Quantizer::Fp16 | Quantizer::Bf16 => 16,
            Quantizer::Fp8(_) => 8,
            Quantizer::Int(s) => s.bits as u32,
            Quantizer::Nf4(_) => 4,
        }
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
    /// with neither, 0.0.
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
    /// The default of every ECC-protected form.
    Secded,
}

/// The error-correcting code and recovery of a protected 4-bit form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Protection {
    /// The code over the 4-bit codes.
    pub code: Int4Code,
    /// What replaces detected values.
    pub policy: ErasurePolicy,
    /// How the metadata is protected.
    pub metadata: MetaProtection,
}

impl Protection {
    /// The code with the paper's defaults: keep detected values, SECDED metadata.
    pub const fn new(code: Int4Code) -> Self {
        Protection {
            code,
            policy: ErasurePolicy::Keep,
            metadata: MetaProtection::Secded,
        }
    }
}

/// A complete stored KV form: a quantizer and, for 4-bit forms, an optional code.
///
/// Built by parsing a spelling or by [`CacheForm::new`], both of which reject
/// contradictory combinations, so every `CacheForm` value is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheForm {
    quantizer: Quantizer,
    protection: Option<Protection>,
}

impl CacheForm {
    /// Checks and builds a form.
    pub fn new(quantizer: Quantizer, protection: Option<Protection>) -> Result<Self> {
        let form = CacheForm {
            quantizer,
            protection,
        };
        form.validate()
            .map_err(|reason| KvQuantError::InvalidSpec {
                spec: format!("{form:?}"),
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
        Self::new(self.quantizer, self.protection)
    }

    /// Whether each token's stored bytes depend on that token alone (no
    /// scale or offset shared across tokens): fp32/fp16/bf16, FP8 with
    /// `-tok`, per-token integer and NF4 forms, per-channel forms over
    /// blocks of one token. Only these forms support
    /// [`KvStore::write_rows`](crate::KvStore::write_rows).
    pub fn is_row_local(&self) -> bool {
        match self.quantizer {
            Quantizer::Fp32 | Quantizer::Fp16 | Quantizer::Bf16 | Quantizer::Nf4(_) => true,
            Quantizer::Fp8(s) => s.per_token,
            Quantizer::Int(s) => match s.granularity {
                Granularity::PerToken { .. } => true,
                Granularity::PerChannel { tokens } => tokens == Some(1),
                Granularity::PerTensor => false,
            },
        }
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let positive = |what: &str, n: usize| {
            if n == 0 {
                Err(format!("{what} must be at least 1"))
            } else {
                Ok(())
            }
        };
        match self.quantizer {
            Quantizer::Int(s) => {
                if ![2, 3, 4, 8].contains(&s.bits) {
                    return Err(format!(
                        "int{} is not supported (2, 3, 4 or 8 bits)",
                        s.bits
                    ));
                }
                match s.granularity {
                    Granularity::PerToken { group: Some(g) } => positive("group size", g)?,
                    Granularity::PerChannel { tokens: Some(t) } => positive("token block", t)?,
                    _ => {}
                }
            }
            Quantizer::Nf4(s) => positive("group size", s.group)?,
            Quantizer::Fp8(Fp8Spec {
                head_dim: Some(h), ..
            }) => positive("head dimension", h)?,
            _ => {}
        }
        if let Some(p) = &self.protection {
            let four_bit = matches!(self.quantizer, Quantizer::Int(IntSpec { bits: 4, .. }))
                || matches!(self.quantizer, Quantizer::Nf4(_));
            if !four_bit {
                return Err(format!(
                    "{} protects 4-bit codes; it cannot be combined with {}",
                    p.code,
                    base_name(&self.quantizer)
                ));
            }
            if let ErasurePolicy::Interpolate { reach: 0 } = p.policy {
                return Err("interpolation reach must be at least 1".into());
            }
        }
        Ok(())
    }
}

fn base_name(q: &Quantizer) -> String {
    let mut s = String::new();
    write_quantizer(&mut s, q).expect("writing to a String cannot fail");
    s
}

fn write_quantizer(f: &mut impl fmt::Write, q: &Quantizer) -> fmt::Result {
    let scale = |f: &mut dyn fmt::Write, s: ScaleType| match s {
        ScaleType::F16 => Ok(()),
        ScaleType::F32 => f.write_str("-sf32"),
    };
    match q {
        Quantizer::Fp32 => f.write_str("fp32"),
        Quantizer::Fp16 => f.write_str("fp16"),
        Quantizer::Bf16 => f.write_str("bf16"),
        Quantizer::Fp8(s) => {
            f.write_str(match s.format {
                Fp8Format::E4M3 => "fp8-e4m3",
                Fp8Format::E5M2 => "fp8-e5m2",
            })?;
            if let Some(h) = s.head_dim {
                write!(f, "-h{h}")?;
            }
            if s.per_token {
                f.write_str("-tok")?;
            }
            Ok(())
        }
        Quantizer::Int(s) => {
            write!(f, "int{}", s.bits)?;
            if s.symmetric {
                f.write_str("-sym")?;
            }
            match s.granularity {
                Granularity::PerToken { group: None } => {}
                Granularity::PerToken { group: Some(g) } => write!(f, "-g{g}")?,
                Granularity::PerChannel { tokens: None } => f.write_str("-ch")?,
                Granularity::PerChannel { tokens: Some(t) } => write!(f, "-ch{t}")?,
                Granularity::PerTensor => f.write_str("-t")?,
            }
            scale(f, s.scale)
        }
        Quantizer::Nf4(s) => {
            f.write_str("nf4")?;
            if s.group != DEFAULT_NF4_GROUP {
                write!(f, "-g{}", s.group)?;
            }
            scale(f, s.scale)
        }
    }
}

impl fmt::Display for CacheForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_quantizer(f, &self.quantizer)?;
        if let Some(p) = &self.protection {
            write!(f, "+{}", p.code)?;
            match p.policy {
                ErasurePolicy::Keep => {}
                ErasurePolicy::Zero => f.write_str("+zero")?,
                ErasurePolicy::Interpolate {
                    reach: DEFAULT_INTERP_REACH,
                } => f.write_str("+interp")?,
                ErasurePolicy::Interpolate { reach } => write!(f, "+interp{reach}")?,
            }
            if p.metadata == MetaProtection::Unprotected {
                f.write_str("+meta-none")?;
            }
        }
        Ok(())
    }
}

/// Parses the number after a prefix (`g64` → 64); `None` if `s` lacks the prefix.
fn number_after(s: &str, prefix: &str) -> Option<std::result::Result<usize, String>> {
    let digits = s.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(
        digits
            .parse::<usize>()
            .map_err(|_| format!("{s:?}: number too large"))
            .and_then(|n| {
                if n == 0 {
                    Err(format!("{s:?}: must be at least 1"))
                } else {
                    Ok(n)
                }
            }),
    )
}

fn parse_quantizer(base: &str) -> std::result::Result<Quantizer, String> {
    let (head, options): (&str, Vec<&str>) = if let Some(rest) = base.strip_prefix("fp8-") {
        let mut parts = rest.split('-');
        let format = parts.next().unwrap_or_default();
        let head = match format {
            "e4m3" => "fp8-e4m3",
            "e5m2" => "fp8-e5m2",
            other => return Err(format!("unknown FP8 format {other:?} (e4m3 or e5m2)")),
        };
        (head, parts.collect())
    } else {
        let mut parts = base.split('-');
        (parts.next().unwrap_or_default(), parts.collect())
    };
    let mut seen = std::collections::HashSet::new();
    for o in &options {
        let key = match o.trim_end_matches(|c: char| c.is_ascii_digit()) {
            "asym" => "sym",
            k => k,
        };
        if !seen.insert(key) {
            return Err(format!("option -{key} given twice"));
        }
    }
    let no_options = |name: &str| {
        if options.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{name} takes no options, found -{}",
                options.join("-")
            ))
        }
    };
    match head {
        "fp32" => no_options("fp32").map(|_| Quantizer::Fp32),
        "fp16" => no_options("fp16").map(|_| Quantizer::Fp16),
        "bf16" => no_options("bf16").map(|_| Quantizer::Bf16),
        "fp8-e4m3" | "fp8-e5m2" => {
            let format = if head == "fp8-e4m3" {
                Fp8Format::E4M3
            } else {
                Fp8Format::E5M2
            };
            let (mut head_dim, mut per_token) = (None, false);
            for o in options {
                if o == "tok" {
                    per_token = true;
                    continue;
                }
                match number_after(o, "h") {
                    Some(h) => head_dim = Some(h?),
                    None => return Err(format!("unknown FP8 option -{o} (-h<N>, -tok)")),
                }
            }
            Ok(Quantizer::Fp8(Fp8Spec {
                format,
                head_dim,
                per_token,
            }))
        }
        "nf4" => {
            let mut spec = Nf4Spec {
                group: DEFAULT_NF4_GROUP,
                scale: ScaleType::F16,
            };
            for o in options {
                if o == "sf32" {
                    spec.scale = ScaleType::F32;
                } else if o == "sf16" {
                    spec.scale = ScaleType::F16;
                } else if let Some(g) = number_after(o, "g") {
                    spec.group = g?;
                } else {
                    return Err(format!("unknown NF4 option -{o} (-g<N>, -sf32)"));
                }
            }
            Ok(Quantizer::Nf4(spec))
        }
        _ => {
            let bits = match head {
                "int2" => 2,
                "int3" => 3,
                "int4" => 4,
                "int8" => 8,
                other => return Err(format!("unknown base form {other:?}")),
            };
            let mut spec = IntSpec::new(bits);
            let mut granularity_set = false;
            for o in options {
                let mut set_granularity = |g: Granularity| {
                    if std::mem::replace(&mut granularity_set, true) {
                        Err("more than one granularity (-g, -ch, -t)".to_string())
                    } else {
                        spec.granularity = g;
                        Ok(())
                    }
                };
                match o {
                    "sym" => spec.symmetric = true,
                    "asym" => spec.symmetric = false,
                    "sf32" => spec.scale = ScaleType::F32,
                    "sf16" => spec.scale = ScaleType::F16,
                    "t" => set_granularity(Granularity::PerTensor)?,
                    "ch" => set_granularity(Granularity::PerChannel { tokens: None })?,
                    _ => {
                        if let Some(g) = number_after(o, "g") {
                            set_granularity(Granularity::PerToken { group: Some(g?) })?;
                        } else if let Some(t) = number_after(o, "ch") {
                            set_granularity(Granularity::PerChannel { tokens: Some(t?) })?;
                        } else {
                            return Err(format!(
                                "unknown integer option -{o} (-sym, -g<N>, -ch, -ch<N>, -t, -sf32)"
                            ));
                        }
                    }
                }
            }
            Ok(Quantizer::Int(spec))
        }
    }
}

impl FromStr for CacheForm {
    type Err = KvQuantError;

    fn from_str(text: &str) -> Result<Self> {
        let err = |reason: String| KvQuantError::InvalidSpec {
            spec: text.to_string(),
            reason,
        };
        let mut parts = text.trim().split('+');
        let base = parts.next().unwrap_or_default();
        let quantizer = parse_quantizer(base).map_err(err)?;
        let mut code = None;
        let mut policy = None;
        let mut metadata = None;
        for part in parts {
            if let Ok(c) = part.parse::<Int4Code>() {
                if code.replace(c).is_some() {
                    return Err(err("more than one code".into()));
                }
                continue;
            }
            let p = match part {
                "keep" => Some(ErasurePolicy::Keep),
                "zero" => Some(ErasurePolicy::Zero),
                "interp" => Some(ErasurePolicy::Interpolate {
                    reach: DEFAULT_INTERP_REACH,
                }),
                _ => match number_after(part, "interp") {
                    Some(r) => {
                        let r = r.map_err(err)?;
                        let reach = u32::try_from(r)
                            .map_err(|_| err(format!("interpolation reach {r} too large")))?;
                        Some(ErasurePolicy::Interpolate { reach })
                    }
                    None => None,
                },
            };
            if let Some(p) = p {
                if code.is_none() {
                    return Err(err(format!("+{part} needs a code before it")));
                }
                if policy.replace(p).is_some() {
                    return Err(err("more than one erasure policy".into()));
                }
                continue;
            }
            let m = match part {
                "meta-none" => MetaProtection::Unprotected,
                "meta-secded" => MetaProtection::Secded,
                other => return Err(err(format!("unknown suffix +{other}"))),
            };
            if code.is_none() {
                return Err(err(format!("+{part} needs a code before it")));
            }
            if metadata.replace(m).is_some() {
                return Err(err("more than one metadata protection".into()));
            }
        }
        let protection = code.map(|code| Protection {
            code,
            policy: policy.unwrap_or(ErasurePolicy::Keep),
            metadata: metadata.unwrap_or(MetaProtection::Secded),
        });
        let form = CacheForm {
            quantizer,
            protection,
        };
        form.validate().map_err(err)?;
        Ok(form)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn issue_spellings_parse_and_print_back() {
        for s in [
            "fp32",
            "fp16",
            "bf16",
            "fp8-e4m3",
            "fp8-e5m2-h64",
            "fp8-e4m3-tok",
            "fp8-e5m2-h64-tok",
            "int8",
            "int4",
            "int4-g64",
            "int4-sym-ch",
            "int2-ch32-sf32",
            "int3-t",
            "nf4",
            "nf4-g32",
            "int4+hamming74",
            "int4+secded84",
            "int4+secded84+interp",
            "int4+secded84+interp4",
            "int4-g64+golay24+zero+meta-none",
            "nf4+secded84",
        ] {
            let form: CacheForm = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(form.to_string(), s);
        }
    }

    #[test]
    fn defaults_are_dropped_when_printing() {
        let f: CacheForm = "int4-asym-sf16+secded84+keep+meta-secded".parse().unwrap();
        assert_eq!(f.to_string(), "int4+secded84");
        assert_eq!("nf4-g64".parse::<CacheForm>().unwrap().to_string(), "nf4");
        let p = f.protection().unwrap();
        assert_eq!(p.policy, ErasurePolicy::Keep);
        assert_eq!(p.metadata, MetaProtection::Secded);
    }

    #[test]
    fn bad_spellings_are_rejected_with_the_valid_choices() {
        for (s, needle) in [
            ("int5", "unknown base form"),
            ("fp8-e3m4", "unknown FP8 format"),
            ("fp16+secded84", "cannot be combined"),
            ("int8+golay24", "cannot be combined"),
            ("int4+interp", "needs a code"),
            ("int4+meta-none", "needs a code"),
            ("int4+secded84+golay24", "more than one code"),
            ("int4+secded84+zero+interp", "more than one erasure policy"),
            ("int4-g64-ch", "more than one granularity"),
            ("int4-g0", "at least 1"),
            ("int4-g64-g32", "given twice"),
            ("int4-sym-asym", "given twice"),
            ("nf4-sym", "unknown NF4 option"),
            ("fp32-g4", "takes no options"),
            ("int4+secded84+interp0", "at least 1"),
            ("int4+foo", "unknown suffix"),
            ("", "unknown base form"),
        ] {
            let e = s.parse::<CacheForm>().unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
            assert!(e.contains("valid forms: fp32"), "{s}: {e}");
        }
    }

    fn forms() -> impl Strategy<Value = CacheForm> {
        let scale = prop_oneof![Just(ScaleType::F16), Just(ScaleType::F32)];
        let granularity = prop_oneof![
            proptest::option::of(1usize..300).prop_map(|group| Granularity::PerToken { group }),
            proptest::option::of(1usize..300).prop_map(|tokens| Granularity::PerChannel { tokens }),
            Just(Granularity::PerTensor),
        ];
        let int = (
            prop_oneof![Just(2u8), Just(3), Just(4), Just(8)],
            any::<bool>(),
            granularity,
            scale.clone(),
        )
            .prop_map(|(bits, symmetric, granularity, scale)| {
                Quantizer::Int(IntSpec {
                    bits,
                    symmetric,
                    granularity,
                    scale,
                })
            });
        let quantizer = prop_oneof![
            Just(Quantizer::Fp32),
            Just(Quantizer::Fp16),
            Just(Quantizer::Bf16),
            (
                any::<bool>(),
                proptest::option::of(1usize..300),
                any::<bool>()
            )
                .prop_map(|(e4, head_dim, per_token)| {
                    Quantizer::Fp8(Fp8Spec {
                        format: if e4 { Fp8Format::E4M3 } else { Fp8Format::E5M2 },
                        head_dim,
                        per_token,
                    })
                }),
            int,
            (1usize..300, scale)
                .prop_map(|(group, scale)| Quantizer::Nf4(Nf4Spec { group, scale })),
        ];
        let policy = prop_oneof![
            Just(ErasurePolicy::Keep),
            Just(ErasurePolicy::Zero),
            (1u32..64).prop_map(|reach| ErasurePolicy::Interpolate { reach }),
        ];
        let protection = proptest::option::of((0usize..3, policy, any::<bool>()).prop_map(
            |(c, policy, meta)| Protection {
                code: Int4Code::ALL[c],
                policy,
                metadata: if meta {
                    MetaProtection::Secded
                } else {
                    MetaProtection::Unprotected
                },
            },
        ));
        (quantizer, protection)
            .prop_filter_map("valid forms only", |(q, p)| CacheForm::new(q, p).ok())
    }

    proptest! {
        #[test]
        fn every_form_round_trips(form in forms()) {
            let text = form.to_string();
            prop_assert_eq!(text.parse::<CacheForm>().unwrap(), form);
        }
    }
}
