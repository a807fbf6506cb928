//! The continuous-batching simulation: every request finishes with exactly
//! its output tokens, waste stays under one block per running request, a
//! shared-prefix workload hits the prefix caches (and misses without one),
//! a tight pool preempts (by recompute or swap) and still finishes, and a
//! seed gives the same report every time.

use paged_cache::scheduler::{
    DecodeItem, DraftItem, Engine, Preemption, SchedulerConfig, Workload, WorkloadConfig, serve,
    simulate,
};
use paged_cache::{
    CacheConfig, HashPrefixCache, KvCacheManager, NoPrefixCache, PagedCacheError, PrefixCache,
    RadixPrefixCache, Result, SeqId,
};

fn workload() -> (Workload, WorkloadConfig) {
    let config = WorkloadConfig {
        seed: 3,
        requests: 120,
        prompt_len: (20, 200),
        output_len: (8, 120),
        ..WorkloadConfig::default()
    };
    (Workload::generate(&config).unwrap(), config)
}

fn config(blocks: usize, preemption: Preemption) -> SchedulerConfig {
    SchedulerConfig {
        cache: CacheConfig {
            num_blocks: blocks,
            block_size: 16,
            host_blocks: 256,
        },
        preemption,
        ..SchedulerConfig::default()
    }
}

fn check<P: PrefixCache>(
    prefix: P,
    blocks: usize,
    preemption: Preemption,
) -> paged_cache::scheduler::Report {
    let (w, wc) = workload();
    let r = simulate(&w, wc.vocab, &config(blocks, preemption), prefix).unwrap();
    assert_eq!(r.finished, w.requests.len());
    let outputs: usize = w.requests.iter().map(|q| q.output_len).sum();
    // Recomputed requests regenerate nothing: decoded tokens are counted once.
    assert_eq!(r.decoded_tokens, outputs as u64);
    assert!(r.max_waste_per_seq < r.block_size, "{r:?}");
    // Utilisation is a share of the pool, and a request is preempted only
    // when the pool has run out: any preemption means a full step.
    assert!(r.mean_utilisation <= r.peak_utilisation && r.peak_utilisation <= 1.0);
    if r.preempted_recompute + r.preempted_swap > 0 {
        assert!(
            r.peak_utilisation > 0.9,
            "preempted at peak utilisation {}",
            r.peak_utilisation
        );
    }
    r
}

#[test]
fn every_cache_and_mode_finishes_the_workload() {
    for preemption in [Preemption::Recompute, Preemption::Swap] {
        let none = check(NoPrefixCache, 1024, preemption);
        let hash = check(HashPrefixCache::new(16), 1024, preemption);
        let radix = check(RadixPrefixCache::new(16), 1024, preemption);
        assert_eq!(none.prefix_hit_rate, 0.0);
        assert!(hash.prefix_hit_rate > 0.2, "{hash:?}");
        assert!(radix.prefix_hit_rate > 0.2, "{radix:?}");
        assert!(hash.prefilled_tokens < none.prefilled_tokens);
    }
}

#[test]
fn a_tight_pool_preempts_and_still_finishes() {
    let recompute = check(HashPrefixCache::new(16), 96, Preemption::Recompute);
    assert!(recompute.preempted_recompute > 0, "{recompute:?}");
    assert_eq!(recompute.preempted_swap, 0);
    let swap = check(RadixPrefixCache::new(16), 96, Preemption::Swap);
    assert!(swap.preempted_swap > 0, "{swap:?}");
}

#[test]
fn a_seed_gives_the_same_report() {
    let a = check(RadixPrefixCache::new(16), 200, Preemption::Swap);
    let b = check(RadixPrefixCache::new(16), 200, Preemption::Swap);
    assert_eq!(a, b);
    let (w1, _) = workload();
    let (w2, _) = workload();
    assert_eq!(w1, w2);
}

#[test]
fn impossible_workloads_and_bad_parameters_are_errors() {
    let (w, wc) = workload();
    assert!(
        simulate(
            &w,
            wc.vocab,
            &config(4, Preemption::Recompute),
            NoPrefixCache
        )
        .is_err()
    );
    for bad in [
        WorkloadConfig {
            prompt_len: (0, 4),
            ..wc
        },
        WorkloadConfig {
            output_len: (9, 4),
            ..wc
        },
        WorkloadConfig {
            arrivals_per_step: f64::NAN,
            ..wc
        },
        WorkloadConfig {
            shared_fraction: 1.5,
            ..wc
        },
    ] {
        assert!(Workload::generate(&bad).is_err());
    }
}

/// Sizes that cannot fit are refused before anything is allocated, with an
/// error naming the parameter, never a panic or an allocation abort.
#[test]
fn sizes_that_cannot_fit_are_refused_before_allocating() {
    use paged_cache::{KvCacheManager, MAX_SLOTS, PagedCacheError};
    let refused = |config: WorkloadConfig, name: &str| match Workload::generate(&config) {
        Err(PagedCacheError::InvalidParameter { name: n, .. }) => assert_eq!(n, name),
        other => panic!("{config:?}: {other:?}"),
    };
    let base = WorkloadConfig::default();
    refused(
        WorkloadConfig {
            requests: 20,
            prompt_len: (1, usize::MAX),
            ..base
        },
        "requests",
    );
    refused(
        WorkloadConfig {
            requests: 1_000_000_000_000,
            ..base
        },
        "requests",
    );
    refused(
        WorkloadConfig {
            output_len: (1, usize::MAX),
            ..base
        },
        "requests",
    );
    let (w, c) = workload();
    for watermark in [7.0, 1.0, -0.1, f64::NAN] {
        let config = SchedulerConfig {
            watermark,
            ..config(64, Preemption::Swap)
        };
        assert!(matches!(
            simulate(&w, c.vocab, &config, NoPrefixCache),
            Err(PagedCacheError::InvalidParameter {
                name: "watermark",
                ..
            })
        ));
    }
    let config = SchedulerConfig {
        max_running: 0,
        ..config(64, Preemption::Swap)
    };
    assert!(matches!(
        simulate(&w, c.vocab, &config, NoPrefixCache),
        Err(PagedCacheError::InvalidParameter {
            name: "max_running",
            ..
        })
    ));
    for (blocks, host, name) in [
        (4_000_000_000, 0, "num_blocks"),
        (MAX_SLOTS / 16 + 1, 0, "num_blocks"),
        (16, 4_000_000_000, "host_blocks"),
        (16, 1 << 32, "host_blocks"),
        (16, usize::MAX, "host_blocks"),
    ] {
        let config = CacheConfig {
            num_blocks: blocks,
            block_size: 16,
            host_blocks: host,
        };
        match KvCacheManager::new(config, NoPrefixCache) {
            Err(PagedCacheError::InvalidParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{blocks} {host}: {:?}", other.err()),
        }
    }
}

/// The host tier is made as swapping needs it: a tier of 100 million
/// blocks costs nothing until a sequence is swapped out, and then holds
/// only what was swapped.
#[test]
fn a_large_host_tier_costs_nothing_until_used() {
    let config = CacheConfig {
        num_blocks: 8,
        block_size: 16,
        host_blocks: 100_000_000,
    };
    let mut cache = paged_cache::KvCacheManager::new(config, NoPrefixCache).unwrap();
    assert_eq!(cache.host_free(), 100_000_000);
    let prompt: Vec<u32> = (0..40).collect();
    let (a, _) = cache.add_sequence(&prompt, 0).unwrap();
    let (b, _) = cache.add_sequence(&prompt[..20], 1).unwrap();
    cache.swap_out(a).unwrap();
    assert_eq!(cache.host_free(), 100_000_000 - 3);
    cache.swap_out(b).unwrap();
    cache.check_invariants().unwrap();
    cache.swap_in(a).unwrap();
    // Slots given back are handed out again before new ones are made.
    assert_eq!(cache.host_free(), 100_000_000 - 2);
    cache.swap_out(a).unwrap();
    cache.check_invariants().unwrap();
    cache.swap_in(b).unwrap();
    cache.swap_in(a).unwrap();
    assert_eq!(cache.host_free(), 100_000_000);
    cache.check_invariants().unwrap();
}

/// An engine that drafts: request `r`'s token `i` is a fixed function;
/// its drafts are the true next tokens with every third one (by a hash)
/// wrong, and decode keeps the drafts up to the first wrong one. It checks
/// at every step that the sequence holds its prompt and true tokens, so a
/// draft the scheduler failed to cut off would be caught.
struct Drafting<'w> {
    workload: &'w Workload,
    k: usize,
    drafted_steps: usize,
}

fn truth(r: usize, i: usize) -> u32 {
    ((r as u32).wrapping_mul(7919) ^ (i as u32).wrapping_mul(104_729)) % 50_000
}

fn wrong(r: usize, i: usize) -> bool {
    (r * 31 + i * 17).is_multiple_of(3)
}

impl<P: PrefixCache> Engine<P> for Drafting<'_> {
    type Error = PagedCacheError;

    fn token(&self, request: usize, index: usize) -> u32 {
        truth(request, index)
    }

    fn prefill(&mut self, _: &mut KvCacheManager<P>, _: usize, _: SeqId, _: usize) -> Result<()> {
        Ok(())
    }

    fn draft(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DraftItem],
    ) -> Result<Vec<Vec<u32>>> {
        self.drafted_steps += 1;
        batch
            .iter()
            .map(|item| {
                let r = item.request;
                let next = cache.tokens(item.seq)?.len() - self.workload.requests[r].prompt.len();
                Ok((next + 1..=next + self.k.min(item.max))
                    .map(|i| truth(r, i) ^ u32::from(wrong(r, i)))
                    .collect())
            })
            .collect()
    }

    fn decode(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DecodeItem],
    ) -> Result<Vec<usize>> {
        let mut kept = Vec::new();
        for item in batch {
            let prompt = &self.workload.requests[item.request].prompt;
            let tokens = cache.tokens(item.seq)?;
            assert_eq!(&tokens[..prompt.len()], prompt.as_slice());
            let decoded = tokens.len() - prompt.len() - item.drafted;
            for (i, &t) in tokens[prompt.len()..].iter().enumerate().take(decoded) {
                assert_eq!(
                    t,
                    truth(item.request, i),
                    "request {} token {i}",
                    item.request
                );
            }
            kept.push(
                (decoded..decoded + item.drafted)
                    .take_while(|&i| !wrong(item.request, i))
                    .count(),
            );
        }
        Ok(kept)
    }
}

#[test]
fn drafted_tokens_are_kept_or_cut_and_every_request_still_finishes() {
    let (w, _) = workload();
    let outputs: u64 = w.requests.iter().map(|q| q.output_len as u64).sum();
    for (blocks, preemption) in [
        (1024, Preemption::Recompute),
        (96, Preemption::Recompute),
        (96, Preemption::Swap),
    ] {
        let config = config(blocks, preemption);
        let plain = simulate(&w, 50_000, &config, RadixPrefixCache::new(16)).unwrap();
        let mut cache = KvCacheManager::new(config.cache, RadixPrefixCache::new(16)).unwrap();
        let mut engine = Drafting {
            workload: &w,
            k: 4,
            drafted_steps: 0,
        };
        let r = serve(&mut cache, &w, &config, &mut engine).unwrap();
        assert_eq!(r.finished, w.requests.len());
        assert_eq!(r.decoded_tokens, outputs, "{r:?}");
        assert!(
            r.accepted_tokens > 0 && r.accepted_tokens < r.drafted_tokens,
            "{r:?}"
        );
        assert!(
            r.steps < plain.steps,
            "{} steps drafting, {} plain",
            r.steps,
            plain.steps
        );
        assert!(r.max_waste_per_seq < r.block_size, "{r:?}");
        if blocks == 96 {
            assert!(r.preempted_recompute + r.preempted_swap > 0, "{r:?}");
        }
        assert!(engine.drafted_steps > 0);
        // Every block is back in the pool.
        assert_eq!(cache.available_blocks(), blocks, "{r:?}");
    }
}

#[test]
fn an_engine_keeping_more_than_it_drafted_is_an_error() {
    struct Greedy;
    impl<P: PrefixCache> Engine<P> for Greedy {
        type Error = PagedCacheError;
        fn token(&self, _: usize, _: usize) -> u32 {
            1
        }
        fn prefill(
            &mut self,
            _: &mut KvCacheManager<P>,
            _: usize,
            _: SeqId,
            _: usize,
        ) -> Result<()> {
            Ok(())
        }
        fn decode(
            &mut self,
            _: &mut KvCacheManager<P>,
            batch: &[DecodeItem],
        ) -> Result<Vec<usize>> {
            Ok(vec![1; batch.len()])
        }
    }
    let (w, _) = workload();
    let config = config(1024, Preemption::Recompute);
    let mut cache = KvCacheManager::new(config.cache, NoPrefixCache).unwrap();
    let err = serve(&mut cache, &w, &config, &mut Greedy).unwrap_err();
    assert!(err.to_string().contains("keeps 1 of its 0 drafts"), "{err}");
}

/// An engine whose request 0 drafts four tokens a step, all rejected,
/// and whose other requests draft nothing.
struct Rejected;

impl<P: PrefixCache> Engine<P> for Rejected {
    type Error = PagedCacheError;

    fn token(&self, request: usize, index: usize) -> u32 {
        truth(request, index)
    }

    fn prefill(&mut self, _: &mut KvCacheManager<P>, _: usize, _: SeqId, _: usize) -> Result<()> {
        Ok(())
    }

    fn draft(&mut self, _: &mut KvCacheManager<P>, batch: &[DraftItem]) -> Result<Vec<Vec<u32>>> {
        Ok(batch
            .iter()
            .map(|item| match item.request {
                0 => vec![7; item.max.min(4)],
                _ => Vec::new(),
            })
            .collect())
    }

    fn decode(&mut self, _: &mut KvCacheManager<P>, batch: &[DecodeItem]) -> Result<Vec<usize>> {
        Ok(vec![0; batch.len()])
    }
}

/// Two requests that fit the pool when decoded plainly fit it when one of
/// them drafts too: drafts are cut off before anyone is preempted for
/// them, the appending request's own and those appended before it.
#[test]
fn drafts_never_preempt_a_request_that_fits_plainly() {
    use paged_cache::scheduler::Request;
    let request = |id: usize, prompt: Vec<u32>, output_len: usize| Request {
        id,
        arrival: 0,
        priority: 0,
        prompt,
        shared_prefix: None,
        output_len,
    };
    // At most four blocks of 4 at once: 8 + 8 tokens when the second
    // finishes, then the first alone to 12.
    let w = Workload {
        requests: vec![request(0, vec![1, 2, 3], 9), request(1, vec![4, 5, 6], 5)],
    };
    let config = SchedulerConfig {
        cache: CacheConfig {
            num_blocks: 4,
            block_size: 4,
            host_blocks: 0,
        },
        watermark: 0.0,
        ..SchedulerConfig::default()
    };
    let plain = simulate(&w, 50_000, &config, NoPrefixCache).unwrap();
    assert_eq!(plain.preempted_recompute, 0, "{plain:?}");
    let mut cache = KvCacheManager::new(config.cache, NoPrefixCache).unwrap();
    let r = serve(&mut cache, &w, &config, &mut Rejected).unwrap();
    assert_eq!((r.finished, r.decoded_tokens), (2, 14), "{r:?}");
    assert_eq!(r.preempted_recompute + r.preempted_swap, 0, "{r:?}");
    assert!(r.drafted_tokens > 0 && r.accepted_tokens == 0, "{r:?}");
    assert_eq!(r.steps, plain.steps, "{r:?}");
}
