//! [`LayerForms`]: which form each layer's keys and values are stored in.
//!
//! Spelling: rules separated by `;`, each `LAYERS:FORM` (keys and values
//! alike) or `LAYERS:KEY_FORM/VALUE_FORM`, where `LAYERS` is `*` (every
//! layer no other rule names) or a comma-separated list of layers and
//! inclusive ranges (`0,29`, `0-3,28-29`); `last` names the model's last
//! layer. Example: `0,last:fp16;*:int4` keeps the first and last layers in
//! f16 (as vLLM's TurboQuant presets do) and the rest in `int4`. A layer
//! named twice, a layer the model does not have, a missing `*` where a
//! layer is left without a rule, and an unparsable form are errors that
//! quote the grammar.

use std::fmt;
use std::str::FromStr;

use super::CacheForm;
use super::parse::quote;
use crate::error::{KvQuantError, Result};

/// The grammar of [`LayerForms`], for error messages and `--help` texts.
pub const LAYER_GRAMMAR: &str = "RULE[;RULE...] with RULE = LAYERS:FORM or LAYERS:KEY_FORM/VALUE_FORM \
and LAYERS = * or N[,N | ,A-B ...] with `last` for the last layer (e.g. 0,last:fp16;*:int4 or 0-3:int8/int4;*:int4-ch/int4)";

/// The index standing for `last` until a model's layer count is known.
const LAST: usize = usize::MAX;

/// One rule: layers and their key and value forms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRule {
    /// Inclusive layer ranges (`usize::MAX` standing for the last layer),
    /// or `None` for `*`.
    pub layers: Option<Vec<(usize, usize)>>,
    /// Form of the keys.
    pub key: CacheForm,
    /// Form of the values.
    pub value: CacheForm,
}

/// Per-layer key and value forms of a whole model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerForms {
    rules: Vec<LayerRule>,
}

fn invalid(spec: &str, reason: String) -> KvQuantError {
    KvQuantError::InvalidLayerForms {
        spec: quote(spec),
        reason,
    }
}

impl LayerForms {
    /// The same key and value forms for every layer.
    pub fn uniform(key: CacheForm, value: CacheForm) -> Self {
        Self {
            rules: vec![LayerRule {
                layers: None,
                key,
                value,
            }],
        }
    }

    /// The rules, in spelling order.
    pub fn rules(&self) -> &[LayerRule] {
        &self.rules
    }

    /// The `(key, value)` form of every layer of a model with `layers`
    /// layers; an error when a rule names a layer the model lacks or a
    /// layer is left without a rule.
    pub fn resolve(&self, layers: usize) -> Result<Vec<(CacheForm, CacheForm)>> {
        let spec = self.to_string();
        let last = layers.saturating_sub(1);
        let fix = |i: usize| if i == LAST { last } else { i };
        let mut out: Vec<Option<(CacheForm, CacheForm)>> = vec![None; layers];
        for rule in &self.rules {
            if let Some(ranges) = &rule.layers {
                for &(a, b) in ranges {
                    let (a, b) = (fix(a), fix(b));
                    if b >= layers || a > b {
                        return Err(invalid(
                            &spec,
                            format!(
                                "layer {} does not exist: the model has layers 0-{last}",
                                b.max(a)
                            ),
                        ));
                    }
                    for (l, slot) in out[a..=b].iter_mut().enumerate() {
                        if slot.replace((rule.key, rule.value)).is_some() {
                            return Err(invalid(
                                &spec,
                                format!("layer {} is named by two rules", a + l),
                            ));
                        }
                    }
                }
            }
        }
        let rest = self.rules.iter().find(|r| r.layers.is_none());
        out.into_iter()
            .enumerate()
            .map(|(l, f)| {
                f.or(rest.map(|r| (r.key, r.value)))
                    .ok_or_else(|| invalid(&spec, format!("layer {l} has no rule (add `*:FORM`)")))
            })
            .collect()
    }
}

fn parse_layers(text: &str) -> std::result::Result<Option<Vec<(usize, usize)>>, String> {
    if text.trim() == "*" {
        return Ok(None);
    }
    let number = |s: &str| match s.trim() {
        "last" => Ok(LAST),
        n => n
            .parse::<usize>()
            .map_err(|_| format!("{:?} is not a layer number", quote(s))),
    };
    text.split(',')
        .map(|item| match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    Err(format!("layer range {a}-{b} runs backwards"))
                } else {
                    Ok((a, b))
                }
            }
            None => number(item).map(|n| (n, n)),
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map(Some)
}

impl FromStr for LayerForms {
    type Err = KvQuantError;

    fn from_str(text: &str) -> Result<Self> {
        let mut rules = Vec::new();
        for rule in text.split(';').filter(|r| !r.trim().is_empty()) {
            let (layers, forms) = rule
                .split_once(':')
                .ok_or_else(|| invalid(text, format!("rule {:?} lacks `LAYERS:`", quote(rule))))?;
            let layers = parse_layers(layers).map_err(|r| invalid(text, r))?;
            let (key, value) = match forms.split_once('/') {
                Some((k, v)) => (k.parse()?, v.parse()?),
                None => {
                    let f: CacheForm = forms.parse()?;
                    (f, f)
                }
            };
            rules.push(LayerRule { layers, key, value });
        }
        if rules.is_empty() {
            return Err(invalid(text, "no rule".into()));
        }
        if rules.iter().filter(|r| r.layers.is_none()).count() > 1 {
            return Err(invalid(text, "`*` given twice".into()));
        }
        let mut named: Vec<(usize, usize)> = rules
            .iter()
            .filter_map(|r| r.layers.as_ref())
            .flatten()
            .copied()
            .collect();
        named.sort_unstable();
        if let Some(w) = named.windows(2).find(|w| w[1].0 <= w[0].1) {
            let layer = w[1].0;
            return Err(invalid(
                text,
                format!("layer {layer} is named by two rules"),
            ));
        }
        Ok(Self { rules })
    }
}

impl fmt::Display for LayerForms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, rule) in self.rules.iter().enumerate() {
            if i > 0 {
                f.write_str(";")?;
            }
            match &rule.layers {
                None => f.write_str("*")?,
                Some(ranges) => {
                    for (j, &(a, b)) in ranges.iter().enumerate() {
                        if j > 0 {
                            f.write_str(",")?;
                        }
                        let show = |i: usize| {
                            if i == LAST {
                                "last".to_string()
                            } else {
                                i.to_string()
                            }
                        };
                        if a == b {
                            f.write_str(&show(a))?;
                        } else {
                            write!(f, "{}-{}", show(a), show(b))?;
                        }
                    }
                }
            }
            if rule.key == rule.value {
                write!(f, ":{}", rule.key)?;
            } else {
                write!(f, ":{}/{}", rule.key, rule.value)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(s: &str) -> CacheForm {
        s.parse().unwrap()
    }

    #[test]
    fn first_and_last_layers_wider() {
        let lf: LayerForms = "0,29:fp16;*:int4".parse().unwrap();
        let per_layer = lf.resolve(30).unwrap();
        assert_eq!(per_layer[0], (form("fp16"), form("fp16")));
        assert_eq!(per_layer[29], (form("fp16"), form("fp16")));
        assert!(
            per_layer[1..29]
                .iter()
                .all(|&p| p == (form("int4"), form("int4")))
        );
        assert_eq!(lf.to_string(), "0,29:fp16;*:int4");
    }

    #[test]
    fn last_names_the_last_layer_of_any_model() {
        let lf: LayerForms = "0,last:fp16;*:int4".parse().unwrap();
        for layers in [2, 24, 30] {
            let per_layer = lf.resolve(layers).unwrap();
            assert_eq!(per_layer[layers - 1], (form("fp16"), form("fp16")));
            assert_eq!(
                per_layer[layers - 2].0,
                form(if layers == 2 { "fp16" } else { "int4" })
            );
        }
        assert_eq!(lf.to_string(), "0,last:fp16;*:int4");
        // `last` overlapping a number is found once the count is known.
        let lf: LayerForms = "last:int8;29:fp16;*:int4".parse().unwrap();
        assert!(
            lf.resolve(30)
                .unwrap_err()
                .to_string()
                .contains("layer 29 is named by two rules")
        );
        assert!(lf.resolve(40).is_ok());
    }

    #[test]
    fn ranges_and_separate_key_value_forms() {
        let lf: LayerForms = "0-2:int8/int4 ; *:int4-ch/int4+secded84".parse().unwrap();
        let per_layer = lf.resolve(5).unwrap();
        assert_eq!(per_layer[2], (form("int8"), form("int4")));
        assert_eq!(per_layer[3], (form("int4-ch"), form("int4+secded84")));
        assert_eq!(lf.to_string(), "0-2:int8/int4;*:int4-ch/int4+secded84");
        let back: LayerForms = lf.to_string().parse().unwrap();
        assert_eq!(back, lf);
    }

    #[test]
    fn bad_layer_lists_are_typed_errors_with_the_grammar() {
        for (text, layers, needle) in [
            ("0-3:int8;2:int4;*:fp16", 30, "named by two rules"),
            ("0,0:int8;*:int4", 30, "named by two rules"),
            ("30:int8;*:int4", 30, "does not exist"),
            ("0:int8", 2, "has no rule"),
            ("*:int8;*:int4", 2, "given twice"),
            ("3-1:int8", 4, "runs backwards"),
            ("x:int8", 4, "not a layer number"),
            ("int8", 4, "lacks"),
            ("", 4, "no rule"),
        ] {
            let e = text
                .parse::<LayerForms>()
                .and_then(|lf| lf.resolve(layers).map(|_| lf))
                .unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(needle), "{text}: {msg}");
            assert!(msg.contains("LAYERS:FORM"), "{text}: {msg}");
        }
        // A bad form inside a rule is the form parser's error.
        let e = "*:int5".parse::<LayerForms>().unwrap_err();
        assert!(matches!(e, KvQuantError::InvalidSpec { .. }), "{e}");
    }
}
