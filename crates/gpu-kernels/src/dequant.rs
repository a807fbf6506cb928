//! INT4 and FP8 stores back to f32 on the device ([`Gpu::dequantize`]),
//! reading kv-quant's buffers as they are: the values equal
//! [`KvStore::decode`](kv_quant::KvStore::decode)'s bit for bit.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use kv_quant::{CacheForm, KvStore, Quantizer};

use crate::device::{Gpu, driver};
use crate::error::{GpuError, Result};
use crate::sources::DEQUANT;

/// `RkvGroups` of dequant.cu: kv-quant's `GroupLayout` and the scale width.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Groups {
    tokens_per_block: u32,
    channels_per_group: u32,
    groups_per_block: u32,
    scale_bytes: u32,
}

// SAFETY: four u32 fields, `repr(C)`, the same layout as `RkvGroups`.
unsafe impl DeviceRepr for Groups {}

const THREADS: u32 = 256;

fn unsupported(form: &CacheForm) -> GpuError {
    GpuError::Unsupported {
        what: "cache form",
        reason: format!("{form}: the dequant kernels read unprotected int4 and fp8 stores"),
    }
}

impl Gpu {
    /// Dequantizes an unprotected INT4 store (any grouping, symmetric or
    /// not, f16 or f32 scales) or an FP8 store on the device and returns
    /// its `tokens × channels` values.
    pub fn dequantize(&self, store: &KvStore) -> Result<Vec<f32>> {
        let form = store.form();
        if form.protection().is_some() {
            return Err(unsupported(form));
        }
        let layout = store.layout().ok_or_else(|| unsupported(form))?;
        let (tokens, channels) = (store.tokens(), store.channels());
        let total = tokens * channels;
        let as_u32 = |x: usize, what: &'static str| {
            u32::try_from(x).map_err(|_| GpuError::Unsupported {
                what,
                reason: format!("{x} exceeds u32 indexing"),
            })
        };
        let groups = Groups {
            tokens_per_block: as_u32(layout.tokens_per_block, "tokens per group")?,
            channels_per_group: as_u32(layout.channels_per_group, "channels per group")?,
            groups_per_block: as_u32(layout.groups_per_block, "groups per block")?,
            // FP8 scales are always f32; integer forms say theirs.
            scale_bytes: match form.quantizer() {
                Quantizer::Int(spec) => spec.scale.bytes() as u32,
                _ => 4,
            },
        };
        let (t, ch) = (as_u32(tokens, "tokens")?, as_u32(channels, "channels")?);
        if total == 0 {
            return Ok(Vec::new());
        }
        let s = self.stream();
        let up = driver("cuMemcpyHtoD");
        let data = s.clone_htod(store.data()).map_err(&up)?;
        let mut out = s.alloc_zeros::<f32>(total).map_err(driver("cuMemAlloc"))?;
        match *form.quantizer() {
            Quantizer::Int(spec) if spec.bits == 4 => {
                let scales = s.clone_htod(store.scales()).map_err(&up)?;
                // Symmetric forms have no offsets; the kernel never reads them.
                let offsets = s
                    .clone_htod(if spec.symmetric {
                        store.scales()
                    } else {
                        store.offsets()
                    })
                    .map_err(&up)?;
                let row_bytes = as_u32(store.row_bytes(), "row bytes")?;
                let symmetric = u32::from(spec.symmetric);
                let f = self.function(&DEQUANT, "int4_dequant")?;
                let cfg = LaunchConfig {
                    grid_dim: (self.grid_for(tokens * channels.div_ceil(2), THREADS), 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&f);
                b.arg(&data).arg(&t).arg(&ch).arg(&row_bytes);
                b.arg(&scales)
                    .arg(&offsets)
                    .arg(&symmetric)
                    .arg(&groups)
                    .arg(&mut out);
                // SAFETY: arguments match int4_dequant's signature; `data`
                // holds tokens × row_bytes bytes and the scales (offsets) one
                // word per group of the store's layout, as kv-quant wrote them.
                unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel (int4_dequant)"))?;
            }
            Quantizer::Fp8(spec) => {
                let table = s.clone_htod(spec.format.table()).map_err(&up)?;
                let scales: Vec<f32> = store
                    .scales()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let scales = s.clone_htod(&scales).map_err(&up)?;
                let f = self.function(&DEQUANT, "fp8_dequant")?;
                let cfg = LaunchConfig {
                    grid_dim: (self.grid_for(total, THREADS), 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&f);
                b.arg(&data)
                    .arg(&t)
                    .arg(&ch)
                    .arg(&table)
                    .arg(&scales)
                    .arg(&groups);
                b.arg(&mut out);
                // SAFETY: arguments match fp8_dequant's signature; one code
                // per value and one f32 scale per group, as kv-quant wrote them.
                unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel (fp8_dequant)"))?;
            }
            _ => return Err(unsupported(form)),
        }
        s.clone_dtoh(&out).map_err(driver("cuMemcpyDtoH"))
    }
}
