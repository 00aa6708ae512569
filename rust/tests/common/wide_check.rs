//! The test policy for the wide (16-lane AVX-512) kernel, shared by the
//! integration tests (`rust/tests/common`) and the crate's unit tests.
//!
//! The crate runs the wide kernel where the CPU has AVX-512 (`avx512f`,
//! `avx512bw`) beside the SHA-NI narrow kernel (the portable one never hands
//! it work). On a CPU without them the tests that would exercise the wide
//! kernel run their narrow paths only; each says so on stderr (written past
//! the test harness's capture, so it shows in a passing run). Where the CPU
//! has them and `CI` is `true` or `1`, a test that did not exercise the wide
//! kernel fails: CI must not pass with it untested.
#![allow(dead_code)]

use std::io::Write as _;

/// Whether this CPU has the features the crate runs the wide kernel with
/// (AVX-512 F and BW, and SHA-NI beside it), asked directly, not through
/// the crate's own detection, which is part of what is checked.
pub fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("sha")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this is a CI run: `CI` is `true` or `1` (any case, whitespace
/// ignored).
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"))
}

/// The verdict for `test`: `Ok(None)` when it exercised the wide kernel,
/// `Ok(Some(notice))` when it did not and that is allowed, `Err(why)` when
/// it must fail (CI, a CPU with AVX-512, the kernel not exercised).
pub fn outcome(test: &str, cpu_has: bool, detected: bool, exercised: bool, ci: bool) -> Result<Option<String>, String> {
    if detected && exercised {
        return Ok(None);
    }
    let notice = if detected {
        format!("{test}: the wide kernel is available on this CPU but this test did not exercise it")
    } else {
        format!("{test}: wide kernel not available on this CPU: not tested")
    };
    if ci && cpu_has {
        Err(format!(
            "{notice} (CI: this CPU has AVX-512, so the wide kernel must be tested)"
        ))
    } else {
        Ok(Some(notice))
    }
}

/// Reports whether `test` exercised the wide kernel (`detected`: the crate
/// found it and a narrow kernel that hands it work; `exercised`: it ran): a
/// notice on stderr where it did not, a panic where CI requires it.
pub fn report(test: &str, detected: bool, exercised: bool) {
    match outcome(test, cpu_has_avx512(), detected, exercised, ci()) {
        Ok(None) => {}
        Ok(Some(notice)) => {
            let _ = writeln!(std::io::stderr(), "note: {notice}");
        }
        Err(why) => panic!("{why}"),
    }
}
