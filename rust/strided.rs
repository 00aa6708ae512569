//! Hashing a strided (non-contiguous) array as if it were contiguous.
//!
//! The digest of a tensor is defined over its C-order bytes, i.e. over
//! `.contiguous()`. Rather than materialising that copy (a whole tensor's
//! worth of memory), the elements are gathered in C order into a small
//! scratch buffer, one bounded piece at a time, and streamed into SHA-256.

use crate::sha256::{Digest, Kernel, Sha256};
use crate::transpose::{transpose16, BLOCK};

/// Scratch size for one gather: bounded memory, large enough to amortise calls.
pub const GATHER_BYTES: usize = 1 << 20;

/// A read-only view of `shape` elements of `itemsize` bytes at byte `strides`.
#[derive(Clone, Debug)]
pub struct StridedView {
    ptr: *const u8,
    itemsize: usize,
    shape: Vec<usize>,
    strides: Vec<isize>,
}

// SAFETY: a `StridedView` is only a description of memory that its creator
// promised (see `new`) stays alive, readable and unwritten by anyone for the
// view's lifetime; it never writes, so reading it from another thread (the
// scheduler's workers) is as sound as reading it from this one.
unsafe impl Send for StridedView {}
unsafe impl Sync for StridedView {}

/// Writes item `i` of `src` (items of `item` bytes) at `dst[i * pitch..]`:
/// one column of a band. Fixed widths for the common item sizes, so that
/// each is one load and one store.
#[inline]
fn scatter(src: &[u8], dst: &mut [u8], item: usize, pitch: usize) {
    match item {
        1 => {
            for (i, &b) in src.iter().enumerate() {
                dst[i * pitch] = b;
            }
        }
        2 => scatter_fixed::<2>(src, dst, pitch),
        4 => scatter_fixed::<4>(src, dst, pitch),
        8 => scatter_fixed::<8>(src, dst, pitch),
        _ => {
            for (i, value) in src.chunks_exact(item).enumerate() {
                dst[i * pitch..i * pitch + item].copy_from_slice(value);
            }
        }
    }
}

#[inline]
fn scatter_fixed<const N: usize>(src: &[u8], dst: &mut [u8], pitch: usize) {
    for (i, value) in src.chunks_exact(N).enumerate() {
        let value: &[u8; N] = value.try_into().expect("chunks of N bytes");
        let at: &mut [u8; N] = (&mut dst[i * pitch..i * pitch + N]).try_into().expect("N bytes");
        *at = *value;
    }
}

/// Rows of a transposed view gathered together ([`StridedView::gather`]):
/// 64 rows of an 8K-wide FP8 weight are a 512 KiB band, inside L2.
const TRANSPOSE_BAND: usize = 64;

impl StridedView {
    /// # Safety
    /// For every index tuple `i` within `shape`, the `itemsize` bytes at
    /// `ptr + sum(i[d] * strides[d])` must be readable for as long as the
    /// view is used, and nobody may write them meanwhile (from any thread,
    /// or a device): the view hands them out as `&[u8]` (for a tensor, the
    /// caller's contract that the model is not updated during a checksum).
    /// When any extent is zero, `ptr` is never read.
    pub unsafe fn new(ptr: *const u8, itemsize: usize, shape: Vec<usize>, strides: Vec<isize>) -> StridedView {
        assert_eq!(shape.len(), strides.len());
        StridedView {
            ptr,
            itemsize,
            shape,
            strides,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> usize {
        self.numel() * self.itemsize
    }

    /// True when the bytes are already laid out in C order with no gaps.
    /// Extents of one do not constrain their stride (as in torch and numpy).
    pub fn is_c_contiguous(&self) -> bool {
        let mut expected = self.itemsize as isize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n as isize;
        }
        true
    }

    /// The bytes as one slice, when the view is C-contiguous.
    pub fn as_contiguous(&self) -> Option<&[u8]> {
        if !self.is_c_contiguous() {
            return None;
        }
        let len = self.nbytes();
        if len == 0 {
            return Some(&[]);
        }
        // SAFETY: contiguous, so the elements are exactly the `len` bytes
        // from `ptr`, readable and unwritten while borrowed, per the
        // contract of `new`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, len) })
    }

    /// Calls `f` with consecutive pieces of the C-order bytes, each at most
    /// [`GATHER_BYTES`] (at least one row of the innermost dimension).
    pub fn for_each_piece(&self, mut f: impl FnMut(&[u8])) {
        if let Some(bytes) = self.as_contiguous() {
            for piece in bytes.chunks(GATHER_BYTES) {
                f(piece);
            }
            return;
        }
        if self.numel() == 0 {
            return;
        }
        let nd = self.shape.len();
        if nd >= 2 && self.strides[nd - 1] != self.itemsize as isize && self.strides[nd - 2] == self.itemsize as isize {
            // A transposed matrix: gathered in bands (see `gather_transposed`).
            let (mut row, mut piece) = (0, Vec::with_capacity(GATHER_BYTES));
            while row < self.rows() {
                piece.clear();
                self.gather_transposed(&mut row, &mut piece, GATHER_BYTES);
                f(&piece);
            }
            return;
        }
        // Merge the innermost run when it is contiguous: whole rows are copied
        // with one memcpy, otherwise element by element.
        let (inner_n, inner_s) = (self.shape[nd - 1], self.strides[nd - 1]);
        let row_bytes = inner_n * self.itemsize;
        let row_contiguous = inner_s == self.itemsize as isize;
        let outer = &self.shape[..nd - 1];
        let outer_strides = &self.strides[..nd - 1];
        let mut scratch: Vec<u8> = Vec::with_capacity(GATHER_BYTES.max(row_bytes));
        let mut index = vec![0usize; outer.len()];
        let mut offset: isize = 0;
        loop {
            // SAFETY: `offset` is the byte offset of element (index.., 0) and
            // the row's elements lie at `offset + k * inner_s`, all inside the
            // view, readable and unwritten, per the contract of `new`.
            unsafe {
                let row = self.ptr.offset(offset);
                if row_contiguous {
                    scratch.extend_from_slice(std::slice::from_raw_parts(row, row_bytes));
                } else {
                    for k in 0..inner_n {
                        let e = row.offset(k as isize * inner_s);
                        scratch.extend_from_slice(std::slice::from_raw_parts(e, self.itemsize));
                    }
                }
            }
            if scratch.len() + row_bytes > scratch.capacity() {
                f(&scratch);
                scratch.clear();
            }
            // Odometer over the outer dimensions, last fastest.
            let mut d = outer.len();
            loop {
                if d == 0 {
                    if !scratch.is_empty() {
                        f(&scratch);
                    }
                    return;
                }
                d -= 1;
                index[d] += 1;
                offset += outer_strides[d];
                if index[d] < outer[d] {
                    break;
                }
                offset -= outer_strides[d] * outer[d] as isize;
                index[d] = 0;
            }
        }
    }

    /// Rows of the innermost dimension (the unit [`StridedView::gather`] copies).
    pub fn rows(&self) -> usize {
        match self.shape.split_last() {
            Some((&inner, outer)) if inner > 0 => outer.iter().product(),
            _ => 0,
        }
    }

    /// The rows in C order as slices of the memory itself, where each row is
    /// contiguous (the innermost stride is the item size); `None` otherwise.
    pub fn contiguous_rows(&self) -> Option<Vec<&[u8]>> {
        let nd = self.shape.len();
        if nd == 0 || self.strides[nd - 1] != self.itemsize as isize {
            return None;
        }
        let row_bytes = self.shape[nd - 1] * self.itemsize;
        let rows = self.rows();
        let mut out = Vec::with_capacity(rows);
        for row in 0..rows {
            let (mut rest, mut offset) = (row, 0isize);
            for d in (0..nd - 1).rev() {
                offset += (rest % self.shape[d]) as isize * self.strides[d];
                rest /= self.shape[d];
            }
            // SAFETY: the row's `row_bytes` lie contiguously at `offset`, inside
            // the view, readable and unwritten for as long as the view is used
            // (the contract of `new`), which the borrow of `self` bounds.
            out.push(unsafe { std::slice::from_raw_parts(self.ptr.offset(offset), row_bytes) });
        }
        Some(out)
    }

    /// Appends the C-order bytes of rows `*row..` to `out`, whole rows, until
    /// one more would take `out` past `max` bytes (at least one row is
    /// appended); advances `*row`. Resumable: a caller hashes a view a
    /// bounded piece at a time, interleaved with other views.
    pub fn gather(&self, row: &mut usize, out: &mut Vec<u8>, max: usize) {
        let rows = self.rows();
        let nd = self.shape.len();
        let (inner_n, inner_s) = (self.shape[nd - 1], self.strides[nd - 1]);
        let row_bytes = inner_n * self.itemsize;
        if nd >= 2 && inner_s != self.itemsize as isize && self.strides[nd - 2] == self.itemsize as isize {
            self.gather_transposed(row, out, max);
            return;
        }
        while *row < rows && (out.is_empty() || out.len() + row_bytes <= max) {
            // The byte offset of element (index of `*row`.., 0): the flat row
            // number written in the outer dimensions' mixed radix.
            let (mut rest, mut offset) = (*row, 0isize);
            for d in (0..nd - 1).rev() {
                offset += (rest % self.shape[d]) as isize * self.strides[d];
                rest /= self.shape[d];
            }
            // SAFETY: the row's elements lie at `offset + k * inner_s`, inside
            // the view, readable and unwritten, per the contract of `new`.
            unsafe {
                let start = self.ptr.offset(offset);
                if inner_s == self.itemsize as isize {
                    out.extend_from_slice(std::slice::from_raw_parts(start, row_bytes));
                } else {
                    for k in 0..inner_n {
                        let e = start.offset(k as isize * inner_s);
                        out.extend_from_slice(std::slice::from_raw_parts(e, self.itemsize));
                    }
                }
            }
            *row += 1;
        }
    }

    /// [`StridedView::gather`] for a view whose rows are another tensor's
    /// columns (the second-to-last dimension's stride is the item size: a
    /// transposed matrix, as vLLM holds FP8 weights, `[K, N]` over `[N, K]`).
    /// Rows are gathered in bands of up to [`TRANSPOSE_BAND`]: element `k` of
    /// the band's rows lies contiguously in memory, so the reads run along
    /// the storage and only the writes, inside the band's output, are
    /// strided. Element by element, row after row, every read was a cache
    /// miss: an FP8 weight hashed at about a tenth of a contiguous one.
    fn gather_transposed(&self, row: &mut usize, out: &mut Vec<u8>, max: usize) {
        let nd = self.shape.len();
        let (inner_n, inner_s) = (self.shape[nd - 1], self.strides[nd - 1]);
        let (per_block, item) = (self.shape[nd - 2], self.itemsize);
        let row_bytes = inner_n * item;
        let rows = self.rows();
        while *row < rows && (out.is_empty() || out.len() + row_bytes <= max) {
            // Rows of one band share every outer index but the last one's.
            let left_in_block = per_block - *row % per_block;
            // At least one row (the while's condition), else what fits under `max`.
            let fits = (max.saturating_sub(out.len()) / row_bytes.max(1)).max(1);
            let band = TRANSPOSE_BAND.min(left_in_block).min(rows - *row).min(fits);
            let (mut rest, mut offset) = (*row, 0isize);
            for d in (0..nd - 1).rev() {
                offset += (rest % self.shape[d]) as isize * self.strides[d];
                rest /= self.shape[d];
            }
            let start = out.len();
            out.resize(start + band * row_bytes, 0);
            let dst = &mut out[start..];
            // One-byte items (FP8, int8) in whole 16x16 blocks with SSE2; the
            // rest (the ragged edges, wider items) element column by column.
            let (full_k, full_i) = if item == 1 {
                (inner_n / BLOCK * BLOCK, band / BLOCK * BLOCK)
            } else {
                (0, 0)
            };
            for k0 in (0..full_k).step_by(BLOCK) {
                for i0 in (0..full_i).step_by(BLOCK) {
                    // SAFETY: the 16 bytes at `offset + k * inner_s + i0` for
                    // k in k0..k0+16 are elements i0..i0+16 of the band (as
                    // below: inside the view, readable and unwritten); the 16
                    // bytes at `(i0 + c) * row_bytes + k0` for c < 16 lie in
                    // `dst` (`band * row_bytes` bytes, i0 + 16 <= band, k0 + 16
                    // <= inner_n = row_bytes), which the view cannot overlap.
                    unsafe {
                        transpose16(
                            self.ptr.offset(offset + k0 as isize * inner_s + i0 as isize),
                            inner_s,
                            dst.as_mut_ptr().add(i0 * row_bytes + k0),
                            row_bytes,
                        )
                    };
                }
            }
            for k in 0..inner_n {
                if k < full_k && full_i == band {
                    continue; // every element of this column is written above
                }
                // SAFETY: element k of rows `*row .. *row + band` lies at
                // `offset + k * inner_s + i * item` for i < band (the band
                // stays inside one block of the second-to-last dimension,
                // whose stride is `item`): `band * item` bytes inside the
                // view, readable and unwritten, per the contract of `new`.
                let src =
                    unsafe { std::slice::from_raw_parts(self.ptr.offset(offset + k as isize * inner_s), band * item) };
                // Rows full_i.. of a blocked column; all of any other.
                let from = if k < full_k { full_i } else { 0 };
                scatter(
                    &src[from * item..],
                    &mut dst[from * row_bytes + k * item..],
                    item,
                    row_bytes,
                );
            }
            *row += band;
        }
    }

    /// SHA-256 of the C-order bytes.
    pub fn digest(&self, kernel: Kernel) -> Digest {
        let mut s = Sha256::new();
        self.for_each_piece(|p| s.update_with(kernel, p));
        s.finalize_with(kernel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest as _;

    /// Gathering a bounded piece at a time, resumed, gives the C-order bytes.
    #[test]
    fn gather_resumes_where_it_stopped() {
        let data: Vec<u8> = (0..=255u8).cycle().take(7 * 10 * 3).collect();
        // A 7 x 5 x 3 view of bytes: every other column of a 7 x 10 x 3 array.
        let view = unsafe { StridedView::new(data.as_ptr(), 1, vec![7, 5, 3], vec![30, 6, 1]) };
        let mut whole = Vec::new();
        view.for_each_piece(|p| whole.extend_from_slice(p));
        for max in [1, 3, 7, 1 << 20] {
            let (mut row, mut out) = (0, Vec::new());
            while row < view.rows() {
                let mut piece = Vec::new();
                view.gather(&mut row, &mut piece, max);
                assert!(!piece.is_empty() && (piece.len() <= max.max(3)));
                out.extend_from_slice(&piece);
            }
            assert_eq!(out, whole, "max {max}");
        }
        let rows: Vec<u8> = view.contiguous_rows().unwrap().concat();
        assert_eq!(rows, whole);
        let transposed = unsafe { StridedView::new(data.as_ptr(), 1, vec![3, 70], vec![1, 3]) };
        assert!(transposed.contiguous_rows().is_none());
        let (mut row, mut out) = (0, Vec::new());
        transposed.gather(&mut row, &mut out, 1 << 20);
        let mut expected = Vec::new();
        transposed.for_each_piece(|p| expected.extend_from_slice(p));
        assert_eq!((row, out), (3, expected));
    }

    /// Transposed views (rows that are another array's columns), batched
    /// and 2-D, of 1-, 2- and 4-byte items, gathered in bounded pieces that
    /// start and end anywhere: the explicit C-order copy, element by element.
    #[test]
    fn transposed_bands_gather_the_c_order_bytes() {
        for item in [1usize, 2, 4] {
            // A batch of 3 matrices of 70 x 130 items, each viewed transposed: [3, 130, 70].
            let (batch, n, k) = (3usize, 70usize, 130usize);
            let data: Vec<u8> = (0..batch * n * k * item).map(|i| (i * 37 % 251) as u8).collect();
            let strides = vec![(n * k * item) as isize, item as isize, (k * item) as isize];
            let view = unsafe { StridedView::new(data.as_ptr(), item, vec![batch, k, n], strides) };
            let mut expect = Vec::new();
            for b in 0..batch {
                for row in 0..k {
                    for col in 0..n {
                        let at = ((b * n + col) * k + row) * item;
                        expect.extend_from_slice(&data[at..at + item]);
                    }
                }
            }
            for max in [1, n * item, 5 * n * item + 3, 1 << 20] {
                let (mut row, mut out) = (0, Vec::new());
                while row < view.rows() {
                    let mut piece = Vec::new();
                    view.gather(&mut row, &mut piece, max);
                    assert!(
                        !piece.is_empty() && piece.len() <= max.max(n * item),
                        "item {item} max {max}"
                    );
                    out.extend_from_slice(&piece);
                }
                assert_eq!(out, expect, "item {item} max {max}");
            }
        }
    }

    /// A transposed 2-D u16 array hashes like its explicit C-order copy.
    #[test]
    fn transposed_matches_explicit_copy() {
        let (rows, cols) = (37usize, 1000usize);
        let data: Vec<u16> = (0..rows * cols).map(|i| i as u16 ^ 0x5a5a).collect();
        // View of the transpose: shape (cols, rows), strides (2, 2*cols).
        let view = unsafe { StridedView::new(data.as_ptr().cast(), 2, vec![cols, rows], vec![2, 2 * cols as isize]) };
        assert!(!view.is_c_contiguous());
        let mut expect = Vec::new();
        for c in 0..cols {
            for r in 0..rows {
                expect.extend_from_slice(&data[r * cols + c].to_le_bytes());
            }
        }
        let want: [u8; 32] = sha2::Sha256::digest(&expect).into();
        for kernel in Kernel::all_available() {
            assert_eq!(view.digest(kernel).bytes, want);
        }
    }

    #[test]
    fn negative_strides_and_broadcast() {
        let data: Vec<u8> = (0..=255).collect();
        // Reversed: start at the end, stride -1.
        let rev = unsafe { StridedView::new(data.as_ptr().add(255), 1, vec![256], vec![-1]) };
        let mut expect = data.clone();
        expect.reverse();
        assert_eq!(
            rev.digest(Kernel::Portable).bytes,
            <[u8; 32]>::from(sha2::Sha256::digest(&expect))
        );
        // Broadcast row: stride 0 in the outer dimension.
        let bc = unsafe { StridedView::new(data.as_ptr(), 1, vec![3, 256], vec![0, 1]) };
        let expect: Vec<u8> = data.iter().copied().cycle().take(768).collect();
        assert_eq!(
            bc.digest(Kernel::Portable).bytes,
            <[u8; 32]>::from(sha2::Sha256::digest(&expect))
        );
    }

    #[test]
    fn empty_view_is_never_read() {
        let v = unsafe { StridedView::new(std::ptr::null(), 4, vec![0, 5], vec![20, 4]) };
        assert_eq!(
            v.digest(Kernel::Portable).hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
