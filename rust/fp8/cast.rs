//! The element arithmetic of the FP8 cast: torch's fp32 -> e4m3fn routine,
//! one row quantized by a scale (or by the scale of its own amax), each
//! loop built for the widest vector extension this CPU has (detected at run
//! time, a portable build otherwise).

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

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
pub(super) fn quantize(x: u16, scale: f32) -> u8 {
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

/// vLLM's per-channel scale of a row's amax (`_fp8_channel_scale` in its
/// online FP8 module): `amax / 448` in fp32, at least `1 / (448 * 512)`.
/// A prediction only: a caller uses a cast by it where the scale vLLM then
/// passes is bit for bit this one.
#[inline(always)]
pub fn channel_scale(amax: u16) -> f32 {
    const FLOOR: f32 = 1.0 / (E4M3_MAX * 512.0);
    (bf16_to_f32(amax) / E4M3_MAX).max(FLOOR)
}

/// `max(|x|)` of a row of bf16 bits, as bf16 bits (above `0x7f80`: a NaN).
/// For every non-NaN bf16, the magnitude's order is the order of its bits
/// with the sign cleared (infinity included).
#[inline(always)]
pub fn abs_max_bits(row: &[u16]) -> u16 {
    row.iter().fold(0u16, |acc, &x| acc.max(x & 0x7fff))
}

/// `row` cast into `out` by `scale`, or (`None`) by the [`channel_scale`]
/// of its own amax: `(amax, scale, nan)`, the amax 0 where the scale was
/// given. The amax is a second read of a row the cast reads from L1 next.
#[inline(always)]
fn cast_row_generic(row: &[u16], scale: Option<f32>, out: &mut [u8]) -> (u16, f32, bool) {
    match scale {
        Some(s) => (0, s, quantize_slice_generic(row, s, out)),
        None => {
            let top = abs_max_bits(row);
            let s = channel_scale(top);
            (top, s, quantize_slice_generic(row, s, out) || top > 0x7f80)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn cast_row_avx2(row: &[u16], scale: Option<f32>, out: &mut [u8]) -> (u16, f32, bool) {
    cast_row_generic(row, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn cast_row_avx512(row: &[u16], scale: Option<f32>, out: &mut [u8]) -> (u16, f32, bool) {
    cast_row_generic(row, scale, out)
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

/// [`cast_row_generic`] by the build of the loop `width` names.
///
/// # Panics
/// If `width` is wider than this CPU supports ([`widest`]).
#[inline]
pub(super) fn cast_row(width: Width, row: &[u16], scale: Option<f32>, out: &mut [u8]) -> (u16, f32, bool) {
    match width {
        Width::Portable => cast_row_generic(row, scale, out),
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => {
            assert!(widest() != Width::Portable, "AVX2 is not available");
            // SAFETY: the CPU has AVX2 and FMA (checked above: `widest`
            // detects them at run time before naming a wider build).
            unsafe { cast_row_avx2(row, scale, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => {
            assert!(widest() == Width::Avx512, "AVX-512 is not available");
            // SAFETY: the CPU has AVX-512 F, BW and VL (detected at run time).
            unsafe { cast_row_avx512(row, scale, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => cast_row_generic(row, scale, out),
    }
}
