//! What `kv-eval` reads: the `--model`/`--text` flags and their checks
//! (before the model loads), loading the model, probing each cache mode on
//! it, and reading and tokenizing the corpus only as far as the run needs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::ValueEnum;
use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::load::load_model as open_model;
use kv_eval::metrics::PplMethod;
use kv_eval::paths;
use kv_model::model::CausalLm;
use kv_model::tokenizer::{ReadLimits, TextTokenizer};

use crate::Error;
use crate::calib::needs_calibration;

/// What the model reads and how the corpus is cut.
#[derive(clap::Args, Clone)]
pub(crate) struct Source {
    /// GGUF model file, Hugging Face folder (config.json, model.safetensors,
    /// tokenizer.json) or the name of a fetched model (smollm2-135m,
    /// qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m, the GGUF `cargo xtask
    /// fetch-model` put in the cache folder].
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// UTF-8 corpus [default: the fetched Python 3.11 tutorial].
    #[arg(long)]
    pub(crate) text: Option<PathBuf>,
    /// Context length of each window.
    #[arg(long, default_value_t = 256)]
    pub(crate) ctx: usize,
    /// Perplexity method: llama.cpp's chunks (score the second half of each
    /// chunk) or the paper's sliding window.
    #[arg(long, value_enum, default_value_t = Method::Llamacpp)]
    pub(crate) method: Method,
    /// Window step of the sliding method.
    #[arg(long, default_value_t = 128)]
    pub(crate) stride: usize,
    /// Use only the first N tokens of the corpus.
    #[arg(long)]
    pub(crate) max_tokens: Option<usize>,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Method {
    Llamacpp,
    Sliding,
}

/// The model `--model` names: a path, else a fetched model's name, else the
/// default model.
pub(crate) fn model_path(p: &Option<PathBuf>) -> Result<PathBuf, Error> {
    let path = match p {
        None => paths::default_model(),
        Some(p) if p.exists() => p.clone(),
        Some(p) => match p.to_str().and_then(paths::named_model) {
            Some(named) if !named.is_file() => {
                return Err(format!(
                    "model {} ({}) is not fetched (run `cargo xtask fetch-model --model {}`)",
                    p.display(),
                    named.display(),
                    p.display()
                )
                .into());
            }
            Some(named) => named,
            None => p.clone(),
        },
    };
    if path.exists() && !path.is_file() && !path.is_dir() {
        return Err(format!(
            "model {} is neither a file nor a folder (pass --model with a GGUF file or a \
             Hugging Face folder)",
            path.display()
        )
        .into());
    }
    if !path.is_file() && !path.is_dir() {
        return Err(format!(
            "model {} not found (run `cargo xtask fetch-model`, or pass --model with a GGUF \
             file or a Hugging Face folder)",
            path.display()
        )
        .into());
    }
    Ok(path)
}

/// Refuses more worker threads than eight per core (a `--threads` that
/// would spawn threads until the machine hangs).
pub(crate) fn check_threads(threads: usize) -> Result<(), Error> {
    let max = 8 * std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > max {
        return Err(
            format!("--threads {threads}: at most {max} (eight per core) on this machine").into(),
        );
    }
    Ok(())
}

/// Refuses source flags that cannot work, before the model loads.
pub(crate) fn check_source(source: &Source) -> Result<(), Error> {
    check_threads(source.threads)?;
    if source.ctx < 4 {
        return Err(format!(
            "--ctx {}: a window needs at least 4 tokens to score a prediction",
            source.ctx
        )
        .into());
    }
    if matches!(source.method, Method::Sliding)
        && (source.stride == 0 || source.stride > source.ctx)
    {
        return Err(format!(
            "--stride {} must be in 1..={} (the context)",
            source.stride, source.ctx
        )
        .into());
    }
    if source.max_tokens == Some(0) {
        return Err("--max-tokens 0 reads no text".into());
    }
    Ok(())
}

/// Builds the global thread pool with `threads` workers (0: one per core),
/// this thread one of them: a forward pass then hands its products to the
/// pool without waking and waiting for it across threads (measured on
/// SmolLM2's decode: the calling thread outside the pool spent most of its
/// time in futex waits and context switches, about 240 a token).
pub(crate) fn init_pool(threads: usize) -> Result<(), Error> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build_global()?;
    Ok(())
}

pub(crate) fn load_model(path: &Path) -> Result<(Box<dyn CausalLm>, TextTokenizer), Error> {
    let started = Instant::now();
    let (model, tokenizer) = open_model(path)?;
    eprintln!(
        "loaded {} ({}) in {:.1} s",
        path.display(),
        model.describe(),
        started.elapsed().as_secs_f64()
    );
    Ok((model, tokenizer))
}

/// A loaded model, its tokenizer, the corpus tokens, and the two file names.
pub(crate) struct Prepared {
    pub(crate) model: Box<dyn CausalLm>,
    pub(crate) tokenizer: TextTokenizer,
    pub(crate) tokens: Vec<u32>,
    pub(crate) model_file: String,
    pub(crate) text_file: String,
}

/// Loads model and corpus and tokenizes the corpus, after checking that
/// the model can run every mode in `modes` (one token through a cache in
/// each mode: group sizes, rotation blocks and layer rules against the
/// model's shape), so a form that cannot fit fails before the corpus is read.
pub(crate) fn prepare(source: &Source, modes: &[CacheMode]) -> Result<Prepared, Error> {
    check_source(source)?;
    crate::source::init_pool(source.threads)?;
    let model_file = model_path(&source.model)?;
    let text_file = source.text.clone().unwrap_or_else(paths::default_text);
    let text = std::fs::File::open(&text_file).map_err(|e| {
        let hint = if source.text.is_none() {
            " (run `cargo xtask fetch-model`, or pass --text FILE)"
        } else {
            ""
        };
        format!("cannot read text {}: {e}{hint}", text_file.display())
    })?;
    let (model, tokenizer) = load_model(&model_file)?;
    for mode in modes {
        probe_mode(model.as_ref(), mode)?;
    }
    if let Some(trained) = model.context()
        && source.ctx > trained
    {
        return Err(format!(
            "--ctx {} is past the {trained} tokens the model was trained to",
            source.ctx
        )
        .into());
    }
    // Read and tokenize only as much text as the token limit needs.
    let limits = ReadLimits {
        max_tokens: source.max_tokens,
        ..ReadLimits::default()
    };
    let tokens = tokenizer
        .encode_reader(text, limits)
        .map_err(|e| format!("{}: {e}", text_file.display()))?;
    eprintln!("{} tokens read from {}", tokens.len(), text_file.display());
    Ok(Prepared {
        model,
        tokenizer,
        tokens,
        model_file: model_file.display().to_string(),
        text_file: text_file.display().to_string(),
    })
}

/// Runs one token through a cache in `mode` (skipped for forms that need a
/// calibration, which is fitted later, and for hierarchical and sparse
/// (`+out`) forms, which only the paged cache holds and which it checks
/// against the model's shape when it is built): the model's shape against
/// the forms.
pub(crate) fn probe_mode(model: &dyn CausalLm, mode: &CacheMode) -> Result<(), Error> {
    if mode.forms().iter().any(|(f, _)| {
        needs_calibration(f) || f.quantizer().is_hierarchical() || f.sparse().is_some()
    }) {
        return Ok(());
    }
    let mut cache = KvCache::new(mode.clone(), None, 0)?;
    model
        .forward(&[0], &mut cache, 0)
        .map_err(|e| format!("{} cannot run on this model: {e}", mode.label()))?;
    Ok(())
}

pub(crate) fn method(source: &Source) -> PplMethod {
    match source.method {
        Method::Llamacpp => PplMethod::LlamaCpp,
        Method::Sliding => PplMethod::Sliding {
            stride: source.stride,
        },
    }
}

pub(crate) fn method_name(source: &Source) -> String {
    match source.method {
        Method::Llamacpp => "llamacpp".into(),
        Method::Sliding => format!("sliding/{}", source.stride),
    }
}
