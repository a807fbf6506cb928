//! Calibration: what the data-dependent cache forms fit on a text disjoint
//! from the evaluation text, and the file that carries it.
//!
//! [`Calibration::fit`] runs the plain model over the calibration tokens in
//! windows, collects every layer's key and value rows (keys after RoPE, as
//! the cache stores them, and rotated back for forms that project before
//! RoPE), and fits, per layer and part, a [`VqCodebook`] for each `vq` form
//! and a PCA [`Basis`] per KV head for each `pca-*` form asked for, and
//! the tables of each calibrated Shard form (`shard-*-cal`).
//!
//! # File format
//! A safetensors file. Each codebook is an F32 tensor named
//! `vq/<form>/<layer>/<k|v>` of shape `[blocks, centroids, dim]` (the
//! centroids as stored, f16 values held exactly in f32), where `<form>` is
//! the codebook's shape as a form spelling (`vq+rot` for 256 centroids of 4
//! channels over 64-channel blocks; protection, segments and the gain's
//! storage type do not change a codebook). Each PCA basis is two F32
//! tensors, `pca/<form>/<layer>/<k|v>/<head>/rows` (`[rank, head_dim]`, the
//! f16 values as stored) and `.../mean` (`[head_dim]`), `<form>` being the
//! basis' shape (`pca-r32`, `pca-e0.99`, `pca-r32-pre` for keys projected
//! before RoPE). Every table carries a U8 tensor of check words beside it
//! (`vq/<form>/<layer>/<k|v>/check`, `pca/.../<head>/check`): the
//! Reed-Muller RM(2,5) check bytes of each 16-bit word of the table as
//! stored (kv-quant's `ProtectedTable`: the codebook's f16 centroids; the
//! basis' f16 rows, then its mean). A calibrated Shard form's tables are
//! its key basis (`pca/<form's basis shape>/<layer>/k/0`, int8 rows with
//! their scales, as the form stores it), the bit allocation fitted on the
//! calibration keys over that basis' groups (U8 `shard/<form>/<layer>/k/allocation`,
//! bits per group) and the value codebook (F32 `shard/<form>/<layer>/v/centroids`,
//! `[256, 4]`, f16 values; none under `-vnf4`), each with its check words;
//! the metadata then holds `shard_head_dim`, the heads the codebook's
//! rotation works in. The header metadata holds
//! `format` (`reliable-kv calibration 2`), `model` (the model's one-line
//! description), `layers`, `kv_channels`, `text` and `tokens` (where the
//! rows came from). Loading checks the format, every tensor's shape, that
//! every value is the f16 it was stored as and every word passes its
//! check (a file changed after it was written is refused, naming the
//! word), and that the file was fitted for a model of the same shape.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use attention::stored::ShardTables;
use kv_lowrank::{Basis, BasisStorage, HeadBases, ShardKeys};
use kv_quant::{
    CacheForm, ChannelVq, CoeffCode, FitOptions, LowRankSpec, Quantizer, Segments, TableBytes,
    VqCodebook,
};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::cache::{CacheMode, KvCache};

mod shard_file;
use crate::error::{EvalError, Result};
use kv_model::model::CausalLm;
use shard_file::{f16_bytes, shard_tables_of};

/// The format tag of calibration files.
pub const FORMAT: &str = "reliable-kv calibration 2";

/// The code of the check words beside each table in a calibration file.
const CHECK_CODE: kv_quant::MetaProtection = kv_quant::MetaProtection::ReedMuller;

/// The check bytes of a table's stored bytes under [`CHECK_CODE`].
fn table_checks(bytes: &[u8]) -> Vec<u8> {
    kv_quant::ProtectedTable::new(bytes, CHECK_CODE)
        .check_bytes()
        .to_vec()
}

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// The key cache.
    Key,
    /// The value cache.
    Value,
}

impl Part {
    /// `k` or `v`, as in tensor names.
    pub fn tag(self) -> &'static str {
        match self {
            Part::Key => "k",
            Part::Value => "v",
        }
    }

    /// `key` or `value`.
    pub fn name(self) -> &'static str {
        match self {
            Part::Key => "key",
            Part::Value => "value",
        }
    }
}

/// A malformed calibration file, found by the safetensors crate.
fn st_err(context: impl Into<String>) -> impl FnOnce(safetensors::SafeTensorError) -> EvalError {
    let context = context.into();
    move |source| EvalError::Safetensors {
        context,
        source: Some(source),
    }
}

/// The codebook shape of a `vq` or `cq` form, as a form spelling (`vq+rot`,
/// `vq-d2-k16+rot128`, `cq-d2-k16`): what two forms must share to share a
/// codebook.
pub fn codebook_shape(form: &CacheForm) -> Option<String> {
    let Quantizer::Vq(mut spec) = *form.quantizer() else {
        return None;
    };
    spec.scale = kv_quant::ScaleType::F16;
    let shape = CacheForm::build(
        Quantizer::Vq(spec),
        form.rotation(),
        Segments::default(),
        None,
    )
    .expect("a valid form's codebook shape is valid");
    Some(shape.to_string())
}

/// The name a calibrated Shard form's tables are kept under: its spelling
/// without its code (a code protects the tables and blocks as stored, it
/// does not change what is fitted), so a file calibrated for
/// `shard-k3-cal` serves `shard-k3-cal+secded84`.
fn shard_key(form: &CacheForm) -> String {
    form.with_protection(None)
        .map_or_else(|_| form.to_string(), |f| f.to_string())
}

/// The basis shape of a `pca-*` form for one part, as a form spelling
/// (`pca-r32`, `pca-e0.99`, `pca-r32-pre`): what two forms must share to
/// share bases. Coefficient codes and protection do not change a basis; the
/// values have no RoPE, so `-pre` is dropped for them.
pub fn basis_shape(form: &CacheForm, part: Part) -> Option<String> {
    if let Quantizer::Shard(spec) = *form.quantizer() {
        // One key basis per layer over all KV heads; its rank and groups
        // are what two forms must share.
        if !(spec.calibrated && part == Part::Key) {
            return None;
        }
        let shape = kv_quant::ShardSpec {
            rank: spec.rank,
            group: spec.group,
            calibrated: true,
            ..Default::default()
        };
        let f = CacheForm::build(
            Quantizer::Shard(shape),
            None,
            Segments {
                sink: kv_quant::spec::DEFAULT_SHARD_SINK,
                window: kv_quant::spec::DEFAULT_SHARD_WINDOW,
            },
            None,
        )
        .expect("a valid form's basis shape is valid");
        return Some(f.to_string());
    }
    let Quantizer::LowRank(spec) = *form.quantizer() else {
        return None;
    };
    if !form.quantizer().needs_bases() {
        return None;
    }
    let shape = LowRankSpec {
        coeffs: CoeffCode::F16,
        pre_rope: spec.pre_rope && part == Part::Key,
        ..spec
    };
    let f = CacheForm::new(Quantizer::LowRank(shape), None)
        .expect("a valid form's basis shape is valid");
    Some(f.to_string())
}

/// The rows and mean of one stored basis, as they are read.
type BasisParts = (Option<Vec<f32>>, Option<Vec<f32>>);

/// Fitted data of one model shape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    /// The model's description when fitted.
    pub model: String,
    /// Layers of the model.
    pub layers: usize,
    /// K (or V) channels per token of the model.
    pub kv_channels: usize,
    /// Where the rows came from (file name) and how many tokens.
    pub text: String,
    /// Calibration tokens used.
    pub tokens: usize,
    codebooks: BTreeMap<(String, usize, Part), Arc<VqCodebook>>,
    bases: BTreeMap<(String, usize, Part), Arc<HeadBases>>,
    /// Per calibrated Shard form and layer: the tables of keys on its basis
    /// (the bit allocation fitted on the calibration keys) and the value
    /// codebook, what a paged Shard cache codes every block on.
    shard: BTreeMap<(String, usize), ShardPrototypes>,
}

/// The tables a calibrated Shard form's paged blocks are coded on, for one
/// layer: keys on the calibrated basis with the allocation fitted on the
/// calibration keys, and the values' codebook (`None` under `-vnf4`).
type ShardPrototypes = (Arc<ShardKeys>, Option<Arc<ChannelVq>>);

/// Every layer's key and value rows over the calibration tokens.
pub struct CalibrationRows {
    /// Per layer: keys then values, `tokens × kv_channels` each.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
    /// The position of every row in its window (for undoing RoPE).
    pub positions: Vec<usize>,
    /// Tokens collected.
    pub tokens: usize,
    /// Channels per row.
    pub channels: usize,
}

impl CalibrationRows {
    /// Runs `model` over `tokens` in windows of `ctx` (the last one may be
    /// shorter) and keeps every layer's key and value rows.
    pub fn collect(model: &dyn CausalLm, tokens: &[u32], ctx: usize) -> Result<Self> {
        if ctx == 0 || tokens.is_empty() {
            return Err(EvalError::InvalidParameter {
                name: "calibration tokens",
                reason: format!(
                    "{} tokens in windows of {ctx} collect nothing",
                    tokens.len()
                ),
            });
        }
        let (layers, channels) = (model.layers(), model.kv_channels());
        let mut rows = vec![(Vec::new(), Vec::new()); layers];
        let mut positions = Vec::with_capacity(tokens.len());
        for window in tokens.chunks(ctx) {
            positions.extend(0..window.len());
            let mut cache = KvCache::new(CacheMode::Plain, None, 0)?;
            model.forward(window, &mut cache, window.len() - 1)?;
            for (l, (k, v)) in rows.iter_mut().enumerate() {
                let (ck, cv) = cache.plain_rows(l).expect("a plain cache holds its rows");
                k.extend_from_slice(ck);
                v.extend_from_slice(cv);
            }
        }
        Ok(Self {
            layers: rows,
            positions,
            tokens: tokens.len(),
            channels,
        })
    }

    /// The rows of head `h` of a layer part (`tokens × head_dim`), keys
    /// rotated back to before RoPE when `unrotate` holds `model`'s rope.
    pub fn head_rows(
        &self,
        layer: usize,
        part: Part,
        head: usize,
        head_dim: usize,
        unrotate: Option<&attention::Rope>,
    ) -> Result<Vec<f32>> {
        let (k, v) = &self.layers[layer];
        let data = if part == Part::Key { k } else { v };
        let mut out = Vec::with_capacity(self.tokens * head_dim);
        let mut row = vec![0f32; self.channels];
        for (t, r) in data.chunks_exact(self.channels).enumerate() {
            row.copy_from_slice(r);
            if let Some(rope) = unrotate {
                rope.undo(&mut row, self.positions[t])?;
            }
            out.extend_from_slice(&row[head * head_dim..][..head_dim]);
        }
        Ok(out)
    }
}

impl CalibrationRows {
    /// A layer's keys as a pair codebook of `form` (`cq-d2-pre`) codes
    /// them: rotated back to position 0, each rotated pair's channels side
    /// by side (attention's `RopePairPart` codes the same rows). Values
    /// carry no RoPE and are refused, and so is a model without one.
    fn pair_ordered_keys(
        &self,
        model: &dyn CausalLm,
        form: &CacheForm,
        layer: usize,
        part: Part,
    ) -> Result<Vec<f32>> {
        let refuse = |reason: String| EvalError::InvalidParameter {
            name: "form",
            reason,
        };
        if part != Part::Key {
            return Err(refuse(format!(
                "{form} codes keys before RoPE; values carry no RoPE (drop -pre from the \
                 value form)"
            )));
        }
        let rope = model.rope().ok_or_else(|| {
            refuse(format!(
                "{form} codes keys before RoPE; {} has none",
                model.describe()
            ))
        })?;
        let mut data = self.head_rows(layer, Part::Key, 0, self.channels, Some(rope))?;
        rope.to_pair_order(&mut data, &mut Vec::new());
        Ok(data)
    }
}

impl Calibration {
    /// Fits a codebook per layer for every `(form, part)` whose form is a
    /// `vq` form (other forms need nothing) on `rows`.
    pub fn fit(
        model: &dyn CausalLm,
        rows: &CalibrationRows,
        text: &str,
        needs: &[(CacheForm, Part)],
        options: FitOptions,
    ) -> Result<Self> {
        let mut shapes: HashMap<(String, Part), CacheForm> = HashMap::new();
        for (f, part) in needs {
            if let Some(shape) = codebook_shape(f) {
                shapes.entry((shape, *part)).or_insert(*f);
            }
        }
        let jobs: Vec<(String, CacheForm, usize, Part)> = shapes
            .iter()
            .flat_map(|((shape, part), form)| {
                (0..rows.layers.len()).map(move |l| (shape.clone(), *form, l, *part))
            })
            .collect();
        let fitted: Vec<((String, usize, Part), Arc<VqCodebook>)> = jobs
            .into_par_iter()
            .map(|(shape, form, l, part)| {
                let (k, v) = &rows.layers[l];
                let cb = if form.codes_before_rope() {
                    let data = rows.pair_ordered_keys(model, &form, l, part)?;
                    VqCodebook::fit(&form, &data, rows.tokens, rows.channels, options)?
                } else {
                    let data = if part == Part::Key { k } else { v };
                    VqCodebook::fit(&form, data, rows.tokens, rows.channels, options)?
                };
                Ok(((shape, l, part), Arc::new(cb)))
            })
            .collect::<Result<_>>()?;
        let mut basis_jobs: Vec<(String, CacheForm, usize, Part)> = Vec::new();
        for (f, part) in needs {
            if let Some(shape) = basis_shape(f, *part) {
                for l in 0..rows.layers.len() {
                    let job = (shape.clone(), *f, l, *part);
                    if !basis_jobs
                        .iter()
                        .any(|j| j.0 == job.0 && j.2 == l && j.3 == *part)
                    {
                        basis_jobs.push(job);
                    }
                }
            }
        }
        let head_dim = model.head_dim();
        let heads = model.kv_channels() / head_dim;
        let bases: Vec<((String, usize, Part), Arc<HeadBases>)> = basis_jobs
            .into_par_iter()
            .map(|(shape, form, l, part)| {
                if let Quantizer::Shard(spec) = *form.quantizer() {
                    // All KV heads' keys, RoPE undone, as one row per token.
                    let ch = rows.channels;
                    let data = rows.head_rows(l, Part::Key, 0, ch, model.rope())?;
                    let rank = spec
                        .rank
                        .unwrap_or(ch)
                        .min(rows.tokens.saturating_sub(1) / 4 * 4);
                    let (b, _) = Basis::fit(
                        &data,
                        rows.tokens,
                        ch,
                        kv_quant::RankRule::Fixed(rank.max(4)),
                        BasisStorage::Int8,
                    )?;
                    let heads = vec![Arc::new(b)];
                    return Ok(((shape, l, part), Arc::new(HeadBases { heads })));
                }
                let Quantizer::LowRank(spec) = *form.quantizer() else {
                    unreachable!("basis shapes come from low-rank and shard forms")
                };
                let kv_quant::LowRankMethod::Pca(rule) = spec.method else {
                    unreachable!("bases are fitted for pca forms")
                };
                let rope = (spec.pre_rope && part == Part::Key)
                    .then(|| model.rope())
                    .flatten();
                let heads = (0..heads)
                    .map(|h| {
                        let data = rows.head_rows(l, part, h, head_dim, rope)?;
                        let (b, _) =
                            Basis::fit(&data, rows.tokens, head_dim, rule, BasisStorage::F16)?;
                        Ok(Arc::new(b))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(((shape, l, part), Arc::new(HeadBases { heads })))
            })
            .collect::<Result<_>>()?;
        let bases: BTreeMap<(String, usize, Part), Arc<HeadBases>> = bases.into_iter().collect();
        let shard = Self::fit_shard(model, rows, needs, &bases)?;
        Ok(Self {
            model: model.describe(),
            layers: model.layers(),
            kv_channels: model.kv_channels(),
            text: text.to_string(),
            tokens: rows.tokens,
            codebooks: fitted.into_iter().collect(),
            bases,
            shard,
        })
    }

    /// For every calibrated Shard form in `needs` and every layer: the
    /// calibration keys (RoPE undone) stored on the form's fitted basis,
    /// which fits the bit allocation, and the value codebook fitted on the
    /// calibration values (as `ShardLayer` fits them on a prefill).
    fn fit_shard(
        model: &dyn CausalLm,
        rows: &CalibrationRows,
        needs: &[(CacheForm, Part)],
        bases: &BTreeMap<(String, usize, Part), Arc<HeadBases>>,
    ) -> Result<BTreeMap<(String, usize), ShardPrototypes>> {
        let mut forms: Vec<CacheForm> = Vec::new();
        for (f, _) in needs {
            if matches!(f.quantizer(), Quantizer::Shard(s) if s.calibrated) && !forms.contains(f) {
                forms.push(*f);
            }
        }
        if forms.is_empty() {
            return Ok(BTreeMap::new());
        }
        let rope = model.rope().ok_or_else(|| EvalError::InvalidParameter {
            name: "form",
            reason: format!("{} has no RoPE: shard forms undo it", model.describe()),
        })?;
        let jobs: Vec<(CacheForm, usize)> = forms
            .iter()
            .flat_map(|f| (0..rows.layers.len()).map(move |l| (*f, l)))
            .collect();
        let (ch, head_dim) = (rows.channels, model.head_dim());
        jobs.into_par_iter()
            .map(|(form, l)| {
                let Quantizer::Shard(spec) = *form.quantizer() else {
                    unreachable!("shard forms only");
                };
                // The key basis is fitted where the form keys a layer.
                let shape = basis_shape(&form, Part::Key).expect("a calibrated shard form");
                let Some(basis) = bases.get(&(shape, l, Part::Key)).map(|b| &b.heads[0]) else {
                    return Ok(None);
                };
                let keys = rows.head_rows(l, Part::Key, 0, ch, Some(rope))?;
                let keys =
                    ShardKeys::with_basis(&keys, rows.tokens, basis, spec.key_bits(), spec.group)?;
                let values = match spec.values {
                    kv_quant::ShardValues::Vq => Some(ChannelVq::fit(
                        &rows.layers[l].1,
                        rows.tokens,
                        ch,
                        head_dim,
                        attention::SHARD_VALUE_FIT,
                    )?),
                    kv_quant::ShardValues::Nf4 => None,
                };
                // The tables alone: the calibration's own rows are not kept.
                let values = values.map(|v| Arc::new(v.tables()));
                Ok(Some((
                    (shard_key(&form), l),
                    (Arc::new(keys.tables()), values),
                )))
            })
            .collect::<Result<Vec<_>>>()
            .map(|fitted| fitted.into_iter().flatten().collect())
    }

    /// The tables one part of the calibrated Shard `form` reads in `layer`
    /// of a paged cache, if fitted (keys rotated by `rope`).
    pub fn shard_tables(
        &self,
        form: &CacheForm,
        layer: usize,
        part: Part,
        rope: &attention::Rope,
    ) -> Option<ShardTables> {
        let (keys, values) = self.shard.get(&(shard_key(form), layer))?;
        Some(match part {
            Part::Key => ShardTables::Keys {
                prototype: keys.clone(),
                rope: rope.clone(),
            },
            Part::Value => ShardTables::Values {
                prototype: values.clone(),
                head_dim: rope.head_dim(),
            },
        })
    }

    /// The bases of `form` for `layer` and `part`, if fitted.
    pub fn bases(&self, form: &CacheForm, layer: usize, part: Part) -> Option<Arc<HeadBases>> {
        let shape = basis_shape(form, part)?;
        self.bases.get(&(shape, layer, part)).cloned()
    }

    /// The codebook of `form` for `layer` and `part`, if fitted.
    pub fn codebook(&self, form: &CacheForm, layer: usize, part: Part) -> Option<Arc<VqCodebook>> {
        let shape = codebook_shape(form)?;
        self.codebooks.get(&(shape, layer, part)).cloned()
    }

    /// Codebook and basis shapes and Shard forms held (form spellings).
    pub fn shapes(&self) -> Vec<String> {
        let mut s: Vec<String> = self
            .codebooks
            .keys()
            .map(|k| k.0.clone())
            .chain(self.bases.keys().map(|k| k.0.clone()))
            .chain(self.shard.keys().map(|k| k.0.clone()))
            .collect();
        s.sort();
        s.dedup();
        s
    }

    /// Refuses a calibration fitted for a model of another shape.
    pub fn check_model(&self, model: &dyn CausalLm) -> Result<()> {
        if let Some(d) = self.shard_head_dim()
            && d != model.head_dim()
        {
            return Err(EvalError::InvalidParameter {
                name: "calibration",
                reason: format!(
                    "its Shard value codebooks rotate heads of {d} channels ({}), but the model's \
                     heads have {} ({})",
                    self.model,
                    model.head_dim(),
                    model.describe()
                ),
            });
        }
        if self.layers != model.layers() || self.kv_channels != model.kv_channels() {
            return Err(EvalError::InvalidParameter {
                name: "calibration",
                reason: format!(
                    "fitted for {} layers × {} KV channels ({}), but the model has {} × {} ({})",
                    self.layers,
                    self.kv_channels,
                    self.model,
                    model.layers(),
                    model.kv_channels(),
                    model.describe()
                ),
            });
        }
        Ok(())
    }

    /// Channels per head the Shard value codebooks rotate, if any is held.
    fn shard_head_dim(&self) -> Option<usize> {
        self.shard
            .values()
            .find_map(|(_, v)| v.as_ref().map(|v| v.hadamard().block()))
    }

    /// Writes the calibration file (see the module docs).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut buffers: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
        for ((form, layer), (keys, values)) in &self.shard {
            let name = format!("shard/{form}/{layer}/k/allocation");
            let allocation = keys.allocation().to_vec();
            let check = table_checks(&allocation);
            buffers.push((format!("{name}/check"), check.clone(), vec![check.len()]));
            buffers.push((name, allocation.clone(), vec![allocation.len()]));
            if let Some(v) = values {
                let name = format!("shard/{form}/{layer}/v/centroids");
                let check = table_checks(&f16_bytes(v.centroids()));
                let bytes = v.centroids().iter().flat_map(|c| c.to_le_bytes()).collect();
                buffers.push((format!("{name}/check"), check.clone(), vec![check.len()]));
                buffers.push((name, bytes, vec![v.centroids().len() / 4, 4]));
            }
        }
        for ((shape, layer, part), cb) in &self.codebooks {
            let spec = cb.spec();
            let bytes: Vec<u8> = cb
                .centroids()
                .iter()
                .flat_map(|c| c.to_le_bytes())
                .collect();
            let name = format!("vq/{shape}/{layer}/{}", part.tag());
            let check = table_checks(&cb.table_bytes());
            buffers.push((format!("{name}/check"), check.clone(), vec![check.len()]));
            buffers.push((name, bytes, vec![cb.codebooks(), spec.centroids, spec.dim]));
        }
        for ((shape, layer, part), bases) in &self.bases {
            for (h, b) in bases.heads.iter().enumerate() {
                let name = format!("pca/{shape}/{layer}/{}/{h}", part.tag());
                let rows: Vec<u8> = b.rows().iter().flat_map(|c| c.to_le_bytes()).collect();
                let mean: Vec<u8> = b.mean().iter().flat_map(|c| c.to_le_bytes()).collect();
                buffers.push((format!("{name}/rows"), rows, vec![b.rank(), b.dim()]));
                buffers.push((format!("{name}/mean"), mean, vec![b.dim()]));
                let check = table_checks(&b.table_bytes());
                buffers.push((format!("{name}/check"), check.clone(), vec![check.len()]));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = buffers
            .iter()
            .map(|(name, bytes, shape)| {
                let dtype = if name.ends_with("/check") || name.ends_with("/allocation") {
                    Dtype::U8
                } else {
                    Dtype::F32
                };
                TensorView::new(dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(st_err(name.clone()))
            })
            .collect::<Result<_>>()?;
        let metadata: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("model", self.model.clone()),
            ("layers", self.layers.to_string()),
            ("kv_channels", self.kv_channels.to_string()),
            ("text", self.text.clone()),
            ("tokens", self.tokens.to_string()),
        ]
        .into_iter()
        .chain(
            self.shard_head_dim()
                .map(|d| ("shard_head_dim", d.to_string())),
        )
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        safetensors::serialize_to_file(views, Some(metadata), path)
            .map_err(|e| EvalError::Report(format!("cannot write {}: {e}", path.display())))
    }

    /// Reads a calibration file (see the module docs), checking its format
    /// and every tensor.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |reason: String| EvalError::Safetensors {
            context: format!("calibration file {}: {reason}", path.display()),
            source: None,
        };
        let header_err = st_err(format!("calibration file {}", path.display()));
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(header_err)?;
        let meta = header.metadata().clone().unwrap_or_default();
        let field = |k: &str| {
            meta.get(k)
                .cloned()
                .ok_or_else(|| bad(format!("no `{k}` in its metadata")))
        };
        if field("format")? != FORMAT {
            return Err(bad(format!("format is not {FORMAT:?}")));
        }
        let number = |k: &str| -> Result<usize> {
            field(k)?
                .parse()
                .map_err(|_| bad(format!("`{k}` is not a number")))
        };
        let (layers, kv_channels) = (number("layers")?, number("kv_channels")?);
        let tensors = SafeTensors::deserialize(&bytes)
            .map_err(st_err(format!("calibration file {}", path.display())))?;
        let mut codebooks = BTreeMap::new();
        let mut basis_parts: BTreeMap<(String, usize, Part, usize), BasisParts> = BTreeMap::new();
        let floats = |view: &TensorView<'_>| -> Vec<f32> {
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let part_of = |name: &str, tag: &str| match tag {
            "k" => Ok(Part::Key),
            "v" => Ok(Part::Value),
            _ => Err(bad(format!("{name}: part {tag:?}"))),
        };
        // Check words first: every table is verified against its own.
        let mut checks: HashMap<String, Vec<u8>> = HashMap::new();
        for (name, view) in tensors.tensors() {
            if let Some(table) = name.strip_suffix("/check") {
                if view.dtype() != Dtype::U8 || view.shape().len() != 1 {
                    return Err(bad(format!("{name}: not a 1-dimensional U8 tensor")));
                }
                checks.insert(table.to_string(), view.data().to_vec());
            }
        }
        let mut verify = |table: &str, values: &[(&[f32], &[f32])], bytes: &[u8]| -> Result<()> {
            // Each value as loaded, and as the table stores it (f16).
            for (loaded, stored) in values {
                if let Some(i) = loaded
                    .iter()
                    .zip(*stored)
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err(bad(format!(
                        "{table}: value {i} ({}) is not the f16 it was stored as: the file \
                         was changed after it was written",
                        loaded[i]
                    )));
                }
            }
            let check = checks
                .remove(table)
                .ok_or_else(|| bad(format!("{table}: no check words ({table}/check)")))?;
            let failing = kv_quant::ProtectedTable::failing_words(bytes, &check, CHECK_CODE)
                .map_err(|e| bad(format!("{table}/check: {e}")))?;
            if let Some(&(word, outcome)) = failing.first() {
                return Err(bad(format!(
                    "{table}: {} of its 16-bit words fail their RM(2,5) check (first: word \
                     {word}, {}): the file was changed after it was written; refit it with \
                     `kv-eval calibrate`",
                    failing.len(),
                    match outcome {
                        gf2_codes::DecodeOutcome::Detected => "more than three flips",
                        _ => "one to three flips",
                    }
                )));
            }
            Ok(())
        };
        // Per Shard form and layer: the keys' allocation, the values' codebook.
        type ShardParts = (Option<Vec<u8>>, Option<Vec<f32>>);
        let mut shard_parts: BTreeMap<(String, usize), ShardParts> = BTreeMap::new();
        for (name, view) in tensors.tensors() {
            if name.ends_with("/check") {
                continue;
            }
            let parts: Vec<&str> = name.split('/').collect();
            if let ["shard", form, layer, part, which] = parts[..] {
                let layer: usize = layer.parse().map_err(|_| bad(format!("{name}: layer")))?;
                if layer >= layers {
                    return Err(bad(format!("{name}: layer {layer} of {layers}")));
                }
                // Files written before tables were keyed without a code
                // may name one; a name not spelled as its form is left for
                // the check below to refuse.
                let key = match form.parse::<CacheForm>() {
                    Ok(f) if f.to_string() == form => shard_key(&f),
                    _ => form.to_string(),
                };
                let slot = shard_parts.entry((key, layer)).or_default();
                match (part, which, view.dtype(), view.shape()) {
                    ("k", "allocation", Dtype::U8, [_]) => {
                        verify(&name, &[], view.data())?;
                        slot.0 = Some(view.data().to_vec());
                    }
                    ("v", "centroids", Dtype::F32, [_, 4]) => {
                        let values = floats(&view);
                        let stored: Vec<f32> = values
                            .iter()
                            .map(|&c| half::f16::from_f32(c).to_f32())
                            .collect();
                        verify(&name, &[(&values, &stored)], &f16_bytes(&stored))?;
                        slot.1 = Some(values);
                    }
                    _ => return Err(bad(format!("{name}: unknown or misshapen"))),
                }
                continue;
            }
            if let ["pca", shape, layer, part, head, which] = parts[..] {
                let form: CacheForm = shape.parse().map_err(|e| bad(format!("{name}: {e}")))?;
                let part = part_of(&name, part)?;
                if basis_shape(&form, part).as_deref() != Some(shape) {
                    return Err(bad(format!("{name}: {shape} is not a basis shape")));
                }
                let layer: usize = layer.parse().map_err(|_| bad(format!("{name}: layer")))?;
                let head: usize = head.parse().map_err(|_| bad(format!("{name}: head")))?;
                if layer >= layers || view.dtype() != Dtype::F32 {
                    return Err(bad(format!(
                        "{name}: layer {layer} of {layers}, or not F32"
                    )));
                }
                let slot = basis_parts
                    .entry((shape.to_string(), layer, part, head))
                    .or_default();
                match which {
                    "rows" if view.shape().len() == 2 => slot.0 = Some(floats(&view)),
                    "mean" if view.shape().len() == 1 => slot.1 = Some(floats(&view)),
                    _ => return Err(bad(format!("{name}: unknown or misshapen"))),
                }
                continue;
            }
            let ["vq", shape, layer, part] = parts[..] else {
                return Err(bad(format!("unknown tensor {name:?}")));
            };
            let form: CacheForm = shape.parse().map_err(|e| bad(format!("{name}: {e}")))?;
            let layer: usize = layer.parse().map_err(|_| bad(format!("{name}: layer")))?;
            if layer >= layers {
                return Err(bad(format!("{name}: layer {layer} of {layers}")));
            }
            let part = match part {
                "k" => Part::Key,
                "v" => Part::Value,
                _ => return Err(bad(format!("{name}: part {part:?}"))),
            };
            if view.dtype() != Dtype::F32 || view.shape().len() != 3 {
                return Err(bad(format!("{name}: not a 3-dimensional F32 tensor")));
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let cb = VqCodebook::new(&form, kv_channels, &values)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            if view.shape() != [cb.codebooks(), cb.spec().centroids, cb.spec().dim] {
                return Err(bad(format!("{name}: shape {:?}", view.shape())));
            }
            verify(&name, &[(&values, cb.centroids())], &cb.table_bytes())?;
            let canonical = codebook_shape(&form).expect("a vq form");
            codebooks.insert((canonical, layer, part), Arc::new(cb));
        }
        let mut bases: BTreeMap<(String, usize, Part), Vec<Arc<Basis>>> = BTreeMap::new();
        for ((shape, layer, part, head), (rows, mean)) in basis_parts {
            let (Some(rows), Some(mean)) = (rows, mean) else {
                return Err(bad(format!(
                    "pca/{shape}/{layer}/{}/{head}: rows or mean missing",
                    part.tag()
                )));
            };
            let dim = mean.len();
            let name = format!("pca/{shape}/{layer}/{}/{head}", part.tag());
            // Shard's key basis is stored in int8 with a scale per row
            // (the rows as written are those codes times their scales),
            // the pca bases in f16.
            let storage = match shape.parse::<CacheForm>().map(|f| *f.quantizer()) {
                Ok(Quantizer::Shard(_)) => BasisStorage::Int8,
                _ => BasisStorage::F16,
            };
            let b = Basis::from_parts(dim, &rows, &mean, storage)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            verify(
                &name,
                &[(&rows, b.rows()), (&mean, b.mean())],
                &b.table_bytes(),
            )?;
            let heads = bases.entry((shape, layer, part)).or_default();
            if heads.len() != head {
                return Err(bad(format!(
                    "pca bases of layer {layer}: head {head} out of order"
                )));
            }
            heads.push(Arc::new(b));
        }
        if let Some(table) = checks.keys().min() {
            return Err(bad(format!("{table}/check: check words of no table")));
        }
        for ((shape, layer, _), heads) in &bases {
            let dims: usize = heads.iter().map(|b| b.dim()).sum();
            if dims != kv_channels {
                return Err(bad(format!(
                    "pca/{shape}/{layer}: heads of {dims} channels, the model has {kv_channels}"
                )));
            }
        }
        let bases: BTreeMap<_, _> = bases
            .into_iter()
            .map(|(k, heads)| (k, Arc::new(HeadBases { heads })))
            .collect();
        let head_dim = match meta.get("shard_head_dim") {
            Some(d) => Some(
                d.parse()
                    .map_err(|_| bad("`shard_head_dim` is not a number".into()))?,
            ),
            None => None,
        };
        let shard = shard_parts
            .into_iter()
            .map(|((form, layer), parts)| {
                let tables = shard_tables_of(&form, layer, parts, &bases, (kv_channels, head_dim));
                Ok(((form, layer), tables.map_err(bad)?))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            model: field("model")?,
            layers,
            kv_channels,
            text: field("text")?,
            tokens: number("tokens")?,
            codebooks,
            bases,
            shard,
        })
    }
}
