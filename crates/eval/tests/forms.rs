//! Key and value forms, per-layer forms and calibrated (vq, cq) forms on the
//! tiny model: the spellings, the bytes each part is counted with, the
//! errors before any work, and the calibration file's round trip and
//! refusals.

mod common;

use std::sync::Arc;

use common::tiny::{LAYERS, model, tokens};
use kv_eval::EvalError;
use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::calibration::{Calibration, CalibrationRows, Part};
use kv_model::model::LlamaModel;
use kv_quant::{CacheForm, FitOptions};

fn forward(m: &LlamaModel, mode: CacheMode) -> Result<(Vec<f32>, KvCache), EvalError> {
    let mut cache = KvCache::new(mode, None, 0)?;
    let logits = m.forward(&tokens(40), &mut cache, 0)?;
    Ok((logits, cache))
}

#[test]
fn spellings_of_modes() {
    for (text, label) in [
        ("plain", "plain"),
        ("int4", "int4"),
        ("int4-ch/int4", "int4-ch/int4"),
        ("int4/int4", "int4"),
        ("0,last:fp16;*:int4", "0,last:fp16;*:int4"),
        ("0:int8/int4;*:fp16", "0:int8/int4;*:fp16"),
    ] {
        assert_eq!(CacheMode::parse(text).unwrap().label(), label, "{text}");
    }
    assert!(CacheMode::parse("int5").is_err());
    assert!(CacheMode::parse("int4/").is_err());
    assert!(CacheMode::parse("0:int4").is_ok());
    let mode = CacheMode::parse("int4+sink4+win64/int4").unwrap();
    assert!(mode.check_context(256).is_ok());
    let e = mode.check_context(68).unwrap_err().to_string();
    assert!(e.contains("cover the whole context of 68"), "{e}");
}

#[test]
fn per_layer_and_per_part_forms_are_what_attention_reads() {
    let m = model();
    let (plain, _) = forward(&m, CacheMode::Plain).unwrap();
    // fp32 everywhere, spelled per layer, is the plain pass bit for bit.
    let (layered, _) = forward(&m, CacheMode::parse("0:fp32;*:fp32").unwrap()).unwrap();
    assert_eq!(plain, layered);
    // Keys in int8, values in fp32: the parts are counted apart.
    let (mixed, cache) = forward(&m, CacheMode::parse("int8/fp32").unwrap()).unwrap();
    assert_ne!(mixed, plain);
    let s = cache.stats();
    let values = s.stored_values / 2;
    let key_bits = 8.0 * s.part_bytes[0] as f64 / values as f64;
    let value_bits = 8.0 * s.part_bytes[1] as f64 / values as f64;
    // int8 over 16 channels: 8 bits + f16 scale and offset per row.
    approx::assert_abs_diff_eq!(key_bits, 8.0 + 32.0 / 16.0, epsilon = 1e-9);
    assert_eq!(value_bits, 32.0);
    // The first layer in fp32, the rest in int4, differs from both.
    let (first_wide, _) = forward(&m, CacheMode::parse("0:fp32;*:int4").unwrap()).unwrap();
    let (all_int4, _) = forward(&m, CacheMode::parse("int4").unwrap()).unwrap();
    assert_ne!(first_wide, all_int4);
    assert_ne!(first_wide, plain);
}

#[test]
fn bad_layer_forms_fail_before_any_work() {
    let m = model();
    for (text, needle) in [
        ("5:int8;*:int4", "does not exist"),
        ("0:int8", "has no rule"),
        ("0-1:int8;1:int4;*:fp16", "named by two rules"),
    ] {
        let e = match CacheMode::parse(text) {
            Ok(mode) => forward(&m, mode).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(needle), "{text}: {e}");
    }
    // A rotation block wider than the tiny model's heads of 8 channels.
    let e = forward(&m, CacheMode::parse("int4+rot16").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("straddle heads"), "{e}");
}

/// The largest absolute difference between two equally long runs of logits.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logits of the same tokens");
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn calibration(m: &LlamaModel, form: &str) -> Calibration {
    let rows = CalibrationRows::collect(m, &tokens(300), 64).unwrap();
    assert_eq!(rows.layers.len(), LAYERS);
    assert_eq!(rows.tokens, 300);
    let f: CacheForm = form.parse().unwrap();
    let opts = FitOptions {
        iterations: 5,
        ..FitOptions::default()
    };
    Calibration::fit(
        m,
        &rows,
        "tokens",
        &[(f, Part::Key), (f, Part::Value)],
        opts,
    )
    .unwrap()
}

#[test]
fn vq_forms_need_a_calibration_and_use_it() {
    let m = model();
    let mode = CacheMode::parse("fp32/vq-k16+rot8").unwrap();
    let e = forward(&m, mode.clone()).unwrap_err().to_string();
    assert!(e.contains("--calibration"), "{e}");
    let cal = Arc::new(calibration(&m, "vq-k16+rot8"));
    assert_eq!(cal.shapes(), ["vq-k16+rot8"]);
    let (logits, cache) = forward(&m, mode.with_calibration(Some(cal.clone()))).unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    // Codebooks are counted with the stores that use them.
    let s = cache.stats();
    assert!(s.codebook_bytes > 0 && s.part_bytes[1] > s.codebook_bytes);
    // A calibration without the form's shape is refused by name.
    let other = CacheMode::parse("fp32/vq-k8+rot8")
        .unwrap()
        .with_calibration(Some(cal));
    let e = forward(&m, other).unwrap_err().to_string();
    assert!(e.contains("no value codebook"), "{e}");
}

#[test]
fn calibration_files_round_trip_and_refuse_bad_ones() {
    let m = model();
    let cal = calibration(&m, "vq-d2-k8+rot8");
    let dir = std::env::temp_dir().join(format!("kv-eval-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cal.safetensors");
    cal.save(&path).unwrap();
    let back = Calibration::load(&path).unwrap();
    assert_eq!(back, cal);
    back.check_model(&m).unwrap();
    // Fitted for another shape.
    let mut wrong = back.clone();
    wrong.layers += 1;
    assert!(
        wrong
            .check_model(&m)
            .unwrap_err()
            .to_string()
            .contains("fitted for")
    );
    // Not a calibration file, garbage, a truncated file.
    let bytes = std::fs::read(&path).unwrap();
    let tag = b"reliable-kv calibration 2";
    let at = bytes.windows(tag.len()).position(|w| w == tag).unwrap();
    let mut other_format = bytes.clone();
    other_format[at + tag.len() - 1] = b'9';
    for (name, content, needle) in [
        ("garbage", b"not safetensors at all".to_vec(), ""),
        ("truncated", bytes[..bytes.len() / 2].to_vec(), ""),
        ("format", other_format, "format is not"),
    ] {
        let p = dir.join(format!("{name}.safetensors"));
        std::fs::write(&p, content).unwrap();
        let e = Calibration::load(&p).unwrap_err();
        assert!(matches!(e, EvalError::Safetensors { .. }), "{name}: {e}");
        assert!(e.to_string().contains(needle), "{name}: {e}");
    }
    // A table changed after it was written: a bit of an f16 value (its
    // lowest mantissa bit, bit 13 of the f32 holding it) fails the table's
    // RM(2,5) check words; a bit below the f16's precision leaves no f16.
    let form: kv_quant::CacheForm = "vq-d2-k8+rot8".parse().unwrap();
    let first = cal.codebook(&form, 0, Part::Key).unwrap().centroids()[0];
    assert!(first.abs() > 1e-3, "a normal f16: {first}");
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let at = header
        + bytes[header..]
            .windows(4)
            .position(|w| w == first.to_le_bytes())
            .unwrap();
    for (bit, needle) in [(13, "fail their RM(2,5) check"), (0, "is not the f16")] {
        let mut changed = bytes.clone();
        changed[at + bit / 8] ^= 1 << (bit % 8);
        let p = dir.join(format!("changed-{bit}.safetensors"));
        std::fs::write(&p, changed).unwrap();
        let e = Calibration::load(&p).unwrap_err().to_string();
        assert!(e.contains(needle), "bit {bit}: {e}");
    }
    let missing = Calibration::load(&dir.join("missing.safetensors")).unwrap_err();
    assert!(matches!(missing, EvalError::Io { .. }), "{missing}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn low_rank_forms_run_on_the_model_with_calibrated_bases() {
    let m = model();
    let (plain, _) = forward(&m, CacheMode::Plain).unwrap();
    // Full rank (8 of the tiny model's 8-channel heads), on the coefficient path.
    let cal = Arc::new(calibration(&m, "pca-r8"));
    let (full, cache) = forward(
        &m,
        CacheMode::parse("pca-r8")
            .unwrap()
            .with_calibration(Some(cal)),
    )
    .unwrap();
    let worst = plain
        .iter()
        .zip(&full)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst < 0.05, "{worst}");
    let certs = &cache.stats().certificates;
    assert_eq!(certs.len(), LAYERS);
    assert!(certs.iter().all(|c| c.count > 0 && c.logit_max >= 0.0));
    // Keys projected before RoPE, values in int8, online keys: other paths.
    let cal = Arc::new(calibration(&m, "pca-r4-pre"));
    let mode = CacheMode::parse("pca-r4-pre/int8")
        .unwrap()
        .with_calibration(Some(cal));
    let (pre, _) = forward(&m, mode).unwrap();
    assert!(pre.iter().all(|x| x.is_finite()));
    // Values carry no RoPE: a value form projecting before it is refused.
    let mode = CacheMode::parse("pca-r4-pre")
        .unwrap()
        .with_calibration(Some(Arc::new(calibration(&m, "pca-r4-pre"))));
    let e = forward(&m, mode).unwrap_err().to_string();
    assert!(e.contains("values do not carry"), "{e}");
    let (online, cache) = forward(&m, CacheMode::parse("fd-r4-l16/fp16").unwrap()).unwrap();
    assert!(online.iter().all(|x| x.is_finite()));
    assert!(cache.stats().part_bytes[0] > 0);
    // Bases missing from the calibration are refused by name.
    let e = forward(&m, CacheMode::parse("pca-r2").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs bases"), "{e}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any spelling made of the grammar's characters parses or gets a typed
    /// error of bounded length; one that parses runs on the tiny model or
    /// is refused with a typed error (layers it lacks, sizes that do not
    /// fit), never a panic.
    #[test]
    fn arbitrary_mode_spellings_never_panic(text in "[a-z0-9+\\-/:;,*]{0,48}") {
        match CacheMode::parse(&text) {
            Err(e) => proptest::prop_assert!(e.to_string().len() < 2048),
            Ok(mode) => {
                let _ = forward(&model(), mode);
            }
        }
    }
}

/// A calibrated `vq` form on the paged cache: its fitted codebooks go to
/// the pool once (counted once, beside the blocks) and every token is coded
/// against them as the re-encode protocol codes it, so the two backends
/// give the same logits up to the order attention sums tiles in.
#[test]
fn vq_forms_are_paged_forms_with_their_codebooks() {
    use attention::KvBackend;
    use kv_eval::backend::{BackendKind, paged_backend, paged_stats};
    use kv_model::model::Adapted;
    let m = model();
    let cal = Arc::new(calibration(&m, "vq-k16+rot8"));
    let mode = CacheMode::parse("fp32/vq-k16+rot8")
        .unwrap()
        .with_calibration(Some(cal));
    // `auto` keeps calibrated forms on the re-encode protocol.
    assert_eq!(BackendKind::auto(&mode, None, 16), BackendKind::Reencode);
    let toks = tokens(40);
    let (reencoded, _) = forward(&m, mode.clone()).unwrap();
    let mut paged = Adapted(paged_backend(&m, &mode, None, 16, toks.len()).unwrap());
    let logits = m.forward(&toks, &mut paged, 0).unwrap();
    assert_eq!(paged.tokens(), toks.len());
    let paged = paged.0;
    let worst = max_abs_diff(&logits, &reencoded);
    assert!(
        worst < 1e-4,
        "paged vq differs from re-encoded vq by {worst}"
    );
    let s = paged_stats(&paged, &m, toks.len()).unwrap();
    assert!(s.codebook_bytes > 0);
    // Counted once, with the values that read them.
    assert_eq!(s.stored_bytes, s.part_bytes[0] + s.part_bytes[1]);
    let blocks = 40usize.div_ceil(16) as u64;
    let value_blocks = s.part_bytes[1] - s.codebook_bytes;
    assert_eq!(
        value_blocks % blocks,
        0,
        "whole value blocks beside the codebooks"
    );
    // The codebooks are resident bits: metadata faults reach them (one
    // exact flip in each layer's value codebook), value faults do not.
    let flip = gf2_codes::channel::ExactFlips::new([9]);
    paged
        .inject(&flip, 0, kv_quant::FaultTarget::Values)
        .unwrap();
    assert_eq!(paged.table_flips(), 0);
    let hit = paged
        .inject(&flip, 0, kv_quant::FaultTarget::Metadata)
        .unwrap();
    assert_eq!(paged.table_flips(), LAYERS as u64);
    assert!(hit >= LAYERS as u64);
    // Without its calibration the paged cache refuses the form by name.
    let bare = CacheMode::parse("fp32/vq-k16+rot8").unwrap();
    let e = paged_backend(&m, &bare, None, 16, 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs its fitted codebook"), "{e}");
}

/// A calibrated low-rank form (`pca-r4`) on the paged cache: blocks are
/// staged exact and projected on the calibrated bases when they seal, the
/// bases counted once; the logits stay near the plain pass (closer than
/// the re-encode protocol's, which projects every row, the newest
/// included); without bases the form is refused by name.
#[test]
fn calibrated_low_rank_forms_are_paged_forms() {
    use kv_eval::backend::{paged_backend, paged_stats};
    use kv_model::model::Adapted;
    let m = model();
    let cal = Arc::new(calibration(&m, "pca-r4"));
    let mode = CacheMode::parse("pca-r4")
        .unwrap()
        .with_calibration(Some(cal));
    let toks = tokens(40);
    let (plain, _) = forward(&m, CacheMode::Plain).unwrap();
    let (reencoded, _) = forward(&m, mode.clone()).unwrap();
    let mut paged = Adapted(paged_backend(&m, &mode, None, 8, toks.len()).unwrap());
    let logits = m.forward(&toks, &mut paged, 0).unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let worst = |a: &[f32]| {
        a.iter()
            .zip(&plain)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    };
    let (paged_err, reencode_err) = (worst(&logits), worst(&reencoded));
    assert!(paged_err > 0.0, "a rank-4 projection changes the logits");
    assert!(
        paged_err <= reencode_err,
        "paged {paged_err} against re-encoded {reencode_err}"
    );
    let s = paged_stats(&paged.0, &m, toks.len()).unwrap();
    assert!(s.codebook_bytes > 0, "the bases are counted");
    let bare = CacheMode::parse("pca-r4").unwrap();
    let e = paged_backend(&m, &bare, None, 8, 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs its calibrated bases"), "{e}");
}

/// Keys projected before RoPE on calibrated bases (`pca-r<R>-pre`) on the
/// paged cache, fed four tokens a step in blocks of 4: each sealed block is
/// turned back from its position, projected, and turned to it again when
/// read. At full rank (8 of the tiny model's 8 channels a head) the logits
/// are the f16 paged cache's within the coefficients' rounding; at rank 4
/// they move further, and stay finite.
#[test]
fn low_rank_keys_before_rope_are_paged_forms() {
    let m = model();
    let toks = tokens(40);
    let with = |spelling: &str, keys: &str| {
        CacheMode::parse(spelling)
            .unwrap()
            .with_calibration(Some(Arc::new(calibration(&m, keys))))
    };
    let (f16, _) = paged_run(&m, &toks, &CacheMode::parse("fp16").unwrap());
    let (full, stats) = paged_run(&m, &toks, &with("pca-r8-pre/fp16", "pca-r8-pre"));
    assert!(stats.codebook_bytes > 0, "the bases are counted");
    let scale = f16.iter().fold(0f32, |a, x| a.max(x.abs()));
    let worst = max_abs_diff(&full, &f16);
    assert!(worst < 1e-2 * scale, "{worst} of {scale}");
    let (low, _) = paged_run(&m, &toks, &with("pca-r4-pre/fp16", "pca-r4-pre"));
    assert!(low.iter().all(|x| x.is_finite()));
    let moved = max_abs_diff(&low, &f16);
    assert!(moved > worst, "rank 4 {moved} against full rank {worst}");
}

/// A Shard form fitted per sequence (`shard-k4-g4`, no calibration) on the
/// paged backend: the sequence's tables are fitted at its first seal and
/// counted with the cache, the logits move but stay near plain's; with a
/// window over every token nothing seals and the logits are f16-paged's;
/// `batch` turns prefix caching off for it with a notice, and `auto`
/// keeps it on the re-encode protocol.
#[test]
fn shard_forms_fitted_per_sequence_are_paged_forms() {
    use kv_eval::backend::BackendKind;
    use kv_eval::batch::{PrefixKind, prefix_for};
    let m = model();
    // The fit needs 1,024 values (256 centroids of 4): 64 rows of the
    // tiny model's 16 channels, past the sink block, out of the window.
    assert_eq!(kv_model::model::CausalLm::kv_channels(&m), 16);
    let toks = tokens(96);
    let run = |mode: &CacheMode| paged_run(&m, &toks, mode);
    let mode = CacheMode::parse("shard-k4-g4+sink2+win8").unwrap();
    let (plain, _) = run(&CacheMode::parse("plain").unwrap());
    let (f16, _) = run(&CacheMode::parse("fp16").unwrap());
    let (shard, stats) = run(&mode);
    assert!(shard.iter().all(|x| x.is_finite()));
    assert_ne!(shard, f16, "blocks were sealed");
    let scale = plain.iter().fold(0f32, |a, x| a.max(x.abs()));
    let worst = max_abs_diff(&shard, &plain);
    assert!(worst < 0.5 * scale, "{worst} of {scale}");
    assert!(
        stats.codebook_bytes > 0,
        "the sequence's tables are counted"
    );
    let (open, open_stats) = run(&CacheMode::parse("shard-k4-g4+sink2+win96").unwrap());
    assert_eq!(open, f16);
    assert_eq!(open_stats.codebook_bytes, 0, "nothing fitted");
    let (prefix, notice) = prefix_for(&mode, PrefixKind::Hash);
    assert_eq!(prefix, PrefixKind::None);
    assert!(notice.unwrap().contains("prefix caching is off"));
    let cal = CacheMode::parse("shard-k4-g4-cal").unwrap();
    assert_eq!(
        prefix_for(&cal, PrefixKind::Radix),
        (PrefixKind::Radix, None)
    );
    assert_eq!(BackendKind::auto(&mode, None, 4), BackendKind::Reencode);
}

/// A calibrated Shard form on the paged cache: blocks past the sink and
/// out of the window are coded on the calibration's tables as their step
/// commits, so a sequence fed four tokens a step reads its middle
/// compressed: its logits stay finite and near the plain pass, differ from
/// it, and the blocks hold fewer bytes than f16 blocks; with a window
/// covering every token nothing is sealed and the logits are f16-paged's
/// bit for bit; without its tables the form is refused by name.
#[test]
fn calibrated_shard_forms_are_paged_forms() {
    use kv_eval::backend::paged_backend;
    let m = model();
    let toks = tokens(40);
    let run = |mode: &CacheMode| paged_run(&m, &toks, mode);
    let with = |spelling: &str| {
        let cal = Arc::new(calibration(&m, spelling));
        CacheMode::parse(spelling)
            .unwrap()
            .with_calibration(Some(cal))
    };
    let (plain, _) = run(&CacheMode::parse("plain").unwrap());
    let (f16, f16_stats) = run(&CacheMode::parse("fp16").unwrap());
    let (shard, stats) = run(&with("shard-k4-g4-cal+sink2+win8"));
    assert!(shard.iter().all(|x| x.is_finite()));
    let scale = plain.iter().fold(0f32, |a, x| a.max(x.abs()));
    let worst = max_abs_diff(&shard, &plain);
    assert!(worst > 0.0 && worst < 0.5 * scale, "{worst} of {scale}");
    let blocks = |s: &kv_eval::cache::CacheStats| s.stored_bytes - s.codebook_bytes;
    assert!(stats.codebook_bytes > 0, "the tables are counted");
    assert!(blocks(&stats) < blocks(&f16_stats), "{stats:?}");
    // A window over every token: nothing sealed, f16 rows throughout.
    let (open, _) = run(&with("shard-k4-g4-cal+sink2+win64"));
    assert_eq!(open, f16);
    let bare = CacheMode::parse("shard-k4-g4-cal").unwrap();
    let e = paged_backend(&m, &bare, None, 4, 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("calibrated key basis"), "{e}");
    // A calibration file keeps every table bit for bit: the int8 key basis
    // (the re-encode protocol reads it), the keys' allocation and the value
    // codebook (the paged blocks are coded on them).
    let spelling = "shard-k4-g4-cal";
    let cal = calibration(&m, spelling);
    let dir = std::env::temp_dir().join(format!("kv-eval-shard-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cal.safetensors");
    cal.save(&path).unwrap();
    let back = Arc::new(Calibration::load(&path).unwrap());
    assert_eq!(*back, cal);
    back.check_model(&m).unwrap();
    let mode = |cal: Arc<Calibration>| {
        CacheMode::parse(spelling)
            .unwrap()
            .with_calibration(Some(cal))
    };
    assert!(forward(&m, mode(back.clone())).is_ok());
    let (fitted, _) = run(&mode(Arc::new(cal)));
    assert_eq!(run(&mode(back.clone())).0, fitted);
    // The file serves the coded spelling too (a code protects the tables
    // and blocks as stored, it does not change what is fitted), and the
    // coded blocks read as the bare ones, bit for bit.
    let coded = CacheMode::parse(&format!("{spelling}+secded84"))
        .unwrap()
        .with_calibration(Some(back));
    let (coded, coded_stats) = run(&coded);
    assert_eq!(coded, fitted);
    assert!(coded_stats.keys.values.words > 0, "{coded_stats:?}");
    // A changed allocation byte fails its check words; a file whose value
    // codebooks rotate heads of another width is refused for this model.
    let bytes = std::fs::read(&path).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta = std::str::from_utf8(&bytes[8..header]).unwrap();
    let name = "\"shard/shard-k4-g4-cal/0/k/allocation\"";
    let offsets = &meta[meta.find(name).unwrap()..];
    let offsets = &offsets[offsets.find("data_offsets").unwrap() + 15..];
    let start: usize = offsets[..offsets.find(',').unwrap()].parse().unwrap();
    let mut changed = bytes.clone();
    changed[header + start] ^= 2;
    let p = dir.join("allocation.safetensors");
    std::fs::write(&p, changed).unwrap();
    let e = Calibration::load(&p).unwrap_err().to_string();
    assert!(e.contains("k/allocation") && e.contains("RM(2,5)"), "{e}");
    let dim = "\"shard_head_dim\":\"8\"";
    let at = bytes.windows(dim.len()).position(|w| w == dim.as_bytes());
    let mut other = bytes.clone();
    other[at.expect("the head width in the metadata") + dim.len() - 2] = b'4';
    let p = dir.join("heads.safetensors");
    std::fs::write(&p, other).unwrap();
    let e = Calibration::load(&p).unwrap().check_model(&m).unwrap_err();
    assert!(e.to_string().contains("heads of 4"), "{e}");
    // Tables with valid check words that do not make the form's tables:
    // an allocation past the form's budget, a form not spelled as written.
    let over = rewrite(&bytes, |name, data| {
        if name.ends_with("/k/allocation") {
            data.fill(8);
        }
    });
    // (The same length: the header's names change in place.)
    let mut renamed = bytes.clone();
    let (from, to) = (b"shard/shard-k4-g4-cal/", b"shard/shard-g4-k4-cal/");
    while let Some(i) = renamed[..header]
        .windows(from.len())
        .position(|w| w == from)
    {
        renamed[i..i + to.len()].copy_from_slice(to);
    }
    for (what, content, needle) in [("over", over, "allows"), ("renamed", renamed, "spelled")] {
        let p = dir.join(format!("{what}.safetensors"));
        std::fs::write(&p, content).unwrap();
        let e = Calibration::load(&p).unwrap_err().to_string();
        assert!(e.contains(needle), "{what}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The logits of the last block of `toks` on a paged backend in `mode`
/// (blocks of 4, a block per step, as a server decodes), and its
/// statistics.
fn paged_run(
    m: &LlamaModel,
    toks: &[u32],
    mode: &CacheMode,
) -> (Vec<f32>, kv_eval::cache::CacheStats) {
    use kv_eval::backend::{paged_backend, paged_stats};
    let mut paged = kv_model::model::Adapted(paged_backend(m, mode, None, 4, toks.len()).unwrap());
    let mut logits = Vec::new();
    for step in toks.chunks(4) {
        logits = m.forward(step, &mut paged, 0).unwrap();
    }
    let s = paged_stats(&paged.0, m, toks.len()).unwrap();
    (logits, s)
}

/// A calibration file's `bytes` with each table passed to `edit` (its name
/// and bytes) and its check words recomputed, as a writer that meant it
/// would (the header keeps its length: names and shapes are unchanged).
fn rewrite(bytes: &[u8], edit: impl Fn(&str, &mut [u8])) -> Vec<u8> {
    use safetensors::tensor::{SafeTensors, TensorView};
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    let tensors = SafeTensors::deserialize(bytes).unwrap();
    let mut tables: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for (name, _, _, data) in &mut tables {
        edit(name, data);
    }
    let words = |name: &str, data: &[u8]| -> Vec<u8> {
        if name.ends_with("/centroids") {
            // f16 values held in f32: the check words cover the f16s.
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                .collect()
        } else {
            data.to_vec()
        }
    };
    let fresh: Vec<(String, Vec<u8>)> = tables
        .iter()
        .filter(|(n, ..)| n.ends_with("/allocation") || n.ends_with("/centroids"))
        .map(|(n, _, _, d)| {
            let table =
                kv_quant::ProtectedTable::new(&words(n, d), kv_quant::MetaProtection::ReedMuller);
            (format!("{n}/check"), table.check_bytes().to_vec())
        })
        .collect();
    for (name, check) in fresh {
        let slot = tables.iter_mut().find(|t| t.0 == name).unwrap();
        slot.3 = check;
    }
    let views: Vec<(String, TensorView<'_>)> = tables
        .iter()
        .map(|(n, dt, shape, d)| (n.clone(), TensorView::new(*dt, shape.clone(), d).unwrap()))
        .collect();
    safetensors::serialize(views, header.metadata().clone()).unwrap()
}

/// Coupled Quantization (`cq`): a codebook per group of channels, fitted on
/// the calibration text, saved and loaded with the calibration, and coded
/// the same way by the re-encode protocol and the paged cache.
#[test]
fn cq_forms_code_each_group_on_its_own_calibrated_codebook() {
    use kv_eval::backend::{paged_backend, paged_stats};
    use kv_model::model::Adapted;
    let m = model();
    let cal = calibration(&m, "cq-d2-k8");
    assert_eq!(cal.shapes(), ["cq-d2-k8"]);
    let form: CacheForm = "cq-d2-k8".parse().unwrap();
    let kv_channels = m.config().kv_heads * m.config().head_dim;
    let book = cal.codebook(&form, 0, Part::Value).unwrap();
    assert_eq!(book.codebooks(), kv_channels / 2, "one codebook per pair");
    let dir = std::env::temp_dir().join(format!("kv-eval-cq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cq.safetensors");
    cal.save(&path).unwrap();
    assert_eq!(Calibration::load(&path).unwrap(), cal);
    std::fs::remove_dir_all(&dir).unwrap();
    let cal = Arc::new(cal);
    let mode = CacheMode::parse("fp32/cq-d2-k8")
        .unwrap()
        .with_calibration(Some(cal.clone()));
    let (reencoded, cache) = forward(&m, mode.clone()).unwrap();
    assert!(reencoded.iter().all(|x| x.is_finite()));
    // f16 centroids: pairs × 8 centroids × 2 channels, per layer.
    let books = LAYERS * kv_channels / 2 * 8 * 2 * 2;
    assert_eq!(cache.stats().codebook_bytes as usize, books);
    let toks = tokens(40);
    let mut paged = Adapted(paged_backend(&m, &mode, None, 16, toks.len()).unwrap());
    let logits = m.forward(&toks, &mut paged, 0).unwrap();
    let worst = max_abs_diff(&logits, &reencoded);
    assert!(
        worst < 1e-4,
        "paged cq differs from re-encoded cq by {worst}"
    );
    let s = paged_stats(&paged.0, &m, toks.len()).unwrap();
    assert_eq!(s.codebook_bytes as usize, books);
    // A vq codebook of the same size is another shape: refused by name.
    let vq = CacheMode::parse("fp32/vq-d2-k8+rot8")
        .unwrap()
        .with_calibration(Some(cal));
    let e = forward(&m, vq).unwrap_err().to_string();
    assert!(e.contains("no value codebook"), "{e}");
}

/// Keys coded before RoPE on pair codebooks (`cq-d2-pre`): fitted on the
/// calibration keys rotated back to position 0 (keys only), served by the
/// paged cache (its blocks rotated back when sealed and to their
/// positions when read) and the re-encode protocol alike, refused for
/// values.
#[test]
fn cq_pre_keys_are_fitted_on_keys_before_rope_and_paged() {
    let m = model();
    let rows = CalibrationRows::collect(&m, &tokens(300), 64).unwrap();
    let f: CacheForm = "cq-d2-k8-pre".parse().unwrap();
    let opts = FitOptions {
        iterations: 5,
        ..FitOptions::default()
    };
    let e = Calibration::fit(&m, &rows, "tokens", &[(f, Part::Value)], opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("values carry no RoPE"), "{e}");
    let cal = Calibration::fit(&m, &rows, "tokens", &[(f, Part::Key)], opts).unwrap();
    assert_eq!(cal.shapes(), ["cq-d2-k8-pre"]);
    // Fitted on other rows than the keys as the model rotates them.
    let plain = Calibration::fit(
        &m,
        &rows,
        "tokens",
        &[("cq-d2-k8".parse().unwrap(), Part::Key)],
        opts,
    )
    .unwrap();
    let (pre, post) = (
        cal.codebook(&f, 1, Part::Key).unwrap(),
        plain
            .codebook(&"cq-d2-k8".parse().unwrap(), 1, Part::Key)
            .unwrap(),
    );
    assert_ne!(pre.centroid(1, 0), post.centroid(1, 0));
    let cal = Arc::new(cal);
    let mode = CacheMode::parse("cq-d2-k8-pre+sink2/fp32")
        .unwrap()
        .with_calibration(Some(cal.clone()));
    // Both backends hold it (attention's tests pin the window's rows to
    // the paged block's); the paged cache keeps the step's own block
    // staged exact, so their logits differ by more than rounding.
    let (reencoded, _) = forward(&m, mode.clone()).unwrap();
    let (exact, _) = forward(&m, CacheMode::parse("fp32").unwrap()).unwrap();
    let worst = max_abs_diff(&reencoded, &exact);
    assert!(worst > 0.0 && worst < 5.0, "{worst}");
    let toks = tokens(24);
    let (logits, s) = paged_run(&m, &toks, &mode);
    let (plain, _) = paged_run(&m, &toks, &CacheMode::parse("fp32").unwrap());
    let worst = max_abs_diff(&logits, &plain);
    assert!(worst > 0.0 && worst < 5.0, "{worst}");
    assert!(s.codebook_bytes > 0);
    let values = CacheMode::parse("fp32/cq-d2-k8-pre")
        .unwrap()
        .with_calibration(Some(cal));
    let e = match kv_eval::backend::paged_backend(&m, &values, None, 4, 8) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("values coded before RoPE"),
    };
    assert!(e.contains("values carry no"), "{e}");
}
