//! Quantize and dequantize throughput of every form, in values per second.
//!
//! Group naming for `cargo xtask bench`: every group is `kv-quant/<figure>`,
//! and the function whose id starts with `baseline-` is the baseline of the
//! other functions in its group.
//!
//! - `kv-quant/dequantize`: tile-by-tile decode (64 tokens per tile, the way
//!   attention reads) of a 4096 × 128 matrix (one Llama-3 KV head at 4K
//!   context), against plain INT4 dequantization (`baseline-int4`) in the
//!   same run. Protected forms are measured clean and after a binary
//!   symmetric channel at BER 1e-2 (the paper's critical regime).
//! - `kv-quant/quantize`: quantizing the same matrix, against copying its f32
//!   values (`baseline-copy-f32`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::{CacheForm, DecodeScratch, FaultTarget, KvStore};

const TOKENS: usize = 4096;
const CHANNELS: usize = 128;
const TILE: usize = 64;

const FORMS: [&str; 14] = [
    "int4+secded84",
    "int4+secded84+interp",
    "int4+hamming74",
    "int4+golay24",
    "int4-g32",
    "int4-ch",
    "int8",
    "int3",
    "int2",
    "nf4",
    "fp8-e4m3",
    "fp8-e5m2",
    "fp16",
    "fp32",
];

fn matrix() -> Vec<f32> {
    (0..TOKENS * CHANNELS)
        .map(|i| {
            let (t, c) = ((i / CHANNELS) as f32, (i % CHANNELS) as f32);
            (0.01 * t + 0.37 * c).sin() * (1.0 + 0.02 * c)
        })
        .collect()
}

fn decode_all(store: &KvStore, out: &mut [f32], scratch: &mut DecodeScratch) -> u64 {
    let mut detected = 0;
    for start in (0..TOKENS).step_by(TILE) {
        let stats = store
            .decode_rows_into(start, TILE, &mut out[..TILE * CHANNELS], scratch)
            .expect("valid tile");
        detected += stats.values.detected;
    }
    detected
}

fn dequantize(c: &mut Criterion) {
    let data = matrix();
    let mut group = c.benchmark_group("kv-quant/dequantize");
    group.throughput(Throughput::Elements((TOKENS * CHANNELS) as u64));
    let mut out = vec![0f32; TILE * CHANNELS];
    let mut scratch = DecodeScratch::new();
    let mut bench = |name: String, store: &KvStore| {
        group.bench_function(name, |b| {
            b.iter(|| decode_all(black_box(store), &mut out, &mut scratch))
        });
    };
    let plain = KvStore::quantize("int4".parse().unwrap(), &data, TOKENS, CHANNELS).unwrap();
    bench("baseline-int4".into(), &plain);
    let ber = BinarySymmetric::new(1e-2).unwrap();
    for spelling in FORMS {
        let form: CacheForm = spelling.parse().unwrap();
        let store = KvStore::quantize(form, &data, TOKENS, CHANNELS).unwrap();
        bench(spelling.to_string(), &store);
        if form.protection().is_some() {
            let mut faulty = store.clone();
            faulty.inject(&ber, 1, FaultTarget::Everything);
            bench(format!("{spelling}@ber1e-2"), &faulty);
        }
    }
    group.finish();
}

fn quantize(c: &mut Criterion) {
    let data = matrix();
    let mut group = c.benchmark_group("kv-quant/quantize");
    group.throughput(Throughput::Elements((TOKENS * CHANNELS) as u64));
    group.bench_function("baseline-copy-f32", |b| {
        b.iter(|| black_box(&data).to_vec())
    });
    for spelling in ["int4"].into_iter().chain(FORMS) {
        let form: CacheForm = spelling.parse().unwrap();
        group.bench_function(spelling, |b| {
            b.iter(|| KvStore::quantize(form, black_box(&data), TOKENS, CHANNELS).unwrap())
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = dequantize, quantize
}
criterion_main!(benches);
