//! Tests of the worker loop: dealt tasks, and messages moving between the
//! wide kernel and narrow lanes.

use super::super::Slices;
use super::*;
use sha2::Digest as _;

const UNSET: Digest = Digest {
    bytes: [0; 32],
    all_zero: true,
};

fn assignment(
    wide: Option<WidePlan>,
    lanes: usize,
    workers: usize,
    narrow: (usize, usize),
    dealt: usize,
) -> Assignment {
    Assignment {
        workers,
        parallel: workers > 1,
        lanes,
        wide,
        narrow,
        dealt,
    }
}

/// Lanes the wide kernel had hashed part of and narrow lanes then took over
/// (all tests of this binary).
pub(super) static MOVED: AtomicUsize = AtomicUsize::new(0);

/// Narrow workers of a mixed split that turned wide once their dealt
/// messages ended (all tests of this binary).
pub(super) static TURNED_WIDE: AtomicUsize = AtomicUsize::new(0);

/// Hashes `data`, each message fed as its `pieces`, with `assignment`, on
/// the workers `running` (at once; the others never start), and checks
/// that every byte was hashed once and every digest and all-zero flag
/// against `sha2`. Returns how many times the wide kernel ran.
fn hash_and_check(
    assignment: &Assignment,
    running: &[usize],
    data: &[Vec<u8>],
    pieces: &[Vec<&[u8]>],
    what: &str,
) -> u64 {
    let mut states = vec![Sha256::new(); data.len()];
    let mut digests = vec![UNSET; data.len()];
    let mut tasks: Vec<_> = states
        .iter_mut()
        .zip(digests.iter_mut())
        .zip(pieces)
        .map(|((state, out), p)| {
            let source = Slices::new(p);
            Task {
                bytes: source.total_bytes(),
                state,
                source,
                digest_out: Some(out),
                marks: None,
            }
        })
        .collect();
    tasks.sort_by_key(|t| std::cmp::Reverse(t.bytes));
    let shared = Shared::new(Kernel::best_available(), assignment, tasks, true);
    std::thread::scope(|s| {
        for &w in running {
            let shared = &shared;
            s.spawn(move || worker(shared, w));
        }
    });
    let hashed = shared.done.load(Ordering::Relaxed);
    let wide_calls = shared.wide_calls.load(Ordering::Relaxed);
    drop(shared);
    assert_eq!(hashed, data.iter().map(|d| d.len() as u64).sum::<u64>(), "{what}");
    for (d, got) in data.iter().zip(&digests) {
        let want: [u8; 32] = sha2::Sha256::digest(d).into();
        assert_eq!(got.bytes, want, "{what}, len {}", d.len());
        assert_eq!(got.all_zero, d.iter().all(|&b| b == 0), "{what}, len {}", d.len());
    }
    wide_calls
}

/// The notice where this CPU lacks the wide kernel (a failure in CI where
/// it has AVX-512), see `crate::wide_check`.
fn wide_kernel_tested(test: &str, wide_calls: u64) {
    crate::wide_check::report(test, Wide::detect().is_some(), wide_calls > 0);
}

/// Hashes `data` (each message fed in chunks of uneven sizes) on one
/// worker holding sixteen lanes, the wide kernel running while at least
/// `wide_min` are open (see [`hash_and_check`]); returns its calls.
fn hash_on_sixteen_lanes(wide: Wide, wide_min: usize, data: &[Vec<u8>]) -> u64 {
    let pieces: Vec<Vec<&[u8]>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let cut = [BLOCK_LEN * 3 + 1, STEP_BYTES - 5, 700_001][i % 3];
            d.chunks(cut.max(1)).collect()
        })
        .collect();
    let plan = WidePlan {
        kernel: wide,
        min_open: wide_min,
        over_one_stream: 2.5,
    };
    let what = format!("wide from {wide_min} open");
    hash_and_check(
        &assignment(Some(plan), WIDE_LANES, 1, (0, 0), 0),
        &[0],
        data,
        &pieces,
        &what,
    )
}

/// Twenty-three messages of mixed lengths (empty, under a block, not a
/// block multiple, several steps) on sixteen lanes: lanes are refilled
/// mid-run, and messages the wide kernel started are finished by
/// narrow lanes once fewer than `wide_min` are open, or once one of them has
/// far more bytes left than the rest. Also with the wide kernel for any
/// open count (idle lanes hashing zeros) and never.
#[test]
fn messages_move_between_the_wide_kernel_and_narrow_lanes_mid_stream() {
    const TEST: &str = "messages_move_between_the_wide_kernel_and_narrow_lanes_mid_stream";
    let Some(wide) = Wide::detect() else {
        return wide_kernel_tested(TEST, 0);
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let lens = [
        0usize,
        1,
        55,
        56,
        63,
        64,
        65,
        4095,
        4096,
        70_000,
        131_072,
        200_003,
        333_333,
        1 << 20,
        1_500_001,
        2 << 20,
        (2 << 20) + 17,
        3_000_000,
        77,
        640_000,
        12_345,
        999_999,
        2_500_000,
    ];
    let mut data: Vec<Vec<u8>> = lens
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 32) as u8
                })
                .collect()
        })
        .collect();
    // All zero but for one byte late in the message: the zero check
    // must see bytes hashed by either kernel.
    data[13].fill(0);
    data[13][900_000] = 1;
    data[14].fill(0);
    let before = MOVED.load(Ordering::Relaxed);
    let mut wide_calls = hash_on_sixteen_lanes(wide, 8, &data);
    assert!(
        MOVED.load(Ordering::Relaxed) > before,
        "no message moved from the wide kernel to narrow lanes"
    );
    wide_calls += hash_on_sixteen_lanes(wide, 1, &data);
    assert_eq!(hash_on_sixteen_lanes(wide, WIDE_LANES + 1, &data), 0, "never wide");
    wide_kernel_tested(TEST, wide_calls);
}

/// Tasks dealt to workers that never start are hashed by the one that
/// runs, after its own and the undealt ones; every digest is right,
/// with one, two, three or four lanes held (three: two run, in turns).
#[test]
fn a_lone_worker_takes_the_tasks_dealt_to_others() {
    let data: Vec<Vec<u8>> = (0..11)
        .map(|i| vec![i as u8 + 1; (11 - i) * (300 << 10) + i * 77])
        .collect();
    let chunks: Vec<[&[u8]; 1]> = data.iter().map(|d| [d.as_slice()]).collect();
    for kernel in Kernel::all_available() {
        for lanes in 1..=4 {
            let mut states = vec![Sha256::new(); data.len()];
            let mut digests = vec![UNSET; data.len()];
            let tasks: Vec<_> = states
                .iter_mut()
                .zip(digests.iter_mut())
                .zip(&chunks)
                .map(|((state, out), c)| Task {
                    bytes: c[0].len() as u64,
                    state,
                    source: Slices::new(c),
                    digest_out: Some(out),
                    marks: None,
                })
                .collect();
            let workers = 3;
            let dealt = (workers * lanes).min(data.len());
            let shared = Shared::new(kernel, &assignment(None, lanes, workers, (0, 0), dealt), tasks, false);
            worker(&shared, 1);
            drop(shared);
            for (d, got) in data.iter().zip(&digests) {
                let want: [u8; 32] = sha2::Sha256::digest(d).into();
                assert_eq!(got.bytes, want, "{kernel:?} lanes {lanes} len {}", d.len());
            }
        }
    }
}

/// A mixed split: worker 0 on four narrow lanes, dealt the largest two
/// messages, worker 1 on the wide kernel's sixteen. Every digest is right
/// with both running at once, and with either alone (the other never
/// starts: the lone wide worker then takes the dealt ones too).
#[test]
fn a_mixed_split_hashes_every_message_whoever_runs() {
    const TEST: &str = "a_mixed_split_hashes_every_message_whoever_runs";
    let Some(wide) = Wide::detect() else {
        return wide_kernel_tested(TEST, 0); // the mixed split never runs here
    };
    let mut data: Vec<Vec<u8>> = vec![vec![7; 3 << 20], vec![9; (3 << 20) + 5]];
    data.extend((0..30).map(|i| {
        (0..(200 << 10) + i * 4099)
            .map(|b| (b * 31 + i) as u8)
            .collect::<Vec<u8>>()
    }));
    let pieces: Vec<Vec<&[u8]>> = data.iter().map(|d| d.chunks(STEP_BYTES + 3).collect()).collect();
    let plan = WidePlan {
        kernel: wide,
        min_open: 8,
        over_one_stream: 2.5,
    };
    let split = assignment(Some(plan), WIDE_LANES, 2, (1, 4), 4);
    let mut wide_calls = 0;
    for running in [vec![0, 1], vec![0], vec![1]] {
        wide_calls += hash_and_check(&split, &running, &data, &pieces, &format!("workers {running:?}"));
    }
    wide_kernel_tested(TEST, wide_calls);
}

/// A narrow worker turns wide once its dealt messages have ended: alone
/// (the wide worker never starts) it hashes its dealt pair, then the rest
/// sixteen at a time; every digest stays right whoever runs.
#[test]
fn a_narrow_worker_turns_wide_once_its_dealt_messages_end() {
    const TEST: &str = "a_narrow_worker_turns_wide_once_its_dealt_messages_end";
    let Some(wide) = Wide::detect() else {
        return wide_kernel_tested(TEST, 0); // the mixed split never runs here
    };
    let mut data: Vec<Vec<u8>> = vec![vec![3; (2 << 20) + 17], vec![0; 2 << 20]];
    data.extend((0..40).map(|i| {
        (0..(150 << 10) + i * 1021)
            .map(|b| (b * 13 + i) as u8)
            .collect::<Vec<u8>>()
    }));
    let pieces: Vec<Vec<&[u8]>> = data.iter().map(|d| d.chunks(STEP_BYTES - 64).collect()).collect();
    let plan = WidePlan {
        kernel: wide,
        min_open: 8,
        over_one_stream: 2.5,
    };
    let split = assignment(Some(plan), WIDE_LANES, 2, (1, 2), 2);
    let turned = TURNED_WIDE.load(Ordering::Relaxed);
    let mut wide_calls = hash_and_check(&split, &[0], &data, &pieces, "the narrow worker alone");
    assert!(
        TURNED_WIDE.load(Ordering::Relaxed) > turned,
        "the narrow worker never turned wide"
    );
    for running in [vec![0, 1], vec![1]] {
        wide_calls += hash_and_check(&split, &running, &data, &pieces, &format!("workers {running:?}"));
    }
    // Two narrow workers of one lane each (a core for each of the two
    // largest), two wide ones.
    let split = assignment(Some(plan), WIDE_LANES, 4, (2, 1), 2);
    for running in [vec![0, 1, 2, 3], vec![0], vec![1, 3], vec![2]] {
        wide_calls += hash_and_check(
            &split,
            &running,
            &data,
            &pieces,
            &format!("(2, 1), workers {running:?}"),
        );
    }
    wide_kernel_tested(TEST, wide_calls);
}
