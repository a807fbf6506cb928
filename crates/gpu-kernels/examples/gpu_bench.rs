//! The device benchmark of issue 8: fused paged decode attention at
//! Llama-3-8B's head shape (32 query heads, 8 KV heads, head_dim 128,
//! blocks of 16 tokens) for f16, INT4 and SECDED-protected INT4, contexts
//! 4K-128K and batch 1-64, as achieved bandwidth against a device-to-device
//! copy measured in the same run; then the checked BF16 GEMM at 4096³
//! against plain cuBLAS. Medians of event-timed repeats after a warm-up.
//!
//! `cargo run --release -p gpu-kernels --features cuda --example gpu_bench`
//! (`-- --quick` for a smaller grid; `-- --only attention` or
//! `-- --only gemm` for one half, so one failing half does not hide the
//! other's numbers). The PyTorch peer is
//! `bench/sdpa_peer.py`, run beside it.

use abft_gemm::{Precision, VAbft};
use cudarc::driver::sys::CUevent_flags;
use gf2_codes::channel::FaultRng;
use gpu_kernels::Gpu;
use half::bf16;
use kv_quant::CacheForm;
use paged_cache::{BlockId, BlockStorage, LayerSpec, PageTable};

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;
/// Distinct physical blocks (pages are spread over them): 2^14 blocks of
/// 16 tokens are 512 MiB of f16 K+V, far beyond the 50 MB L2.
const POOL_BLOCKS: usize = 1 << 14;

fn median_ms(gpu: &Gpu, reps: usize, mut f: impl FnMut()) -> f64 {
    let ctx = gpu.context();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..3 {
        f();
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let (a, b) = (ctx.new_event(flags).unwrap(), ctx.new_event(flags).unwrap());
            a.record(gpu.stream()).unwrap();
            f();
            b.record(gpu.stream()).unwrap();
            f64::from(a.elapsed_ms(&b).unwrap())
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    if !matches!(only, None | Some("attention" | "gemm")) {
        return Err(format!("--only takes `attention` or `gemm`, not {only:?}").into());
    }
    let gpu = Gpu::open_default()?;
    println!("device: {:?}", gpu.info());
    let s = gpu.stream().clone();

    // Copy bandwidth: bytes read + bytes written per second.
    let bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(bytes)?;
    let mut dst = s.alloc_zeros::<u8>(bytes)?;
    let ms = median_ms(&gpu, 20, || s.memcpy_dtod(&src, &mut dst).unwrap());
    let copy_gbs = 2.0 * bytes as f64 / ms / 1e6;
    println!("device-to-device copy: {copy_gbs:.0} GB/s (read + write)");
    drop((src, dst));
    let mut rng = FaultRng::new(1);
    if only != Some("gemm") {
        attention(&gpu, quick, copy_gbs, &mut rng)?;
    }
    if only != Some("attention") {
        checked_gemm(&gpu, &mut rng)?;
    }
    Ok(())
}

/// Fused paged decode for f16, INT4 and SECDED INT4 over the context and
/// batch grid, as bandwidth against the copy's.
fn attention(
    gpu: &Gpu,
    quick: bool,
    copy_gbs: f64,
    rng: &mut FaultRng,
) -> Result<(), Box<dyn std::error::Error>> {
    let contexts: &[usize] = if quick {
        &[4096, 32768]
    } else {
        &[4096, 16384, 65536, 131072]
    };
    let batches: &[usize] = if quick { &[1, 16] } else { &[1, 8, 32, 64] };
    let channels = KV_HEADS * HEAD_DIM;
    let mut row = vec![0f32; channels];
    println!("\n| form | kernel | context | batch | time (ms) | per token (µs) | GB/s | of copy |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut int4_ms = std::collections::HashMap::new();
    for spelling in ["fp16", "int4", "int4+secded84+interp+meta-secded"] {
        let form: CacheForm = spelling.parse()?;
        let storage = BlockStorage::new(POOL_BLOCKS, BLOCK, &[LayerSpec::uniform(form, channels)])?;
        for b in 0..POOL_BLOCKS {
            for t in 0..BLOCK {
                for x in row.iter_mut() {
                    *x = (rng.next_f64() * 2.0 - 1.0) as f32;
                }
                storage.write(BlockId(b as u32), t, 0, &row, &row)?;
            }
        }
        let layer = gpu.upload_layer(&storage, 0, HEAD_DIM)?;
        for &ctx_len in contexts {
            for &batch in batches {
                let pages = ctx_len / BLOCK;
                let ids: Vec<Vec<BlockId>> = (0..batch)
                    .map(|i| {
                        (0..pages)
                            .map(|p| BlockId(((p * 7919 + i * 104_729) % POOL_BLOCKS) as u32))
                            .collect()
                    })
                    .collect();
                let refs: Vec<(&[BlockId], usize)> =
                    ids.iter().map(|v| (v.as_slice(), ctx_len)).collect();
                let table = PageTable::from_tables(&refs, BLOCK)?;
                let dt = gpu.upload_page_table(&layer, &table)?;
                let q: Vec<f32> = (0..batch * Q_HEADS * HEAD_DIM)
                    .map(|_| (rng.next_f64() - 0.5) as f32)
                    .collect();
                // The default kernel first (tensor cores where they apply),
                // then the CUDA-core kernel for comparison.
                let paths: &[bool] = if layer.tensor_cores_apply() {
                    &[true, false]
                } else {
                    &[true]
                };
                for &tensor_cores in paths {
                    let mut ws = gpu.paged_workspace(&layer, &dt, Q_HEADS, None)?;
                    ws.use_tensor_cores(tensor_cores);
                    gpu.set_queries(&mut ws, &q)?;
                    let ms = median_ms(gpu, 20, || {
                        gpu.launch_paged_decode(&layer, &dt, &mut ws).unwrap()
                    });
                    let moved = layer.bytes_per_token() * (ctx_len * batch) as f64;
                    let gbs = moved / ms / 1e6;
                    let kernel = gpu.paged_kernel(&layer, &ws);
                    println!(
                        "| {spelling} | {kernel} | {ctx_len} | {batch} | {ms:.3} | {:.3} | {gbs:.0} | {:.2} |",
                        ms * 1e3 / batch as f64,
                        gbs / copy_gbs
                    );
                    if spelling.starts_with("int4") && tensor_cores {
                        int4_ms.insert((spelling, ctx_len, batch), (ms, layer.bytes_per_token()));
                    }
                }
            }
        }
    }
    println!("\n| context | batch | protected/plain time | byte ratio | time / byte ratio |");
    println!("|---|---|---|---|---|");
    for &ctx_len in contexts {
        for &batch in batches {
            let (p, pb) = int4_ms[&("int4+secded84+interp+meta-secded", ctx_len, batch)];
            let (u, ub) = int4_ms[&("int4", ctx_len, batch)];
            println!(
                "| {ctx_len} | {batch} | {:.2} | {:.2} | {:.2} |",
                p / u,
                pb / ub,
                (p / u) / (pb / ub)
            );
        }
    }

    Ok(())
}

/// The checked BF16 GEMM at 4096³ against plain cuBLAS.
fn checked_gemm(gpu: &Gpu, rng: &mut FaultRng) -> Result<(), Box<dyn std::error::Error>> {
    let n = 4096;
    let a: Vec<bf16> = (0..n * n)
        .map(|_| bf16::from_f64(rng.next_f64() - 0.5))
        .collect();
    let b: Vec<bf16> = (0..n * n)
        .map(|_| bf16::from_f64(rng.next_f64() - 0.5))
        .collect();
    let mut g = gpu.checked_gemm(&a, &b, n, n, n)?;
    let rule = VAbft::design(Precision::Bf16.e_max_ascend());
    let plain = median_ms(gpu, 30, || gpu.gemm(&mut g).unwrap());
    let checked = median_ms(gpu, 30, || {
        gpu.gemm(&mut g).unwrap();
        gpu.queue_check(&mut g, &rule).unwrap();
    });
    let verdict = gpu.check_verdict(&g)?;
    println!(
        "\nchecked GEMM 4096³ BF16: cuBLAS {plain:.3} ms ({:.0} TFLOP/s), checked {checked:.3} ms, overhead {:.1}%, false positives {}",
        2.0 * (n as f64).powi(3) / plain / 1e9,
        100.0 * (checked / plain - 1.0),
        verdict.flagged.len()
    );
    Ok(())
}
