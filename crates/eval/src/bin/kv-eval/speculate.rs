//! The `--speculate` flag of `kv-eval generate` and `kv-eval batch`:
//! `lookup[:k=K]`, `draft:MODEL[:k=K]` or `self[:skip=LAYERS][:k=K]`, and
//! the drafters it names.

use std::path::{Path, PathBuf};

use kv_model::model::batch::{BatchDrafters, BatchModelDrafter, BatchRequest};
use kv_model::model::{CausalLm, Drafter, PromptLookup, SelfDrafter};
use kv_model::tokenizer::TextTokenizer;

use crate::{Error, load_model, model_path};

/// A `--speculate` spelling.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Speculate {
    /// Prompt lookup, `k` drafts per step.
    Lookup { k: usize },
    /// A draft model, `k` drafts per step.
    Draft { model: PathBuf, k: usize },
    /// The model itself through its cache's draft view, `k` drafts per
    /// step, the layers `skip` skipped.
    SelfDraft { k: usize, skip: Vec<usize> },
}

impl Speculate {
    /// The drafter and k, in words.
    pub(crate) fn describe(&self) -> String {
        let k = self.k();
        match self {
            Self::Lookup { .. } => format!("prompt lookup, k={k}"),
            Self::Draft { model, .. } => format!("draft model {}, k={k}", model.display()),
            Self::SelfDraft { skip, .. } if skip.is_empty() => {
                format!("self, upper 4-bit plane, k={k}")
            }
            Self::SelfDraft { skip, .. } => format!(
                "self, upper 4-bit plane, {} layers skipped, k={k}",
                skip.len()
            ),
        }
    }

    /// Drafts per step.
    pub(crate) fn k(&self) -> usize {
        match self {
            Self::Lookup { k } | Self::Draft { k, .. } | Self::SelfDraft { k, .. } => *k,
        }
    }
}

/// Parses `lookup[:k=K]`, `draft:MODEL[:k=K]` or `self[:k=K]`.
pub(crate) fn parse_speculate(s: &str) -> Result<Speculate, String> {
    let (head, k) = match s.rsplit_once(":k=") {
        Some((head, k)) => {
            let k: usize = k
                .parse()
                .map_err(|_| format!("{s:?}: k={k} is not a number of drafts"))?;
            if k == 0 {
                return Err(format!("{s:?}: k=0 drafts nothing (k is at least 1)"));
            }
            (head, k)
        }
        // Eight rows a verification: one group of the token-lane kernels.
        None => (s, 7),
    };
    match head.split_once(':') {
        None if head == "lookup" => Ok(Speculate::Lookup { k }),
        Some(("draft", model)) if !model.is_empty() => Ok(Speculate::Draft {
            model: PathBuf::from(model),
            k,
        }),
        None if head == "self" => Ok(Speculate::SelfDraft {
            k,
            skip: Vec::new(),
        }),
        Some(("self", layers)) => match layers.strip_prefix("skip=").map(parse_layers) {
            Some(Ok(skip)) => Ok(Speculate::SelfDraft { k, skip }),
            Some(Err(e)) => Err(format!("{s:?}: {e}")),
            None => Err(format!(
                "{s:?}: self takes skip=LAYERS (for example skip=12-19,22)"
            )),
        },
        _ => Err(format!(
            "{s:?} is not lookup[:k=K], draft:MODEL[:k=K] (MODEL a GGUF file, a folder or a \
             fetched model name) or self[:k=K]"
        )),
    }
}

/// Parses a layer list: numbers and ranges `A-B` (inclusive), separated
/// by commas, at most [`MAX_LAYER`].
pub(crate) fn parse_layers(s: &str) -> Result<Vec<usize>, String> {
    const MAX_LAYER: usize = 4096;
    let number = |n: &str| match n.parse::<usize>() {
        Ok(l) if l < MAX_LAYER => Ok(l),
        _ => Err(format!(
            "layer {n:?} is not a layer number below {MAX_LAYER}"
        )),
    };
    let mut layers = Vec::new();
    for item in s.split(',') {
        match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(format!("layers {a}-{b}: the range runs backwards"));
                }
                layers.extend(a..=b);
            }
            None => layers.push(number(item)?),
        }
    }
    Ok(layers)
}

/// Loads the draft model `path` names (a GGUF file, a folder or a fetched
/// model's name), refused where it does not share `tokenizer`: another
/// vocabulary size, or any token spelled otherwise in its vocabulary.
pub(crate) fn load_draft(
    path: &Path,
    target: &dyn CausalLm,
    tokenizer: &TextTokenizer,
) -> Result<Box<dyn CausalLm>, Error> {
    let (draft, draft_tokenizer) = load_model(&model_path(&Some(path.to_path_buf()))?)?;
    let vocab = target.vocab();
    let differs = draft.vocab() != vocab
        || draft_tokenizer.vocab_size() != tokenizer.vocab_size()
        || (0..tokenizer.vocab_size() as u32)
            .any(|id| tokenizer.token(id) != draft_tokenizer.token(id));
    if differs {
        return Err(format!(
            "the draft model {} does not share the target's tokenizer (vocabularies of {} and \
             {vocab} tokens, or a token spelled otherwise)",
            path.display(),
            draft.vocab()
        )
        .into());
    }
    Ok(draft)
}

/// The drafters of a batch, as `how` names them: prompt lookup for each
/// request, `draft` (loaded by [`load_draft`]) drafting greedily for every
/// request in batched passes, or `target` reading its cache's draft view
/// for each request with its sampling.
pub(crate) fn batch_drafters<'a>(
    how: &Speculate,
    target: &'a dyn CausalLm,
    draft: Option<&'a dyn CausalLm>,
    requests: &[BatchRequest],
) -> Result<BatchDrafters<'a>, Error> {
    Ok(match how {
        Speculate::Lookup { .. } => BatchDrafters::PerRequest(
            requests
                .iter()
                .map(|_| Box::new(PromptLookup::default()) as Box<dyn Drafter>)
                .collect(),
        ),
        Speculate::Draft { model, .. } => {
            let draft = draft
                .ok_or_else(|| format!("the draft model {} is not loaded", model.display()))?;
            BatchDrafters::Model(BatchModelDrafter::new(
                draft,
                target.vocab(),
                requests.len(),
            )?)
        }
        Speculate::SelfDraft { skip, .. } => BatchDrafters::PerRequest(
            requests
                .iter()
                .map(|q| -> Result<Box<dyn Drafter + 'a>, Error> {
                    Ok(Box::new(
                        SelfDrafter::new(target, q.sampling)?.skipping(skip)?,
                    ))
                })
                .collect::<Result<_, _>>()?,
        ),
    })
}
