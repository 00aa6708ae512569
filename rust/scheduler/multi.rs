//! Digests fed over many calls: a tensor hashed one staged chunk at a time.

use super::worker::{Marks, Task};
use super::{ChunkSource, Scheduler, Slices};
use crate::error::Error;
use crate::sha256::{Digest, Sha256};

/// Several digests open at once, each fed its bytes in order over many
/// calls, from many buffers in parallel. This is how a tensor larger than a
/// staging slot is hashed one slot-sized chunk at a time.
pub struct MultiHasher {
    scheduler: Scheduler,
    states: Vec<Sha256>,
    /// Per digest, where to record its chain state ([`MultiHasher::mark`]).
    marks: Vec<Marks>,
}

impl MultiHasher {
    pub(super) fn new(scheduler: Scheduler, n: usize) -> MultiHasher {
        MultiHasher {
            scheduler,
            states: vec![Sha256::new(); n],
            marks: (0..n).map(|_| Marks::default()).collect(),
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
        let marks = (0..states.len()).map(|_| Marks::default()).collect();
        MultiHasher {
            scheduler,
            states,
            marks,
        }
    }

    /// Records digest `index`'s chain state ([`Sha256::export`]) when its
    /// message reaches each length of `at` (increasing, none below the
    /// bytes fed so far; one equal to them is recorded now), replacing any
    /// marks not reached yet. The states are read with [`MultiHasher::marked`].
    pub fn mark(&mut self, index: usize, at: &[u64]) -> Result<(), String> {
        let len = self.states.len();
        let (Some(state), Some(marks)) = (self.states.get(index), self.marks.get_mut(index)) else {
            return Err(format!("no digest #{index} (of {len})"));
        };
        if let Some(w) = at.windows(2).find(|w| w[1] <= w[0]) {
            return Err(format!("marks must increase: {} then {}", w[0], w[1]));
        }
        if let Some(&first) = at.first().filter(|&&first| first < state.len()) {
            return Err(format!("mark {first} is behind the {} bytes already fed", state.len()));
        }
        marks.at.truncate(marks.next);
        marks.at.extend_from_slice(at);
        marks.record(state);
        Ok(())
    }

    /// The chain states recorded so far for digest `index`, in mark order.
    pub fn marked(&self, index: usize) -> Option<&[Vec<u8>]> {
        self.marks.get(index).map(|m| m.states.as_slice())
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
                                            // Each digest's chunks, cut where a mark falls inside one: a lane
                                            // passes a mark between two chunks, where its state is recorded.
        let mut chunks: Vec<&[u8]> = Vec::with_capacity(order.len());
        let mut spans: Vec<(usize, usize, usize)> = Vec::new(); // (index, start, end) in chunks
        let mut at = 0u64; // the current digest's length once the chunks so far are hashed
        let mut cursor = 0usize; // the current digest's first mark not behind `at`
        for &i in &order {
            let (index, bytes) = feeds[i];
            let marks = &self.marks[index];
            if spans.last().is_none_or(|s| s.0 != index) {
                spans.push((index, chunks.len(), chunks.len()));
                at = self.states[index].len();
                cursor = marks.next;
            }
            let end = at + bytes.len() as u64;
            let mut rest = bytes;
            // Each mark is passed once over all of a digest's feeds (not rescanned per feed).
            while let Some(&mark) = marks.at.get(cursor) {
                if mark <= at {
                    cursor += 1;
                    continue;
                }
                let cut = mark - at;
                if cut >= rest.len() as u64 {
                    break;
                }
                let (head, tail) = rest.split_at(cut as usize);
                chunks.push(head);
                at = mark;
                rest = tail;
                cursor += 1;
            }
            chunks.push(rest);
            at = end;
            spans.last_mut().unwrap().2 = chunks.len();
        }
        let mut tasks = Vec::new();
        let mut states = self.states.iter_mut().zip(self.marks.iter_mut()).enumerate();
        for &(index, start, end) in &spans {
            let (state, marks) = states.find(|(i, _)| *i == index).unwrap().1;
            let source = Slices::new(&chunks[start..end]);
            let marked = marks.next < marks.at.len();
            tasks.push(Task {
                bytes: source.total_bytes(),
                state,
                source,
                digest_out: None,
                marks: marked.then_some(marks),
            });
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

#[cfg(test)]
mod mark_tests {
    use super::*;
    use sha2::Digest as _;

    fn message(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32)
            .map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8)
            .collect()
    }

    /// The state recorded at each mark is the chain after exactly that many
    /// bytes: finished, it is sha2's digest of the prefix; continued over
    /// the next block, it is the next mark's state. Marks fall anywhere
    /// (mid-feed, on a feed's end, off the 64-byte grid), feeds of several
    /// digests interleave, messages run over several updates, on every lane
    /// count and the wide kernel.
    #[test]
    fn marked_states_are_the_chain_at_each_mark() {
        let sizes = [0usize, 1, 63, 64, 65, 1000, 100_003, 3 << 20];
        let data: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| message(n, i as u32)).collect();
        for lanes in [1, 2, 4, 16] {
            let scheduler = Scheduler {
                lanes,
                threads: 2,
                ..Scheduler::default()
            };
            let mut multi = scheduler.multi(data.len());
            let mut marks: Vec<Vec<u64>> = Vec::new();
            for (i, d) in data.iter().enumerate() {
                let block = (d.len() / 7).max(1) as u64 + (i as u64 % 3);
                let mut at: Vec<u64> = (0..=d.len() as u64).step_by(block as usize).collect();
                if at.last() != Some(&(d.len() as u64)) {
                    at.push(d.len() as u64);
                }
                multi.mark(i, &at).unwrap();
                marks.push(at);
            }
            // Two updates, each feeding every message in three uneven pieces.
            let half: Vec<usize> = data.iter().map(|d| d.len() * 2 / 5).collect();
            for (lo, hi) in [(0usize, 0usize), (1, 1)] {
                let mut feeds: Vec<(usize, &[u8])> = Vec::new();
                for (i, d) in data.iter().enumerate() {
                    let (start, end) = if lo == 0 { (0, half[i]) } else { (half[i], d.len()) };
                    let third = start + (end - start) / 3 + hi;
                    let third = third.min(end);
                    feeds.push((i, &d[start..third]));
                    feeds.push((i, &d[third..end]));
                }
                let mid = feeds.len() / 2;
                feeds.rotate_left(mid); // digests out of index order; each one's pieces in order
                multi.update(&feeds).unwrap();
            }
            for (i, d) in data.iter().enumerate() {
                let states = multi.marked(i).unwrap();
                assert_eq!(states.len(), marks[i].len(), "message {i}, {lanes} lanes");
                for (at, state) in marks[i].iter().zip(states) {
                    let s = Sha256::import(state).unwrap();
                    assert_eq!(s.len(), *at);
                    let digest = s.finalize_with(scheduler.kernel);
                    assert_eq!(
                        digest.bytes[..],
                        sha2::Sha256::digest(&d[..*at as usize])[..],
                        "message {i} at {at}, {lanes} lanes"
                    );
                }
            }
        }
    }

    /// Marks out of order, or behind the bytes fed, are refused; a mark at
    /// the bytes fed is recorded at once.
    #[test]
    fn bad_marks_are_refused() {
        let mut multi = Scheduler::default().multi(1);
        assert!(multi.mark(0, &[5, 5]).unwrap_err().contains("increase"));
        assert!(multi.mark(1, &[5]).unwrap_err().contains("no digest #1"));
        multi.update(&[(0, &[1u8; 10][..])]).unwrap();
        assert!(multi.mark(0, &[9]).unwrap_err().contains("behind"));
        multi.mark(0, &[10, 20]).unwrap();
        assert_eq!(multi.marked(0).unwrap().len(), 1);
        multi.update(&[(0, &[2u8; 10][..])]).unwrap();
        assert_eq!(multi.marked(0).unwrap().len(), 2);
    }
}
