//! `cargo xtask bench kv-eval --filter serving`: the serving path of the
//! default model on the paged cache (`int4+secded84`, blocks of 16).
//!
//! - `kv-eval/serving-batched-decode`: one decode step of 16 sequences in one
//!   batched forward pass, in generated tokens per second, against one
//!   step of a single sequence (the baseline); each sequence holds 256
//!   tokens. The goal is a ratio of at least 4 (the weights are read once
//!   per step for the whole batch).
//! - `kv-eval/serving-prefill-1024-shared`: the prefill of a request whose first
//!   1,024 tokens are a cached shared prompt (a prefix-cache hit: only its
//!   16 own tokens are computed), in request tokens per second, against the
//!   same request on a cache without the prefix (the baseline). A ratio of
//!   r saves 1 − 1/r of the prefill time; the goal is 90% (r ≥ 10).
//! - `kv-eval/serving-generation-2k`: end-to-end generation, one decode step of
//!   one sequence after a 2,048-token prompt, in generated tokens per
//!   second: `shard-k3` and `shard` on the re-encode cache (the layer fitted
//!   at the prefill, each new token in its 8-bit decode stream; the cache
//!   grows by one token per iteration) against `fp16` on the paged cache
//!   (the baseline, each step's token taken back).
//!
//! Needs the model of `cargo xtask fetch-model`; without it nothing runs and
//! the reason is printed.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_eval::batch::paged_cache;
use kv_eval::cache::CacheMode;
use kv_eval::paths;
use kv_model::gguf::GgufFile;
use kv_model::model::batch::{decode_step, prefill};
use kv_model::model::{CausalLm, LlamaModel};
use kv_model::tokenizer::TextTokenizer;
use paged_cache::{
    CacheConfig, HashPrefixCache, KvCacheManager, NoPrefixCache, PrefixCache, SeqId,
};

const FORM: &str = "int4+secded84";
const BLOCK: usize = 16;
const BATCH: usize = 16;
const CONTEXT: usize = 256;
const SHARED: usize = 1024;
const OWN: usize = 16;

fn config() -> CacheConfig {
    CacheConfig {
        num_blocks: 1024,
        block_size: BLOCK,
        host_blocks: 0,
    }
}

/// `n` sequences of `CONTEXT` corpus tokens each, prefilled.
fn prefilled(
    model: &dyn CausalLm,
    mode: &CacheMode,
    ids: &[u32],
    n: usize,
) -> (KvCacheManager<NoPrefixCache>, Vec<SeqId>) {
    let mut cache = paged_cache(model, mode, config(), NoPrefixCache).unwrap();
    let seqs = (0..n)
        .map(|i| {
            let (seq, _) = cache
                .add_sequence(&ids[i * CONTEXT..(i + 1) * CONTEXT], 0)
                .unwrap();
            prefill(model, &mut cache, seq, 0).unwrap();
            seq
        })
        .collect();
    (cache, seqs)
}

/// One decode step over `seqs`; the appended tokens are taken back so
/// every iteration sees the same cache.
fn step(model: &dyn CausalLm, cache: &mut KvCacheManager<NoPrefixCache>, seqs: &[SeqId]) {
    for &seq in seqs {
        cache.append(seq, &[42]).unwrap();
    }
    black_box(decode_step(model, cache, seqs).unwrap());
    for &seq in seqs {
        cache.truncate(seq, 1).unwrap();
    }
}

/// Prefills `request` on `cache` and frees it (a cached prefix stays).
fn serve_prefill<P: PrefixCache>(
    model: &dyn CausalLm,
    cache: &mut KvCacheManager<P>,
    request: &[u32],
) {
    let (seq, cached) = cache.add_sequence(request, 0).unwrap();
    black_box(prefill(model, cache, seq, cached).unwrap());
    cache.free(seq).unwrap();
}

/// The default model and the corpus' token ids; `None` (with the reason
/// printed) when the model is not fetched.
fn load(what: &str) -> Option<(LlamaModel, Vec<u32>)> {
    let path = paths::default_model();
    let Ok(file) = GgufFile::open(&path) else {
        eprintln!(
            "{what} bench skipped: {} is missing (run `cargo xtask fetch-model`)",
            path.display()
        );
        return None;
    };
    let model = LlamaModel::from_gguf(&file).unwrap();
    let tok = TextTokenizer::from_gguf(&file).unwrap();
    let text = std::fs::read_to_string(paths::default_text())
        .unwrap_or_else(|_| "The capital of France is Paris. ".repeat(2048));
    let ids = tok.encode(&text).unwrap();
    Some((model, ids))
}

fn bench(c: &mut Criterion) {
    let Some((model, ids)) = load("serving") else {
        return;
    };
    let mode = CacheMode::parse(FORM).unwrap();

    let mut g = c.benchmark_group("kv-eval/serving-batched-decode");
    g.sample_size(10);
    let (mut one, one_seq) = prefilled(&model, &mode, &ids, 1);
    g.throughput(Throughput::Elements(1));
    g.bench_function("baseline-1-sequence", |b| {
        b.iter(|| step(&model, &mut one, &one_seq))
    });
    drop(one);
    let (mut many, seqs) = prefilled(&model, &mode, &ids, BATCH);
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function(format!("{BATCH}-sequences"), |b| {
        b.iter(|| step(&model, &mut many, &seqs))
    });
    drop(many);
    g.finish();

    let mut g = c.benchmark_group("kv-eval/serving-prefill-1024-shared");
    g.sample_size(10)
        .throughput(Throughput::Elements((SHARED + OWN) as u64));
    let request = &ids[..SHARED + OWN];
    let mut cold = paged_cache(&model, &mode, config(), NoPrefixCache).unwrap();
    g.bench_function("baseline-no-prefix-cache", |b| {
        b.iter(|| serve_prefill(&model, &mut cold, request))
    });
    drop(cold);
    let mut warm = paged_cache(&model, &mode, config(), HashPrefixCache::new(BLOCK)).unwrap();
    // An earlier request with the shared prompt left it cached.
    let (seq, _) = warm.add_sequence(&ids[..SHARED + 1], 0).unwrap();
    prefill(&model, &mut warm, seq, 0).unwrap();
    warm.cache_prefix(seq, SHARED).unwrap();
    warm.free(seq).unwrap();
    let (seq, cached) = warm.add_sequence(request, 0).unwrap();
    assert_eq!(cached, SHARED, "the shared prompt is found cached");
    warm.free(seq).unwrap();
    g.bench_function("prefix-hit", |b| {
        b.iter(|| serve_prefill(&model, &mut warm, request))
    });
    g.finish();
}

/// Tokens of the generation prompt.
const PROMPT: usize = 2048;

fn generation(c: &mut Criterion) {
    use kv_eval::cache::KvCache;
    let Some((model, ids)) = load("generation") else {
        return;
    };
    let prompt = &ids[..PROMPT];
    let mut g = c.benchmark_group("kv-eval/serving-generation-2k");
    g.sample_size(10).throughput(Throughput::Elements(1));
    let fp16 = CacheMode::parse("fp16").unwrap();
    let mut cache = paged_cache(&model, &fp16, config_for(PROMPT + 64), NoPrefixCache).unwrap();
    let (seq, _) = cache.add_sequence(prompt, 0).unwrap();
    prefill(&model, &mut cache, seq, 0).unwrap();
    g.bench_function("baseline-fp16", |b| {
        b.iter(|| step(&model, &mut cache, &[seq]))
    });
    drop(cache);
    for form in ["shard-k3", "shard"] {
        let mut cache = KvCache::new(CacheMode::parse(form).unwrap(), None, 0).unwrap();
        model.forward(prompt, &mut cache, PROMPT - 1).unwrap();
        g.bench_function(form, |b| {
            b.iter(|| black_box(model.forward(&[42], &mut cache, 0).unwrap()))
        });
    }
    g.finish();
}

/// A pool holding one sequence of `tokens` tokens.
fn config_for(tokens: usize) -> CacheConfig {
    CacheConfig {
        num_blocks: tokens.div_ceil(BLOCK) + 1,
        block_size: BLOCK,
        host_blocks: 0,
    }
}

criterion_group!(benches, bench, generation);
criterion_main!(benches);
