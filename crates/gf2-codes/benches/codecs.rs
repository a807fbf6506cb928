//! Batch codec throughput against baselines measured in the same run.
//!
//! Group naming for `cargo xtask bench`: every group is `gf2-codes/<figure>`,
//! and the function whose id starts with `baseline-` is the baseline of the
//! other functions in its group (same throughput unit).
//!
//! Inputs are random INT4 values, encoded, then hit by a binary symmetric
//! channel at p = 1e-3 (the paper's moderate regime), so decoders see a
//! realistic mix of clean, corrected and detected words.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gf2_codes::batch::{Backend, Int4Codec, erasure_words};
use gf2_codes::channel::{BinarySymmetric, FaultChannel, FaultRng};
use gf2_codes::{Golay24, Int4Code, Secded84};

fn random_values(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = FaultRng::new(seed);
    (0..n).map(|_| (rng.next_u64() & 0xF) as u8).collect()
}

fn noisy_encoding(codec: &dyn Int4Codec, values: &[u8], ber: f64) -> Vec<u8> {
    let mut enc = codec.encode(values).expect("values are nibbles");
    BinarySymmetric::new(ber).unwrap().inject(&mut enc, 42);
    enc
}

/// `n` bytes of `buf` (allocated with 64 to spare) starting at the same
/// offset within a 64-byte line as `like`, for the memcpy baselines: on an
/// AMD Zen 3 host `memcpy` (`rep movsb`) copied 256 KiB at 2.3 GB/s instead
/// of 40 between buffers whose offsets differed by 16 bytes, which made the
/// baseline depend on where the allocator put two vectors.
fn aligned_like<'a>(buf: &'a mut [u8], like: &[u8], n: usize) -> &'a mut [u8] {
    let (want, have) = (like.as_ptr() as usize % 64, buf.as_ptr() as usize % 64);
    let skip = (want + 64 - have) % 64;
    &mut buf[skip..skip + n]
}

/// Decode and encode throughput in encoded bytes per second, against memcpy
/// of the same number of bytes, at an L2-resident and a DRAM-sized buffer;
/// at a bit error rate of 1e-3 (about 40% of SECDED's 64-byte chunks hold a
/// flip) and of 1e-5 (about 0.5%: nearly every chunk takes the clean path).
fn decode_vs_memcpy(c: &mut Criterion) {
    let cases = [
        ("256KiB", 256 << 10, 1e-3, ""),
        ("64MiB", 64 << 20, 1e-3, ""),
        ("256KiB", 256 << 10, 1e-5, "_ber1e-5"),
        ("64MiB", 64 << 20, 1e-5, "_ber1e-5"),
    ];
    for (label, values_len, ber, suffix) in cases {
        let values = random_values(values_len, 1);
        let mut out = vec![0u8; values_len];
        let mut erasures = vec![0u64; erasure_words(values_len)];
        let mut group = c.benchmark_group(format!("gf2-codes/decode_{label}{suffix}"));
        group.throughput(Throughput::Bytes(values_len as u64));
        let src = vec![0x5Au8; values_len];
        let mut copy = vec![0u8; values_len + 64];
        let copy = aligned_like(&mut copy, &src, values_len);
        group.bench_function("baseline-memcpy", |b| {
            b.iter(|| copy.copy_from_slice(black_box(&src)))
        });
        for code in Int4Code::ALL.into_iter().chain(Int4Code::INTERLEAVED) {
            let codec = code.codec();
            let enc = noisy_encoding(codec, &values, ber);
            group.throughput(Throughput::Bytes(enc.len() as u64));
            for backend in Backend::available() {
                if code.is_interleaved() && backend != Backend::detect() {
                    continue; // the inner decoder's backends are measured above
                }
                let name = if backend == Backend::detect() {
                    code.to_string()
                } else {
                    format!("{code}-{backend:?}").to_lowercase()
                };
                group.bench_function(name, |b| {
                    b.iter(|| {
                        codec
                            .decode_into_with(backend, black_box(&enc), &mut out, &mut erasures)
                            .unwrap()
                    })
                });
            }
        }
        group.finish();
    }
}

fn encode_vs_memcpy(c: &mut Criterion) {
    let n = 256 << 10;
    let values = random_values(n, 2);
    let mut group = c.benchmark_group("gf2-codes/encode_256KiB");
    group.throughput(Throughput::Bytes(n as u64));
    let mut dst = vec![0u8; n + 64];
    let dst = aligned_like(&mut dst, &values, n);
    group.bench_function("baseline-memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&values)))
    });
    for code in Int4Code::ALL {
        let codec = code.codec();
        let mut enc = vec![0u8; codec.encoded_len(n)];
        group.bench_function(code.to_string(), |b| {
            b.iter(|| codec.encode_into(black_box(&values), &mut enc).unwrap())
        });
    }
    group.finish();
}

/// What interleaving costs: the interleaved layouts' decode (the 8×8 bit
/// transposes, then the inner decoder) against the inner code's decode of
/// the same values, 256 KiB at BER 1e-3.
fn interleaved_vs_plain(c: &mut Criterion) {
    let n = 256 << 10;
    let values = random_values(n, 4);
    let mut out = vec![0u8; n];
    let mut erasures = vec![0u64; erasure_words(n)];
    for code in Int4Code::INTERLEAVED {
        let (woven, plain) = (code.codec(), code.base().codec());
        let mut group = c.benchmark_group(format!("gf2-codes/interleaved_{}", code.base()));
        group.throughput(Throughput::Bytes(plain.encoded_len(n) as u64));
        let enc = noisy_encoding(plain, &values, 1e-3);
        group.bench_function(format!("baseline-{}", code.base()), |b| {
            b.iter(|| {
                plain
                    .decode_into(black_box(&enc), &mut out, &mut erasures)
                    .unwrap()
            })
        });
        let enc = noisy_encoding(woven, &values, 1e-3);
        group.bench_function(code.to_string(), |b| {
            b.iter(|| {
                woven
                    .decode_into(black_box(&enc), &mut out, &mut erasures)
                    .unwrap()
            })
        });
        group.finish();
    }
}

/// Codewords per second of the batch decoders against the generic
/// `LinearCode` syndrome decoder (the plain implementation) on the same words.
fn batch_vs_generic(c: &mut Criterion) {
    let n = 3 * 65536;
    let values = random_values(n, 3);
    let mut out = vec![0u8; n];
    let mut erasures = vec![0u64; erasure_words(n)];
    for (code, codec, bytes_per_word) in [
        (Int4Code::Golay24, &Golay24 as &dyn Int4Codec, 3usize),
        (Int4Code::Secded84, &Secded84, 1),
    ] {
        let enc = noisy_encoding(codec, &values, 1e-3);
        let words = codec.codewords(n);
        let linear = code.linear_code();
        let mut group = c.benchmark_group(format!("gf2-codes/{code}_codewords"));
        group.throughput(Throughput::Elements(words as u64));
        group.bench_function("baseline-linear-code", |b| {
            b.iter(|| {
                let mut acc = 0u64;
                for w in black_box(&enc).chunks_exact(bytes_per_word) {
                    let word = w.iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x));
                    acc ^= linear.decode_word(word).unwrap().data;
                }
                acc
            })
        });
        group.bench_function("batch", |b| {
            b.iter(|| {
                codec
                    .decode_into(black_box(&enc), &mut out, &mut erasures)
                    .unwrap()
            })
        });
        group.finish();
    }
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = decode_vs_memcpy, encode_vs_memcpy, interleaved_vs_plain, batch_vs_generic
}
criterion_main!(benches);
