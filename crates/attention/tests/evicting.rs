//! `Evicting` against its definition: an eviction that keeps everything
//! changes no bit; one that keeps part reads exactly a cache holding the
//! kept rows of each head; positions stay the model's; misuse is refused.

use attention::{
    Attention, DenseBackend, Evicting, Eviction, HeadShape, KvBackend, Mask, ModelKvShape, SnapKv,
};

const LAYERS: usize = 2;

fn shape() -> HeadShape {
    HeadShape::new(4, 2, 8).unwrap()
}

fn model(shape: &HeadShape) -> ModelKvShape<'_> {
    ModelKvShape {
        layers: LAYERS,
        heads: *shape,
        rope: None,
    }
}

/// Deterministic pseudo-random rows in [-2, 2).
fn rows(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

/// One step of `n` tokens from `first`, as a model runs it: each layer
/// appends its rows and attends its queries; the outputs, layer by layer.
fn step<B: KvBackend>(b: &mut B, first: usize, n: usize) -> Vec<Vec<f32>> {
    let s = shape();
    let attn = Attention::new(s);
    b.begin(&vec![1; n]).map_err(|e| e.to_string()).unwrap();
    let mut outs = Vec::new();
    for layer in 0..LAYERS {
        let seed = (first * 31 + layer) as u64;
        let (k, v) = (
            rows(n * s.kv_channels(), seed),
            rows(n * s.kv_channels(), seed + 7),
        );
        b.append(layer, &k, &v).map_err(|e| e.to_string()).unwrap();
        let q = rows(n * s.q_len(), seed + 13);
        let positions: Vec<usize> = (b.tokens()..b.tokens() + n).collect();
        let out = b
            .attend(layer, &attn, &q, &positions, &Mask::Causal)
            .map_err(|e| e.to_string())
            .unwrap();
        outs.push(out.out);
    }
    b.commit().map_err(|e| e.to_string()).unwrap();
    outs
}

#[test]
fn keeping_every_token_changes_no_bit() {
    let s = shape();
    let mut plain = DenseBackend::new();
    let mut wrapped = Evicting::new(DenseBackend::new(), SnapKv::new(1.0, 4, 3).unwrap()).unwrap();
    plain.fit(&model(&s)).unwrap();
    wrapped.fit(&model(&s)).unwrap();
    for (first, n) in [(0, 10), (10, 7)] {
        assert_eq!(step(&mut plain, first, n), step(&mut wrapped, first, n));
    }
    assert_eq!(
        wrapped.evict().unwrap(),
        Eviction {
            prefill: 17,
            kept: 17
        }
    );
    for (first, n) in [(17, 1), (18, 3)] {
        assert_eq!(step(&mut plain, first, n), step(&mut wrapped, first, n));
    }
    assert_eq!(wrapped.tokens(), 21);
}

#[test]
fn an_eviction_reads_as_a_cache_of_the_kept_rows() {
    let s = shape();
    let (kv, d) = (s.kv_channels(), s.head_dim());
    let policy = SnapKv::new(0.4, 5, 3).unwrap();
    let mut wrapped = Evicting::new(DenseBackend::new(), policy).unwrap();
    wrapped.fit(&model(&s)).unwrap();
    // The prefill in two steps; the window's queries span both.
    let mut prefill_rows = vec![(Vec::new(), Vec::new(), Vec::new()); LAYERS];
    for (first, n) in [(0, 28), (28, 2)] {
        step(&mut wrapped, first, n);
        for (layer, (k, v, q)) in prefill_rows.iter_mut().enumerate() {
            let seed = (first * 31 + layer) as u64;
            k.extend(rows(n * kv, seed));
            v.extend(rows(n * kv, seed + 7));
            q.extend(rows(n * s.q_len(), seed + 13));
        }
    }
    let done = wrapped.evict().unwrap();
    assert_eq!(
        done,
        Eviction {
            prefill: 30,
            kept: 12
        }
    );
    assert_eq!(wrapped.tokens(), 30);
    assert_eq!(wrapped.inner().tokens(), 12);
    // The reference: each layer's kept rows, head by head, in a plain cache.
    let mut reference = DenseBackend::new();
    reference.fit(&model(&s)).unwrap();
    reference.begin(&[0; 12]).unwrap();
    for (layer, (k, v, q)) in prefill_rows.iter().enumerate() {
        let window = &q[25 * s.q_len()..];
        let kept = policy
            .select(&s, window, &(25..30).collect::<Vec<_>>(), k)
            .unwrap();
        let (mut ks, mut vs) = (vec![0.0; 12 * kv], vec![0.0; 12 * kv]);
        for (g, tokens) in kept.iter().enumerate() {
            assert_eq!(tokens.len(), 12);
            assert!(tokens.ends_with(&[25, 26, 27, 28, 29]));
            for (slot, &t) in tokens.iter().enumerate() {
                let (from, to) = (t as usize * kv + g * d, slot * kv + g * d);
                ks[to..to + d].copy_from_slice(&k[from..from + d]);
                vs[to..to + d].copy_from_slice(&v[from..from + d]);
            }
        }
        reference.append(layer, &ks, &vs).unwrap();
    }
    reference.commit().unwrap();
    // Decoding after the eviction: the model's positions 30, 31, ... read
    // as the reference's 12, 13, ...
    let attn = Attention::new(s);
    for p in 30..33 {
        wrapped.begin(&[1]).unwrap();
        reference.begin(&[1]).unwrap();
        for layer in 0..LAYERS {
            let (k, v, q) = (
                rows(kv, p as u64),
                rows(kv, p as u64 + 1),
                rows(s.q_len(), 3),
            );
            wrapped.append(layer, &k, &v).unwrap();
            reference.append(layer, &k, &v).unwrap();
            let got = wrapped
                .attend(layer, &attn, &q, &[p], &Mask::Causal)
                .unwrap();
            let want = reference
                .attend(layer, &attn, &q, &[p - 18], &Mask::Causal)
                .unwrap();
            assert_eq!(got.out, want.out, "position {p}, layer {layer}");
        }
        wrapped.commit().unwrap();
        reference.commit().unwrap();
    }
}

#[test]
fn misuse_is_refused() {
    let s = shape();
    let policy = SnapKv::new(0.5, 4, 1).unwrap();
    let mut b = Evicting::new(DenseBackend::new(), policy).unwrap();
    assert!(
        b.evict()
            .unwrap_err()
            .to_string()
            .contains("nothing written")
    );
    b.fit(&model(&s)).unwrap();
    step(&mut b, 0, 20);
    // A step open: refused, nothing changed.
    b.begin(&[1]).unwrap();
    assert!(b.evict().is_err());
    b.rollback();
    assert_eq!(b.tokens(), 20);
    assert_eq!(
        b.evict().unwrap(),
        Eviction {
            prefill: 20,
            kept: 10
        }
    );
    assert!(b.evict().unwrap_err().to_string().contains("once already"));
    step(&mut b, 20, 3);
    assert!(b.truncate(19).unwrap_err().to_string().contains("evicted"));
    b.truncate(21).unwrap();
    assert_eq!((b.tokens(), b.inner().tokens()), (21, 11));
    // Positions inside the prefill: evicted (3) or moved (15, stored 5).
    let attn = Attention::new(s);
    let q = rows(s.q_len(), 1);
    for p in [3, 15] {
        let e = b.attend(0, &attn, &q, &[p], &Mask::Causal).unwrap_err();
        assert!(e.to_string().contains("prefill"), "{e}");
    }
    // Key ranges in model positions (a self-speculative draft's mask):
    // the whole cache reads as the causal mask does; one starting inside
    // the prefill is refused, and so is a sliding window.
    let causal = b.attend(0, &attn, &q, &[20], &Mask::Causal).unwrap();
    let whole = std::slice::from_ref(&(0..21));
    let ranged = b.attend(0, &attn, &q, &[20], &Mask::Ranges(whole)).unwrap();
    assert_eq!(causal.out, ranged.out);
    let inside = std::slice::from_ref(&(5..21));
    assert!(
        b.attend(0, &attn, &q, &[20], &Mask::Ranges(inside))
            .is_err()
    );
    assert!(
        b.attend(0, &attn, &q, &[20], &Mask::SlidingWindow(4))
            .is_err()
    );
    // Wrapping a cache that holds tokens.
    let mut used = DenseBackend::new();
    used.fit(&model(&s)).unwrap();
    step(&mut used, 0, 2);
    assert!(Evicting::new(used, policy).is_err());
}

#[test]
fn a_layer_that_never_attended_the_window_is_refused() {
    let s = shape();
    let mut b = Evicting::new(DenseBackend::new(), SnapKv::new(0.5, 4, 1).unwrap()).unwrap();
    b.fit(&model(&s)).unwrap();
    b.begin(&[1; 8]).unwrap();
    for layer in 0..LAYERS {
        let k = rows(8 * s.kv_channels(), layer as u64);
        b.append(layer, &k, &k).unwrap();
    }
    b.commit().unwrap();
    let e = b.evict().unwrap_err().to_string();
    assert!(e.contains("eviction window"), "{e}");
    assert_eq!(b.inner().tokens(), 8, "nothing changed");
}

#[test]
fn without_a_policy_every_call_passes_through() {
    let s = shape();
    let mut plain = DenseBackend::new();
    let mut wrapped = Evicting::with_policy(DenseBackend::new(), None).unwrap();
    plain.fit(&model(&s)).unwrap();
    wrapped.fit(&model(&s)).unwrap();
    assert_eq!(step(&mut plain, 0, 9), step(&mut wrapped, 0, 9));
    assert!(
        wrapped
            .evict()
            .unwrap_err()
            .to_string()
            .contains("no policy")
    );
    assert_eq!(step(&mut plain, 9, 2), step(&mut wrapped, 9, 2));
    assert_eq!(wrapped.tokens(), 11);
}
