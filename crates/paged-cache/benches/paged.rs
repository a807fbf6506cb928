//! Benchmarks of `cargo xtask bench paged-cache`, each group with a
//! baseline measured in the same run:
//!
//! - `paged-cache/alloc-free`: allocate/free pairs per second of
//!   [`BlockPool`] (batches of 64 allocations, then 64 frees in reverse)
//!   against `baseline-vec-stack`, the plain allocator of the vLLM notes
//!   (a `Vec` of free ids and a reference-count array).
//! - `paged-cache/prefix-lookup`: tokens per second of a full-prefix hit on
//!   a 2,048-token prompt among 64 cached ones (lookup plus releasing the
//!   references), for both prefix caches, against `baseline-hashmap`, the
//!   same job without a cache structure (every block-aligned prefix of the
//!   stored prompts in a std `HashMap` keyed by a chained SipHash of its
//!   blocks, probed block by block); `sha256-only` is the chained SHA-256
//!   of the query's blocks alone (the hash cache's floor).
//! - `paged-cache/decode-16k-<form>`: single-query decode attention over a
//!   16K-token sequence at Llama-3-8B's shape (32 query heads, 8 KV heads,
//!   head dim 128) on two threads, as stored bytes read per second:
//!   `baseline-contiguous` reads one contiguous [`KvStore`] per K and V, the
//!   others read the same rows through a page table of shuffled blocks of
//!   16 or 64 tokens. The goal is paged within 1.1x of contiguous time
//!   (a ratio of at least 0.91). `int4-ch` (per-channel keys and values)
//!   is read paged with every block sealed (one scale and offset per
//!   channel per block: `int4-ch<B>`), its baseline one contiguous store
//!   with one scale per channel over all 16K tokens; `int4-ch64` keeps one
//!   per 64 tokens, in blocks of 16 and 32 a group over several blocks,
//!   its baseline one contiguous `int4-ch64` store.
//! - `paged-cache/decode-64k`: the same decode over 64K tokens in blocks
//!   of 64 and 16, `int4` and `int4-ch` against `baseline-fp16-b64`, paged
//!   FP16 in blocks of 64, as tokens per second (the ratio is the speed-up
//!   over FP16; the goal for `int4-ch`: at least 1.5, and at least
//!   `int4`'s).
//! - `paged-cache/write-token-2k`: one decode step's K/V writes at
//!   SmolLM2-135M's shape (30 layers, 3 KV heads × 64) in `int4+secded84`
//!   after 2,048 tokens: `paged` opens a step on a [`PagedBackend`], appends
//!   every layer's rows (each token encoded once, into its block) and rolls
//!   the step back; `baseline-reencode` is what the re-encode protocol does
//!   for the same step: quantise and encode all 2,049 tokens of every
//!   layer's K and V again. Steps per second, so the ratio is the speed-up.

use std::hint::black_box;
use std::time::Duration;

use attention::{Attention, HeadShape, Mask};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_quant::{CacheForm, KvStore};
use paged_cache::{
    BlockId, BlockPool, BlockStorage, HashPrefixCache, KvPart, LayerSpec, PageTable, PagedKv,
    PrefixCache, RadixPrefixCache,
};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use test_support::rows::{shuffled, smooth_rows};

fn alloc_free(c: &mut Criterion) {
    const BATCH: usize = 64;
    const BLOCKS: usize = 4096;
    let mut group = c.benchmark_group("paged-cache/alloc-free");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("baseline-vec-stack", |b| {
        let mut free: Vec<u32> = (0..BLOCKS as u32).rev().collect();
        let mut refs = vec![0u32; BLOCKS];
        let mut taken = Vec::with_capacity(BATCH);
        b.iter(|| {
            for _ in 0..BATCH {
                let id = free.pop().expect("free block");
                refs[id as usize] = 1;
                taken.push(id);
            }
            while let Some(id) = taken.pop() {
                refs[id as usize] -= 1;
                if refs[id as usize] == 0 {
                    free.push(id);
                }
            }
            black_box(free.len())
        })
    });
    group.bench_function("block-pool", |b| {
        let mut pool = BlockPool::new(BLOCKS, 16).expect("pool");
        let mut taken = Vec::with_capacity(BATCH);
        b.iter(|| {
            for _ in 0..BATCH {
                taken.push(pool.allocate().expect("free block").block);
            }
            while let Some(id) = taken.pop() {
                pool.release(id).expect("in use");
            }
            black_box(pool.num_free())
        })
    });
    group.finish();
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 49_152)
        .collect()
}

fn lookup<P: PrefixCache>(
    mut cache: P,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
) {
    const BS: usize = 16;
    const LEN: usize = 2048;
    let mut pool = BlockPool::new(64 * LEN / BS + 8, BS).expect("pool");
    for s in 0..64 {
        let tokens = prompt(s, LEN);
        let blocks: Vec<BlockId> = (0..LEN / BS)
            .map(|_| pool.allocate().expect("block").block)
            .collect();
        cache
            .insert(&mut pool, &tokens, &blocks, 0)
            .expect("insert");
        for &b in blocks.iter().rev() {
            pool.release(b).expect("release");
        }
    }
    let query = prompt(17, LEN);
    group.bench_function(cache.name(), |b| {
        b.iter(|| {
            let hit = cache
                .lookup(&mut pool, black_box(&query), 0)
                .expect("lookup");
            assert!(hit.tokens >= LEN - BS);
            for &b in hit.blocks.iter().rev() {
                pool.release(b).expect("release");
            }
            if let Some(lock) = hit.lock {
                cache.release(lock);
            }
            hit.tokens
        })
    });
}

fn prefix_lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("paged-cache/prefix-lookup");
    group.throughput(Throughput::Elements(2048));
    let query = prompt(17, 2048);
    // The same job without a cache structure: every block-aligned prefix
    // of the 64 stored prompts in a std HashMap keyed by a chained SipHash
    // of the blocks; a lookup walks the query's blocks until one misses.
    let chain = |parent: u64, block: &[u32]| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parent.hash(&mut h);
        block.hash(&mut h);
        h.finish()
    };
    let mut known = std::collections::HashMap::new();
    for s in 0..64 {
        let mut parent = 0;
        for (i, block) in prompt(s, 2048).chunks_exact(16).enumerate() {
            parent = chain(parent, block);
            known.insert(parent, (s, i));
        }
    }
    group.bench_function("baseline-hashmap", |b| {
        b.iter(|| {
            let (mut parent, mut hit) = (0u64, 0usize);
            for block in black_box(&query).chunks_exact(16) {
                parent = chain(parent, block);
                if !known.contains_key(&parent) {
                    break;
                }
                hit += 16;
            }
            hit
        })
    });
    group.bench_function("sha256-only", |b| {
        b.iter(|| {
            let mut parent = [0u8; 32];
            for block in black_box(&query).chunks_exact(16) {
                let mut h = Sha256::new();
                h.update(parent);
                for t in block {
                    h.update(t.to_le_bytes());
                }
                parent = h.finalize().into();
            }
            parent[0]
        })
    });
    lookup(HashPrefixCache::new(16), &mut group);
    lookup(RadixPrefixCache::new(16), &mut group);
    group.finish();
}

/// What the decode groups share: their two-thread pool, Llama-3-8B's
/// shape (32 query heads, 8 KV heads, head dim 128), its attention, one
/// query and `tokens` rows of K and V.
struct DecodeInputs {
    pool: rayon::ThreadPool,
    shape: HeadShape,
    attn: Attention,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    tokens: usize,
}

impl DecodeInputs {
    fn new(tokens: usize) -> Self {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("threads");
        let shape = HeadShape::new(32, 8, 128).expect("shape");
        let ch = shape.kv_channels();
        let q = smooth_rows(1, shape.q_len(), 0.3);
        let (k, v) = pool.install(|| (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0)));
        Self {
            pool,
            shape,
            attn: Attention::new(shape),
            q,
            k,
            v,
            tokens,
        }
    }

    /// Benchmarks one decode of the last token over `keys` and `values`.
    fn bench<K: attention::KvSource, V: attention::KvSource>(
        &self,
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        keys: &K,
        values: &V,
    ) {
        group.bench_function(name, |b| {
            b.iter(|| {
                self.pool.install(|| {
                    self.attn
                        .decode(&self.q, self.tokens - 1, keys, values, &Mask::Causal)
                        .expect("decode")
                        .out[0]
                })
            })
        });
    }
}

fn decode(c: &mut Criterion) {
    const TOKENS: usize = 16 * 1024;
    let inputs = DecodeInputs::new(TOKENS);
    let (pool, ch) = (&inputs.pool, inputs.shape.kv_channels());
    let (k, v) = (&inputs.k, &inputs.v);
    for spelling in [
        "fp16",
        "int8",
        "int4",
        "int4+secded84",
        "int4-ch",
        "int4-ch64",
    ] {
        let form: CacheForm = spelling.parse().expect("form");
        let mut group = c.benchmark_group(format!("paged-cache/decode-16k-{spelling}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        let (ks, vs) = pool.install(|| {
            (
                KvStore::quantize(form, k, TOKENS, ch).expect("k"),
                KvStore::quantize(form, v, TOKENS, ch).expect("v"),
            )
        });
        group.throughput(Throughput::Bytes(
            (ks.stored_bytes() + vs.stored_bytes()) as u64,
        ));
        inputs.bench(&mut group, "baseline-contiguous", &ks, &vs);
        for bs in [16, 32, 64] {
            let (storage, table) = paged_rows(form, (k, v), TOKENS, ch, bs);
            let keys = PagedKv::new(&storage, &table, 0, 0, KvPart::Keys).expect("keys");
            let values = PagedKv::new(&storage, &table, 0, 0, KvPart::Values).expect("values");
            inputs.bench(&mut group, &format!("paged-b{bs}"), &keys, &values);
        }
        group.finish();
    }
}

/// `tokens` rows of `k` and `v` (`channels` wide) written in `form` into
/// blocks of `bs` tokens in shuffled physical order, as a long-running
/// pool hands blocks out, every block sealed (staged forms such as
/// `int4-ch`) as the steps that wrote them would have when they
/// committed; with the page table of the one sequence.
fn paged_rows(
    form: CacheForm,
    (k, v): (&[f32], &[f32]),
    tokens: usize,
    channels: usize,
    bs: usize,
) -> (BlockStorage, PageTable) {
    let blocks = tokens / bs;
    let layers = [LayerSpec::uniform(form, channels)];
    let storage = BlockStorage::new(blocks, bs, &layers).expect("storage");
    let table_blocks: Vec<BlockId> = shuffled(blocks as u32).into_iter().map(BlockId).collect();
    (0..tokens).into_par_iter().for_each(|t| {
        let r = t * channels..(t + 1) * channels;
        storage
            .write(table_blocks[t / bs], t % bs, 0, &k[r.clone()], &v[r])
            .expect("write");
    });
    storage
        .seal_blocks(
            &table_blocks,
            0,
            tokens,
            &mut paged_cache::SeqTables::default(),
        )
        .expect("seal");
    let table = PageTable::from_tables(&[(&table_blocks, tokens)], bs).expect("table");
    (storage, table)
}

/// `paged-cache/decode-64k`: the issue figure at 64K tokens, paged forms
/// against paged FP16 in the same run (tokens per second, so the ratio is
/// the speed-up over FP16).
fn decode_64k(c: &mut Criterion) {
    const TOKENS: usize = 64 * 1024;
    let inputs = DecodeInputs::new(TOKENS);
    let (pool, ch) = (&inputs.pool, inputs.shape.kv_channels());
    let mut group = c.benchmark_group("paged-cache/decode-64k");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(TOKENS as u64));
    for (name, spelling, bs) in [
        ("baseline-fp16-b64", "fp16", 64),
        ("int4-b64", "int4", 64),
        ("int4-ch-b64", "int4-ch", 64),
        ("int4-b16", "int4", 16),
        ("int4-ch-b16", "int4-ch", 16),
    ] {
        let form: CacheForm = spelling.parse().expect("form");
        let (storage, table) =
            pool.install(|| paged_rows(form, (&inputs.k, &inputs.v), TOKENS, ch, bs));
        let keys = PagedKv::new(&storage, &table, 0, 0, KvPart::Keys).expect("keys");
        let values = PagedKv::new(&storage, &table, 0, 0, KvPart::Values).expect("values");
        inputs.bench(&mut group, name, &keys, &values);
    }
    group.finish();
}

/// `paged-cache/seal-block-4k`: sealing one block of 16 tokens in every
/// layer of SmolLM2-135M's shape (30 layers, 3 KV heads × 64;
/// `int4-ch+sink4` keys, `lm4` values, so only keys seal) against
/// `baseline-decode-attention`, one decode step's attention over 4,096
/// tokens in the same cache (every layer, one query each; the model's
/// projections not counted, which makes the baseline smaller than a
/// decode step). A block seals once per 16 decode steps; the goal is a
/// seal under 5% of one step (a ratio of at least 20).
fn seal_block(c: &mut Criterion) {
    const LAYERS: usize = 30;
    const CONTEXT: usize = 4096;
    const BS: usize = 16;
    let heads = HeadShape::new(9, 3, 64).expect("shape");
    let ch = heads.kv_channels();
    let attn = Attention::new(heads);
    let spec = LayerSpec {
        key: "int4-ch+sink4".parse().expect("form"),
        value: "lm4".parse().expect("form"),
        channels: ch,
    };
    // One spare block to seal again and again.
    let blocks = CONTEXT / BS + 1;
    let storage = BlockStorage::new(blocks, BS, &vec![spec; LAYERS]).expect("storage");
    let (k, v) = (
        smooth_rows(CONTEXT + BS, ch, 0.0),
        smooth_rows(CONTEXT + BS, ch, 1.0),
    );
    let table: Vec<BlockId> = (0..(CONTEXT / BS) as u32).map(BlockId).collect();
    for (t, r) in (0..CONTEXT).map(|t| (t, t * ch..(t + 1) * ch)) {
        for l in 0..LAYERS {
            storage
                .write(table[t / BS], t % BS, l, &k[r.clone()], &v[r.clone()])
                .expect("write");
        }
    }
    storage
        .seal_blocks(&table, 0, CONTEXT, &mut paged_cache::SeqTables::default())
        .expect("seal");
    let pages = PageTable::from_tables(&[(&table, CONTEXT)], BS).expect("table");
    let q = smooth_rows(1, heads.q_len(), 0.3);
    let mut group = c.benchmark_group("paged-cache/seal-block-4k");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    group.bench_function("baseline-decode-attention", |b| {
        b.iter(|| {
            let mut sum = 0.0;
            for l in 0..LAYERS {
                let keys = PagedKv::new(&storage, &pages, 0, l, KvPart::Keys).expect("keys");
                let values = PagedKv::new(&storage, &pages, 0, l, KvPart::Values).expect("values");
                sum += attn
                    .decode(&q, CONTEXT - 1, &keys, &values, &Mask::Causal)
                    .expect("decode")
                    .out[0];
            }
            sum
        })
    });
    // The spare block as a sequence's second block (the first holds sinks).
    let spare = [table[0], BlockId((CONTEXT / BS) as u32)];
    let rows = CONTEXT * ch..(CONTEXT + BS) * ch;
    group.bench_function("seal", |b| {
        b.iter_batched(
            || {
                // A block written row by row (staged), as decoding writes it.
                storage.open_block(spare[1]).expect("open");
                for (i, (kr, vr)) in k[rows.clone()]
                    .chunks_exact(ch)
                    .zip(v[rows.clone()].chunks_exact(ch))
                    .enumerate()
                {
                    for l in 0..LAYERS {
                        storage.write(spare[1], i, l, kr, vr).expect("write");
                    }
                }
            },
            |()| {
                let sealed = storage
                    .seal_blocks(&spare, BS, 2 * BS, &mut paged_cache::SeqTables::default())
                    .expect("seal");
                assert_eq!(sealed, LAYERS, "one key block per layer");
            },
            // One setup per seal: each seal needs a freshly staged block.
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

fn write_token(c: &mut Criterion) {
    use attention::{KvBackend, ModelKvShape};
    use paged_cache::PagedBackend;
    const LAYERS: usize = 30;
    const CONTEXT: usize = 2048;
    let heads = HeadShape::new(9, 3, 64).expect("shape");
    let ch = heads.kv_channels();
    let form: CacheForm = "int4+secded84".parse().expect("form");
    let mut group = c.benchmark_group("paged-cache/write-token-2k");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(1));
    let rows = smooth_rows(CONTEXT + 1, ch, 0.0);
    group.bench_function("baseline-reencode", |b| {
        b.iter(|| {
            for _ in 0..2 * LAYERS {
                black_box(KvStore::quantize(form, &rows, CONTEXT + 1, ch).expect("store"));
            }
        })
    });
    let spec = LayerSpec::uniform(form, ch);
    let mut paged = PagedBackend::new(&vec![spec; LAYERS], 16, CONTEXT / 16 + 2).expect("backend");
    paged
        .fit(&ModelKvShape {
            layers: LAYERS,
            heads,
            rope: None,
        })
        .expect("fit");
    let ids: Vec<u32> = (0..CONTEXT as u32).collect();
    paged.begin(&ids).expect("begin");
    for l in 0..LAYERS {
        paged
            .append(l, &rows[..CONTEXT * ch], &rows[..CONTEXT * ch])
            .expect("prefill");
    }
    paged.commit().expect("commit");
    let last = &rows[CONTEXT * ch..];
    group.bench_function("paged", |b| {
        b.iter(|| {
            paged.begin(&[7]).expect("begin");
            for l in 0..LAYERS {
                paged.append(l, black_box(last), last).expect("append");
            }
            paged.rollback();
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    alloc_free,
    prefix_lookup,
    decode,
    decode_64k,
    seal_block,
    write_token
);
criterion_main!(benches);
