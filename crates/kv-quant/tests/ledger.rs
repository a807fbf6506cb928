//! The fault ledger is exact: after any sequence of injections, scrubs,
//! row writes and row copies, the bits it records are exactly the bits
//! where the store differs from a twin that got the same writes and no
//! faults, in every buffer. Decode statistics are computed from it, so this
//! is what makes their miscorrected and silent counts true.

use gf2_codes::channel::{BinarySymmetric, Burst, FaultChannel};
use kv_quant::{CacheForm, FaultTarget, KvStore, QuantizeOptions};
use proptest::prelude::*;

const TOKENS: usize = 24;

/// Row-local forms (every operation applies) and two that are not.
const FORMS: [(&str, usize); 12] = [
    ("int4+secded84", 64),
    ("int4+hamming74+interp", 40),
    ("int4+golay24", 33),
    ("int4-g16+secded84", 64),
    ("fp16", 16),
    ("int4", 48),
    ("int4-ch+secded84", 32),
    ("int4+secded84+sink2+win4", 32),
    ("int4+golay24+meta-rm", 33),
    ("nf4-sf32+secded84+meta-rm", 64),
    ("int4+secded84x8+interp", 40),
    ("int4-g16+golay24x8", 64),
];

#[derive(Clone, Debug)]
enum Op {
    Inject {
        seed: u64,
        target: u8,
        burst: bool,
    },
    InjectRows {
        start: usize,
        len: usize,
        seed: u64,
    },
    Scrub,
    ScrubRows {
        start: usize,
        len: usize,
    },
    Write {
        start: usize,
        len: usize,
        phase: u32,
    },
    CopyRows {
        from: usize,
        to: usize,
        len: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<u64>(), 0u8..3, any::<bool>()).prop_map(|(seed, target, burst)| Op::Inject {
            seed,
            target,
            burst
        }),
        (0..TOKENS, 1..8usize, any::<u64>()).prop_map(|(start, len, seed)| Op::InjectRows {
            start,
            len,
            seed
        }),
        Just(Op::Scrub),
        (0..TOKENS, 1..8usize).prop_map(|(start, len)| Op::ScrubRows { start, len }),
        (0..TOKENS, 1..6usize, 0u32..100).prop_map(|(start, len, phase)| Op::Write {
            start,
            len,
            phase
        }),
        (0..TOKENS, 0..TOKENS, 1..6usize).prop_map(|(from, to, len)| Op::CopyRows {
            from,
            to,
            len
        }),
    ]
}

fn rows(tokens: usize, channels: usize, phase: u32) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| ((i / channels) as f32 * 0.07 + (i % channels) as f32 * 0.3 + phase as f32).sin())
        .collect()
}

/// Bit positions where `a` and `b` differ.
fn diff(a: &[u8], b: &[u8]) -> Vec<u64> {
    let mut out = Vec::new();
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let mut d = x ^ y;
        while d != 0 {
            out.push(8 * i as u64 + u64::from(d.trailing_zeros()));
            d &= d - 1;
        }
    }
    out
}

fn check(store: &KvStore, twin: &KvStore, after: &str) -> Result<(), TestCaseError> {
    let l = store.fault_ledger();
    let pairs = [
        (
            "values",
            l.values.positions(),
            diff(store.data(), twin.data()),
        ),
        (
            "scales",
            l.scales.positions(),
            diff(store.scales(), twin.scales()),
        ),
        (
            "offsets",
            l.offsets.positions(),
            diff(store.offsets(), twin.offsets()),
        ),
        (
            "checks",
            l.checks.positions(),
            diff(store.meta_checks(), twin.meta_checks()),
        ),
        (
            "exact",
            l.exact.positions(),
            diff(store.exact_data(), twin.exact_data()),
        ),
    ];
    for (what, recorded, differs) in pairs {
        prop_assert_eq!(recorded, differs.as_slice(), "{} after {}", what, after);
    }
    Ok(())
}

fn clip(start: usize, len: usize) -> std::ops::Range<usize> {
    start..(start + len).min(TOKENS)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn the_ledger_is_exactly_the_difference_from_what_was_written(
        form in 0..FORMS.len(),
        ops in proptest::collection::vec(op(), 1..10),
    ) {
        let (spelling, ch) = FORMS[form];
        let form: CacheForm = spelling.parse().unwrap();
        let local = form.is_row_local();
        let twin = KvStore::quantize(form, &rows(TOKENS, ch, 0), TOKENS, ch).unwrap();
        let mut store = twin.clone();
        let mut twin = twin;
        // A high rate, so words collect several flips and scrubs miscorrect.
        let bsc = BinarySymmetric::new(0.03).unwrap();
        let burst = Burst::new(0.01, 2, 8).unwrap();
        for op in &ops {
            match *op {
                Op::Inject { seed, target, burst: b } => {
                    let target = [FaultTarget::Values, FaultTarget::Metadata, FaultTarget::Everything]
                        [usize::from(target)];
                    let channel: &dyn FaultChannel = if b { &burst } else { &bsc };
                    store.inject(channel, seed, target);
                }
                Op::InjectRows { start, len, seed } if local => {
                    store.inject_rows(clip(start, len), &bsc, seed, FaultTarget::Everything).unwrap();
                }
                Op::Scrub => {
                    store.scrub().unwrap();
                }
                Op::ScrubRows { start, len } if local => {
                    store.scrub_rows(clip(start, len)).unwrap();
                }
                Op::Write { start, len, phase } if local => {
                    let r = clip(start, len);
                    let new = rows(r.len(), ch, phase);
                    store.write_rows(r.start, &new, QuantizeOptions::default()).unwrap();
                    twin.write_rows(r.start, &new, QuantizeOptions::default()).unwrap();
                }
                Op::CopyRows { from, to, len } if local => {
                    let n = len.min(TOKENS - from).min(TOKENS - to);
                    let src = store.rows_to_store(from, n).unwrap();
                    check(&src, &twin.rows_to_store(from, n).unwrap(), "rows_to_store")?;
                    let twin_src = twin.rows_to_store(from, n).unwrap();
                    store.copy_rows_from(to, &src).unwrap();
                    twin.copy_rows_from(to, &twin_src).unwrap();
                }
                _ => continue,
            }
            check(&store, &twin, &format!("{op:?}"))?;
        }
        // The statistics agree with the ledger: nothing recorded, nothing wrong.
        let stats = store.decode().unwrap().stats;
        if store.fault_ledger().total() == 0 {
            prop_assert_eq!(stats.values.miscorrected + stats.values.silent, 0);
            prop_assert_eq!(stats.metadata.miscorrected + stats.metadata.silent, 0);
        }
    }
}
