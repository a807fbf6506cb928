//! `kv-eval shard-stream`: the drift of a `shard` cache's decode stream
//! (kv_eval::stream_drift): greedy generations after prompts cut from the
//! corpus, under an `fp16` cache and under the form with its stream off,
//! 3-bit + QJL, 4-bit and 8-bit (and, with `--fold`, folded into the
//! middle), matched token by token.

use std::path::PathBuf;

use kv_eval::cache::CacheMode;
use kv_eval::stream_drift::{DriftConfig, run, stream_variants};
use kv_quant::CacheForm;

use crate::Error;
use crate::source::{Source, prepare};

/// The flags of `kv-eval shard-stream`.
#[derive(clap::Args)]
pub(crate) struct StreamArgs {
    #[command(flatten)]
    source: Source,
    /// The `shard` form whose stream settings are compared.
    #[arg(long, default_value = "shard")]
    form: String,
    /// The reference form.
    #[arg(long, default_value = "fp16")]
    reference: String,
    /// Prompts, cut from the corpus at evenly spaced offsets.
    #[arg(long, default_value_t = 5)]
    prompts: usize,
    /// Tokens of each prompt.
    #[arg(long, default_value_t = 2048)]
    prefix: usize,
    /// Tokens generated after each prompt.
    #[arg(long, default_value_t = 150)]
    new_tokens: usize,
    /// Generated-token counts at which matches are reported.
    #[arg(long, value_delimiter = ',', default_value = "20,60,150")]
    checkpoints: Vec<usize>,
    /// Also fold generated tokens into the compressed middle in chunks of
    /// this many (from the 8-bit stream and from f16), beside the unfolded
    /// stream settings.
    #[arg(long)]
    fold: Option<usize>,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Runs `kv-eval shard-stream`.
pub(crate) fn run_stream(args: StreamArgs) -> Result<(), Error> {
    let form: CacheForm = args.form.parse()?;
    let reference: CacheForm = args.reference.parse()?;
    if let Some(path) = &args.json {
        crate::check_out_file(path, "--json")?;
    }
    let mut modes = vec![CacheMode::form(reference)];
    modes.extend(
        stream_variants(&form, args.fold)?
            .into_iter()
            .map(CacheMode::form),
    );
    let prepared = prepare(&args.source, &modes)?;
    let config = DriftConfig {
        prompts: args.prompts,
        prefix: args.prefix,
        new_tokens: args.new_tokens,
        checkpoints: args.checkpoints,
        fold: args.fold,
    };
    if let Some(trained) = prepared.model.context()
        && config
            .prefix
            .checked_add(config.new_tokens)
            .is_none_or(|n| n > trained)
    {
        return Err(format!(
            "--prefix {} and --new-tokens {} pass the {trained} tokens the model was trained to",
            config.prefix, config.new_tokens
        )
        .into());
    }
    let report = run(
        prepared.model.as_ref(),
        &prepared.tokens,
        reference,
        &form,
        &config,
        |what| eprintln!("{what}"),
    )?;
    println!("{}", report.markdown());
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
