//! Single-query decode attention read straight from each stored KV form, on
//! two threads, as effective bandwidth: stored K and V bytes read per second.
//!
//! Group naming for `cargo xtask bench`: each group is
//! `attention/decode-<q>x<kv>x<d>-<context>`, for SmolLM2-135M's shape
//! (9 query heads, 3 KV heads, head dim 64) at 4K, 16K and 64K tokens and
//! Llama-3-8B's (32/8/128) at 4K, 16K, 64K and 128K. Each form `F` is
//! paired with `baseline-F`, a wrapping sum on the same two threads over a
//! buffer of exactly `F`'s stored K and V bytes: the streaming-read
//! bandwidth for that working set, measured in the same run, so a set that
//! fits in the last-level cache is compared with a read that also runs
//! from cache. The ratio is the fraction of that bandwidth decode attention
//! reaches. Decode is timed through `decode_into` with its buffers and
//! workspace kept across calls, as a decode loop calls it (no allocation).
//! The bench prints each set's size against the last-level cache;
//! at 32/8/128 and 128K tokens every set is at least 4x a 32 MiB L3 (int4,
//! the smallest, holds 129 MiB), so those rows are about memory.
//!
//! Integer forms are measured three times: `F` scores keys exactly in f32,
//! `F@int8q` with int8-quantized queries and integer dot products
//! (`Numerics::Int8Query`) and `F@int16q` with 16-bit query codes as two
//! int8 halves (`Numerics::Int16Query`), each with its own `baseline-…`
//! stream.
//!
//! Set `ATTENTION_BENCH_CONTEXTS` (for example `4096,65536`) to pick contexts.
//!
//! `attention/low-rank-<q>x<kv>x<d>-<context>` (16K and 64K tokens): decode
//! attention in coefficient space over `pca-r<d/4>` and `pca-r<d/2>` keys
//! and values (f16 coefficients), against FP16 decode attention
//! (`baseline-fp16`) in the same run; throughput in tokens per second, so
//! each ratio is the speed-up over FP16.
//!
//! `attention/shard-<q>x<kv>x<d>-<context>` (4K, 16K, 64K tokens): decode
//! attention over `shard` layers computed on their compressed forms,
//! against FP16 decode attention (`baseline-fp16`) in the same run.
//!
//! `attention/pair-codes-<q>x<kv>x<d>-<context>` (4K, 16K, 64K tokens):
//! keys coded before RoPE on pair codebooks scored against the codebook,
//! beside the same keys decoded and rotated per tile, against FP16 decode
//! attention in the same run.

use std::hint::black_box;
use std::time::Duration;

use attention::{Attention, DenseKv, HeadShape, KvSource, Mask, Numerics, Workspace};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use kv_quant::{CacheForm, KvStore};
use rayon::prelude::*;
use test_support::rows::smooth_rows;

const THREADS: usize = 2;

const FORMS: [&str; 11] = [
    "fp16",
    "fp8-e4m3",
    "fp8-e5m2",
    "nf4",
    "int8",
    "int4",
    "int4-ch",
    "int4+secded84",
    "int4+secded84+interp",
    "int4+hamming74",
    "int4+golay24",
];

/// Forms whose keys are integer levels, measured with `Numerics::Int8Query` too.
fn integer_keys(form: &str) -> bool {
    form.starts_with("int")
}

const SHAPES: [(usize, usize, usize); 2] = [(9, 3, 64), (32, 8, 128)];

/// Contexts for a shape: `ATTENTION_BENCH_CONTEXTS` when set, else 4K, 16K
/// and 64K tokens, plus 128K for the 128-dim shape (its memory-bound rows).
fn contexts(head_dim: usize) -> Vec<usize> {
    std::env::var("ATTENTION_BENCH_CONTEXTS")
        .ok()
        .map(|s| {
            s.split(',')
                .map(|c| c.trim().parse().expect("context"))
                .collect()
        })
        .unwrap_or_else(|| {
            let mut c = vec![4096, 16384, 65536];
            if head_dim >= 128 {
                c.push(131072);
            }
            c
        })
}

/// The last-level cache in bytes, from sysfs (`None` where it is not exposed).
fn last_level_cache() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    (0..8)
        .rev()
        .filter_map(|i| std::fs::read_to_string(dir.join(format!("index{i}/size"))).ok())
        .find_map(|size| {
            let size = size.trim();
            let (n, scale) = match size.strip_suffix('K') {
                Some(n) => (n, 1usize << 10),
                None => match size.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (size, 1),
                },
            };
            n.parse::<usize>().ok().map(|n| n * scale)
        })
}

/// A buffer of `bytes` (rounded up to whole words), touched so every page is resident.
fn stream_buffer(bytes: usize) -> Vec<u64> {
    (0..bytes.div_ceil(8))
        .into_par_iter()
        .map(|i| i as u64)
        .collect()
}

/// Streaming read: a wrapping sum over `buffer`, split over the pool's threads.
fn stream_read(buffer: &[u64]) -> u64 {
    buffer
        .par_chunks(buffer.len().div_ceil(THREADS))
        .map(|chunk| {
            let (lanes, tail) = chunk.as_chunks::<8>();
            let mut acc = [0u64; 8];
            for l in lanes {
                for i in 0..8 {
                    acc[i] = acc[i].wrapping_add(l[i]);
                }
            }
            acc.iter().chain(tail).fold(0u64, |a, &b| a.wrapping_add(b))
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// Measures decode attention over one pair of sources as stored bytes per
/// second, after `baseline-<name>`: a streaming read of the same bytes.
fn bench_form<K: KvSource, V: KvSource>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    pool: &rayon::ThreadPool,
    name: &str,
    (attn, q): (&Attention, &[f32]),
    keys: &K,
    values: &V,
) {
    let bytes = keys.stored_bytes() + values.stored_bytes();
    if let Some(llc) = last_level_cache() {
        eprintln!(
            "{name}: working set {:.1} MiB = {:.2}x the {} MiB last-level cache",
            bytes as f64 / f64::from(1 << 20),
            bytes as f64 / llc as f64,
            llc >> 20
        );
    }
    let stream = pool.install(|| stream_buffer(bytes));
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function(format!("baseline-{name}"), |b| {
        b.iter(|| pool.install(|| stream_read(black_box(&stream))))
    });
    drop(stream);
    let position = keys.tokens() - 1;
    // A decode loop's entry point: buffers and workspace kept across calls,
    // so a call allocates nothing (`decode` would add fresh buffers and
    // their page faults to every call).
    let shape = attn.shape();
    let (mut out, mut lse) = (vec![0.0f32; shape.q_len()], vec![0.0f32; shape.q_heads()]);
    let mut ws = Workspace::new();
    group.bench_function(name, |b| {
        b.iter(|| {
            pool.install(|| {
                attn.decode_into(
                    black_box(q),
                    position,
                    keys,
                    values,
                    &Mask::Causal,
                    &mut out,
                    &mut lse,
                    &mut ws,
                )
                .expect("decode");
                out[0]
            })
        })
    });
}

fn decode(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("pool");
    for &(q_heads, kv_heads, d) in &SHAPES {
        let shape = HeadShape::new(q_heads, kv_heads, d).expect("shape");
        let ch = shape.kv_channels();
        let mut attn = Attention::new(shape);
        attn.set_numerics(Numerics::Exact);
        let coded = |numerics| {
            let mut a = attn;
            a.set_numerics(numerics);
            a
        };
        let fast = [
            ("int8q", coded(Numerics::Int8Query)),
            ("int16q", coded(Numerics::Int16Query)),
        ];
        let q = smooth_rows(1, shape.q_len(), 0.3);
        for tokens in contexts(d) {
            let (k, v) =
                pool.install(|| (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0)));
            let mut group = c.benchmark_group(format!(
                "attention/decode-{q_heads}x{kv_heads}x{d}-{}k",
                tokens / 1024
            ));
            group
                .sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2));
            let dense_k = DenseKv::new(&k, tokens, ch).expect("k");
            let dense_v = DenseKv::new(&v, tokens, ch).expect("v");
            bench_form(&mut group, &pool, "fp32", (&attn, &q), &dense_k, &dense_v);
            for spelling in FORMS {
                let form: CacheForm = spelling.parse().expect("form");
                let (ks, vs) = pool.install(|| {
                    (
                        KvStore::quantize(form, &k, tokens, ch).expect("quantize k"),
                        KvStore::quantize(form, &v, tokens, ch).expect("quantize v"),
                    )
                });
                bench_form(&mut group, &pool, spelling, (&attn, &q), &ks, &vs);
                if integer_keys(spelling) {
                    for (suffix, attn) in &fast {
                        let name = format!("{spelling}@{suffix}");
                        bench_form(&mut group, &pool, &name, (attn, &q), &ks, &vs);
                    }
                }
            }
            group.finish();
        }
    }
}

fn low_rank(c: &mut Criterion) {
    use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankStore};
    use std::sync::Arc;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("pool");
    for &(q_heads, kv_heads, d) in &SHAPES {
        let contexts: Vec<usize> = contexts(d)
            .into_iter()
            .filter(|t| (16384..=65536).contains(t))
            .collect();
        let shape = HeadShape::new(q_heads, kv_heads, d).expect("shape");
        let ch = shape.kv_channels();
        let attn = Attention::new(shape);
        let q = smooth_rows(1, shape.q_len(), 0.3);
        // Bases fitted on 2,048 rows of the same kind of data.
        let fit = |r: usize, phase: f32| {
            let rows = smooth_rows(2048, ch, phase);
            let heads = (0..kv_heads)
                .map(|h| {
                    let head: Vec<f32> = rows
                        .chunks_exact(ch)
                        .flat_map(|row| row[h * d..][..d].to_vec())
                        .collect();
                    let (b, _) = Basis::fit(
                        &head,
                        2048,
                        d,
                        kv_quant::RankRule::Fixed(r),
                        BasisStorage::F16,
                    )
                    .expect("fit");
                    Arc::new(b)
                })
                .collect();
            HeadBases { heads }
        };
        for &tokens in &contexts {
            let (k, v) =
                pool.install(|| (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0)));
            let name = format!(
                "attention/low-rank-{q_heads}x{kv_heads}x{d}-{}k",
                tokens / 1024
            );
            let mut group = fp16_group(c, name, &pool, &attn, &q, (&k, &v, tokens));
            let position = tokens - 1;
            for r in [d / 4, d / 2] {
                let form: CacheForm = format!("pca-r{r}").parse().expect("form");
                let (bk, bv) = (fit(r, 0.0), fit(r, 1.0));
                let (lk, lv) = pool.install(|| {
                    (
                        LowRankStore::build(form, &k, tokens, ch, d, Some(&bk)).expect("k"),
                        LowRankStore::build(form, &v, tokens, ch, d, Some(&bv)).expect("v"),
                    )
                });
                group.bench_function(format!("pca-r{r}"), |b| {
                    b.iter(|| {
                        pool.install(|| {
                            attn.attend_low_rank(
                                black_box(&q),
                                &[position],
                                &lk,
                                &lv,
                                &Mask::Causal,
                            )
                            .expect("decode")
                            .out[0]
                        })
                    })
                });
            }
            group.finish();
        }
    }
}

/// A group of `tokens`-token decode calls (10 samples, throughput in
/// tokens) whose first function is FP16 decode attention over `k`, `v`
/// (`baseline-fp16`).
fn fp16_group<'c>(
    c: &'c mut Criterion,
    name: String,
    pool: &rayon::ThreadPool,
    attn: &Attention,
    q: &[f32],
    (k, v, tokens): (&[f32], &[f32], usize),
) -> BenchmarkGroup<'c, WallTime> {
    let ch = k.len() / tokens;
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(tokens as u64));
    let fp16: CacheForm = "fp16".parse().expect("form");
    let (ks, vs) = pool.install(|| {
        (
            KvStore::quantize(fp16, k, tokens, ch).expect("k"),
            KvStore::quantize(fp16, v, tokens, ch).expect("v"),
        )
    });
    let position = tokens - 1;
    group.bench_function("baseline-fp16", |b| {
        b.iter(|| {
            pool.install(|| {
                attn.decode(black_box(q), position, &ks, &vs, &Mask::Causal)
                    .expect("decode")
                    .out[0]
            })
        })
    });
    group
}

/// `attention/shard-<q>x<kv>x<d>-<context>k`: decode attention over a whole
/// `shard` layer (4 sink and 64 window tokens exact, the middle compressed:
/// scores from the coefficients, values summed rotated) against FP16
/// decode attention over the same rows (`baseline-fp16`) in the same run;
/// throughput in tokens per second, so each ratio is the speed-up over FP16.
fn shard(c: &mut Criterion) {
    use attention::{Rope, RopeLayout, ShardLayer};
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("pool");
    for &(q_heads, kv_heads, d) in &SHAPES {
        let shape = HeadShape::new(q_heads, kv_heads, d).expect("shape");
        let ch = shape.kv_channels();
        let attn = Attention::new(shape);
        let q = smooth_rows(1, shape.q_len(), 0.3);
        let rope = Rope::new(RopeLayout::Adjacent, d, d, 100_000.0).expect("rope");
        for tokens in contexts(d).into_iter().filter(|&t| t <= 65536) {
            let (k, v) =
                pool.install(|| (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0)));
            let name = format!(
                "attention/shard-{q_heads}x{kv_heads}x{d}-{}k",
                tokens / 1024
            );
            let mut group = fp16_group(c, name, &pool, &attn, &q, (&k, &v, tokens));
            let position = tokens - 1;
            for spec in ["shard", "shard-k3"] {
                let form: CacheForm = spec.parse().expect("form");
                let layer = pool.install(|| {
                    ShardLayer::build(form, &k, &v, tokens, tokens, &rope).expect("shard")
                });
                eprintln!(
                    "{spec} at {tokens} tokens: {:.2}x smaller than f16",
                    (2 * tokens * ch * 2) as f64 / layer.stored_bytes() as f64
                );
                group.bench_function(spec, |b| {
                    b.iter(|| {
                        pool.install(|| {
                            layer
                                .attend(&attn, black_box(&q), &[position], &Mask::Causal)
                                .expect("decode")
                                .out[0]
                        })
                    })
                });
            }
            group.finish();
        }
    }
}

/// Keys coded before RoPE on pair codebooks, read as the paged cache read
/// them before they were scored against the codebook: each tile's rows
/// decoded, put back in channel order and rotated to their positions
/// (f64 rotation), then scored as f32 rows.
struct DecodedPairs<'a> {
    store: &'a KvStore,
    rope: &'a attention::Rope,
}

impl KvSource for DecodedPairs<'_> {
    type Scratch = (Vec<f32>, kv_quant::DecodeScratch, Vec<f32>);

    fn tokens(&self) -> usize {
        KvSource::tokens(self.store)
    }

    fn channels(&self) -> usize {
        KvSource::channels(self.store)
    }

    fn stored_bytes(&self) -> usize {
        KvSource::stored_bytes(self.store)
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        (rows, decode, head): &'s mut Self::Scratch,
    ) -> attention::Result<attention::Tile<'s>> {
        let ch = self.store.channels();
        rows.resize(count * ch, 0.0);
        let stats = self.store.decode_rows_into(start, count, rows, decode)?;
        self.rope.from_pair_order(rows, head);
        self.rope.apply_rows(rows, ch, start)?;
        Ok(attention::Tile {
            rows: attention::TileRows::F32(rows),
            stats,
        })
    }
}

/// `attention/pair-codes-<q>x<kv>x<d>-<context>k` (4K, 16K, 64K tokens):
/// decode attention over keys coded before RoPE on one 16-centroid
/// codebook per pair (`cq-d2-k16-pre`, values FP16), scored against the
/// codebook (`cq-d2-k16-pre`) and read as decoded, rotated rows
/// (`cq-d2-k16-pre-decoded`, the read path before), against FP16 decode
/// attention (`baseline-fp16`) in the same run; throughput in tokens per
/// second, so each ratio is the speed-up over FP16.
fn pair_codes(c: &mut Criterion) {
    use attention::stored::{Fitted, open_window};
    use attention::{Rope, RopeLayout};
    use kv_quant::{FitOptions, QuantizeOptions, VqCodebook};
    use std::sync::Arc;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("pool");
    let form: CacheForm = "cq-d2-k16-pre".parse().expect("form");
    for &(q_heads, kv_heads, d) in &SHAPES {
        let shape = HeadShape::new(q_heads, kv_heads, d).expect("shape");
        let ch = shape.kv_channels();
        let attn = Attention::new(shape);
        let q = smooth_rows(1, shape.q_len(), 0.3);
        let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).expect("rope");
        // The codebook, fitted on 2,048 rows of the same kind, in pair order.
        let mut train = smooth_rows(2048, ch, 0.0);
        rope.to_pair_order(&mut train, &mut Vec::new());
        let codebook =
            Arc::new(VqCodebook::fit(&form, &train, 2048, ch, FitOptions::default()).expect("fit"));
        let fitted = Fitted {
            codebook: Some(codebook.clone()),
            rope: Some(rope.clone()),
            ..Fitted::default()
        };
        for tokens in contexts(d).into_iter().filter(|&t| t <= 65536) {
            let (k, v) =
                pool.install(|| (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0)));
            let name = format!(
                "attention/pair-codes-{q_heads}x{kv_heads}x{d}-{}k",
                tokens / 1024
            );
            let mut group = fp16_group(c, name, &pool, &attn, &q, (&k, &v, tokens));
            let position = tokens - 1;
            let mut rotated = k.clone();
            for (t, row) in rotated.chunks_exact_mut(ch).enumerate() {
                rope.apply(row, t).expect("rope");
            }
            let window =
                open_window(form, &fitted, &rotated, (tokens, ch, d), Some(&rope)).expect("window");
            let mut paired = k.clone();
            rope.to_pair_order(&mut paired, &mut Vec::new());
            let options = QuantizeOptions::default();
            let store = KvStore::quantize_with_codebook(
                form,
                &paired,
                tokens,
                ch,
                options,
                codebook.clone(),
            )
            .expect("store");
            let fp16: CacheForm = "fp16".parse().expect("form");
            let vs = KvStore::quantize(fp16, &v, tokens, ch).expect("v");
            let decoded = DecodedPairs {
                store: &store,
                rope: &rope,
            };
            let source = window.source();
            for (spec, keys) in [
                ("cq-d2-k16-pre", &source as &dyn Bench),
                ("cq-d2-k16-pre-decoded", &decoded),
            ] {
                group.bench_function(spec, |b| {
                    b.iter(|| pool.install(|| keys.decode(&attn, black_box(&q), position, &vs)))
                });
            }
            group.finish();
        }
    }
}

/// One decode call over keys of any source type (so both key sources run
/// in one loop).
trait Bench: Sync {
    fn decode(&self, attn: &Attention, q: &[f32], position: usize, values: &KvStore) -> f32;
}

impl<K: KvSource> Bench for K {
    fn decode(&self, attn: &Attention, q: &[f32], position: usize, values: &KvStore) -> f32 {
        attn.decode(q, position, self, values, &Mask::Causal)
            .expect("decode")
            .out[0]
    }
}

criterion_group!(benches, decode, low_rank, shard, pair_codes);
criterion_main!(benches);
