//! Calibration: what the data-dependent cache forms fit on a text disjoint
//! from the evaluation text, and the file that carries it.
//!
//! [`Calibration::fit`] runs the plain model over the calibration tokens in
//! windows, collects every layer's key and value rows (keys after RoPE, as
//! the cache stores them), and fits a [`VqCodebook`] per layer, part and
//! codebook shape for each `vq` form asked for.
//!
//! # File format
//! A safetensors file. Each codebook is an F32 tensor named
//! `vq/<form>/<layer>/<k|v>` of shape `[blocks, centroids, dim]` (the
//! centroids as stored, f16 values held exactly in f32), where `<form>` is
//! the codebook's shape as a form spelling (`vq+rot` for 256 centroids of 4
//! channels over 64-channel blocks; protection, segments and the gain's
//! storage type do not change a codebook). The header metadata holds
//! `format` (`reliable-kv calibration 1`), `model` (the model's one-line
//! description), `layers`, `kv_channels`, `text` and `tokens` (where the
//! rows came from). Loading checks the format, every tensor's shape, and
//! that the file was fitted for a model of the same shape.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use kv_quant::{CacheForm, FitOptions, Quantizer, Segments, VqCodebook};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::cache::{CacheMode, KvCache};
use crate::error::{EvalError, Result};
use crate::model::CausalLm;

/// The format tag of calibration files.
pub const FORMAT: &str = "reliable-kv calibration 1";

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

/// The codebook shape of a `vq` form, as a form spelling (`vq+rot`,
/// `vq-d2-k16+rot128`): what two forms must share to share a codebook.
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
}

/// Every layer's key and value rows over the calibration tokens.
pub struct CalibrationRows {
    /// Per layer: keys then values, `tokens × kv_channels` each.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
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
        for window in tokens.chunks(ctx) {
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
            tokens: tokens.len(),
            channels,
        })
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
                let data = if part == Part::Key { k } else { v };
                let cb = VqCodebook::fit(&form, data, rows.tokens, rows.channels, options)?;
                Ok(((shape, l, part), Arc::new(cb)))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            model: model.describe(),
            layers: model.layers(),
            kv_channels: model.kv_channels(),
            text: text.to_string(),
            tokens: rows.tokens,
            codebooks: fitted.into_iter().collect(),
        })
    }

    /// The codebook of `form` for `layer` and `part`, if fitted.
    pub fn codebook(&self, form: &CacheForm, layer: usize, part: Part) -> Option<Arc<VqCodebook>> {
        let shape = codebook_shape(form)?;
        self.codebooks.get(&(shape, layer, part)).cloned()
    }

    /// Codebook shapes held (form spellings).
    pub fn shapes(&self) -> Vec<String> {
        let mut s: Vec<String> = self.codebooks.keys().map(|k| k.0.clone()).collect();
        s.dedup();
        s
    }

    /// Refuses a calibration fitted for a model of another shape.
    pub fn check_model(&self, model: &dyn CausalLm) -> Result<()> {
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

    /// Writes the calibration file (see the module docs).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut buffers: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
        for ((shape, layer, part), cb) in &self.codebooks {
            let spec = cb.spec();
            let bytes: Vec<u8> = cb
                .centroids()
                .iter()
                .flat_map(|c| c.to_le_bytes())
                .collect();
            buffers.push((
                format!("vq/{shape}/{layer}/{}", part.tag()),
                bytes,
                vec![cb.blocks(), spec.centroids, spec.dim],
            ));
        }
        let views: Vec<(String, TensorView<'_>)> = buffers
            .iter()
            .map(|(name, bytes, shape)| {
                TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| EvalError::Safetensors(e.to_string()))
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
        let bad = |reason: String| {
            EvalError::Safetensors(format!("calibration file {}: {reason}", path.display()))
        };
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
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
        let tensors = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut codebooks = BTreeMap::new();
        for (name, view) in tensors.tensors() {
            let parts: Vec<&str> = name.split('/').collect();
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
            if view.shape() != [cb.blocks(), cb.spec().centroids, cb.spec().dim] {
                return Err(bad(format!("{name}: shape {:?}", view.shape())));
            }
            let canonical = codebook_shape(&form).expect("a vq form");
            codebooks.insert((canonical, layer, part), Arc::new(cb));
        }
        Ok(Self {
            model: field("model")?,
            layers,
            kv_channels,
            text: field("text")?,
            tokens: number("tokens")?,
            codebooks,
        })
    }
}
