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
//! - `kv-quant/write`: the write path, one token row at a time through a
//!   [`RowEncoder`] into preallocated buffers (what a paged cache does on
//!   every appended token), against copying the same f32 rows one at a time
//!   (`baseline-copy-rows`). Throughput in values per second on one thread.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, KvStore, QuantizeOptions, RowBuffersMut, RowEncoder,
};

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

fn write(c: &mut Criterion) {
    let data = matrix();
    let mut group = c.benchmark_group("kv-quant/write");
    group.throughput(Throughput::Elements((TOKENS * CHANNELS) as u64));
    let mut copy = vec![0f32; TOKENS * CHANNELS];
    group.bench_function("baseline-copy-rows", |b| {
        b.iter(|| {
            for (dst, src) in copy
                .chunks_exact_mut(CHANNELS)
                .zip(black_box(&data).chunks_exact(CHANNELS))
            {
                dst.copy_from_slice(src);
            }
        })
    });
    for spelling in [
        "int4",
        "int4+secded84",
        "int4-g32",
        "int8",
        "fp16",
        "lm4",
        "int4+rot",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let mut encoder = RowEncoder::new(form, CHANNELS, None).unwrap();
        let sizes = encoder.buffer_sizes(TOKENS);
        let one = encoder.buffer_sizes(1);
        let mut bytes = vec![0u8; sizes.data];
        let mut scales = vec![0u8; sizes.scales];
        let mut offsets = vec![0u8; sizes.offsets];
        let mut sc = vec![0u8; sizes.scale_checks];
        let mut oc = vec![0u8; sizes.offset_checks];
        group.bench_function(spelling, |b| {
            b.iter(|| {
                for (t, row) in black_box(&data).chunks_exact(CHANNELS).enumerate() {
                    let out = RowBuffersMut {
                        data: &mut bytes[t * one.data..][..one.data],
                        scales: &mut scales[t * one.scales..][..one.scales],
                        offsets: &mut offsets[t * one.offsets..][..one.offsets],
                        scale_checks: &mut sc[t * one.scale_checks..][..one.scale_checks],
                        offset_checks: &mut oc[t * one.offset_checks..][..one.offset_checks],
                    };
                    encoder
                        .encode_into(row, out, QuantizeOptions::default())
                        .unwrap();
                }
            })
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
    targets = dequantize, quantize, write
}
criterion_main!(benches);
