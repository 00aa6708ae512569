//! 16x16 byte-matrix transposes with SSE2 (part of every x86-64 CPU): the
//! transposed writes of the FP8 cast ([`crate::fp8`], a tile of rows at a
//! time: [`write_tile_transposed`]) and the transposed reads of a strided
//! view's gather ([`crate::strided`]), each a byte at a time before.

/// Whole blocks this module transposes: 16 rows of 16 bytes.
pub const BLOCK: usize = 16;

/// `dst[c * dst_pitch + r] = src[r * src_pitch + c]` for `r, c < 16`: four
/// rounds of interleaving the bytes of rows `i` and `i + 8` (each round
/// rotates an element's 8-bit address, row bits then column bits, by one;
/// four rotations swap row and column).
///
/// # Safety
/// The 16 bytes at `src + r * src_pitch` must be readable and the 16 bytes
/// at `dst + c * dst_pitch` writable, for every `r, c < 16`; the two
/// regions must not overlap.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn transpose16(src: *const u8, src_pitch: isize, dst: *mut u8, dst_pitch: usize) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_setzero_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8,
    };
    // Plain fixed-count loops over arrays, no closures: LLVM unrolls them
    // and keeps the rows in registers. (Built with `array::from_fn` and a
    // branch on the index, each round was a loop with a 256-byte `memcpy`,
    // and the FP8 cast's transposed writes ran at a quarter of its speed.)
    // SAFETY: SSE2 is part of every x86-64 CPU.
    let mut rows: [__m128i; 16] = [unsafe { _mm_setzero_si128() }; 16];
    for (r, row) in rows.iter_mut().enumerate() {
        // SAFETY: the caller makes the 16 bytes at src + r * src_pitch readable.
        *row = unsafe { _mm_loadu_si128(src.offset(r as isize * src_pitch).cast()) };
    }
    for _ in 0..4 {
        let mut next = rows;
        for k in 0..8 {
            // SAFETY: SSE2 is part of every x86-64 CPU.
            unsafe {
                next[2 * k] = _mm_unpacklo_epi8(rows[k], rows[k + 8]);
                next[2 * k + 1] = _mm_unpackhi_epi8(rows[k], rows[k + 8]);
            }
        }
        rows = next;
    }
    for (c, row) in rows.iter().enumerate() {
        // SAFETY: the caller makes the 16 bytes at dst + c * dst_pitch writable.
        unsafe { _mm_storeu_si128(dst.add(c * dst_pitch).cast(), *row) };
    }
}

/// The portable build of the x86-64 one above.
///
/// # Safety
/// As the x86-64 build: the 16 rows of 16 bytes at `src` readable, at `dst`
/// writable, the two regions apart.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub unsafe fn transpose16(src: *const u8, src_pitch: isize, dst: *mut u8, dst_pitch: usize) {
    for r in 0..BLOCK {
        for c in 0..BLOCK {
            // SAFETY: inside the regions the caller vouches for.
            unsafe { *dst.add(c * dst_pitch + r) = *src.offset(r as isize * src_pitch + c as isize) };
        }
    }
}

/// The tile height whose output runs are written by streaming stores: 64
/// bytes, a whole cache line of each output row where the output is 64-byte
/// aligned (only then are streaming stores used: a line written in two
/// parts by them is flushed twice).
const STREAMED: usize = 64;

/// 64 bytes from `src` to `dst` with streaming stores: an output line written
/// whole, never read first and not kept in cache.
///
/// # Safety
/// 64 bytes readable at `src`, writable at `dst` (64-byte aligned).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream64(src: *const u8, dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    for q in 0..4 {
        // SAFETY: the caller's: in bounds, `dst` aligned.
        unsafe {
            _mm_stream_si128(
                dst.add(16 * q).cast::<__m128i>(),
                _mm_loadu_si128(src.add(16 * q).cast()),
            )
        };
    }
}

/// `dst[k * pitch + i] = tile[i * cols + k]` for `i < height`, `k < cols`:
/// whole 16x16 blocks by [`transpose16`], the ragged edges byte by byte.
///
/// # Safety
/// `dst + k * pitch + i` must be writable for every such `k, i`, and no
/// other thread may touch those bytes meanwhile.
pub unsafe fn write_tile_transposed(tile: &[u8], height: usize, cols: usize, dst: *mut u8, pitch: usize) {
    assert_eq!(tile.len(), height * cols, "the tile holds its rows");
    let (full_i, full_k) = (height / BLOCK * BLOCK, cols / BLOCK * BLOCK);
    #[cfg(target_arch = "x86_64")]
    if height == STREAMED && (dst as usize).is_multiple_of(STREAMED) && pitch.is_multiple_of(STREAMED) {
        let mut stage = [0u8; BLOCK * STREAMED];
        for k0 in (0..full_k).step_by(BLOCK) {
            for i0 in (0..STREAMED).step_by(BLOCK) {
                // SAFETY: tile rows i0..i0+16, bytes k0..k0+16 lie in the tile;
                // stage rows c * STREAMED + i0..+16 (c < 16) lie in the stage.
                unsafe {
                    transpose16(
                        tile.as_ptr().add(i0 * cols + k0),
                        cols as isize,
                        stage.as_mut_ptr().add(i0),
                        STREAMED,
                    )
                };
            }
            for c in 0..BLOCK {
                // SAFETY: 64 bytes at dst + (k0 + c) * pitch are the caller's
                // to write (k0 + c < cols, height == 64), 64-byte aligned
                // (checked above); the stage's row c is 64 bytes.
                unsafe { stream64(stage.as_ptr().add(c * STREAMED), dst.add((k0 + c) * pitch)) };
            }
        }
        // SAFETY: SSE2; orders the streaming stores before the task ends.
        unsafe { std::arch::x86_64::_mm_sfence() };
        for k in full_k..cols {
            for i in 0..height {
                // SAFETY: a byte the caller owns.
                unsafe { *dst.add(k * pitch + i) = tile[i * cols + k] };
            }
        }
        return;
    }
    for k0 in (0..full_k).step_by(BLOCK) {
        for i0 in (0..full_i).step_by(BLOCK) {
            // SAFETY: tile rows i0..i0+16, bytes k0..k0+16 lie in the tile
            // (i0 + 16 <= height, k0 + 16 <= cols); the destination bytes
            // are the caller's to write.
            unsafe {
                transpose16(
                    tile.as_ptr().add(i0 * cols + k0),
                    cols as isize,
                    dst.add(k0 * pitch + i0),
                    pitch,
                )
            };
        }
    }
    for k in 0..cols {
        let from_i = if k < full_k { full_i } else { 0 };
        for i in from_i..height {
            // SAFETY: as above: a byte the caller owns.
            unsafe { *dst.add(k * pitch + i) = tile[i * cols + k] };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes_with_pitches() {
        let (sp, dp) = (37usize, 23usize);
        let src: Vec<u8> = (0..16 * sp).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; 16 * dp];
        // SAFETY: 16 rows of 16 bytes at pitch `sp` / `dp` lie inside the vectors.
        unsafe { transpose16(src.as_ptr(), sp as isize, dst.as_mut_ptr(), dp) };
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(dst[c * dp + r], src[r * sp + c], "({r}, {c})");
            }
        }
    }
}
