//! 16-lane AVX-512 multi-buffer SHA-256: sixteen independent messages, one
//! in each 32-bit lane of a zmm register (the scheme of isa-l_crypto's
//! `sha256_mb` and minio's sha256-simd).
//!
//! SHA-NI runs one message's rounds on a port that issues `sha256rnds2`
//! only every ~2.9 cycles on Sapphire/Emerald Rapids, so those cores stop
//! near 1.9 GB/s however many streams are interleaved; this kernel does the
//! rounds with plain vector ops (`vprord`, `vpternlogd` for Ch, Maj and the
//! three-way xors), sixteen messages per instruction. Measured with
//! `shared/mb-probe` (one core, L2-hot): Intel family 6 model 207 2.9-3.2
//! GB/s against SHA-NI's 1.9; AMD family 26 model 2 4.5 GB/s against SHA-NI
//! x4's 3.9. Which kernel a run uses is decided by calibration on the CPU at
//! hand ([`super::Kernel::wide_rate`]), never by these figures.
//!
//! Each block of the sixteen messages is loaded as sixteen rows of sixteen
//! words and transposed (unpack 32, unpack 64, two rounds of 128-bit
//! shuffles), so that register `t` holds word `t` of every message.

use std::arch::x86_64::*;

/// Messages advanced together.
pub(super) const LANES: usize = 16;

/// Run-time check for every feature the kernel enables.
pub(super) fn is_supported() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

// The helpers carry the kernel's target features (so that the intrinsics
// are safe to call in them, and they inline into it); they are private and
// called only from `compress`, itself reached only after `is_supported()`.

#[target_feature(enable = "avx512f")]
#[inline]
fn big_sigma0(a: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0x96>(
        _mm512_ror_epi32::<2>(a),
        _mm512_ror_epi32::<13>(a),
        _mm512_ror_epi32::<22>(a),
    )
}

#[target_feature(enable = "avx512f")]
#[inline]
fn big_sigma1(e: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0x96>(
        _mm512_ror_epi32::<6>(e),
        _mm512_ror_epi32::<11>(e),
        _mm512_ror_epi32::<25>(e),
    )
}

#[target_feature(enable = "avx512f")]
#[inline]
fn small_sigma0(x: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0x96>(
        _mm512_ror_epi32::<7>(x),
        _mm512_ror_epi32::<18>(x),
        _mm512_srli_epi32::<3>(x),
    )
}

#[target_feature(enable = "avx512f")]
#[inline]
fn small_sigma1(x: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0x96>(
        _mm512_ror_epi32::<17>(x),
        _mm512_ror_epi32::<19>(x),
        _mm512_srli_epi32::<10>(x),
    )
}

/// Transposes 16 rows of 16 words in place: afterwards `r[t]` holds word
/// `t` of every row, row `i` in lane `i`.
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(r: &mut [__m512i; 16]) {
    // Pairs of rows interleaved by 32-bit words, then quads by 64-bit words:
    // q[4k + j] holds words j, j+4, j+8, j+12 (one per 128-bit lane) of rows
    // 4k..4k+4, in row order within each lane.
    let mut t = [_mm512_setzero_si512(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    let mut q = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        q[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        q[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        q[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        q[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    // 128-bit lanes: gather word j of rows 0-3, 4-7, 8-11, 12-15 into one
    // register, for j, j+4, j+8, j+12.
    for j in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0x88>(q[j], q[4 + j]);
        let v1 = _mm512_shuffle_i32x4::<0xDD>(q[j], q[4 + j]);
        let v2 = _mm512_shuffle_i32x4::<0x88>(q[8 + j], q[12 + j]);
        let v3 = _mm512_shuffle_i32x4::<0xDD>(q[8 + j], q[12 + j]);
        r[j] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
        r[j + 8] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
        r[j + 4] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
        r[j + 12] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
    }
}

/// Compresses the whole blocks of sixteen independent streams into their
/// states; every lane must have the same number of whole blocks.
///
/// # Safety
/// The CPU must support `avx512f` and `avx512bw` (see [`is_supported`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn compress(states: [&mut [u32; 8]; LANES], blocks: [&[u8]; LANES]) {
    let nblocks = blocks[0].len() / 64;
    // The loads below read 64 bytes at 64 i of every lane for i < nblocks;
    // this check is what makes them sound.
    for b in &blocks {
        assert_eq!(b.len(), nblocks * 64, "lanes must have equal whole-block lengths");
    }
    // Big-endian words: reverse the bytes of every 32-bit word.
    let bswap = _mm512_broadcast_i32x4(_mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3));

    // State word j of every lane in s[j].
    let mut s = [_mm512_setzero_si512(); 8];
    for (j, word) in s.iter_mut().enumerate() {
        let lanes: [u32; LANES] = std::array::from_fn(|l| states[l][j]);
        // SAFETY: a [u32; 16] is 64 bytes, one unaligned load.
        *word = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
    }

    for i in 0..nblocks {
        let mut w = [_mm512_setzero_si512(); 16];
        for (l, row) in w.iter_mut().enumerate() {
            // SAFETY: i < nblocks and every lane holds nblocks * 64 bytes
            // (asserted above), so bytes [64 i, 64 i + 64) are in bounds.
            *row = unsafe { _mm512_loadu_si512(blocks[l].as_ptr().add(64 * i).cast()) };
        }
        transpose16(&mut w);
        for word in w.iter_mut() {
            *word = _mm512_shuffle_epi8(*word, bswap);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = s;
        for t in 0..64 {
            if t >= 16 {
                let next = _mm512_add_epi32(
                    _mm512_add_epi32(small_sigma1(w[(t + 14) % 16]), w[(t + 9) % 16]),
                    _mm512_add_epi32(small_sigma0(w[(t + 1) % 16]), w[t % 16]),
                );
                w[t % 16] = next;
            }
            let k = _mm512_set1_epi32(super::ROUND_CONSTANTS.0[t] as i32);
            let ch = _mm512_ternarylogic_epi32::<0xCA>(e, f, g);
            let t1 = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_add_epi32(h, big_sigma1(e)), _mm512_add_epi32(ch, k)),
                w[t % 16],
            );
            let t2 = _mm512_add_epi32(big_sigma0(a), _mm512_ternarylogic_epi32::<0xE8>(a, b, c));
            h = g;
            g = f;
            f = e;
            e = _mm512_add_epi32(d, t1);
            d = c;
            c = b;
            b = a;
            a = _mm512_add_epi32(t1, t2);
        }
        for (word, new) in s.iter_mut().zip([a, b, c, d, e, f, g, h]) {
            *word = _mm512_add_epi32(*word, new);
        }
    }

    for (j, word) in s.iter().enumerate() {
        let mut lanes = [0u32; LANES];
        // SAFETY: a [u32; 16] is 64 bytes, one unaligned store.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), *word) };
        for (l, v) in lanes.iter().enumerate() {
            states[l][j] = *v;
        }
    }
    // The SHA-NI kernels that may run next on this thread are legacy-SSE
    // encoded: leave the upper halves of the vector registers clean so that
    // no SSE/AVX transition (or false dependency on them) follows.
    _mm256_zeroupper();
}
