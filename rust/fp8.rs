//! FP8 (e4m3fn) quantization per output channel, bit for bit as torch runs
//! vLLM's online `fp8_per_channel` on bf16 weights.
//!
//! vLLM computes, for a weight `W` of `N` rows (output channels) by `K`:
//! `amax = max(|W|)` per row (in bf16: exact), a scale per row from it (a
//! handful of fp32 operations, left to vLLM), then
//! `(W.float() / scale).clamp(-448, 448).to(float8_e4m3fn)` and keeps the
//! result transposed (`[K, N]`). Every step is exact IEEE arithmetic:
//! bf16 widens to fp32 without rounding, fp32 division and clamping are
//! correctly rounded on every x86 CPU, and torch's cast to e4m3fn is the
//! integer routine in c10's `Float8_e4m3fn.h`, restated here
//! ([`e4m3fn_from_f32`]). So the bytes equal torch's, and the cost is one
//! read of the weight per pass instead of torch's temporaries (a 4-byte
//! quotient, a clamp, a cast), which is most of what vLLM's processing of
//! an FP8 model costs.
//!
//! NaN is the one input whose bytes are not pinned down by IEEE (which
//! NaN a division returns): [`row_abs_max`] and [`quantize_rows`] report a
//! NaN weight or scale, and the caller hands such a tensor to torch itself.
//! (An infinite weight gives an infinite amax and scale, and `inf / inf` a
//! NaN that is not reported: x86 returns its default NaN, sign set, as
//! torch's own division does there, so the byte, 0xff, is torch's.)

use rayon::prelude::*;

use crate::transpose::write_tile_transposed;

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Input rows a task of the transposed cast quantizes together: each output
/// row then takes 64 bytes from it, one cache line.
const TILE: usize = 64;

/// A bf16 value (its bits) widened to fp32: exact.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// torch's fp32 -> float8_e4m3fn cast (c10 `fp8e4m3fn_from_fp32_value`):
/// round to nearest even, finite overflow and infinities saturate to 448
/// (`0x7e`), NaN becomes `0x7f`, the sign kept.
#[inline]
pub fn e4m3fn_from_f32(f: f32) -> u8 {
    // 480.0f, the first fp32 value not representable in e4m3fn.
    const FP8_MAX: u32 = 1087 << 20;
    // 0.5 as an exponent offset: adding 2^(141-127) to a value below
    // e4m3fn's normal range (2^-6) rounds it, as an fp32 addition does, to
    // the bits of its denormal encoding: ((127 - 7) + (23 - 3) + 1) << 23.
    const DENORM_MASK: u32 = 141 << 23;
    const INF: u32 = 0x7F80_0000;
    let all = f.to_bits();
    let sign = all & 0x8000_0000;
    let bits = all ^ sign;
    let denormal = (f32::from_bits(bits) + f32::from_bits(DENORM_MASK))
        .to_bits()
        .wrapping_sub(DENORM_MASK) as u8;
    let mant_odd = (bits >> 20) & 1;
    let normal = (bits
        .wrapping_add((7u32.wrapping_sub(127) << 23).wrapping_add(0x7FFFF))
        .wrapping_add(mant_odd)
        >> 20) as u8;
    // `bits` < 2^31 (the sign cleared): compared as i32, which vectorizes.
    let magnitude = if bits as i32 >= FP8_MAX as i32 {
        if bits as i32 > INF as i32 {
            0x7f
        } else {
            0x7e
        }
    } else if (bits as i32) < (121 << 23) {
        denormal
    } else {
        normal
    };
    magnitude | (sign >> 24) as u8
}

/// One element quantized: `clamp(x / scale, -448, 448)` cast to e4m3fn.
#[inline(always)]
fn quantize(x: u16, scale: f32) -> u8 {
    e4m3fn_from_f32((bf16_to_f32(x) / scale).clamp(-E4M3_MAX, E4M3_MAX))
}

#[inline]
fn is_nan_bf16(x: u16) -> bool {
    x & 0x7fff > 0x7f80
}

/// `row` quantized by one scale into `out`; `true` if an element is NaN.
/// Written so that the compiler vectorizes it: no early exit, the NaN test
/// folded into an accumulator, every branch of the cast a select.
#[inline(always)]
fn quantize_slice_generic(row: &[u16], scale: f32, out: &mut [u8]) -> bool {
    let mut nan = 0u16;
    for (q, &x) in out.iter_mut().zip(row) {
        *q = quantize(x, scale);
        nan |= u16::from(is_nan_bf16(x));
    }
    nan != 0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_slice_avx2(row: &[u16], scale: f32, out: &mut [u8]) -> bool {
    quantize_slice_generic(row, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn quantize_slice_avx512(row: &[u16], scale: f32, out: &mut [u8]) -> bool {
    quantize_slice_generic(row, scale, out)
}

/// The widest build of the element loop this CPU runs (detected once).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Width {
    Portable,
    Avx2,
    Avx512,
}

/// The widest [`Width`] this CPU supports.
pub fn widest() -> Width {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDTH: std::sync::OnceLock<Width> = std::sync::OnceLock::new();
        *WIDTH.get_or_init(|| {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                Width::Avx512
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                Width::Avx2
            } else {
                Width::Portable
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    Width::Portable
}

/// `row` quantized into `out` by the build of the loop `width` names.
///
/// # Panics
/// If `width` is wider than this CPU supports ([`widest`]).
#[inline]
fn quantize_slice(width: Width, row: &[u16], scale: f32, out: &mut [u8]) -> bool {
    match width {
        Width::Portable => quantize_slice_generic(row, scale, out),
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => {
            assert!(widest() != Width::Portable, "AVX2 is not available");
            // SAFETY: the CPU has AVX2 and FMA (checked above: `widest`
            // detects them at run time before naming a wider build).
            unsafe { quantize_slice_avx2(row, scale, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => {
            assert!(widest() == Width::Avx512, "AVX-512 is not available");
            // SAFETY: the CPU has AVX-512 F, BW and VL (detected at run time).
            unsafe { quantize_slice_avx512(row, scale, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => quantize_slice_generic(row, scale, out),
    }
}

/// Rows of bf16 bits read where they lie: row `n` is
/// `src[offset + n * stride..][..cols]` (a contiguous matrix, or a piece of
/// a larger one: the rows of a checkpoint tensor a TP shard narrows to).
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    src: &'a [u16],
    offset: usize,
    stride: usize,
    rows: usize,
    cols: usize,
}

impl<'a> Rows<'a> {
    /// `rows` rows of `cols` at `offset`, `stride` apart; `None` if one
    /// would end past `src` (or the arithmetic overflows).
    pub fn new(src: &'a [u16], offset: usize, stride: usize, rows: usize, cols: usize) -> Option<Rows<'a>> {
        if rows > 0 {
            let end = (rows - 1).checked_mul(stride)?.checked_add(offset)?.checked_add(cols)?;
            if end > src.len() {
                return None;
            }
        }
        Some(Rows {
            src,
            offset,
            stride,
            rows,
            cols,
        })
    }

    /// A contiguous `[src.len() / cols, cols]` matrix.
    ///
    /// # Panics
    /// If `cols` is 0 or does not divide `src.len()`.
    pub fn contiguous(src: &'a [u16], cols: usize) -> Rows<'a> {
        assert!(
            cols > 0 && src.len().is_multiple_of(cols),
            "{} items are not rows of {cols}",
            src.len()
        );
        Rows {
            src,
            offset: 0,
            stride: cols,
            rows: src.len() / cols,
            cols,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    #[inline]
    fn row(&self, n: usize) -> &'a [u16] {
        let start = self.offset + n * self.stride;
        &self.src[start..start + self.cols]
    }
}

/// `max(|x|)` of each of the rows of `src` (bf16 bits, `cols` a row), as
/// bf16 bits, into `out` (one per row); `true` if any element is NaN (then
/// `out` is not torch's and the caller must not use it).
///
/// # Panics
/// If `src` is not `out.len()` rows of `cols`.
pub fn row_abs_max(src: &[u16], cols: usize, out: &mut [u16]) -> bool {
    assert_eq!(src.len(), out.len() * cols, "row_abs_max: {} rows of {cols}", out.len());
    if cols == 0 {
        out.fill(0);
        return false;
    }
    rows_abs_max(Rows::contiguous(src, cols), out)
}

/// [`row_abs_max`] of rows read where they lie.
///
/// # Panics
/// If `out` does not hold one item per row.
pub fn rows_abs_max(rows: Rows<'_>, out: &mut [u16]) -> bool {
    assert_eq!(
        out.len(),
        rows.rows,
        "rows_abs_max: {} rows into {}",
        rows.rows,
        out.len()
    );
    out.par_iter_mut()
        .enumerate()
        .with_min_len(16)
        .map(|(n, m)| {
            // For every non-NaN bf16, the magnitude's order is the order of
            // its bits with the sign cleared (infinity included).
            let top = rows.row(n).iter().fold(0u16, |acc, &x| acc.max(x & 0x7fff));
            *m = top;
            top > 0x7f80
        })
        .reduce(|| false, |a, b| a | b)
}

/// Quantizes `src` (bf16 bits, rows of `cols`) by the per-row `scale` into
/// `out`: row-major (`[rows, cols]`) or, with `transposed`, the transposed
/// layout vLLM keeps (`[cols, rows]`, `out[k * rows + n]`). Returns `true`
/// if a weight or a scale is NaN: then `out` is not torch's and the caller
/// must not use it (see the module's note on infinities).
///
/// # Panics
/// If the lengths disagree (`src` and `out` are `scale.len() * cols`).
pub fn quantize_rows(src: &[u16], cols: usize, scale: &[f32], out: &mut [u8], transposed: bool) -> bool {
    quantize_rows_with(widest(), src, cols, scale, out, transposed)
}

/// [`quantize_rows`] with the element loop's build chosen (the tests run each).
///
/// # Panics
/// As [`quantize_rows`], and if `width` is wider than this CPU supports.
pub fn quantize_rows_with(
    width: Width,
    src: &[u16],
    cols: usize,
    scale: &[f32],
    out: &mut [u8],
    transposed: bool,
) -> bool {
    let rows = scale.len();
    assert_eq!(src.len(), rows * cols, "quantize_rows: {rows} rows of {cols}");
    assert_eq!(
        out.len(),
        rows * cols,
        "quantize_rows: the output holds {} bytes",
        out.len()
    );
    if rows == 0 || cols == 0 {
        return false;
    }
    if transposed {
        return quantize_rows_into(width, Rows::contiguous(src, cols), scale, out, 0, rows);
    }
    let nan_scale = scale.iter().any(|s| s.is_nan());
    let nan = out
        .par_chunks_mut(cols)
        .zip(src.par_chunks(cols))
        .zip(scale.par_iter())
        .with_min_len(16)
        .map(|((o, row), &s)| quantize_slice(width, row, s, o))
        .reduce(|| false, |a, b| a | b);
    nan || nan_scale
}

/// Quantizes `rows` (one `scale` each) into rows `first..first + rows` of
/// a transposed `[cols, total]` output (`out[k * total + first + n]`): one
/// piece of a weight whose other rows come from elsewhere. Returns `true` if
/// a weight or a scale is NaN (then `out` is not torch's).
///
/// # Panics
/// If `scale` is not one per row, the rows do not fit in `total`, or `out`
/// is not `cols * total` bytes; and if `width` is wider than this CPU supports.
pub fn quantize_rows_into(
    width: Width,
    rows: Rows<'_>,
    scale: &[f32],
    out: &mut [u8],
    first: usize,
    total: usize,
) -> bool {
    assert_eq!(
        scale.len(),
        rows.rows,
        "quantize_rows_into: {} scales for {} rows",
        scale.len(),
        rows.rows
    );
    // Checked: the tasks write through raw pointers (`quantize_row_tiles`),
    // so a wrapped sum or product here would let them write out of bounds.
    assert!(
        first.checked_add(rows.rows).is_some_and(|end| end <= total),
        "rows {first}+{} of {total}",
        rows.rows
    );
    assert_eq!(
        Some(out.len()),
        rows.cols.checked_mul(total),
        "quantize_rows_into: the output holds {} bytes",
        out.len()
    );
    if rows.rows == 0 || rows.cols == 0 {
        return false;
    }
    let nan_scale = scale.iter().any(|s| s.is_nan());
    quantize_row_tiles(width, rows, scale, out, first, total) || nan_scale
}

/// The output's base pointer, shared by the tasks of [`quantize_row_tiles`]
/// (each writes bytes no other task writes).
#[derive(Clone, Copy)]
struct Output(*mut u8);
// SAFETY: the pointer is only written through at the disjoint places each
// task of `quantize_row_tiles` owns (see there); it outlives the tasks.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

impl Output {
    /// The address `offset` bytes in (a method, so that a closure captures
    /// the whole `Output`, not its raw pointer field).
    ///
    /// # Safety
    /// `offset` must lie within the output.
    unsafe fn at(self, offset: usize) -> *mut u8 {
        // SAFETY: the caller's: in bounds.
        unsafe { self.0.add(offset) }
    }
}

/// The transposed layout, input rows first: each task quantizes a tile of
/// `TILE` whole input rows (read in order, at the row-major cast's speed),
/// then writes it out as the same 64 bytes of every output row (a whole
/// cache line each where the output is 64-byte aligned: then with streaming
/// stores).
///
/// Measured on an Intel Xeon fam 6 model 207 (2 threads, a 4096 x 11008
/// weight, GB/s of bf16 read): bands of output rows, each input row read a
/// kilobyte at a time, 1.85 (2.6 with the transposes kept in registers, 3.1
/// with wider bands); input-row tiles 4.1; with streaming stores 6.2; the
/// row-major cast 9. An output line written in parts, or read before it is
/// written, costs more than the cast of its 64 bytes.
fn quantize_row_tiles(width: Width, rows: Rows<'_>, scale: &[f32], out: &mut [u8], first: usize, total: usize) -> bool {
    let cols = rows.cols;
    let height = TILE;
    assert!(
        first.checked_add(rows.rows).is_some_and(|end| end <= total) && Some(out.len()) == cols.checked_mul(total),
        "the output holds the rows"
    );
    let base = Output(out.as_mut_ptr());
    (0..rows.rows.div_ceil(height))
        .into_par_iter()
        .map(|t| {
            let n0 = t * height;
            let used = height.min(rows.rows - n0);
            let mut tile = vec![0u8; used * cols];
            let mut nan = false;
            for (i, quantized) in tile.chunks_exact_mut(cols).enumerate() {
                nan |= quantize_slice(width, rows.row(n0 + i), scale[n0 + i], quantized);
            }
            // SAFETY: this task writes out[k * total + first + n0 + i] for
            // k < cols, i < used only: columns first + n0.. first + n0 + used
            // of the cols output rows, inside `out` (first + rows <= total,
            // out.len() == cols * total: asserted) and written by no other
            // task (each owns its own n0..n0 + used); `out` is borrowed
            // mutably for the whole call, so nothing else reads it meanwhile.
            unsafe { write_tile_transposed(&tile, used, cols, base.at(first + n0), total) };
            nan
        })
        .reduce(|| false, |a, b| a | b)
}

#[cfg(test)]
#[path = "fp8_tests.rs"]
mod tests;
