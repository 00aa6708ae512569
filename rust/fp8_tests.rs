//! Tests of the FP8 cast: known values, the transposed layout at ragged
//! sizes, pieces read where they lie, and NaN reporting.

use super::*;

#[test]
fn e4m3fn_known_values() {
    assert_eq!(e4m3fn_from_f32(0.0), 0x00);
    assert_eq!(e4m3fn_from_f32(-0.0), 0x80);
    assert_eq!(e4m3fn_from_f32(1.0), 0x38);
    assert_eq!(e4m3fn_from_f32(-2.0), 0xc0);
    assert_eq!(e4m3fn_from_f32(448.0), 0x7e);
    assert_eq!(e4m3fn_from_f32(-448.0), 0xfe);
    assert_eq!(e4m3fn_from_f32(1e9), 0x7e);
    assert_eq!(e4m3fn_from_f32(f32::INFINITY), 0x7e);
    assert_eq!(e4m3fn_from_f32(f32::NAN) & 0x7f, 0x7f);
    // The smallest denormal, 2^-9, and half of it (a tie: to even, 0).
    assert_eq!(e4m3fn_from_f32(2f32.powi(-9)), 0x01);
    assert_eq!(e4m3fn_from_f32(2f32.powi(-10)), 0x00);
    // 1 + 1/16 is a tie between 1 (even) and 1 + 1/8.
    assert_eq!(e4m3fn_from_f32(1.0625), 0x38);
    assert_eq!(e4m3fn_from_f32(1.1875), 0x3a);
}

fn reference(src: &[u16], rows: usize, cols: usize, scale: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; rows * cols];
    for n in 0..rows {
        for k in 0..cols {
            out[k * rows + n] = quantize(src[n * cols + k], scale[n]);
        }
    }
    out
}

#[test]
fn transposed_equals_the_elementwise_definition_at_ragged_sizes() {
    for (rows, cols) in [
        (1, 1),
        (3, 130),
        (65, 64),
        (129, 200),
        (64, 1),
        (200, 63),
        (8, 1030),
        (136, 520),
        (77, 1537),
        (70, 5000),
        (33, 9000),
    ] {
        let src: Vec<u16> = (0..rows * cols)
            .map(|i| (i as u16).wrapping_mul(40503) & 0xbfff)
            .collect();
        let mut amax = vec![0u16; rows];
        assert!(!row_abs_max(&src, cols, &mut amax));
        let scale: Vec<f32> = amax.iter().map(|&a| (bf16_to_f32(a) / E4M3_MAX).max(1e-6)).collect();
        let mut out = vec![0u8; rows * cols];
        assert!(!quantize_rows(&src, cols, &scale, &mut out, true));
        assert_eq!(out, reference(&src, rows, cols, &scale), "{rows}x{cols}");
        for width in [Width::Portable, Width::Avx2, Width::Avx512] {
            if width == Width::Avx512 && widest() != Width::Avx512
                || width == Width::Avx2 && widest() == Width::Portable
            {
                continue;
            }
            let mut again = vec![0u8; rows * cols];
            assert!(!quantize_rows_with(width, &src, cols, &scale, &mut again, true));
            assert_eq!(again, out, "{width:?} {rows}x{cols}");
        }
        let mut flat = vec![0u8; rows * cols];
        quantize_rows(&src, cols, &scale, &mut flat, false);
        for n in 0..rows {
            for k in 0..cols {
                assert_eq!(flat[n * cols + k], out[k * rows + n]);
            }
        }
    }
}

#[test]
fn pieces_read_where_they_lie_equal_the_whole_contiguous_weight() {
    // A [rows, cols] weight whose rows come from two pieces of a wider
    // [rows, 3 * cols] source (columns cols..2*cols, as a row-parallel
    // shard narrows), split at an awkward row.
    for (rows, cols, split) in [(130, 70, 37), (64, 1030, 64), (3, 5, 1), (77, 17, 0)] {
        let wide = 3 * cols;
        let source: Vec<u16> = (0..rows * wide)
            .map(|i| (i as u16).wrapping_mul(40503) & 0xbfff)
            .collect();
        let whole: Vec<u16> = (0..rows)
            .flat_map(|n| source[n * wide + cols..n * wide + 2 * cols].to_vec())
            .collect();
        let mut amax = vec![0u16; rows];
        assert!(!row_abs_max(&whole, cols, &mut amax));
        let scale: Vec<f32> = amax.iter().map(|&a| (bf16_to_f32(a) / E4M3_MAX).max(1e-6)).collect();
        let mut want = vec![0u8; rows * cols];
        assert!(!quantize_rows(&whole, cols, &scale, &mut want, true));

        let mut got_amax = vec![0u16; rows];
        let mut got = vec![0u8; rows * cols];
        for (first, count) in [(0, split), (split, rows - split)] {
            let piece = Rows::new(&source, first * wide + cols, wide, count, cols).unwrap();
            assert!(!rows_abs_max(piece, &mut got_amax[first..first + count]));
            let sc = &scale[first..first + count];
            assert!(!quantize_rows_into(widest(), piece, sc, &mut got, first, rows));
        }
        assert_eq!(got_amax, amax, "{rows}x{cols} at {split}");
        assert_eq!(got, want, "{rows}x{cols} at {split}");
    }
    // A piece that would end past its source is refused.
    let src = [0u16; 10];
    assert!(Rows::new(&src, 0, 4, 3, 3).is_none());
    assert!(Rows::new(&src, 1, 4, 3, 1).is_some());
    assert!(Rows::new(&src, usize::MAX, 4, 2, 2).is_none());
}

#[test]
fn nan_is_reported() {
    let src = [0x3f80u16, 0x7fc1, 0x0000, 0x4000];
    let mut amax = [0u16; 2];
    assert!(row_abs_max(&src, 2, &mut amax));
    let mut out = [0u8; 4];
    assert!(quantize_rows(&src, 2, &[1.0, 1.0], &mut out, true));
    assert!(quantize_rows(&[0u16; 4], 2, &[1.0, f32::NAN], &mut out, false));
    // Infinity is not NaN: it saturates, as torch's clamp does.
    assert!(!quantize_rows(
        &[0x7f80u16, 0xff80],
        1,
        &[1.0, 1.0],
        &mut out[..2],
        false
    ));
    assert_eq!(out[..2], [0x7e, 0xfe]);
}

#[test]
fn a_piece_into_aligned_and_misaligned_outputs_equals_the_definition() {
    // Whole tiles whose output runs start 64-byte aligned take the streaming
    // stores; one byte off, or a pitch of 16-byte steps, the plain
    // transposes: the same bytes.
    for (total, first, skew) in [(192, 64, 0), (192, 64, 1), (160, 16, 0)] {
        piece_into(total, first, skew);
    }
}

fn piece_into(total: usize, first: usize, skew: usize) {
    let (rows, cols) = (128, 72);
    let src: Vec<u16> = (0..rows * cols)
        .map(|i| (i as u16).wrapping_mul(40503) & 0xbfff)
        .collect();
    let mut amax = vec![0u16; rows];
    assert!(!row_abs_max(&src, cols, &mut amax));
    let scale: Vec<f32> = amax.iter().map(|&a| (bf16_to_f32(a) / E4M3_MAX).max(1e-6)).collect();
    let whole = reference(&src, rows, cols, &scale); // [cols, rows]
    let mut buffer = vec![0u8; cols * total + 128];
    {
        let start = buffer.as_ptr().align_offset(64) + skew;
        let out = &mut buffer[start..start + cols * total];
        out.fill(0xaa);
        let piece = Rows::new(&src, 0, cols, rows, cols).unwrap();
        assert!(!quantize_rows_into(widest(), piece, &scale, out, first, total));
        for k in 0..cols {
            let row = &out[k * total..(k + 1) * total];
            assert_eq!(
                &row[first..first + rows],
                &whole[k * rows..(k + 1) * rows],
                "skew {skew}, k {k}"
            );
            assert!(
                row[..first].iter().chain(&row[first + rows..]).all(|&b| b == 0xaa),
                "skew {skew}: outside the piece"
            );
        }
    }
}

#[test]
fn a_cast_by_its_own_amax_equals_the_amax_the_scale_and_the_cast_apart() {
    // vLLM's scale, restated independently: fp32 amax / 448, floored at
    // 1 / 229376 (every all-zero row takes the floor).
    let floor = 1.0f32 / 229376.0;
    for (rows, cols, stride, offset) in [(1, 1, 1, 0), (70, 130, 130, 0), (129, 200, 260, 7), (64, 64, 96, 3)] {
        let len = offset + (rows - 1) * stride + cols;
        let mut src: Vec<u16> = (0..len).map(|i| (i as u16).wrapping_mul(40503) & 0xbfff).collect();
        // A zero row, a row of one tiny denormal, a row with an infinity.
        for k in 0..cols {
            src[offset + k] = 0;
        }
        if rows > 2 {
            for k in 0..cols {
                src[offset + stride + k] = if k == cols / 2 { 0x8001 } else { 0 };
            }
            src[offset + 2 * stride] = 0xff80;
        }
        let piece = Rows::new(&src, offset, stride, rows, cols).unwrap();
        let mut amax = vec![0u16; rows];
        assert!(!rows_abs_max(piece, &mut amax));
        let scale: Vec<f32> = amax.iter().map(|&a| (bf16_to_f32(a) / 448.0).max(floor)).collect();
        for width in [Width::Portable, Width::Avx2, Width::Avx512] {
            if (width == Width::Avx512 && widest() != Width::Avx512)
                || (width == Width::Avx2 && widest() == Width::Portable)
            {
                continue;
            }
            let (total, first) = (rows + 5, 3);
            let mut apart = vec![0x55u8; cols * total];
            assert!(!quantize_rows_into(width, piece, &scale, &mut apart, first, total));
            let (mut own_amax, mut own_scale) = (vec![1u16; rows], vec![-1f32; rows]);
            let mut fused = vec![0x55u8; cols * total];
            let nan = amax_quantize_rows_into(width, piece, &mut own_amax, &mut own_scale, &mut fused, first, total);
            assert!(!nan, "{width:?} {rows}x{cols}");
            assert_eq!(own_amax, amax, "{width:?} {rows}x{cols}");
            let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&own_scale), bits(&scale), "{width:?} {rows}x{cols}");
            assert_eq!(fused, apart, "{width:?} {rows}x{cols}");
        }
    }
    // A NaN weight is reported.
    let src = [0x3f80u16, 0x7fc1, 0x0000, 0x4000];
    let (mut amax, mut scale, mut out) = ([0u16; 2], [0f32; 2], [0u8; 4]);
    let piece = Rows::new(&src, 0, 2, 2, 2).unwrap();
    assert!(amax_quantize_rows_into(
        widest(),
        piece,
        &mut amax,
        &mut scale,
        &mut out,
        0,
        2
    ));
}
