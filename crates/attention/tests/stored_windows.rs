//! The re-encode protocol's registry (`open_window`, `open_window_layer`):
//! a window is the kv-quant or kv-lowrank store of its rows coded whole,
//! bit for bit, and attention over it equals attention over that store
//! (in coefficient space where keys and values are low-rank of one rank);
//! a shard layer is built once at the prefill and extended after; faults
//! are drawn from the seeds given, the fitted tables from their own
//! stream; and bad input is a typed error.

mod common;

use std::sync::Arc;

use attention::stored::{
    Fitted, WindowShape, WindowState, attend_windows, keeps_prefill, open_window, open_window_layer,
};
use attention::{Attention, AttentionOutput, HeadShape, Mask, PreRopeKeys, Rope, RopeLayout};
use attention::{KvSource, ShardLayer};
use gf2_codes::channel::BinarySymmetric;
use kv_lowrank::{HeadBases, LowRankStore};
use kv_quant::{
    CacheForm, FaultTarget, FitOptions, KvStore, NonFinite, QuantizeOptions, VqCodebook,
};

const HEAD_DIM: usize = 64;
const KV_HEADS: usize = 2;
const CH: usize = KV_HEADS * HEAD_DIM;
const TOKENS: usize = 96;

fn shape() -> HeadShape {
    HeadShape::new(4, KV_HEADS, HEAD_DIM).unwrap()
}

fn rope() -> Rope {
    Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap()
}

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.2)
}

fn form(spelling: &str) -> CacheForm {
    spelling.parse().unwrap()
}

fn clamped() -> QuantizeOptions {
    QuantizeOptions {
        non_finite: NonFinite::Clamp,
    }
}

/// A codebook fitted on other rows, for `vq` forms.
fn codebook(form: &CacheForm) -> Fitted {
    let cal = rows(512, 99);
    let cb = VqCodebook::fit(form, &cal, 512, CH, FitOptions::default()).unwrap();
    Fitted {
        codebook: Some(Arc::new(cb)),
        ..Fitted::default()
    }
}

/// Queries at the last `n` positions, RoPE applied.
fn queries(n: usize, tokens: usize) -> (Vec<f32>, Vec<usize>) {
    let ql = shape().q_len();
    let mut q = common::uniform(5, n * ql, 1.0);
    let positions: Vec<usize> = (tokens - n..tokens).collect();
    for (row, &p) in q.chunks_exact_mut(ql).zip(&positions) {
        rope().apply(row, p).unwrap();
    }
    (q, positions)
}

/// Bit for bit (the first differing value reported, not the arrays).
fn same(a: &AttentionOutput, b: &AttentionOutput, what: &str) {
    let first = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits())
            .map(|i| (i, x[i], y[i]))
    };
    assert_eq!(a.out.len(), b.out.len(), "{what}: output lengths");
    assert_eq!(first(&a.out, &b.out), None, "{what}: outputs");
    assert_eq!(first(&a.lse, &b.lse), None, "{what}: log-sum-exps");
    assert_eq!(a.stats, b.stats, "{what}: decode statistics");
}

#[test]
fn kv_quant_windows_are_their_stores_coded_whole() {
    let (k, v) = (rows(TOKENS, 1), rows(TOKENS, 2));
    let attention = Attention::new(shape());
    let (q, pos) = queries(8, TOKENS);
    let shape3 = (TOKENS, CH, HEAD_DIM);
    for spelling in [
        "int4",
        "int4-ch+sink4",
        "int4-ch32+win32",
        "int8+secded84",
        "lm4",
        "int4+rot16",
        "vq+secded84",
    ] {
        let f = form(spelling);
        let fitted = if f.quantizer().needs_codebook() {
            codebook(&f)
        } else {
            Fitted::default()
        };
        let quantize = |rows: &[f32]| match &fitted.codebook {
            Some(cb) => {
                KvStore::quantize_with_codebook(f, rows, TOKENS, CH, clamped(), cb.clone()).unwrap()
            }
            None => KvStore::quantize_with(f, rows, TOKENS, CH, clamped()).unwrap(),
        };
        let (want_k, want_v) = (quantize(&k), quantize(&v));
        let mut wk = open_window(f, &fitted, &k, shape3, Some(&rope())).unwrap();
        let mut wv = open_window(f, &fitted, &v, shape3, None).unwrap();
        assert_eq!(wk.form(), f);
        assert_eq!(wk.tokens(), TOKENS);
        assert_eq!(wk.stored_bytes(), want_k.stored_bytes(), "{spelling}");
        assert_eq!(
            wk.shared_bytes() > 0,
            fitted.codebook.is_some(),
            "{spelling}: a codebook is counted with the window"
        );
        assert!(wk.low_rank().is_none());
        for mask in [Mask::Causal, Mask::SlidingWindow(40)] {
            let got = attend_windows(&attention, &q, &pos, (&wk, &wv), &mask).unwrap();
            let want = attention
                .prefill(&q, &pos, &want_k, &want_v, &mask)
                .unwrap();
            same(&got, &want, spelling);
        }
        assert!(*wk.rows_mut().unwrap() == want_k, "{spelling}: keys");
        assert!(*wv.rows_mut().unwrap() == want_v, "{spelling}: values");
    }
}

#[test]
fn low_rank_windows_read_in_coefficient_space_or_through_the_kernels() {
    let (k, v) = (rows(TOKENS, 3), rows(TOKENS, 4));
    let attention = Attention::new(shape());
    let (q, pos) = queries(6, TOKENS);
    let shape3 = (TOKENS, CH, HEAD_DIM);
    let build = |f: CacheForm, rows: &[f32]| {
        LowRankStore::build(f, rows, TOKENS, CH, HEAD_DIM, None).unwrap()
    };
    let none = Fitted::default();
    // Equal ranks, keys after RoPE: coefficient space (bases fitted on
    // the window, online).
    let f = form("fd-r8");
    let (wk, wv) = (
        open_window(f, &none, &k, shape3, Some(&rope())).unwrap(),
        open_window(f, &none, &v, shape3, None).unwrap(),
    );
    let (sk, sv) = (build(f, &k), build(f, &v));
    assert_eq!(wk.stored_bytes(), sk.stored_bytes());
    assert_eq!(
        wk.shared_bytes(),
        0,
        "bases fitted on the window are its own"
    );
    let got = attend_windows(&attention, &q, &pos, (&wk, &wv), &Mask::Causal).unwrap();
    let want = attention
        .attend_low_rank(&q, &pos, &sk, &sv, &Mask::Causal)
        .unwrap();
    same(&got, &want, "fd-r8");
    // Unequal ranks: through the kernels on rebuilt rows.
    let fv = form("fd-r4");
    let wv4 = open_window(fv, &none, &v, shape3, None).unwrap();
    let got = attend_windows(&attention, &q, &pos, (&wk, &wv4), &Mask::Causal).unwrap();
    let want = attention
        .prefill(&q, &pos, &sk, &build(fv, &v), &Mask::Causal)
        .unwrap();
    same(&got, &want, "fd-r8/fd-r4");
    // Keys projected before RoPE: coded on the rows rotated back to
    // position 0, rotated again on the way to the kernels.
    let fp = form("fd-r8-pre");
    let r = rope();
    let mut unrotated = k.clone();
    for (t, row) in unrotated.chunks_exact_mut(CH).enumerate() {
        r.undo(row, t).unwrap();
    }
    let spk = build(fp, &unrotated);
    let wpk = open_window(fp, &none, &k, shape3, Some(&r)).unwrap();
    assert_eq!(wpk.source().tokens(), TOKENS);
    let got = attend_windows(&attention, &q, &pos, (&wpk, &wv), &Mask::Causal).unwrap();
    let want = attention
        .prefill(&q, &pos, &PreRopeKeys::new(&spk, &r, 0), &sv, &Mask::Causal)
        .unwrap();
    same(&got, &want, "fd-r8-pre keys");
    // Values carry no RoPE: a layer refuses a `-pre` value form (the
    // protocol once rotated such values back to position 0 and read them
    // so, which no table of the READMEs ran); a value window opened
    // without a RoPE is coded as given, and one rotated back is refused.
    let layer_shape = WindowShape {
        tokens: TOKENS,
        prefill: TOKENS,
        channels: CH,
        head_dim: HEAD_DIM,
    };
    let both_pre = open_window_layer(
        [(fp, &none), (fp, &none)],
        &mut WindowState::default(),
        (&k, &v),
        layer_shape,
        Some(&r),
    );
    assert!(both_pre.is_err());
    let wpv = open_window(fp, &none, &v, shape3, None).unwrap();
    assert!(!wpv.rotated_back() && wpk.rotated_back());
    let got = attend_windows(&attention, &q, &pos, (&wpk, &wpv), &Mask::Causal).unwrap();
    let want = attention
        .prefill(
            &q,
            &pos,
            &PreRopeKeys::new(&spk, &r, 0),
            &build(fp, &v),
            &Mask::Causal,
        )
        .unwrap();
    same(&got, &want, "fd-r8-pre keys and values");
    let rotated = open_window(fp, &none, &v, shape3, Some(&r)).unwrap();
    assert!(attend_windows(&attention, &q, &pos, (&wpk, &rotated), &Mask::Causal).is_err());
    // Calibrated bases: read, not owned, and counted with the window.
    let fc = form("pca-r8+secded84");
    let bases = calibrated_bases();
    let fitted = Fitted {
        bases: Some(bases.clone()),
        ..Fitted::default()
    };
    let wc = open_window(fc, &fitted, &v, shape3, None).unwrap();
    let sc = LowRankStore::build(fc, &v, TOKENS, CH, HEAD_DIM, Some(&bases)).unwrap();
    assert_eq!(wc.stored_bytes(), sc.stored_bytes());
    // RM(2,5) under SECDED: two check bytes per 16-bit word.
    assert_eq!(wc.shared_bytes(), 2 * bases.stored_bytes());
    let got = attend_windows(&attention, &q, &pos, (&wk, &wc), &Mask::Causal).unwrap();
    let want = attention
        .attend_low_rank(&q, &pos, &sk, &sc, &Mask::Causal)
        .unwrap();
    same(&got, &want, "fd-r8/pca-r8 calibrated, equal ranks");
}

/// Rank-8 bases per head fitted on other rows.
fn calibrated_bases() -> Arc<HeadBases> {
    common::fitted_bases(&rows(512, 99), KV_HEADS, HEAD_DIM, 8)
}

/// Keys with RoPE applied, near a low-rank subspace (what Shard fits).
fn shard_rows(tokens: usize) -> (Vec<f32>, Vec<f32>) {
    let r = rope();
    let mut k = common::structured_rows(tokens, CH, 21, 0.05);
    for (t, row) in k.chunks_exact_mut(CH).enumerate() {
        r.apply(row, t).unwrap();
    }
    (k, rows(tokens, 22))
}

#[test]
fn a_shard_layer_is_fitted_at_the_prefill_and_extended_after() {
    let f = form("shard-k2-g4+win32");
    assert!(keeps_prefill(f) && !keeps_prefill(form("int4-ch")));
    let (prefill, tokens) = (64, 80);
    let (k, v) = shard_rows(tokens);
    let r = rope();
    let attention = Attention::new(shape());
    let none = Fitted::default();
    let shape_at = |t: usize| WindowShape {
        tokens: t,
        prefill,
        channels: CH,
        head_dim: HEAD_DIM,
    };
    let rows_at = |t: usize| (&k[..t * CH], &v[..t * CH]);
    let fitted = ShardLayer::build(
        f,
        &k[..prefill * CH],
        &v[..prefill * CH],
        prefill,
        prefill,
        &r,
    )
    .unwrap();
    let mut state = WindowState::default();
    for t in [prefill, 72, tokens] {
        let layer = open_window_layer(
            [(f, &none), (f, &none)],
            &mut state,
            rows_at(t),
            shape_at(t),
            Some(&r),
        )
        .unwrap();
        let want_layer = fitted.extended(rows_at(t).0, rows_at(t).1, t).unwrap();
        let (q, pos) = queries(4, t);
        let got = layer.attend(&attention, &q, &pos, &Mask::Causal).unwrap();
        let want = want_layer
            .attend(&attention, &q, &pos, &Mask::Causal)
            .unwrap();
        same(&got, &want, &format!("{t} tokens"));
        let bytes = layer.bytes();
        assert_eq!(bytes.total, want_layer.bytes().total() as u64);
        assert!(bytes.parts[0] + bytes.parts[1] <= bytes.total);
        assert_eq!(layer.low_rank(), [None, None]);
    }
    // A rolled-back step leaves the prefill's layer to grow from again.
    state.rollback();
    let layer = open_window_layer(
        [(f, &none), (f, &none)],
        &mut state,
        rows_at(70),
        shape_at(70),
        Some(&r),
    )
    .unwrap();
    let (q, pos) = queries(4, 70);
    let want = fitted
        .extended(rows_at(70).0, rows_at(70).1, 70)
        .unwrap()
        .attend(&attention, &q, &pos, &Mask::Causal)
        .unwrap();
    same(
        &layer.attend(&attention, &q, &pos, &Mask::Causal).unwrap(),
        &want,
        "after a rollback",
    );
}

#[test]
fn faults_come_from_the_seeds_given_and_tables_from_their_own_stream() {
    let f = form("vq+secded84");
    let fitted = codebook(&f);
    let (k, v) = (rows(TOKENS, 7), rows(TOKENS, 8));
    let shape = WindowShape {
        tokens: TOKENS,
        prefill: TOKENS,
        channels: CH,
        head_dim: HEAD_DIM,
    };
    let open = || {
        open_window_layer(
            [(f, &fitted), (f, &fitted)],
            &mut WindowState::default(),
            (&k, &v),
            shape,
            None,
        )
        .unwrap()
    };
    let channel = BinarySymmetric::new(2e-3).unwrap();
    let attention = Attention::new(self::shape());
    let (q, pos) = queries(4, TOKENS);
    let read =
        |l: &attention::stored::WindowLayer| l.attend(&attention, &q, &pos, &Mask::Causal).unwrap();
    let clean = open();
    let bytes = clean.bytes();
    assert_eq!(bytes.total, bytes.parts[0] + bytes.parts[1]);
    assert!(bytes.shared > 0, "the codebook is counted");
    // The same seeds flip the same bits; other seeds other bits.
    let (mut a, mut b, mut c) = (open(), open(), open());
    let hit_a = a.inject(&channel, [1, 2], FaultTarget::Everything).unwrap();
    let hit_b = b.inject(&channel, [1, 2], FaultTarget::Everything).unwrap();
    c.inject(&channel, [3, 4], FaultTarget::Everything).unwrap();
    assert_eq!(hit_a, hit_b);
    assert!(hit_a.flips > 0 && hit_a.tables.words > 0);
    same(&read(&a), &read(&b), "same seeds");
    assert_ne!(read(&a).stats, read(&c).stats, "other seeds");
    // Values only: no table is touched; the tables alone: their flips.
    let mut d = open();
    let values = d.inject(&channel, [1, 2], FaultTarget::Values).unwrap();
    assert_eq!(values.tables, Default::default());
    let mut e = open();
    let tables = e
        .inject_tables(&channel, [1, 2], FaultTarget::Everything)
        .unwrap();
    assert_eq!(tables.tables, hit_a.tables);
    assert!(tables.flips < hit_a.flips);
    assert_eq!(read(&e).stats, read(&clean).stats, "rows untouched");
    // Row by row, the stores are the caller's.
    let [sk, _] = e.rows_mut().unwrap();
    assert_eq!(sk.tokens(), TOKENS);
}

#[test]
fn bad_windows_are_refused() {
    let none = Fitted::default();
    let (k, v) = (rows(TOKENS, 9), rows(TOKENS, 10));
    let shape3 = (TOKENS, CH, HEAD_DIM);
    let shard = form("shard-k2-g4+win32");
    // A shard form keeps state: not a window.
    assert!(open_window(shard, &none, &k, shape3, Some(&rope())).is_err());
    // A vq form without its codebook.
    assert!(open_window(form("vq"), &none, &k, shape3, None).is_err());
    // Rows that are not tokens × channels.
    assert!(open_window(form("int4"), &none, &k[..CH + 1], shape3, None).is_err());
    let shape = WindowShape {
        tokens: TOKENS,
        prefill: TOKENS,
        channels: CH,
        head_dim: HEAD_DIM,
    };
    let mut state = WindowState::default();
    let mut open = |forms: [CacheForm; 2], rope: Option<&Rope>| {
        open_window_layer(
            [(forms[0], &none), (forms[1], &none)],
            &mut state,
            (&k, &v),
            shape,
            rope,
        )
    };
    // Shard keys and values are one form, and undo RoPE.
    assert!(open([shard, form("int4")], Some(&rope())).is_err());
    assert!(open([shard, shard], None).is_err());
    // Low-rank and shard layers take faults on the whole layer only.
    let mut low_rank = open([form("fd-r8"), form("int4")], None).unwrap();
    assert!(low_rank.rows_mut().is_err());
    let mut kept = open([shard, shard], Some(&rope())).unwrap();
    assert!(kept.rows_mut().is_err());
    let channel = BinarySymmetric::new(1e-3).unwrap();
    assert!(
        kept.inject_tables(&channel, [0, 0], FaultTarget::Metadata)
            .is_err()
    );
}
