//! Checked GEMM on the device: `C = A·B` by cuBLAS (BF16 inputs, f32
//! output and accumulation) and abft-gemm's V-ABFT row check
//! ([`VAbft`]) computed by two kernels: B's row sums and variance sums, then
//! per row of A the expected and observed checksums, the bound, and the verdict.

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use abft_gemm::threshold::{VAbft, VarianceEstimator};

use crate::device::{Gpu, driver};
use crate::error::{GpuError, Result, check_len};
use crate::sources::ABFT;

const THREADS: u32 = 256;

/// Device buffers of one checked product of fixed shape.
#[derive(Debug)]
pub struct CheckedGemm {
    m: usize,
    k: usize,
    n: usize,
    blas: CudaBlas,
    /// `M × K` BF16, row-major (private: the launches rely on its length).
    a: CudaSlice<bf16>,
    /// `K × N` BF16, row-major: the weights, fixed for the life of the
    /// product, so their checksums and statistics are computed once
    /// ([`Gpu::set_b`] replaces them and recomputes).
    b: CudaSlice<bf16>,
    /// The estimator B's sums in `row_sums` and `bsums` were made with.
    b_sums_for: Option<u32>,
    /// `M × N` f32, row-major ([`Gpu::read_c`], [`Gpu::poke_c`]).
    c: CudaSlice<f32>,
    row_sums: CudaSlice<f64>,
    bsums: CudaSlice<f64>,
    residual: CudaSlice<f64>,
    bound: CudaSlice<f64>,
    flags: CudaSlice<u32>,
    flagged: CudaSlice<u32>,
}

/// The verdict of one checked product.
#[derive(Clone, Debug, PartialEq)]
pub struct RowVerdict {
    /// `|observed − expected|` per row.
    pub residuals: Vec<f64>,
    /// The V-ABFT bound per row.
    pub bounds: Vec<f64>,
    /// Rows whose residual exceeds the bound or is not finite.
    pub flagged: Vec<usize>,
}

fn int(x: usize, what: &'static str) -> Result<i32> {
    i32::try_from(x).map_err(|_| GpuError::Unsupported {
        what,
        reason: format!("{x} exceeds cuBLAS's int dimensions"),
    })
}

impl Gpu {
    /// Allocates a checked product of `m × k` by `k × n` and uploads A and B.
    pub fn checked_gemm(
        &self,
        a: &[bf16],
        b: &[bf16],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<CheckedGemm> {
        check_len("A", a.len(), m * k)?;
        check_len("B", b.len(), k * n)?;
        for (x, what) in [(m, "m"), (k, "k"), (n, "n")] {
            if x == 0 {
                return Err(GpuError::InvalidParameter {
                    name: what,
                    reason: "must be positive".into(),
                });
            }
            int(x, what)?;
        }
        let s = self.stream();
        let blas = CudaBlas::new(s.clone()).map_err(|e| GpuError::Driver {
            call: "cublasCreate",
            message: e.to_string(),
        })?;
        let up = driver("cuMemcpyHtoD");
        let alloc = driver("cuMemAlloc");
        Ok(CheckedGemm {
            m,
            k,
            n,
            blas,
            a: s.clone_htod(a).map_err(&up)?,
            b: s.clone_htod(b).map_err(&up)?,
            b_sums_for: None,
            c: s.alloc_zeros(m * n).map_err(&alloc)?,
            row_sums: s.alloc_zeros(k).map_err(&alloc)?,
            bsums: s.alloc_zeros(3).map_err(&alloc)?,
            residual: s.alloc_zeros(m).map_err(&alloc)?,
            bound: s.alloc_zeros(m).map_err(&alloc)?,
            flags: s.alloc_zeros(m).map_err(&alloc)?,
            flagged: s.alloc_zeros(1).map_err(&alloc)?,
        })
    }

    /// Queues `C = A·B` (cuBLAS, tensor cores, f32 accumulation): the plain
    /// product, and the baseline of the checked one.
    pub fn gemm(&self, g: &mut CheckedGemm) -> Result<()> {
        let s = self.stream();
        let (m, k, n) = (int(g.m, "m")?, int(g.k, "k")?, int(g.n, "n")?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (a, _ga) = g.a.device_ptr(s);
        let (b, _gb) = g.b.device_ptr(s);
        let (c, _gc) = g.c.device_ptr_mut(s);
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first.
        // SAFETY: the buffers hold k·n, m·k and m·n elements of the types
        // named (checked at allocation); alpha and beta outlive the call.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *g.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                (&alpha as *const f32).cast(),
                b as *const _,
                cudaDataType::CUDA_R_16BF,
                n,
                a as *const _,
                cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                c as *mut _,
                cudaDataType::CUDA_R_32F,
                n,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| GpuError::Driver {
            call: "cublasGemmEx",
            message: e.to_string(),
        })
    }

    /// Replaces B (`K × N` BF16, row-major); its checksums are recomputed
    /// by the next [`Gpu::queue_check`].
    pub fn set_b(&self, g: &mut CheckedGemm, b: &[bf16]) -> Result<()> {
        check_len("B", b.len(), g.k * g.n)?;
        self.stream()
            .memcpy_htod(b, &mut g.b)
            .map_err(driver("cuMemcpyHtoD (B)"))?;
        g.b_sums_for = None;
        Ok(())
    }

    /// Queues the V-ABFT row check of the product in `g.c` (without
    /// waiting). B's row sums and statistics are computed on the first
    /// check, after [`Gpu::set_b`] and when the rule's variance estimator
    /// changes, and reused otherwise.
    pub fn queue_check(&self, g: &mut CheckedGemm, rule: &VAbft) -> Result<()> {
        if rule.sampling.is_some() {
            return Err(GpuError::Unsupported {
                what: "V-ABFT sampling",
                reason: "the device check reads every element".into(),
            });
        }
        let estimator: u32 = match rule.estimator {
            VarianceEstimator::ExtremeValue => 0,
            VarianceEstimator::MaxMinBound => 1,
            VarianceEstimator::Exact => 2,
        };
        let s = self.stream();
        s.memset_zeros(&mut g.flagged)
            .map_err(driver("cuMemsetD8"))?;
        let (m, k, n) = (g.m as u32, g.k as u32, g.n as u32);
        let cfg = |blocks: u32| LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        if g.b_sums_for != Some(estimator) {
            // Invalid until the recompute is queued: a failure below must
            // not leave zeroed sums marked as valid.
            g.b_sums_for = None;
            s.memset_zeros(&mut g.bsums).map_err(driver("cuMemsetD8"))?;
            let f = self.function(&ABFT, "abft_b_rows")?;
            let mut l = s.launch_builder(&f);
            l.arg(&g.b)
                .arg(&k)
                .arg(&n)
                .arg(&estimator)
                .arg(&mut g.row_sums)
                .arg(&mut g.bsums);
            // SAFETY: arguments match abft_b_rows; B holds k·n values, row_sums k.
            unsafe { l.launch(cfg(k)) }.map_err(driver("cuLaunchKernel (abft_b_rows)"))?;
            g.b_sums_for = Some(estimator);
        }
        let f = self.function(&ABFT, "abft_check_rows")?;
        let mut l = s.launch_builder(&f);
        l.arg(&g.a)
            .arg(&g.c)
            .arg(&m)
            .arg(&k)
            .arg(&n)
            .arg(&g.row_sums)
            .arg(&g.bsums);
        l.arg(&rule.e_max).arg(&rule.coefficient).arg(&estimator);
        l.arg(&mut g.residual)
            .arg(&mut g.bound)
            .arg(&mut g.flags)
            .arg(&mut g.flagged);
        // SAFETY: arguments match abft_check_rows; A holds m·k values, C m·n,
        // the per-row outputs m each.
        unsafe { l.launch(cfg(m)) }.map_err(driver("cuLaunchKernel (abft_check_rows)"))?;
        Ok(())
    }

    /// Reads back the verdict of the last check (waits for it).
    pub fn check_verdict(&self, g: &CheckedGemm) -> Result<RowVerdict> {
        let s = self.stream();
        let down = driver("cuMemcpyDtoH");
        let flags = s.clone_dtoh(&g.flags).map_err(&down)?;
        Ok(RowVerdict {
            residuals: s.clone_dtoh(&g.residual).map_err(&down)?,
            bounds: s.clone_dtoh(&g.bound).map_err(&down)?,
            flagged: flags
                .iter()
                .enumerate()
                .filter(|&(_, &f)| f != 0)
                .map(|(i, _)| i)
                .collect(),
        })
    }

    /// Overwrites one element of C (fault injection for tests and studies).
    pub fn poke_c(&self, g: &mut CheckedGemm, row: usize, col: usize, value: f32) -> Result<()> {
        if row >= g.m || col >= g.n {
            return Err(GpuError::InvalidParameter {
                name: "element",
                reason: format!("({row}, {col}) outside {}×{}", g.m, g.n),
            });
        }
        let mut view = g.c.slice_mut(row * g.n + col..row * g.n + col + 1);
        self.stream()
            .memcpy_htod(&[value], &mut view)
            .map_err(driver("cuMemcpyHtoD (poke)"))
    }

    /// Reads C back.
    pub fn read_c(&self, g: &CheckedGemm) -> Result<Vec<f32>> {
        self.stream()
            .clone_dtoh(&g.c)
            .map_err(driver("cuMemcpyDtoH"))
    }
}
