//! `cargo xtask <cmd>`: workspace automation.
//!
//! - `bench [CRATE...] [--json FILE]`: runs the criterion benches of the named
//!   crates (all crates with benches when none are named) and reports every
//!   figure as a ratio to the baseline measured in the same run.

mod bench;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench(args) => bench::run(&args),
    }
}
