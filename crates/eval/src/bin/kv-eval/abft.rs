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

/// `kv-eval ppl --gemm-flip-site`: where injected GEMM flips land.
#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub(crate) enum FlipSite {
    Output,
    Accumulator,
    Weight,
}

impl From<FlipSite> for kv_eval::gemm_checks::FlipSite {
    fn from(site: FlipSite) -> Self {
        match site {
            FlipSite::Output => Self::Output,
            FlipSite::Accumulator => Self::Accumulator,
            FlipSite::Weight => Self::Weight,
        }
    }
}

impl FlipSite {
    pub(crate) fn name(self) -> &'static str {
        kv_eval::gemm_checks::FlipSite::from(self).name()
    }
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

/// Prints what the GEMM checks of a run found: the counts, the corrections,
/// and the per-bit detection table when flips were injected.
pub(crate) fn print_checks(
    rule: Option<abft_gemm::LinearRule>,
    c: &kv_eval::gemm_checks::GemmCheckStats,
    corrected: bool,
    flipped: bool,
) {
    println!(
        "  GEMM checks ({}): {} products, {} rows, {} flagged ({} before any flip of their own)",
        rule.map(|r| r.name()).unwrap_or_default(),
        c.products,
        c.rows,
        c.flagged,
        c.false_alarms
    );
    if corrected {
        println!(
            "  corrected {} flagged rows, left {} as they were",
            c.corrected, c.uncorrected
        );
    }
    if flipped {
        println!("  | bit | flips | alone in passing rows | detected of those |");
        println!("  |---|---|---|---|");
        for b in (0..32).rev().filter(|&b| c.injected[b] > 0) {
            println!(
                "  | {b} | {} | {} | {:.1}% |",
                c.injected[b],
                c.eligible[b],
                100.0 * c.detected[b] as f64 / c.eligible[b].max(1) as f64
            );
        }
    }
}
