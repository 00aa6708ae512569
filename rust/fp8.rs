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

mod cast;
#[cfg(test)]
use cast::quantize;
use cast::{abs_max_bits, cast_row};
pub use cast::{bf16_to_f32, channel_scale, e4m3fn_from_f32, widest, Width, E4M3_MAX};

/// Input rows a task of the transposed cast quantizes together: each output
/// row then takes 64 bytes from it, one cache line.
const TILE: usize = 64;

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
            let top = abs_max_bits(rows.row(n));
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
        .map(|((o, row), &s)| cast_row(width, row, Some(s), o).2)
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
    assert_eq!(scale.len(), rows.rows, "quantize_rows_into: {} scales", scale.len());
    if rows.rows == 0 || rows.cols == 0 {
        return false;
    }
    let nan_scale = scale.iter().any(|s| s.is_nan());
    quantize_row_tiles(width, rows, Scales::Given(scale), out, first, total) || nan_scale
}

/// [`quantize_rows_into`] by each row's own [`channel_scale`], in one read
/// of the rows: each row's amax (bf16 bits) and scale are written to
/// `amax` and `scale`. Returns `true` if a weight is NaN (then nothing
/// written is torch's).
///
/// # Panics
/// As [`quantize_rows_into`], `amax` and `scale` one per row.
pub fn amax_quantize_rows_into(
    width: Width,
    rows: Rows<'_>,
    amax: &mut [u16],
    scale: &mut [f32],
    out: &mut [u8],
    first: usize,
    total: usize,
) -> bool {
    assert!(
        amax.len() == rows.rows && scale.len() == rows.rows,
        "amax_quantize_rows_into: {} amaxes and {} scales for {} rows",
        amax.len(),
        scale.len(),
        rows.rows
    );
    quantize_row_tiles(width, rows, Scales::Own(amax, scale), out, first, total)
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

/// The scales of a cast's rows: given, or each row's own, computed from its
/// amax and written out beside it (one item per row each).
enum Scales<'s> {
    Given(&'s [f32]),
    Own(&'s mut [u16], &'s mut [f32]),
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
fn quantize_row_tiles(
    width: Width,
    rows: Rows<'_>,
    scales: Scales<'_>,
    out: &mut [u8],
    first: usize,
    total: usize,
) -> bool {
    let cols = rows.cols;
    // Checked: the tasks write through raw pointers, so a wrapped sum or
    // product here would let them write out of bounds.
    assert!(
        first.checked_add(rows.rows).is_some_and(|end| end <= total),
        "rows {first}+{} of {total}",
        rows.rows
    );
    assert_eq!(
        Some(out.len()),
        cols.checked_mul(total),
        "the transposed output holds {} bytes",
        out.len()
    );
    let given = match &scales {
        Scales::Given(s) => s.len(),
        Scales::Own(a, s) => a.len().min(s.len()),
    };
    // Checked here, where the tasks rely on it: one scale (and amax) a row.
    assert_eq!(given, rows.rows, "{given} scales for {} rows", rows.rows);
    if let Scales::Own(amax, scale) = &scales {
        assert_eq!(amax.len(), scale.len(), "one amax and one scale a row");
    }
    if rows.rows == 0 || cols == 0 {
        if let Scales::Own(amax, scale) = scales {
            amax.fill(0);
            scale.fill(channel_scale(0));
        }
        return false;
    }
    let base = Output(out.as_mut_ptr());
    // SAFETY (both arms): task `t` writes out[k * total + first + n0 + i]
    // for k < cols, i < its tile's rows (n0 = t * TILE): columns
    // first + n0.. of the cols output rows, inside `out` (first + rows <=
    // total, out.len() == cols * total: asserted) and written by no other
    // task (each owns its own tile of rows); `out` is borrowed mutably for
    // the whole call, so nothing else reads it meanwhile.
    let tile = |t: usize, scales: Scales<'_>| unsafe { cast_tile(width, rows, t * TILE, scales, base, first, total) };
    match scales {
        Scales::Given(scale) => scale
            .par_chunks(TILE)
            .enumerate()
            .map(|(t, s)| tile(t, Scales::Given(s)))
            .reduce(|| false, |a, b| a | b),
        Scales::Own(amax, scale) => amax
            .par_chunks_mut(TILE)
            .zip(scale.par_chunks_mut(TILE))
            .enumerate()
            .map(|(t, (a, s))| tile(t, Scales::Own(a, s)))
            .reduce(|| false, |a, b| a | b),
    }
}

/// One task of [`quantize_row_tiles`]: rows `n0..` of `rows`, one per item
/// of `scales`, cast into a tile, then written transposed at column
/// `first + n0` of the output at `base`. `true` if a weight or scale is NaN.
///
/// # Safety
/// `base` must be a `[rows.cols, total]` output whose columns
/// `first + n0..first + n0 + scales.len()` lie inside it and are written by
/// nobody else while this runs.
unsafe fn cast_tile(
    width: Width,
    rows: Rows<'_>,
    n0: usize,
    mut scales: Scales<'_>,
    base: Output,
    first: usize,
    total: usize,
) -> bool {
    let cols = rows.cols;
    let used = match &scales {
        Scales::Given(s) => s.len(),
        Scales::Own(a, _) => a.len(),
    };
    let mut tile = vec![0u8; used * cols];
    let mut nan = false;
    for (i, quantized) in tile.chunks_exact_mut(cols).enumerate() {
        let row = rows.row(n0 + i);
        nan |= match &mut scales {
            Scales::Given(s) => cast_row(width, row, Some(s[i]), quantized).2,
            Scales::Own(amax, scale) => {
                let (top, s, bad) = cast_row(width, row, None, quantized);
                (amax[i], scale[i]) = (top, s);
                bad
            }
        };
    }
    // SAFETY: the caller's: these columns are inside the output and this
    // call's alone.
    unsafe { write_tile_transposed(&tile, used, cols, base.at(first + n0), total) };
    nan
}

#[cfg(test)]
#[path = "fp8_tests.rs"]
mod tests;
