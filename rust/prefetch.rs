//! Cache prefetch hints, shared by the small-message hashing path and the
//! walk of a torch module.

/// Asks the cache (all levels) for the `lines` 64-byte lines starting at
/// `address`. A hint only: it reads nothing architecturally and never
/// faults, whatever the address, so any address is allowed; a no-op off
/// x86-64.
#[inline]
pub(crate) fn lines(address: usize, lines: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in 0..lines {
        // SAFETY: a prefetch neither faults nor reads architecturally, so the
        // address needs no validity; SSE is baseline on x86-64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                address.wrapping_add(64 * line) as *const i8
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (address, lines);
}
