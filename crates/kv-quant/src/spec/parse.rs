//! The one spelling of a [`CacheForm`]: [`FromStr`] and [`Display`](fmt::Display).
//!
//! A spelling is a base form with `-` options, then `+` suffixes in any
//! order (see [`GRAMMAR`]). Printing puts the suffixes in a fixed order and
//! omits defaults, so `parse(form.to_string()) == form` for every form and
//! every form has exactly one printed spelling.

use std::fmt;
use std::str::FromStr;

use gf2_codes::Int4Code;

use super::{
    CacheForm, CoeffCode, DEFAULT_FD_CHUNK, DEFAULT_FD_THRESHOLD, DEFAULT_INTERP_REACH,
    DEFAULT_NF4_GROUP, DEFAULT_ROTATION_BLOCK, DEFAULT_SHARD_GROUP, DEFAULT_SHARD_KEY_BUDGET,
    DEFAULT_SHARD_SINK, DEFAULT_SHARD_STREAM, DEFAULT_SHARD_WINDOW, DEFAULT_VQ_CENTROIDS,
    DEFAULT_VQ_DIM, ErasurePolicy, Fp8Spec, Granularity, IntSpec, LloydMaxSpec, LowRankMethod,
    LowRankSpec, MetaProtection, Nf4Spec, Protection, Quantizer, RankRule, Rotation, ScaleType,
    Segments, ShardSpec, ShardValues, SparseSpec, VqSpec,
};
use crate::error::{KvQuantError, Result};
use crate::fp8::Fp8Format;

/// Every valid spelling, for error messages and `--help` texts.
pub const GRAMMAR: &str = "BASE[+SUFFIX...] with BASE one of fp32 | fp16 | bf16 | \
fp8-e4m3[-h<N>][-tok] | fp8-e5m2[-h<N>][-tok] | int{2,3,4,8}[-sym][-g<N> | -ch | -ch<N> | -t][-sf32] | \
int8h[-sym][-g<N> | -ch | -ch<N>][-sf32] (two 4-bit planes: upper and residual) | \
nf4[-g<N>][-sf32] | lm{1..8}[-sf32] | vq[-d{1,2,4,8}][-k<2..256>][-sf32] | \
cq[-d{1,2,4,8}][-k<2..256>][-g<N>][-pre][-sf32] (Coupled Quantization: a codebook per group of d channels, unrotated; a gain per row or per N channels; -pre with -d2: keys coded before RoPE, a code per rotated pair) | \
pca-r<R>[-c16|-c8|-c4][-pre] | pca-e<E in (0,1]>[...] | fd-r<R>[-m<M>][-l<L>][-t<T>][-c16|-c8|-c4][-pre] | \
shard[-k<key bits per value>][-g<G>][-r<R>][-vnf4][-s<1..8>[q]|-soff][-f<fold chunk>][-cal] (sink 4, window 64 unless +sink/+win), and SUFFIX one of \
+rot[<N>] (Hadamard blocks of N channels, default 64; lm and vq always rotate) | +qjl (lm only) | \
+sink<S> | +win<W> | +out<P> (integer forms: the largest P% of each block's values exact, P in (0, 20]) | +clip, +pre (with +out: each dense group clamped to its best range; keys coded before RoPE) | +hamming74 | +secded84 | +golay24 | +secded84x8 | +golay24x8 | then, after a code, +keep | +zero | \
+interp[<reach>] | +meta-none | +meta-secded | +meta-rm (e.g. int4, int4-g64, int4-ch, nf4, fp8-e4m3, int4+rot, lm4, \
vq, int4-ch32+win32, int4+secded84+interp, int8+golay24, lm3+sink4+win64)";

/// Longest part of a rejected spelling quoted back in an error message.
const QUOTE_LIMIT: usize = 80;

/// The spelling as quoted in an error: cut after [`QUOTE_LIMIT`] characters.
pub(crate) fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_LIMIT) {
        Some((cut, _)) => format!("{}… ({} bytes)", &text[..cut], text.len()),
        None => text.to_string(),
    }
}

pub(super) fn base_name(q: &Quantizer) -> String {
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
        Quantizer::Int(s) | Quantizer::Hierarchical(s) => {
            match q {
                Quantizer::Hierarchical(_) => f.write_str("int8h")?,
                _ => write!(f, "int{}", s.bits)?,
            }
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
        Quantizer::LloydMax(s) => {
            write!(f, "lm{}", s.bits)?;
            scale(f, s.scale)
        }
        Quantizer::LowRank(s) => {
            match s.method {
                LowRankMethod::Pca(RankRule::Fixed(r)) => write!(f, "pca-r{r}")?,
                LowRankMethod::Pca(RankRule::Energy(e)) => {
                    write!(f, "pca-e{}", millionths(e))?;
                }
                LowRankMethod::Fd {
                    rank,
                    sketch,
                    chunk,
                    threshold,
                } => {
                    write!(f, "fd-r{rank}")?;
                    if sketch != 2 * rank {
                        write!(f, "-m{sketch}")?;
                    }
                    if chunk != DEFAULT_FD_CHUNK {
                        write!(f, "-l{chunk}")?;
                    }
                    if threshold != DEFAULT_FD_THRESHOLD {
                        write!(f, "-t{}", millionths(threshold))?;
                    }
                }
            }
            match s.coeffs {
                CoeffCode::F16 => {}
                CoeffCode::Int8 => f.write_str("-c8")?,
                CoeffCode::Int4 => f.write_str("-c4")?,
            }
            if s.pre_rope {
                f.write_str("-pre")?;
            }
            Ok(())
        }
        Quantizer::Shard(s) => {
            f.write_str("shard")?;
            if s.key_budget != DEFAULT_SHARD_KEY_BUDGET {
                write!(f, "-k{}", millionths(s.key_budget))?;
            }
            if s.group != DEFAULT_SHARD_GROUP {
                write!(f, "-g{}", s.group)?;
            }
            if let Some(r) = s.rank {
                write!(f, "-r{r}")?;
            }
            if s.values == ShardValues::Nf4 {
                f.write_str("-vnf4")?;
            }
            match s.stream {
                Some(DEFAULT_SHARD_STREAM) if !s.stream_qjl => {}
                Some(b) => write!(f, "-s{b}{}", if s.stream_qjl { "q" } else { "" })?,
                None => f.write_str("-soff")?,
            }
            if let Some(c) = s.fold {
                write!(f, "-f{c}")?;
            }
            if s.calibrated {
                f.write_str("-cal")?;
            }
            Ok(())
        }
        Quantizer::Vq(s) => {
            f.write_str(if s.coupled { "cq" } else { "vq" })?;
            if s.dim != DEFAULT_VQ_DIM {
                write!(f, "-d{}", s.dim)?;
            }
            if s.centroids != DEFAULT_VQ_CENTROIDS {
                write!(f, "-k{}", s.centroids)?;
            }
            if let Some(g) = s.gain_block {
                write!(f, "-g{g}")?;
            }
            if s.pre_rope {
                f.write_str("-pre")?;
            }
            scale(f, s.scale)
        }
    }
}

impl fmt::Display for CacheForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_quantizer(f, &self.quantizer)?;
        match (self.rotation, self.quantizer.needs_rotation()) {
            (Some(Rotation { block }), true) if block == DEFAULT_ROTATION_BLOCK => {}
            (
                Some(Rotation {
                    block: DEFAULT_ROTATION_BLOCK,
                }),
                false,
            ) => f.write_str("+rot")?,
            (Some(Rotation { block }), _) => write!(f, "+rot{block}")?,
            (None, _) => {}
        }
        if let Quantizer::LloydMax(LloydMaxSpec { qjl: true, .. }) = self.quantizer {
            f.write_str("+qjl")?;
        }
        let (sink, window) = match self.quantizer {
            Quantizer::Shard(_) => (DEFAULT_SHARD_SINK, DEFAULT_SHARD_WINDOW),
            _ => (0, 0),
        };
        if self.segments.sink != sink {
            write!(f, "+sink{}", self.segments.sink)?;
        }
        if self.segments.window != window {
            write!(f, "+win{}", self.segments.window)?;
        }
        if let Some(share) = self.sparse {
            let bp = share.basis_points();
            let text = format!("{}.{:02}", bp / 100, bp % 100);
            write!(
                f,
                "+out{}",
                text.trim_end_matches('0').trim_end_matches('.')
            )?;
            if share.clip() {
                f.write_str("+clip")?;
            }
            if share.pre_rope() {
                f.write_str("+pre")?;
            }
        }
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
            if p.metadata != MetaProtection::default_for(p.code) {
                f.write_str(match p.metadata {
                    MetaProtection::Unprotected => "+meta-none",
                    MetaProtection::Secded => "+meta-secded",
                    MetaProtection::ReedMuller => "+meta-rm",
                })?;
            }
        }
        Ok(())
    }
}

/// A share in millionths as its shortest decimal (`990000` → `0.99`).
fn millionths(m: u32) -> String {
    let text = format!("{}.{:06}", m / 1_000_000, m % 1_000_000);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Parses a share in (0, 1] or a positive decimal after a prefix
/// (`e0.99` → 990 000 millionths); `None` without the prefix.
fn share_after(s: &str, prefix: &str) -> Option<std::result::Result<u32, String>> {
    let digits = s.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    Some(match digits.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 4000.0 => Ok((v * 1e6).round() as u32),
        _ => Err(format!("{}: not a positive number", quote(s))),
    })
}

/// Parses the percentage of `+out<P>` (`1`, `0.5`, `0.25`: at most two
/// decimals, in (0, 20]) as basis points.
fn outlier_share(text: &str) -> std::result::Result<SparseSpec, String> {
    let bad = || {
        format!(
            "+out{}: the outlier share is a percentage in (0, 20] with at most two \
             decimals (+out1, +out0.5)",
            quote(text)
        )
    };
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || frac.len() > 2 || whole.len() > 3 {
        return Err(bad());
    }
    let whole: u16 = whole.parse().map_err(|_| bad())?;
    let frac: u16 = format!("{frac:0<2}").parse().map_err(|_| bad())?;
    let bp = whole
        .checked_mul(100)
        .and_then(|w| w.checked_add(frac))
        .ok_or_else(bad)?;
    SparseSpec::new(bp).map_err(|_| bad())
}

/// Parses the number after a prefix (`g64` → 64); `None` if `s` lacks the
/// prefix or is not followed by digits only.
fn number_after(s: &str, prefix: &str) -> Option<std::result::Result<usize, String>> {
    let digits = s.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(
        digits
            .parse::<usize>()
            .map_err(|_| format!("{}: number too large", quote(s)))
            .and_then(|n| {
                if n == 0 {
                    Err(format!("{s:?}: must be at least 1"))
                } else {
                    Ok(n)
                }
            }),
    )
}

/// Splits a base form into its head and `-` options, rejecting repeated options.
fn split_options(base: &str) -> std::result::Result<(&str, Vec<&str>), String> {
    let (head, options): (&str, Vec<&str>) = if let Some(rest) = base.strip_prefix("fp8-") {
        let mut parts = rest.split('-');
        let format = parts.next().unwrap_or_default();
        let head = match format {
            "e4m3" => "fp8-e4m3",
            "e5m2" => "fp8-e5m2",
            other => {
                return Err(format!(
                    "unknown FP8 format {:?} (e4m3 or e5m2)",
                    quote(other)
                ));
            }
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
            "sf16" => "sf32",
            // A shard stream's bits, with or without QJL, or off: one option.
            "soff" => "s",
            _ if is_qjl_stream(o) => "s",
            k => k,
        };
        if !seen.insert(key) {
            return Err(format!("option -{key} given twice"));
        }
    }
    Ok((head, options))
}

fn parse_scale(o: &str) -> Option<ScaleType> {
    match o {
        "sf32" => Some(ScaleType::F32),
        "sf16" => Some(ScaleType::F16),
        _ => None,
    }
}

fn parse_quantizer(base: &str) -> std::result::Result<Quantizer, String> {
    let (head, options) = split_options(base)?;
    let no_options = |name: &str| {
        if options.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{name} takes no options, found -{}",
                quote(&options.join("-"))
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
                    None => return Err(format!("unknown FP8 option -{} (-h<N>, -tok)", quote(o))),
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
                if let Some(s) = parse_scale(o) {
                    spec.scale = s;
                } else if let Some(g) = number_after(o, "g") {
                    spec.group = g?;
                } else {
                    return Err(format!("unknown NF4 option -{} (-g<N>, -sf32)", quote(o)));
                }
            }
            Ok(Quantizer::Nf4(spec))
        }
        "pca" | "fd" => parse_low_rank(head, &options),
        "shard" => parse_shard(&options),
        "vq" | "cq" => {
            let mut spec = VqSpec {
                dim: DEFAULT_VQ_DIM,
                centroids: DEFAULT_VQ_CENTROIDS,
                scale: ScaleType::F16,
                coupled: head == "cq",
                gain_block: None,
                pre_rope: false,
            };
            for o in options {
                if let Some(s) = parse_scale(o) {
                    spec.scale = s;
                } else if let Some(d) = number_after(o, "d") {
                    spec.dim = d?;
                } else if let Some(k) = number_after(o, "k") {
                    spec.centroids = k?;
                } else if let Some(g) = number_after(o, "g").filter(|_| spec.coupled) {
                    spec.gain_block = Some(g?);
                } else if o == "pre" && spec.coupled {
                    spec.pre_rope = true;
                } else {
                    return Err(format!(
                        "unknown {head} option -{} (-d<D>, -k<K>, {}-sf32)",
                        quote(o),
                        if spec.coupled { "-g<N>, -pre, " } else { "" }
                    ));
                }
            }
            Ok(Quantizer::Vq(spec))
        }
        _ if head.starts_with("lm") => {
            let bits = match number_after(head, "lm") {
                Some(b) => b?,
                None => return Err(format!("unknown base form {:?}", quote(head))),
            };
            let Some(bits) = u8::try_from(bits).ok().filter(|b| *b <= 8) else {
                return Err(format!("lm{bits} is not supported (1 to 8 bits)"));
            };
            let mut spec = LloydMaxSpec {
                bits,
                qjl: false,
                scale: ScaleType::F16,
            };
            for o in options {
                match parse_scale(o) {
                    Some(s) => spec.scale = s,
                    None => return Err(format!("unknown Lloyd-Max option -{} (-sf32)", quote(o))),
                }
            }
            Ok(Quantizer::LloydMax(spec))
        }
        _ => {
            // `int8h`: INT8-class values as two 4-bit planes, each spelled
            // with the options of the `int4` form its planes are.
            let (bits, hierarchical) = match head {
                "int2" => (2, false),
                "int3" => (3, false),
                "int4" => (4, false),
                "int8" => (8, false),
                "int8h" => (4, true),
                other => return Err(format!("unknown base form {:?}", quote(other))),
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
                    "t" => set_granularity(Granularity::PerTensor)?,
                    "ch" => set_granularity(Granularity::PerChannel { tokens: None })?,
                    _ => {
                        if let Some(s) = parse_scale(o) {
                            spec.scale = s;
                        } else if let Some(g) = number_after(o, "g") {
                            set_granularity(Granularity::PerToken { group: Some(g?) })?;
                        } else if let Some(t) = number_after(o, "ch") {
                            set_granularity(Granularity::PerChannel { tokens: Some(t?) })?;
                        } else {
                            return Err(format!(
                                "unknown integer option -{} (-sym, -g<N>, -ch, -ch<N>, -t, -sf32)",
                                quote(o)
                            ));
                        }
                    }
                }
            }
            Ok(if hierarchical {
                Quantizer::Hierarchical(spec)
            } else {
                Quantizer::Int(spec)
            })
        }
    }
}

fn parse_low_rank(head: &str, options: &[&str]) -> std::result::Result<Quantizer, String> {
    let (mut rank, mut energy, mut sketch, mut chunk, mut threshold) =
        (None, None, None, None, None);
    let (mut coeffs, mut pre_rope) = (CoeffCode::F16, false);
    for &o in options {
        match o {
            "c16" => coeffs = CoeffCode::F16,
            "c8" => coeffs = CoeffCode::Int8,
            "c4" => coeffs = CoeffCode::Int4,
            "pre" => pre_rope = true,
            _ => {
                if let Some(r) = number_after(o, "r") {
                    rank = Some(r?);
                } else if let (Some(e), "pca") = (share_after(o, "e"), head) {
                    energy = Some(e?);
                } else if let (Some(m), "fd") = (number_after(o, "m"), head) {
                    sketch = Some(m?);
                } else if let (Some(l), "fd") = (number_after(o, "l"), head) {
                    chunk = Some(l?);
                } else if let (Some(t), "fd") = (share_after(o, "t"), head) {
                    threshold = Some(t?);
                } else {
                    return Err(format!(
                        "unknown {head} option -{} ({})",
                        quote(o),
                        if head == "pca" {
                            "-r<R> or -e<E>, -c16, -c8, -c4, -pre"
                        } else {
                            "-r<R>, -m<M>, -l<L>, -t<T>, -c16, -c8, -c4, -pre"
                        }
                    ));
                }
            }
        }
    }
    let method = match (head, rank, energy) {
        ("pca", Some(r), None) => LowRankMethod::Pca(RankRule::Fixed(r)),
        ("pca", None, Some(e)) => LowRankMethod::Pca(RankRule::Energy(e)),
        ("pca", _, _) => {
            return Err("pca takes one of -r<R> (a rank) or -e<E> (retained energy)".into());
        }
        (_, Some(r), _) => LowRankMethod::Fd {
            rank: r,
            sketch: sketch.unwrap_or(2 * r),
            chunk: chunk.unwrap_or(DEFAULT_FD_CHUNK),
            threshold: threshold.unwrap_or(DEFAULT_FD_THRESHOLD),
        },
        _ => return Err("fd needs -r<R> (the rank of each chunk)".into()),
    };
    Ok(Quantizer::LowRank(LowRankSpec {
        method,
        coeffs,
        pre_rope,
    }))
}

/// `s<digits>q`: a shard stream with a QJL sketch.
fn is_qjl_stream(o: &str) -> bool {
    o.strip_prefix('s')
        .and_then(|r| r.strip_suffix('q'))
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_shard(options: &[&str]) -> std::result::Result<Quantizer, String> {
    let mut spec = ShardSpec::default();
    for &o in options {
        match o {
            "vnf4" => spec.values = ShardValues::Nf4,
            "vvq" => spec.values = ShardValues::Vq,
            "soff" => spec.stream = None,
            "cal" => spec.calibrated = true,
            _ => {
                if let Some(k) = share_after(o, "k") {
                    spec.key_budget = k?;
                } else if let Some(g) = number_after(o, "g") {
                    spec.group = g?;
                } else if let Some(r) = number_after(o, "r") {
                    spec.rank = Some(r?);
                } else if let Some(c) = number_after(o, "f") {
                    spec.fold = Some(c?);
                } else if let Some(b) =
                    number_after(o, "s").or_else(|| number_after(o.strip_suffix('q')?, "s"))
                {
                    let b =
                        b.map_err(|_| format!("{}: must be -s1 to -s8 (-s1q to -s7q)", quote(o)))?;
                    spec.stream_qjl = o.ends_with('q');
                    spec.stream = Some(
                        u8::try_from(b)
                            .map_err(|_| format!("a decode stream of {b} bits (1 to 8)"))?,
                    );
                } else {
                    return Err(format!(
                        "unknown shard option -{} (-k<bits>, -g<G>, -r<R>, -vnf4, -s<bits>[q], -soff, -f<C>, -cal)",
                        quote(o)
                    ));
                }
            }
        }
    }
    Ok(Quantizer::Shard(spec))
}

/// The suffixes of one spelling, each at most once.
#[derive(Default)]
struct Suffixes {
    rotation: Option<Rotation>,
    qjl: bool,
    sink: Option<usize>,
    window: Option<usize>,
    sparse: Option<SparseSpec>,
    clip: bool,
    pre_rope: bool,
    code: Option<Int4Code>,
    policy: Option<ErasurePolicy>,
    metadata: Option<MetaProtection>,
}

fn once<T>(slot: &mut Option<T>, value: T, what: &str) -> std::result::Result<(), String> {
    if slot.replace(value).is_some() {
        Err(format!("more than one {what}"))
    } else {
        Ok(())
    }
}

impl Suffixes {
    fn add(&mut self, part: &str) -> std::result::Result<(), String> {
        if let Ok(c) = part.parse::<Int4Code>() {
            return once(&mut self.code, c, "code");
        }
        if part == "rot" {
            let r = Rotation {
                block: DEFAULT_ROTATION_BLOCK,
            };
            return once(&mut self.rotation, r, "rotation");
        }
        if let Some(n) = number_after(part, "rot") {
            return once(&mut self.rotation, Rotation { block: n? }, "rotation");
        }
        if part == "qjl" {
            if std::mem::replace(&mut self.qjl, true) {
                return Err("more than one +qjl".into());
            }
            return Ok(());
        }
        if let Some(s) = number_after(part, "sink") {
            return once(&mut self.sink, s?, "+sink");
        }
        if let Some(w) = number_after(part, "win") {
            return once(&mut self.window, w?, "+win");
        }
        for (name, flag) in [("clip", &mut self.clip), ("pre", &mut self.pre_rope)] {
            if part == name {
                if std::mem::replace(flag, true) {
                    return Err(format!("more than one +{name}"));
                }
                return Ok(());
            }
        }
        if let Some(p) = part.strip_prefix("out") {
            return once(&mut self.sparse, outlier_share(p)?, "+out");
        }
        let policy = match part {
            "keep" => Some(ErasurePolicy::Keep),
            "zero" => Some(ErasurePolicy::Zero),
            "interp" => Some(ErasurePolicy::Interpolate {
                reach: DEFAULT_INTERP_REACH,
            }),
            _ => match number_after(part, "interp") {
                Some(r) => {
                    let r = r?;
                    let reach = u32::try_from(r)
                        .map_err(|_| format!("interpolation reach {r} too large"))?;
                    Some(ErasurePolicy::Interpolate { reach })
                }
                None => None,
            },
        };
        if let Some(p) = policy {
            if self.code.is_none() {
                return Err(format!("+{part} needs a code before it"));
            }
            return once(&mut self.policy, p, "erasure policy");
        }
        let m = match part {
            "meta-none" => MetaProtection::Unprotected,
            "meta-secded" => MetaProtection::Secded,
            "meta-rm" => MetaProtection::ReedMuller,
            other => return Err(format!("unknown suffix +{}", quote(other))),
        };
        if self.code.is_none() {
            return Err(format!("+{part} needs a code before it"));
        }
        once(&mut self.metadata, m, "metadata protection")
    }
}

impl FromStr for CacheForm {
    type Err = KvQuantError;

    fn from_str(text: &str) -> Result<Self> {
        let err = |reason: String| KvQuantError::InvalidSpec {
            spec: quote(text),
            reason,
        };
        let mut parts = text.trim().split('+');
        let base = parts.next().unwrap_or_default();
        let mut quantizer = parse_quantizer(base).map_err(err)?;
        let mut suffixes = Suffixes::default();
        for part in parts {
            suffixes.add(part).map_err(err)?;
        }
        if suffixes.qjl {
            match &mut quantizer {
                Quantizer::LloydMax(s) => s.qjl = true,
                other => {
                    return Err(err(format!(
                        "+qjl sketches the residual of a Lloyd-Max form (lm1..lm8), not {}",
                        base_name(other)
                    )));
                }
            }
        }
        let rotation = suffixes
            .rotation
            .or(quantizer.needs_rotation().then_some(Rotation {
                block: DEFAULT_ROTATION_BLOCK,
            }));
        let protection = suffixes.code.map(|code| Protection {
            code,
            policy: suffixes.policy.unwrap_or(ErasurePolicy::Keep),
            metadata: suffixes
                .metadata
                .unwrap_or(MetaProtection::default_for(code)),
        });
        let (sink, window) = match quantizer {
            Quantizer::Shard(_) => (DEFAULT_SHARD_SINK, DEFAULT_SHARD_WINDOW),
            _ => (0, 0),
        };
        let segments = Segments {
            sink: suffixes.sink.unwrap_or(sink),
            window: suffixes.window.unwrap_or(window),
        };
        let form = CacheForm {
            quantizer,
            rotation,
            segments,
            protection,
            sparse: match (suffixes.sparse, suffixes.clip, suffixes.pre_rope) {
                (Some(s), clip, pre) => Some(s.with_clip(clip).with_pre_rope(pre)),
                (None, false, false) => None,
                (None, ..) => {
                    return Err(err("+clip and +pre are options of a form sealed with \
                                    sparse outliers: spell +out<P>+clip, +out<P>+pre"
                        .into()));
                }
            },
        };
        form.validate().map_err(err)?;
        Ok(form)
    }
}
