//! Moving apart lanes whose read positions alias in the cache.

use super::worker::{hash_step, Lane, Shared};
use super::ChunkSource;
use crate::sha256::BLOCK_LEN;

/// Read positions of two lanes closer than this to a multiple of
/// [`ALIAS_PERIOD`] are de-phased (see [`dephase`]).
const ALIAS_GUARD: usize = 16 * 1024;
/// Measured on Zen 4 (one core, four lanes, 16 MiB messages `d` bytes apart
/// in one mapping): any `d` within 4 KiB of a multiple of 32 MiB is slower,
/// by 1-4% at 32, 64 and 96 MiB and by 15-25% at 128 and 256 MiB; 8 KiB away,
/// or at multiples of 16 MiB that are not of 32, nothing is lost. It follows
/// virtual addresses (the guest's physical pages are scattered), and real
/// layouts hit it: tensors of one size lie back to back in a safetensors
/// file (128 MiB `q_proj`/`o_proj` in a 70B model) or in consecutive
/// allocations (`size + 4 KiB` apart), and largest-first scheduling starts
/// equal sizes together, so they run the whole tensor in lockstep.
const ALIAS_PERIOD: usize = 32 << 20;
/// How far a lane is moved ahead alone to leave the aliasing window.
const DEPHASE_BYTES: usize = 2 * ALIAS_GUARD;

/// Whether two read positions `d` bytes apart alias (see [`ALIAS_PERIOD`]).
fn aliases(d: usize) -> bool {
    // |d| modulo the period, below the guard: shift the window to start at 0.
    d.wrapping_add(ALIAS_GUARD - 1) & (ALIAS_PERIOD - 1) <= 2 * (ALIAS_GUARD - 1)
}

/// If two open lanes read at positions that alias, advances the later one
/// alone by [`DEPHASE_BYTES`] (one-stream kernel) and returns `true`. Lanes
/// of a group advance by equal steps, so the offset then holds for as long as
/// both messages run: a pair costs one short solo run (~20 us), against up to
/// a quarter of the core for the rest of two long tensors. Each call moves
/// the highest-index lane of the first aliasing pair, so repeated calls end
/// (a lane is moved out of at most three windows; earlier lanes never move).
pub(super) fn dephase<S: ChunkSource>(shared: &Shared<'_, S>, lanes: &mut [Option<Lane<'_, S>>]) -> bool {
    let at = |l: &Option<Lane<'_, S>>| {
        l.as_ref()
            .map_or(0, |l| l.task.source.chunk()[l.pos..].as_ptr() as usize)
    };
    let Some(j) = (1..lanes.len()).find(|&j| (0..j).any(|i| aliases(at(&lanes[j]).wrapping_sub(at(&lanes[i]))))) else {
        return false;
    };
    let Some(l) = lanes[j].as_mut() else {
        return false;
    };
    // The caller checked that every lane has a full step of whole blocks ready.
    let bytes = DEPHASE_BYTES.min(l.pending_len() / BLOCK_LEN * BLOCK_LEN);
    #[cfg(test)]
    tests::DEPHASED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    hash_step(shared, std::slice::from_mut(&mut lanes[j]), bytes, None);
    true
}

#[cfg(test)]
mod tests {
    use super::super::Scheduler;
    use super::*;
    use crate::sha256::{Kernel, STEP_BYTES};
    use sha2::Digest as _;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// How many times [`dephase`] moved a lane (all tests of this binary).
    pub(in crate::scheduler) static DEPHASED: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn alias_window_is_a_few_pages_either_side_of_each_period() {
        for k in [0usize, 1, 2, 4, 7] {
            let base = k * ALIAS_PERIOD;
            for near in [0, 4096, ALIAS_GUARD - 1] {
                assert!(aliases(base + near), "{base} + {near}");
                assert!(aliases(base.wrapping_sub(near)), "{base} - {near}");
                // Distances are taken as `later - earlier`, so both signs occur.
                assert!(aliases(0usize.wrapping_sub(base + near)));
            }
            for far in [ALIAS_GUARD, DEPHASE_BYTES, 64 << 10, 16 << 20] {
                assert!(!aliases(base + far), "{base} + {far}");
                assert!(
                    !aliases(base.wrapping_sub(far).wrapping_add(ALIAS_PERIOD)),
                    "{base} - {far}"
                );
            }
        }
    }

    /// Messages laid out so that lanes alias (and are moved apart), with
    /// lengths around the step and the de-phasing size, through every lane
    /// count: digests equal `sha2`, and the all-zero flag sees a byte that
    /// only the de-phasing pass read.
    #[test]
    fn aliasing_layouts_hash_exactly() {
        let lens = [
            (1 << 20) + 37,
            STEP_BYTES + DEPHASE_BYTES + 13,
            STEP_BYTES + 64,
            3 << 20,
            STEP_BYTES + DEPHASE_BYTES - 64,
        ];
        let jitter = [0usize, 4096, 0, 8192, 64 << 10];
        let starts: Vec<usize> = (0..5).map(|i| i * ALIAS_PERIOD + jitter[i]).collect();
        let pool_len = starts[4] + (3 << 20) + 4096;
        assert!(starts.windows(2).take(3).all(|w| aliases(w[1] - w[0])));
        let mut pool = vec![0u8; pool_len];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for b in pool.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
        let check = |pool: &[u8]| {
            let msgs: Vec<&[u8]> = starts.iter().zip(lens).map(|(&s, l)| &pool[s..s + l]).collect();
            for kernel in Kernel::all_available() {
                for lanes in [1, 2, 4, 16] {
                    for threads in [1, 2] {
                        let scheduler = Scheduler::new(kernel, lanes, threads);
                        for (m, d) in msgs.iter().zip(scheduler.hash_many(&msgs)) {
                            let want: [u8; 32] = sha2::Sha256::digest(m).into();
                            assert_eq!(d.bytes, want, "{scheduler:?} len {}", m.len());
                            assert_eq!(d.all_zero, m.iter().all(|&b| b == 0), "{scheduler:?}");
                        }
                    }
                }
            }
        };
        check(&pool);
        // All zero but one byte, inside the part a de-phased lane hashes
        // alone, then after it.
        for at in [100, DEPHASE_BYTES + 100] {
            pool.fill(0);
            for &s in &starts {
                pool[s + at] = 1;
            }
            check(&pool);
        }
        pool.fill(0);
        check(&pool);
        assert!(
            DEPHASED.load(Ordering::Relaxed) > 0,
            "no lane was de-phased: the layout does not test it"
        );
    }
}
