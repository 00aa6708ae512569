//! Per-core SHA-256 throughput with 1, 2 and 4 interleaved streams, on this
//! machine: the calibration's L2-hot figures and 4 x 64 MiB buffers streamed
//! from DRAM, one thread; and the small-message calibration (the 16-lane
//! AVX-512 kernel against this kernel's lanes). Compare with the C probes in
//! shared/shani-probe and shared/mb-probe.
//!
//!     cargo run --release --example lanes

use weight_checker::{Kernel, Scheduler};

fn main() {
    let kernel = Kernel::best_available();
    let (chosen, figures) = kernel.calibrate_lanes();
    println!("calibration (L2-hot, GB/s per lane count): {figures:?}; chosen {chosen}");
    let pool: Vec<u8> = (0..4 * (64usize << 20))
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let bufs: Vec<&[u8]> = pool.chunks(64 << 20).collect();
    for lanes in [1, 2, 4] {
        let scheduler = Scheduler::new(kernel, lanes, 1);
        let mut best = 0f64;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            std::hint::black_box(scheduler.hash_many(&bufs));
            best = best.max(pool.len() as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
        println!("{kernel} {lanes} lanes, one thread, 4 x 64 MiB: {best:.2} GB/s");
    }
    let (wide, own) = kernel.calibrate_small();
    println!(
        "64 x 4 KiB of one length, L2-hot: 16-lane AVX-512 {wide:.2} GB/s, {kernel} x{} {own:.2} GB/s; \
         small messages use {} lanes",
        kernel.default_lanes(),
        kernel.small_message_lanes()
    );
}
