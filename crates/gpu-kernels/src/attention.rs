//! Fused paged flash-decoding on the device.
//!
//! [`DevicePagedLayer`] holds one layer's K and V block pools on the device:
//! for every block, the four buffers of its kv-quant store (values, scales,
//! offsets, check bytes) copied unchanged from paged-cache's
//! [`BlockStorage`], each pool an array of equal-sized blocks.
//! [`DevicePageTable`] is paged-cache's CSR [`PageTable`] on the device.
//! [`Gpu::paged_decode`] runs one decode step for every sequence of the
//! table (split over the sequence, merged by log-sum-exp) and is checked
//! against paged-cache's CPU [`paged_decode`](paged_cache::paged_decode).

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use kv_quant::{KvDecodeStats, ParamBound, ScaleType};
use paged_cache::{BlockStorage, KvPart, PageTable};

use crate::device::{Gpu, driver};
use crate::error::{GpuError, Result, check_len};
use crate::layout::{BlockBytes, KernelForm, ValueCoding};
use crate::sources::{
    ATTENTION_GROUPS, ATTENTION_HEAD_DIMS, PAGED_DECODE, paged_decode_kernel, paged_mma_kernel,
    paged_mma_shared_bytes,
};

/// Tokens per tile of the kernel (`RKV_TILE`); splits are multiples of it.
pub const TILE_TOKENS: usize = 64;
const THREADS: u32 = 128;

/// One K or V pool: the four buffers of every block, block after block.
#[derive(Debug)]
struct DevicePool {
    data: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    offsets: CudaSlice<u8>,
    checks: CudaSlice<u8>,
    /// The metadata bound passed with every launch: kv-quant's
    /// plausibility bound for protected metadata; for unprotected metadata,
    /// the bound of the words stored, 0 if one is infinite (the
    /// tensor-core kernels' fast-path limit, not a check).
    bound: ParamBound,
}

/// One layer's K and V pools on the device.
#[derive(Debug)]
pub struct DevicePagedLayer {
    form: KernelForm,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    bytes: BlockBytes,
    k: DevicePool,
    v: DevicePool,
}

impl DevicePagedLayer {
    /// The form as the kernel reads it.
    pub fn form(&self) -> &KernelForm {
        &self.form
    }

    /// Bytes of K and V one token takes on the device (values and metadata):
    /// what the kernel must read per token, for bandwidth figures.
    pub fn bytes_per_token(&self) -> f64 {
        let b = self.bytes;
        2.0 * (b.data + b.scales + b.offsets + b.checks) as f64 / self.block_size as f64
    }

    /// KV heads.
    pub fn kv_heads(&self) -> usize {
        self.form.channels / self.head_dim
    }

    /// Whether the tensor-core kernels (`paged_mma_*`) can read this
    /// layer: INT4 or SECDED INT4 whose groups cover whole heads, with
    /// rows and blocks of a multiple of 16 bytes (their vector loads).
    pub fn tensor_cores_apply(&self) -> bool {
        self.form
            .reads_on_tensor_cores(self.head_dim, self.block_size)
    }
}

/// A page table on the device, with the per-sequence token counts.
#[derive(Debug)]
pub struct DevicePageTable {
    indptr: CudaSlice<u32>,
    indices: CudaSlice<u32>,
    last_page_len: CudaSlice<u32>,
    sequences: usize,
    max_tokens: usize,
    block_size: usize,
}

impl DevicePageTable {
    /// Sequences in the table.
    pub fn sequences(&self) -> usize {
        self.sequences
    }
}

/// The result of [`Gpu::paged_decode`].
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePagedOutput {
    /// `sequences × q_heads × head_dim`.
    pub out: Vec<f32>,
    /// Natural log-sum-exp of the scaled scores per sequence and query head.
    pub lse: Vec<f32>,
    /// Decode statistics of every K and V row read (K and V together), as
    /// a decoder without the store's ledger of injected faults counts them
    /// (miscorrections as corrections, silent errors as clean: compare with
    /// the CPU's [`KvDecodeStats::without_truth`]).
    pub stats: KvDecodeStats,
}

/// One pool's device addresses and parameter bound, `RkvPool` of
/// paged_decode.cu field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PoolParams {
    buffers: [u64; 4],
    scale_bound: f32,
    offset_bound: f32,
}

/// Kernel parameters, `RkvPagedParams` of paged_decode.cu field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Params {
    k: PoolParams,
    v: PoolParams,
    indptr: u64,
    indices: u64,
    last_page_len: u64,
    q: u64,
    part_acc: u64,
    part_ml: u64,
    stats: u64,
    secded_table: u64,
    meta_columns: u64,
    data_stride: u64,
    meta_stride: u64,
    check_stride: u64,
    block_size: u32,
    row_bytes: u32,
    channels: u32,
    channels_per_group: u32,
    groups_per_row: u32,
    scale_bytes: u32,
    symmetric: u32,
    meta_checks: u32,
    meta_width: u32,
    meta_check_bits: u32,
    policy: u32,
    reach: u32,
    q_heads: u32,
    kv_heads: u32,
    splits: u32,
    split_tokens: u32,
    scale_log2: f32,
    pad: u32,
}

// The C layouts: four 8-byte addresses and two floats; two pools, twelve
// 8-byte words, sixteen u32, a float and the pad.
const _: () = assert!(std::mem::size_of::<PoolParams>() == 40);
const _: () = assert!(std::mem::size_of::<Params>() == 2 * 40 + 12 * 8 + 16 * 4 + 8);

// SAFETY: `repr(C)`, plain integers and device addresses, laid out as
// `RkvPagedParams` (pointers are 8 bytes on the device).
unsafe impl DeviceRepr for Params {}

/// Reusable device buffers of one decode configuration.
#[derive(Debug)]
pub struct PagedWorkspace {
    q: CudaSlice<f32>,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    stats: CudaSlice<u64>,
    q_heads: usize,
    splits: usize,
    split_tokens: usize,
    tensor_cores: bool,
}

impl PagedWorkspace {
    /// Allows (the default) or forbids the tensor-core kernels; forbidden,
    /// every form runs on the CUDA-core kernels (`paged_decode_*`).
    pub fn use_tensor_cores(&mut self, allowed: bool) {
        self.tensor_cores = allowed;
    }
}

/// The split kernel for `layer` with `group` query heads per KV head.
fn kernel_name(layer: &DevicePagedLayer, group: usize, tensor_cores: bool) -> String {
    let coding = match layer.form.coding {
        ValueCoding::F16 => "f16",
        ValueCoding::Int4 => "int4",
        ValueCoding::Int4Secded84 => "secded",
    };
    if tensor_cores && layer.tensor_cores_apply() {
        paged_mma_kernel(coding, layer.head_dim, group)
    } else {
        paged_decode_kernel(coding, layer.head_dim, group)
    }
}

/// Splits per sequence for `ctas` CTAs per split (sequences × KV heads)
/// on a device that keeps `slots` CTAs resident, at most `most`: the
/// fewest whose waves are at least 90% full and that fill 90% of one wave;
/// else the fullest waves found. A last wave a fraction full costs a whole
/// wave's time (measured: 2.42 waves took the time of 3).
fn splits_for_waves(ctas: usize, slots: usize, most: usize) -> usize {
    let (ctas, slots) = (ctas.max(1), slots.max(1));
    let mut best = (0.0, 1);
    for s in 1..=most.clamp(1, 1024) {
        let n = s * ctas;
        let fill = n as f64 / (n.div_ceil(slots) * slots) as f64;
        if fill >= 0.9 && n as f64 >= 0.9 * slots as f64 {
            return s;
        }
        if fill > best.0 + 1e-9 {
            best = (fill, s);
        }
    }
    best.1
}

/// kv-quant's bound of unprotected scale and offset words, as the
/// tensor-core kernels' fast-path limit; 0 where a stored word is infinite
/// (every tile then takes the exact route, which reads the words as they
/// are, as the CPU does).
fn stored_bound(ty: ScaleType, scales: &[u8], offsets: &[u8]) -> ParamBound {
    let b = ParamBound::of_words(ty, scales, offsets);
    if b.scale.is_finite() && b.offset.is_finite() {
        b
    } else {
        ParamBound::default()
    }
}

fn u32_of(x: usize, what: &'static str) -> Result<u32> {
    u32::try_from(x).map_err(|_| GpuError::Unsupported {
        what,
        reason: format!("{x} exceeds u32 indexing"),
    })
}

impl Gpu {
    /// Copies `layer` of every block of `storage` to the device.
    pub fn upload_layer(
        &self,
        storage: &BlockStorage,
        layer: usize,
        head_dim: usize,
    ) -> Result<DevicePagedLayer> {
        let spec = storage
            .layers()
            .get(layer)
            .ok_or_else(|| GpuError::InvalidParameter {
                name: "layer",
                reason: format!("layer {layer} of {}", storage.layers().len()),
            })?;
        if spec.key != spec.value {
            return Err(GpuError::InvalidParameter {
                name: "layer",
                reason: format!(
                    "keys in {} and values in {}: the fused kernel reads one form per layer",
                    spec.key, spec.value
                ),
            });
        }
        let form = KernelForm::new(spec.key, spec.channels, head_dim)?;
        let block_size = storage.block_size();
        let num_blocks = storage.num_blocks();
        let bytes = form.block_bytes(block_size);
        let pool = |part: KvPart| -> Result<DevicePool> {
            let mut host = crate::layout::block_pool_bytes(storage, layer, part)?;
            let want = [bytes.data, bytes.scales, bytes.offsets, bytes.checks];
            for (h, w) in host.iter_mut().zip(want) {
                check_len("block pool bytes", h.len(), w * num_blocks)?;
                // The device never reads an absent buffer; keep one byte so
                // every pool has an address.
                if h.is_empty() {
                    h.push(0);
                }
            }
            let up = driver("cuMemcpyHtoD (pool)");
            let s = self.stream();
            // kv-quant bounds protected metadata only (0 otherwise). The
            // tensor-core kernels also need a bound on unprotected scales
            // (their f16 split of p·a): the bound of the words stored.
            let bound = if form.meta_checks {
                crate::layout::with_pool_store(storage, layer, part, |s| Ok(s.param_bound()))?
            } else {
                stored_bound(form.scale, &host[1], &host[2])
            };
            Ok(DevicePool {
                data: s.clone_htod(&host[0]).map_err(&up)?,
                scales: s.clone_htod(&host[1]).map_err(&up)?,
                offsets: s.clone_htod(&host[2]).map_err(&up)?,
                checks: s.clone_htod(&host[3]).map_err(&up)?,
                bound,
            })
        };
        Ok(DevicePagedLayer {
            form,
            head_dim,
            block_size,
            num_blocks,
            bytes,
            k: pool(KvPart::Keys)?,
            v: pool(KvPart::Values)?,
        })
    }

    /// Copies a page table to the device after checking it against the layer.
    pub fn upload_page_table(
        &self,
        layer: &DevicePagedLayer,
        table: &PageTable,
    ) -> Result<DevicePageTable> {
        table.validate(layer.num_blocks)?;
        if table.block_size != layer.block_size {
            return Err(GpuError::InvalidParameter {
                name: "page table",
                reason: format!(
                    "pages of {} tokens for blocks of {}",
                    table.block_size, layer.block_size
                ),
            });
        }
        let sequences = table.sequences();
        let max_tokens = (0..sequences).map(|i| table.tokens(i)).max().unwrap_or(0);
        u32_of(max_tokens, "sequence length")?;
        let s = self.stream();
        let up = driver("cuMemcpyHtoD (page table)");
        let nonempty = |v: &[u32]| if v.is_empty() { vec![0] } else { v.to_vec() };
        Ok(DevicePageTable {
            indptr: s.clone_htod(&table.indptr).map_err(&up)?,
            indices: s.clone_htod(&nonempty(&table.indices)).map_err(&up)?,
            last_page_len: s.clone_htod(&nonempty(&table.last_page_len)).map_err(&up)?,
            sequences,
            max_tokens,
            block_size: table.block_size,
        })
    }

    /// Buffers for decoding `table` with `q_heads` query heads; the
    /// sequence is split into pieces of `split_tokens` (a multiple of
    /// [`TILE_TOKENS`]; `None` picks enough pieces to fill the device).
    pub fn paged_workspace(
        &self,
        layer: &DevicePagedLayer,
        table: &DevicePageTable,
        q_heads: usize,
        split_tokens: Option<usize>,
    ) -> Result<PagedWorkspace> {
        let kv_heads = layer.kv_heads();
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(GpuError::InvalidParameter {
                name: "q_heads",
                reason: format!("{q_heads} query heads over {kv_heads} KV heads"),
            });
        }
        let split_tokens = match split_tokens {
            Some(s) if s == 0 || !s.is_multiple_of(TILE_TOKENS) => {
                return Err(GpuError::InvalidParameter {
                    name: "split_tokens",
                    reason: format!("{s} is not a positive multiple of {TILE_TOKENS}"),
                });
            }
            Some(s) => s,
            None => {
                // Whole waves of the CTAs the kernel keeps resident.
                let group = q_heads / kv_heads;
                let shape_ok = ATTENTION_HEAD_DIMS.contains(&layer.head_dim)
                    && ATTENTION_GROUPS.contains(&group);
                let resident = if shape_ok {
                    let (func, shared) = self.split_kernel(layer, group, true)?;
                    func.occupancy_max_active_blocks_per_multiprocessor(
                        THREADS,
                        shared as usize,
                        None,
                    )
                    .map_err(driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?
                } else {
                    4
                };
                let slots = resident.max(1) as usize * self.info().multiprocessors.max(1) as usize;
                let ctas = table.sequences.max(1) * kv_heads;
                let most = table.max_tokens.div_ceil(TILE_TOKENS).max(1);
                let splits = splits_for_waves(ctas, slots, most);
                table
                    .max_tokens
                    .div_ceil(splits)
                    .div_ceil(TILE_TOKENS)
                    .max(1)
                    * TILE_TOKENS
            }
        };
        let splits = table.max_tokens.div_ceil(split_tokens).max(1);
        let n = table.sequences.max(1) * q_heads;
        let s = self.stream();
        let alloc = driver("cuMemAlloc (workspace)");
        Ok(PagedWorkspace {
            q: s.alloc_zeros(n * layer.head_dim).map_err(&alloc)?,
            out: s.alloc_zeros(n * layer.head_dim).map_err(&alloc)?,
            lse: s.alloc_zeros(n).map_err(&alloc)?,
            part_acc: s.alloc_zeros(n * splits * layer.head_dim).map_err(&alloc)?,
            part_ml: s.alloc_zeros(2 * n * splits).map_err(&alloc)?,
            stats: s.alloc_zeros(9).map_err(&alloc)?,
            q_heads,
            splits,
            split_tokens,
            tensor_cores: true,
        })
    }

    /// Copies `queries` (`sequences × q_heads × head_dim`) into the workspace.
    pub fn set_queries(&self, ws: &mut PagedWorkspace, queries: &[f32]) -> Result<()> {
        check_len("queries", queries.len(), ws.q.len())?;
        self.stream()
            .memcpy_htod(queries, &mut ws.q)
            .map_err(driver("cuMemcpyHtoD (queries)"))
    }

    /// The split kernel [`Gpu::launch_paged_decode`] runs for `layer` with
    /// `ws`: `paged_mma_<coding>_hd<HD>_g<G>` on tensor cores where they
    /// apply and are allowed, else `paged_decode_<coding>_hd<HD>_g<G>`.
    pub fn paged_kernel(&self, layer: &DevicePagedLayer, ws: &PagedWorkspace) -> String {
        kernel_name(layer, ws.q_heads / layer.kv_heads().max(1), ws.tensor_cores)
    }

    /// The split kernel for `layer` at `group` query heads per KV head and
    /// the dynamic shared memory it launches with (the tensor-core
    /// kernels' staged tiles; set as the function's limit, which is needed
    /// beyond 48 KiB).
    fn split_kernel(
        &self,
        layer: &DevicePagedLayer,
        group: usize,
        tensor_cores: bool,
    ) -> Result<(cudarc::driver::CudaFunction, u32)> {
        let func = self.function(&PAGED_DECODE, &kernel_name(layer, group, tensor_cores))?;
        if !(tensor_cores && layer.tensor_cores_apply()) {
            return Ok((func, 0));
        }
        let secded = layer.form.coding == ValueCoding::Int4Secded84;
        let shared = paged_mma_shared_bytes(secded, layer.head_dim);
        func.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(driver("cuFuncSetAttribute (dynamic shared memory)"))?;
        Ok((func, shared))
    }

    /// Queues one decode step (the split kernel and the merge) on the
    /// stream without waiting: the kernel a benchmark times.
    pub fn launch_paged_decode(
        &self,
        layer: &DevicePagedLayer,
        table: &DevicePageTable,
        ws: &mut PagedWorkspace,
    ) -> Result<()> {
        let kv_heads = layer.kv_heads();
        let group = ws.q_heads / kv_heads;
        let hd = layer.head_dim;
        if !ATTENTION_HEAD_DIMS.contains(&hd) || !ATTENTION_GROUPS.contains(&group) {
            return Err(GpuError::Unsupported {
                what: "head shape",
                reason: format!(
                    "head_dim {hd} with {group} query heads per KV head (kernels exist for head_dim {ATTENTION_HEAD_DIMS:?}, groups {ATTENTION_GROUPS:?})"
                ),
            });
        }
        if table.block_size != layer.block_size {
            return Err(GpuError::InvalidParameter {
                name: "page table",
                reason: "block size differs from the layer's".into(),
            });
        }
        let check_ws = ws.q.len() == table.sequences.max(1) * ws.q_heads * hd
            && ws.splits * ws.split_tokens >= table.max_tokens;
        if !check_ws {
            return Err(GpuError::InvalidParameter {
                name: "workspace",
                reason: "made for another page table or layer".into(),
            });
        }
        let s = self.stream();
        // Cleared first: a table without sequences decodes nothing, and its
        // statistics must not be the last launch's.
        s.memset_zeros(&mut ws.stats)
            .map_err(driver("cuMemsetD8"))?;
        if table.sequences == 0 {
            return Ok(());
        }
        let tables = self.tables()?;
        let f = &layer.form;
        let (func, shared) = self.split_kernel(layer, group, ws.tensor_cores)?;
        let (policy, reach) = f.policy_code();
        let wide = f.scale == ScaleType::F32;
        let meta_code = if wide {
            kv_quant::MetaCode::f32()
        } else {
            kv_quant::MetaCode::f16()
        };
        let bs = layer.block_size;
        // Device addresses: the guards keep the stream ordered with the
        // buffers' last writes; they live until the launch below is queued.
        let (kd, _g0) = layer.k.data.device_ptr(s);
        let (ks, _g1) = layer.k.scales.device_ptr(s);
        let (ko, _g2) = layer.k.offsets.device_ptr(s);
        let (kc, _g3) = layer.k.checks.device_ptr(s);
        let (vd, _g4) = layer.v.data.device_ptr(s);
        let (vs, _g5) = layer.v.scales.device_ptr(s);
        let (vo, _g6) = layer.v.offsets.device_ptr(s);
        let (vc, _g7) = layer.v.checks.device_ptr(s);
        let (indptr, _g8) = table.indptr.device_ptr(s);
        let (indices, _g9) = table.indices.device_ptr(s);
        let (last, _g10) = table.last_page_len.device_ptr(s);
        let (q, _g11) = ws.q.device_ptr(s);
        let (acc, _g12) = ws.part_acc.device_ptr(s);
        let (ml, _g13) = ws.part_ml.device_ptr(s);
        let (stats, _g14) = ws.stats.device_ptr(s);
        let (sec, _g15) = tables.secded.device_ptr(s);
        let (meta, _g16) = tables.meta[usize::from(wide)].device_ptr(s);
        let p = Params {
            k: PoolParams {
                buffers: [kd, ks, ko, kc],
                scale_bound: layer.k.bound.scale,
                offset_bound: layer.k.bound.offset,
            },
            v: PoolParams {
                buffers: [vd, vs, vo, vc],
                scale_bound: layer.v.bound.scale,
                offset_bound: layer.v.bound.offset,
            },
            indptr,
            indices,
            last_page_len: last,
            q,
            part_acc: acc,
            part_ml: ml,
            stats,
            secded_table: sec,
            meta_columns: meta,
            data_stride: layer.bytes.data as u64,
            meta_stride: layer.bytes.scales as u64,
            check_stride: layer.bytes.checks as u64,
            block_size: u32_of(bs, "block size")?,
            row_bytes: u32_of(f.row_bytes, "row bytes")?,
            channels: u32_of(f.channels, "channels")?,
            channels_per_group: u32_of(f.channels_per_group.max(1), "group")?,
            groups_per_row: u32_of(f.groups_per_row(), "groups")?,
            scale_bytes: f.scale.bytes() as u32,
            symmetric: u32::from(f.symmetric),
            meta_checks: u32::from(f.meta_checks),
            meta_width: meta_code.data_bits(),
            meta_check_bits: meta_code.check_bits(),
            policy,
            reach,
            q_heads: u32_of(ws.q_heads, "q_heads")?,
            kv_heads: u32_of(kv_heads, "kv_heads")?,
            splits: u32_of(ws.splits, "splits")?,
            split_tokens: u32_of(ws.split_tokens, "split tokens")?,
            scale_log2: (std::f64::consts::LOG2_E / (hd as f64).sqrt()) as f32,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(ws.splits, "splits")?,
                u32_of(kv_heads, "kv_heads")?,
                u32_of(table.sequences, "sequences")?,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        let mut b = s.launch_builder(&func);
        b.arg(&p);
        // SAFETY: `Params` is `RkvPagedParams`; every address is a live
        // buffer of this context whose length matches what the kernel
        // indexes: pools of num_blocks blocks of `bytes` each, a page table
        // validated against num_blocks, and a workspace sized for this
        // table's sequences, query heads and splits (checked above).
        unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel (paged_decode)"))?;
        let merge = self.function(&PAGED_DECODE, "paged_merge")?;
        let cfg = LaunchConfig {
            grid_dim: (cfg.grid_dim.1 * group as u32, cfg.grid_dim.2, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (splits, hd32) = (p.splits, hd as u32);
        let mut b = s.launch_builder(&merge);
        b.arg(&ws.part_acc).arg(&ws.part_ml).arg(&splits).arg(&hd32);
        b.arg(&mut ws.out).arg(&mut ws.lse);
        // SAFETY: arguments match paged_merge; the grid covers sequences ×
        // q_heads rows of `splits` partials each, as allocated.
        unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel (paged_merge)"))?;
        Ok(())
    }

    /// Fills the output and log-sum-exp buffers with `value` (tests poison
    /// them with NaN to check that every element gets written).
    pub fn fill_outputs(&self, ws: &mut PagedWorkspace, value: f32) -> Result<()> {
        let s = self.stream();
        let up = driver("cuMemcpyHtoD (fill)");
        s.memcpy_htod(&vec![value; ws.out.len()], &mut ws.out)
            .map_err(&up)?;
        s.memcpy_htod(&vec![value; ws.lse.len()], &mut ws.lse)
            .map_err(&up)
    }

    /// Reads back the last decode's outputs and statistics (waits for it).
    pub fn paged_output(&self, ws: &PagedWorkspace) -> Result<DevicePagedOutput> {
        let s = self.stream();
        let down = driver("cuMemcpyDtoH");
        let c = s.clone_dtoh(&ws.stats).map_err(&down)?;
        let counts = |o: usize| gf2_codes::DecodeStats {
            words: c[o],
            clean: c[o + 1],
            corrected: c[o + 2],
            detected: c[o + 3],
            ..Default::default()
        };
        Ok(DevicePagedOutput {
            out: s.clone_dtoh(&ws.out).map_err(&down)?,
            lse: s.clone_dtoh(&ws.lse).map_err(&down)?,
            stats: KvDecodeStats {
                values: counts(0),
                metadata: counts(4),
                erased_values: c[8],
            },
        })
    }

    /// One decode step for every sequence of `table`: `queries` holds
    /// `sequences × q_heads × head_dim` values; uploads, runs, downloads.
    pub fn paged_decode(
        &self,
        layer: &DevicePagedLayer,
        table: &PageTable,
        q_heads: usize,
        queries: &[f32],
    ) -> Result<DevicePagedOutput> {
        let t = self.upload_page_table(layer, table)?;
        let mut ws = self.paged_workspace(layer, &t, q_heads, None)?;
        self.set_queries(&mut ws, queries)?;
        self.launch_paged_decode(layer, &t, &mut ws)?;
        self.paged_output(&ws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unprotected_bounds_are_finite_or_zero() {
        let f16_words = |xs: &[f32]| -> Vec<u8> {
            xs.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect()
        };
        let b = stored_bound(
            ScaleType::F16,
            &f16_words(&[0.5, f32::NAN, 2.0]),
            &f16_words(&[-3.0, 1.0]),
        );
        assert_eq!((b.scale, b.offset), (2.0, 3.0));
        let b = stored_bound(
            ScaleType::F16,
            &f16_words(&[0.5, f32::INFINITY]),
            &f16_words(&[1.0]),
        );
        assert_eq!((b.scale, b.offset), (0.0, 0.0));
        let f32_words: Vec<u8> = [1e-3f32, f32::NEG_INFINITY]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b = stored_bound(ScaleType::F32, &1e-3f32.to_le_bytes(), &f32_words);
        assert_eq!((b.scale, b.offset), (0.0, 0.0));
        assert_eq!(
            stored_bound(ScaleType::F16, &[], &[]),
            ParamBound::default()
        );
    }

    #[test]
    fn splits_fill_whole_waves() {
        // H100, three resident CTAs per SM: 396 slots.
        let slots = 396;
        // One sequence of 8 KV heads: 45 splits are the fewest that fill
        // one wave to 90% (360 of 396).
        assert_eq!(splits_for_waves(8, slots, 2048), 45);
        // 64 sequences × 8 heads = 512 CTAs: one split is 1.29 waves
        // (65% full), three are 3.9 of 4 (97%).
        assert_eq!(splits_for_waves(512, slots, 2048), 3);
        // A short context caps the splits: the fullest waves within the cap.
        assert_eq!(splits_for_waves(8, slots, 4), 4);
        // Enough CTAs already: one split.
        assert_eq!(splits_for_waves(396, slots, 100), 1);
        // Degenerate inputs stay at one split.
        assert_eq!(splits_for_waves(0, 0, 0), 1);
        for (ctas, most) in [(1, 1), (3, 7), (100, 1000), (4096, 16)] {
            let s = splits_for_waves(ctas, slots, most);
            assert!((1..=most.max(1)).contains(&s), "{ctas} {most}: {s}");
        }
    }
}
