//! ECC-protected stores: seeded injection, the accounting identity, every
//! one- and two-flip pattern of a SECDED word, the erasure policies (the
//! paper's midpoint and the distance-weighted extension), metadata
//! protection, and tile decoding equal to whole decoding.

use gf2_codes::channel::{BinarySymmetric, ExactFlips, FaultChannel, FaultRng, Flips};
use kv_quant::{CacheForm, DecodeScratch, FaultTarget, KvDecodeStats, KvStore, RowsView};

/// Flips the given positions in the buffer of the `call`-th call only (a
/// metadata injection calls the channel for scales, offsets, checks in turn).
#[derive(Debug)]
struct FlipsInCall {
    call: usize,
    positions: Vec<u64>,
    calls: std::sync::atomic::AtomicUsize,
}

impl FlipsInCall {
    fn new(call: usize, positions: Vec<u64>) -> Self {
        FlipsInCall {
            call,
            positions,
            calls: Default::default(),
        }
    }
}

impl FaultChannel for FlipsInCall {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let call = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let positions = if call == self.call {
            self.positions.clone()
        } else {
            Vec::new()
        };
        ExactFlips::new(positions).inject_with(data, rng)
    }
}

/// A smooth `tokens × channels` matrix (slow drift along tokens, as the
/// paper's smoothness assumption has it) with per-channel offsets.
fn smooth(tokens: usize, channels: usize) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| {
            let (t, c) = ((i / channels) as f32, (i % channels) as f32);
            (0.05 * t + 0.7 * c).sin() * (1.0 + 0.1 * c) + 0.02 * c
        })
        .collect()
}

fn store(spelling: &str, tokens: usize, channels: usize) -> KvStore {
    let form: CacheForm = spelling.parse().unwrap();
    KvStore::quantize(form, &smooth(tokens, channels), tokens, channels).unwrap()
}

#[test]
fn injection_is_reproducible_from_the_seed() {
    let clean = store("int4+secded84+interp", 64, 64);
    let channel = BinarySymmetric::new(1e-2).unwrap();
    let (mut a, mut b, mut c) = (clean.clone(), clean.clone(), clean.clone());
    let ia = a.inject(&channel, 7, FaultTarget::Everything);
    let ib = b.inject(&channel, 7, FaultTarget::Everything);
    assert_eq!(ia, ib);
    assert_eq!(a, b);
    assert_eq!(a.decode().unwrap(), b.decode().unwrap());
    // Value flips do not depend on whether the metadata is hit too.
    let ic = c.inject(&channel, 7, FaultTarget::Values);
    assert_eq!(ic.values, ia.values);
    assert_eq!(ic.metadata(), 0);
    assert_eq!(c.injected_flips(), ic.total() as u64);
    assert_eq!(a.decode().unwrap().injected_flips, ia.total() as u64);
    let mut d = clean.clone();
    assert_ne!(d.inject(&channel, 8, FaultTarget::Everything), ia);
    // Metadata-only injection leaves the values alone.
    let mut e = clean.clone();
    let ie = e.inject(&channel, 7, FaultTarget::Metadata);
    assert!(ie.values.is_empty());
    assert_eq!(e.data(), clean.data());
    assert_eq!(
        (ie.scales.clone(), ie.checks.clone()),
        (ia.scales, ia.checks)
    );
}

/// Every word hit by a flip lands in exactly one of corrected, detected,
/// miscorrected and silent; every word not hit is clean; flips in padding
/// bits belong to no word. Per-weight outcomes follow each code's distance.
#[test]
fn every_flipped_word_is_accounted_for() {
    for spelling in ["int4+hamming74", "int4+secded84", "int4+golay24", "int4"] {
        for channels in [64, 30] {
            for (seed, ber) in [(1, 1e-3), (2, 1e-2), (3, 5e-2)] {
                let clean = store(spelling, 96, channels);
                let mut faulty = clean.clone();
                let injection = faulty.inject(
                    &BinarySymmetric::new(ber).unwrap(),
                    seed,
                    FaultTarget::Values,
                );
                let mut weight = std::collections::BTreeMap::<usize, u32>::new();
                let mut padding = 0;
                for &bit in injection.values.positions() {
                    match faulty.word_of_bit(bit) {
                        Some(w) => *weight.entry(w).or_default() += 1,
                        None => padding += 1,
                    }
                }
                let decoded = faulty.decode().unwrap();
                let s = decoded.stats.values;
                let label = format!("{spelling} ×{channels} ber {ber}");
                assert_eq!(s.words as usize, 96 * faulty.words_per_row(), "{label}");
                let touched = weight.len() as u64;
                assert_eq!(s.clean, s.words - touched, "{label}");
                assert_eq!(
                    s.corrected + s.detected + s.miscorrected + s.silent,
                    touched,
                    "{label}"
                );
                let count = |w: u32| weight.values().filter(|&&x| x == w).count() as u64;
                match spelling {
                    "int4+hamming74" => {
                        assert_eq!((s.corrected, s.detected), (count(1), 0), "{label}")
                    }
                    "int4+secded84" => {
                        assert_eq!(s.corrected, count(1), "{label}");
                        assert!(s.detected >= count(2), "{label}");
                        assert_eq!(decoded.stats.erased_values, s.detected, "{label}");
                    }
                    "int4+golay24" => {
                        assert_eq!(s.corrected, count(1) + count(2) + count(3), "{label}");
                        assert!(s.detected >= count(4), "{label}");
                    }
                    _ => assert_eq!(
                        s.silent, touched,
                        "{label}: every flipped nibble changes its value"
                    ),
                }
                if spelling == "int4+hamming74" && channels == 30 {
                    // 30 values take 210 of the row's 216 bits.
                    assert!(padding > 0 || ber < 1e-2, "{label}: padding bits exist");
                } else if spelling != "int4" || channels != 30 {
                    assert_eq!(padding, 0, "{label}");
                }
                assert_eq!(decoded.stats.metadata.words, 2 * 96, "{label}");
                assert_eq!(decoded.stats.metadata.clean, 2 * 96, "{label}");
            }
        }
    }
}

/// All 8 single and 28 double flips of every SECDED codeword of one token
/// row: singles decode to the clean matrix, doubles erase exactly one value.
#[test]
fn every_one_and_two_flip_pattern_of_a_secded_word() {
    let clean = store("int4+secded84+zero", 3, 16);
    let reference = clean.decode().unwrap();
    let row = clean.row_bytes() as u64;
    for c in 0..16u64 {
        let word = 8 * (row + c); // token 1, channel c
        for a in 0..8 {
            let mut one = clean.clone();
            one.inject(&ExactFlips::new(vec![word + a]), 0, FaultTarget::Values);
            let d = one.decode().unwrap();
            assert_eq!(d.values, reference.values, "bit {a} of word {c}");
            assert_eq!((d.stats.values.corrected, d.stats.erased_values), (1, 0));
            for b in a + 1..8 {
                let mut two = clean.clone();
                two.inject(
                    &ExactFlips::new(vec![word + a, word + b]),
                    0,
                    FaultTarget::Values,
                );
                let d = two.decode().unwrap();
                assert_eq!(
                    (d.stats.values.detected, d.stats.erased_values),
                    (1, 1),
                    "bits {a},{b}"
                );
                assert!(d.is_erased(1, c as usize));
                assert_eq!(d.values[16 + c as usize], 0.0);
                let others_equal = d
                    .values
                    .iter()
                    .zip(&reference.values)
                    .enumerate()
                    .all(|(i, (x, y))| i == 16 + c as usize || x == y);
                assert!(others_equal);
            }
        }
    }
}

/// Flip two bits of the SECDED word of `(token, channel)` in every listed cell.
fn erase(store: &mut KvStore, cells: &[(usize, usize)]) {
    let positions: Vec<u64> = cells
        .iter()
        .flat_map(|&(t, c)| {
            let base = 8 * (t * store.row_bytes() + c) as u64;
            [base + 1, base + 5] // data bit 1 and Hamming parity bit p1: detected
        })
        .collect();
    store.inject(&ExactFlips::new(positions), 0, FaultTarget::Values);
}

#[test]
fn erasure_policies_do_what_they_say() {
    let (tokens, channels) = (12, 8);
    let mut results = Vec::new();
    for policy in ["keep", "zero", "interp", "interp1"] {
        let clean = store(&format!("int4+secded84+{policy}"), tokens, channels);
        let v = clean.decode().unwrap().values;
        let at = |t: usize, c: usize| v[t * channels + c];
        let mut faulty = clean.clone();
        // Isolated (5,2); boundaries (0,3) and (11,4); a run (7,6),(8,6); a run of three (2,1..=3 tokens).
        let cells = [
            (5, 2),
            (0, 3),
            (11, 4),
            (7, 6),
            (8, 6),
            (1, 1),
            (2, 1),
            (3, 1),
        ];
        erase(&mut faulty, &cells);
        let d = faulty.decode().unwrap();
        assert_eq!(d.stats.erased_values, cells.len() as u64);
        let got = |t: usize, c: usize| d.values[t * channels + c];
        match policy {
            "keep" => {
                // The received data bits are used as they are: data bit 1 flipped.
                let (s, o) = clean.group_params(5).unwrap();
                let level = ((at(5, 2) - o) / s).round() as u8;
                assert_eq!(got(5, 2), o + f32::from(level ^ 2) * s);
            }
            "zero" => assert!(cells.iter().all(|&(t, c)| got(t, c) == 0.0)),
            "interp" => {
                assert_eq!(
                    got(5, 2),
                    0.5 * (at(4, 2) + at(6, 2)),
                    "the paper's midpoint (eq. 29)"
                );
                assert_eq!(
                    got(0, 3),
                    at(1, 3),
                    "left boundary clamps to the right neighbour"
                );
                assert_eq!(
                    got(11, 4),
                    at(10, 4),
                    "right boundary clamps to the left neighbour"
                );
                assert_eq!(
                    got(7, 6),
                    (2.0 * at(6, 6) + at(9, 6)) / 3.0,
                    "distance-weighted"
                );
                assert_eq!(
                    got(8, 6),
                    (at(6, 6) + 2.0 * at(9, 6)) / 3.0,
                    "distance-weighted"
                );
                assert_eq!(got(2, 1), 0.5 * (at(0, 1) + at(4, 1)));
            }
            _ => {
                // Reach 1: the middle of the run of three has no valid neighbour.
                assert_eq!(got(2, 1), 0.0);
                assert_eq!(got(1, 1), at(0, 1));
                assert_eq!(got(5, 2), 0.5 * (at(4, 2) + at(6, 2)));
            }
        }
        let untouched = (0..tokens * channels)
            .filter(|i| !cells.contains(&(i / channels, i % channels)))
            .all(|i| d.values[i] == v[i]);
        assert!(untouched, "{policy}");
        results.push(d.values);
    }
    assert_ne!(results[0], results[2]);
}

#[test]
fn metadata_faults_are_corrected_detected_or_counted() {
    let (tokens, channels) = (6, 16);
    let clean = store("int4-g8+secded84+interp+meta-secded", tokens, channels);
    let reference = clean.decode().unwrap();
    // One flip in scale 4 (token 2, channels 0..8): corrected, values intact.
    let mut one = clean.clone();
    let bit = 8 * 2 * 4 + 9;
    one.inject(&FlipsInCall::new(0, vec![bit]), 0, FaultTarget::Metadata);
    let d = one.decode().unwrap();
    assert_eq!(d.values, reference.values);
    assert_eq!(
        (d.stats.metadata.corrected, d.stats.metadata.detected),
        (1, 0)
    );
    // Two flips in it: detected, the whole group erased and interpolated.
    let mut two = clean.clone();
    two.inject(
        &FlipsInCall::new(0, vec![bit, bit + 2]),
        0,
        FaultTarget::Metadata,
    );
    let d = two.decode().unwrap();
    assert_eq!(d.stats.metadata.detected, 1);
    assert_eq!(d.stats.erased_values, 8);
    for c in 0..8 {
        assert!(d.is_erased(2, c));
        let expect = 0.5 * (reference.values[channels + c] + reference.values[3 * channels + c]);
        assert_eq!(d.values[2 * channels + c], expect);
    }
    // Unprotected metadata: the same flip changes the group silently.
    let clean_raw = store("int4-g8+secded84+interp+meta-none", tokens, channels);
    let mut raw = clean_raw.clone();
    raw.inject(&FlipsInCall::new(0, vec![bit]), 0, FaultTarget::Metadata);
    let d = raw.decode().unwrap();
    assert_eq!((d.stats.metadata.silent, d.stats.erased_values), (1, 0));
    assert_ne!(d.values, reference.values);
}

/// Under `keep` a detected value codeword stays as received, but a group
/// whose scale was erased has no value to keep: it is interpolated from
/// its neighbours along the tokens, as under `+interp`.
#[test]
fn keep_interpolates_groups_whose_metadata_was_erased() {
    let (tokens, channels) = (6, 16);
    for form in [
        "int4-g8+secded84+meta-secded",
        "int4-g8+golay24+meta-secded",
    ] {
        let clean = store(form, tokens, channels);
        let reference = clean.decode().unwrap();
        let mut two = clean.clone();
        let bit = 8 * 2 * 4 + 9;
        two.inject(
            &FlipsInCall::new(0, vec![bit, bit + 2]),
            0,
            FaultTarget::Metadata,
        );
        let d = two.decode().unwrap();
        assert_eq!(d.stats.metadata.detected, 1, "{form}");
        assert_eq!(d.stats.erased_values, 8, "{form}");
        for c in 0..channels {
            let expect = if c < 8 {
                0.5 * (reference.values[channels + c] + reference.values[3 * channels + c])
            } else {
                reference.values[2 * channels + c]
            };
            assert_eq!(d.values[2 * channels + c], expect, "{form} channel {c}");
        }
        // Rows of the other tokens untouched.
        let others = (0..tokens * channels)
            .filter(|i| i / channels != 2)
            .all(|i| d.values[i] == reference.values[i]);
        assert!(others, "{form}");
        // The fused tile view reads the same values.
        let mut scratch = kv_quant::DecodeScratch::new();
        let (view, _) = two.decode_rows_view(0, tokens, &mut scratch).unwrap();
        match view {
            kv_quant::RowsView::Values(v) => assert_eq!(v, &d.values[..], "{form}"),
            _ => panic!("{form}: a tile with erased values is read as values"),
        }
    }
}

/// Under RM(2,5) metadata a scale survives three flips and a fourth is
/// detected: the group is erased and interpolated instead of changed.
#[test]
fn rm_metadata_corrects_three_flips_and_detects_four() {
    let (tokens, channels) = (6, 16);
    let clean = store("int4-g8+secded84+interp+meta-rm", tokens, channels);
    let reference = clean.decode().unwrap();
    // Scale 4 (token 2, channels 0..8): its bits start at 16·4, its check
    // word's at 16·4 in the check buffer (two bytes per word).
    let base = 16 * 4;
    let mut three = clean.clone();
    let flips = FlipsPerCall {
        positions: vec![vec![base + 3, base + 10, base + 14], Vec::new(), Vec::new()],
        calls: Default::default(),
    };
    three.inject(&flips, 0, FaultTarget::Metadata);
    let d = three.decode().unwrap();
    assert_eq!(d.values, reference.values);
    assert_eq!(
        (d.stats.metadata.corrected, d.stats.metadata.detected),
        (1, 0)
    );
    let mut four = clean.clone();
    let flips = FlipsPerCall {
        positions: vec![
            vec![base + 3, base + 10, base + 14],
            Vec::new(),
            vec![base + 5],
        ],
        calls: Default::default(),
    };
    four.inject(&flips, 0, FaultTarget::Metadata);
    let d = four.decode().unwrap();
    assert_eq!(d.stats.metadata.detected, 1);
    assert_eq!(d.stats.erased_values, 8);
    for c in 0..8 {
        let expect = 0.5 * (reference.values[channels + c] + reference.values[3 * channels + c]);
        assert_eq!(d.values[2 * channels + c], expect);
    }
    // The bytes: two check bytes per scale and per offset.
    assert_eq!(clean.meta_checks().len(), 2 * 2 * tokens * channels / 8);
}

/// Flips the given positions in the buffer of each call (scales, offsets,
/// checks for a metadata injection).
#[derive(Debug)]
struct FlipsPerCall {
    positions: Vec<Vec<u64>>,
    calls: std::sync::atomic::AtomicUsize,
}

impl FaultChannel for FlipsPerCall {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let call = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ExactFlips::new(self.positions.get(call).cloned().unwrap_or_default())
            .inject_with(data, rng)
    }
}

/// A metadata error the code cannot see (flips that make another valid
/// codeword) that decodes to a NaN, infinite or negative scale, or to a
/// finite scale or offset outside the range the store's writers wrote,
/// erases its group, which interpolation rebuilds, instead of spreading
/// non-finite or blown-up values; one inside the range is a bounded error
/// and is read as it is. The ledger counts every such word as silent.
#[test]
fn implausible_protected_parameters_are_erased() {
    let (tokens, channels) = (6, 16);
    let clean = store("int4-g8+secded84+interp+meta-secded", tokens, channels);
    let reference = clean.decode().unwrap();
    let bound = clean.param_bound();
    let code = kv_quant::MetaCode::f16();
    let g = 4; // token 2, channels 0..8
    let groups = tokens * channels / 8;
    let word = |buffer: &[u8]| u32::from(u16::from_le_bytes([buffer[2 * g], buffer[2 * g + 1]]));
    let (scale, offset) = (word(clean.scales()), word(clean.offsets()));
    let f16 = |x: f32| u32::from(half::f16::from_f32(x).to_bits());
    let (s, o) = clean.group_params(g).unwrap();
    // (is the offset, written word, erased)
    let cases = [
        (false, 0x7c00, true),                  // +∞
        (false, 0xfe00, true),                  // NaN
        (false, 0xbc00, true),                  // −1.0
        (false, scale ^ 0x4000, true),          // the top exponent bit: ×2^16
        (false, f16(bound.scale * 1.01), true), // just above every written scale
        (false, f16(s * 0.5), false),           // a smaller scale: bounded
        (true, offset ^ 0x4000, true),
        (true, f16(-bound.offset * 1.01), true),
        (true, f16(o * 0.5), false),
    ];
    for (is_offset, target, erased) in cases {
        let orig = if is_offset { offset } else { scale };
        let bits = |d: u32, base: u64| -> Vec<u64> {
            (0..32)
                .filter(|b| d >> b & 1 == 1)
                .map(|b| base + b)
                .collect()
        };
        let word_flips = bits(orig ^ target, 16 * g as u64);
        let check = if is_offset { groups + g } else { g };
        let check_flips = bits(code.check(orig) ^ code.check(target), 8 * check as u64);
        let flips = FlipsPerCall {
            positions: if is_offset {
                vec![Vec::new(), word_flips, check_flips]
            } else {
                vec![word_flips, Vec::new(), check_flips]
            },
            calls: Default::default(),
        };
        let mut hit = clean.clone();
        hit.inject(&flips, 0, FaultTarget::Metadata);
        let d = hit.decode().unwrap();
        let what = format!(
            "{} {target:#06x}",
            if is_offset { "offset" } else { "scale" }
        );
        assert_eq!(d.stats.metadata.silent, 1, "{what}");
        assert_eq!(d.stats.erased_values, if erased { 8 } else { 0 }, "{what}");
        for c in 0..8 {
            assert_eq!(d.is_erased(2, c), erased, "{what}");
            if erased {
                let expect =
                    0.5 * (reference.values[channels + c] + reference.values[3 * channels + c]);
                assert_eq!(d.values[2 * channels + c], expect, "{what}");
            }
        }
        assert!(d.values.iter().all(|v| v.is_finite()), "{what}");
    }
}

/// Decoding in tiles of any sizes gives the bits and the statistics of one
/// whole decode, with faults in values and metadata, for every kind of form.
#[test]
fn tiles_decode_exactly_like_the_whole_matrix() {
    let channel = BinarySymmetric::new(2e-2).unwrap();
    for (spelling, channels) in [
        ("int4+secded84+interp", 64),
        ("int4+secded84+interp", 30),
        ("int4+secded84x8+interp", 30),
        ("int4+secded84x8", 64),
        ("int4-g16+golay24x8+interp", 64),
        ("int4+hamming74+zero", 40),
        ("int4-ch5+golay24+interp", 33),
        ("int4-sym-g16+golay24+interp3", 64),
        ("nf4-g16+secded84+interp", 64),
        ("int4-t+secded84+keep", 16),
        ("int4-g8", 64),
        ("int3-ch", 24),
        ("fp8-e4m3-h8", 32),
        ("fp16", 8),
    ] {
        let tokens = 41;
        let clean = store(spelling, tokens, channels);
        for seed in 0..3 {
            let mut faulty = clean.clone();
            faulty.inject(&channel, seed, FaultTarget::Everything);
            let whole = faulty.decode().unwrap();
            let mut rng = FaultRng::new(seed);
            let mut scratch = DecodeScratch::new();
            let (mut start, mut stats, mut values) = (0, KvDecodeStats::default(), Vec::new());
            while start < tokens {
                let count = (1 + rng.below(9) as usize).min(tokens - start);
                let mut out = vec![f32::NAN; count * channels];
                stats += faulty
                    .decode_rows_into(start, count, &mut out, &mut scratch)
                    .unwrap();
                values.extend(out);
                start += count;
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&values), bits(&whole.values), "{spelling} seed {seed}");
            assert_eq!(stats, whole.stats, "{spelling} seed {seed}");
        }
    }
}

/// The paper's effect in miniature: at BER 1e-2 SECDED with interpolation
/// stays much closer to the clean cache than unprotected INT4.
#[test]
fn protection_reduces_the_damage_of_faults() {
    let (tokens, channels) = (256, 64);
    let channel = BinarySymmetric::new(1e-2).unwrap();
    let error = |spelling: &str| {
        let clean = store(spelling, tokens, channels);
        let reference = clean.decode().unwrap().values;
        let mut faulty = clean.clone();
        faulty.inject(&channel, 11, FaultTarget::Everything);
        let v = faulty.decode().unwrap().values;
        v.iter()
            .zip(&reference)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
    };
    let (plain, hamming, secded, interp, golay) = (
        error("int4"),
        error("int4+hamming74"),
        error("int4+secded84"),
        error("int4+secded84+interp"),
        error("int4+golay24"),
    );
    assert!(hamming < plain / 5.0, "hamming {hamming} vs plain {plain}");
    assert!(interp < secded, "interp {interp} vs keep {secded}");
    assert!(golay < hamming, "golay {golay} vs hamming {hamming}");
}

/// `decode_rows_view` gives the values and statistics of `decode_rows_into`
/// for every form, clean and faulted: levels where no value is erased,
/// values otherwise.
#[test]
fn row_views_equal_decoded_rows() {
    let channel = BinarySymmetric::new(3e-3).unwrap();
    for spelling in [
        "int4",
        "int4-ch",
        "int4-g16",
        "int8",
        "int4-sym-g32",
        "int8-sym-t",
        "int2",
        "int4+secded84",
        "int4+secded84+interp",
        "int4+hamming74+zero",
        "int4+golay24",
        "fp8-e4m3",
        "nf4",
        "fp16",
        // Lloyd-Max codebooks: levels in the store's rotated coordinates,
        // so compared with the rotated decode; with QJL, values.
        "lm4",
        "lm3",
        "lm4+secded84",
        "lm3+qjl",
    ] {
        let (tokens, channels) = (70, 64);
        let clean = store(spelling, tokens, channels);
        let mut faulted = clean.clone();
        faulted.inject(&channel, 11, FaultTarget::Everything);
        let (mut levels_seen, mut erased_seen) = (false, false);
        // Compared by bits: faulted FP8 codes decode to NaN.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for s in [&clean, &faulted] {
            let (mut a, mut b) = (DecodeScratch::default(), DecodeScratch::default());
            for (start, count) in [(0, 64), (64, 6), (5, 33)] {
                let mut want = vec![0.0; count * channels];
                let want_stats = s
                    .decode_rows_rotated_into(start, count, &mut want, &mut a)
                    .unwrap();
                let (view, stats) = s.decode_rows_view(start, count, &mut b).unwrap();
                assert_eq!(stats, want_stats, "{spelling} {start}+{count}");
                erased_seen |= stats.erased_values > 0;
                let got = match view {
                    RowsView::Values(v) => v.to_vec(),
                    RowsView::Levels(l) => {
                        levels_seen = true;
                        assert_eq!(l.rows(), count);
                        let mut out = vec![f32::NAN; count * channels];
                        l.dequantize_into(&mut out);
                        for (i, &x) in out.iter().enumerate() {
                            let v = l.value(i / channels, i % channels);
                            assert_eq!(v.to_bits(), x.to_bits(), "{spelling} value {i}");
                        }
                        // A sub-view holds the same values.
                        let (first, n) = (count / 3, count - count / 3);
                        let mut part = vec![f32::NAN; n * channels];
                        l.sub_rows(first, n).dequantize_into(&mut part);
                        assert_eq!(bits(&part), bits(&out[first * channels..]));
                        out
                    }
                };
                assert_eq!(bits(&got), bits(&want), "{spelling} {start}+{count}");
            }
        }
        // Integer, FP8, NF4 and Lloyd-Max codes come back as levels; FP16
        // and QJL forms as values.
        let coded = !spelling.starts_with("fp16") && !spelling.contains("qjl");
        assert_eq!(levels_seen, coded, "{spelling}: levels returned");
        // The detecting codes met erasures, so their value path ran too.
        if spelling.contains("secded") {
            assert!(erased_seen, "{spelling}: no erasure at this error rate");
        }
    }
    let s = store("int4", 8, 16);
    assert!(
        s.decode_rows_view(4, 5, &mut DecodeScratch::default())
            .is_err()
    );
    assert!(
        s.decode_rows_view(0, 0, &mut DecodeScratch::default())
            .is_err()
    );
}

#[test]
fn interpolation_reads_only_the_rows_it_is_limited_to() {
    let (tokens, channels) = (12, 8);
    let clean = store("int4+secded84+interp", tokens, channels);
    let v = clean.decode().unwrap().values;
    let at = |t: usize, c: usize| v[t * channels + c];
    let mut faulty = clean.clone();
    // (4, 2) sits on the first row of "block" 4..8, (7, 5) on its last.
    erase(&mut faulty, &[(4, 2), (7, 5)]);
    let mut out = vec![0.0; 4 * channels];
    let mut scratch = DecodeScratch::new();
    faulty
        .decode_rows_into(4, 4, &mut out, &mut scratch)
        .unwrap();
    assert_eq!(out[2], 0.5 * (at(3, 2) + at(5, 2)), "unlimited: both sides");
    assert_eq!(out[3 * channels + 5], 0.5 * (at(6, 5) + at(8, 5)));
    scratch.limit_neighbours(Some(4..8));
    faulty
        .decode_rows_into(4, 4, &mut out, &mut scratch)
        .unwrap();
    assert_eq!(
        out[2],
        at(5, 2),
        "limited: the row before the block is not read"
    );
    assert_eq!(out[3 * channels + 5], at(6, 5), "nor the row after it");
    // A limit narrower than the rows decoded still lets them see each other.
    scratch.limit_neighbours(Some(5..6));
    faulty
        .decode_rows_into(4, 4, &mut out, &mut scratch)
        .unwrap();
    assert_eq!(out[2], at(5, 2));
}

/// A block limit (a paged cache's aligned blocks, several in one tile)
/// keeps interpolation inside the erased row's block, for `+interp` and for
/// a metadata-erased group under `keep`.
#[test]
fn interpolation_stays_inside_the_rows_block() {
    let (tokens, channels) = (12, 16);
    for form in [
        "int4-g8+secded84+meta-secded",
        "int4-g8+secded84+interp+meta-secded",
    ] {
        let clean = store(form, tokens, channels);
        let v = clean.decode().unwrap().values;
        let at = |t: usize, c: usize| v[t * channels + c];
        let mut hit = clean.clone();
        // Two flips in the scale of token 4, channels 0..8: detected.
        let bit = 8 * 2 * (2 * 4) + 9;
        hit.inject(
            &FlipsInCall::new(0, vec![bit, bit + 2]),
            0,
            FaultTarget::Metadata,
        );
        let mut out = vec![0.0; tokens * channels];
        let mut scratch = DecodeScratch::new();
        hit.decode_rows_into(0, tokens, &mut out, &mut scratch)
            .unwrap();
        assert_eq!(out[4 * channels], 0.5 * (at(3, 0) + at(5, 0)), "{form}");
        // Blocks of 4 rows: token 4 opens block 4..8, token 3 is not read.
        scratch.limit_neighbours_to_blocks(Some(4));
        hit.decode_rows_into(0, tokens, &mut out, &mut scratch)
            .unwrap();
        for c in 0..8 {
            assert_eq!(out[4 * channels + c], at(5, c), "{form} channel {c}");
        }
        scratch.limit_neighbours_to_blocks(None);
        hit.decode_rows_into(0, tokens, &mut out, &mut scratch)
            .unwrap();
        assert_eq!(out[4 * channels], 0.5 * (at(3, 0) + at(5, 0)), "{form}");
    }
}

/// Multi-bit upsets confined to one byte: every SECDED codeword is one byte,
/// so plain SECDED sees two or three flips in one word (detected or
/// miscorrected), while the interleaved layout sees one flip in each of
/// two or three words and corrects them all.
#[test]
fn interleaving_turns_byte_upsets_into_single_flips() {
    let (tokens, channels) = (64, 64);
    let upsets = gf2_codes::channel::MultiBitUpset::new(2e-3, 1, 2, 3).unwrap();
    let outcome = |spelling: &str| {
        let clean = store(spelling, tokens, channels);
        let reference = clean.decode().unwrap().values;
        let mut hit = clean.clone();
        hit.inject(&upsets, 3, FaultTarget::Values);
        let d = hit.decode().unwrap();
        (d.stats.values, d.values == reference)
    };
    let (plain, plain_exact) = outcome("int4+secded84");
    let (woven, woven_exact) = outcome("int4+secded84x8");
    assert!(plain.detected + plain.miscorrected > 0, "{plain:?}");
    assert!(!plain_exact);
    assert_eq!(
        (woven.detected, woven.miscorrected, woven.silent),
        (0, 0, 0),
        "{woven:?}"
    );
    assert!(
        woven.corrected >= 2 * (plain.detected + plain.miscorrected),
        "{woven:?} {plain:?}"
    );
    assert!(woven_exact);
}
