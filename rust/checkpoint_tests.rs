//! Tests of the checkpoint reader: header validation and lane windows.

use super::*;

#[test]
fn lane_windows_share_a_fixed_resident_total() {
    // 2 threads x 4 narrow lanes: the full window and read-ahead.
    let w = Windows::for_streams(8);
    assert_eq!((w.chunk, w.read_ahead), (CHUNK_BYTES, READ_AHEAD_BYTES));
    // 2 threads x 16 wide lanes: a quarter each, the same totals.
    let w = Windows::for_streams(32);
    assert_eq!(32 * w.chunk, RESIDENT_BYTES);
    assert_eq!(32 * w.read_ahead, READ_AHEAD_TOTAL_BYTES);
    // Many threads: never below the floors; few: never above the caps.
    let w = Windows::for_streams(112 * 16);
    assert_eq!((w.chunk, w.read_ahead), (MIN_CHUNK_BYTES, READ_AHEAD_BYTES / 4));
    assert_eq!(Windows::for_streams(1), Windows::for_streams(0));
    assert_eq!(Windows::for_streams(2).chunk, CHUNK_BYTES);
}

fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend(std::iter::repeat_n(7u8, data_len));
    v
}

fn parse(bytes: &[u8]) -> Result<Vec<TensorEntry>, Error> {
    parse_header(Path::new("x.safetensors"), bytes)
}

#[test]
fn valid_header() {
    let f = file(
        r#"{"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"__metadata__":{"k":"v"}}"#,
        12,
    );
    let e = parse(&f).unwrap();
    assert_eq!(e.len(), 1);
    assert_eq!((e[0].start, e[0].end), (8 + f.len() as u64 - 8 - 12, f.len() as u64));
}

#[test]
fn each_defect_names_file_and_tensor() {
    let cases = [
        (
            file(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 4),
            "run past the end",
        ),
        (
            file(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8),
            "need 12 bytes",
        ),
        (
            file(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#, 8),
            "reversed",
        ),
        (
            file(r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#, 8),
            "unknown dtype",
        ),
        (
            file(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                8,
            ),
            "overlaps",
        ),
    ];
    for (bytes, want) in cases {
        let err = parse(&bytes).unwrap_err().to_string();
        assert!(
            err.contains(want) && err.contains("x.safetensors") && err.contains("tensor"),
            "{err}"
        );
    }
    let err = parse(&file("{not json", 0)).unwrap_err().to_string();
    assert!(err.contains("invalid JSON"), "{err}");
    let mut long = file("{}", 0);
    long[..8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(parse(&long)
        .unwrap_err()
        .to_string()
        .contains("past the end of the file"));
    assert!(parse(&[1, 2, 3]).unwrap_err().to_string().contains("truncated"));
}
