//! Criterion benches: the scheduler against plain `sha2`, one thread, for 1, 2
//! and 4 interleaved narrow streams, the same-length path small batches take, plus
//! all threads. Each case hashes a batch of equal buffers so the
//! multi-stream scheduler has messages to pair. The last case is 10,000
//! small parameters as a model holds them, each its own allocation.
//!
//!     cargo bench --bench scheduler

use std::time::Duration;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use sha2::Digest as _;
use weight_checker::scheduler::hash_batched;
use weight_checker::{Kernel, Scheduler};

fn cases() -> Vec<(&'static str, usize, usize)> {
    // (label, buffer size, buffer count)
    vec![
        ("4KiB x 4096", 4 << 10, 4096),
        ("64KiB x 256", 64 << 10, 256),
        ("1MiB x 32", 1 << 20, 32),
        ("64MiB x 4", 64 << 20, 4),
    ]
}

fn bench(c: &mut Criterion) {
    let best = Kernel::best_available();
    for (label, size, count) in cases() {
        // Large buffers start 2 MiB past the end of the one before, as the C
        // probe's separate 2 MiB-aligned allocations do. Packed at exactly
        // 64 MiB apart, four streams read the same DRAM bank at every step
        // (advancing in lockstep, their addresses differ by a power of two):
        // 3.1-3.2 GB/s on one core here instead of 3.42-3.44, for the same
        // kernel, which measured the layout rather than the hashing.
        let gap = if size >= 1 << 20 { 2 << 20 } else { 0 };
        let stride = size + gap;
        let pool: Vec<u8> = (0..stride * count)
            .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
            .collect();
        let bufs: Vec<&[u8]> = pool.chunks(stride).map(|c| &c[..size]).collect();
        let mut group = c.benchmark_group(label);
        group.throughput(Throughput::Bytes((size * count) as u64));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        group.bench_function("sha2 1 thread", |b| {
            b.iter(|| bufs.iter().map(sha2::Sha256::digest).collect::<Vec<_>>())
        });
        for lanes in [1, 2, 4] {
            let scheduler = Scheduler::new(best, lanes, 1);
            group.bench_with_input(
                BenchmarkId::new(format!("{best} 1 thread"), format!("{lanes} streams")),
                &scheduler,
                |b, e| b.iter(|| e.hash_many(&bufs)),
            );
        }
        if size <= 64 << 10 {
            // Batches of one length skip the scheduler (what `Batches` does).
            group.bench_function(format!("{best} 1 thread same-length 4 streams"), |b| {
                b.iter(|| weight_checker::sha256::digest_same_length(best, 4, &bufs))
            });
        }
        let all = Scheduler::default();
        group.bench_function(format!("{} all threads {} streams", all.kernel, all.lanes), |b| {
            b.iter(|| all.hash_many(&bufs))
        });
        group.finish();
    }
}

/// Small parameters as a model holds them: each its own allocation (41 MB
/// in all, more than the L3), hashed one group of 4 at a time on one thread,
/// then through `Batches` on all threads as the Python binding does.
fn bench_separate(c: &mut Criterion) {
    let best = Kernel::best_available();
    let (size, count) = (4 << 10, 10_000);
    let owned: Vec<Vec<u8>> = (0..count)
        .map(|i| (0..size).map(|j| (i * 31 + j) as u8).collect())
        .collect();
    let bufs: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
    let mut group = c.benchmark_group("4KiB x 10000 separate allocations");
    group.throughput(Throughput::Bytes((size * count) as u64));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    group.bench_function(format!("{best} 1 thread same-length 4 streams"), |b| {
        b.iter(|| weight_checker::sha256::digest_same_length(best, 4, &bufs))
    });
    let all = Scheduler::default();
    group.bench_function(format!("{} Batches all threads", all.kernel), |b| {
        b.iter(|| hash_batched(all, &bufs))
    });
    group.finish();
}

criterion_group!(benches, bench, bench_separate);

/// `criterion_main!`, after checking the core's settings: an invalid
/// `WEIGHT_CHECKER_*` value is reported, not silently defaulted.
fn main() {
    if let Err(e) = weight_checker::settings::check() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
