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
