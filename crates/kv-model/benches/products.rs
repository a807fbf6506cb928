//! The product kernels against same-run baselines (`cargo xtask bench
//! kv-model`):
//!
//! - `kv-model/decode/<TYPE>`: one token through matrices of 2048 × 2048
//!   weights whose stored bytes total 64 MiB (past the last-level cache, as
//!   a model's weights are), against `baseline-<TYPE>`, a streaming read of
//!   exactly those bytes on every pool thread: the ratio is the share of
//!   the memory bandwidth the kernel reaches;
//! - `kv-model/prefill/<TYPE>`: 64 tokens through one 2048 × 2048 matrix,
//!   against `baseline-f32`, abft-gemm's f32 product (faer's GEMM, what
//!   kv-eval multiplied by before kv-model) on the same shapes, in
//!   multiply-adds per second;
//! - `kv-model/guard/<check|decode-Q4_K>`: a [`WeightGuard`] check (the CRC
//!   of every row) over `Q4_K` matrices whose bytes total 64 MiB, and one
//!   token's product through the same matrices, against `baseline-read`,
//!   the streaming read of those bytes: what a check costs beside a
//!   decode step;
//! - `kv-model/decode-isa/<TYPE>[-cached]`: one token on AVX-512 VNNI
//!   against the same product pinned to AVX2, through 64 MiB of matrices
//!   and through one matrix the caches hold, for the types whose one-token
//!   kernels VNNI sums (on a CPU with AVX-512 VNNI);
//! - `kv-model/prefill-isa/<TYPE>`: 64 tokens on AVX-512 VNNI against the
//!   same product pinned to AVX2, for the types whose token lanes VNNI
//!   sums (on a CPU with AVX-512 VNNI).

use abft_gemm::Matrix;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_model::model::{Projection, WeightGuard};
use kv_model::weights::{Isa, QuantMatrix, StoredLinear, WeightType};
use rayon::prelude::*;
use std::hint::black_box;

const TYPES: [WeightType; 10] = [
    WeightType::F32,
    WeightType::F16,
    WeightType::Q8_0,
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q4_K,
    WeightType::Q5_K,
    WeightType::Q6_K,
];

const SIDE: usize = 2048;

/// A `SIDE × SIDE` matrix of `ty` with codes from a fixed pattern and small
/// finite scales.
fn matrix(ty: WeightType, seed: usize) -> StoredLinear {
    if ty.block_elems() == 1 {
        let v: Vec<f32> = (0..SIDE * SIDE)
            .map(|i| ((i + seed) % 17) as f32 * 0.01)
            .collect();
        let m = QuantMatrix::from_f32(SIDE, SIDE, &v).unwrap();
        let m = if ty == WeightType::F32 {
            m
        } else {
            let data: Vec<u8> = v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect();
            QuantMatrix::new(ty, SIDE, SIDE, data).unwrap()
        };
        return StoredLinear::new(vec![m]).unwrap();
    }
    let len = QuantMatrix::data_len(ty, SIDE, SIDE).unwrap();
    let mut data: Vec<u8> = (0..len).map(|i| ((i + seed) * 131 % 251) as u8).collect();
    let scale = half::f16::from_f32(0.01).to_le_bytes();
    let at: &[usize] = if ty == WeightType::Q6_K {
        &[208]
    } else {
        &[0, 2]
    };
    for block in data.chunks_exact_mut(ty.block_bytes()) {
        for &a in at {
            block[a..a + 2].copy_from_slice(&scale);
        }
    }
    StoredLinear::new(vec![QuantMatrix::new(ty, SIDE, SIDE, data).unwrap()]).unwrap()
}

fn input(t: usize) -> Vec<f32> {
    (0..t * SIDE)
        .map(|i| ((i % 29) as f32 - 14.0) * 0.1)
        .collect()
}

fn decode(c: &mut Criterion) {
    let isa = Isa::detect();
    let x = input(1);
    let mut out = vec![0.0; SIDE];
    let mut g = c.benchmark_group("kv-model/decode");
    for ty in TYPES {
        let per = QuantMatrix::data_len(ty, SIDE, SIDE).unwrap();
        let count = (64usize << 20).div_ceil(per);
        let ms: Vec<StoredLinear> = (0..count).map(|s| matrix(ty, s)).collect();
        g.throughput(Throughput::Bytes((count * per) as u64));
        g.bench_function(ty.name(), |b| {
            b.iter(|| {
                for m in &ms {
                    m.product_into(&mut out, black_box(&x), false, isa).unwrap();
                }
            })
        });
        g.bench_function(format!("baseline-{}", ty.name()), |b| {
            // Read on every pool thread, as the product runs.
            b.iter(|| read_all(&ms))
        });
    }
    g.finish();
}

fn prefill(c: &mut Criterion) {
    let isa = Isa::detect();
    let t = 64;
    let x = input(t);
    let mut out = vec![0.0; t * SIDE];
    let mut g = c.benchmark_group("kv-model/prefill");
    g.throughput(Throughput::Elements((t * SIDE * SIDE) as u64));
    for ty in TYPES {
        let m = matrix(ty, 0);
        g.bench_function(ty.name(), |b| {
            b.iter(|| m.product_into(&mut out, black_box(&x), false, isa).unwrap())
        });
    }
    let dense = Matrix::new(SIDE, SIDE, matrix(WeightType::F32, 0).to_f32()).unwrap();
    g.bench_function("baseline-f32", |b| {
        b.iter(|| abft_gemm::linear_into(&mut out, black_box(&x), &dense, false).unwrap())
    });
    g.finish();
}

/// `kv-model/prefill-isa/<TYPE>`: the prefill product of the types with
/// AVX-512 VNNI kernels on that set, against `baseline-<TYPE>`, the same
/// product pinned to AVX2 (the ratio is what VNNI gains); skipped with a
/// printed reason on a CPU without AVX-512 VNNI.
fn prefill_isa(c: &mut Criterion) {
    if !Isa::Avx512Vnni.is_supported() {
        eprintln!("kv-model/prefill-isa: skipped, this CPU has no AVX-512 VNNI");
        return;
    }
    let t = 64;
    let x = input(t);
    let mut out = vec![0.0; t * SIDE];
    let mut g = c.benchmark_group("kv-model/prefill-isa");
    g.throughput(Throughput::Elements((t * SIDE * SIDE) as u64));
    for ty in [
        WeightType::Q4_0,
        WeightType::Q5_0,
        WeightType::Q4_K,
        WeightType::Q6_K,
    ] {
        let m = matrix(ty, 0);
        for (name, isa) in [
            (ty.name().to_string(), Isa::Avx512Vnni),
            (format!("baseline-{}", ty.name()), Isa::Avx2),
        ] {
            g.bench_function(name, |b| {
                b.iter(|| m.product_into(&mut out, black_box(&x), false, isa).unwrap())
            });
        }
    }
    g.finish();
}

/// `kv-model/decode-isa/<TYPE>`: one token through `ty`'s 64 MiB of
/// matrices (as `decode`) and through one matrix of 2048 × 2048 that the
/// caches hold (`-cached`), on AVX-512 VNNI against the same product
/// pinned to AVX2 (`baseline-…`), for the types whose one-token kernels
/// VNNI sums (on a CPU with AVX-512 VNNI).
fn decode_isa(c: &mut Criterion) {
    if !Isa::Avx512Vnni.is_supported() {
        eprintln!("kv-model/decode-isa: skipped, this CPU has no AVX-512 VNNI");
        return;
    }
    let x = input(1);
    let mut out = vec![0.0; SIDE];
    let mut g = c.benchmark_group("kv-model/decode-isa");
    for ty in [
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q8_0,
    ] {
        let per = QuantMatrix::data_len(ty, SIDE, SIDE).unwrap();
        let count = (64usize << 20).div_ceil(per);
        let ms: Vec<StoredLinear> = (0..count).map(|s| matrix(ty, s)).collect();
        for (what, ms) in [("", &ms[..]), ("-cached", &ms[..1])] {
            g.throughput(Throughput::Bytes((ms.len() * per) as u64));
            for (name, isa) in [
                (format!("{}{what}", ty.name()), Isa::Avx512Vnni),
                (format!("baseline-{}{what}", ty.name()), Isa::Avx2),
            ] {
                g.bench_function(name, |b| {
                    b.iter(|| {
                        for m in ms {
                            m.product_into(&mut out, black_box(&x), false, isa).unwrap();
                        }
                    })
                });
            }
        }
    }
    g.finish();
}

/// Streams `ms`' bytes on every pool thread (the memory-bandwidth baseline).
fn read_all(ms: &[StoredLinear]) -> u64 {
    ms.iter().fold(0u64, |s, m| {
        let sum = black_box(m.parts()[0].data())
            .par_chunks(64 << 10)
            .map(|chunk| {
                chunk.chunks_exact(8).fold(0u64, |s, c| {
                    s.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()))
                })
            })
            .reduce(|| 0, u64::wrapping_add);
        s.wrapping_add(sum)
    })
}

fn guard(c: &mut Criterion) {
    let ty = WeightType::Q4_K;
    let per = QuantMatrix::data_len(ty, SIDE, SIDE).unwrap();
    let count = (64usize << 20).div_ceil(per);
    let ps: Vec<Projection> = (0..count)
        .map(|s| Projection::Stored(matrix(ty, s)))
        .collect();
    let guards: Vec<WeightGuard> = ps
        .iter()
        .map(|p| WeightGuard::new(p, kv_model::model::DEFAULT_ROWS_PER_GROUP).unwrap())
        .collect();
    let ms: Vec<StoredLinear> = (0..count).map(|s| matrix(ty, s)).collect();
    let (x, mut out, isa) = (input(1), vec![0.0; SIDE], Isa::detect());
    let mut g = c.benchmark_group("kv-model/guard");
    g.throughput(Throughput::Bytes((count * per) as u64));
    g.bench_function("check", |b| {
        b.iter(|| {
            for (guard, p) in guards.iter().zip(&ps) {
                assert!(guard.verify(black_box(p)).unwrap().is_empty());
            }
        })
    });
    g.bench_function("decode-Q4_K", |b| {
        b.iter(|| {
            for m in &ms {
                m.product_into(&mut out, black_box(&x), false, isa).unwrap();
            }
        })
    });
    g.bench_function("baseline-read", |b| b.iter(|| read_all(&ms)));
    g.finish();
}

criterion_group!(benches, decode, decode_isa, prefill, prefill_isa, guard);
criterion_main!(benches);
