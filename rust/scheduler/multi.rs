//! Digests fed over many calls: a tensor hashed one staged chunk at a time.

use super::worker::Task;
use super::{ChunkSource, Scheduler, Slices};
use crate::error::Error;
use crate::sha256::{Digest, Sha256};

/// Several digests open at once, each fed its bytes in order over many
/// calls, from many buffers in parallel. This is how a tensor larger than a
/// staging slot is hashed one slot-sized chunk at a time.
pub struct MultiHasher {
    scheduler: Scheduler,
    states: Vec<Sha256>,
}

impl MultiHasher {
    pub(super) fn new(scheduler: Scheduler, n: usize) -> MultiHasher {
        MultiHasher {
            scheduler,
            states: vec![Sha256::new(); n],
        }
    }

    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// A hasher whose digests continue the given chain states
    /// ([`Sha256::import`]ed): each fed bytes continue its message.
    pub(super) fn resume(scheduler: Scheduler, states: Vec<Sha256>) -> MultiHasher {
        MultiHasher { scheduler, states }
    }

    /// The chain states of every digest, in index order ([`Sha256::export`]):
    /// another hasher, in this process or another, can continue each.
    pub fn export(&self) -> Vec<Vec<u8>> {
        self.states.iter().map(Sha256::export).collect()
    }

    /// Bytes fed so far to digest `index`.
    pub fn bytes_fed(&self, index: usize) -> Option<u64> {
        self.states.get(index).map(|s| s.len())
    }

    /// Feeds each `(digest index, bytes)` pair. Pairs for the same digest are
    /// applied in the order given; different digests are hashed in parallel.
    /// Each call is one run of the scheduler (its shape recorded for
    /// [`super::last_run`]).
    pub fn update(&mut self, feeds: &[(usize, &[u8])]) -> Result<(), Error> {
        if let Some(&(bad, _)) = feeds.iter().find(|(i, _)| *i >= self.states.len()) {
            return Err(Error::DigestIndex {
                index: bad,
                len: self.states.len(),
            });
        }
        let mut order: Vec<usize> = (0..feeds.len()).collect();
        order.sort_by_key(|&i| feeds[i].0); // stable: keeps each digest's order
        let chunks: Vec<&[u8]> = order.iter().map(|&i| feeds[i].1).collect();
        let mut tasks = Vec::new();
        let mut start = 0;
        let mut states = self.states.iter_mut().enumerate();
        while start < order.len() {
            let index = feeds[order[start]].0;
            let mut end = start;
            while end < order.len() && feeds[order[end]].0 == index {
                end += 1;
            }
            let state = states.find(|(i, _)| *i == index).unwrap().1;
            let source = Slices::new(&chunks[start..end]);
            tasks.push(Task {
                bytes: source.total_bytes(),
                state,
                source,
                digest_out: None,
            });
            start = end;
        }
        let (outcome, shape) = self.scheduler.run(tasks, None);
        super::report::record(shape);
        outcome
    }

    /// Pads and finishes every digest, in index order.
    pub fn finish(self) -> Vec<Digest> {
        let kernel = self.scheduler.kernel;
        self.states.into_iter().map(|s| s.finalize_with(kernel)).collect()
    }
}

/// Each strided view open at once gathers at most this many bytes a round.
const GATHER_ROUND_BYTES: usize = crate::strided::GATHER_BYTES;
/// Rows at least this long are hashed where they lie; shorter ones gathered
/// (a slice per row would cost more than its bytes).
const ROW_SLICE_MIN_BYTES: usize = 512;

impl Scheduler {
    /// SHA-256 of each view's C-order bytes, through the lanes like
    /// contiguous messages. A view made of contiguous rows of at least
    /// [`ROW_SLICE_MIN_BYTES`] (a tensor narrowed along its last dimension,
    /// as a row-parallel shard is) is fed its rows where they lie, all such
    /// views in one run, nothing copied. Any other is gathered in rounds: up
    /// to `streams()` views (at least 8) each gather their next bounded piece
    /// (in parallel) and the pieces are hashed as one run, the views
    /// continuing their streams, a finished one's place taken by the next.
    /// Hashing each view as one gathered stream of its own ran at half the
    /// rate of contiguous tensors.
    pub fn hash_strided(&self, views: &[&crate::strided::StridedView]) -> Vec<Digest> {
        use rayon::prelude::*;

        let mut multi = self.multi(views.len());
        let mut gathered = Vec::new();
        let mut rows: Vec<(usize, &[u8])> = Vec::new();
        for (i, view) in views.iter().enumerate() {
            match view.contiguous_rows() {
                Some(r) if r.first().is_none_or(|row| row.len() >= ROW_SLICE_MIN_BYTES) => {
                    rows.extend(r.into_iter().map(|row| (i, row)));
                }
                _ => gathered.push(i),
            }
        }
        if !rows.is_empty() {
            multi
                .update(&rows)
                .expect("every index is a view's, below the hasher's length");
        }
        let open_max = self.streams().max(8);
        // (view index, next row, its gathered piece)
        let mut open: Vec<(usize, usize, Vec<u8>)> = Vec::with_capacity(open_max);
        let mut next = gathered.into_iter().filter(|&i| views[i].rows() > 0);
        loop {
            while open.len() < open_max {
                let Some(i) = next.next() else { break };
                open.push((i, 0, Vec::with_capacity(GATHER_ROUND_BYTES)));
            }
            if open.is_empty() {
                break;
            }
            open.par_iter_mut().for_each(|(i, row, piece)| {
                piece.clear();
                views[*i].gather(row, piece, GATHER_ROUND_BYTES);
            });
            let feeds: Vec<(usize, &[u8])> = open.iter().map(|(i, _, p)| (*i, &p[..])).collect();
            multi
                .update(&feeds)
                .expect("every index is a view's, below the hasher's length");
            open.retain(|(i, row, _)| *row < views[*i].rows());
        }
        multi.finish()
    }
}

#[cfg(test)]
mod strided_tests {
    use super::*;
    use crate::strided::StridedView;
    use sha2::Digest as _;

    /// Every kind of view, read by row, gathered, empty, all in one call,
    /// hashes like sha2 over its explicit C-order copy, whatever the lanes.
    #[test]
    fn hash_strided_matches_sha2_over_the_c_order_copy() {
        let data: Vec<u8> = (0..3 * 1024 * 700u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let p = data.as_ptr();
        // SAFETY: every view lies inside `data`, which outlives them and is never written.
        let views = unsafe {
            vec![
                // A 700 x 1024 shard of a 700 x 3072 array: rows of 1 KiB read in place.
                StridedView::new(p.add(1024), 1, vec![700, 1024], vec![3072, 1]),
                // Rows of 100 bytes: gathered.
                StridedView::new(p, 1, vec![700, 100], vec![3000, 1]),
                // Transposed 2-byte items: gathered element by element.
                StridedView::new(p, 2, vec![64, 300], vec![2, 128]),
                // Empty.
                StridedView::new(p, 1, vec![0, 4], vec![4, 1]),
                // Three dimensions, rows of 512 bytes.
                StridedView::new(p, 1, vec![3, 40, 512], vec![600_000, 3000, 1]),
            ]
        };
        let refs: Vec<&StridedView> = views.iter().collect();
        for lanes in [1, 2, 4] {
            let scheduler = Scheduler {
                lanes,
                threads: 2,
                ..Scheduler::default()
            };
            let digests = scheduler.hash_strided(&refs);
            for (view, digest) in views.iter().zip(&digests) {
                let mut bytes = Vec::new();
                view.for_each_piece(|piece| bytes.extend_from_slice(piece));
                assert_eq!(
                    digest.bytes[..],
                    sha2::Sha256::digest(&bytes)[..],
                    "{view:?}, {lanes} lanes"
                );
            }
        }
    }
}
