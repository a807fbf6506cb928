//! The drift of a `shard` cache's decode stream (`shard-kv-compression-blog.md`,
//! section 8): prompts cut from the corpus are prefilled into a `shard`
//! cache, then the model generates greedily; tokens generated after the
//! prefill go to the decode stream, kept in f16 (`-soff`) or quantised per
//! token by Hadamard + Lloyd-Max (`-s4`, `-s8`, and the blog's "4-bit +
//! QJL" as `-s3q`: three Lloyd-Max bits and the sketch's bit), or, under a
//! fold chunk `C`, folded into the compressed middle every `C` tokens
//! (`-f<C>`, from the 8-bit stream and from f16). Each run's tokens are
//! compared position by position with a reference run (an `fp16` cache)
//! and with the same `shard` prefill whose stream is off, so the stream's
//! own drift is seen apart from the prefill's compression.

use kv_model::model::Sampling;
use serde::Serialize;

use crate::backend::BackendKind;
use crate::cache::CacheMode;
use crate::error::{EvalError, Result};
use crate::generate::{GenerateConfig, generate};
use kv_model::model::CausalLm;
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
    /// Also fold generated tokens into the middle in chunks of this many.
    pub fold: Option<usize>,
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

/// The stream settings of a `shard` form: off, 3-bit Lloyd-Max + QJL,
/// 4-bit and 8-bit Lloyd-Max, then, with a `fold` chunk, folding from the
/// 8-bit stream and from f16 (stream off).
pub fn stream_variants(form: &CacheForm, fold: Option<usize>) -> Result<Vec<CacheForm>> {
    let Quantizer::Shard(spec) = *form.quantizer() else {
        return Err(EvalError::InvalidParameter {
            name: "form",
            reason: format!("{form} is not a shard form"),
        });
    };
    let mut settings = vec![
        (None, false, None),
        (Some(3), true, None),
        (Some(4), false, None),
        (Some(8), false, None),
    ];
    if fold.is_some() {
        settings.extend([(Some(8), false, fold), (None, false, fold)]);
    }
    settings
        .into_iter()
        .map(|(stream, stream_qjl, fold)| {
            let q = Quantizer::Shard(kv_quant::ShardSpec {
                stream,
                stream_qjl,
                fold,
                ..spec
            });
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
    let trained = model.context().unwrap_or(usize::MAX);
    if config
        .prefix
        .checked_add(config.new_tokens)
        .is_none_or(|c| c > trained)
    {
        return Err(EvalError::InvalidParameter {
            name: "new-tokens",
            reason: format!(
                "a prefix of {} and {} new tokens pass the model's trained context of {trained}",
                config.prefix, config.new_tokens
            ),
        });
    }
    if config
        .prefix
        .checked_add(config.prompts)
        .is_none_or(|n| tokens.len() < n)
    {
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
    let variants = stream_variants(form, config.fold)?;
    let stride = (tokens.len() - config.prefix) / config.prompts;
    let greedy = |mode: CacheMode, prompt: &[u32]| -> Result<Vec<u32>> {
        let c = GenerateConfig {
            mode,
            backend: BackendKind::Reencode,
            context: config.prefix + config.new_tokens,
            max_new: config.new_tokens,
            sampling: Sampling::default(),
            faults: None,
            prefill_step: None,
            eviction: None,
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
        let names = |fold| -> Vec<String> {
            stream_variants(&f, fold)
                .unwrap()
                .iter()
                .map(|f| f.to_string())
                .collect()
        };
        let unfolded = [
            "shard-k2-soff+win32",
            "shard-k2-s3q+win32",
            "shard-k2-s4+win32",
            "shard-k2+win32",
        ];
        assert_eq!(names(None), unfolded);
        let mut folded = unfolded.map(String::from).to_vec();
        folded.extend([
            "shard-k2-f64+win32".into(),
            "shard-k2-soff-f64+win32".into(),
        ]);
        assert_eq!(names(Some(64)), folded);
        assert!(stream_variants(&"int4".parse().unwrap(), None).is_err());
        // A fold chunk the form cannot take is the form's error.
        assert!(stream_variants(&f, Some(3)).is_err());
    }
}
