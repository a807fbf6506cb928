//! [`GpuError`]: every way a GPU entry point can fail, as one enum.

/// Errors of the GPU entry points. Nothing here panics on input a caller can
/// get wrong; with no device, every entry point returns [`GpuError::NoDevice`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The crate was built without the `cuda` feature.
    #[error("gpu-kernels was built without the `cuda` feature")]
    FeatureDisabled,
    /// No CUDA driver library or no device was found.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// NVRTC (the run-time compiler) could not be loaded.
    #[error("NVRTC not available: {0}")]
    NoCompiler(String),
    /// A kernel source failed to compile (the compiler log is included).
    #[error("compiling {module}: {log}")]
    Compile {
        /// Kernel module (source file) name.
        module: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA driver or cuBLAS call failed.
    #[error("CUDA {call}: {message}")]
    Driver {
        /// What was being done.
        call: &'static str,
        /// The driver's message.
        message: String,
    },
    /// A buffer does not have the length the call needs.
    #[error("{what}: {found} elements, expected {expected}")]
    ShapeMismatch {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        found: usize,
        /// The length needed.
        expected: usize,
    },
    /// A cache form, shape or parameter these kernels do not handle.
    #[error("unsupported {what}: {reason}")]
    Unsupported {
        /// What is unsupported.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// An invalid parameter value.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// Parameter name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An error of the kv-quant layer (forms, stores).
    #[error(transparent)]
    KvQuant(#[from] kv_quant::KvQuantError),
    /// An error of the paged-cache layer (page tables, storage).
    #[error(transparent)]
    PagedCache(#[from] paged_cache::PagedCacheError),
}

/// Result with [`GpuError`].
pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// Checks a buffer length.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn check_len(what: &'static str, found: usize, expected: usize) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(GpuError::ShapeMismatch {
            what,
            found,
            expected,
        })
    }
}
