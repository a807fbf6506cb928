//! Speculative decoding in a continuous batch on the tiny model: every
//! request of a batch drafts with a drafter of its own (prompt lookup, a
//! draft model, the target reading its hierarchical cache's upper plane),
//! the batched pass verifies all of them, and each request's greedy output
//! is the plain batch's token for token, with preemption and prefix
//! sharing in play; bad settings are refused before any work.

mod common;

use std::sync::Arc;

use attention::DenseBackend;
use kv_model::ModelError;
use kv_model::model::batch::{
    BatchDrafters, BatchModelDrafter, BatchRequest, BatchSpeculation, Served, serve_batch,
    serve_batch_speculative,
};
use kv_model::model::{
    Adapted, CausalLm, Drafter, LlamaModel, ModelDrafter, PromptLookup, Sampling, SelfDrafter,
};
use paged_cache::scheduler::{Preemption, SchedulerConfig};
use paged_cache::{BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, LayerSpec};

use common::{LAYERS, VOCAB, tiny};

/// Four requests whose prompts repeat themselves (prompt lookup finds
/// matches) and share a first block, arriving over three steps.
fn requests() -> Vec<BatchRequest> {
    let shared = [3u32, 17, 5, 9, 3, 17, 5, 22];
    (0..4u32)
        .map(|i| BatchRequest {
            prompt: shared
                .iter()
                .copied()
                .chain((0..6 + i).map(|j| (j * 7 + i) % VOCAB as u32))
                .chain([3, 17])
                .collect(),
            max_new_tokens: 14 + 3 * i as usize,
            arrival_step: u64::from(i / 2 + i % 2),
            priority: i % 2,
            sampling: Sampling::default(),
        })
        .collect()
}

fn cache(m: &LlamaModel, key: &str, value: &str, blocks: usize) -> KvCacheManager<HashPrefixCache> {
    let config = CacheConfig {
        num_blocks: blocks,
        block_size: 4,
        host_blocks: 32,
    };
    let spec = LayerSpec {
        key: key.parse().unwrap(),
        value: value.parse().unwrap(),
        channels: m.kv_channels(),
    };
    let storage = BlockStorage::new(blocks, 4, &vec![spec; LAYERS]).unwrap();
    KvCacheManager::with_storage(config, HashPrefixCache::new(4), Arc::new(storage)).unwrap()
}

fn scheduler(preemption: Preemption) -> SchedulerConfig {
    SchedulerConfig {
        preemption,
        ..SchedulerConfig::default()
    }
}

fn plain(m: &LlamaModel, key: &str, value: &str, blocks: usize, preemption: Preemption) -> Served {
    let requests = requests();
    serve_batch(
        m,
        &requests,
        &mut cache(m, key, value, blocks),
        &scheduler(preemption),
        &mut |_, _| Ok(()),
    )
    .unwrap()
}

fn speculative<'a>(
    m: &'a LlamaModel,
    requests: &'a [BatchRequest],
    (key, value, blocks): (&str, &str, usize),
    preemption: Preemption,
    k: usize,
    drafters: BatchDrafters<'a>,
) -> Result<Served, ModelError> {
    let mut cache = cache(m, key, value, blocks);
    let mut on_finished = |_: usize, _: &_| Ok(());
    serve_batch_speculative(
        m,
        requests,
        &mut cache,
        &scheduler(preemption),
        BatchSpeculation { k, drafters },
        &mut on_finished,
    )
}

#[test]
fn batched_speculation_is_the_plain_batch_token_for_token() {
    let target = tiny(0, |_| true);
    let other = tiny(5_000, |_| true);
    let requests = requests();
    for (key, value, blocks, preemption) in [
        ("fp32", "fp32", 64, Preemption::Recompute),
        ("int8h", "int8h-g4", 64, Preemption::Recompute),
        ("int8h", "int8h", 14, Preemption::Recompute),
        ("int8h-g8+secded84", "int8h", 14, Preemption::Swap),
        // Staged forms: each verification stops where a block seals.
        ("int4-ch+sink4", "int4", 64, Preemption::Recompute),
        ("int8h-ch", "int8h", 14, Preemption::Recompute),
    ] {
        let want = plain(&target, key, value, blocks, preemption);
        let hierarchical = key.starts_with("int8h");
        for (name, k) in [("lookup", 3), ("model", 2), ("batched", 3), ("self", 4)] {
            if name == "self" && !hierarchical {
                continue;
            }
            let per_request: Vec<Box<dyn Drafter + '_>> = (0..requests.len())
                .map(|_| -> Box<dyn Drafter + '_> {
                    match name {
                        "lookup" => Box::new(PromptLookup::default()),
                        "model" => Box::new(
                            ModelDrafter::new(
                                &other,
                                Adapted(DenseBackend::new()),
                                VOCAB,
                                Sampling::default(),
                            )
                            .unwrap(),
                        ),
                        _ => Box::new(SelfDrafter::new(&target, Sampling::default()).unwrap()),
                    }
                })
                .collect();
            // The other model for every request in batched passes.
            let drafters = match name {
                "batched" => BatchDrafters::Model(
                    BatchModelDrafter::new(&other, VOCAB, requests.len()).unwrap(),
                ),
                _ => BatchDrafters::PerRequest(per_request),
            };
            let got = speculative(
                &target,
                &requests,
                (key, value, blocks),
                preemption,
                k,
                drafters,
            )
            .unwrap();
            let case = format!("{key}/{value}, {blocks} blocks, {preemption:?}, {name} k={k}");
            for (i, (g, w)) in got.outputs.iter().zip(&want.outputs).enumerate() {
                assert_eq!(g.tokens, w.tokens, "{case}: request {i}");
                assert_eq!(g.token_times.len(), g.tokens.len(), "{case}");
            }
            let stats = got.speculation.expect("a speculating batch reports");
            assert!(
                stats.accepted > 0 && stats.accepted <= stats.drafted,
                "{case}: {stats:?}"
            );
            assert_eq!(got.scheduler.accepted_tokens, stats.accepted, "{case}");
            assert!(
                got.scheduler.steps <= want.scheduler.steps,
                "{case}: {:?}",
                got.scheduler
            );
            assert_eq!(
                got.scheduler.decoded_tokens, want.scheduler.decoded_tokens,
                "{case}"
            );
            if blocks == 14 {
                let s = &got.scheduler;
                assert!(
                    s.preempted_recompute + s.preempted_swap > 0,
                    "{case}: {s:?}"
                );
            }
            if name == "self" {
                // The target's own draft over an 8-bit cache's upper plane
                // is nearly always right.
                assert!(stats.accepted * 2 > stats.drafted, "{case}: {stats:?}");
            }
        }
    }
}

/// A drafter that never proposes anything.
struct Never;

impl Drafter for Never {
    fn propose(&mut self, _: &[u32], _: usize) -> Result<kv_model::model::Draft, ModelError> {
        Ok(kv_model::model::Draft::default())
    }
}

/// Sampled requests whose drafters never propose draw, step by step, from
/// the streams the plain batch draws from (stream `1 + i` for output
/// index `i`): the same tokens, under preemption too.
#[test]
fn sampled_requests_without_drafts_draw_what_the_plain_batch_draws() {
    let target = tiny(0, |_| true);
    let mut requests = requests();
    for (i, q) in requests.iter_mut().enumerate() {
        q.sampling = Sampling {
            temperature: 0.9,
            top_p: 0.95,
            seed: 11 + i as u64,
        };
    }
    for (blocks, preemption) in [(64, Preemption::Recompute), (14, Preemption::Swap)] {
        let want = serve_batch(
            &target,
            &requests,
            &mut cache(&target, "fp32", "fp32", blocks),
            &scheduler(preemption),
            &mut |_, _| Ok(()),
        )
        .unwrap();
        let never: Vec<Box<dyn Drafter + '_>> = (0..requests.len())
            .map(|_| Box::new(Never) as Box<dyn Drafter>)
            .collect();
        let got = speculative(
            &target,
            &requests,
            ("fp32", "fp32", blocks),
            preemption,
            3,
            BatchDrafters::PerRequest(never),
        )
        .unwrap();
        for (i, (g, w)) in got.outputs.iter().zip(&want.outputs).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{blocks} blocks: request {i}");
        }
        assert_eq!(got.speculation.unwrap().drafted, 0);
        // Sampling does change the outputs (the check means something).
        let greedy = plain(&target, "fp32", "fp32", blocks, preemption);
        assert_ne!(
            greedy.outputs.iter().map(|o| &o.tokens).collect::<Vec<_>>(),
            want.outputs.iter().map(|o| &o.tokens).collect::<Vec<_>>()
        );
    }
}

#[test]
fn bad_settings_are_refused_before_any_work() {
    let target = tiny(0, |_| true);
    let requests = requests();
    let lookups = |n: usize| -> Vec<Box<dyn Drafter + '_>> {
        (0..n)
            .map(|_| Box::new(PromptLookup::default()) as Box<dyn Drafter>)
            .collect()
    };
    for (k, drafters, what) in [(0, 4, "k"), (3, 3, "drafters")] {
        let err = speculative(
            &target,
            &requests,
            ("fp32", "fp32", 64),
            Preemption::Recompute,
            k,
            BatchDrafters::PerRequest(lookups(drafters)),
        )
        .unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidParameter { name, .. } if name == what),
            "{err}"
        );
    }
    // A self-drafter on a cache without a draft view.
    let drafters: Vec<Box<dyn Drafter + '_>> = (0..requests.len())
        .map(|_| {
            Box::new(SelfDrafter::new(&target, Sampling::default()).unwrap()) as Box<dyn Drafter>
        })
        .collect();
    let err = speculative(
        &target,
        &requests,
        ("int8", "int8h", 64),
        Preemption::Recompute,
        2,
        BatchDrafters::PerRequest(drafters),
    )
    .unwrap_err();
    assert!(err.to_string().contains("keeps no draft view"), "{err}");
    // A batched draft model of another vocabulary, or for another count.
    let other = tiny(3, |_| true);
    assert!(BatchModelDrafter::new(&other, VOCAB + 1, 4).is_err());
    let err = speculative(
        &target,
        &requests,
        ("fp32", "fp32", 64),
        Preemption::Recompute,
        2,
        BatchDrafters::Model(BatchModelDrafter::new(&other, VOCAB, 3).unwrap()),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidParameter {
                name: "drafters",
                ..
            }
        ),
        "{err}"
    );
}
