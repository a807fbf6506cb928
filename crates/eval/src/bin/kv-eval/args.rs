//! The flags several commands share: the cache forms (`--form`,
//! `--key-form`, `--value-form`, `--layer-forms`), the backend and its
//! numerics, the fault target.

use clap::ValueEnum;
use kv_eval::backend::BackendKind;
use kv_eval::cache::{CacheMode, FaultSpec};
use kv_quant::{CacheForm, FaultTarget, LayerForms};

use crate::Error;

/// Which form each layer's keys and values are stored in.
#[derive(clap::Args, Clone)]
pub(crate) struct Forms {
    /// Cache form of keys and values (kv-quant spelling: fp32, fp16, int8,
    /// int4, int4-ch, int4+rot, lm4, vq, int4+secded84+interp,
    /// int4-ch32+win32, ...) or `plain` for the unstored f32 pass.
    #[arg(long, default_value = "plain")]
    pub(crate) form: String,
    /// Form of the keys (default: --form).
    #[arg(long)]
    pub(crate) key_form: Option<String>,
    /// Form of the values (default: --form).
    #[arg(long)]
    pub(crate) value_form: Option<String>,
    /// Per-layer forms, `LAYERS:FORM[/VALUE_FORM];...` (`0,last:fp16;*:int4`);
    /// layers without a rule take --key-form/--value-form.
    #[arg(long)]
    pub(crate) layer_forms: Option<String>,
}

/// The KV backend a run uses.
#[derive(clap::Args, Clone, Copy)]
pub(crate) struct BackendArgs {
    /// KV backend: `auto` (paged where it holds the forms and no per-call
    /// faults are asked for, reencode otherwise), `reencode` (the paper's
    /// protocol: each forward call quantises, encodes and faults the whole
    /// window), `paged` (each token encoded once, when written, into a paged
    /// block) or `dense` (f32 rows, `plain` only).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub(crate) backend: Backend,
    /// Tokens per block of the paged backend.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_size: usize,
    /// How attention scores integer-coded keys: `exact` (f32, the
    /// evaluation's reference: every published table uses it), `auto`
    /// (the attention crate's default: `int8` for 4-bit affine levels in
    /// whole-row per-token groups, per-channel values in blocks of 16 to
    /// 128 tokens and per-channel keys in blocks of 32 to 128, exact for
    /// every other),
    /// `int8` (int8-quantized queries, integer dot products) or `int16`
    /// (16-bit query codes as two int8 halves) [default: exact].
    #[arg(long, value_enum)]
    pub(crate) numerics: Option<NumericsArg>,
    /// Instruction set of attention's kernels: `scalar`, `avx2`, `avx512`
    /// or `avx512-vnni` (one this CPU lacks is refused) [default: the
    /// fastest this CPU runs]. The vector sets give the same bits.
    #[arg(long, value_parser = parse_isa)]
    pub(crate) isa: Option<attention::Isa>,
}

/// `--isa`, as [`attention::Isa`] spells it: refused at parse time, before
/// the model loads, where the name is unknown or this CPU lacks the set.
pub(crate) fn parse_isa(s: &str) -> Result<attention::Isa, String> {
    let isa: attention::Isa = s
        .parse()
        .map_err(|e: attention::AttentionError| e.to_string())?;
    isa.ensure_supported().map_err(|e| e.to_string())?;
    Ok(isa)
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum NumericsArg {
    Exact,
    Auto,
    Int8,
    Int16,
}

impl NumericsArg {
    pub(crate) fn numerics(self) -> attention::Numerics {
        match self {
            Self::Exact => attention::Numerics::Exact,
            Self::Auto => attention::Numerics::Auto,
            Self::Int8 => attention::Numerics::Int8Query,
            Self::Int16 => attention::Numerics::Int16Query,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Backend {
    Auto,
    Dense,
    Reencode,
    Paged,
}

impl BackendArgs {
    /// The backend for `mode` and `faults` (which `auto` chooses by).
    pub(crate) fn kind(self, mode: &CacheMode, faults: Option<FaultSpec>) -> BackendKind {
        let paged = BackendKind::Paged {
            block_size: self.block_size,
        };
        match self.backend {
            Backend::Auto => BackendKind::auto(mode, faults, self.block_size),
            Backend::Dense => BackendKind::Dense,
            Backend::Reencode => BackendKind::Reencode,
            Backend::Paged => paged,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Target {
    Values,
    Metadata,
    Everything,
}

impl From<Target> for FaultTarget {
    fn from(t: Target) -> Self {
        match t {
            Target::Values => FaultTarget::Values,
            Target::Metadata => FaultTarget::Metadata,
            Target::Everything => FaultTarget::Everything,
        }
    }
}

/// The cache mode the form flags name (no model needed).
pub(crate) fn mode_of(forms: &Forms) -> Result<CacheMode, Error> {
    let base = CacheMode::parse(&forms.form)?;
    if forms.key_form.is_none() && forms.value_form.is_none() && forms.layer_forms.is_none() {
        return Ok(base);
    }
    let part = |flag: &str, text: &Option<String>| -> Result<Option<CacheForm>, Error> {
        match text.as_deref().unwrap_or(&forms.form) {
            "plain" if text.is_some() || forms.layer_forms.is_none() => Err(format!(
                "{flag} plain: one part cannot stay unstored while the other is stored; use fp32"
            )
            .into()),
            "plain" => Ok(None),
            f => Ok(Some(f.parse()?)),
        }
    };
    let (key, value) = (
        part("--key-form", &forms.key_form)?,
        part("--value-form", &forms.value_form)?,
    );
    let Some(layers) = &forms.layer_forms else {
        let (Some(k), Some(v)) = (key, value) else {
            return Err("give --key-form and --value-form (or --form) a stored form".into());
        };
        return Ok(CacheMode::key_value(k, v));
    };
    let mut spec = layers.clone();
    if let (Some(k), Some(v)) = (key, value)
        && !spec.split(';').any(|r| r.trim_start().starts_with('*'))
    {
        spec.push_str(&format!(";*:{k}/{v}"));
    }
    Ok(CacheMode::layered(spec.parse::<LayerForms>()?, None))
}

/// Token eviction at the end of each window's prompt (SnapKV).
#[derive(clap::Args, Clone)]
pub(crate) struct EvictArgs {
    /// Evict tokens after each window's unscored prefix, keeping this share
    /// of them per key head (SnapKV: the prefix's last --evict-window
    /// queries vote, pooled over --evict-pool positions); comma-separated
    /// shares in `frontier` run each configuration at each. Paged and
    /// dense backends; forms coded after RoPE.
    #[arg(long, value_delimiter = ',')]
    pub(crate) evict: Vec<f64>,
    /// Queries of the observation window that vote (and are kept whole).
    #[arg(long, default_value_t = 32)]
    pub(crate) evict_window: usize,
    /// Positions the votes are max-pooled over (odd).
    #[arg(long, default_value_t = 7)]
    pub(crate) evict_pool: usize,
    /// The prefix's first tokens every key head keeps before any voted one
    /// (attention sinks: with a `+sink<S>` form, S puts the true sinks in
    /// its exact slots); 0 keeps SnapKV's rule.
    #[arg(long, default_value_t = 0)]
    pub(crate) evict_sinks: usize,
}

impl EvictArgs {
    /// One policy per --evict share, or `[None]` without the flag;
    /// refused before any work where a parameter is out of its domain.
    pub(crate) fn policies(&self) -> Result<Vec<Option<attention::SnapKv>>, Error> {
        if self.evict.is_empty() {
            return Ok(vec![None]);
        }
        self.evict
            .iter()
            .map(|&keep| {
                attention::SnapKv::new(keep, self.evict_window, self.evict_pool)
                    .map(|p| Some(p.with_sinks(self.evict_sinks)))
                    .map_err(|e| format!("--evict: {e}").into())
            })
            .collect()
    }

    /// The one policy of a command that runs one configuration.
    pub(crate) fn policy(&self) -> Result<Option<attention::SnapKv>, Error> {
        match self.policies()?.as_slice() {
            [one] => Ok(*one),
            many => Err(format!("--evict takes one share here, got {}", many.len()).into()),
        }
    }
}
