//! Tests of the checkpoint reader: header validation and lane windows.

use std::path::PathBuf;

use super::mapped::{MIN_CHUNK_BYTES, READ_AHEAD_TOTAL_BYTES, RESIDENT_BYTES};
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

/// A safetensors file of U8 tensors of `sizes` (bytes from a fixed pattern),
/// written under the system's temp directory; the expected digests by sha2.
fn write_u8_file(tag: &str, sizes: &[usize]) -> (PathBuf, Vec<(String, [u8; 32])>) {
    use sha2::Digest as _;
    let mut header = String::from("{");
    let (mut data, mut at, mut want) = (Vec::new(), 0usize, Vec::new());
    for (i, &n) in sizes.iter().enumerate() {
        let bytes: Vec<u8> = (0..n).map(|k| ((k * 131 + i * 17) % 251) as u8).collect();
        let name = format!("t{i:03}");
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"U8","shape":[{n}],"data_offsets":[{at},{}]}}"#,
            at + n
        ));
        want.push((name, sha2::Sha256::digest(&bytes).into()));
        data.extend_from_slice(&bytes);
        at += n;
    }
    header.push('}');
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(&data);
    let path = std::env::temp_dir().join(format!("wc-cold-{}-{tag}.safetensors", std::process::id()));
    std::fs::write(&path, v).unwrap();
    (path, want)
}

fn read_options(buffer_bytes: usize, cursors: usize) -> ReadOptions {
    ReadOptions {
        mode: ReadMode::Read,
        buffer_bytes,
        cursors,
    }
}

#[test]
fn the_read_path_equals_sha2_whatever_the_buffers_and_cursors() {
    // Tensors far larger than a buffer, runs of small ones that share a
    // buffer, empty ones, more spans than cursors.
    let mut sizes = vec![300_000, 0, 17, 5, 70_001, 0];
    sizes.extend(std::iter::repeat_n(1000, 40));
    sizes.extend([1 << 20, 123_457]);
    let (path, want) = write_u8_file("mix", &sizes);
    let files = [CheckpointFile::open(&path).unwrap()];
    let scheduler = Scheduler::default();
    for (buffer_bytes, cursors) in [(4096, 1), (4099, 2), (65_536, 3), (1 << 20, 8), (0, 0)] {
        let out = checksum_files_with(&files, &scheduler, read_options(buffer_bytes, cursors), None).unwrap();
        assert_eq!(out.read_files, 1);
        let got: Vec<(String, [u8; 32])> = out.digests.iter().map(|(n, d)| (n.clone(), d.bytes)).collect();
        assert_eq!(got, want, "buffer {buffer_bytes}, cursors {cursors}");
    }
    let mapped = checksum_files_with(
        &files,
        &scheduler,
        ReadOptions {
            mode: ReadMode::Mapped,
            ..ReadOptions::default()
        },
        None,
    )
    .unwrap();
    assert_eq!(mapped.read_files, 0);
    assert_eq!(mapped.digests.len(), want.len());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_file_cut_short_after_it_was_opened_is_an_error_naming_the_tensor() {
    // The header was valid at open; the data ends early when the read path
    // gets to it: an error naming the file and the tensor, never a digest
    // of part of a tensor (the mapping would fault here instead).
    let (path, _) = write_u8_file("cut", &[100_000, 200_000, 50_000]);
    let files = [CheckpointFile::open(&path).unwrap()];
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 60_000)
        .unwrap();
    let err = checksum_files_with(&files, &Scheduler::default(), read_options(4096, 2), None)
        .err()
        .expect("a truncated file hashed");
    let text = err.to_string();
    assert!(text.contains("t001") && text.contains("wc-cold-"), "{text}");
    assert!(text.contains("truncated"), "{text}");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_cancel_from_progress_stops_the_read_path() {
    let (path, _) = write_u8_file("cancel", &[4 << 20, 4 << 20]);
    let files = [CheckpointFile::open(&path).unwrap()];
    let mut calls = 0;
    let mut progress = |_: u64, _: u64| {
        calls += 1;
        false
    };
    let out = checksum_files_with(
        &files,
        &Scheduler::default(),
        read_options(4096, 1),
        Some(&mut progress),
    );
    assert!(matches!(out, Err(Error::Cancelled)), "{:?}", out.err());
    assert!(calls >= 1);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn spans_keep_large_tensors_alone_and_pack_small_ones_largest_first() {
    let (path, _) = write_u8_file("spans", &[10, 20, 1000, 5, 5]);
    let f = CheckpointFile::open(&path).unwrap();
    let spans = cold::spans(&[&f], 100);
    let shape: Vec<(usize, usize, u64)> = spans.iter().map(|s| (s.first, s.count, s.end - s.start)).collect();
    assert_eq!(shape, vec![(2, 1, 1000), (0, 2, 30), (3, 2, 10)]);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_buffer_larger_than_the_data_or_than_memory_is_cut_to_what_the_largest_span_needs() {
    // A buffer of usize::MAX - 4096 bytes used to overflow its alignment
    // slack and panic; one of 64 GiB to abort on allocation.
    let (path, want) = write_u8_file("huge-buffer", &[100, 5000, 7]);
    let files = [CheckpointFile::open(&path).unwrap()];
    for buffer_bytes in [usize::MAX - 4096, 1 << 36, MAX_BUFFER_BYTES] {
        let out = checksum_files_with(&files, &Scheduler::default(), read_options(buffer_bytes, 2), None).unwrap();
        let got: Vec<(String, [u8; 32])> = out.digests.iter().map(|(n, d)| (n.clone(), d.bytes)).collect();
        assert_eq!(got, want, "buffer {buffer_bytes}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_file_replaced_after_it_was_opened_is_an_error_not_another_files_digests() {
    let (path, _) = write_u8_file("replaced", &[10_000, 20_000]);
    let files = [CheckpointFile::open(&path).unwrap()];
    let (other, _) = write_u8_file("replacement", &[10_000, 20_000]);
    std::fs::rename(&other, &path).unwrap();
    let err = checksum_files_with(&files, &Scheduler::default(), read_options(4096, 2), None)
        .err()
        .expect("a replaced file hashed");
    assert!(err.to_string().contains("replaced"), "{err}");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn asking_what_is_cached_reads_nothing() {
    // The fraction is asked without reading (cachestat or mincore): a cold
    // file asked twice is still cold. Evicting needs POSIX_FADV_DONTNEED to
    // work here; where it leaves the file cached, nothing is checked.
    let (path, _) = write_u8_file("cached", &[8 << 20; 4]);
    let f = CheckpointFile::open(&path).unwrap();
    assert!(f.resident_fraction() >= CACHED_FRACTION);
    let file = std::fs::File::open(&path).unwrap();
    file.sync_all().unwrap();
    {
        use std::os::fd::AsRawFd;
        // SAFETY: integer arguments only; the descriptor is open.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    // (Opening read the header through the mapping, and the page fault's
    // read-ahead some MiB after it: the file is 32 MiB so that it stays
    // mostly cold.)
    let first = f.resident_fraction();
    eprintln!("cached after eviction: {first:.2}");
    if first < 0.5 {
        assert!(f.resident_fraction() < 0.5, "asking made the file look cached");
        assert!(f.resident_fraction() < 0.5, "asking made the file look cached");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_file_cut_inside_its_header_while_it_is_parsed_is_an_error_naming_the_header() {
    // The mapping is made and guarded, then the file is cut to one page,
    // inside a header of three: the parse reads the guard's zeros past the
    // cut, and the error says the header was being read (no tensor was).
    use super::file::parse_guarded;
    use crate::fault_guard::Registration;
    let sizes = vec![8usize; 400]; // about 30 KiB of header, 3.2 KB of data
    let (path, _) = write_u8_file("header-cut", &sizes);
    // SAFETY: a read-only mapping of a file only this test writes; the
    // guard is registered before any read of it, so the read past the cut
    // below is recorded as a fault (zeros), never a SIGBUS.
    let map = unsafe { memmap2::Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap();
    let guard = Registration::new(map.as_ptr(), map.len()).expect("a guard slot");
    let header_len = u64::from_le_bytes(map[..8].try_into().unwrap());
    assert!(header_len > 3 * 4096, "{header_len}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let text = parse_guarded(&path, &map, &guard)
        .expect_err("a cut header parsed")
        .to_string();
    assert!(text.contains("wc-cold-") && text.contains("header-cut"), "{text}");
    assert!(text.contains(": its header: truncated while it was read"), "{text}");
    assert!(text.contains("no byte at offset 4096"), "{text}");
    assert!(!text.contains("tensor '"), "{text}");
    drop(guard);
    drop(map);
    std::fs::remove_file(path).unwrap();
}
