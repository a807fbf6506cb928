//! `kv-eval accumulate`: faults accumulating while the model generates,
//! with and without scrubbing; accumulate.md and accumulate.json in --out.

use std::path::PathBuf;

use kv_eval::accumulate::{AccumulateConfig, run};
use kv_eval::cache::CacheMode;
use kv_eval::paths;
use kv_model::tokenizer::ReadLimits;

use crate::{Calib, Error, Target, calibration_for, load_model, model_path};

/// The flags of `kv-eval accumulate`.
#[derive(clap::Args)]
pub(crate) struct AccumulateArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    /// UTF-8 text whose first --prompt-tokens tokens are the prompt
    /// [default: the fetched Python 3.11 tutorial].
    #[arg(long)]
    text: Option<PathBuf>,
    /// Prompt tokens.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Decode steps.
    #[arg(long, default_value_t = 128)]
    steps: usize,
    #[command(flatten)]
    calib: Calib,
    /// Comma-separated per-token forms (paged blocks).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "int4+secded84,int4+golay24"
    )]
    forms: Vec<String>,
    /// Comma-separated scrub intervals in steps, `never` for none.
    #[arg(long, value_delimiter = ',', default_value = "never,64,16,4")]
    scrub: Vec<String>,
    /// Bit error rate applied to every resident block before each step.
    #[arg(long, default_value_t = 1e-5)]
    ber_per_step: f64,
    /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    channel: String,
    /// Which stored bits are exposed.
    #[arg(long, value_enum, default_value_t = Target::Values)]
    target: Target,
    /// Fault seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens per paged block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

/// Runs `kv-eval accumulate`.
pub(crate) fn run_accumulate(args: AccumulateArgs) -> Result<(), Error> {
    let scrubs = args
        .scrub
        .iter()
        .map(|s| match s.as_str() {
            "never" => Ok(None),
            n => match n.parse::<usize>() {
                Ok(0) | Err(_) => Err(format!("--scrub {n}: a step count ≥ 1 or `never`")),
                Ok(k) => Ok(Some(k)),
            },
        })
        .collect::<Result<Vec<_>, _>>()?;
    if args.prompt_tokens == 0 || args.steps == 0 {
        return Err("--prompt-tokens and --steps must be at least 1".into());
    }
    if !(0.0..=1.0).contains(&args.ber_per_step) {
        return Err(format!("--ber-per-step {} is not in [0, 1]", args.ber_per_step).into());
    }
    let mut forms = args
        .forms
        .iter()
        .map(|f| CacheMode::parse(f))
        .collect::<Result<Vec<_>, _>>()?;
    for m in &forms {
        kv_eval::backend::BackendKind::Paged {
            block_size: args.block_size,
        }
        .check(m, None)?;
    }
    let config = AccumulateConfig {
        steps: args.steps,
        block_size: args.block_size,
        ber_per_step: args.ber_per_step,
        channel: args.channel.parse()?,
        target: args.target.into(),
        seed: args.seed,
    };
    let text_file = args.text.clone().unwrap_or_else(paths::default_text);
    let text = std::fs::File::open(&text_file)
        .map_err(|e| format!("cannot read text {}: {e}", text_file.display()))?;
    crate::check_out_dir(&args.out)?;
    let (model, tokenizer) = load_model(&model_path(&args.model)?)?;
    let tokens = args.prompt_tokens.saturating_add(args.steps);
    if let Some(trained) = model.context()
        && tokens > trained
    {
        return Err(format!(
            "--prompt-tokens {} plus --steps {} is {tokens} tokens, past the {trained} tokens \
             the model was trained to",
            args.prompt_tokens, args.steps
        )
        .into());
    }
    let limits = ReadLimits {
        max_tokens: Some(args.prompt_tokens),
        ..ReadLimits::default()
    };
    // Calibrated forms (`vq`, `pca-*`) read their fitted tables: loaded
    // from --calibration or fitted on --calib-text.
    let cal = calibration_for(&forms, &args.calib, model.as_ref(), &tokenizer)?;
    forms = forms
        .into_iter()
        .map(|m| m.with_calibration(cal.clone()))
        .collect();
    let prompt = tokenizer.encode_reader(text, limits)?;
    if prompt.len() < args.prompt_tokens {
        return Err(format!(
            "{} holds {} tokens, fewer than --prompt-tokens {}",
            text_file.display(),
            prompt.len(),
            args.prompt_tokens
        )
        .into());
    }
    let report = run(model.as_ref(), &prompt, &forms, &scrubs, &config, |r| {
        eprintln!(
            "{} scrub {:?}: agreement {:.2}%, mean KL {:.4}, {} flips",
            r.form,
            r.scrub_every,
            100.0 * r.agreement,
            r.kl_mean,
            r.injected_flips
        );
    })?;
    print!("{}", report.markdown());
    for p in report.write(&args.out)? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
