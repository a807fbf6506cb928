//! The batch codecs against the generic `LinearCode` decoder: every received
//! word exhaustively, random buffers of every tail length through every
//! backend, erasure bitmaps, truth-aware statistics, scrubbing and bad input.

use gf2_codes::batch::{Backend, Int4Codec, erasure_words};
use gf2_codes::channel::{BinarySymmetric, FaultChannel, FaultRng};
use gf2_codes::{DecodeOutcome, DecodeStats, Gf2Error, Golay24, Hamming74, Int4Code, Secded84};
use proptest::prelude::*;

/// Reads codeword `i` of a buffer in the code's layout. Interleaved
/// layouts, from their definition: in a whole block of eight codewords,
/// bit `b` of codeword `k` is bit `k` of the block's byte `b`.
fn codeword(code: Int4Code, enc: &[u8], i: usize) -> u64 {
    if code.is_interleaved() {
        let bits = code.linear_code().n();
        let block_bytes = bits; // eight codewords of `bits` bits
        let (block, k) = (i / 8, i % 8);
        if (block + 1) * block_bytes > enc.len() {
            return codeword(code.base(), enc, i);
        }
        return (0..bits).fold(0, |w, b| {
            w | u64::from(enc[block * block_bytes + b] >> k & 1) << b
        });
    }
    match code {
        Int4Code::Secded84 => u64::from(enc[i]),
        Int4Code::Golay24 => enc[3 * i..3 * i + 3]
            .iter()
            .rev()
            .fold(0, |a, &b| a << 8 | u64::from(b)),
        Int4Code::Hamming74 => {
            let bit = 7 * i;
            let mut w = 0u64;
            for k in 0..7 {
                let p = bit + k;
                if p / 8 < enc.len() {
                    w |= u64::from(enc[p / 8] >> (p % 8) & 1) << k;
                }
            }
            w
        }
        _ => unreachable!("interleaved layouts are read above"),
    }
}

/// The reference: decode each codeword with the generic decoder.
fn reference(
    code: Int4Code,
    enc: &[u8],
    truth: &[u8],
) -> (Vec<u8>, Vec<u64>, DecodeStats, DecodeStats) {
    let n = truth.len();
    let codec = code.codec();
    let per = codec.values_per_codeword();
    let linear = code.linear_code();
    let mut values = vec![0u8; n];
    let mut erasures = vec![0u64; erasure_words(n)];
    let (mut plain, mut with_truth) = (DecodeStats::default(), DecodeStats::default());
    for i in 0..codec.codewords(n) {
        let dec = linear.decode_word(codeword(code, enc, i)).unwrap();
        let mut right = true;
        for j in 0..per {
            let v = per * i + j;
            let got = (dec.data >> (4 * j) & 0xF) as u8;
            let expected = if v < n { truth[v] } else { 0 };
            right &= got == expected;
            if v < n {
                values[v] = got;
                if dec.outcome == DecodeOutcome::Detected {
                    erasures[v / 64] |= 1 << (v % 64);
                }
            }
        }
        plain.record(dec.outcome);
        with_truth.record_with_truth(dec.outcome, right);
    }
    (values, erasures, plain, with_truth)
}

fn check_against_reference(code: Int4Code, enc: &[u8], truth: &[u8]) {
    let codec = code.codec();
    let n = truth.len();
    let (values, erasures, plain, with_truth) = reference(code, enc, truth);
    for backend in Backend::available() {
        let mut out = vec![0xEEu8; n];
        let mut er = vec![u64::MAX; erasure_words(n)];
        let stats = codec
            .decode_into_with(backend, enc, &mut out, &mut er)
            .unwrap();
        assert_eq!(out, values, "{code} {backend:?} values, n = {n}");
        assert_eq!(er, erasures, "{code} {backend:?} erasures, n = {n}");
        assert_eq!(stats, plain, "{code} {backend:?} stats, n = {n}");
        let mut out = vec![0xEEu8; n];
        let stats = codec
            .decode_with_truth_into_with(backend, enc, truth, &mut out, &mut er)
            .unwrap();
        assert_eq!(out, values);
        assert_eq!(stats, with_truth, "{code} {backend:?} truth stats, n = {n}");
    }
}

#[test]
fn every_received_word_matches_the_generic_decoder() {
    // Hamming and SECDED: all 2^7 / 2^8 received words in one buffer each,
    // laid out so that every word is a codeword of the buffer.
    let mut rng = FaultRng::new(5);
    for code in [Int4Code::Hamming74, Int4Code::Secded84] {
        let n_bits = code.linear_code().n();
        let words = 1usize << n_bits;
        // Blocks of four chunks (Hamming: two; SECDED: five), a leftover
        // chunk or two, a ragged tail.
        let n = words * 5 + 64 + 5;
        let truth: Vec<u8> = (0..n).map(|_| (rng.next_u64() & 0xF) as u8).collect();
        let mut enc = vec![0u8; code.codec().encoded_len(n)];
        for i in 0..n {
            let w = (i % words) as u64;
            for k in 0..n_bits {
                let p = if code == Int4Code::Secded84 {
                    8 * i + k
                } else {
                    7 * i + k
                };
                enc[p / 8] |= ((w >> k & 1) as u8) << (p % 8);
            }
        }
        check_against_reference(code, &enc, &truth);
    }
}

/// The SIMD kernels skip the correction of a chunk whose syndromes are all
/// zero: one flip at every bit of a clean buffer of several chunks (so each
/// chunk is in turn the dirty one, beside clean ones, inside a block of
/// chunks tested at once and outside one) matches the reference.
#[test]
fn one_flip_anywhere_in_a_clean_buffer_matches_the_reference() {
    let mut rng = FaultRng::new(11);
    for code in Int4Code::ALL.into_iter().chain(Int4Code::INTERLEAVED) {
        // One block of four chunks, one more, a tail. Hamming's fifth chunk is
        // decoded from the input only if 64 bytes from its start are readable:
        // the 17-value tail (15 bytes) gives it the 8 bytes past its 56.
        let n = 5 * 64 + 17;
        let truth: Vec<u8> = (0..n).map(|_| (rng.next_u64() & 0xF) as u8).collect();
        let clean = code.codec().encode(&truth).unwrap();
        for bit in 0..8 * clean.len() {
            let mut enc = clean.clone();
            enc[bit / 8] ^= 1 << (bit % 8);
            check_against_reference(code, &enc, &truth);
        }
    }
}

/// All 2^24 received words, in buffers of 2^20 codewords, against the
/// generic syndrome decoder. One of the slow tests of the suite (a few
/// seconds in release); kept because it is the only check of every word.
#[test]
fn golay_every_received_word_matches_the_generic_decoder() {
    let code = Int4Code::Golay24;
    let linear = code.linear_code();
    let words_per_batch = 1 << 20;
    let mut values = vec![0u8; 3 * words_per_batch];
    let mut erasures = vec![0u64; erasure_words(values.len())];
    for batch in 0..16u32 {
        let enc: Vec<u8> = (0..words_per_batch as u32)
            .flat_map(|i| ((batch << 20) | i).to_le_bytes().into_iter().take(3))
            .collect();
        let stats = Golay24
            .decode_into(&enc, &mut values, &mut erasures)
            .unwrap();
        let mut expected = DecodeStats::default();
        for i in 0..words_per_batch {
            let w = u64::from((batch << 20) | i as u32);
            let dec = linear.decode_word(w).unwrap();
            expected.record(dec.outcome);
            let got = u64::from(values[3 * i])
                | u64::from(values[3 * i + 1]) << 4
                | u64::from(values[3 * i + 2]) << 8;
            assert_eq!(got, dec.data, "received {w:#08x}");
            let erased = erasures[3 * i / 64] >> (3 * i % 64) & 1 == 1;
            assert_eq!(erased, dec.outcome == DecodeOutcome::Detected);
        }
        assert_eq!(stats, expected);
    }
}

fn any_code() -> impl Strategy<Value = Int4Code> {
    let every: Vec<Int4Code> = Int4Code::ALL
        .into_iter()
        .chain(Int4Code::INTERLEAVED)
        .collect();
    prop::sample::select(every)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_buffers_match_reference(
        code in any_code(),
        truth in proptest::collection::vec(0u8..16, 0..300),
        p in prop::sample::select(vec![0.0, 1e-3, 2e-2, 0.1, 0.3]),
        seed in any::<u64>(),
    ) {
        let codec = code.codec();
        let mut enc = codec.encode(&truth).unwrap();
        prop_assert_eq!(enc.len(), codec.encoded_len(truth.len()));
        BinarySymmetric::new(p).unwrap().inject(&mut enc, seed);
        check_against_reference(code, &enc, &truth);
    }

    #[test]
    fn clean_round_trip(code in any_code(), truth in proptest::collection::vec(0u8..16, 0..300)) {
        let codec = code.codec();
        let dec = codec.decode(&codec.encode(&truth).unwrap(), truth.len()).unwrap();
        prop_assert_eq!(&dec.values, &truth);
        prop_assert!(dec.erasures.iter().all(|&w| w == 0));
        prop_assert_eq!(dec.stats.clean, codec.codewords(truth.len()) as u64);
    }

    #[test]
    fn scrub_rewrites_corrected_words(
        code in any_code(),
        truth in proptest::collection::vec(0u8..16, 1..300),
        seed in any::<u64>(),
    ) {
        let codec = code.codec();
        let clean = codec.encode(&truth).unwrap();
        let mut enc = clean.clone();
        BinarySymmetric::new(0.02).unwrap().inject(&mut enc, seed);
        let before = codec.decode(&enc, truth.len()).unwrap();
        let scrub = codec.scrub(&mut enc, truth.len()).unwrap();
        prop_assert_eq!(scrub, before.stats);
        // After scrubbing, nothing is left to correct; detected words stay detected.
        let after = codec.decode(&enc, truth.len()).unwrap();
        prop_assert_eq!(after.stats.corrected, 0);
        prop_assert_eq!(after.stats.detected, before.stats.detected);
        prop_assert_eq!(after.values, before.values);
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    for code in Int4Code::ALL.into_iter().chain(Int4Code::INTERLEAVED) {
        let codec = code.codec();
        let n = 10;
        assert!(matches!(
            codec.encode(&[1, 2, 16]),
            Err(Gf2Error::NibbleOutOfRange {
                index: 2,
                value: 16
            })
        ));
        let mut short = vec![0u8; codec.encoded_len(n) - 1];
        assert!(matches!(
            codec.encode_into(&[0; 10], &mut short),
            Err(Gf2Error::LengthMismatch {
                what: "encoded",
                ..
            })
        ));
        let enc = codec.encode(&[3; 10]).unwrap();
        let mut values = vec![0u8; n];
        let mut erasures = vec![0u64; 1];
        assert!(matches!(
            codec.decode_into(&enc[..enc.len() - 1], &mut values, &mut erasures),
            Err(Gf2Error::LengthMismatch {
                what: "encoded",
                ..
            })
        ));
        assert!(matches!(
            codec.decode_into(&enc, &mut values, &mut []),
            Err(Gf2Error::LengthMismatch {
                what: "erasures",
                ..
            })
        ));
        assert!(matches!(
            codec.decode_with_truth_into(&enc, &[0; 9], &mut values, &mut erasures),
            Err(Gf2Error::LengthMismatch { what: "truth", .. })
        ));
        assert!(codec.scrub(&mut enc.clone(), n + 64).is_err());
    }
}

#[test]
fn storage_is_seven_and_eight_bits_per_value() {
    assert_eq!(Hamming74.encoded_len(8), 7);
    assert_eq!(Hamming74.encoded_len(1 << 20) * 8, 7 << 20);
    assert_eq!(Secded84.encoded_len(1 << 20) * 8, 8 << 20);
    assert_eq!(Golay24.encoded_len(3 << 20) * 8, 8 * (3 << 20));
    for code in Int4Code::ALL {
        let bits = code.codec().bits_per_value() as usize;
        assert_eq!(code.codec().encoded_len(3 * 64 * 8) * 8, bits * 3 * 64 * 8);
    }
}

#[test]
fn golay_double_and_triple_errors_in_a_buffer_are_corrected() {
    let mut rng = FaultRng::new(77);
    let truth: Vec<u8> = (0..3000).map(|_| (rng.next_u64() & 0xF) as u8).collect();
    let mut enc = Golay24.encode(&truth).unwrap();
    // Flip exactly three distinct bits in every codeword.
    let mut total = 0;
    for cw in enc.chunks_exact_mut(3) {
        let mut mask = 0u32;
        while mask.count_ones() < 3 {
            mask |= 1 << rng.below(24);
        }
        total += mask.count_ones();
        for (b, m) in cw.iter_mut().zip(mask.to_le_bytes()) {
            *b ^= m;
        }
    }
    assert_eq!(total, 3000);
    let dec = Golay24.decode(&enc, truth.len()).unwrap();
    assert_eq!(dec.stats.corrected, 1000);
    assert_eq!(dec.values, truth);
    assert_eq!(dec.stats.detected, 0);
}

#[test]
fn unsupported_backend_is_an_error_not_a_crash() {
    // A backend this CPU lacks must be refused; on a CPU with every backend
    // there is none to try, which the skip log says.
    match Backend::ALL.into_iter().find(|b| !b.is_supported()) {
        Some(missing) => {
            let mut v = [0u8; 4];
            let mut e = [0u64; 1];
            assert!(
                Secded84
                    .decode_into_with(missing, &[0; 4], &mut v, &mut e)
                    .is_err()
            );
        }
        None => test_support::skip(
            test_support::Requirement::Isa,
            "gf2-codes",
            "unsupported_backend_is_an_error_not_a_crash",
            "this CPU supports every backend: the refusal of a missing one was not exercised",
        ),
    }
    assert!(Backend::available().contains(&Backend::Scalar));
    assert!(Backend::detect().is_supported());
}

/// `codeword_of_bit` names the codeword a stored bit belongs to: two flips
/// in the codeword it names are detected by SECDED, two flips in different
/// codewords are both corrected, in the plain and the interleaved layout
/// (a partial final block included).
#[test]
fn codeword_of_bit_names_the_codeword_a_flip_lands_in() {
    for code in [Int4Code::Secded84, Int4Code::Secded84x8] {
        let codec = code.codec();
        let n = 8 * 3 + 3;
        let truth: Vec<u8> = (0..n).map(|i| (i * 5 % 16) as u8).collect();
        let clean = codec.encode(&truth).unwrap();
        let bits = 8 * clean.len() as u64;
        for a in 0..bits {
            for b in a + 1..bits {
                let mut hit = clean.clone();
                for x in [a, b] {
                    hit[(x / 8) as usize] ^= 1 << (x % 8);
                }
                let d = codec.decode(&hit, n).unwrap();
                let same = codec.codeword_of_bit(a, n) == codec.codeword_of_bit(b, n);
                let expect = if same { (0, 1) } else { (2, 0) };
                assert_eq!(
                    (d.stats.corrected, d.stats.detected),
                    expect,
                    "{code} bits {a}, {b}"
                );
            }
        }
    }
}

/// Encodings of `n` values each laid end to end equal the encoding of all
/// the values exactly where `concatenates(n)` says so.
#[test]
fn concatenation_is_promised_only_where_it_holds() {
    let every = Int4Code::ALL.into_iter().chain(Int4Code::INTERLEAVED);
    for code in every {
        let codec = code.codec();
        for n in [1, 3, 5, 8, 24, 27, 64, 72, 192, 200] {
            // Eight parts: enough to fill an interleaving block from one value each.
            let parts: Vec<Vec<u8>> = (0..8)
                .map(|p| (0..n).map(|i| ((i * 7 + 3 * p + 1) % 16) as u8).collect())
                .collect();
            let joined: Vec<u8> = parts
                .iter()
                .flat_map(|p| codec.encode(p).unwrap())
                .collect();
            let whole = codec.encode(&parts.concat()).unwrap();
            assert_eq!(codec.concatenates(n), joined == whole, "{code} n = {n}");
        }
    }
}
