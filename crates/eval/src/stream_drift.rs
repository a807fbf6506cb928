//! The drift of a `shard` cache's decode stream (`shard-kv-compression-blog.md`,
//! section 8): prompts cut from the corpus are prefilled into a `shard`
//! cache, then the model generates greedily; tokens generated after the
//! prefill go to the decode stream, kept in f16 (`-soff`) or quantised per
//! token by Hadamard + Lloyd-Max (`-s4`, `-s8`). Each run's tokens are
//! compared position by position with a reference run (an `fp16` cache)
//! and with the same `shard` prefill whose stream is off, so the stream's
//! own drift is seen apart from the prefill's compression.

use serde::Serialize;

use crate::backend::BackendKind;
use crate::cache::CacheMode;
use crate::error::{EvalError, Result};
use crate::generate::{GenerateConfig, Sampling, generate};
use crate::models::CausalLm;
use kv_quant::{CacheForm, Quantizer};

/// What [`run`] measures.
#[derive(Clone, Debug, PartialEq)]
pub struct DriftConfig {
    /// Prompts, cut from the corpus at evenly spaced offsets.
    pub prompts: usize,
    /// Tokens of each prompt (the prefill).
    pub prefix: usize,
    /// Tokens generated after each prompt.
    pub new_tokens: usize,
    /// Generated-token counts at which matches are reported (the blog's 20, 60, 150).
    pub checkpoints: Vec<usize>,
}

/// One stream setting.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DriftRow {
    /// The form.
    pub form: String,
    /// Per checkpoint `n`: tokens among the first `n` of every prompt equal
    /// to the reference's at the same position.
    pub matches_reference: Vec<usize>,
    /// The same against the stream-off run of the same prefill.
    pub matches_stream_off: Vec<usize>,
    /// Mean over prompts of the tokens generated before the first
    /// difference from the reference.
    pub mean_agreeing_prefix: f64,
}

/// The experiment's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DriftReport {
    /// The reference form.
    pub reference: String,
    /// Prompts and their length.
    pub prompts: usize,
    /// Tokens of each prompt.
    pub prefix: usize,
    /// The checkpoints.
    pub checkpoints: Vec<usize>,
    /// One row per stream setting (off first).
    pub rows: Vec<DriftRow>,
}

/// The stream settings of a `shard` form: off, 4-bit and 8-bit Lloyd-Max.
pub fn stream_variants(form: &CacheForm) -> Result<Vec<CacheForm>> {
    let Quantizer::Shard(spec) = *form.quantizer() else {
        return Err(EvalError::InvalidParameter {
            name: "form",
            reason: format!("{form} is not a shard form"),
        });
    };
    [None, Some(4), Some(8)]
        .into_iter()
        .map(|stream| {
            let q = Quantizer::Shard(kv_quant::ShardSpec { stream, ..spec });
            Ok(CacheForm::build(q, None, form.segments(), None)?)
        })
        .collect()
}

/// Runs `config.prompts` prompts of the corpus `tokens` under the
/// reference form and each stream setting of `form`, greedily.
pub fn run(
    model: &dyn CausalLm,
    tokens: &[u32],
    reference: CacheForm,
    form: &CacheForm,
    config: &DriftConfig,
    mut progress: impl FnMut(&str),
) -> Result<DriftReport> {
    let last = config.checkpoints.iter().copied().max().unwrap_or(0);
    if config.prompts == 0 || config.prefix == 0 || last > config.new_tokens {
        return Err(EvalError::InvalidParameter {
            name: "drift",
            reason: format!(
                "{} prompts of {} tokens, {} new tokens, checkpoints {:?}",
                config.prompts, config.prefix, config.new_tokens, config.checkpoints
            ),
        });
    }
    if tokens.len() < config.prefix + config.prompts {
        return Err(EvalError::InvalidParameter {
            name: "corpus",
            reason: format!(
                "{} tokens cannot give {} prompts of {}",
                tokens.len(),
                config.prompts,
                config.prefix
            ),
        });
    }
    let variants = stream_variants(form)?;
    let stride = (tokens.len() - config.prefix) / config.prompts;
    let greedy = |mode: CacheMode, prompt: &[u32]| -> Result<Vec<u32>> {
        let c = GenerateConfig {
            mode,
            backend: BackendKind::Reencode,
            context: config.prefix + config.new_tokens,
            max_new: config.new_tokens,
            sampling: Sampling::default(),
            faults: None,
        };
        Ok(generate(model, prompt, &c, |_| Ok(()))?.tokens)
    };
    // runs[v][p]: tokens of variant v (0: reference) for prompt p.
    let mut runs: Vec<Vec<Vec<u32>>> = vec![Vec::new(); variants.len() + 1];
    for p in 0..config.prompts {
        let prompt = &tokens[p * stride..p * stride + config.prefix];
        for (v, f) in std::iter::once(&reference).chain(&variants).enumerate() {
            progress(&format!("prompt {}/{}: {f}", p + 1, config.prompts));
            runs[v].push(greedy(CacheMode::form(*f), prompt)?);
        }
    }
    let matches = |a: &[Vec<u32>], b: &[Vec<u32>], n: usize| -> usize {
        a.iter()
            .zip(b)
            .map(|(x, y)| x.iter().zip(y).take(n).filter(|(s, t)| s == t).count())
            .sum()
    };
    let rows = variants
        .iter()
        .enumerate()
        .map(|(v, f)| {
            let got = &runs[v + 1];
            let prefix: usize = got
                .iter()
                .zip(&runs[0])
                .map(|(x, y)| x.iter().zip(y).take_while(|(s, t)| s == t).count())
                .sum();
            DriftRow {
                form: f.to_string(),
                matches_reference: config
                    .checkpoints
                    .iter()
                    .map(|&n| matches(got, &runs[0], n))
                    .collect(),
                matches_stream_off: config
                    .checkpoints
                    .iter()
                    .map(|&n| matches(got, &runs[1], n))
                    .collect(),
                mean_agreeing_prefix: prefix as f64 / config.prompts as f64,
            }
        })
        .collect();
    Ok(DriftReport {
        reference: reference.to_string(),
        prompts: config.prompts,
        prefix: config.prefix,
        checkpoints: config.checkpoints.clone(),
        rows,
    })
}

impl DriftReport {
    /// The table as Markdown: matches as `count/total (percent)`.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "{} prompts of {} tokens, greedy; matches against `{}` (and, after the slash, \
             against the same prefill with the stream off)\n\n| form |",
            self.prompts, self.prefix, self.reference
        );
        for n in &self.checkpoints {
            s += &format!(" after {n} |");
        }
        s += " tokens before the first difference (mean) |\n|---|";
        for _ in &self.checkpoints {
            s += "---|";
        }
        s += "---|\n";
        for r in &self.rows {
            s += &format!("| `{}` |", r.form);
            for ((&n, &a), &b) in self
                .checkpoints
                .iter()
                .zip(&r.matches_reference)
                .zip(&r.matches_stream_off)
            {
                let total = n * self.prompts;
                s += &format!(
                    " {a}/{total} ({:.1}%) / {:.1}% |",
                    100.0 * a as f64 / total as f64,
                    100.0 * b as f64 / total as f64
                );
            }
            s += &format!(" {:.1} |\n", r.mean_agreeing_prefix);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_set_only_the_stream() {
        let f: CacheForm = "shard-k2+win32".parse().unwrap();
        let v: Vec<String> = stream_variants(&f)
            .unwrap()
            .iter()
            .map(|f| f.to_string())
            .collect();
        assert_eq!(
            v,
            ["shard-k2-soff+win32", "shard-k2-s4+win32", "shard-k2+win32"]
        );
        assert!(stream_variants(&"int4".parse().unwrap()).is_err());
    }
}
