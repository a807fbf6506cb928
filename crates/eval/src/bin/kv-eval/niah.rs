//! `kv-eval niah`: the needle-in-a-haystack grid for one or more cache
//! forms; niah.md, niah.json and niah.svg in --out.

use kv_model::model::Sampling;
use std::path::PathBuf;

use kv_eval::cache::CacheMode;
use kv_eval::generate::GenerateConfig;
use kv_eval::niah::{Haystack, NiahConfig, NiahReport, run_grid};
use kv_eval::paths;

use crate::{Backend, BackendArgs, Calib, Error, calibration_for, load_model, model_path};

/// The flags of `kv-eval niah`.
#[derive(clap::Args)]
pub(crate) struct NiahArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    /// Comma-separated cache forms, each a whole-model form (`plain`,
    /// `fp16`, `int4+secded84`, ...).
    #[arg(long, value_delimiter = ',', default_value = "plain")]
    forms: Vec<String>,
    /// Prompt lengths in tokens [default: 1024,2048,4096,8192].
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    lengths: Vec<usize>,
    /// Needle depths in [0, 1].
    #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,1")]
    depths: Vec<f64>,
    /// Digits of each passkey.
    #[arg(long, default_value_t = 5)]
    digits: u32,
    /// Seed of the passkeys.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Haystack text [default: the Jargon File `cargo xtask fetch-model` fetched].
    #[arg(long)]
    haystack: Option<PathBuf>,
    #[command(flatten)]
    calib: Calib,
    /// KV backend: paged, auto, reencode or dense (plain only).
    #[arg(long, value_enum, default_value_t = Backend::Paged)]
    backend: Backend,
    /// Tokens per block of the paged backend.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[command(flatten)]
    evict: crate::args::EvictArgs,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

/// Runs `kv-eval niah`.
pub(crate) fn run(args: NiahArgs) -> Result<(), Error> {
    let config = NiahConfig {
        lengths: args.lengths.clone(),
        depths: args.depths.clone(),
        digits: args.digits,
        seed: args.seed,
    };
    config.check()?;
    if let Some(&l) = args.lengths.iter().find(|&&l| l == 0) {
        return Err(format!("--lengths: a prompt of {l} tokens").into());
    }
    let modes = args
        .forms
        .iter()
        .map(|f| CacheMode::parse(f))
        .collect::<Result<Vec<_>, _>>()?;
    let backend_args = BackendArgs {
        backend: args.backend,
        block_size: args.block_size,
        numerics: None,
        isa: None,
    };
    let eviction = args.evict.policy()?;
    for m in &modes {
        let backend = backend_args.kind(m, None);
        backend.check(m, None)?;
        if eviction.is_some() {
            kv_eval::backend::check_eviction(m, backend)?;
        }
    }
    let haystack_path = args
        .haystack
        .clone()
        .unwrap_or_else(paths::default_haystack);
    let haystack = Haystack::open(&haystack_path)?;
    let model_file = model_path(&args.model)?;
    crate::check_out_dir(&args.out)?;
    let (model, tokenizer) = load_model(&model_file)?;
    let longest = *args.lengths.iter().max().expect("checked non-empty");
    if let Some(trained) = model.context()
        && longest > trained
    {
        return Err(format!(
            "--lengths {longest} is past the {trained} tokens the model was trained to"
        )
        .into());
    }
    let filler = haystack.tokens(&tokenizer, longest)?;
    let cal = calibration_for(&modes, &args.calib, model.as_ref(), &tokenizer)?;
    let mut grids = Vec::new();
    for mode in modes {
        let mode = mode.with_calibration(cal.clone());
        let backend = backend_args.kind(&mode, None);
        // Staged forms read their prompt as decoding would: a block per
        // step, each block sealed before the next one reads it (in one
        // step the whole haystack would be read exact).
        let prefill_step = match backend {
            kv_eval::backend::BackendKind::Paged { block_size }
                if kv_eval::backend::seals_blocks(&mode, block_size) =>
            {
                Some(block_size)
            }
            _ => None,
        };
        let base = GenerateConfig {
            mode: mode.clone(),
            backend,
            context: longest,
            max_new: 0,
            sampling: Sampling::default(),
            faults: None,
            prefill_step,
            eviction,
        };
        eprintln!("{}:", mode.label());
        let grid = run_grid(
            model.as_ref(),
            &tokenizer,
            &filler,
            &config,
            &mode,
            &base,
            |c| {
                eprintln!(
                    "  {:>6} tokens, depth {:<4}: {} (passkey {}, answer {:?})",
                    c.length,
                    c.depth,
                    if c.found { "found " } else { "missed" },
                    c.passkey,
                    c.answer
                );
            },
        )?;
        eprintln!(
            "  {} of {} found in {:.0} s",
            grid.found,
            grid.cells.len(),
            grid.seconds
        );
        grids.push(grid);
    }
    let report = NiahReport {
        model: model_file.display().to_string(),
        haystack: haystack_path.display().to_string(),
        lengths: args.lengths,
        depths: args.depths,
        seed: args.seed,
        grids,
    };
    print!("{}", report.markdown());
    for p in report.write(&args.out)? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
