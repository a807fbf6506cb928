//! [`CacheMode`]: where attention reads K and V from (the plain f32 rows,
//! or kv-quant stores in forms chosen per layer for keys and values), with
//! its one spelling.

use std::sync::Arc;

use kv_quant::{CacheForm, LayerForms};

use super::BlockForms;
use crate::calibration::{Calibration, Part};
use crate::error::{EvalError, Result};

/// Where attention reads K and V from.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheMode {
    /// The f32 rows as computed (no store).
    Plain,
    /// kv-quant stores, in forms chosen per layer for keys and values.
    Stored(StoredForms),
}

/// The forms of a stored cache and the fitted data they need.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredForms {
    /// Key and value forms per layer.
    pub layers: LayerForms,
    /// Codebooks (and other calibrated data) for the forms that need them.
    pub calibration: Option<Arc<Calibration>>,
    /// Each block's form where blocks of one layer differ (adaptive
    /// protection per block), read block by block; `None` stores each
    /// part of a layer as one store.
    pub blocks: Option<Arc<BlockForms>>,
}

impl CacheMode {
    /// One form for keys and values of every layer.
    pub fn form(form: CacheForm) -> Self {
        Self::key_value(form, form)
    }

    /// A key form and a value form for every layer.
    pub fn key_value(key: CacheForm, value: CacheForm) -> Self {
        Self::Stored(StoredForms {
            layers: LayerForms::uniform(key, value),
            calibration: None,
            blocks: None,
        })
    }

    /// Per-layer forms with the calibration they need.
    pub fn layered(layers: LayerForms, calibration: Option<Arc<Calibration>>) -> Self {
        Self::Stored(StoredForms {
            layers,
            calibration,
            blocks: None,
        })
    }

    /// The same forms stored block by block as `blocks` says (plain stays
    /// plain).
    pub fn with_blocks(self, blocks: BlockForms) -> Self {
        match self {
            Self::Plain => Self::Plain,
            Self::Stored(s) => Self::Stored(StoredForms {
                blocks: Some(Arc::new(blocks)),
                ..s
            }),
        }
    }

    /// The same forms with this calibration (plain stays plain).
    pub fn with_calibration(self, calibration: Option<Arc<Calibration>>) -> Self {
        match self {
            Self::Plain => Self::Plain,
            Self::Stored(s) => Self::Stored(StoredForms { calibration, ..s }),
        }
    }

    /// The spelling of the mode: `plain`, a form (`int4`), a key/value pair
    /// (`int4-ch/int4`) or a layer policy (`0,29:fp16;*:int4`).
    pub fn label(&self) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Stored(s) => match s.layers.rules() {
                [rule] if rule.layers.is_none() && rule.key == rule.value => rule.key.to_string(),
                [rule] if rule.layers.is_none() => format!("{}/{}", rule.key, rule.value),
                _ => s.layers.to_string(),
            },
        }
    }

    /// Every form the mode names, with the part it stores.
    pub fn forms(&self) -> Vec<(CacheForm, Part)> {
        match self {
            Self::Plain => Vec::new(),
            Self::Stored(s) => s
                .layers
                .rules()
                .iter()
                .flat_map(|r| [(r.key, Part::Key), (r.value, Part::Value)])
                .collect(),
        }
    }

    /// Refuses exact sinks and windows that cover a whole context of `ctx`
    /// tokens (nothing would be quantized).
    pub fn check_context(&self, ctx: usize) -> Result<()> {
        for (f, _) in self.forms() {
            let seg = f.segments();
            if seg.sink + seg.window >= ctx {
                return Err(EvalError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{f}: a sink of {} and a window of {} tokens cover the whole context of {ctx}",
                        seg.sink, seg.window
                    ),
                });
            }
        }
        Ok(())
    }

    /// Parses `plain`, `FORM`, `KEY_FORM/VALUE_FORM` or a layer policy
    /// (`LAYERS:FORM[/FORM];...`).
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        if text == "plain" {
            return Ok(Self::Plain);
        }
        if text.contains(':') {
            return Ok(Self::layered(text.parse()?, None));
        }
        Ok(match text.split_once('/') {
            Some((k, v)) => Self::key_value(k.parse()?, v.parse()?),
            None => Self::form(text.parse()?),
        })
    }
}
