//! Property tests of every scheduler path against plain `sha2`.

mod common;

use common::WideCheck;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use sha2::Digest as _;
use weight_checker::{ChunkSource, Kernel, Scheduler};

fn oracle(data: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(data).into()
}

/// Lengths around the 64-byte block and 56-byte padding edges, plus larger ones.
fn length() -> impl Strategy<Value = usize> {
    prop_oneof![
        prop::sample::select(vec![0usize, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129]),
        0usize..5000,
        (1usize..4).prop_map(|m| m << 20),
        (1usize..3 << 20),
    ]
}

/// A buffer of `len` bytes starting `offset` bytes into a larger allocation,
/// so starts are misaligned.
fn buffers() -> impl Strategy<Value = (Vec<u8>, Vec<(usize, usize)>)> {
    prop::collection::vec((length(), 0usize..16), 0..12)
        .prop_flat_map(|specs| {
            let total: usize = specs.iter().map(|(l, o)| l + o).sum();
            (prop::collection::vec(any::<u8>(), total..=total), Just(specs))
        })
        .prop_map(|(pool, specs)| (pool, lay_out(specs)))
}

fn schedulers() -> Vec<Scheduler> {
    let mut out = Vec::new();
    for kernel in Kernel::all_available() {
        for lanes in [1, 2, 4, 16] {
            for threads in [1, 2] {
                out.push(Scheduler::new(kernel, lanes, threads));
            }
        }
    }
    // The calibrated default (the lane count measured on this CPU).
    out.push(Scheduler::default());
    out
}

/// Twenty misaligned buffers of 10-67 KB: enough open messages of similar
/// lengths that sixteen lanes run wide, where the CPU has the wide kernel
/// (the random cases do too, but not every time).
fn sixteen_lanes_case() -> (Vec<u8>, Vec<(usize, usize)>) {
    let specs: Vec<(usize, usize)> = (0..20).map(|i| (10_000 + 3001 * i, i % 16)).collect();
    let total: usize = specs.iter().map(|(l, o)| l + o).sum();
    let pool: Vec<u8> = (0..total).map(|i| (i as u32).wrapping_mul(2654435761) as u8).collect();
    (pool, lay_out(specs))
}

/// `(start, len)` of each `(len, misalignment)` laid out back to back in one
/// pool, each after its own misalignment.
fn lay_out(specs: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    let mut at = 0;
    specs
        .into_iter()
        .map(|(len, off)| {
            let start = at + off;
            at = start + len;
            (start, len)
        })
        .collect()
}

fn check_hash_many(mut pool: Vec<u8>, ranges: &[(usize, usize)], zero_some: bool) -> Result<(), TestCaseError> {
    if zero_some {
        if let Some(&(s, l)) = ranges.first() {
            pool[s..s + l].fill(0);
        }
    }
    let bufs: Vec<&[u8]> = ranges.iter().map(|&(s, l)| &pool[s..s + l]).collect();
    for scheduler in schedulers() {
        let got = scheduler.hash_many(&bufs);
        for (b, d) in bufs.iter().zip(&got) {
            prop_assert_eq!(d.bytes, oracle(b), "{:?} len {}", scheduler, b.len());
            prop_assert_eq!(d.all_zero, b.iter().all(|&x| x == 0));
        }
    }
    Ok(())
}

#[test]
fn hash_many_matches_sha2() {
    let wide = WideCheck::start("hash_many_matches_sha2");
    let (pool, ranges) = sixteen_lanes_case();
    check_hash_many(pool, &ranges, true).unwrap();
    proptest!(ProptestConfig { cases: 48, ..ProptestConfig::default() }, |((pool, ranges) in buffers(), zero_some in any::<bool>())| {
        check_hash_many(pool, &ranges, zero_some)?;
    });
    wide.finish();
}

fn check_multi_hasher(
    pool: &[u8],
    ranges: &[(usize, usize)],
    cuts: &[usize],
    rounds: usize,
) -> Result<(), TestCaseError> {
    let bufs: Vec<&[u8]> = ranges.iter().map(|&(s, l)| &pool[s..s + l]).collect();
    for scheduler in schedulers() {
        // Split every buffer at pseudo-random points, then feed the pieces
        // over `rounds` updates, several pieces of one digest per update.
        let mut pieces: Vec<Vec<&[u8]>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let mut points: Vec<usize> = cuts.iter().map(|c| (c + i * 7919) % (b.len() + 1)).collect();
                points.push(0);
                points.push(b.len());
                points.sort_unstable();
                points.windows(2).map(|w| &b[w[0]..w[1]]).collect()
            })
            .collect();
        let mut multi = scheduler.multi(bufs.len());
        for r in 0..rounds {
            let mut feeds = Vec::new();
            for (i, p) in pieces.iter_mut().enumerate() {
                let take = if r + 1 == rounds {
                    p.len()
                } else {
                    p.len().div_ceil(rounds)
                };
                feeds.extend(p.drain(..take.min(p.len())).map(|c| (i, c)));
            }
            multi.update(&feeds).unwrap();
        }
        for (i, b) in bufs.iter().enumerate() {
            prop_assert_eq!(multi.bytes_fed(i), Some(b.len() as u64));
        }
        for (b, d) in bufs.iter().zip(multi.finish()) {
            prop_assert_eq!(d.bytes, oracle(b), "{:?}", scheduler);
        }
    }
    Ok(())
}

#[test]
fn multi_hasher_random_chunkings_match_sha2() {
    let wide = WideCheck::start("multi_hasher_random_chunkings_match_sha2");
    let (pool, ranges) = sixteen_lanes_case();
    check_multi_hasher(&pool, &ranges, &[5000, 70_001], 2).unwrap();
    proptest!(
        ProptestConfig { cases: 48, ..ProptestConfig::default() },
        |((pool, ranges) in buffers(), cuts in prop::collection::vec(0usize..1 << 21, 0..40), rounds in 1usize..5)| {
            check_multi_hasher(&pool, &ranges, &cuts, rounds)?;
        }
    );
    wide.finish();
}

#[test]
fn multi_hasher_rejects_unknown_digest() {
    let mut m = Scheduler::default().multi(2);
    let err = m.update(&[(0, b"ok".as_slice()), (2, b"bad")]).unwrap_err();
    assert!(err.to_string().contains("index 2"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// The safetensors header parser never panics, whatever the bytes.
    #[test]
    fn header_parser_never_panics(body in prop::collection::vec(any::<u8>(), 0..400), hlen in 0u64..500, prefix in any::<bool>()) {
        let mut bytes = if prefix { hlen.to_le_bytes().to_vec() } else { Vec::new() };
        bytes.extend(body);
        let _ = weight_checker::checkpoint::parse_header(std::path::Path::new("f"), &bytes);
    }

    /// Headers that are JSON objects with arbitrary entries: still no panic,
    /// and every accepted tensor lies inside the file.
    #[test]
    fn json_header_parser_never_panics(
        entries in prop::collection::vec(("[a-c]{1,2}", prop::sample::select(vec!["F32", "BF16", "U8", "F4", "X"]),
            prop::collection::vec(0u64..1 << 40, 0..3), any::<u64>(), any::<u64>()), 0..4),
        data_len in 0usize..64,
    ) {
        let obj: serde_json::Map<String, serde_json::Value> = entries.into_iter().map(|(name, dtype, shape, b, e)| {
            (name, serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [b % 80, e % 80]}))
        }).collect();
        let header = serde_json::to_vec(&obj).unwrap();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(&header);
        bytes.extend(std::iter::repeat_n(1u8, data_len));
        if let Ok(tensors) = weight_checker::checkpoint::parse_header(std::path::Path::new("f"), &bytes) {
            for t in tensors {
                prop_assert!(t.start <= t.end && t.end <= bytes.len() as u64);
            }
        }
    }
}

/// A streamed message that hands its bytes out in the given chunk sizes,
/// failing instead of yielding chunk `fail_at` when set.
struct Chunked<'a> {
    data: &'a [u8],
    sizes: Vec<usize>,
    next: usize,
    pos: usize,
    end: usize,
    fail_at: Option<usize>,
}

impl<'a> Chunked<'a> {
    fn new(data: &'a [u8], cut: usize, fail_at: Option<usize>) -> Chunked<'a> {
        let mut sizes = Vec::new();
        let mut left = data.len();
        let mut k = 0usize;
        while left > 0 {
            let n = (1 + (cut * (k + 3)) % 70_000).min(left);
            sizes.push(n);
            left -= n;
            k += 1;
        }
        Chunked {
            data,
            sizes,
            next: 0,
            pos: 0,
            end: 0,
            fail_at,
        }
    }
}

impl ChunkSource for Chunked<'_> {
    fn total_bytes(&self) -> u64 {
        self.data.len() as u64
    }

    fn chunk(&self) -> &[u8] {
        &self.data[self.pos..self.end]
    }

    fn next_chunk(&mut self) -> Result<bool, weight_checker::Error> {
        if self.fail_at == Some(self.next) {
            return Err(weight_checker::Error::Io {
                path: "failing-source".into(),
                source: std::io::Error::other("injected read failure"),
            });
        }
        self.pos = self.end;
        match self.sizes.get(self.next) {
            Some(&n) => {
                self.end += n;
                self.next += 1;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

fn check_streamed_sources(pool: &[u8], ranges: &[(usize, usize)], cut: usize) -> Result<(), TestCaseError> {
    let bufs: Vec<&[u8]> = ranges.iter().map(|&(s, l)| &pool[s..s + l]).collect();
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    for scheduler in schedulers() {
        let sources: Vec<Chunked<'_>> = bufs.iter().map(|b| Chunked::new(b, cut, None)).collect();
        let mut last = (0, 0);
        let mut report = |done: u64, all: u64| {
            last = (done, all);
            true
        };
        let got = scheduler.hash_sources(sources, Some(&mut report)).unwrap();
        for (b, d) in bufs.iter().zip(&got) {
            prop_assert_eq!(d.bytes, oracle(b), "{:?} len {}", scheduler, b.len());
        }
        prop_assert_eq!(last, (total, total));
    }
    Ok(())
}

/// The streaming feeder: any chunking of any messages, any lanes and
/// threads, digests equal sha2's; progress ends at the total.
#[test]
fn streamed_sources_match_sha2() {
    let wide = WideCheck::start("streamed_sources_match_sha2");
    let (pool, ranges) = sixteen_lanes_case();
    check_streamed_sources(&pool, &ranges, 30_011).unwrap();
    proptest!(ProptestConfig { cases: 32, ..ProptestConfig::default() }, |((pool, ranges) in buffers(), cut in 1usize..100_000)| {
        check_streamed_sources(&pool, &ranges, cut)?;
    });
    wide.finish();
}

#[test]
fn a_failing_source_stops_the_run_with_its_error() {
    let data = vec![7u8; 8 << 20];
    for scheduler in schedulers() {
        let mut sources: Vec<Chunked<'_>> = (0..6).map(|_| Chunked::new(&data, 50_000, None)).collect();
        sources[3].fail_at = Some(5);
        let err = scheduler.hash_sources(sources, None).unwrap_err();
        assert!(err.to_string().contains("injected read failure"), "{err}");
    }
}

#[test]
fn progress_can_cancel_a_run() {
    let data = vec![1u8; 64 << 20];
    let scheduler = Scheduler::default();
    let sources: Vec<Chunked<'_>> = (0..4).map(|_| Chunked::new(&data, 60_000, None)).collect();
    let mut calls = 0;
    let mut cancel = |_: u64, _: u64| {
        calls += 1;
        false
    };
    let err = scheduler.hash_sources(sources, Some(&mut cancel)).unwrap_err();
    assert!(matches!(err, weight_checker::Error::Cancelled), "{err}");
    assert!(calls >= 1);
}

/// Small messages through [`Batches`]: `threads - 1` helpers and the
/// producer. With `collect`, the producer works as the Python binding does:
/// it takes finished digests whenever a batch goes out, then closes the
/// queue and alternates hashing one batch and collecting.
fn batched(scheduler: Scheduler, msgs: &[&[u8]], collect: bool) -> Vec<(usize, [u8; 32])> {
    use weight_checker::{BatchQueue, Batches};
    let queue = BatchQueue::new();
    let mut out: Vec<(usize, [u8; 32])> = Vec::new();
    let take = |out: &mut Vec<(usize, [u8; 32])>| out.extend(queue.take_done().into_iter().map(|(i, d)| (i, d.bytes)));
    rayon::in_place_scope(|scope| {
        let mut batches = Batches::new(scope, scheduler, &queue);
        for (i, m) in msgs.iter().enumerate() {
            if batches.push(i, m) && collect {
                take(&mut out);
            }
        }
        if collect {
            let one_thread = batches.close();
            while queue.work_one(one_thread) {
                take(&mut out);
            }
        } else {
            batches.finish();
        }
    });
    take(&mut out);
    out.extend(queue.into_digests().into_iter().map(|(i, d)| (i, d.bytes)));
    out.sort_by_key(|(i, _)| *i);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every message hashed exactly once, right, whatever the thread count
    /// and however the messages fall into batches (several full ones, a
    /// partial one, or none).
    #[test]
    fn batches_hash_every_message_once(
        sizes in prop::collection::vec(prop_oneof![0usize..200, 4000usize..4200], 0..700),
        threads in 1usize..4,
        seed in any::<u8>(),
        one_shape in any::<bool>(),
        collect in any::<bool>(),
    ) {
        // Batches of one length take the same-length path.
        let sizes: Vec<usize> = if one_shape { sizes.iter().map(|_| sizes[0]).collect() } else { sizes };
        let pool: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8 ^ seed).collect())
            .collect();
        let msgs: Vec<&[u8]> = pool.iter().map(Vec::as_slice).collect();
        for kernel in Kernel::all_available() {
            let got = batched(Scheduler::new(kernel, 4, threads), &msgs, collect);
            // Exactly once: sorted by index, the indices are 0..n.
            prop_assert!(got.iter().map(|(i, _)| *i).eq(0..msgs.len()));
            for (i, d) in got {
                prop_assert_eq!(d, oracle(msgs[i]));
            }
        }
    }
}

/// A producer that fails part-way drops its `Batches` without `finish`: the
/// helpers leave (the scope ends instead of waiting forever) and whatever
/// they hashed is right.
#[test]
fn an_abandoned_batches_releases_its_helpers() {
    use weight_checker::{BatchQueue, Batches};
    let pool: Vec<Vec<u8>> = (0..2000).map(|i| vec![i as u8; 4096]).collect();
    for threads in [1, 2, 4] {
        let queue = BatchQueue::new();
        rayon::in_place_scope(|scope| {
            let mut batches = Batches::new(scope, Scheduler::new(Kernel::best_available(), 4, threads), &queue);
            for (i, m) in pool.iter().enumerate().take(1500) {
                batches.push(i, m);
            }
            drop(batches); // the producer's error path
        });
        // Whatever was hashed was pushed, is hashed once, and is right.
        let mut seen = std::collections::HashSet::new();
        for (i, d) in queue.into_digests() {
            assert!(i < 1500, "message {i} was never pushed");
            assert!(seen.insert(i), "message {i} hashed twice");
            assert_eq!(d.bytes, oracle(&pool[i]));
        }
    }
}

fn check_same_length(len: usize, count: usize, zeros: &[bool], seed: u8) -> Result<(), TestCaseError> {
    let msgs: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            if zeros[i] {
                vec![0; len]
            } else {
                (0..len).map(|j| (i * 7 + j) as u8 ^ seed | 1).collect()
            }
        })
        .collect();
    let refs: Vec<&[u8]> = msgs.iter().map(Vec::as_slice).collect();
    for kernel in Kernel::all_available() {
        // 16: the wide (AVX-512) kernel where the CPU has it, in groups of
        // sixteen with this kernel's lanes for the rest.
        for lanes in [1, 2, 3, 4, weight_checker::sha256::WIDE_LANES] {
            let got = weight_checker::sha256::digest_same_length(kernel, lanes, &refs);
            prop_assert_eq!(got.len(), count);
            for (d, m) in got.iter().zip(&msgs) {
                prop_assert_eq!(d.bytes, oracle(m));
                prop_assert_eq!(d.all_zero, m.iter().all(|&b| b == 0));
            }
        }
    }
    Ok(())
}

/// Messages of one length, several at a time with their padding blocks
/// in the multi-stream kernel: every digest and all-zero flag right, for
/// every kernel and lane count, counts that are not multiples of 4.
#[test]
fn same_length_digests_match_sha2() {
    let wide = WideCheck::start("same_length_digests_match_sha2");
    let zeros: Vec<bool> = (0..40).map(|i| i % 5 == 0).collect();
    check_same_length(4096 + 13, 37, &zeros, 7).unwrap();
    proptest!(
        ProptestConfig { cases: 64, ..ProptestConfig::default() },
        |(
            len in prop_oneof![
                prop::sample::select(vec![0usize, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129]),
                0usize..9000,
            ],
            count in prop_oneof![0usize..11, 14usize..40],
            zeros in prop::collection::vec(any::<bool>(), 40),
            seed in any::<u8>(),
        )| {
            check_same_length(len, count, &zeros, seed)?;
        }
    );
    wide.finish();
}

/// Sixteen different messages per group, each with its own bytes in every
/// word position, so that a transposition that swapped two lanes or two
/// words of the wide kernel could not give the right digests.
#[test]
fn wide_kernel_keeps_every_lane_apart() {
    let wide = WideCheck::start("wide_kernel_keeps_every_lane_apart");
    if weight_checker::sha256::Wide::detect().is_none() {
        return wide.finish(); // the notice (or, in CI on an AVX-512 CPU, the failure)
    }
    for len in [0usize, 1, 63, 64, 65, 4096, 4096 + 13, 65_536 + 64] {
        let msgs: Vec<Vec<u8>> = (0..35)
            .map(|i| {
                (0..len)
                    .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i * 977) as u8)
                    .collect()
            })
            .collect();
        let refs: Vec<&[u8]> = msgs.iter().map(Vec::as_slice).collect();
        let got = weight_checker::sha256::digest_same_length(Kernel::best_available(), 16, &refs);
        for (i, (d, m)) in got.iter().zip(&msgs).enumerate() {
            assert_eq!(d.bytes, oracle(m), "message {i} of length {len}");
        }
    }
    wide.finish();
}

/// The floor measurement times each pass it was asked for.
#[test]
fn batches_floor_times_every_pass() {
    let times = weight_checker::scheduler::batches_floor(Scheduler::default(), 200, 4096, 3);
    assert_eq!(times.len(), 3);
    // Each pass hashed 800 KiB: under 8 us would mean more than 100 GB/s,
    // i.e. a pass that skipped the hashing.
    let least = std::time::Duration::from_secs_f64(200.0 * 4096.0 / 100e9);
    assert!(times.iter().all(|t| *t > least), "{times:?}");
}
