//! `cargo xtask bench abft-gemm`: checked GEMM against plain GEMM in the
//! same run, at 1024³ and 2048³, f32 and BF16 inputs. Throughput is
//! multiply-accumulates of the product per second.
//!
//! - `checked-*`: GEMM then verification; `ratio = checked / plain`, so the
//!   overhead is `1/ratio − 1`. On this 2-core machine GEMM timings vary
//!   by ±10% between runs, which swamps a few percent of overhead.
//! - `verify-*`: the verification alone (checksums and thresholds) on the
//!   finished C, timed in the same run; its ratio is GEMM time over
//!   verification time, so the overhead is `1/ratio` (ratio ≥ 10 meets the
//!   10% goal). This is the steadier figure.

use std::hint::black_box;

use abft_gemm::{
    AAbft, Distribution, Matrix, Precision, Sampling, VAbft, gemm, verify_rows, verify_rows_sampled,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    for p in [Precision::Fp32, Precision::Bf16] {
        for n in [1024usize, 2048] {
            let a = Matrix::random(n, n, Distribution::Uniform, 1.0, p, 1);
            let b = Matrix::random(n, n, Distribution::Uniform, 1.0, p, 2);
            let mut g = c.benchmark_group(format!("abft-gemm/{}-{n}", p.name()));
            g.sample_size(10)
                .throughput(Throughput::Elements((n * n * n) as u64));
            let vabft = VAbft::design(p.e_max_ascend());
            let sampled = VAbft {
                sampling: Some(Sampling {
                    period: 32,
                    keep: 16,
                }),
                ..vabft
            };
            let aabft = AAbft::for_precision(p);
            g.bench_function("baseline-gemm", |bch| {
                bch.iter(|| black_box(gemm(&a, &b, p).unwrap()))
            });
            g.bench_function("checked-vabft", |bch| {
                bch.iter(|| {
                    let c = gemm(&a, &b, p).unwrap().c;
                    black_box(verify_rows(&a, &b, &c, &vabft))
                })
            });
            g.bench_function("checked-vabft-sampled", |bch| {
                bch.iter(|| {
                    let c = gemm(&a, &b, p).unwrap().c;
                    black_box(verify_rows_sampled(&a, &b, &c, &sampled))
                })
            });
            let c0 = gemm(&a, &b, p).unwrap().c;
            g.bench_function("verify-vabft", |bch| {
                bch.iter(|| black_box(verify_rows(&a, &b, &c0, &vabft)))
            });
            g.bench_function("verify-vabft-sampled", |bch| {
                bch.iter(|| black_box(verify_rows_sampled(&a, &b, &c0, &sampled)))
            });
            g.bench_function("verify-aabft", |bch| {
                bch.iter(|| black_box(verify_rows(&a, &b, &c0, &aabft)))
            });
            g.bench_function("checked-aabft", |bch| {
                bch.iter(|| {
                    let c = gemm(&a, &b, p).unwrap().c;
                    black_box(verify_rows(&a, &b, &c, &aabft))
                })
            });
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
