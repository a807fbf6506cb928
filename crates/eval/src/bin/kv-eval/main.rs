//! `kv-eval`: the experiments' command line, one module per command
//! (`ppl`, `sweep`, `frontier`, `lowrank-report`, `calibrate`, `generate`,
//! `batch`, `niah`, `accumulate`, `adapt`, `shard-stream`, `top`), the
//! flags they share in `args`, the checks made before any work in
//! `checks`.

mod abft;
mod accumulate;
mod adapt;
mod args;
mod batch;
mod calib;
mod calibrate;
mod checks;
mod frontier;
mod frontier_plot;
mod generate;
mod lowrank;
mod niah;
mod ppl;
mod progress;
mod source;
mod speculate;
mod stream;
mod sweep;
mod top;

// What the command modules share, by its short name.
pub(crate) use args::{Backend, BackendArgs, Forms, NumericsArg, Target, mode_of};
pub(crate) use calib::{Calib, calibration_for};
pub(crate) use checks::{check_out_dir, check_out_file, check_segments};
pub(crate) use progress::evaluate_with_bar;
pub(crate) use source::{Prepared, Source, load_model, method, method_name, model_path, prepare};

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Real-model fault-injection evaluation of KV-cache forms.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Memory budget for everything sized from the flags (paged pools):
    /// bytes, or with K, M, G or T (24G) [default: 80% of the memory
    /// available at start].
    #[arg(long, global = true)]
    memory_limit: Option<String>,
    /// Load GGUF weights holding NaN or infinity (a fault experiment's
    /// damaged file) instead of refusing them.
    #[arg(long, global = true)]
    allow_non_finite_weights: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Perplexity, KL from the clean run, top-k and codec statistics of one configuration.
    Ppl(ppl::PplArgs),
    /// Forms × bit error rates × seeds: the paper's Tables 5 and 7-10, as
    /// Markdown, JSON and an SVG plot in --out.
    Sweep(sweep::SweepArgs),
    /// The quality-versus-bytes frontier: bits per value, PPL, ΔPPL, KL and
    /// top-1 agreement of many key/value/per-layer form configurations at
    /// several context lengths; frontier.md, frontier.json and frontier.svg in --out.
    Frontier(frontier::FrontierArgs),
    /// Several `frontier` runs (their frontier.json) as one figure at one
    /// context: a panel per model with its Pareto front and the goals;
    /// frontier.md and frontier.svg in --out.
    FrontierPlot(frontier_plot::FrontierPlotArgs),
    /// Spectra of the KV cache per layer and head (keys before and after
    /// RoPE, values) over the calibration text: ranks at 90/99/99.9% of the
    /// energy; lowrank.md, lowrank.json and lowrank.svg in --out.
    LowrankReport(lowrank::LowrankArgs),
    /// Fits the codebooks (vq) and PCA bases (pca-*) of calibrated forms
    /// on a calibration text and writes them to a file for --calibration.
    Calibrate(calibrate::CalibrateArgs),
    /// Generates text after a prompt on a KV backend (paged by default),
    /// greedy or sampled; streams the continuation to stdout, then prints
    /// tokens/s, the cache's true bytes and the codec statistics to stderr.
    /// On the paged backend faults can accumulate over the decode steps
    /// (--ber-per-step), with a scrubber (--scrub-every).
    Generate(generate::GenerateArgs),
    /// Continuous batching of the model on the paged cache (paged-cache's
    /// scheduler, prefix cache, preemption by recompute or swap) for a
    /// requests file or the seeded workload; outputs and report in --out.
    Batch(batch::BatchArgs),
    /// Needle in a haystack: a passkey hidden at several depths of
    /// haystacks of several lengths, found or not by greedy generation, for
    /// each cache form; niah.md, niah.json and niah.svg (heat maps) in --out.
    Niah(niah::NiahArgs),
    /// Faults accumulating in the paged cache while the model generates,
    /// with and without scrubbing: top-1 agreement and KL per step against
    /// the same form without faults; accumulate.md and .json in --out.
    Accumulate(accumulate::AccumulateArgs),
    /// Adaptive protection on a non-uniform fault map (hot layers, blocks
    /// or rows): each layer's or block's code (Hamming, SECDED, Golay)
    /// chosen from what reading it under SECDED showed, scored against
    /// uniform codes under the same faults.
    Adapt(adapt::AdaptArgs),
    /// The drift of a `shard` cache's decode stream: greedy generations
    /// with the stream off, 4-bit and 8-bit, matched against an fp16 cache.
    ShardStream(stream::StreamArgs),
    /// The top-k next tokens of a prompt with their logits and probabilities.
    Top(top::TopArgs),
}

/// What a command fails with: any error, printed as `error: ...`.
type Error = Box<dyn std::error::Error>;

/// The command line, every subcommand taking negative numbers as values:
/// `--ber -1` reaches the flag's own check (which names it and its range)
/// instead of clap's "unexpected argument '-1'".
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let mut command = Cli::command().allow_negative_numbers(true);
    let names: Vec<String> = command
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |c| c.allow_negative_numbers(true));
    }
    Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    let cli = parse_cli();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    if let Some(limit) = &cli.memory_limit {
        kv_eval::budget::set_limit(kv_eval::budget::parse_size(limit)?);
    }
    kv_eval::load::allow_non_finite_weights(cli.allow_non_finite_weights);
    match cli.command {
        Command::Ppl(args) => ppl::run(args),
        Command::Sweep(args) => sweep::run(args),
        Command::Frontier(args) => frontier::run(args),
        Command::FrontierPlot(args) => frontier_plot::run(args),
        Command::LowrankReport(args) => lowrank::run(args),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Batch(args) => batch::run(args),
        Command::Niah(args) => niah::run(args),
        Command::Accumulate(args) => accumulate::run_accumulate(args),
        Command::Adapt(args) => adapt::run_adapt(args),
        Command::ShardStream(args) => stream::run_stream(args),
        Command::Top(args) => top::run(args),
    }
}
