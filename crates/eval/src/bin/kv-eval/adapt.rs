//! `kv-eval adapt`: adaptive protection on a non-uniform fault map (hot
//! layers, hot blocks or hot rows). The first `--observe-tokens` run under
//! SECDED everywhere; each layer's code (a layer map) or each block's (a
//! block or row map, `--block` rows per block) is chosen from the corrected
//! and detected counts it showed (kv_eval::adaptive); the rest of the
//! corpus is then scored under uniform Hamming, SECDED and Golay and under
//! the chosen codes, with the same faults. Under a block or row map every
//! run is read block by block, interpolation limited to each block.

use std::path::PathBuf;

use kv_eval::adaptive::{AdaptRule, Level, choose, choose_blocks, estimate, layer_forms};
use kv_eval::backend::BackendKind;
use kv_eval::cache::{
    BlockForms, CacheMode, ChannelKind, FaultSpec, HotMap, HotRegion, LayerCodewords,
};
use kv_eval::metrics::RunConfig;
use kv_quant::{CacheForm, FaultTarget, LayerForms};

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
    /// Bit error rate of the memory outside the hot layers, blocks or rows.
    #[arg(long, default_value_t = 1e-5)]
    ber: f64,
    /// Comma-separated layers whose memory is worse (codes chosen per layer).
    #[arg(long, value_delimiter = ',')]
    hot_layers: Vec<usize>,
    /// Fraction of blocks (of --block rows of each layer's keys and values)
    /// whose memory is worse (codes chosen per block).
    #[arg(long)]
    hot_blocks: Option<f64>,
    /// Fraction of single rows of each layer's keys and values whose memory
    /// is worse (codes chosen per block).
    #[arg(long)]
    hot_rows: Option<f64>,
    /// Rows per block, for --hot-blocks and for choosing codes per block.
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// Bit error rate of the hot layers, blocks or rows.
    #[arg(long, default_value_t = 1e-2)]
    hot_ber: f64,
    /// SECDED and Golay with their codewords interleaved over 8 bytes
    /// (`secded84x8`, `golay24x8`: what clustered faults need); Hamming
    /// stays plain.
    #[arg(long)]
    interleaved: bool,
    /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    channel: String,
    /// Fault seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens (from the start of the corpus) read under SECDED to observe
    /// each layer or block; the rest is scored.
    #[arg(long, default_value_t = 2048)]
    observe_tokens: usize,
    /// Promote a layer (or block) to Golay at an estimated bit error rate of
    /// at least this.
    #[arg(long, default_value_t = 1e-4)]
    promote_at: f64,
    /// Demote a layer (or block) to Hamming below this.
    #[arg(long, default_value_t = 1e-6)]
    demote_at: f64,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The hot region the flags name (exactly one of --hot-layers,
/// --hot-blocks, --hot-rows), checked before the model loads.
fn hot_region(args: &AdaptArgs) -> Result<HotRegion, Error> {
    let given = [
        !args.hot_layers.is_empty(),
        args.hot_blocks.is_some(),
        args.hot_rows.is_some(),
    ];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err("give exactly one of --hot-layers, --hot-blocks, --hot-rows".into());
    }
    if args.block == 0 || args.block > args.source.ctx {
        return Err(format!(
            "--block {}: a block holds 1 to --ctx ({}) rows",
            args.block, args.source.ctx
        )
        .into());
    }
    let fraction = |flag: &str, f: f64| -> Result<f64, Error> {
        if (0.0..=1.0).contains(&f) && f > 0.0 {
            Ok(f)
        } else {
            Err(format!("{flag} {f} is not in (0, 1]").into())
        }
    };
    Ok(match (args.hot_blocks, args.hot_rows) {
        (Some(f), _) => HotRegion::Blocks {
            block: args.block,
            fraction: fraction("--hot-blocks", f)?,
        },
        (_, Some(f)) => HotRegion::Rows {
            fraction: fraction("--hot-rows", f)?,
        },
        _ => {
            if let Some(l) = args.hot_layers.iter().find(|&&l| l >= 64) {
                return Err(format!(
                    "--hot-layers {l}: at most 64 layers (0 to 63) can be hot; the model's own \
                     layer count is checked once it loads"
                )
                .into());
            }
            let mut mask = 0u64;
            for &l in &args.hot_layers {
                if mask & 1 << l != 0 {
                    return Err(format!(
                        "--hot-layers names layer {l} twice: list each hot layer once"
                    )
                    .into());
                }
                mask |= 1 << l;
            }
            HotRegion::Layers(mask)
        }
    })
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
    let region = hot_region(&args)?;
    if let Some(path) = &args.json {
        crate::check_out_file(path, "--json")?;
    }
    let per_block = !matches!(region, HotRegion::Layers(_));
    // Hamming(7,4) has no interleaved layout: it stays plain.
    let codes = if args.interleaved {
        ["hamming74", "secded84x8", "golay24x8"]
    } else {
        ["hamming74", "secded84", "golay24"]
    };
    let forms = codes.map(|code| format!("{}+{code}{}", args.base, args.policy));
    let parsed: [CacheForm; 3] = [forms[0].parse()?, forms[1].parse()?, forms[2].parse()?];
    // Under a block or row map every run is read block by block, so the
    // uniform forms and the adaptive one interpolate alike.
    let blocked = |mode: CacheMode, blocks: BlockForms| {
        if per_block {
            mode.with_blocks(blocks)
        } else {
            mode
        }
    };
    let uniform: Vec<CacheMode> = parsed
        .iter()
        .map(|&f| blocked(CacheMode::form(f), BlockForms::uniform(args.block, false)))
        .collect();
    let channel: ChannelKind = args.channel.parse()?;
    let faults = FaultSpec {
        channel,
        ber: args.ber,
        seed: args.seed,
        target: FaultTarget::Values,
        hot: Some(HotMap {
            region,
            ber: args.hot_ber,
        }),
    };
    let prepared = prepare(&args.source, &uniform)?;
    let (model, tokens) = (prepared.model, prepared.tokens);
    let layers = model.layers();
    if let Some(l) = args.hot_layers.iter().find(|&&l| l >= layers) {
        return Err(format!("--hot-layers {l}: the model has {layers} layers").into());
    }
    let observe = args.observe_tokens;
    if observe == 0 || observe.saturating_add(args.source.ctx) > tokens.len() {
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
        eviction: None,
    };
    let ppl_method = method(&args.source);
    let observing = blocked(
        CacheMode::form(parsed[1]),
        BlockForms::uniform(args.block, true),
    );
    let seen = evaluate_with_bar(
        "observing",
        model.as_ref(),
        &tokens[..observe],
        args.source.ctx,
        ppl_method,
        &[run(observing)],
    )?
    .remove(0)
    .stats;
    println!("observed on {observe} tokens under {}:", forms[1]);
    let (adaptive, choice) = if per_block {
        let levels = choose_blocks(&seen.blocks, rule)?;
        print_block_choice(&faults, &seen.blocks, &levels, args.block);
        let blocks = BlockForms::from_levels(args.block, &levels, parsed);
        let choice = serde_json::json!({ "block": args.block, "levels": levels
            .iter()
            .map(|p| p.iter().map(|l| format!("{l:?}")).collect::<Vec<_>>())
            .collect::<Vec<_>>() });
        (CacheMode::form(parsed[1]).with_blocks(blocks), choice)
    } else {
        let levels = choose(&seen.layers, rule)?;
        for (l, (s, level)) in seen.layers.iter().zip(&levels).enumerate() {
            let p = estimate(s).unwrap_or(0.0);
            println!("  layer {l:2}: estimated BER {p:.2e} -> {level:?}");
        }
        let spelling = layer_forms(&levels, [&forms[0], &forms[1], &forms[2]]);
        println!("adaptive: {spelling}");
        let mode = CacheMode::layered(spelling.parse::<LayerForms>()?, None);
        (mode, serde_json::json!(spelling))
    };
    // The clean reference: SECDED without faults (every code reads the
    // same values when nothing is flipped).
    let clean = RunConfig {
        faults: None,
        ..run(uniform[1].clone())
    };
    let mut runs: Vec<RunConfig> = vec![clean];
    runs.extend(uniform.into_iter().map(run));
    runs.push(run(adaptive));
    let labels = ["no faults", &forms[0], &forms[1], &forms[2], "adaptive"];
    let scored = evaluate_with_bar(
        "scoring",
        model.as_ref(),
        &tokens[observe..],
        args.source.ctx,
        ppl_method,
        &runs,
    )?;
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
            "ctx": args.source.ctx, "ber": args.ber, "hot_map": format!("{region:?}"),
            "hot_ber": args.hot_ber, "channel": channel.name(), "seed": args.seed,
            "observe_tokens": observe, "promote_at": args.promote_at,
            "demote_at": args.demote_at, "observed_layers": seen.layers,
            "observed_blocks": seen.blocks, "adaptive": choice, "runs": rows,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&value)?)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Prints how many blocks each level got, and how the promoted blocks
/// match the map's hot region: a block is hot where any of its rows that
/// held tokens is (a window's last block may be partly empty: its rows read
/// are its share of the codewords a full block of the part showed).
fn print_block_choice(
    faults: &FaultSpec,
    seen: &[Vec<LayerCodewords>],
    levels: &[Vec<Level>],
    block: usize,
) {
    let (mut count, mut hot, mut hot_promoted) = ([0usize; 3], 0usize, 0usize);
    for (i, (part, seen)) in levels.iter().zip(seen).enumerate() {
        let full = seen.iter().map(|s| s.words).max().unwrap_or(0).max(1);
        for (b, (level, s)) in part.iter().zip(seen).enumerate() {
            count[*level as usize] += 1;
            let rows = (block as u64 * s.words).div_ceil(full) as usize;
            let is_hot = (b * block..b * block + rows).any(|r| faults.is_hot(i / 2, i % 2, r));
            hot += usize::from(is_hot);
            hot_promoted += usize::from(is_hot && *level == Level::Golay);
        }
    }
    println!(
        "  blocks of {block} rows: {} Hamming, {} SECDED, {} Golay; {hot_promoted} of the {hot} \
         blocks holding hot rows promoted",
        count[0], count[1], count[2]
    );
}
