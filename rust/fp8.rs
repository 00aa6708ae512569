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

use crate::transpose::{transpose16, BLOCK};

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Output rows gathered per band when writing the transposed layout (a band
/// is one task's contiguous piece of the output): half a thread's share of
/// them, within these bounds (see [`band_width`]).
const MIN_BAND: usize = 512;
const MAX_BAND: usize = 2048;
/// Input rows quantized together into one tile of a band.
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
    assert!(first + rows.rows <= total, "rows {first}+{} of {total}", rows.rows);
    assert_eq!(
        out.len(),
        rows.cols * total,
        "quantize_rows_into: the output holds {} bytes",
        out.len()
    );
    if rows.rows == 0 || rows.cols == 0 {
        return false;
    }
    let nan_scale = scale.iter().any(|s| s.is_nan());
    quantize_transposed(width, rows, scale, out, first, total) || nan_scale
}

/// The transposed layout: each task owns a band of whole output rows
/// ([`band_width`] input columns), a contiguous piece of `out`. Within it,
/// `TILE` input rows at a time are quantized row by row into a tile
/// (contiguous reads and the conversion vectorized), then the tile is
/// written out column by column as `TILE`-byte runs. A band is wide (up to
/// 4 KiB of each input row) because every input row of the band lies on a
/// page of its own, and a short run per row leaves the hardware prefetcher
/// no stream to follow: on an Intel Xeon fam 6 model 207, bands of 512,
/// 1,024 and 2,048 columns cast a 4096 x 11008 weight at 2.6, 2.9 and
/// 3.2 GB/s of bf16 read (4,096: 2.2, too few tasks for two threads; a
/// quarter of a thread's share, 1,376: 2.6-2.9).
fn quantize_transposed(
    width: Width,
    rows: Rows<'_>,
    scale: &[f32],
    out: &mut [u8],
    first: usize,
    total: usize,
) -> bool {
    let band_cols = band_width(rows.cols, rayon::current_num_threads());
    out.par_chunks_mut(band_cols * total)
        .enumerate()
        .map(|(band, piece)| {
            let k0 = band * band_cols;
            let used = piece.len() / total; // output rows in this band (the last may be short)
            let mut tile = vec![0u8; TILE * band_cols];
            let mut nan = false;
            for n0 in (0..rows.rows).step_by(TILE) {
                let height = TILE.min(rows.rows - n0);
                for (i, quantized) in tile.chunks_exact_mut(band_cols).take(height).enumerate() {
                    let n = n0 + i;
                    let row = &rows.row(n)[k0..k0 + used];
                    nan |= quantize_slice(width, row, scale[n], &mut quantized[..used]);
                }
                write_columns(&tile, band_cols, height, used, &mut piece[first + n0..], total);
            }
            nan
        })
        .reduce(|| false, |a, b| a | b)
}

/// Columns a band of the transposed cast takes: half of each thread's share
/// of `cols` (two tasks a thread, to even out a busy one), rounded up
/// to whole 16-byte blocks, within `MIN_BAND..=MAX_BAND`.
fn band_width(cols: usize, threads: usize) -> usize {
    let share = cols.div_ceil(2 * threads.max(1));
    share.next_multiple_of(BLOCK).clamp(MIN_BAND, MAX_BAND)
}

/// Writes column `j` of `tile` (`height` rows of `tile_pitch` bytes, `width`
/// columns used) as `out[j * pitch..][..height]`: whole 16x16 blocks by
/// [`transpose16`], the ragged edges byte by byte.
fn write_columns(tile: &[u8], tile_pitch: usize, height: usize, width: usize, out: &mut [u8], pitch: usize) {
    let (full_i, full_j) = (height / BLOCK * BLOCK, width / BLOCK * BLOCK);
    if full_i > 0 && full_j > 0 {
        assert!(
            tile.len() >= (full_i - 1) * tile_pitch + full_j,
            "the tile holds its rows"
        );
        assert!(out.len() >= (full_j - 1) * pitch + full_i, "the output holds its rows");
    }
    // Down a column block first: its output rows are finished one run after
    // another, while their lines are in cache.
    for j0 in (0..full_j).step_by(BLOCK) {
        for i0 in (0..full_i).step_by(BLOCK) {
            // SAFETY: rows i0..i0+16 of the tile, bytes j0..j0+16 of each, and
            // rows j0..j0+16 of `out`, bytes i0..i0+16 of each, lie inside the
            // two slices (asserted above); a shared and a mutable borrow
            // cannot overlap.
            unsafe {
                transpose16(
                    tile.as_ptr().add(i0 * tile_pitch + j0),
                    tile_pitch as isize,
                    out.as_mut_ptr().add(j0 * pitch + i0),
                    pitch,
                )
            };
        }
    }
    for j in 0..width {
        let from_i = if j < full_j { full_i } else { 0 };
        for i in from_i..height {
            out[j * pitch + i] = tile[i * tile_pitch + j];
        }
    }
}

#[cfg(test)]
#[path = "fp8_tests.rs"]
mod tests;
