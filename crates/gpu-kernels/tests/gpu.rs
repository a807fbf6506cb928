//! GPU tests against the CPU crates as oracles: batch ECC decode (values,
//! erasures, statistics equal to gf2-codes'), dequantisation (bit-equal to
//! kv-quant), fused paged decoding in every compiled variant (within 2e-5
//! relative of paged-cache's CPU decode, every output written), checked GEMM (the injected fault's row
//! flagged, none on a clean product). Where there is no device each test
//! skips visibly (`test_support::skip`: named in `cargo xtask test`'s
//! summary; a failure under `REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

use abft_gemm::{Matrix, Precision, Threshold, VAbft};
use attention::{Attention, HeadShape, Numerics};
use gf2_codes::Int4Code;
use gf2_codes::channel::{BinarySymmetric, FaultRng};
use gpu_kernels::{Gpu, GpuError};
use half::bf16;
use kv_quant::{CacheForm, FaultTarget, KvStore};
use paged_cache::{BlockId, BlockStorage, KvPart, LayerSpec, PageTable, paged_decode};

fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::open_default() {
        Ok(g) => Some(g),
        Err(GpuError::NoDevice(why)) => {
            test_support::skip(
                test_support::Requirement::Gpu,
                "gpu-kernels",
                test,
                &format!("no CUDA device ({why})"),
            );
            None
        }
        Err(e) => panic!("opening the device: {e}"),
    }
}

fn normal(rng: &mut FaultRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

#[test]
fn ecc_decode_matches_the_cpu_codecs() {
    let Some(gpu) = gpu("ecc_decode_matches_the_cpu_codecs") else {
        return;
    };
    let mut rng = FaultRng::new(7);
    for code in Int4Code::ALL {
        for count in [1usize, 5, 63, 64, 1000, 100_003] {
            let values: Vec<u8> = (0..count).map(|_| (rng.next_u64() & 15) as u8).collect();
            let mut enc = code.codec().encode(&values).unwrap();
            for byte in enc.iter_mut() {
                for bit in 0..8 {
                    if rng.next_f64() < 0.02 {
                        *byte ^= 1 << bit;
                    }
                }
            }
            if code == Int4Code::Hamming74 {
                // Bits past the last codeword are not part of any word.
                let used = 7 * count % 8;
                if used != 0 {
                    *enc.last_mut().unwrap() &= (1u8 << used) - 1;
                }
            }
            let cpu = code.codec().decode(&enc, count).unwrap();
            let dev = gpu.ecc_decode(code, &enc, count).unwrap();
            assert_eq!(dev.values, cpu.values, "{code} {count}");
            assert_eq!(dev.erasures, cpu.erasures, "{code} {count}");
            assert_eq!(dev.stats, cpu.stats, "{code} {count}");
        }
    }
    assert!(matches!(
        gpu.ecc_decode(Int4Code::Secded84, &[0; 3], 4),
        Err(GpuError::ShapeMismatch { .. })
    ));
}

#[test]
fn dequantize_is_bit_equal_to_kv_quant() {
    let Some(gpu) = gpu("dequantize_is_bit_equal_to_kv_quant") else {
        return;
    };
    let mut rng = FaultRng::new(11);
    let (tokens, channels) = (97, 256);
    let data = normal(&mut rng, tokens * channels);
    for spelling in [
        "int4",
        "int4-g64",
        "int4-sym-g32",
        "int4-ch",
        "int4-ch32",
        "int4-g128-sf32",
        "fp8-e4m3",
        "fp8-e5m2",
        "fp8-e4m3-h64",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let store = KvStore::quantize(form, &data, tokens, channels).unwrap();
        let cpu = store.decode().unwrap().values;
        let dev = gpu.dequantize(&store).unwrap();
        assert_eq!(cpu.len(), dev.len(), "{spelling}: lengths");
        let same = cpu
            .iter()
            .zip(&dev)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{spelling}");
    }
    let protected =
        KvStore::quantize("int4+secded84".parse().unwrap(), &data, tokens, channels).unwrap();
    assert!(matches!(
        gpu.dequantize(&protected),
        Err(GpuError::Unsupported { .. })
    ));
}

/// Relative L2 error allowed between the device's and the CPU's decode
/// outputs. Both read the same stored bytes (f16 and INT4 dequantise
/// exactly) and accumulate in f32, in different orders and with different
/// `exp` implementations: about `ε·√n` = 6e-8 · 32 for the longest
/// sequence (1,031 tokens), with a tenfold margin.
const PAGED_DECODE_TOLERANCE: f64 = 2e-5;

/// Random sequences over a shared pool, CPU and device decode compared, for
/// every compiled kernel instance: head_dim 64 and 128 × 1, 2, 4 and 8
/// query heads per KV head × every handled value form.
#[test]
fn paged_decode_matches_the_cpu_in_every_variant() {
    let Some(gpu) = gpu("paged_decode_matches_the_cpu_in_every_variant") else {
        return;
    };
    let kv_heads = 4;
    let block = 16;
    let lens = [1usize, 15, 16, 17, 200, 1031];
    let blocks: usize = lens.iter().map(|l| l.div_ceil(block)).sum();
    let mut kernels = std::collections::BTreeSet::new();
    for hd in [64, 128] {
        for group in [1, 2, 4, 8] {
            let q_heads = kv_heads * group;
            for (spelling, ber) in [
                ("fp16", 0.0),
                ("int4", 0.0),
                ("int4-g64", 0.0),
                ("int4-sym-g32-sf32", 0.0),
                ("int4+secded84+meta-secded", 1e-3),
                ("int4+secded84+zero+meta-secded", 1e-3),
                ("int4-g64+secded84+interp+meta-secded", 1e-3),
                ("int4+secded84+interp+meta-secded", 1e-2),
                // Tensor-core kernels: whole-head groups, affine and
                // symmetric, f16 and f32 scales; SECDED without faults and
                // with a few (most tiles clean, some on the exact route).
                ("int4-g128", 0.0),
                ("int4-sym-sf32", 0.0),
                ("int4+secded84+meta-secded", 0.0),
                ("int4-g128+secded84+interp+meta-secded", 2e-5),
            ] {
                let case = format!("{spelling} hd {hd} group {group}");
                kernels.extend(paged_decode_case(
                    &gpu,
                    &case,
                    spelling,
                    ber,
                    (q_heads, kv_heads, hd),
                    block,
                    &lens,
                    blocks,
                ));
            }
        }
    }
    // Both kernel families ran, every tensor-core instance among them.
    for coding in ["int4", "secded"] {
        for hd in [64, 128] {
            for group in [1, 2, 4, 8] {
                let name = gpu_kernels::sources::paged_mma_kernel(coding, hd, group);
                assert!(kernels.contains(&name), "{name} never ran");
            }
        }
    }
    assert!(kernels.iter().any(|k| k.starts_with("paged_decode_secded")));
}

/// Layouts the main test does not reach, on both kernel families: blocks
/// of 8 tokens (a 16-token tile spans two blocks, so the tensor-core kernel
/// looks pages up per row), 3 KV heads, symmetric SECDED INT4, SECDED
/// metadata over f32 scales, and faults on every one.
#[test]
fn paged_decode_matches_the_cpu_in_other_layouts() {
    let Some(gpu) = gpu("paged_decode_matches_the_cpu_in_other_layouts") else {
        return;
    };
    let lens = [1usize, 8, 9, 23, 300];
    let mut ran = Vec::new();
    for (block, kv_heads) in [(8, 4), (16, 3)] {
        let blocks: usize = lens.iter().map(|l| l.div_ceil(block)).sum();
        for hd in [64, 128] {
            for (spelling, ber) in [
                ("int4", 0.0),
                ("int4-sym+secded84+meta-secded", 1e-4),
                ("int4-sf32+secded84+interp+meta-secded", 1e-4),
                ("int4+secded84+zero+meta-secded", 1e-3),
            ] {
                let case = format!("{spelling} hd {hd} blocks of {block}, {kv_heads} KV heads");
                ran.extend(paged_decode_case(
                    &gpu,
                    &case,
                    spelling,
                    ber,
                    (4 * kv_heads, kv_heads, hd),
                    block,
                    &lens,
                    blocks,
                ));
            }
        }
    }
    assert!(ran.iter().any(|k| k.starts_with("paged_mma_secded")));
}

#[allow(clippy::too_many_arguments)]
fn paged_decode_case(
    gpu: &Gpu,
    case: &str,
    spelling: &str,
    ber: f64,
    (q_heads, kv_heads, hd): (usize, usize, usize),
    block: usize,
    lens: &[usize],
    blocks: usize,
) -> Vec<String> {
    let channels = kv_heads * hd;
    let form: CacheForm = spelling.parse().unwrap();
    let storage = BlockStorage::new(blocks, block, &[LayerSpec::uniform(form, channels)]).unwrap();
    let mut rng = FaultRng::new(3);
    let mut tables = Vec::new();
    let mut next = 0u32;
    for &len in lens {
        let ids: Vec<BlockId> = (0..len.div_ceil(block))
            .map(|i| BlockId(next + i as u32))
            .collect();
        next += ids.len() as u32;
        for t in 0..len {
            let (k, v) = (normal(&mut rng, channels), normal(&mut rng, channels));
            storage.write(ids[t / block], t % block, 0, &k, &v).unwrap();
        }
        tables.push((ids, len));
    }
    if ber > 0.0 {
        let ch = BinarySymmetric::new(ber).unwrap();
        for b in 0..blocks {
            for part in [KvPart::Keys, KvPart::Values] {
                storage
                    .inject(
                        BlockId(b as u32),
                        0,
                        part,
                        &ch,
                        100 + b as u64,
                        FaultTarget::Everything,
                    )
                    .unwrap();
            }
        }
    }
    let refs: Vec<(&[BlockId], usize)> = tables.iter().map(|(i, l)| (i.as_slice(), *l)).collect();
    let table = PageTable::from_tables(&refs, block).unwrap();
    let queries = normal(&mut rng, lens.len() * q_heads * hd);
    // The CPU reference dequantises exactly (its default, `Auto`, would
    // score INT4 keys with int8-coded queries).
    let mut attention = Attention::new(HeadShape::new(q_heads, kv_heads, hd).unwrap());
    attention.set_numerics(Numerics::Exact);
    let cpu = paged_decode(&attention, &storage, &table, 0, &queries).unwrap();
    assert_eq!(cpu.len(), lens.len(), "{case}: CPU sequences");

    let layer = gpu.upload_layer(&storage, 0, hd).unwrap();
    let dt = gpu.upload_page_table(&layer, &table).unwrap();
    let mut kernels = Vec::new();
    let paths: &[bool] = if layer.tensor_cores_apply() {
        &[true, false]
    } else {
        &[false]
    };
    for (&tensor_cores, split) in paths
        .iter()
        .flat_map(|t| [None, Some(64), Some(256)].map(|s| (t, s)))
    {
        let mut ws = gpu.paged_workspace(&layer, &dt, q_heads, split).unwrap();
        ws.use_tensor_cores(tensor_cores);
        let kernel = gpu.paged_kernel(&layer, &ws);
        let case = format!("{case} [{kernel}]");
        gpu.set_queries(&mut ws, &queries).unwrap();
        gpu.fill_outputs(&mut ws, f32::NAN).unwrap();
        gpu.launch_paged_decode(&layer, &dt, &mut ws).unwrap();
        let dev = gpu.paged_output(&ws).unwrap();
        assert_eq!(
            dev.out.len(),
            lens.len() * q_heads * hd,
            "{case}: device outputs"
        );
        assert!(
            dev.out.iter().all(|x| x.is_finite()),
            "{case}: unwritten or non-finite output"
        );
        let mut stats = kv_quant::KvDecodeStats::default();
        for (i, c) in cpu.iter().enumerate() {
            assert_eq!(c.out.len(), q_heads * hd, "{case}: CPU outputs of seq {i}");
            let d = &dev.out[i * q_heads * hd..][..q_heads * hd];
            let num: f64 = c
                .out
                .iter()
                .zip(d)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = c.out.iter().map(|a| f64::from(*a).powi(2)).sum();
            assert!(
                num.sqrt() <= PAGED_DECODE_TOLERANCE * den.sqrt().max(1e-30),
                "{case} seq {i} split {split:?}: rel {}",
                (num / den).sqrt()
            );
            stats += c.stats.keys;
            stats += c.stats.values;
        }
        if form.protection().is_some() {
            // The device decodes without the store's ledger of injected
            // faults: it cannot tell a miscorrection from a correction.
            assert_eq!(dev.stats, stats.without_truth(), "{case}");
        }
        kernels.push(kernel);
    }
    kernels
}

#[test]
fn checked_gemm_flags_the_injected_row_only() {
    let Some(gpu) = gpu("checked_gemm_flags_the_injected_row_only") else {
        return;
    };
    let (m, k, n) = (256, 512, 384);
    let mut rng = FaultRng::new(5);
    let a: Vec<bf16> = normal(&mut rng, m * k)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let b: Vec<bf16> = normal(&mut rng, k * n)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let rule = VAbft::design(Precision::Bf16.e_max_ascend());
    let mut g = gpu.checked_gemm(&a, &b, m, k, n).unwrap();
    gpu.gemm(&mut g).unwrap();
    gpu.queue_check(&mut g, &rule).unwrap();
    let clean = gpu.check_verdict(&g).unwrap();
    assert!(
        clean.flagged.is_empty(),
        "false positives: {:?}",
        clean.flagged
    );
    // The CPU rule on the same matrices gives bounds within rounding of the device's.
    let to_f32 = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let (am, bm) = (
        Matrix::new(m, k, to_f32(&a)).unwrap(),
        Matrix::new(k, n, to_f32(&b)).unwrap(),
    );
    let cm = Matrix::new(m, n, gpu.read_c(&g).unwrap()).unwrap();
    let cpu_bounds = rule.rows(&am, &bm, &cm);
    assert_eq!(cpu_bounds.len(), clean.bounds.len(), "one bound per row");
    for (cpu, dev) in cpu_bounds.iter().zip(&clean.bounds) {
        assert!(
            (cpu - dev).abs() <= 1e-9 * cpu.abs(),
            "bound {cpu} vs {dev}"
        );
    }
    let c = gpu.read_c(&g).unwrap();
    let (row, col) = (77, 5);
    // An error inside the rounding bound is by design not caught (about
    // 110 here: BF16's e_max with K = 512); one four bounds wide is.
    let error = 4.0 * clean.bounds[row] as f32;
    gpu.poke_c(&mut g, row, col, c[row * n + col] + error)
        .unwrap();
    gpu.queue_check(&mut g, &rule).unwrap();
    assert_eq!(gpu.check_verdict(&g).unwrap().flagged, vec![row]);
    assert!(matches!(
        gpu.checked_gemm(&a, &b, m, k + 1, n),
        Err(GpuError::ShapeMismatch { .. })
    ));
    // New weights: B's cached sums are recomputed, so the new clean product
    // passes with the CPU's bounds for it.
    let b2: Vec<bf16> = normal(&mut rng, k * n)
        .into_iter()
        .map(|x| bf16::from_f32(3.0 * x + 0.5))
        .collect();
    assert!(matches!(
        gpu.set_b(&mut g, &b2[1..]),
        Err(GpuError::ShapeMismatch { .. })
    ));
    gpu.set_b(&mut g, &b2).unwrap();
    gpu.gemm(&mut g).unwrap();
    gpu.queue_check(&mut g, &rule).unwrap();
    let verdict = gpu.check_verdict(&g).unwrap();
    assert!(verdict.flagged.is_empty(), "{:?}", verdict.flagged);
    let cm = Matrix::new(m, n, gpu.read_c(&g).unwrap()).unwrap();
    let b2m = Matrix::new(k, n, to_f32(&b2)).unwrap();
    for (cpu, dev) in rule.rows(&am, &b2m, &cm).iter().zip(&verdict.bounds) {
        assert!(
            (cpu - dev).abs() <= 1e-9 * cpu.abs(),
            "bound {cpu} vs {dev}"
        );
    }
}

#[test]
fn modules_are_compiled_once_and_cached_by_name() {
    let Some(gpu) = gpu("modules_are_compiled_once_and_cached_by_name") else {
        return;
    };
    assert!(gpu.loaded_modules().is_empty());
    gpu.ecc_decode(Int4Code::Secded84, &[0; 8], 8).unwrap();
    gpu.ecc_decode(Int4Code::Golay24, &[0; 3], 3).unwrap();
    assert_eq!(gpu.loaded_modules(), vec!["ecc_decode"]);
}
