//! The core's environment settings, in one place: their names, the values
//! each accepts, and the one parser of each.
//!
//! - `WEIGHT_CHECKER_KERNEL`: `auto` (the fastest narrow kernel this CPU
//!   has), `portable` (the `sha2` crate, one stream) or `sha-ni` (the
//!   interleaved SHA-NI kernels; the portable one where the CPU lacks them).
//! - `WEIGHT_CHECKER_LANES`: `1`, `2` or `4` narrow lanes per thread, or
//!   `16` for the 16-lane wide (AVX-512) kernel where the CPU has it;
//!   unset, the lanes are measured at first use.
//! - `WEIGHT_CHECKER_THREADS`: a positive integer; unset, the share set by
//!   [`crate::scheduler::set_default_threads`], else the cores in this
//!   process's CPU affinity.
//!
//! An unset or empty (or all-whitespace) variable means the default;
//! surrounding whitespace is ignored. Any other value must be one the
//! variable accepts: a typo is an error naming the variable, the value and
//! what it accepts ([`SettingError`]), never a silent default. The readers
//! ([`crate::Kernel::active`], the lane choice, the thread count) read
//! through this module; the Python binding checks all three ([`check`])
//! before any work, and pure-Rust callers should too (or build with
//! [`crate::Scheduler::from_env`]): a reader that meets an invalid value
//! panics with the same message rather than pick a default.

use std::ffi::OsString;
use std::fmt;

/// Environment variable that selects the narrow kernel.
pub const KERNEL_ENV: &str = "WEIGHT_CHECKER_KERNEL";
/// Environment variable that fixes the lanes per thread.
pub const LANES_ENV: &str = "WEIGHT_CHECKER_LANES";
/// Environment variable that sets the worker threads of every scheduler.
pub const THREADS_ENV: &str = "WEIGHT_CHECKER_THREADS";

const KERNEL_EXPECTED: &str = "one of auto, portable, sha-ni (unset: auto)";
const LANES_EXPECTED: &str = "one of 1, 2, 4, 16 (unset: measured at first use)";
const THREADS_EXPECTED: &str =
    "a positive integer (unset: the share set by set_threads, else the cores in this process's CPU affinity)";

/// What [`KERNEL_ENV`] asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelSetting {
    /// The fastest narrow kernel this CPU has (also when unset).
    #[default]
    Auto,
    /// The `sha2` crate's one-stream path.
    Portable,
    /// The interleaved SHA-NI kernels (the portable path where the CPU
    /// lacks them).
    ShaNi,
}

/// An invalid value of one of the core's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingError {
    /// The variable, e.g. `WEIGHT_CHECKER_LANES`.
    pub name: &'static str,
    /// The value as given (lossily decoded where it is not UTF-8).
    pub value: String,
    /// The values it accepts, and what unset means.
    pub expected: &'static str,
}

impl fmt::Display for SettingError {
    /// `WEIGHT_CHECKER_LANES='8': expected one of 1, 2, 4, 16 (unset:
    /// measured at first use)`; control characters and quotes in the value
    /// are escaped, so the message stays one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}='{}': expected {}",
            self.name,
            self.value.escape_debug(),
            self.expected
        )
    }
}

impl std::error::Error for SettingError {}

fn invalid(name: &'static str, value: &str, expected: &'static str) -> SettingError {
    SettingError {
        name,
        value: value.to_owned(),
        expected,
    }
}

/// Parses a [`KERNEL_ENV`] value (`""`: the default, [`KernelSetting::Auto`]).
pub fn parse_kernel(value: &str) -> Result<KernelSetting, SettingError> {
    match value.trim() {
        "" | "auto" => Ok(KernelSetting::Auto),
        "portable" => Ok(KernelSetting::Portable),
        "sha-ni" => Ok(KernelSetting::ShaNi),
        _ => Err(invalid(KERNEL_ENV, value, KERNEL_EXPECTED)),
    }
}

/// Parses a [`LANES_ENV`] value: `Some(1 | 2 | 4 | 16)`, or `None` (`""`:
/// measured at first use).
pub fn parse_lanes(value: &str) -> Result<Option<usize>, SettingError> {
    match value.trim() {
        "" => Ok(None),
        "1" => Ok(Some(1)),
        "2" => Ok(Some(2)),
        "4" => Ok(Some(4)),
        "16" => Ok(Some(16)),
        _ => Err(invalid(LANES_ENV, value, LANES_EXPECTED)),
    }
}

/// Parses a [`THREADS_ENV`] value: `Some(n)` with `n >= 1`, or `None`
/// (`""`: the process default).
pub fn parse_threads(value: &str) -> Result<Option<usize>, SettingError> {
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    match trimmed.parse::<usize>() {
        Ok(n) if n > 0 && trimmed.bytes().all(|b| b.is_ascii_digit()) => Ok(Some(n)),
        _ => Err(invalid(THREADS_ENV, value, THREADS_EXPECTED)),
    }
}

/// The variable's value now: `Ok("")` when unset, an error for a value
/// that is not UTF-8 (no accepted value is).
fn read(name: &'static str, expected: &'static str) -> Result<String, SettingError> {
    match std::env::var_os(name) {
        None => Ok(String::new()),
        Some(raw) => raw
            .into_string()
            .map_err(|raw: OsString| invalid(name, &raw.to_string_lossy(), expected)),
    }
}

/// [`KERNEL_ENV`] as it is now.
pub fn kernel() -> Result<KernelSetting, SettingError> {
    parse_kernel(&read(KERNEL_ENV, KERNEL_EXPECTED)?)
}

/// [`LANES_ENV`] as it is now.
pub fn lanes() -> Result<Option<usize>, SettingError> {
    parse_lanes(&read(LANES_ENV, LANES_EXPECTED)?)
}

/// [`THREADS_ENV`] as it is now.
pub fn threads() -> Result<Option<usize>, SettingError> {
    parse_threads(&read(THREADS_ENV, THREADS_EXPECTED)?)
}

/// Checks all three settings as the environment holds them now (three
/// `getenv`s): the first invalid one, in the order kernel, lanes, threads.
pub fn check() -> Result<(), SettingError> {
    kernel()?;
    lanes()?;
    threads()?;
    Ok(())
}

/// A reader's value, or a panic with the setting's message: readers cannot
/// return an error, and a default would hide the typo. Entry points check
/// first ([`check`]), so this only fires for a caller that did not.
pub(crate) fn or_panic<T>(value: Result<T, SettingError>) -> T {
    value.unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_values_parse() {
        assert_eq!(parse_kernel("auto"), Ok(KernelSetting::Auto));
        assert_eq!(parse_kernel("portable"), Ok(KernelSetting::Portable));
        assert_eq!(parse_kernel("sha-ni"), Ok(KernelSetting::ShaNi));
        for (value, lanes) in [("1", 1), ("2", 2), ("4", 4), ("16", 16)] {
            assert_eq!(parse_lanes(value), Ok(Some(lanes)));
        }
        assert_eq!(parse_threads("1"), Ok(Some(1)));
        assert_eq!(parse_threads("12"), Ok(Some(12)));
        assert_eq!(parse_threads("0012"), Ok(Some(12)));
    }

    #[test]
    fn empty_means_the_default() {
        assert_eq!(parse_kernel(""), Ok(KernelSetting::Auto));
        assert_eq!(parse_lanes(""), Ok(None));
        assert_eq!(parse_threads(""), Ok(None));
        // All whitespace counts as empty.
        assert_eq!(parse_kernel("  "), Ok(KernelSetting::Auto));
        assert_eq!(parse_lanes(" \t"), Ok(None));
        assert_eq!(parse_threads("\n"), Ok(None));
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(parse_kernel(" portable\n"), Ok(KernelSetting::Portable));
        assert_eq!(parse_lanes(" 16 "), Ok(Some(16)));
        assert_eq!(parse_threads("\t3 "), Ok(Some(3)));
        // Not inside a value.
        assert!(parse_lanes("1 6").is_err());
        assert!(parse_kernel("sha -ni").is_err());
    }

    #[test]
    fn values_not_accepted_are_errors_naming_variable_value_and_choices() {
        let e = parse_lanes("8").unwrap_err();
        assert_eq!(
            e.to_string(),
            "WEIGHT_CHECKER_LANES='8': expected one of 1, 2, 4, 16 (unset: measured at first use)"
        );
        for lanes in ["0", "3", "32", "four", "-4", "4.0", "+4", "0x4"] {
            assert_eq!(parse_lanes(lanes).unwrap_err().name, LANES_ENV, "{lanes}");
        }
        let e = parse_kernel("sha_ni").unwrap_err();
        assert_eq!(
            e.to_string(),
            "WEIGHT_CHECKER_KERNEL='sha_ni': expected one of auto, portable, sha-ni (unset: auto)"
        );
        for kernel in ["SHA-NI", "Portable", "avx512", "sha-ni+avx512-x16", "1"] {
            assert_eq!(parse_kernel(kernel).unwrap_err().name, KERNEL_ENV, "{kernel}");
        }
    }

    #[test]
    fn threads_must_be_a_positive_integer() {
        let e = parse_threads("0").unwrap_err();
        assert_eq!(e.name, THREADS_ENV);
        assert!(
            e.to_string()
                .starts_with("WEIGHT_CHECKER_THREADS='0': expected a positive integer"),
            "{e}"
        );
        for threads in ["-1", "+2", "1.5", "two", "2 cores", "99999999999999999999999", "00"] {
            assert!(parse_threads(threads).is_err(), "{threads}");
        }
    }

    #[test]
    fn the_value_is_shown_as_given_on_one_line() {
        // Whitespace is kept in the message (it is part of what was given),
        // escaped so that the message stays one line.
        let e = parse_lanes(" 8\n").unwrap_err();
        assert_eq!(e.value, " 8\n");
        assert!(e.to_string().starts_with("WEIGHT_CHECKER_LANES=' 8\\n': "), "{e}");
        assert!(!e.to_string().contains('\n'));
    }
}
