//! Model-shaped runs through the scheduler, in memory, on all threads: the
//! calibrated default against narrow lanes fixed at 4 and the wide AVX-512
//! kernel asked for (16), measured side by side, best of 5 each, with the
//! assignment the calibrated scheduler chose for each shape (workers,
//! kernel and lanes of each).
//!
//!     cargo run --release --example shapes [NAME-PART]

use weight_checker::{Kernel, Scheduler};

/// The tensors of a Llama-architecture model (bf16): the embedding (and an
/// untied `lm_head`), then per layer q, k, v, o, gate, up, down and two
/// norms.
fn llama_like(hidden: usize, inter: usize, kv: usize, vocab: usize, layers: usize, tied: bool) -> Vec<usize> {
    let (h, i) = (hidden, inter);
    let mut sizes = vec![vocab * h * 2; if tied { 1 } else { 2 }];
    for _ in 0..layers {
        sizes.extend([
            h * h * 2,
            kv * h * 2,
            kv * h * 2,
            h * h * 2,
            i * h * 2,
            i * h * 2,
            i * h * 2,
            h * 2,
            h * 2,
        ]);
    }
    sizes
}

fn main() {
    // An invalid WEIGHT_CHECKER_* setting is reported, not silently defaulted.
    let calibrated = match Scheduler::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let kernel = Kernel::best_available();
    let mib = 1usize << 20;
    let layer_70b = vec![
        128 * mib,
        16 * mib,
        16 * mib,
        128 * mib,
        448 * mib,
        448 * mib,
        448 * mib,
        16384,
        16384,
    ];
    let shapes: [(&str, Vec<usize>); 6] = [
        ("one Llama-70B layer", layer_70b),
        // The benchmarks' Llama-shaped set: hidden 2048, 8 layers, vocab 32000.
        ("llama-shaped 0.98 GB", llama_like(2048, 5632, 512, 32000, 8, false)),
        // Llama-3.2-3B: 254 tensors, one 788 MB embedding among 6-50 MB ones.
        (
            "Llama-3.2-3B-shaped 6.4 GB",
            llama_like(3072, 8192, 1024, 128256, 28, true),
        ),
        ("64 x 16 MiB", vec![16 << 20; 64]),
        ("8 x 128 MiB", vec![128 << 20; 8]),
        // Llama-3-8B, 16 GB in memory: only when named (`shapes 8B`).
        (
            "Llama-3-8B-shaped 16 GB (only when named)",
            llama_like(4096, 14336, 1024, 128256, 32, false),
        ),
    ];
    // `cargo run --release --example shapes -- 3B`: the shapes whose name has "3B".
    let only = std::env::args().nth(1);
    for (name, sizes) in shapes {
        let wanted = match &only {
            Some(o) => name.contains(o.as_str()),
            None => !name.contains("only when named"),
        };
        if !wanted {
            continue;
        }
        let total: usize = sizes.iter().sum();
        let pool: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![7u8; n]).collect();
        let bufs: Vec<&[u8]> = pool.iter().map(Vec::as_slice).collect();
        let narrow = format!("narrow {kernel} x4");
        let schedulers = [
            ("calibrated", calibrated),
            (narrow.as_str(), Scheduler::new(kernel, 4, 0)),
            ("wide avx512 x16", Scheduler::new(kernel, 16, 0)),
        ];
        let mut best = [f64::MAX; 3];
        for _ in 0..5 {
            for (b, (_, s)) in best.iter_mut().zip(&schedulers) {
                let start = std::time::Instant::now();
                std::hint::black_box(s.hash_many(&bufs));
                *b = b.min(start.elapsed().as_secs_f64());
            }
        }
        let line: Vec<String> = schedulers
            .iter()
            .zip(best)
            .map(|((n, _), t)| format!("{n} {:.4} s ({:.2} GB/s)", t, total as f64 / t / 1e9))
            .collect();
        println!("{name}: {}", line.join(", "));
        let sizes: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
        println!(
            "  calibrated assignment: {}",
            schedulers[0].1.describe_assignment(&sizes)
        );
    }
}
