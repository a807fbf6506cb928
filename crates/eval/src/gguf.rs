//! A GGUF reader (versions 2 and 3): metadata of every type, tensor infos,
//! alignment, and dequantisation of F32, F16, BF16, Q8_0, Q4_0 and Q4_1
//! exactly as ggml defines them.
//!
//! The file format follows ggml's `docs/gguf.md`: magic `GGUF`, a `u32`
//! version, `u64` tensor and metadata counts, the metadata key/value pairs,
//! the tensor infos, padding to `general.alignment` (32 when absent), then the
//! tensor data, each tensor at an aligned offset from the data section's start.
//!
//! Every length, count and offset read from the file is checked against what
//! is left of the file before anything is allocated, so a malformed or hostile
//! file gives [`EvalError::Gguf`], never a panic or a huge allocation.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{EvalError, Result};

/// GGUF magic: the bytes `GGUF`.
const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// UTF-8 `string`.
    String(String),
    /// `array` of one element type.
    Array(Vec<MetaValue>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A ggml tensor element type, with its block geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType {
    id: u32,
    name: &'static str,
    block_elems: u64,
    block_bytes: u64,
}

/// The ggml types this reader knows (`ggml.h`'s `ggml_type` ids and block
/// sizes). Tensors of any of them can be listed; [`Tensor::to_f32`] handles
/// F32, F16, BF16, Q8_0, Q4_0 and Q4_1.
const GGML_TYPES: &[GgmlType] = &[
    GgmlType::new(0, "F32", 1, 4),
    GgmlType::new(1, "F16", 1, 2),
    GgmlType::new(2, "Q4_0", 32, 18),
    GgmlType::new(3, "Q4_1", 32, 20),
    GgmlType::new(6, "Q5_0", 32, 22),
    GgmlType::new(7, "Q5_1", 32, 24),
    GgmlType::new(8, "Q8_0", 32, 34),
    GgmlType::new(9, "Q8_1", 32, 36),
    GgmlType::new(10, "Q2_K", 256, 84),
    GgmlType::new(11, "Q3_K", 256, 110),
    GgmlType::new(12, "Q4_K", 256, 144),
    GgmlType::new(13, "Q5_K", 256, 176),
    GgmlType::new(14, "Q6_K", 256, 210),
    GgmlType::new(15, "Q8_K", 256, 292),
    GgmlType::new(24, "I8", 1, 1),
    GgmlType::new(25, "I16", 1, 2),
    GgmlType::new(26, "I32", 1, 4),
    GgmlType::new(27, "I64", 1, 8),
    GgmlType::new(28, "F64", 1, 8),
    GgmlType::new(30, "BF16", 1, 2),
];

impl GgmlType {
    const fn new(id: u32, name: &'static str, block_elems: u64, block_bytes: u64) -> Self {
        Self {
            id,
            name,
            block_elems,
            block_bytes,
        }
    }

    /// The type with ggml id `id`, if known.
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().copied().find(|t| t.id == id)
    }

    /// The type named `name` (`"Q4_1"`), if known.
    pub fn from_name(name: &str) -> Option<Self> {
        GGML_TYPES.iter().copied().find(|t| t.name == name)
    }

    /// ggml's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// ggml's name (`"Q4_1"`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Elements per block.
    pub fn block_elems(&self) -> u64 {
        self.block_elems
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }
}

/// One tensor's description from the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml's `ne`: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset from the data section's start.
    pub offset: u64,
    /// Size in bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }

    /// Number of rows (product of the other dims).
    pub fn rows(&self) -> usize {
        (self.elements() / self.dims[0]) as usize
    }
}

/// The bytes behind a [`GgufFile`]: a memory map or an owned buffer.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file, its bytes memory-mapped.
pub struct GgufFile {
    bytes: Bytes,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
    alignment: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .finish()
    }
}

/// A tensor's info and its bytes.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    /// The header entry.
    pub info: &'a TensorInfo,
    /// The raw bytes (`info.bytes` of them).
    pub data: &'a [u8],
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; the model
        // cache is written once by `cargo xtask fetch-model` and never
        // modified in place, so the bytes do not change under the map.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Self> {
        let mut r = Reader {
            buf: &bytes,
            pos: 0,
        };
        if r.take(4, "magic")? != MAGIC {
            return Err(EvalError::Gguf("bad magic (not a GGUF file)".into()));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(EvalError::GgufVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Each metadata pair takes at least 12 bytes, each tensor info 24.
        r.check_count(n_kv, 12, "metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let value = r.value(ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(EvalError::Gguf(format!("duplicate metadata key {key}")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(EvalError::Gguf(format!(
                        "general.alignment {v:?} is not a positive power of two"
                    )));
                }
            },
        };
        r.check_count(n_tensors, 24, "tensor count")?;
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            infos.push(r.tensor_info(alignment)?);
        }
        let header_end = r.pos as u64;
        let data_start = header_end
            .div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or_else(|| EvalError::Gguf("data section offset overflows".into()))?;
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        if n_tensors > 0 && data_start > bytes.len() as u64 {
            return Err(EvalError::Gguf("file ends before its data section".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for t in &infos {
            if !seen.insert(t.name.as_str()) {
                return Err(EvalError::Gguf(format!("duplicate tensor {}", t.name)));
            }
            let end = t.offset.checked_add(t.bytes);
            if end.is_none_or(|e| e > data_len) {
                return Err(EvalError::Gguf(format!(
                    "tensor {} ({} bytes at offset {}) lies outside the {} data bytes (truncated file?)",
                    t.name, t.bytes, t.offset, data_len
                )));
            }
        }
        Ok(Self {
            bytes,
            version,
            metadata,
            tensors: infos,
            data_start,
            alignment,
        })
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required unsigned metadata value.
    pub fn meta_u64(&self, key: &str) -> Result<u64> {
        self.meta(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| EvalError::Model(format!("missing or non-integer metadata {key}")))
    }

    /// A required float metadata value.
    pub fn meta_f64(&self, key: &str) -> Result<f64> {
        self.meta(key)
            .and_then(MetaValue::as_f64)
            .ok_or_else(|| EvalError::Model(format!("missing or non-numeric metadata {key}")))
    }

    /// A required string metadata value.
    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| EvalError::Model(format!("missing or non-string metadata {key}")))
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>> {
        let info = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| EvalError::Model(format!("missing tensor {name}")))?;
        let start = (self.data_start + info.offset) as usize;
        Ok(Tensor {
            info,
            data: &self.bytes[start..start + info.bytes as usize],
        })
    }
}

impl Tensor<'_> {
    /// Dequantises the whole tensor to f32 (row-major, `dims[0]` contiguous).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = self.info.elements() as usize;
        let mut out = vec![0.0f32; n];
        let dequant = self.dequantizer()?;
        let block_elems = self.info.ty.block_elems as usize;
        let block_bytes = self.info.ty.block_bytes as usize;
        // 256 blocks per work item keeps rayon's overhead negligible.
        let per_item = 256;
        out.par_chunks_mut(block_elems * per_item)
            .zip(self.data.par_chunks(block_bytes * per_item))
            .for_each(|(out, data)| {
                for (o, b) in out
                    .chunks_exact_mut(block_elems)
                    .zip(data.chunks_exact(block_bytes))
                {
                    dequant(b, o);
                }
            });
        Ok(out)
    }

    /// Dequantises row `row` (`dims[0]` values) into `out`.
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let len = self.info.row_len();
        if row >= self.info.rows() || out.len() != len {
            return Err(EvalError::Shape(format!(
                "row {row} of {} ({} rows of {len}) into {} values",
                self.info.name,
                self.info.rows(),
                out.len()
            )));
        }
        let dequant = self.dequantizer()?;
        let block_elems = self.info.ty.block_elems as usize;
        let block_bytes = self.info.ty.block_bytes as usize;
        let row_bytes = len / block_elems * block_bytes;
        let data = &self.data[row * row_bytes..(row + 1) * row_bytes];
        for (o, b) in out
            .chunks_exact_mut(block_elems)
            .zip(data.chunks_exact(block_bytes))
        {
            dequant(b, o);
        }
        Ok(())
    }

    fn dequantizer(&self) -> Result<BlockDequant> {
        Ok(match self.info.ty.name {
            "F32" => dequant_f32,
            "F16" => dequant_f16,
            "BF16" => dequant_bf16,
            "Q8_0" => dequant_q8_0,
            "Q4_0" => dequant_q4_0,
            "Q4_1" => dequant_q4_1,
            other => {
                return Err(EvalError::UnsupportedType {
                    name: self.info.name.clone(),
                    ty: other.into(),
                });
            }
        })
    }
}

/// Dequantises one block of a ggml type into its elements.
type BlockDequant = fn(&[u8], &mut [f32]);

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn dequant_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn dequant_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// `block_q8_0`: f16 `d`, then 32 `i8` quants; `x = q·d`.
fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// `block_q4_0`: f16 `d`, then 16 bytes; byte `j` holds element `j` in its
/// low nibble and element `j + 16` in its high nibble; `x = (q − 8)·d`.
fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = (f32::from(q & 0x0f) - 8.0) * d;
        out[j + 16] = (f32::from(q >> 4) - 8.0) * d;
    }
}

/// `block_q4_1`: f16 `d`, f16 `m`, then 16 bytes as in Q4_0; `x = q·d + m`.
fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = f32::from(q & 0x0f) * d + m;
        out[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Nested arrays deeper than this are refused (GGUF writers emit depth 1).
const MAX_ARRAY_DEPTH: u32 = 4;

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(EvalError::Gguf(format!(
                "truncated: {what} needs {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Refuses a count whose items, at `min_bytes` each, cannot fit in the rest.
    fn check_count(&self, n: u64, min_bytes: u64, what: &str) -> Result<()> {
        if n.checked_mul(min_bytes)
            .is_none_or(|b| b > self.remaining())
        {
            return Err(EvalError::Gguf(format!(
                "{what} {n} cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| EvalError::Gguf(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>("u8")?[0]),
            1 => MetaValue::I8(self.array::<1>("i8")?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => MetaValue::U32(self.u32("u32")?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => match self.array::<1>("bool")?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(EvalError::Gguf(format!("bool value {b} is not 0 or 1"))),
            },
            8 => MetaValue::String(self.string("string value")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(EvalError::Gguf("arrays nested too deeply".into()));
                }
                let item_ty = self.u32("array type")?;
                let n = self.u64("array length")?;
                let min = match item_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(EvalError::Gguf(format!("unknown metadata type {t}"))),
                };
                self.check_count(n, min, "array length")?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item_ty, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64("u64")?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array("f64")?)),
            t => return Err(EvalError::Gguf(format!("unknown metadata type {t}"))),
        })
    }

    fn tensor_info(&mut self, alignment: u64) -> Result<TensorInfo> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(EvalError::Gguf(format!(
                "tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let ty_id = self.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| EvalError::Gguf(format!("tensor {name}: unknown ggml type {ty_id}")))?;
        let offset = self.u64("tensor offset")?;
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| EvalError::Gguf(format!("tensor {name}: element count overflows")))?;
        if dims.contains(&0) {
            return Err(EvalError::Gguf(format!("tensor {name}: a dimension is 0")));
        }
        if !dims[0].is_multiple_of(ty.block_elems) {
            return Err(EvalError::Gguf(format!(
                "tensor {name}: row length {} is not a multiple of the {} block of {}",
                dims[0], ty.name, ty.block_elems
            )));
        }
        let bytes = (elements / ty.block_elems)
            .checked_mul(ty.block_bytes)
            .ok_or_else(|| EvalError::Gguf(format!("tensor {name}: byte size overflows")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(EvalError::Gguf(format!(
                "tensor {name}: offset {offset} is not aligned to {alignment}"
            )));
        }
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            bytes,
        })
    }
}

/// Writes a GGUF v3 image (for tests, fuzz seeds and tools that build small
/// models): metadata in the given order, then tensors with their raw bytes.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata pair.
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor from raw bytes in `ty`'s layout.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    /// Adds an F32 tensor.
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(
            name,
            dims,
            GgmlType::from_id(0).expect("F32 is known"),
            bytes,
        )
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = DEFAULT_ALIGNMENT as usize;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&meta_type(v).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += data.len().div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn meta_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => write_string(out, s),
        MetaValue::Array(items) => {
            let item_ty = items.first().map_or(4, meta_type);
            out.extend_from_slice(&item_ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                write_value(out, i);
            }
        }
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_follows_ggml_nibble_order() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16 {
            b[4 + j] = (j as u8) | (((15 - j) as u8) << 4);
        }
        let mut out = [0.0f32; 32];
        dequant_q4_1(&b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q4_0_and_q8_0_blocks() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0x9f; // element 0: 15 → 14, element 16: 9 → 2
        let mut out = [0.0f32; 32];
        dequant_q4_0(&b, &mut out);
        assert_eq!((out[0], out[16], out[1]), (14.0, 2.0, -16.0));
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[2] = (-128i8) as u8;
        b[33] = 127;
        dequant_q8_0(&b, &mut out);
        assert_eq!((out[0], out[31], out[5]), (-32.0, 31.75, 0.0));
    }

    #[test]
    fn round_trip_through_writer() {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String("llama".into()))
            .meta("a.u8", MetaValue::U8(7))
            .meta("a.i64", MetaValue::I64(-3))
            .meta("a.f64", MetaValue::F64(0.5))
            .meta("a.bool", MetaValue::Bool(true))
            .meta(
                "a.arr",
                MetaValue::Array(vec![
                    MetaValue::String("x".into()),
                    MetaValue::String("yz".into()),
                ]),
            )
            .tensor_f32("t", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .tensor(
                "h",
                &[2],
                GgmlType::from_name("BF16").unwrap(),
                [
                    bf16::from_f32(1.5).to_le_bytes(),
                    bf16::from_f32(-2.0).to_le_bytes(),
                ]
                .concat(),
            );
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.meta_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.meta_u64("a.u8").unwrap(), 7);
        assert_eq!(f.meta("a.i64"), Some(&MetaValue::I64(-3)));
        assert_eq!(f.meta_f64("a.f64").unwrap(), 0.5);
        assert_eq!(f.meta("a.arr").unwrap().as_array().unwrap().len(), 2);
        let t = f.tensor("t").unwrap();
        assert_eq!((t.info.rows(), t.info.row_len()), (2, 3));
        assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut row = [0.0; 3];
        t.row_to_f32(1, &mut row).unwrap();
        assert_eq!(row, [4.0, 5.0, 6.0]);
        assert_eq!(f.tensor("h").unwrap().to_f32().unwrap(), vec![1.5, -2.0]);
        assert!(matches!(f.tensor("nope"), Err(EvalError::Model(_))));
        assert!(matches!(
            t.row_to_f32(2, &mut row),
            Err(EvalError::Shape(_))
        ));
    }
}
