//! CUDA kernels for the workspace's hot paths, byte-compatible with
//! kv-quant's and paged-cache's layouts; the CPU crates are their oracle.
//!
//! - `ecc`: batch decode of Hamming(7,4), SECDED(8,4) and Golay(24,12)
//!   INT4 codewords with per-value erasures and statistics reduced on the device.
//! - `dequant`: INT4 and FP8 stores back to f32, bit-identical to kv-quant.
//! - `attention`: fused flash-decoding over a paged cache in f16, INT4 and
//!   SECDED-protected INT4 with the erasure policy applied inside the tile
//!   loop, GQA, and paged-cache's CSR page table.
//! - `gemm`: a cuBLAS BF16 product with V-ABFT row checks on the device.
//!
//! The device code sits behind the `cuda` feature (off by default). With it
//! on, the crate still builds with no CUDA toolkit and no GPU: cudarc loads
//! the driver, NVRTC and cuBLAS at run time, and the `.cu` sources embedded
//! here ([`sources`]) are compiled by NVRTC on first use, one module per
//! file, cached per module name (`Gpu`). With no device every entry point
//! returns [`GpuError::NoDevice`]. The host-side parts ([`tables`],
//! [`layout`], [`sources`]) build and are tested everywhere.

pub mod error;
pub mod layout;
pub mod sources;
pub mod tables;

#[cfg(feature = "cuda")]
pub mod attention;
#[cfg(feature = "cuda")]
pub mod dequant;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod ecc;
#[cfg(feature = "cuda")]
pub mod gemm;

#[cfg(feature = "cuda")]
pub use device::{DeviceInfo, Gpu};
pub use error::{GpuError, Result};
pub use layout::{BlockBytes, KernelForm, ValueCoding};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
