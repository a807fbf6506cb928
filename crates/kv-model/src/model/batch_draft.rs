//! Drafting for a speculating batch ([`BatchDrafters`]): a [`Drafter`] of
//! its own for each request (prompt lookup, the target reading its own
//! cache's draft view), or one draft model drafting for every request of a
//! step together ([`BatchModelDrafter`]: one batched forward pass of the
//! draft model per drafted token, its weights read once for all the
//! requests, where a drafter per request reads them once per request).

use attention::{DenseBackend, KvBackend};
use gf2_codes::channel::FaultRng;

use super::speculative::check_draft_vocab;
use super::{Adapted, BatchItem, CausalLm, Drafter, Sampling};
use crate::error::{ModelError, Result};

/// How the requests of a speculating batch draft.
pub enum BatchDrafters<'a> {
    /// Request `i` drafts with drafter `i` (one per request, dropped when
    /// it finishes).
    PerRequest(Vec<Box<dyn Drafter + 'a>>),
    /// One draft model for every request, in batched passes.
    Model(BatchModelDrafter<'a>),
}

impl std::fmt::Debug for BatchDrafters<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PerRequest(d) => write!(f, "PerRequest({} drafters)", d.len()),
            Self::Model(m) => m.fmt(f),
        }
    }
}

/// What a batched draft model drafts for: a request, its context (prompt
/// and every token so far, the next one last) and how many tokens.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DraftAsk {
    pub(crate) request: usize,
    pub(crate) context: Vec<u32>,
    pub(crate) k: usize,
}

/// One request's draft cache and the tokens it holds.
#[derive(Debug)]
struct DraftCache {
    cache: Adapted<DenseBackend>,
    fed: Vec<u32>,
}

impl DraftCache {
    fn empty() -> Self {
        Self {
            cache: Adapted(DenseBackend::new()),
            fed: Vec::new(),
        }
    }
}

/// A draft model with the target's vocabulary drafting greedily for every
/// request of a batch: each step, each request's dense cache is cut back
/// to the tokens it shares with the request's context, the catch-up
/// tokens of all requests run as one batched pass, then one batched pass
/// per drafted token (a request leaves the batch when it has its `k`).
/// A request's cache is freed when it finishes.
pub struct BatchModelDrafter<'m> {
    model: &'m dyn CausalLm,
    caches: Vec<DraftCache>,
}

impl std::fmt::Debug for BatchModelDrafter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchModelDrafter")
            .field("model", &self.model.describe())
            .field("requests", &self.caches.len())
            .finish()
    }
}

impl<'m> BatchModelDrafter<'m> {
    /// Drafts with `model` for `requests` requests of a target of `vocab`
    /// tokens; refuses a model of another vocabulary.
    pub fn new(model: &'m dyn CausalLm, vocab: usize, requests: usize) -> Result<Self> {
        check_draft_vocab(model, vocab)?;
        Ok(Self {
            model,
            caches: (0..requests).map(|_| DraftCache::empty()).collect(),
        })
    }

    /// The requests it drafts for.
    pub fn requests(&self) -> usize {
        self.caches.len()
    }

    /// Frees request `request`'s draft cache (it finished).
    pub(crate) fn release(&mut self, request: usize) {
        if let Some(c) = self.caches.get_mut(request) {
            *c = DraftCache::empty();
        }
    }

    /// Each ask's `k` greedy drafts (none for an empty context or `k` 0),
    /// in the asks' order. Asks must name distinct requests.
    pub(crate) fn propose_all(&mut self, asks: &[DraftAsk]) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); asks.len()];
        // The asks that draft, by request (the caches are taken in that
        // order, each once).
        let mut live: Vec<usize> = (0..asks.len())
            .filter(|&i| asks[i].k > 0 && !asks[i].context.is_empty())
            .collect();
        live.sort_unstable_by_key(|&i| asks[i].request);
        if live
            .windows(2)
            .any(|w| asks[w[0]].request == asks[w[1]].request)
            || live.iter().any(|&i| asks[i].request >= self.caches.len())
        {
            return Err(ModelError::InvalidParameter {
                name: "asks",
                reason: format!(
                    "a request asked twice or past the drafter's {} requests",
                    self.caches.len()
                ),
            });
        }
        // Each cache cut back to what it shares with its context; what
        // follows is the first pass's tokens.
        let mut feeds = Vec::with_capacity(live.len());
        for &i in &live {
            let (ask, c) = (&asks[i], &mut self.caches[asks[i].request]);
            let shared = c
                .fed
                .iter()
                .zip(&ask.context)
                .take_while(|(a, b)| a == b)
                .count()
                .min(ask.context.len() - 1);
            c.cache.truncate(shared)?;
            c.fed.truncate(shared);
            feeds.push(ask.context[shared..].to_vec());
        }
        let (greedy, model) = (Sampling::default(), self.model);
        let mut rng = FaultRng::with_stream(0, 0);
        while !live.is_empty() {
            let logits = {
                let mut caches = self.caches_of(live.iter().map(|&i| asks[i].request));
                let mut items: Vec<BatchItem<'_>> = caches
                    .iter_mut()
                    .zip(&feeds)
                    .map(|(c, feed)| BatchItem {
                        tokens: feed,
                        cache: &mut c.cache,
                        logits_from: feed.len() - 1,
                    })
                    .collect();
                model.forward_batch(&mut items)?
            };
            let mut next = (Vec::new(), Vec::new());
            for ((&i, feed), logits) in live.iter().zip(feeds).zip(&logits) {
                let c = &mut self.caches[asks[i].request];
                c.fed.extend_from_slice(&feed);
                let token = greedy.pick(logits, &mut rng);
                out[i].push(token);
                if out[i].len() < asks[i].k {
                    next.0.push(i);
                    next.1.push(vec![token]);
                }
            }
            (live, feeds) = next;
        }
        Ok(out)
    }

    /// The caches of `requests` (ascending, distinct), mutably.
    fn caches_of(&mut self, requests: impl Iterator<Item = usize>) -> Vec<&mut DraftCache> {
        let mut want = requests.peekable();
        let mut got = Vec::new();
        for (r, c) in self.caches.iter_mut().enumerate() {
            if want.peek() == Some(&r) {
                want.next();
                got.push(c);
            }
        }
        got
    }
}
