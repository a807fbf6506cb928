//! `kv-eval batch`: continuous batching of the real model on the paged
//! cache, from a requests file or the simulator's seeded workload; each
//! request's output is written into --out as it finishes, then the report.
//! With `--speculate` the batch is served plainly first (the baseline, its
//! outputs kept only to compare) and then speculatively.

use std::io::Write;
use std::path::{Path, PathBuf};

use kv_eval::batch::{
    BatchConfig, BatchReport, PrefixKind, parse_requests, run_batch, run_batch_speculative,
    run_batch_with, workload_requests,
};
use kv_model::model::batch::{BatchRequest, BatchSpeculation, RequestOutput};
use kv_model::tokenizer::{ReadLimits, TextTokenizer};
use paged_cache::scheduler::{Preemption, SchedulerConfig, Workload, WorkloadConfig};
use paged_cache::{CacheConfig, KvCacheManager, NoPrefixCache};

use crate::speculate::{Speculate, batch_drafters, load_draft};
use crate::{Calib, Error, Forms, calibration_for, load_model, mode_of, model_path};

/// The largest requests file read (a line per request).
const MAX_REQUESTS_BYTES: u64 = 64 << 20;

/// The prefix cache, as a flag.
#[derive(clap::ValueEnum, Clone, Copy)]
enum Prefix {
    None,
    Hash,
    Radix,
}

/// The preemption mode, as a flag.
#[derive(clap::ValueEnum, Clone, Copy)]
enum PreemptBy {
    Recompute,
    Swap,
}

/// The flags of `kv-eval batch`.
#[derive(clap::Args)]
pub(crate) struct BatchArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    /// Requests, one JSON object per line: `prompt`, `max_new_tokens`,
    /// optional `arrival_step`, `priority`, `temperature`, `top_p`, `seed`.
    #[arg(long, required_unless_present = "workload")]
    requests: Option<PathBuf>,
    /// Serve the simulator's seeded shared-prefix workload instead, its
    /// prompts cut from the evaluation corpus.
    #[arg(long, conflicts_with = "requests")]
    workload: bool,
    /// Workload: seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Workload: requests in all.
    #[arg(long, default_value_t = 32)]
    num_requests: usize,
    /// Workload: mean arrivals per scheduler step.
    #[arg(long, default_value_t = 1.0)]
    arrivals_per_step: f64,
    /// Workload: prompt lengths MIN,MAX in tokens (shared prefix included).
    #[arg(long, value_delimiter = ',', default_values_t = [64, 256])]
    prompt_len: Vec<usize>,
    /// Workload: output lengths MIN,MAX in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [16, 64])]
    output_len: Vec<usize>,
    /// Workload: distinct shared prefixes and the tokens of each.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 128])]
    shared_prefixes: Vec<usize>,
    /// Evaluation text the workload's prompts are cut from
    /// [default: the fetched corpus].
    #[arg(long)]
    text: Option<PathBuf>,
    #[command(flatten)]
    forms: Forms,
    #[command(flatten)]
    calib: Calib,
    /// Device blocks of the paged cache.
    #[arg(long, default_value_t = 1024)]
    blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Host blocks (the swap tier).
    #[arg(long, default_value_t = 1024)]
    host_blocks: usize,
    /// Prefix cache.
    #[arg(long, value_enum, default_value_t = Prefix::Hash)]
    prefix: Prefix,
    /// How a request is preempted when the pool runs short.
    #[arg(long, value_enum, default_value_t = PreemptBy::Recompute)]
    preemption: PreemptBy,
    /// Fraction of blocks admission keeps free.
    #[arg(long, default_value_t = 0.01)]
    watermark: f64,
    /// Requests running at once at most.
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Prompt tokens prefilled per step at most (a longer prompt runs alone).
    #[arg(long, default_value_t = 2048)]
    max_prefill_tokens: usize,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Output folder: `request-N.txt` per request and `outputs.jsonl` as
    /// each finishes, then `report.md` and `report.json`.
    #[arg(long)]
    out: PathBuf,
    /// Speculative decoding (the spellings of `generate --speculate`):
    /// `lookup[:k=K]` (prompt lookup for each request), `draft:MODEL[:k=K]`
    /// (one draft model drafting greedily for every request in batched
    /// passes) or `self[:skip=LAYERS][:k=K]` (each request through the
    /// draft view of an int8h-class cache). The batch is served plainly
    /// first and the report adds the acceptance, the speedup and how many
    /// greedy outputs equal the plain batch's.
    #[arg(long, value_parser = crate::speculate::parse_speculate)]
    speculate: Option<Speculate>,
}

/// Runs `kv-eval batch`.
pub(crate) fn run(args: BatchArgs) -> Result<(), Error> {
    let mode = mode_of(&args.forms)?;
    crate::source::check_threads(args.threads)?;
    crate::source::init_pool(args.threads)?;
    let cache = CacheConfig {
        num_blocks: args.blocks,
        block_size: args.block_size,
        host_blocks: args.host_blocks,
    };
    let scheduler = SchedulerConfig {
        cache,
        watermark: args.watermark,
        max_prefill_tokens: args.max_prefill_tokens,
        max_running: args.max_running,
        preemption: match args.preemption {
            PreemptBy::Recompute => Preemption::Recompute,
            PreemptBy::Swap => Preemption::Swap,
        },
    };
    // Everything a flag can get wrong is refused before the model loads.
    scheduler.check()?;
    if let Some(Speculate::SelfDraft { .. }) = args.speculate {
        kv_eval::backend::BackendKind::Paged {
            block_size: args.block_size,
        }
        .check_draft_view(&mode)?;
    }
    // The block tables (a token id per slot, a header per block), before
    // they are made; the K/V pool is checked when it is sized.
    let slots = (args.blocks as u64).saturating_mul(args.block_size as u64);
    kv_eval::budget::check(
        &format!(
            "the block tables of --blocks {} × --block-size {}",
            args.blocks, args.block_size
        ),
        slots
            .saturating_mul(4)
            .saturating_add((args.blocks as u64).saturating_mul(64)),
    )?;
    KvCacheManager::new(cache, NoPrefixCache).map_err(|e| {
        format!(
            "--blocks {} × --block-size {}: {e}",
            args.blocks, args.block_size
        )
    })?;
    let text = match &args.requests {
        Some(path) => Some(
            kv_eval::paths::read_text_at_most(path, MAX_REQUESTS_BYTES)
                .map_err(|e| format!("cannot read requests {}: {e}", path.display()))?,
        ),
        None => {
            Workload::generate(&workload_config(&args)?)?;
            None
        }
    };
    crate::check_out_dir(&args.out)?;
    let (model, tokenizer) = load_model(&model_path(&args.model)?)?;
    let context = model.context().unwrap_or(usize::MAX);
    if let Some(k) = args
        .speculate
        .as_ref()
        .map(Speculate::k)
        .filter(|&k| k >= context)
    {
        return Err(format!(
            "--speculate k={k}: less than the model's context of {context} (checked before the \
             plain baseline runs)"
        )
        .into());
    }
    let requests = match (&text, &args.requests) {
        (Some(text), Some(path)) => parse_requests(text, context, |p| Ok(tokenizer.encode(p)?))
            .map_err(|e| format!("{}: {e}", path.display()))?,
        _ => workload(&args, &tokenizer)?,
    };
    let cal = calibration_for(
        std::slice::from_ref(&mode),
        &args.calib,
        model.as_ref(),
        &tokenizer,
    )?;
    let config = BatchConfig {
        mode: mode.with_calibration(cal),
        cache,
        prefix: match args.prefix {
            Prefix::None => PrefixKind::None,
            Prefix::Hash => PrefixKind::Hash,
            Prefix::Radix => PrefixKind::Radix,
        },
        scheduler,
    };
    let draft = match &args.speculate {
        Some(Speculate::Draft { model: path, .. }) => {
            Some(load_draft(path, model.as_ref(), &tokenizer)?)
        }
        _ => None,
    };
    let drafters = match &args.speculate {
        Some(how) => Some(batch_drafters(
            how,
            model.as_ref(),
            draft.as_deref(),
            &requests,
        )?),
        None => None,
    };
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    // The plain batch first, on the same cache form: the baseline.
    let plain = match &drafters {
        Some(_) => Some(run_batch(model.as_ref(), &requests, &config)?),
        None => None,
    };
    let mut outputs = Output::create(&args.out)?;
    let mut deliver = |r: usize, out: &RequestOutput| {
        outputs
            .write(r, out, &tokenizer)
            .map_err(|e| kv_eval::EvalError::InvalidParameter {
                name: "out",
                reason: e.to_string(),
            })
    };
    let report = match (drafters, &args.speculate) {
        (Some(drafters), Some(how)) => {
            let speculation = BatchSpeculation {
                k: how.k(),
                drafters,
            };
            run_batch_speculative(
                model.as_ref(),
                &requests,
                &config,
                speculation,
                &mut deliver,
            )?
        }
        _ => run_batch_with(model.as_ref(), &requests, &config, &mut deliver)?,
    };
    let compared = plain.as_ref().map_or_else(String::new, |plain| {
        compare(plain, &report, &requests, args.speculate.as_ref())
    });
    let md = format!(
        "{} on {}, {} requests ({}), {} blocks of {} tokens, {} host blocks, {} prefix cache, \
         {} preemption\n\n{}",
        config.mode.label(),
        model.describe(),
        requests.len(),
        args.requests.as_ref().map_or_else(
            || format!("workload seed {}", args.seed),
            |p| p.display().to_string()
        ),
        cache.num_blocks,
        cache.block_size,
        cache.host_blocks,
        report.scheduler.prefix_cache,
        report.scheduler.preemption,
        report.markdown()
    ) + &compared;
    write(&args.out.join("report.md"), &md)?;
    write(
        &args.out.join("report.json"),
        &serde_json::to_string_pretty(&report)?,
    )?;
    print!("{md}");
    Ok(())
}

/// The speculative batch against the plain one: the speedup, and how many
/// greedy requests generated exactly the plain batch's tokens.
fn compare(
    plain: &BatchReport,
    speculative: &BatchReport,
    requests: &[BatchRequest],
    how: Option<&Speculate>,
) -> String {
    let greedy: Vec<usize> = (0..requests.len())
        .filter(|&i| requests[i].sampling.temperature == 0.0)
        .collect();
    let equal = greedy
        .iter()
        .filter(|&&i| plain.outputs[i].tokens == speculative.outputs[i].tokens)
        .count();
    format!(
        "\nPlain batch on the same cache: {:.2} s, {:.1} tokens/s, {} steps; speculative \
         ({}): {:.2} s, {:.1} tokens/s, {} steps: {:.2}x. {equal} of {} greedy requests \
         generated the plain batch's tokens.\n",
        plain.seconds,
        plain.tokens_per_second,
        plain.scheduler.steps,
        how.map_or_else(String::new, Speculate::describe),
        speculative.seconds,
        speculative.tokens_per_second,
        speculative.scheduler.steps,
        speculative.tokens_per_second / plain.tokens_per_second.max(1e-9),
        greedy.len()
    )
}

/// The workload's requests with real prompts.
fn workload(args: &BatchArgs, tokenizer: &TextTokenizer) -> Result<Vec<BatchRequest>, Error> {
    let config = workload_config(args)?;
    let path = args
        .text
        .clone()
        .unwrap_or_else(kv_eval::paths::default_text);
    let file = std::fs::File::open(&path).map_err(|e| {
        format!(
            "cannot read the workload's text {}: {e} (run `cargo xtask fetch-model`)",
            path.display()
        )
    })?;
    let needed = (config
        .shared_prefixes
        .saturating_mul(config.shared_prefix_len))
    .saturating_add(config.prompt_len.1.saturating_mul(2));
    let corpus = tokenizer.encode_reader_plain(
        file,
        ReadLimits {
            max_tokens: Some(needed.saturating_mul(8)),
            ..ReadLimits::default()
        },
    )?;
    Ok(workload_requests(&corpus, &config)?)
}

/// The workload flags as the simulator's configuration.
fn workload_config(args: &BatchArgs) -> Result<WorkloadConfig, Error> {
    let pair = |flag: &str, v: &[usize]| match v {
        &[a, b] => Ok((a, b)),
        _ => Err(format!(
            "--{flag} takes two numbers, MIN,MAX (or COUNT,TOKENS)"
        )),
    };
    let (shared_prefixes, shared_prefix_len) = pair("shared-prefixes", &args.shared_prefixes)?;
    Ok(WorkloadConfig {
        seed: args.seed,
        requests: args.num_requests,
        arrivals_per_step: args.arrivals_per_step,
        prompt_len: pair("prompt-len", &args.prompt_len)?,
        output_len: pair("output-len", &args.output_len)?,
        shared_prefixes,
        shared_prefix_len,
        ..WorkloadConfig::default()
    })
}

/// Where finished requests go, as they finish.
struct Output {
    dir: PathBuf,
    jsonl: std::fs::File,
}

impl Output {
    fn create(dir: &Path) -> Result<Self, Error> {
        let path = dir.join("outputs.jsonl");
        let jsonl = std::fs::File::create(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            jsonl,
        })
    }

    /// Writes request `r`'s text file and its `outputs.jsonl` line, flushed.
    fn write(&mut self, r: usize, out: &RequestOutput, tok: &TextTokenizer) -> Result<(), Error> {
        let text = tok.decode(&out.tokens)?;
        write(&self.dir.join(format!("request-{r}.txt")), &text)?;
        let line = serde_json::json!({
            "request": r,
            "text": text,
            "tokens": out.tokens,
            "ttft_s": out.ttft(),
            "token_times_s": out.token_times,
        });
        writeln!(self.jsonl, "{line}")?;
        self.jsonl.flush()?;
        Ok(())
    }
}

fn write(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()).into())
}
