//! Shared by the integration tests: a fault channel that flips exactly the
//! bits it is given.

/// A channel that flips exactly the given bit positions (those inside the
/// buffer it is applied to).
#[derive(Debug)]
pub(crate) struct ExactFlips(pub(crate) Vec<u64>);

impl gf2_codes::channel::FaultChannel for ExactFlips {
    fn inject_with(
        &self,
        data: &mut [u8],
        _rng: &mut gf2_codes::channel::FaultRng,
    ) -> gf2_codes::channel::Flips {
        let flips = gf2_codes::channel::Flips::from_events(
            self.0
                .iter()
                .copied()
                .filter(|&p| p / 8 < data.len() as u64)
                .collect(),
        );
        flips.apply(data).unwrap();
        flips
    }
}
