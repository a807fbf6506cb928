//! The models and what they share: the [`CausalLm`] interface (a forward
//! pass over any [`KvBackend`], the [`ModelCache`]), the projections
//! ([`Projection`]: weights as stored, multiplied by this crate's kernels,
//! or dense f32 through abft-gemm's linear layer) and the hook that may
//! replace their products ([`ProjectionHook`]: kv-eval's GEMM checks), and
//! their integrity ([`WeightGuard`]); generation ([`generate`]),
//! speculative decoding ([`generate_speculative`]) and continuous batching
//! ([`batch`]) on top. Llama-family models in [`llama`], GPT-2 in
//! [`gpt2`].

mod backend;
pub mod batch;
mod batch_draft;
mod generate;
pub mod gpt2;
mod guard;
pub mod llama;
mod projection;
mod speculative;

pub use abft_gemm::Matrix;
pub use backend::Adapted;
pub use generate::{GenerateOptions, Generated, Sampling, check_prompt, generate};
pub use gpt2::{Gpt2Config, Gpt2Layer, Gpt2Model};
pub use guard::{DEFAULT_ROWS_PER_GROUP, DamagedRow, GuardReport, RowRepair, WeightGuard};
pub use llama::{LlamaArch, LlamaConfig, LlamaLayer, LlamaModel, LoadOptions};
pub(crate) use projection::{HookSlot, listed, project};
pub use projection::{Projection, ProjectionHook, ProjectionId, ProjectionKind};
pub use speculative::{
    Draft, Drafter, ModelDrafter, PromptLookup, SelfDrafter, SpeculativeGenerated,
    SpeculativeOptions, SpeculativeStats, check_speculative, generate_speculative,
};

use attention::{Attention, AttentionConfig, HeadShape, KvBackend, Numerics, OnNonFinite, Rope};

use crate::error::{ModelError, Result};

/// The KV cache a forward pass talks to: any [`KvBackend`] whose errors are
/// this crate's (the f32 oracle, the paged cache, kv-eval's re-encode
/// protocol: a backend with errors of its own reports them as
/// [`ModelError::External`]), borrowing for `'c` what it borrows (a
/// self-speculative draft's [`attention::DraftOverlay`] borrows its
/// target's cache).
pub type ModelCache<'c> = dyn KvBackend<Error = ModelError> + 'c;

/// A causal language model whose K and V go through a [`KvBackend`].
pub trait CausalLm: Send + Sync {
    /// Vocabulary size (logits per token).
    fn vocab(&self) -> usize;
    /// Transformer blocks.
    fn layers(&self) -> usize;
    /// K (or V) channels per token and layer.
    fn kv_channels(&self) -> usize;
    /// Channels per attention head.
    fn head_dim(&self) -> usize;
    /// The rotary embedding of the keys, if the model has one (forms that
    /// project keys before RoPE undo and redo it).
    fn rope(&self) -> Option<&Rope> {
        None
    }
    /// The context the model was trained to (positions past it are
    /// refused by learned-position models and unreliable for RoPE ones).
    fn context(&self) -> Option<usize> {
        None
    }
    /// Every projection of the forward pass with its identity, in the
    /// order the pass multiplies them (the output head last).
    fn projections(&self) -> Vec<(ProjectionId, &Projection)>;
    /// [`projections`](Self::projections), to change in place (a
    /// [`WeightGuard`]'s repairs, a fault experiment's flips): the same
    /// order; a tied output head is the token embedding.
    fn projections_mut(&mut self) -> Vec<(ProjectionId, &mut Projection)>;
    /// Computes every projection through `hook` from now on (`None`: the
    /// plain products). A cloned model starts without a hook.
    fn set_projection_hook(&mut self, hook: Option<std::sync::Arc<dyn ProjectionHook>>);
    /// How attention scores integer-coded keys from now on.
    fn set_numerics(&mut self, numerics: attention::Numerics);
    /// The instruction set of attention's kernels from now on
    /// ([`attention::Isa`]; the weight products keep their own choice); an
    /// error, and no change, where this CPU lacks it.
    fn set_attention_isa(&mut self, isa: attention::Isa) -> Result<()>;
    /// Whether the forward pass skips the layers a cache asks it to skip
    /// (`KvBackend::skips_layer`: a shallower self-speculative draft). The
    /// default: no.
    fn can_skip_layers(&self) -> bool {
        false
    }
    /// A one-line description (architecture and shape).
    fn describe(&self) -> String;
    /// Bytes the weights take in memory.
    fn weight_bytes(&self) -> usize;
    /// Runs `tokens` after what `cache` already holds (their positions
    /// follow the cache's), appends their K and V to it as one step
    /// (committed on success, rolled back on error), and returns the logits
    /// (`vocab` per token) of the tokens from index `logits_from` on.
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
    ) -> Result<Vec<f32>>;

    /// As [`forward`](Self::forward), but commits only the first
    /// `keep(&logits)` tokens of the step and drops the rest from every
    /// layer of `cache` (speculative decoding: the target verifies its
    /// drafts in one pass and keeps the accepted ones, through
    /// `KvBackend::commit_prefix`). A `keep` past the tokens is refused
    /// and the step undone.
    fn forward_keeping(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
        keep: &mut dyn FnMut(&[f32]) -> usize,
    ) -> Result<Vec<f32>>;

    /// Runs several sequences as one batch: each item's tokens after what
    /// its cache holds, its logits from `logits_from` on (as
    /// [`forward`](Self::forward) returns them, one vector per item).
    /// Llama-family models share every projection's GEMM across the batch
    /// (the weights are read once per step, not once per sequence) and
    /// attend per sequence; an error rolls every item's step back. This
    /// default runs the items one after the other (an error leaves the
    /// items before it committed).
    fn forward_batch(&self, batch: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter_mut()
            .map(|item| self.forward(item.tokens, &mut *item.cache, item.logits_from))
            .collect()
    }

    /// [`forward_batch`](Self::forward_batch) committing only the first
    /// `keep(i, &logits)` tokens of item `i`'s step (speculative decoding
    /// in a batch: each sequence verifies its drafts and keeps the
    /// accepted ones). The default runs the items one at a time through
    /// [`forward_keeping`](Self::forward_keeping); Llama-family models run
    /// them as one batch.
    fn forward_batch_keeping(
        &self,
        batch: &mut [BatchItem<'_>],
        keep: &mut dyn FnMut(usize, &[f32]) -> usize,
    ) -> Result<Vec<Vec<f32>>> {
        batch
            .iter_mut()
            .enumerate()
            .map(|(i, item)| {
                self.forward_keeping(item.tokens, &mut *item.cache, item.logits_from, &mut |l| {
                    keep(i, l)
                })
            })
            .collect()
    }
}

/// One sequence of a batched forward pass ([`CausalLm::forward_batch`]).
pub struct BatchItem<'a> {
    /// Its new tokens.
    pub tokens: &'a [u32],
    /// Its cache.
    pub cache: &'a mut ModelCache<'a>,
    /// Index of its first token whose logits are returned.
    pub logits_from: usize,
}

impl std::fmt::Debug for BatchItem<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchItem")
            .field("tokens", &self.tokens)
            .field("cached", &self.cache.tokens())
            .field("logits_from", &self.logits_from)
            .finish()
    }
}

/// Refuses an empty call, a `logits_from` past the tokens and ids outside
/// the vocabulary.
fn check_tokens(tokens: &[u32], vocab: usize, logits_from: usize) -> Result<()> {
    let t = tokens.len();
    if t == 0 || logits_from > t {
        return Err(ModelError::EmptyForward {
            tokens: t,
            logits_from,
        });
    }
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ModelError::TokenId { id, vocab });
    }
    Ok(())
}

/// [`forward_step`] for a batch: checks every item and sizes its cache,
/// opens a step on each, runs `step` over them all, then commits every
/// step, or rolls every open step back if anything failed.
pub(crate) fn forward_steps(
    batch: &mut [BatchItem<'_>],
    vocab: usize,
    model: &attention::ModelKvShape<'_>,
    step: impl FnOnce(&mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    forward_steps_keeping(batch, vocab, model, None, step)
}

/// How many tokens of item `i`'s step to commit, given its logits
/// ([`CausalLm::forward_batch_keeping`]).
pub(crate) type KeepRows<'a> = dyn FnMut(usize, &[f32]) -> usize + 'a;

/// [`forward_steps`], committing only the first `keep(i, &logits)` tokens
/// of item `i`'s step where `keep` is given
/// ([`CausalLm::forward_batch_keeping`]).
pub(crate) fn forward_steps_keeping(
    batch: &mut [BatchItem<'_>],
    vocab: usize,
    model: &attention::ModelKvShape<'_>,
    mut keep: Option<&mut KeepRows<'_>>,
    step: impl FnOnce(&mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    for item in batch.iter_mut() {
        check_tokens(item.tokens, vocab, item.logits_from)?;
        item.cache.fit(model)?;
    }
    for i in 0..batch.len() {
        let item = &mut batch[i];
        if let Err(e) = item.cache.begin(item.tokens) {
            for open in &mut batch[..i] {
                open.cache.rollback();
            }
            return Err(e);
        }
    }
    match step(batch) {
        Ok(out) => {
            for i in 0..batch.len() {
                let cache = &mut batch[i].cache;
                let committed = match keep.as_mut() {
                    Some(keep) => cache.commit_prefix(keep(i, &out[i])),
                    None => cache.commit(),
                };
                if let Err(e) = committed {
                    // The steps not yet committed are undone.
                    for open in &mut batch[i + 1..] {
                        open.cache.rollback();
                    }
                    return Err(e);
                }
            }
            Ok(out)
        }
        Err(e) => {
            for item in batch.iter_mut() {
                item.cache.rollback();
            }
            Err(e)
        }
    }
}

/// The set-up every forward pass shares: refuses an empty call, a
/// `logits_from` past the tokens and ids outside the vocabulary, sizes
/// `cache` for `model`, then runs `step` as one cache step (committed on
/// success, rolled back on error).
pub(crate) fn forward_step(
    tokens: &[u32],
    vocab: usize,
    logits_from: usize,
    model: &attention::ModelKvShape<'_>,
    cache: &mut ModelCache<'_>,
    step: impl FnOnce(&mut ModelCache<'_>) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    check_tokens(tokens, vocab, logits_from)?;
    cache.fit(model)?;
    attention::run_step(cache, tokens, step)
}

/// [`forward_step`], committing only the first `keep(&logits)` tokens of
/// the step ([`CausalLm::forward_keeping`]).
pub(crate) fn forward_step_keeping(
    tokens: &[u32],
    vocab: usize,
    logits_from: usize,
    model: &attention::ModelKvShape<'_>,
    cache: &mut ModelCache<'_>,
    keep: &mut dyn FnMut(&[f32]) -> usize,
    step: impl FnOnce(&mut ModelCache<'_>) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    check_tokens(tokens, vocab, logits_from)?;
    cache.fit(model)?;
    cache.begin(tokens)?;
    match step(cache) {
        Ok(logits) => {
            cache.commit_prefix(keep(&logits))?;
            Ok(logits)
        }
        Err(e) => {
            cache.rollback();
            Err(e)
        }
    }
}

/// The attention every model starts with: the evaluation's reference
/// numerics and tiling (every published table was measured with exact
/// scores over 64-row tiles; `set_numerics` picks other numerics), and
/// non-finite outputs reported rather than refused (a fault experiment
/// measures them).
pub(crate) fn reference_attention(shape: HeadShape) -> Result<Attention> {
    Ok(Attention::with_config(
        shape,
        AttentionConfig {
            on_non_finite: OnNonFinite::Report,
            numerics: Numerics::Exact,
            tile_tokens: 64,
            tile_bytes: None,
            ..AttentionConfig::default()
        },
    )?)
}

/// Refuses a normalisation epsilon that is NaN, infinite or not positive
/// (it would turn every hidden state into NaN or ∞ without a word).
pub(crate) fn check_norm_eps(eps: f32) -> Result<()> {
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(ModelError::ModelFile(format!(
            "normalisation epsilon {eps} is not a positive finite number"
        )))
    }
}
