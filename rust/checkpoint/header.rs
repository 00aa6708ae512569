//! Safetensors headers: the tensors of a file, validated as the
//! `safetensors` crate validates them, and when it refuses a file the
//! diagnosis that names the tensor at fault; the error every defect of a
//! checkpoint file is reported with ([`bad`]).

use std::path::Path;

use safetensors::SafeTensors;
use serde_json::Value;

use crate::error::Error;

/// Headers larger than this are refused (as the safetensors crate does).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub start: u64,
    pub end: u64,
}

impl TensorEntry {
    pub fn nbytes(&self) -> u64 {
        self.end - self.start
    }
}

/// Bits per element of each safetensors dtype (the `safetensors` crate's
/// list), for the diagnosis of a rejected header.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// The error of a malformed (or, read later, changed) checkpoint file,
/// naming the file and, where one is at fault, the tensor: shared by the
/// header checks here, the opened file, the read path and the checksum.
pub(super) fn bad(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason: reason.into(),
    }
}

/// Parses and validates the header of a whole safetensors file (`file`, all
/// its bytes) and returns the tensors in file order.
///
/// The verdict is the `safetensors` crate's (`SafeTensors::read_metadata`,
/// what Python's `safe_open` runs): tensors back to back from offset 0 with
/// no gap or overlap, sizes exactly dtype x shape in whole bytes, the data
/// covering the file to its last byte. When it refuses a file, [`diagnose`]
/// words the reason and names the tensor at fault.
pub fn parse_header(path: &Path, file: &[u8]) -> Result<Vec<TensorEntry>, Error> {
    let (n, metadata) = match SafeTensors::read_metadata(file) {
        Ok(ok) => ok,
        Err(e) => {
            return Err(diagnose(path, file)
                .err()
                .unwrap_or_else(|| bad(path, None, format!("invalid safetensors file: {e}"))))
        }
    };
    let data_start = (8 + n) as u64;
    Ok(metadata
        .offset_keys()
        .into_iter()
        .filter_map(|name| {
            let info = metadata.info(&name)?;
            let (begin, end) = info.data_offsets;
            Some(TensorEntry {
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.iter().map(|&d| d as u64).collect(),
                start: data_start + begin as u64,
                end: data_start + end as u64,
                name,
            })
        })
        .collect())
}

/// The first defect of a file the crate refused, as one message naming the
/// file and, where one is at fault, the tensor. Checks what the crate
/// checks, in the order a reader would look.
fn diagnose(path: &Path, file: &[u8]) -> Result<(), Error> {
    let file_len = file.len() as u64;
    if file_len < 8 {
        return Err(bad(
            path,
            None,
            format!("truncated: {file_len} bytes, shorter than the 8-byte header length"),
        ));
    }
    let n = u64::from_le_bytes(file[..8].try_into().unwrap());
    if n > MAX_HEADER_BYTES {
        return Err(bad(
            path,
            None,
            format!("header length {n} is larger than the limit {MAX_HEADER_BYTES}"),
        ));
    }
    if 8 + n > file_len {
        return Err(bad(
            path,
            None,
            format!("header length {n} runs past the end of the file ({file_len} bytes)"),
        ));
    }
    let header = &file[8..8 + n as usize];
    let json: Value =
        serde_json::from_slice(header).map_err(|e| bad(path, None, format!("invalid JSON header: {e}")))?;
    let map = json
        .as_object()
        .ok_or_else(|| bad(path, None, "header is not a JSON object"))?;
    let data_len = file_len - 8 - n;
    let mut spans = Vec::with_capacity(map.len());
    for (name, info) in map {
        if name == "__metadata__" {
            if !info.as_object().is_some_and(|m| m.values().all(Value::is_string)) {
                return Err(bad(path, None, "__metadata__ must map strings to strings"));
            }
            continue;
        }
        let t = Some(name.as_str());
        let info = info.as_object().ok_or_else(|| bad(path, t, "entry is not an object"))?;
        let dtype = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(path, t, "missing or non-string dtype"))?;
        let bits = dtype_bits(dtype).ok_or_else(|| bad(path, t, format!("unknown dtype {dtype:?}")))?;
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(path, t, "missing or non-list shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad(path, t, format!("shape entry {d} is not a non-negative integer")))
            })
            .collect::<Result<_, _>>()?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad(path, t, "data_offsets must be [begin, end]"))?;
        let (begin, end) = match (offsets[0].as_u64(), offsets[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => return Err(bad(path, t, "data_offsets must be non-negative integers")),
        };
        if begin > end {
            return Err(bad(path, t, format!("data_offsets [{begin}, {end}] are reversed")));
        }
        if end > data_len {
            return Err(bad(
                path,
                t,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes): truncated file?"
                ),
            ));
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(path, t, "shape overflows"))?;
        let nbits = numel.checked_mul(bits).ok_or_else(|| bad(path, t, "shape overflows"))?;
        if nbits % 8 != 0 {
            return Err(bad(
                path,
                t,
                format!("dtype {dtype} and shape {shape:?} make {nbits} bits, not whole bytes"),
            ));
        }
        if nbits / 8 != end - begin {
            return Err(bad(
                path,
                t,
                format!(
                    "dtype {dtype} and shape {shape:?} need {} bytes, but data_offsets span {}",
                    nbits / 8,
                    end - begin
                ),
            ));
        }
        spans.push((begin, end, name.as_str()));
    }
    spans.sort();
    let mut at = 0;
    let mut previous: Option<&str> = None;
    for &(begin, end, name) in &spans {
        if begin < at {
            let other = previous.unwrap_or("?");
            return Err(bad(path, Some(name), format!("data overlaps tensor {other:?}")));
        }
        if begin > at {
            return Err(bad(
                path,
                Some(name),
                format!(
                    "a gap of {} bytes before it (data must be back to back from 0)",
                    begin - at
                ),
            ));
        }
        at = end;
        previous = Some(name);
    }
    if at != data_len {
        return Err(bad(
            path,
            None,
            format!("the tensors cover {at} of the {data_len} data bytes: the file has bytes no tensor owns"),
        ));
    }
    Ok(())
}
