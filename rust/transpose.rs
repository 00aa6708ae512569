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
#[inline]
pub unsafe fn transpose16(src: *const u8, src_pitch: isize, dst: *mut u8, dst_pitch: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8};
    // SAFETY: each load reads 16 readable bytes (the caller's contract);
    // loadu allows any alignment. SSE2 is part of the x86-64 baseline.
    let mut rows: [__m128i; 16] =
        std::array::from_fn(|r| unsafe { _mm_loadu_si128(src.offset(r as isize * src_pitch).cast()) });
    for _ in 0..4 {
        rows = std::array::from_fn(|k| {
            let (a, b) = (rows[k / 2], rows[k / 2 + 8]);
            // SAFETY: SSE2 is part of the x86-64 baseline: every x86-64 CPU runs it.
            unsafe {
                if k % 2 == 0 {
                    _mm_unpacklo_epi8(a, b)
                } else {
                    _mm_unpackhi_epi8(a, b)
                }
            }
        });
    }
    for (c, row) in rows.iter().enumerate() {
        // SAFETY: 16 writable bytes at `dst + c * dst_pitch` (the caller's
        // contract); storeu allows any alignment.
        unsafe { _mm_storeu_si128(dst.add(c * dst_pitch).cast(), *row) };
    }
}

/// [`transpose16`] byte by byte: the portable fallback.
///
/// # Safety
/// As [`transpose16`].
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
