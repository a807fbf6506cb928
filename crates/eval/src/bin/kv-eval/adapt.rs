//! `kv-eval adapt`: adaptive protection on a non-uniform fault map. The
//! first `--observe-tokens` run under SECDED everywhere; each layer's code
//! is chosen from the corrected and detected counts it showed
//! (kv_eval::adaptive); the rest of the corpus is then scored under uniform
//! Hamming, SECDED and Golay and under the chosen codes, with the same faults.

use std::path::PathBuf;

use kv_eval::adaptive::{AdaptRule, choose, estimate, layer_forms};
use kv_eval::backend::BackendKind;
use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec, HotLayers};
use kv_eval::metrics::RunConfig;
use kv_quant::{FaultTarget, LayerForms};

use crate::source::{Source, method, prepare};
use crate::{Error, evaluate_with_bar};

/// The flags of `kv-eval adapt`.
#[derive(clap::Args)]
pub(crate) struct AdaptArgs {
    #[command(flatten)]
    source: Source,
    /// Quantizer of every layer (the codes are added to it).
    #[arg(long, default_value = "int4")]
    base: String,
    /// Erasure policy suffix of every protected form.
    #[arg(long, default_value = "+interp")]
    policy: String,
    /// Bit error rate of every layer not in --hot-layers.
    #[arg(long, default_value_t = 1e-5)]
    ber: f64,
    /// Comma-separated layers whose memory is worse.
    #[arg(long, value_delimiter = ',', required = true)]
    hot_layers: Vec<usize>,
    /// Their bit error rate.
    #[arg(long, default_value_t = 1e-2)]
    hot_ber: f64,
    /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    channel: String,
    /// Fault seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens (from the start of the corpus) read under SECDED to observe
    /// each layer; the rest is scored.
    #[arg(long, default_value_t = 2048)]
    observe_tokens: usize,
    /// Promote a layer to Golay at an estimated bit error rate of at least this.
    #[arg(long, default_value_t = 1e-4)]
    promote_at: f64,
    /// Demote a layer to Hamming below this.
    #[arg(long, default_value_t = 1e-6)]
    demote_at: f64,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Runs `kv-eval adapt`.
pub(crate) fn run_adapt(args: AdaptArgs) -> Result<(), Error> {
    let rule = AdaptRule {
        promote_at: args.promote_at,
        demote_at: args.demote_at,
    };
    rule.check()?;
    for (flag, ber) in [("--ber", args.ber), ("--hot-ber", args.hot_ber)] {
        if !(ber > 0.0 && ber <= 1.0) {
            return Err(format!("{flag} {ber} is not in (0, 1]").into());
        }
    }
    if let Some(l) = args.hot_layers.iter().find(|&&l| l >= 64) {
        return Err(format!("--hot-layers {l}: layers 0..64 only").into());
    }
    let forms = ["hamming74", "secded84", "golay24"]
        .map(|code| format!("{}+{code}{}", args.base, args.policy));
    let uniform: Vec<CacheMode> = forms
        .iter()
        .map(|f| CacheMode::parse(f))
        .collect::<Result<_, _>>()?;
    let channel: ChannelKind = args.channel.parse()?;
    let hot = HotLayers {
        layers: args.hot_layers.iter().fold(0u64, |m, &l| m | 1 << l),
        ber: args.hot_ber,
    };
    let faults = FaultSpec {
        channel,
        ber: args.ber,
        seed: args.seed,
        target: FaultTarget::Values,
        hot: Some(hot),
    };
    let prepared = prepare(&args.source, &uniform)?;
    let (model, tokens) = (prepared.model, prepared.tokens);
    let layers = model.layers();
    if let Some(l) = args.hot_layers.iter().find(|&&l| l >= layers) {
        return Err(format!("--hot-layers {l}: the model has {layers} layers").into());
    }
    let observe = args.observe_tokens;
    if observe == 0 || observe + args.source.ctx > tokens.len() {
        return Err(format!(
            "--observe-tokens {observe} leaves no full window of the {} tokens to score",
            tokens.len()
        )
        .into());
    }
    let run = |mode: CacheMode| RunConfig {
        mode,
        faults: Some(faults),
        backend: BackendKind::Reencode,
    };
    let ppl_method = method(&args.source);
    let seen = evaluate_with_bar(
        "observing",
        model.as_ref(),
        &tokens[..observe],
        args.source.ctx,
        ppl_method,
        &[run(uniform[1].clone())],
    )?
    .remove(0)
    .stats
    .layers;
    let levels = choose(&seen, rule)?;
    let spelling = layer_forms(&levels, &args.base, &args.policy);
    println!("observed on {observe} tokens under {}:", forms[1]);
    for (l, (s, level)) in seen.iter().zip(&levels).enumerate() {
        let p = estimate(s).unwrap_or(0.0);
        println!("  layer {l:2}: estimated BER {p:.2e} -> {level:?}");
    }
    let adaptive = CacheMode::layered(spelling.parse::<LayerForms>()?, None);
    let mut runs: Vec<RunConfig> = uniform.into_iter().map(run).collect();
    runs.push(run(adaptive));
    let labels = [&forms[0], &forms[1], &forms[2], "adaptive"];
    let scored = evaluate_with_bar(
        "scoring",
        model.as_ref(),
        &tokens[observe..],
        args.source.ctx,
        ppl_method,
        &runs,
    )?;
    println!("adaptive: {spelling}");
    println!("| form | bits/value | PPL | detected | miscorrected + silent |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (label, m) in labels.iter().zip(&scored) {
        let c = m.stats.value_counts();
        println!(
            "| {label} | {:.3} | {:.4} | {} | {} |",
            m.stats.bits_per_value,
            m.ppl,
            c[3],
            c[4] + c[5]
        );
        rows.push(serde_json::json!({
            "form": label, "bits_per_value": m.stats.bits_per_value, "ppl": m.ppl,
            "metrics": m,
        }));
    }
    if let Some(path) = args.json {
        let value = serde_json::json!({
            "model": prepared.model_file, "text": prepared.text_file,
            "ctx": args.source.ctx, "ber": args.ber, "hot_layers": args.hot_layers,
            "hot_ber": args.hot_ber, "channel": channel.name(), "seed": args.seed,
            "observe_tokens": observe, "promote_at": args.promote_at,
            "demote_at": args.demote_at, "observed": seen, "adaptive": spelling,
            "runs": rows,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&value)?)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
