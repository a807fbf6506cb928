//! `Numerics::Int8Query` and `Int16Query` against the f64 oracle: every
//! score within the bound stated on [`Numerics`], so every output within
//! `max|v|·(e^{2Δ} − 1)` (plus `n·max(a·l) / (2·32767)` for `Int8Query`'s
//! integer value sums over `n` keys) of attention over the dequantized cache, for every
//! integer key layout the integer path takes; and the path is really taken
//! (its outputs differ from the exact path's).

mod common;

use attention::{Attention, HeadShape, Mask, Numerics};
use common::{oracle, uniform};
use kv_quant::{DecodeScratch, KvStore, LevelMap, RowsView};

const FORMS: &[&str] = &[
    "int8",
    "int8-sym-ch",
    "int4",
    "int4-g32",
    "int4-g16",
    "int4-sym-g64",
    "int4-ch",
    "int4-ch64",
    "int4-ch48",
    "int4-t",
    "int3-g32",
    "int2",
    "int4+secded84",
    "int4+secded84+interp",
    "int4-ch+secded84",
    "int4+hamming74",
    "int4+golay24",
    "nf4",
    "nf4-g32",
];

/// NF4 codes are read by the integer paths through their integer image
/// `128 + round(127·level)`, as centred levels of scale `a/127`.
fn nf4_image(code: u8) -> f64 {
    let level = f64::from(kv_quant::NF4_LEVELS[usize::from(code & 15)]);
    128.0 + (127.0 * level).round()
}

/// How far an NF4 code's level is from its image's (`≤ 0.0037`).
fn nf4_image_error(code: u8) -> f64 {
    let level = f64::from(kv_quant::NF4_LEVELS[usize::from(code & 15)]);
    (level - (nf4_image(code) - 128.0) / 127.0).abs()
}

/// A level as the integer paths read it, its scale factor, and its image
/// error (0 for integer levels).
fn as_read(map: LevelMap, level: u8) -> (f64, f64, f64) {
    match map {
        LevelMap::Nf4 => (nf4_image(level), 1.0 / 127.0, nf4_image_error(level)),
        _ => (f64::from(level), 1.0, 0.0),
    }
}

const TOKENS: usize = 333;

/// How far `Int8Query`'s integer value sums can move an output over the
/// `n` keys of `store`: `n·max(a·l)/(2·32767)` (the largest scale times the
/// largest level as read: 255/127 for NF4's image), plus, for NF4, the
/// largest `|a|·ε` of reading a code through its image.
fn value_sum_bound(store: &KvStore, n: usize) -> f64 {
    let mut scratch = DecodeScratch::default();
    let (view, _) = store.decode_rows_view(0, TOKENS, &mut scratch).unwrap();
    let RowsView::Levels(levels) = view else {
        panic!("integer forms read as levels");
    };
    let largest = f64::from(levels.scale.iter().fold(0.0f32, |m, &a| m.max(a.abs())));
    let span = match levels.map {
        LevelMap::Nf4 => largest * 255.0 / 127.0,
        _ => largest * f64::from(levels.max_level()),
    };
    let worst_image = levels
        .levels
        .iter()
        .map(|&l| as_read(levels.map, l).2)
        .fold(0.0, f64::max);
    n as f64 * span / (2.0 * 32767.0) + largest * worst_image
}

/// Per query head, the largest score error the bound allows over the keys:
/// `(s_q/2)·Σ_c |a_g(c)|·l_c` for groups along rows,
/// `(s'/2)·Σ_c |l_c − 2^(bits−1)|` with `s' = max|q_c·a_c| / code_max` for
/// per-channel groups; for NF4,
/// `l_c` is the code's image, `a` its scale over 127, and the image's own
/// error `Σ_c |q_c·a_g(c)|·ε_c` is added.
fn score_bounds(store: &KvStore, q: &[f32], shape: &HeadShape, code_max: f64) -> Vec<f64> {
    let (d, group) = (shape.head_dim(), shape.group());
    let mut scratch = DecodeScratch::default();
    let (view, _) = store.decode_rows_view(0, TOKENS, &mut scratch).unwrap();
    let RowsView::Levels(levels) = view else {
        panic!("integer forms read as levels");
    };
    let cpg = levels.channels_per_group();
    let mut bounds = vec![0.0f64; shape.q_heads()];
    for (h, qh) in q.chunks_exact(d).enumerate() {
        let kvh = h / group;
        for t in 0..TOKENS {
            let g0 = levels.group_index(t, 0);
            let row = &levels.levels[t * levels.channels()..][kvh * d..][..d];
            let bound = if cpg == 1 {
                let a = &levels.scale[g0 + kvh * d..][..d];
                let peak = qh.iter().zip(a).fold(0.0f64, |m, (&q, &a)| {
                    m.max((f64::from(q) * f64::from(a)).abs())
                });
                // Scored against levels centred on 2^(bits−1) (a centred
                // map's middle level).
                let centre = match levels.map {
                    LevelMap::Centered { mid } => f64::from(mid),
                    _ => (f64::from(levels.max_level()) + 1.0) / 2.0,
                };
                let spread: f64 = row.iter().map(|&l| (f64::from(l) - centre).abs()).sum();
                peak / code_max / 2.0 * spread
            } else {
                let peak = qh.iter().fold(0.0f64, |m, &q| m.max(f64::from(q).abs()));
                let (mut weighted, mut image) = (0.0, 0.0);
                for (c, &l) in row.iter().enumerate() {
                    let a = f64::from(levels.scale[g0 + (kvh * d + c) / cpg]).abs();
                    let (level, unit, err) = as_read(levels.map, l);
                    weighted += a * unit * level;
                    image += (f64::from(qh[c]) * a).abs() * err;
                }
                peak / code_max / 2.0 * weighted + image
            };
            bounds[h] = bounds[h].max(bound);
        }
    }
    assert!(matches!(
        levels.map,
        LevelMap::Affine | LevelMap::Centered { .. } | LevelMap::Nf4
    ));
    bounds
}

#[test]
fn int8_queries_stay_within_the_stated_bound_of_the_oracle() {
    for (shape, seed) in [
        (HeadShape::new(9, 3, 64).unwrap(), 1),
        (HeadShape::new(4, 2, 128).unwrap(), 2),
        (HeadShape::new(6, 2, 96).unwrap(), 3),
    ] {
        let ch = shape.kv_channels();
        let k = uniform(seed, TOKENS * ch, 2.0);
        let v = uniform(seed + 10, TOKENS * ch, 1.0);
        let q = uniform(seed + 20, shape.q_len(), 3.0);
        let mut exact = Attention::new(shape);
        exact.set_numerics(Numerics::Exact);
        // The scores use the query scaled by 1/√d, as attention scales it.
        let scaled: Vec<f32> = q
            .iter()
            .map(|&x| (f64::from(x) * shape.scale()) as f32)
            .collect();
        let codings = [
            (Numerics::Int8Query, 127.0),
            (Numerics::Int16Query, 32639.0),
        ];
        for (form, (numerics, code_max)) in FORMS.iter().flat_map(|f| codings.map(|c| (f, c))) {
            let mut fast = exact;
            fast.set_numerics(numerics);
            let (ks, vs) = (
                KvStore::quantize(form.parse().unwrap(), &k, TOKENS, ch).unwrap(),
                KvStore::quantize(form.parse().unwrap(), &v, TOKENS, ch).unwrap(),
            );
            let (kd, vd) = (ks.decode().unwrap().values, vs.decode().unwrap().values);
            let want = oracle(&q, &[TOKENS - 1], &kd, &vd, TOKENS, &shape, &Mask::Causal);
            let got = fast
                .decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            let reference = exact
                .decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            if form.starts_with("nf4") && numerics == Numerics::Int16Query {
                // NF4's integer image is as coarse as int8 query codes: 16-bit
                // codes leave it to the exact path.
                assert_eq!(got.out, reference.out, "{form}: scored exactly");
                continue;
            }
            assert_ne!(
                got.out, reference.out,
                "{numerics:?}, {form}: the integer path was not taken"
            );
            let vmax = vd.iter().fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
            let bounds = score_bounds(&ks, &scaled, &shape, code_max);
            let d = shape.head_dim();
            // Integer value sums (Int8Query): at most n·max(a·l)/(2·32767)
            // over n keys.
            let values = if numerics == Numerics::Int8Query {
                value_sum_bound(&vs, TOKENS)
            } else {
                0.0
            };
            for (h, &delta) in bounds.iter().enumerate() {
                // The output bound, plus the exact path's own 1e-5 tolerance.
                let allowed = vmax * ((2.0 * delta).exp() - 1.0) + values + 1e-5 * vmax;
                let err = got.out[h * d..][..d]
                    .iter()
                    .zip(&want.out[h * d..][..d])
                    .map(|(&a, &b)| (f64::from(a) - b).abs())
                    .fold(0.0, f64::max);
                assert!(
                    err <= allowed,
                    "{numerics:?}, {form} at {shape:?}, head {h}: error {err:.3e} > bound {allowed:.3e} (Δ = {delta:.3e})"
                );
                let lse_err = (f64::from(got.lse[h]) - want.lse[h]).abs();
                assert!(
                    lse_err <= delta + 1e-5 * want.lse[h].abs().max(1.0),
                    "{numerics:?}, {form}, head {h}: log-sum-exp off by {lse_err:.3e} > Δ = {delta:.3e}"
                );
            }
        }
    }
}

#[test]
fn int8_queries_leave_float_forms_exact() {
    let shape = HeadShape::new(4, 2, 64).unwrap();
    let ch = shape.kv_channels();
    let (k, v, q) = (
        uniform(5, TOKENS * ch, 1.0),
        uniform(6, TOKENS * ch, 1.0),
        uniform(7, shape.q_len(), 1.0),
    );
    let mut exact = Attention::new(shape);
    exact.set_numerics(Numerics::Exact);
    let mut fast = exact;
    fast.set_numerics(Numerics::Int8Query);
    // Float forms, and integer groups narrower than the integer path takes.
    for form in ["fp16", "fp8-e4m3", "nf4-g8", "int4-g8"] {
        let f = form.parse().unwrap();
        let (ks, vs) = (
            KvStore::quantize(f, &k, TOKENS, ch).unwrap(),
            KvStore::quantize(f, &v, TOKENS, ch).unwrap(),
        );
        let a = fast
            .decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal)
            .unwrap();
        let b = exact
            .decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal)
            .unwrap();
        assert_eq!(a.out, b.out, "{form}");
    }
}

/// `Numerics::Auto` (the default) is `Int8Query` for 4-bit affine levels
/// in whole-row per-token groups (`int4` and its protected forms) and exact
/// elsewhere, bit for bit, deciding for keys and values separately.
#[test]
fn auto_numerics_pick_by_layout() {
    let shape = HeadShape::new(4, 2, 64).unwrap();
    let ch = shape.kv_channels();
    let (k, v, q) = (
        uniform(8, TOKENS * ch, 1.0),
        uniform(9, TOKENS * ch, 1.0),
        uniform(10, shape.q_len(), 1.0),
    );
    let auto = Attention::new(shape);
    assert_eq!(auto.config().numerics, Numerics::Auto);
    let with = |numerics| {
        let mut a = auto;
        a.set_numerics(numerics);
        a
    };
    let (exact, int8) = (with(Numerics::Exact), with(Numerics::Int8Query));
    let stores = |kf: &str, vf: &str| {
        (
            KvStore::quantize(kf.parse().unwrap(), &k, TOKENS, ch).unwrap(),
            KvStore::quantize(vf.parse().unwrap(), &v, TOKENS, ch).unwrap(),
        )
    };
    // (form, what `Auto` equals); every form here is one the integer path
    // takes, so the two paths differ on each.
    let cases = [
        ("int4-ch256", &exact),
        ("int8-ch64", &exact),
        ("int4", &int8),
        ("int4+secded84", &int8),
        ("int4+golay24", &int8),
        ("int4-g32", &exact),
        ("int4-sym", &exact),
        ("int8", &exact),
        ("int4-ch", &exact),
        ("int4-t", &exact),
        ("nf4", &exact),
    ];
    for (form, like) in cases {
        let (ks, vs) = stores(form, form);
        let run = |a: &Attention| a.decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal).unwrap();
        let (got, want) = (run(&auto), run(like));
        assert_eq!((&got.out, &got.lse), (&want.out, &want.lse), "{form}");
        assert_ne!(run(&exact).out, run(&int8).out, "{form}: both paths taken");
    }
    // Keys and values decided apart: integer scores with f32 value sums,
    // and exact scores with integer value sums, neither pure path.
    // Per-channel blocks of 16 to 128 tokens (sealed paged blocks) are
    // summed as integers, and scored as integers from 32 tokens on (keys
    // in blocks of 16 are scored exactly); over the whole store (333
    // tokens) or in 8-bit levels they are exact on both sides.
    for (kf, vf, exact_scores) in [
        ("int4", "int4-g32", false),
        ("int4-g32", "int4", true),
        ("int4-ch16", "int4-ch128", true),
        ("int4-ch64", "int4-g32", false),
        ("int4-ch32", "int4-g32", false),
    ] {
        let (ks, vs) = stores(kf, vf);
        let run = |a: &Attention| a.decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal).unwrap();
        let mixed = run(&auto);
        assert_ne!(mixed.out, run(&exact).out, "{kf}/{vf}");
        assert_ne!(mixed.out, run(&int8).out, "{kf}/{vf}");
        let like = if exact_scores { &exact } else { &int8 };
        assert_eq!(mixed.lse, run(like).lse, "{kf}/{vf}: the scores' path");
    }
}

/// INT4 values are read packed two per byte by the integer value pass; a
/// tile that pass declines (a scale whose sign a metadata fault flipped: a
/// negative product is outside the weight codes' range) is summed by the
/// f32 pass from the same packed levels, giving what `Exact` gives. The
/// keys are FP16, scored alike by every numerics.
#[test]
fn packed_values_the_integer_pass_declines_take_the_f32_pass() {
    let shape = HeadShape::new(4, 2, 64).unwrap();
    let ch = shape.kv_channels();
    let (k, v, q) = (
        uniform(11, TOKENS * ch, 1.0),
        uniform(12, TOKENS * ch, 1.0),
        uniform(13, shape.q_len(), 1.0),
    );
    let keys = KvStore::quantize("fp16".parse().unwrap(), &k, TOKENS, ch).unwrap();
    let clean = KvStore::quantize("int4".parse().unwrap(), &v, TOKENS, ch).unwrap();
    // The sign bit of the f16 scale (and offset: both buffers) of every
    // 16th row, so that every tile holds one.
    let mut faulted = clean.clone();
    let signs: Vec<u64> = (0..TOKENS as u64)
        .step_by(16)
        .map(|t| t * 16 + 15)
        .collect();
    let flips = gf2_codes::channel::ExactFlips::new(signs);
    faulted.inject(&flips, 0, kv_quant::FaultTarget::Metadata);
    let with = |numerics| {
        let mut a = Attention::new(shape);
        a.set_numerics(numerics);
        a
    };
    for values in [&clean, &faulted] {
        let run = |a: &Attention| {
            a.decode(&q, TOKENS - 1, &keys, values, &Mask::Causal)
                .unwrap()
        };
        let exact = run(&with(Numerics::Exact));
        for numerics in [Numerics::Auto, Numerics::Int8Query] {
            let got = run(&with(numerics));
            assert!(got.out.iter().all(|x| x.is_finite()));
            if std::ptr::eq(values, &faulted) {
                assert_eq!(got.out, exact.out, "{numerics:?}: the f32 value pass");
            } else {
                assert_ne!(got.out, exact.out, "{numerics:?}: the integer value pass");
            }
        }
    }
}
