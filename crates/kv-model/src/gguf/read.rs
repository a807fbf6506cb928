//! The bounds-checked little-endian cursor the GGUF reader parses with:
//! every length, count and offset is checked against what is left of the
//! file before anything is allocated.

use super::{GgmlType, MAX_DIMS, MetaValue, TensorInfo};
use crate::error::{ModelError, Result};

/// A bounds-checked little-endian cursor.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

/// Nested arrays deeper than this are refused (GGUF writers emit depth 1).
const MAX_ARRAY_DEPTH: u32 = 4;

impl<'a> Reader<'a> {
    pub(super) fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    pub(super) fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(ModelError::Gguf(format!(
                "truncated: {what} needs {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Refuses a count whose items, at `min_bytes` each, cannot fit in the rest.
    pub(super) fn check_count(&self, n: u64, min_bytes: u64, what: &str) -> Result<()> {
        if n.checked_mul(min_bytes)
            .is_none_or(|b| b > self.remaining())
        {
            return Err(ModelError::Gguf(format!(
                "{what} {n} cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(())
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ModelError::Gguf(format!("{what} is not valid UTF-8")))
    }

    pub(super) fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue> {
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
                b => return Err(ModelError::Gguf(format!("bool value {b} is not 0 or 1"))),
            },
            8 => MetaValue::String(self.string("string value")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(ModelError::Gguf("arrays nested too deeply".into()));
                }
                let item_ty = self.u32("array type")?;
                let n = self.u64("array length")?;
                let min = match item_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(ModelError::Gguf(format!("unknown metadata type {t}"))),
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
            t => return Err(ModelError::Gguf(format!("unknown metadata type {t}"))),
        })
    }

    pub(super) fn tensor_info(&mut self, alignment: u64) -> Result<TensorInfo> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(ModelError::Gguf(format!(
                "tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let ty_id = self.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| ModelError::Gguf(format!("tensor {name}: unknown ggml type {ty_id}")))?;
        let offset = self.u64("tensor offset")?;
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| ModelError::Gguf(format!("tensor {name}: element count overflows")))?;
        if dims.contains(&0) {
            return Err(ModelError::Gguf(format!("tensor {name}: a dimension is 0")));
        }
        if !dims[0].is_multiple_of(ty.block_elems) {
            return Err(ModelError::Gguf(format!(
                "tensor {name}: row length {} is not a multiple of the {} block of {}",
                dims[0], ty.name, ty.block_elems
            )));
        }
        let bytes = (elements / ty.block_elems)
            .checked_mul(ty.block_bytes)
            .ok_or_else(|| ModelError::Gguf(format!("tensor {name}: byte size overflows")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(ModelError::Gguf(format!(
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
