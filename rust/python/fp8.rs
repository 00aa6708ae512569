//! `_core.fp8_row_abs_max` and `_core.fp8_quantize_rows`: the FP8 kernels
//! of `crate::fp8` over buffer-protocol arrays (numpy views of torch
//! tensors), with the GIL released.

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::acquire::BufferExport;
use crate::fp8;
use crate::scheduler::foreground;

/// A C-contiguous buffer export as a slice of `T`: its items must be `T`'s
/// size and one of `T`'s formats ([`Item`]), its length in bytes a whole
/// number of `T` and its address aligned for `T`.
struct Typed {
    export: BufferExport,
    len: usize,
}

/// The element types the kernels read and write, with the buffer formats
/// (`struct` codes, native byte order) that hold them: bf16 bits come as
/// 16-bit integers (numpy has no bf16), bytes as 8-bit ones.
trait Item {
    const FORMATS: &'static [u8];
    const NAME: &'static str;
}

impl Item for u16 {
    const FORMATS: &'static [u8] = b"hH";
    const NAME: &'static str = "16-bit integers (bf16 bits)";
}

impl Item for f32 {
    const FORMATS: &'static [u8] = b"f";
    const NAME: &'static str = "float32";
}

impl Item for u8 {
    const FORMATS: &'static [u8] = b"Bb";
    const NAME: &'static str = "bytes";
}

/// The buffer's item format, its native-order prefix stripped (`None` when
/// it is anything but one `struct` code in native or little-endian order).
fn format_code(view: &ffi::Py_buffer) -> Option<u8> {
    if view.format.is_null() {
        return Some(b'B'); // the buffer protocol's default
    }
    // SAFETY: with PyBUF_FORMAT requested, a non-null `format` is a
    // NUL-terminated string the exporter keeps alive with the export.
    let format = unsafe { std::ffi::CStr::from_ptr(view.format) }.to_bytes();
    match format {
        [code] | [b'@' | b'=' | b'<', code] => Some(*code),
        _ => None,
    }
}

impl Typed {
    fn new<T: Item>(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Typed> {
        let flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT | if writable { ffi::PyBUF_WRITABLE } else { 0 };
        let export = BufferExport::new(obj, flags)?;
        let view = export.view();
        let bytes = view.len.max(0) as usize;
        let size = std::mem::size_of::<T>();
        let code = format_code(view);
        if view.itemsize as usize != size || !code.is_some_and(|c| T::FORMATS.contains(&c)) {
            return Err(PyValueError::new_err(format!(
                "{what}: items of {} bytes, format {:?}, where {} are expected",
                view.itemsize,
                code.map_or("?".to_string(), |c| (c as char).to_string()),
                T::NAME
            )));
        }
        if !bytes.is_multiple_of(size) || !(view.buf as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(PyValueError::new_err(format!(
                "{what}: {bytes} bytes at an address that is not a whole, aligned array of {size}-byte items"
            )));
        }
        Ok(Typed {
            export,
            len: bytes / size,
        })
    }

    fn ptr(&self) -> *mut u8 {
        self.export.view().buf as *mut u8
    }
}

/// `rows * cols` items, or the error naming `what` when the product overflows.
fn items(rows: usize, cols: usize, what: &str) -> PyResult<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| PyValueError::new_err(format!("{what}: {rows} rows of {cols} overflow")))
}

/// `len` items of `T` at address `at` (any address when `len` is 0).
///
/// # Safety
/// As `std::slice::from_raw_parts`, for a non-empty slice: `len` readable,
/// aligned items, unwritten for `'a`.
unsafe fn shared<'a, T>(at: usize, len: usize) -> &'a [T] {
    let ptr = if len == 0 {
        std::ptr::NonNull::dangling().as_ptr()
    } else {
        at as *const T
    };
    // SAFETY: the caller's contract; an empty slice reads nothing.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// [`shared`], writable.
///
/// # Safety
/// As `std::slice::from_raw_parts_mut`, for a non-empty slice: `len`
/// writable, aligned items nobody else reads or writes for `'a`.
unsafe fn exclusive<'a, T>(at: usize, len: usize) -> &'a mut [T] {
    let ptr = if len == 0 {
        std::ptr::NonNull::dangling().as_ptr()
    } else {
        at as *mut T
    };
    // SAFETY: the caller's contract; an empty slice touches nothing.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

fn check(got: usize, want: usize, what: &str) -> PyResult<()> {
    if got != want {
        return Err(PyValueError::new_err(format!(
            "{what}: {got} items where {want} are needed"
        )));
    }
    Ok(())
}

/// `out` must share no byte with an input: the core reads the inputs while
/// it writes `out` (a shared and a mutable slice of one memory are unsound).
fn apart(out: &Typed, out_bytes: usize, input: &Typed, input_bytes: usize, what: &str) -> PyResult<()> {
    apart_named((out, out_bytes, "out"), (input, input_bytes, what))
}

/// [`apart`] of any two buffers, each named in the error.
fn apart_named(a: (&Typed, usize, &str), b: (&Typed, usize, &str)) -> PyResult<()> {
    let (x, y) = (a.0.ptr() as usize, b.0.ptr() as usize);
    if a.1 > 0 && b.1 > 0 && x < y + b.1 && y < x + a.1 {
        return Err(PyValueError::new_err(format!("{} overlaps {}", a.2, b.2)));
    }
    Ok(())
}

/// Per-row `max(|x|)` of `weight` (bf16 bits, `rows` x `cols`) into `out`
/// (bf16 bits, one per row); `True` if an element is NaN (`out` unusable).
#[pyfunction]
pub(super) fn fp8_row_abs_max(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    cols: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let src = Typed::new::<u16>(weight, false, "weight")?;
    let dst = Typed::new::<u16>(out, true, "out")?;
    check(src.len, items(dst.len, cols, "weight")?, "weight")?;
    apart(&dst, dst.len * 2, &src, src.len * 2, "weight")?;
    let (s, d) = (src.ptr() as usize, dst.ptr() as usize);
    let (n_src, n_dst) = (src.len, dst.len);
    // SAFETY: both exports are C-contiguous, aligned for u16 and of the
    // lengths checked above (no overflow), alive until `src` / `dst` drop
    // after this call; `out` shares no byte with the weight (checked); the
    // caller's contract keeps the weight unwritten while the GIL is released.
    // An empty export's pointer is never dereferenced: the slices are empty.
    let nan = py.detach(|| {
        foreground(|| unsafe {
            let src = shared::<u16>(s, n_src);
            let dst = exclusive::<u16>(d, n_dst);
            fp8::row_abs_max(src, cols, dst)
        })
    });
    drop((src, dst));
    Ok(nan)
}

/// Quantizes `weight` (bf16 bits, one row per `scale`, `cols` a row) into
/// `out` (bytes, e4m3fn): row-major, or transposed (`out[k * rows + n]`);
/// `True` if a quotient was NaN (`out` unusable).
#[pyfunction]
pub(super) fn fp8_quantize_rows(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    cols: usize,
    scale: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    transposed: bool,
) -> PyResult<bool> {
    let src = Typed::new::<u16>(weight, false, "weight")?;
    let sc = Typed::new::<f32>(scale, false, "scale")?;
    let dst = Typed::new::<u8>(out, true, "out")?;
    check(src.len, items(sc.len, cols, "weight")?, "weight")?;
    check(dst.len, src.len, "out")?;
    apart(&dst, dst.len, &src, src.len * 2, "weight")?;
    apart(&dst, dst.len, &sc, sc.len * 4, "scale")?;
    let (s, c, d) = (src.ptr() as usize, sc.ptr() as usize, dst.ptr() as usize);
    let (n_src, n_sc) = (src.len, sc.len);
    // SAFETY: as in `fp8_row_abs_max`: three live, C-contiguous, aligned
    // exports of the checked lengths (no overflow), `out` sharing no byte
    // with the inputs (checked), the inputs unwritten by anyone else while
    // the GIL is released; empty ones are never read.
    let nan = py.detach(|| {
        foreground(|| unsafe {
            let src = shared::<u16>(s, n_src);
            let sc = shared::<f32>(c, n_sc);
            let dst = exclusive::<u8>(d, n_src);
            fp8::quantize_rows(src, cols, sc, dst, transposed)
        })
    });
    drop((src, sc, dst));
    Ok(nan)
}

/// A transposed `[cols, total]` output of `out_len` bytes that rows
/// `first..first + rows` fit in (what `quantize_rows_into` asserts), or the error.
fn transposed_rows(out_len: usize, rows: usize, cols: usize, first: usize, total: usize) -> PyResult<()> {
    check(out_len, items(total, cols, "out")?, "out")?;
    if first.checked_add(rows).is_none_or(|end| end > total) {
        return Err(PyValueError::new_err(format!("rows {first}+{rows} of {total}")));
    }
    Ok(())
}

/// The rows of a piece of a weight read where they lie: row `n` is
/// `source[offset + n * stride..][..cols]` (bf16 bits), or the error.
fn piece<'a>(source: &'a [u16], offset: usize, stride: usize, rows: usize, cols: usize) -> PyResult<fp8::Rows<'a>> {
    fp8::Rows::new(source, offset, stride, rows, cols).ok_or_else(|| {
        PyValueError::new_err(format!(
            "source: {rows} rows of {cols} at {offset}, {stride} apart, end past its {} items",
            source.len()
        ))
    })
}

/// [`fp8_row_abs_max`] of a piece of a weight read where it lies (one row of
/// `cols` every `stride` items of `source` from `offset`) into `out` (one
/// per row).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn fp8_row_abs_max_piece(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    offset: usize,
    stride: usize,
    rows: usize,
    cols: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let src = Typed::new::<u16>(source, false, "source")?;
    let dst = Typed::new::<u16>(out, true, "out")?;
    check(dst.len, rows, "out")?;
    apart(&dst, dst.len * 2, &src, src.len * 2, "source")?;
    let (s, d) = (src.ptr() as usize, dst.ptr() as usize);
    let (n_src, n_dst) = (src.len, dst.len);
    // SAFETY: as in `fp8_row_abs_max`: two live, C-contiguous, aligned
    // exports of the lengths read from them, `out` sharing no byte with the
    // source (checked); `piece` checks that every row lies inside the source
    // before anything is read; the caller's contract keeps the source
    // unwritten while the GIL is released.
    let nan = py.detach(|| {
        foreground(|| unsafe {
            let src = shared::<u16>(s, n_src);
            let dst = exclusive::<u16>(d, n_dst);
            piece(src, offset, stride, rows, cols).map(|p| fp8::rows_abs_max(p, dst))
        })
    })?;
    drop((src, dst));
    Ok(nan)
}

/// Quantizes a piece of a weight read where it lies (as in
/// [`fp8_row_abs_max_piece`]), one `scale` a row, into rows
/// `first..first + rows` of the transposed `[cols, total]` output `out`
/// (`out[k * total + first + n]`); `True` if a quotient was NaN.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn fp8_quantize_piece(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    offset: usize,
    stride: usize,
    rows: usize,
    cols: usize,
    scale: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    first: usize,
    total: usize,
) -> PyResult<bool> {
    let src = Typed::new::<u16>(source, false, "source")?;
    let sc = Typed::new::<f32>(scale, false, "scale")?;
    let dst = Typed::new::<u8>(out, true, "out")?;
    check(sc.len, rows, "scale")?;
    transposed_rows(dst.len, rows, cols, first, total)?;
    apart(&dst, dst.len, &src, src.len * 2, "source")?;
    apart(&dst, dst.len, &sc, sc.len * 4, "scale")?;
    let (s, c, d) = (src.ptr() as usize, sc.ptr() as usize, dst.ptr() as usize);
    let (n_src, n_sc, n_dst) = (src.len, sc.len, dst.len);
    // SAFETY: as in `fp8_quantize_rows`: three live, C-contiguous, aligned
    // exports of the lengths read from them, `out` sharing no byte with the
    // inputs (checked); `piece` checks that every row lies inside the source,
    // and the lengths and row range (checked above) are what
    // `quantize_rows_into` asserts; the caller's contract keeps the source
    // and the scales unwritten while the GIL is released.
    let nan = py.detach(|| {
        foreground(|| unsafe {
            let src = shared::<u16>(s, n_src);
            let sc = shared::<f32>(c, n_sc);
            let dst = exclusive::<u8>(d, n_dst);
            piece(src, offset, stride, rows, cols)
                .map(|p| fp8::quantize_rows_into(fp8::widest(), p, sc, dst, first, total))
        })
    })?;
    drop((src, sc, dst));
    Ok(nan)
}

/// [`fp8_quantize_piece`] by each row's own scale, vLLM's from its amax
/// (`crate::fp8::channel_scale`), in one read of the piece: each row's amax
/// (bf16 bits) and scale are written into `amax` and `scale` (one per row);
/// `True` if a weight was NaN (nothing written is usable).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn fp8_amax_quantize_piece(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    offset: usize,
    stride: usize,
    rows: usize,
    cols: usize,
    amax: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    first: usize,
    total: usize,
) -> PyResult<bool> {
    let src = Typed::new::<u16>(source, false, "source")?;
    let am = Typed::new::<u16>(amax, true, "amax")?;
    let sc = Typed::new::<f32>(scale, true, "scale")?;
    let dst = Typed::new::<u8>(out, true, "out")?;
    check(am.len, rows, "amax")?;
    check(sc.len, rows, "scale")?;
    transposed_rows(dst.len, rows, cols, first, total)?;
    // Every output apart from the source and from one another.
    let buffers = [
        (&dst, dst.len, "out"),
        (&am, am.len * 2, "amax"),
        (&sc, sc.len * 4, "scale"),
        (&src, src.len * 2, "source"),
    ];
    for (i, a) in buffers.iter().enumerate() {
        for b in &buffers[i + 1..] {
            apart_named(*a, *b)?;
        }
    }
    let (s, a, c, d) = (
        src.ptr() as usize,
        am.ptr() as usize,
        sc.ptr() as usize,
        dst.ptr() as usize,
    );
    let (n_src, n_dst) = (src.len, dst.len);
    // SAFETY: as in `fp8_quantize_piece`: four live, C-contiguous, aligned
    // exports of the lengths read from them; the three outputs share no byte
    // with the source or one another (checked); `piece` checks that every
    // row lies inside the source, and the lengths and row range (checked
    // above) are what `amax_quantize_rows_into` asserts; the caller's
    // contract keeps the source unwritten while the GIL is released.
    let nan = py.detach(|| {
        foreground(|| unsafe {
            let src = shared::<u16>(s, n_src);
            let am = exclusive::<u16>(a, rows);
            let sc = exclusive::<f32>(c, rows);
            let dst = exclusive::<u8>(d, n_dst);
            piece(src, offset, stride, rows, cols)
                .map(|p| fp8::amax_quantize_rows_into(fp8::widest(), p, am, sc, dst, first, total))
        })
    })?;
    drop((src, am, sc, dst));
    Ok(nan)
}
