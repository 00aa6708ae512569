//! NIST SHA-256 vectors through every kernel, lane width and entry point.

mod common;

use common::{wide_check, WideCheck};
use weight_checker::{Kernel, Scheduler, Sha256};

fn vectors() -> Vec<(Vec<u8>, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/sha256-nist.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let msg = v["message"]
                .as_str()
                .unwrap()
                .repeat(v["repeat"].as_u64().unwrap() as usize);
            (msg.into_bytes(), v["digest"].as_str().unwrap().to_string())
        })
        .collect()
}

#[test]
fn nist_vectors_one_shot_every_backend() {
    for kernel in Kernel::all_available() {
        for (msg, want) in vectors() {
            let got = weight_checker::sha256::digest_with(kernel, &msg);
            assert_eq!(got.hex(), want, "kernel {kernel}, len {}", msg.len());
        }
    }
}

#[test]
fn nist_vectors_batched_every_lane_width() {
    let wide = WideCheck::start("nist_vectors_batched_every_lane_width");
    // Each vector eight times: enough messages to fill sixteen lanes, so that
    // the wide kernel runs where the CPU has it.
    let vectors: Vec<(Vec<u8>, String)> = vectors().into_iter().flat_map(|v| std::iter::repeat_n(v, 8)).collect();
    let messages: Vec<&[u8]> = vectors.iter().map(|(m, _)| m.as_slice()).collect();
    let mut schedulers = vec![Scheduler::default()]; // the calibrated lane count
    for kernel in Kernel::all_available() {
        for lanes in [1, 2, 3, 4, 16] {
            for threads in [1, 0] {
                schedulers.push(Scheduler::new(kernel, lanes, threads));
            }
        }
    }
    for scheduler in schedulers {
        let got = scheduler.hash_many(&messages);
        for ((_, want), d) in vectors.iter().zip(&got) {
            assert_eq!(&d.hex(), want, "{scheduler:?}");
        }
    }
    wide.finish();
}

#[test]
fn nist_vectors_incremental_byte_by_byte_prefix() {
    for kernel in Kernel::all_available() {
        for (msg, want) in vectors().into_iter().filter(|(m, _)| m.len() < 1000) {
            let mut s = Sha256::new();
            for b in &msg {
                s.update_with(kernel, std::slice::from_ref(b));
            }
            assert_eq!(s.finalize_with(kernel).hex(), want);
        }
    }
}

#[test]
fn all_zero_flag() {
    let zeros = vec![0u8; 1 << 20];
    let mut late = zeros.clone();
    *late.last_mut().unwrap() = 1;
    for kernel in Kernel::all_available() {
        let e = Scheduler::new(kernel, 2, 0);
        let d = e.hash_many(&[&zeros, &late, b"", &zeros[..63]]);
        assert_eq!(
            d.iter().map(|d| d.all_zero).collect::<Vec<_>>(),
            [true, false, true, true]
        );
    }
}

#[test]
fn calibration_measures_every_lane_count_and_chooses_one_it_can_run() {
    // The rule itself is tested on real cores' figures in sha256/calibrate.rs.
    for kernel in Kernel::all_available() {
        let (chosen, figures) = kernel.calibrate_lanes();
        assert_eq!(figures.map(|f| f.0), [1, 2, 4]);
        assert!(figures.iter().all(|f| f.1 > 0.0), "{figures:?}");
        assert!([1, 2, 4].contains(&chosen) && chosen <= kernel.max_lanes());
        assert!([1, 2, 4, 16].contains(&kernel.default_lanes()));
    }
}

#[test]
fn nist_vectors_through_the_wide_kernel() {
    let wide = WideCheck::start("nist_vectors_through_the_wide_kernel");
    // Each vector seventeen times: one group of sixteen in the wide kernel
    // (where the CPU has it) and one left for the narrow lanes.
    for kernel in Kernel::all_available() {
        for (msg, want) in vectors() {
            let copies: Vec<&[u8]> = std::iter::repeat_n(msg.as_slice(), 17).collect();
            let got = weight_checker::sha256::digest_same_length(kernel, weight_checker::sha256::WIDE_LANES, &copies);
            assert!(
                got.iter().all(|d| d.hex() == want),
                "kernel {kernel}, len {}",
                msg.len()
            );
        }
    }
    wide.finish();
}

/// The policy of the tests above: a notice where the CPU lacks the wide
/// kernel or it was not exercised; a failure only in CI on a CPU that has it.
#[test]
fn an_untested_wide_kernel_fails_ci_only_where_the_cpu_has_it() {
    use wide_check::outcome;
    assert_eq!(outcome("t", true, true, true, true), Ok(None));
    assert_eq!(
        outcome("t", false, false, false, false),
        Ok(Some("t: wide kernel not available on this CPU: not tested".into()))
    );
    // Without AVX-512, CI passes with the notice.
    assert!(matches!(outcome("t", false, false, false, true), Ok(Some(_))));
    // With it: detection or the scheduler failing to use it fails CI...
    assert!(outcome("t", true, false, false, true)
        .unwrap_err()
        .contains("not available"));
    assert!(outcome("t", true, true, false, true)
        .unwrap_err()
        .contains("did not exercise"));
    // ... and is a notice elsewhere.
    assert!(matches!(outcome("t", true, true, false, false), Ok(Some(_))));
}

/// `autotests` is off (the root `tests/` holds the Python suite), so a file
/// in `rust/tests/` runs only if Cargo.toml declares it: fail for one that
/// would silently never run.
#[test]
fn every_rust_test_file_is_declared_in_cargo_toml() {
    let root = env!("CARGO_MANIFEST_DIR");
    let manifest = std::fs::read_to_string(format!("{root}/Cargo.toml")).unwrap();
    for entry in std::fs::read_dir(format!("{root}/rust/tests")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".rs") {
            assert!(
                manifest.contains(&format!("path = \"rust/tests/{name}\"")),
                "rust/tests/{name} is not a [[test]] in Cargo.toml, so it never runs"
            );
        }
    }
}
