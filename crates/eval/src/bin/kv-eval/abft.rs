//! `kv-eval ppl --abft [v-abft|a-abft|fixed]`: the threshold rule of the
//! GEMM checks and its parameters.

use clap::ValueEnum;

/// `kv-eval ppl --abft`'s threshold rules (abft-gemm's).
#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub(crate) enum AbftRule {
    VAbft,
    AAbft,
    Fixed,
}

/// The checks' rule from `--abft`, `--abft-emax` and `--abft-tau`, each
/// parameter refused where its rule is not the one chosen.
pub(crate) fn abft_rule(
    rule: Option<AbftRule>,
    e_max: Option<f64>,
    tau: Option<f64>,
) -> Result<Option<abft_gemm::LinearRule>, Box<dyn std::error::Error>> {
    let positive = |name: &str, v: f64| match v.is_finite() && v > 0.0 {
        true => Ok(v),
        false => Err(format!("--{name} {v} is not a positive number")),
    };
    if e_max.is_some() && rule != Some(AbftRule::VAbft)
        || tau.is_some() && rule != Some(AbftRule::Fixed)
    {
        return Err("--abft-emax goes with --abft v-abft, --abft-tau with --abft fixed".into());
    }
    Ok(match rule {
        None => None,
        Some(AbftRule::VAbft) => Some(
            abft_gemm::VAbft::design(positive(
                "abft-emax",
                e_max.unwrap_or(abft_gemm::Precision::Fp32.e_max_ascend()),
            )?)
            .into(),
        ),
        Some(AbftRule::AAbft) => {
            Some(abft_gemm::AAbft::for_precision(abft_gemm::Precision::Fp32).into())
        }
        Some(AbftRule::Fixed) => Some(
            abft_gemm::FixedThreshold {
                tau: positive("abft-tau", tau.unwrap_or(1e-3))?,
            }
            .into(),
        ),
    })
}
