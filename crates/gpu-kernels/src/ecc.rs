//! Batch ECC decode on the device: [`Gpu::ecc_decode`] (owned data in,
//! owned data out) and [`Gpu::ecc_decode_into`] (device buffers, no host
//! copies but the statistics), both byte-compatible with gf2-codes' batch
//! codecs: same values, same erasure bitmap, same [`DecodeStats`].

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use gf2_codes::{DecodeStats, Int4Code};

use crate::device::{Gpu, driver};
use crate::error::{GpuError, Result, check_len};
use crate::sources::ECC_DECODE;

/// The result of [`Gpu::ecc_decode`], laid out as gf2-codes'
/// [`Decoded`](gf2_codes::batch::Decoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceDecoded {
    /// One value per byte.
    pub values: Vec<u8>,
    /// Bit `i % 64` of word `i / 64` set for values in detected codewords.
    pub erasures: Vec<u64>,
    /// Outcome counts per codeword.
    pub stats: DecodeStats,
}

const THREADS: u32 = 256;

impl Gpu {
    /// Decodes `count` INT4 values from `encoded` (gf2-codes' layout of
    /// `code`): uploads, decodes on the device, and downloads.
    pub fn ecc_decode(
        &self,
        code: Int4Code,
        encoded: &[u8],
        count: usize,
    ) -> Result<DeviceDecoded> {
        check_len(
            "encoded bytes",
            encoded.len(),
            code.codec().encoded_len(count),
        )?;
        let s = self.stream();
        let enc = s.clone_htod(encoded).map_err(driver("cuMemcpyHtoD"))?;
        let mut values = s
            .alloc_zeros::<u8>(count.max(1))
            .map_err(driver("cuMemAlloc"))?;
        let mut erasures = s
            .alloc_zeros::<u32>(2 * count.div_ceil(64).max(1))
            .map_err(driver("cuMemAlloc"))?;
        let stats = self.ecc_decode_into(code, &enc, count, &mut values, &mut erasures)?;
        let mut v = s.clone_dtoh(&values).map_err(driver("cuMemcpyDtoH"))?;
        v.truncate(count);
        let e32 = s.clone_dtoh(&erasures).map_err(driver("cuMemcpyDtoH"))?;
        let erasures = e32
            .chunks_exact(2)
            .take(count.div_ceil(64))
            .map(|w| u64::from(w[0]) | u64::from(w[1]) << 32)
            .collect();
        Ok(DeviceDecoded {
            values: v,
            erasures,
            stats,
        })
    }

    /// Decodes on device buffers: `values` gets one value per byte (at
    /// least `count`), `erasures` the bitmap as little-endian u32 words (at
    /// least `2·⌈count/64⌉`; zeroed here first). Returns the statistics
    /// (waits for the device to read them back).
    pub fn ecc_decode_into(
        &self,
        code: Int4Code,
        encoded: &CudaSlice<u8>,
        count: usize,
        values: &mut CudaSlice<u8>,
        erasures: &mut CudaSlice<u32>,
    ) -> Result<DecodeStats> {
        let codec = code.codec();
        check_len("encoded bytes", encoded.len(), codec.encoded_len(count))?;
        if values.len() < count {
            return Err(GpuError::ShapeMismatch {
                what: "values buffer",
                found: values.len(),
                expected: count,
            });
        }
        let words = 2 * count.div_ceil(64);
        if erasures.len() < words {
            return Err(GpuError::ShapeMismatch {
                what: "erasure words",
                found: erasures.len(),
                expected: words,
            });
        }
        if code.is_interleaved() {
            return Err(GpuError::Unsupported {
                what: "code",
                reason: format!("{code}: interleaved layouts are decoded on the CPU only"),
            });
        }
        let n = u32::try_from(count).map_err(|_| GpuError::Unsupported {
            what: "batch size",
            reason: format!("{count} values exceed u32 indexing"),
        })?;
        if count == 0 {
            return Ok(DecodeStats::default());
        }
        let s = self.stream();
        let tables = self.tables()?;
        s.memset_zeros(erasures).map_err(driver("cuMemsetD8"))?;
        let mut stats = s.alloc_zeros::<u64>(4).map_err(driver("cuMemAlloc"))?;
        let units = match code {
            Int4Code::Secded84 => count.div_ceil(4),
            Int4Code::Hamming74 => count.div_ceil(8),
            Int4Code::Golay24 => count.div_ceil(3),
            Int4Code::Secded84x8 | Int4Code::Golay24x8 => unreachable!("refused above"),
        };
        let cfg = LaunchConfig {
            grid_dim: (self.grid_for(units, THREADS), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match code {
            Int4Code::Secded84 => "secded84_decode",
            Int4Code::Hamming74 => "hamming74_decode",
            Int4Code::Golay24 => "golay24_decode",
            Int4Code::Secded84x8 | Int4Code::Golay24x8 => unreachable!("refused above"),
        };
        let f = self.function(&ECC_DECODE, name)?;
        let mut b = s.launch_builder(&f);
        b.arg(encoded).arg(&n);
        match code {
            Int4Code::Secded84 => b.arg(&tables.secded),
            Int4Code::Hamming74 => b.arg(&tables.hamming),
            Int4Code::Golay24 => b.arg(&tables.golay_parity).arg(&tables.golay_leader),
            Int4Code::Secded84x8 | Int4Code::Golay24x8 => unreachable!("refused above"),
        };
        b.arg(values).arg(erasures).arg(&mut stats);
        // SAFETY: the argument list matches the kernel's signature in
        // ecc_decode.cu; the buffer lengths were checked above (encoded holds
        // the layout's bytes for `count` values, values ≥ count bytes,
        // erasures ≥ ⌈count/32⌉ words), and the kernel indexes no further.
        unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel (ecc decode)"))?;
        let c = s.clone_dtoh(&stats).map_err(driver("cuMemcpyDtoH"))?;
        Ok(DecodeStats {
            words: c[0],
            clean: c[1],
            corrected: c[2],
            detected: c[3],
            ..DecodeStats::default()
        })
    }
}
