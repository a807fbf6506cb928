//! # test-support
//!
//! Visible test skips. A test that cannot run here (no CUDA device, no
//! NVRTC, a CPU without an instruction set, missing data) calls [`skip`]
//! instead of returning quietly:
//!
//! - the reason goes to stderr (shown with `--nocapture` or on failure);
//! - a line `<requirement>\t<crate>\t<test>\t<reason>` is appended to the
//!   file named by `RKV_SKIP_LOG`, which `cargo xtask test` sets and
//!   summarises after the run ("gpu-kernels: 5 tests skipped, no CUDA device");
//! - where the requirement's variable is set to 1 (`REQUIRE_GPU` for
//!   [`Requirement::Gpu`] and [`Requirement::Nvrtc`], `REQUIRE_ISA` for
//!   [`Requirement::Isa`], `REQUIRE_DATA` for [`Requirement::Data`]), the
//!   skip panics instead: on a machine that has the piece, a test that
//!   would skip is a failure.
//!
//! ```
//! use test_support::{Requirement, skip};
//! fn gpu_test() {
//!     let device_found = false;
//!     if !device_found {
//!         return skip(Requirement::Gpu, env!("CARGO_PKG_NAME"), "gpu_test", "no CUDA device");
//!     }
//! }
//! # unsafe { std::env::remove_var("REQUIRE_GPU") };
//! gpu_test();
//! ```
//!
//! [`rows`] holds the synthetic K/V rows and shuffled block orders the
//! benches and timing examples share.

mod alloc;
pub mod rows;

pub use alloc::{CountingAllocator, allocations};

use std::io::Write;

/// What a skipped test lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// A CUDA device.
    Gpu,
    /// The NVRTC run-time compiler.
    Nvrtc,
    /// An instruction set of the CPU (AVX2, AVX-512, F16C, ...).
    Isa,
    /// Downloaded data (the default model, the corpus).
    Data,
}

impl Requirement {
    /// The name used in the log and the summary.
    pub fn name(self) -> &'static str {
        match self {
            Requirement::Gpu => "gpu",
            Requirement::Nvrtc => "nvrtc",
            Requirement::Isa => "isa",
            Requirement::Data => "data",
        }
    }

    /// The variable that turns this skip into a failure.
    pub fn variable(self) -> &'static str {
        match self {
            Requirement::Gpu | Requirement::Nvrtc => "REQUIRE_GPU",
            Requirement::Isa => "REQUIRE_ISA",
            Requirement::Data => "REQUIRE_DATA",
        }
    }
}

/// Skips the calling test visibly (see the crate docs); panics where the
/// requirement's variable is `1`.
pub fn skip(requirement: Requirement, krate: &str, test: &str, reason: &str) {
    let reason = reason.replace(['\t', '\n'], " ");
    if std::env::var(requirement.variable()).as_deref() == Ok("1") {
        panic!(
            "{krate}::{test} needs {} but {} ({}=1 turns this skip into a failure)",
            requirement.name(),
            reason,
            requirement.variable()
        );
    }
    eprintln!("SKIPPED {krate}::{test}: {reason}");
    if let Some(path) = std::env::var_os("RKV_SKIP_LOG") {
        let line = format!("{}\t{krate}\t{test}\t{reason}\n", requirement.name());
        // One write of one line per call: appends from parallel tests stay whole.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Summarises a skip log: one line per (crate, requirement, reason) with its
/// count, in the order first seen.
pub fn summarize(log: &str) -> Vec<String> {
    let mut groups: Vec<((String, String, String), Vec<String>)> = Vec::new();
    for line in log.lines() {
        let mut parts = line.splitn(4, '\t');
        let (Some(req), Some(krate), Some(test), Some(reason)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let key = (krate.to_string(), req.to_string(), reason.to_string());
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(test.to_string()),
            None => groups.push((key, vec![test.to_string()])),
        }
    }
    groups
        .into_iter()
        .map(|((krate, req, reason), tests)| {
            format!(
                "{krate}: {} test{} skipped ({req}: {reason}): {}",
                tests.len(),
                if tests.len() == 1 { "" } else { "s" },
                tests.join(", ")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_are_logged_and_summarized() {
        let dir = std::env::temp_dir().join(format!("skips-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        let text = "gpu\tgpu-kernels\ta\tno CUDA device\ngpu\tgpu-kernels\tb\tno CUDA device\nisa\tattention\tc\tno AVX-512\n";
        std::fs::write(&log, text).unwrap();
        let lines = summarize(&std::fs::read_to_string(&log).unwrap());
        assert_eq!(
            lines,
            [
                "gpu-kernels: 2 tests skipped (gpu: no CUDA device): a, b",
                "attention: 1 test skipped (isa: no AVX-512): c"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(Requirement::Nvrtc.variable(), "REQUIRE_GPU");
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
