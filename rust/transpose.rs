//! 16x16 byte-matrix transposes with SSE2 (part of every x86-64 CPU): the
//! transposed writes of the FP8 cast ([`crate::fp8`]) and the transposed
//! reads of a strided view's gather ([`crate::strided`]), each a byte at a
//! time before.

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
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8};
    // Plain fixed-count loops over arrays, no closures: LLVM unrolls them
    // and keeps the rows in registers. (Built with `array::from_fn` and a
    // branch on the index, each round was a loop with a 256-byte `memcpy`,
    // and the FP8 cast's transposed writes ran at a quarter of its speed.)
    let mut rows = [[0u8; 16]; 16].map(|_| unsafe { std::mem::zeroed::<__m128i>() });
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
