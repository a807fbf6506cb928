//! `cargo xtask gpu-bundle`: everything gpu-kernels' device checks need, in
//! one folder a device machine can run without a Rust toolchain.
//!
//! The device machines lent to some sessions have the CUDA toolkit and
//! PyTorch but no Rust and no network, and a session's device time is a
//! quarter of an hour, starts included. So the test and bench binaries are
//! built here, stripped, and copied with the CUDA sources, the PyTorch peer
//! and a `run.sh` that does every check in one call: the device and
//! driver, the `gpu` test binary (`--nocapture`), `ptxas -v` over every
//! module (registers and spills), `gpu_bench` and `sdpa_peer.py`, each
//! under its own time limit, each writing one file into `$OUT`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::{CUDA_MODULES, cargo, status};

/// Arguments of `cargo xtask gpu-bundle`.
#[derive(Args)]
pub(crate) struct GpuBundleArgs {
    /// Output folder (ignored by git; name it in the device tool's `carry`).
    #[arg(long, default_value = "target/gpu-bundle")]
    out: PathBuf,
}

/// The script the device machine runs.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# gpu-kernels' device checks in one call (built by `cargo xtask gpu-bundle`).
# On the device machine, from the repository root:
#   bash target/gpu-bundle/run.sh        (carry: target/gpu-bundle)
# Each step writes one file into $OUT (or the bundle's out/ folder) and has
# its own time limit, so one hang does not cost the others.
set -u
B=$(cd "$(dirname "$0")" && pwd)
O=${OUT:-$B/out}
mkdir -p "$O"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# cudarc looks for libnvrtc.so, libcublas.so and libcublasLt.so (or their
# .so.12): where the toolkit only has another major version's file, link it.
L=/tmp/rkv-libs
mkdir -p "$L"
for lib in nvrtc cublas cublasLt; do
  if [ ! -e "/usr/local/cuda/lib64/lib$lib.so" ]; then
    f=$(find /usr/local/cuda*/ /opt /usr/lib -name "lib$lib.so.[0-9]*" 2>/dev/null | sort | tail -n 1)
    [ -n "$f" ] && ln -sf "$f" "$L/lib$lib.so" && export LD_LIBRARY_PATH=$L:$(dirname "$f"):$LD_LIBRARY_PATH
  fi
done
export RKV_SKIP_LOG="$O/skips.txt"
# A GPU test that finds no device fails here instead of skipping.
export REQUIRE_GPU=1
{ date -u; nvidia-smi; nvcc --version; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ls -l "$L"; } > "$O/device.txt" 2>&1
# ptxas over every module (registers, spills) in the background; its cubins
# then spare the benchmark NVRTC's and the driver's compile.
mkdir -p /tmp/cubin
for m in ecc_decode dequant paged_decode abft; do
  ( timeout 150 nvcc -arch=sm_90 -std=c++17 -cubin -Xptxas -v "$B/kernels/$m.full.cu" -o "/tmp/cubin/$m.cubin" > "/tmp/ptxas.$m.txt" 2>&1; echo "rc=$?" >> "/tmp/ptxas.$m.txt" ) &
done
SECONDS=0
timeout "${TESTS_S:-150}" "$B/gpu-tests" --nocapture --test-threads 1 > "$O/tests.txt" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$O/tests.txt"
wait
for m in ecc_decode dequant paged_decode abft; do
  echo "== $m"; cat "/tmp/ptxas.$m.txt"
  grep -q '^rc=0' "/tmp/ptxas.$m.txt" && cp "/tmp/cubin/$m.cubin" "/tmp/cubin/$m.ptx"
done > "$O/ptxas.txt" 2>&1
[ -e /tmp/cubin/paged_decode.ptx ] && export RKV_PTX_DIR=/tmp/cubin
SECONDS=0
timeout "${BENCH_S:-120}" "$B/gpu_bench" --only attention ${BENCH_ARGS:-} > "$O/bench.txt" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$O/bench.txt"
timeout "${GEMM_S:-45}" "$B/gpu_bench" --only gemm > "$O/gemm.txt" 2>&1
echo "rc=$?" >> "$O/gemm.txt"
timeout "${SDPA_S:-75}" python3 "$B/sdpa_peer.py" ${BENCH_ARGS:-} > "$O/sdpa.txt" 2>&1
echo "rc=$?" >> "$O/sdpa.txt"
# Nsight Compute on one launch of a kernel (NCU_KERNEL, a regex), if asked.
if [ -n "${NCU_KERNEL:-}" ]; then
  timeout "${NCU_S:-90}" ncu -k "regex:$NCU_KERNEL" --launch-skip "${NCU_SKIP:-75}" --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis "$B/gpu_bench" --only attention --quick > "$O/ncu.txt" 2>&1
  echo "rc=$?" >> "$O/ncu.txt"
fi
unset RKV_PTX_DIR
timeout "${SAN_S:-45}" compute-sanitizer --tool memcheck "$B/gpu-tests" --test-threads 1 ${SAN_TESTS:-ecc dequant modules} > "$O/sanitizer.txt" 2>&1
echo "rc=$?" >> "$O/sanitizer.txt"
tail -n 4 "$O"/*.txt
"#;

/// Builds the bundle into `args.out`.
pub(crate) fn run(args: &GpuBundleArgs) -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let crate_dir = root.join("crates/gpu-kernels");
    let out = &args.out;
    if out.exists() {
        fs::remove_dir_all(out).with_context(|| format!("clearing {}", out.display()))?;
    }
    fs::create_dir_all(out.join("kernels"))?;
    let tests = test_binary()?;
    status(
        cargo().args([
            "build",
            "--release",
            "-p",
            "gpu-kernels",
            "--features",
            "cuda",
            "--example",
            "gpu_bench",
        ]),
        "cargo build --example gpu_bench",
    )?;
    let bench = root.join("target/release/examples/gpu_bench");
    copy_stripped(&tests, &out.join("gpu-tests"))?;
    copy_stripped(&bench, &out.join("gpu_bench"))?;
    // Each module's full source, the text NVRTC compiles, for nvcc there.
    crate::write_cuda_sources(&out.join("kernels"))?;
    for m in CUDA_MODULES {
        let source = out.join("kernels").join(format!("{m}.full.cu"));
        if !source.is_file() {
            bail!("{} was not written", source.display());
        }
    }
    fs::copy(
        crate_dir.join("bench/sdpa_peer.py"),
        out.join("sdpa_peer.py"),
    )?;
    fs::write(out.join("run.sh"), RUN_SH)?;
    // The bundle's files: the top folder and `kernels/`.
    let mut bytes = 0u64;
    for dir in [out.clone(), out.join("kernels")] {
        for entry in fs::read_dir(&dir)?.flatten() {
            let meta = entry.metadata()?;
            if meta.is_file() {
                bytes += meta.len();
            }
        }
    }
    println!(
        "{}: {:.1} MiB; on a device machine: bash {}/run.sh (carry {})",
        out.display(),
        bytes as f64 / f64::from(1 << 20),
        out.display(),
        out.display()
    );
    Ok(())
}

/// Builds gpu-kernels' `gpu` integration test with its `cuda` feature and
/// returns the executable cargo reports for it.
fn test_binary() -> Result<PathBuf> {
    let output = crate::stdout_of(
        cargo().args([
            "test",
            "--release",
            "-p",
            "gpu-kernels",
            "--features",
            "cuda",
            "--test",
            "gpu",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ]),
        "cargo test --no-run",
    )?;
    for line in String::from_utf8_lossy(&output).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_gpu_test = message["reason"] == "compiler-artifact"
            && message["target"]["name"] == "gpu"
            && message["target"]["kind"][0] == "test";
        if let (true, Some(path)) = (is_gpu_test, message["executable"].as_str()) {
            return Ok(PathBuf::from(path));
        }
    }
    bail!("cargo reported no executable for gpu-kernels' `gpu` test")
}

/// Copies `from` to `to` without its symbols and debug information (the
/// bundle travels to the device machine, 64 MiB at most).
fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    let stripped = std::process::Command::new("strip").arg(to).status();
    if !matches!(stripped, Ok(s) if s.success()) {
        eprintln!(
            "strip: not run on {} (the bundle keeps its symbols)",
            to.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run.sh` runs `ptxas` over exactly the modules `cargo xtask ptx` builds.
    #[test]
    fn run_sh_checks_every_cuda_module() {
        let line = RUN_SH
            .lines()
            .find(|l| l.trim_start().starts_with("for m in "))
            .expect("the ptxas loop");
        let listed: Vec<&str> = line
            .trim()
            .trim_start_matches("for m in ")
            .trim_end_matches("; do")
            .split_whitespace()
            .collect();
        assert_eq!(listed, CUDA_MODULES);
    }
}
