//! `kv-eval generate`: text after a prompt on a KV backend, streamed to
//! stdout, then tokens/s, the cache's true bytes and the codec statistics
//! on stderr; with `--speculate`, decoded plainly first and then
//! speculatively, with the acceptance and the speedup.

use kv_model::model::Sampling;
use std::path::PathBuf;

use kv_eval::generate::{GenerateConfig, Generation, StepFaults, generate, generate_speculative};
use kv_model::model::{Adapted, ModelDrafter, PromptLookup, SelfDrafter, SpeculativeStats};
use kv_model::tokenizer::ReadLimits;

use crate::speculate::Speculate;
use crate::{
    Backend, BackendArgs, Calib, Error, Forms, Target, calibration_for, load_model, mode_of,
    model_path,
};

/// The flags of `kv-eval generate`.
#[derive(clap::Args)]
pub(crate) struct GenerateArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(long, required_unless_present = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file instead.
    #[arg(long, conflicts_with = "prompt")]
    prompt_file: Option<PathBuf>,
    /// Keep only the first N tokens of the prompt (a context of a chosen
    /// length for speed measurements).
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Tokens the cache holds at most (prompt and continuation).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling: the smallest set of tokens with this much probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampling stream and of the faults.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    forms: Forms,
    #[command(flatten)]
    calib: Calib,
    /// KV backend: paged, auto (paged where a block holds the forms,
    /// reencode otherwise), reencode or dense (plain only).
    #[arg(long, value_enum, default_value_t = Backend::Paged)]
    backend: Backend,
    /// Tokens per block of the paged backend.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Bit error rate applied to every resident block before each decode step.
    #[arg(long, default_value_t = 0.0)]
    ber_per_step: f64,
    /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    channel: String,
    /// Which stored bits are exposed.
    #[arg(long, value_enum, default_value_t = Target::Values)]
    target: Target,
    /// Scrub the resident blocks every N decode steps.
    #[arg(long)]
    scrub_every: Option<usize>,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Prompt tokens per step [default: the whole prompt in one step]; a
    /// paged staged form (per-channel keys, sinks, windows) prefilled a
    /// block at a time reads each block's predecessors sealed, as
    /// decoding does.
    #[arg(long)]
    prefill_step: Option<usize>,
    /// How attention scores integer-coded keys and sums integer values
    /// (as `ppl --numerics`) [default: exact].
    #[arg(long, value_enum)]
    numerics: Option<crate::NumericsArg>,
    /// Instruction set of attention's kernels (as `ppl --isa`) [default:
    /// the fastest this CPU runs].
    #[arg(long, value_parser = crate::args::parse_isa)]
    isa: Option<attention::Isa>,
    /// Speculative decoding: `lookup[:k=K]` (prompt lookup: the last 3 or 2
    /// tokens matched earlier in the prompt and output, what followed
    /// proposed), `draft:MODEL[:k=K]` (a smaller model with the same
    /// tokenizer drafting greedily on a dense cache of its own) or
    /// `self[:skip=LAYERS][:k=K]` (the model drafting for itself through
    /// the upper 4-bit plane of a hierarchical `int8h` cache, QuantSpec's
    /// scheme, optionally with LAYERS skipped: `12-19,22`); K drafts
    /// per step, 7 by default (a verification of eight rows: one group of
    /// kv-model's token-lane kernels). The run decodes plainly first on the
    /// same cache form and reports the speedup.
    #[arg(long, value_parser = crate::speculate::parse_speculate)]
    speculate: Option<Speculate>,
    #[command(flatten)]
    evict: crate::args::EvictArgs,
}

/// Runs `kv-eval generate`.
pub(crate) fn run(args: GenerateArgs) -> Result<(), Error> {
    let GenerateArgs {
        model,
        prompt,
        prompt_file,
        prompt_tokens,
        max_new,
        ctx,
        temperature,
        top_p,
        seed,
        forms,
        calib,
        backend,
        block_size,
        ber_per_step,
        channel,
        target,
        scrub_every,
        threads,
        prefill_step,
        numerics,
        isa,
        speculate,
        evict,
    } = args;
    let eviction = evict.policy()?;
    let mode = mode_of(&forms)?;
    crate::check_segments(&mode, ctx)?;
    let backend = BackendArgs {
        backend,
        block_size,
        numerics: None,
        isa: None,
    }
    .kind(&mode, None);
    let sampling = Sampling {
        temperature,
        top_p,
        seed,
    };
    sampling.check()?;
    backend.check(&mode, None)?;
    if eviction.is_some() {
        kv_eval::backend::check_eviction(&mode, backend)?;
    }
    if let Some(Speculate::SelfDraft { .. }) = speculate {
        backend.check_draft_view(&mode)?;
    }
    let faults = StepFaults {
        channel: channel.parse()?,
        ber_per_step,
        target: target.into(),
        seed,
        scrub_every,
    };
    if prompt.as_deref() == Some("") || prompt_tokens == Some(0) {
        return Err("the prompt is empty".into());
    }
    if prompt.is_none() && prompt_file.is_none() {
        return Err("give --prompt or --prompt-file".into());
    }
    if let Some(k) = speculate.as_ref().map(Speculate::k).filter(|&k| k >= ctx) {
        return Err(format!(
            "--speculate k={k}: at most the context left after the prompt (--ctx {ctx})"
        )
        .into());
    }
    crate::source::check_threads(threads)?;
    crate::source::init_pool(threads)?;
    let (mut model, tokenizer) = load_model(&model_path(&model)?)?;
    if let Some(n) = numerics {
        model.set_numerics(n.numerics());
    }
    if let Some(isa) = isa {
        model.set_attention_isa(isa)?;
    }
    let limits = ReadLimits {
        max_tokens: prompt_tokens,
        ..ReadLimits::default()
    };
    let mut ids = match (&prompt, &prompt_file) {
        (Some(p), _) => tokenizer.encode_reader(p.as_bytes(), limits)?,
        (None, Some(f)) => {
            let file = std::fs::File::open(f)
                .map_err(|e| format!("cannot read prompt {}: {e}", f.display()))?;
            tokenizer
                .encode_reader(file, limits)
                .map_err(|e| format!("{}: {e}", f.display()))?
        }
        (None, None) => unreachable!("checked above"),
    };
    if ids.is_empty() {
        return Err("the prompt is empty".into());
    }
    if let Some(n) = prompt_tokens {
        ids.truncate(n);
    }
    let shown = match prompt {
        Some(ref p) if prompt_tokens.is_none() => p.clone(),
        _ => tokenizer.decode(&ids)?,
    };
    let cal = calibration_for(
        std::slice::from_ref(&mode),
        &calib,
        model.as_ref(),
        &tokenizer,
    )?;
    let mode = mode.with_calibration(cal);
    let config = GenerateConfig {
        mode: mode.clone(),
        backend,
        context: ctx,
        max_new,
        sampling,
        faults: Some(faults),
        prefill_step,
        eviction,
    };
    if let Some(k) = speculate.as_ref().map(Speculate::k) {
        let generate = kv_model::model::GenerateOptions {
            context: ctx,
            max_new,
            sampling,
            prefill_step,
        };
        kv_model::model::check_speculative(
            &ids,
            &kv_model::model::SpeculativeOptions { generate, k },
        )?;
    }
    let draft_model = match &speculate {
        Some(Speculate::Draft { model: path, .. }) => {
            let mut draft = crate::speculate::load_draft(path, model.as_ref(), &tokenizer)?;
            // The draft's attention runs on the pinned set too.
            if let Some(isa) = isa {
                draft.set_attention_isa(isa)?;
            }
            Some(draft)
        }
        Some(Speculate::SelfDraft { skip, .. }) => {
            // Layers the model lacks are refused before any work.
            SelfDrafter::new(model.as_ref(), sampling)?.skipping(skip)?;
            None
        }
        _ => None,
    };
    // Plain decoding first, on the same cache form: the baseline.
    let plain = match &speculate {
        Some(_) => Some(generate(model.as_ref(), &ids, &config, |_| Ok(()))?),
        None => None,
    };
    let mut text = String::new();
    let mut out_ids = Vec::new();
    let mut stdout = std::io::stdout();
    print!("{shown}");
    let stream = |id| {
        use std::io::Write;
        out_ids.push(id);
        let now = tokenizer.decode(&out_ids)?;
        if let Some(new) = now.strip_prefix(text.as_str()) {
            print!("{new}");
            let _ = stdout.flush();
        }
        text = now;
        Ok(())
    };
    let g = match &speculate {
        None => generate(model.as_ref(), &ids, &config, stream)?,
        Some(Speculate::Lookup { k }) => {
            let mut lookup = PromptLookup::default();
            generate_speculative(model.as_ref(), &mut lookup, *k, &ids, &config, stream)?
        }
        Some(Speculate::Draft { k, .. }) => {
            let draft = draft_model.as_deref().expect("loaded above");
            let mut drafter = ModelDrafter::new(
                draft,
                Adapted(attention::DenseBackend::new()),
                model.vocab(),
                kv_model::model::Sampling::default(),
            )?;
            generate_speculative(model.as_ref(), &mut drafter, *k, &ids, &config, stream)?
        }
        Some(Speculate::SelfDraft { k, skip }) => {
            let mut drafter = SelfDrafter::new(model.as_ref(), sampling)?.skipping(skip)?;
            generate_speculative(model.as_ref(), &mut drafter, *k, &ids, &config, stream)?
        }
    };
    println!();
    let values =
        2 * (ids.len() + g.tokens.len().saturating_sub(1)) * model.kv_channels() * model.layers();
    eprintln!(
        "{} prompt tokens in {:.2} s; {} new tokens, {:.2} tokens/s ({} backend, {})",
        ids.len(),
        g.prefill_seconds,
        g.tokens.len(),
        g.tokens_per_second(),
        backend.name(),
        mode.label()
    );
    let bits = |bytes: u64| 8.0 * bytes as f64 / values.max(1) as f64;
    if let Some(e) = g.eviction {
        eprintln!(
            "eviction: each key head kept {} of the {} prompt tokens (SnapKV)",
            e.kept, e.prefill
        );
    }
    if g.table_bytes > 0 {
        eprintln!(
            "cache: {} bytes, {:.3} bits per K/V value held; with {} bytes of fitted tables, {:.3}",
            g.cache_bytes,
            bits(g.cache_bytes),
            g.table_bytes,
            bits(g.cache_bytes + g.table_bytes)
        );
    } else {
        eprintln!(
            "cache: {} bytes, {:.3} bits per K/V value held",
            g.cache_bytes,
            bits(g.cache_bytes)
        );
    }
    let [k, v] = g.reads;
    eprintln!(
        "reads: keys {} words ({} corrected, {} detected), values {} words ({} corrected, {} detected); {} flips injected; scrubbed {} corrected, {} detected",
        k.values.words,
        k.values.corrected,
        k.values.detected,
        v.values.words,
        v.values.corrected,
        v.values.detected,
        g.injected_flips,
        g.scrubbed.values.corrected,
        g.scrubbed.values.detected
    );
    let (table_flips, t) = g.tables;
    if table_flips > 0 {
        eprintln!(
            "fitted tables: {table_flips} of the flips; {} words now read {} corrected, {} detected (read as 0), {} miscorrected, {} silent; scrubbed {} corrected",
            t.words, t.corrected, t.detected, t.miscorrected, t.silent, g.scrubbed.tables.corrected
        );
    }
    if let Some((now, peak)) = kv_eval::budget::resident_bytes() {
        eprintln!(
            "memory: {:.1} MB resident after the run (peak {:.1} MB); weights {:.1} MB, cache {:.1} MB",
            now as f64 / 1e6,
            peak as f64 / 1e6,
            model.weight_bytes() as f64 / 1e6,
            g.cache_bytes as f64 / 1e6
        );
    }
    if let (Some(plain), Some(stats), Some(how)) = (&plain, &g.speculation, &speculate) {
        print_speculation(how, stats, plain, &g, sampling.temperature == 0.0);
    }
    if g.non_finite_stored > 0 {
        eprintln!(
            "non-finite K/V values stored: {} (faults in an unprotected form made NaN or infinity; \
             the output above is their outcome)",
            g.non_finite_stored
        );
    }
    Ok(())
}

/// Prints the drafting statistics and the speedup over plain decoding.
fn print_speculation(
    how: &Speculate,
    s: &SpeculativeStats,
    plain: &Generation,
    g: &Generation,
    greedy: bool,
) {
    eprintln!(
        "speculation ({}): {} verify passes, {} drafted, {} accepted ({:.1}%), \
         {:.2} tokens per pass; drafting {:.2} s, verifying {:.2} s",
        how.describe(),
        s.verify_passes,
        s.drafted,
        s.accepted,
        100.0 * s.acceptance_rate(),
        s.tokens_per_pass(),
        s.draft_seconds,
        s.verify_seconds
    );
    let agree = plain
        .tokens
        .iter()
        .zip(&g.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!(
        "plain decoding on the same cache: {:.2} tokens/s; speculative {:.2} tokens/s: {:.2}x{}",
        plain.tokens_per_second(),
        g.tokens_per_second(),
        g.tokens_per_second() / plain.tokens_per_second().max(1e-9),
        if greedy {
            format!(
                "; the first {agree} of {} tokens equal plain greedy decoding's",
                g.tokens.len()
            )
        } else {
            String::new()
        }
    );
}
