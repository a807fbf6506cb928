//! Every embedded CUDA source compiles with NVRTC for Hopper (sm_90), with
//! no device needed. Skips visibly (`test_support::skip`) where libnvrtc is
//! not on the library path (`cargo xtask test` puts one there from PyPI's
//! nvidia-cuda-nvrtc-cu12 when it can).
#![cfg(feature = "cuda")]

use gpu_kernels::sources::MODULES;
use gpu_kernels::{Gpu, GpuError};

#[test]
fn every_module_compiles_for_sm90() {
    for module in MODULES {
        match Gpu::compile(&module, "compute_90") {
            Ok(ptx) => {
                let text = ptx.to_src();
                assert!(
                    text.contains(".target sm_90"),
                    "{}: {}",
                    module.name,
                    &text[..200.min(text.len())]
                );
                println!("{}: {} bytes of PTX", module.name, text.len());
            }
            Err(GpuError::NoCompiler(why)) => {
                return test_support::skip(
                    test_support::Requirement::Nvrtc,
                    "gpu-kernels",
                    "every_module_compiles_for_sm90",
                    &format!("no NVRTC ({why})"),
                );
            }
            Err(e) => panic!("{e}"),
        }
    }
}
