//! The `_into` calls of the batch codecs do not allocate, on every backend
//! this CPU has (a per-thread counting allocator).

use gf2_codes::Int4Code;
use gf2_codes::batch::{Backend, Int4Codec, erasure_words};

#[global_allocator]
static GLOBAL: test_support::CountingAllocator = test_support::CountingAllocator;

#[test]
fn encode_into_and_decode_into_do_not_allocate() {
    let n = 4099;
    let values: Vec<u8> = (0..n).map(|i| (i * 7 % 16) as u8).collect();
    let backends = Backend::available();
    for code in Int4Code::ALL {
        let codec: &dyn Int4Codec = code.codec();
        let mut encoded = vec![0u8; codec.encoded_len(n)];
        let mut decoded = vec![0u8; n];
        let mut erasures = vec![0u64; erasure_words(n)];
        // Warm up (tables are built once, lazily).
        codec.encode_into(&values, &mut encoded).unwrap();
        for &b in &backends {
            codec
                .decode_into_with(b, &encoded, &mut decoded, &mut erasures)
                .unwrap();
            codec
                .decode_with_truth_into_with(b, &encoded, &values, &mut decoded, &mut erasures)
                .unwrap();
        }
        encoded[10] ^= 0b101;
        let before = test_support::allocations();
        codec.encode_into(&values, &mut encoded).unwrap();
        encoded[10] ^= 0b1;
        for &b in &backends {
            codec
                .decode_into_with(b, &encoded, &mut decoded, &mut erasures)
                .unwrap();
            codec
                .decode_with_truth_into_with(b, &encoded, &values, &mut decoded, &mut erasures)
                .unwrap();
        }
        codec.scrub(&mut encoded, n).unwrap();
        assert_eq!(test_support::allocations(), before, "{code}");
        assert_eq!(decoded, values, "{code}");
    }
}
