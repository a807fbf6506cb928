//! `paged-cache`: the continuous-batching simulation and its report.
//!
//! `paged-cache simulate` runs one seeded workload through every prefix
//! cache (none, hash, radix) and both preemption modes and prints a
//! Markdown table (and with `--json`, the reports as JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use paged_cache::scheduler::{
    Preemption, Report, SchedulerConfig, Workload, WorkloadConfig, markdown, simulate,
};
use paged_cache::{CacheConfig, HashPrefixCache, NoPrefixCache, RadixPrefixCache};

#[derive(Parser, Debug)]
#[command(version, about = "Paged KV-cache simulations")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Simulates continuous batching over a seeded workload and prints a report.
    Simulate(SimulateArgs),
}

#[derive(clap::Args, Debug)]
struct SimulateArgs {
    /// Seed of the workload.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Requests.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Mean arrivals per step.
    #[arg(long, default_value_t = 2.0)]
    arrival_rate: f64,
    /// Shortest and longest prompt, as MIN..MAX.
    #[arg(long, default_value = "64..512", value_parser = range)]
    prompt_len: (usize, usize),
    /// Shortest and longest output, as MIN..MAX.
    #[arg(long, default_value = "16..256", value_parser = range)]
    output_len: (usize, usize),
    /// Distinct shared prefixes (0 for none).
    #[arg(long, default_value_t = 4)]
    shared_prefixes: usize,
    /// Tokens of each shared prefix.
    #[arg(long, default_value_t = 192)]
    shared_prefix_len: usize,
    /// Fraction of requests that start with a shared prefix.
    #[arg(long, default_value_t = 0.6)]
    shared_fraction: f64,
    /// Device blocks.
    #[arg(long, default_value_t = 2048)]
    blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Host-tier blocks for swapping.
    #[arg(long, default_value_t = 4096)]
    host_blocks: usize,
    /// Fraction of blocks admission keeps free.
    #[arg(long, default_value_t = 0.01)]
    watermark: f64,
    /// Running requests at most.
    #[arg(long, default_value_t = 256)]
    max_running: usize,
    /// Also write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?} is not MIN..MAX"))?;
    let parse = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("{x:?}: {e}"));
    Ok((parse(a)?, parse(b)?))
}

fn run(args: &SimulateArgs) -> Result<Vec<Report>, Box<dyn std::error::Error>> {
    let workload_config = WorkloadConfig {
        seed: args.seed,
        requests: args.requests,
        arrivals_per_step: args.arrival_rate,
        prompt_len: args.prompt_len,
        output_len: args.output_len,
        shared_prefixes: args.shared_prefixes,
        shared_prefix_len: args.shared_prefix_len,
        shared_fraction: args.shared_fraction,
        ..WorkloadConfig::default()
    };
    let workload = Workload::generate(&workload_config)?;
    let vocab = workload_config.vocab;
    let mut reports = Vec::new();
    for preemption in [Preemption::Recompute, Preemption::Swap] {
        let config = SchedulerConfig {
            cache: CacheConfig {
                num_blocks: args.blocks,
                block_size: args.block_size,
                host_blocks: args.host_blocks,
            },
            watermark: args.watermark,
            max_running: args.max_running,
            preemption,
            ..SchedulerConfig::default()
        };
        reports.push(simulate(&workload, vocab, &config, NoPrefixCache)?);
        reports.push(simulate(
            &workload,
            vocab,
            &config,
            HashPrefixCache::new(args.block_size),
        )?);
        reports.push(simulate(
            &workload,
            vocab,
            &config,
            RadixPrefixCache::new(args.block_size),
        )?);
    }
    Ok(reports)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Simulate(args) = cli.command;
    match run(&args) {
        Ok(reports) => {
            println!(
                "workload: seed {}, {} requests, {} arrivals/step, prompts {}..{}, outputs {}..{}, \
                 {} shared prefixes of {} tokens in {:.0}% of prompts; {} blocks of {} tokens, {} host blocks\n",
                args.seed,
                args.requests,
                args.arrival_rate,
                args.prompt_len.0,
                args.prompt_len.1,
                args.output_len.0,
                args.output_len.1,
                args.shared_prefixes,
                args.shared_prefix_len,
                100.0 * args.shared_fraction,
                args.blocks,
                args.block_size,
                args.host_blocks
            );
            print!("{}", markdown(&reports));
            if let Some(path) = &args.json {
                let text = serde_json::to_string_pretty(&reports).expect("reports serialize");
                if let Err(e) = std::fs::write(path, text) {
                    eprintln!("error: writing {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
