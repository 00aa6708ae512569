//! Per-core SHA-256 throughput with 1, 2 and 4 interleaved narrow streams
//! (SHA-NI where the CPU has it) and the 16-lane wide AVX-512 kernel, on
//! this machine: the calibrations' figures
//! (L2-hot; 16 x 256 KiB for the streaming one), then 16 x 16 MiB buffers
//! streamed from DRAM on one thread; and the small-message calibration.
//! Compare with the C probes in shared/shani-probe and shared/mb-probe.
//!
//!     cargo run --release --example lanes

use weight_checker::{settings, Kernel, Scheduler};

fn main() {
    // An invalid WEIGHT_CHECKER_* setting is reported, not silently defaulted.
    if let Err(e) = settings::check() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let kernel = Kernel::best_available();
    let (chosen, figures) = kernel.calibrate_lanes();
    println!("calibration (L2-hot, GB/s per lane count): {figures:?}; chosen {chosen}");
    match kernel.wide_stream_rates() {
        Some((wide, four)) => {
            println!("streaming calibration (16 x 256 KiB): 16-lane wide {wide:.2} GB/s, {kernel} x4 {four:.2} GB/s")
        }
        None => println!("streaming calibration: no wide kernel on this CPU (or the lanes are fixed)"),
    }
    let pool: Vec<u8> = (0..16 * (16usize << 20))
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let bufs: Vec<&[u8]> = pool.chunks(16 << 20).collect();
    for lanes in [1, 2, 4, 16] {
        let scheduler = Scheduler::new(kernel, lanes, 1);
        let mut best = 0f64;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            std::hint::black_box(scheduler.hash_many(&bufs));
            best = best.max(pool.len() as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
        let name = if scheduler.effective_lanes() == 16 {
            format!("wide ({})", weight_checker::sha256::Wide::NAME)
        } else {
            format!("narrow ({kernel})")
        };
        println!(
            "{name} {} lanes, one thread, 16 x 16 MiB: {best:.2} GB/s",
            scheduler.effective_lanes()
        );
    }
    let (wide, own) = kernel.calibrate_small();
    println!(
        "64 x 4 KiB of one length, L2-hot: 16-lane wide {wide:.2} GB/s, {kernel} x{} {own:.2} GB/s; \
         small messages use {} lanes",
        kernel.default_lanes(),
        kernel.small_message_lanes()
    );
}
