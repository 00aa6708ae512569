//! Interleaved SHA-NI kernels: `N` independent SHA-256 streams per loop.
//!
//! One stream is latency-bound: every 64-byte block is a chain of 32
//! dependent `sha256rnds2` steps. Two or four unrelated messages have no
//! dependency between them, so advancing them in one loop lets the core issue
//! one stream's rounds while another's are in flight (~1.85x with two streams
//! on Zen 4). The round structure follows Intel's SHA extensions white paper,
//! as in the `sha2` crate's x86 kernel.

use std::arch::x86_64::*;

/// Run-time check for every feature the kernels enable.
pub(super) fn is_supported() -> bool {
    is_x86_feature_detected!("sha")
        && is_x86_feature_detected!("sse2")
        && is_x86_feature_detected!("ssse3")
        && is_x86_feature_detected!("sse4.1")
}

#[inline(always)]
fn round_constants(group: usize) -> __m128i {
    // SAFETY: group < 16, so the 16-byte load stays inside the 64-word table,
    // which is 64-byte aligned.
    unsafe { _mm_load_si128(super::ROUND_CONSTANTS.0.as_ptr().add(4 * group).cast()) }
}

/// One 4-round group `g` of every lane, in the instruction order of Intel's
/// reference (and of the C probe in `shared/shani-probe`): the first
/// `sha256rnds2` of every lane, then `sha256msg2` for the next group, the
/// second `sha256rnds2`, then `sha256msg1` for the group after. Each step is
/// issued for all lanes back to back, so independent instructions sit next
/// to each other, and the schedule is spread over the rounds instead of
/// computed in one burst (which kept more registers live and spilled with
/// four lanes). `w[l][g % 4]` holds the message words of group `g`.
#[inline(always)]
fn group<const N: usize>(abef: &mut [__m128i; N], cdgh: &mut [__m128i; N], w: &mut [[__m128i; 4]; N], g: usize) {
    let (mc, mn, mp) = (g % 4, (g + 1) % 4, (g + 3) % 4);
    // SAFETY (whole block): the SSE2/SHA intrinsics are available because
    // every caller is a `#[target_feature(enable = "sha,...")]` function
    // reached only after `is_supported()`.
    unsafe {
        let k = round_constants(g);
        let mut msg = [_mm_setzero_si128(); N];
        for l in 0..N {
            msg[l] = _mm_add_epi32(w[l][mc], k);
            cdgh[l] = _mm_sha256rnds2_epu32(cdgh[l], abef[l], msg[l]);
        }
        if (3..=14).contains(&g) {
            for wl in w.iter_mut() {
                let t = _mm_add_epi32(wl[mn], _mm_alignr_epi8(wl[mc], wl[mp], 4));
                wl[mn] = _mm_sha256msg2_epu32(t, wl[mc]);
            }
        }
        for l in 0..N {
            abef[l] = _mm_sha256rnds2_epu32(abef[l], cdgh[l], _mm_shuffle_epi32(msg[l], 0x0E));
        }
        if (1..=12).contains(&g) {
            for wl in w.iter_mut() {
                wl[mp] = _mm_sha256msg1_epu32(wl[mp], wl[mc]);
            }
        }
    }
}

/// Compresses `blocks[l].len() / 64` blocks into `states[l]` for each of the
/// `N` lanes; every lane must have the same number of whole blocks.
///
/// # Safety
/// The CPU must support `sha`, `sse2`, `ssse3` and `sse4.1` (see
/// [`is_supported`]).
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
pub(super) unsafe fn compress<const N: usize>(states: [&mut [u32; 8]; N], blocks: [&[u8]; N]) {
    let nblocks = blocks[0].len() / 64;
    // The pointer arithmetic below relies on every lane having `nblocks`
    // whole blocks; this check is what makes it sound.
    for b in &blocks {
        assert_eq!(b.len(), nblocks * 64, "lanes must have equal whole-block lengths");
    }
    let mask = _mm_set_epi64x(0x0C0D_0E0F_0809_0A0B, 0x0405_0607_0001_0203);

    let mut abef = [_mm_setzero_si128(); N];
    let mut cdgh = [_mm_setzero_si128(); N];
    for l in 0..N {
        // SAFETY: a `[u32; 8]` is 32 bytes, two unaligned 16-byte loads.
        let (dcba, hgfe) = unsafe {
            let p: *const __m128i = states[l].as_ptr().cast();
            (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)))
        };
        let cdab = _mm_shuffle_epi32(dcba, 0xB1);
        let efgh = _mm_shuffle_epi32(hgfe, 0x1B);
        abef[l] = _mm_alignr_epi8(cdab, efgh, 8);
        cdgh[l] = _mm_blend_epi16(efgh, cdab, 0xF0);
    }

    for i in 0..nblocks {
        let abef_save = abef;
        let cdgh_save = cdgh;
        let mut w = [[_mm_setzero_si128(); 4]; N];
        for l in 0..N {
            for (j, wj) in w[l].iter_mut().enumerate() {
                // SAFETY: i < nblocks and every lane holds nblocks * 64 bytes
                // (asserted above), so bytes [64 i + 16 j, +16) are in bounds.
                let v = unsafe { _mm_loadu_si128(blocks[l].as_ptr().add(64 * i + 16 * j).cast()) };
                *wj = _mm_shuffle_epi8(v, mask);
            }
        }
        // Written out group by group (constant `g`) so that the register
        // indices are constants and the schedule stays in registers.
        group(&mut abef, &mut cdgh, &mut w, 0);
        group(&mut abef, &mut cdgh, &mut w, 1);
        group(&mut abef, &mut cdgh, &mut w, 2);
        group(&mut abef, &mut cdgh, &mut w, 3);
        group(&mut abef, &mut cdgh, &mut w, 4);
        group(&mut abef, &mut cdgh, &mut w, 5);
        group(&mut abef, &mut cdgh, &mut w, 6);
        group(&mut abef, &mut cdgh, &mut w, 7);
        group(&mut abef, &mut cdgh, &mut w, 8);
        group(&mut abef, &mut cdgh, &mut w, 9);
        group(&mut abef, &mut cdgh, &mut w, 10);
        group(&mut abef, &mut cdgh, &mut w, 11);
        group(&mut abef, &mut cdgh, &mut w, 12);
        group(&mut abef, &mut cdgh, &mut w, 13);
        group(&mut abef, &mut cdgh, &mut w, 14);
        group(&mut abef, &mut cdgh, &mut w, 15);
        for l in 0..N {
            abef[l] = _mm_add_epi32(abef[l], abef_save[l]);
            cdgh[l] = _mm_add_epi32(cdgh[l], cdgh_save[l]);
        }
    }

    for l in 0..N {
        let feba = _mm_shuffle_epi32(abef[l], 0x1B);
        let dchg = _mm_shuffle_epi32(cdgh[l], 0xB1);
        let dcba = _mm_blend_epi16(feba, dchg, 0xF0);
        let hgef = _mm_alignr_epi8(dchg, feba, 8);
        // SAFETY: two 16-byte stores into a 32-byte `[u32; 8]`.
        unsafe {
            let p: *mut __m128i = states[l].as_mut_ptr().cast();
            _mm_storeu_si128(p, dcba);
            _mm_storeu_si128(p.add(1), hgef);
        }
    }
}
