//! The scheduler's input: one message whose bytes arrive in order.

use crate::error::Error;

/// One message whose bytes arrive in order, a chunk at a time.
///
/// The scheduler calls [`next_chunk`](ChunkSource::next_chunk) to make the first chunk
/// current, reads [`chunk`](ChunkSource::chunk) (possibly over several steps),
/// then calls `next_chunk` again, until it returns `Ok(false)`. A source may
/// reuse or release a chunk's memory once `next_chunk` is called again.
pub trait ChunkSource: Send {
    /// Total bytes of the message: the scheduling order and progress.
    fn total_bytes(&self) -> u64;
    /// The current chunk (empty before the first `next_chunk`).
    fn chunk(&self) -> &[u8];
    /// Done with the current chunk: makes the next one current. `Ok(false)`
    /// when the message has no more bytes; an error stops the whole run.
    fn next_chunk(&mut self) -> Result<bool, Error>;
}

/// A message already in memory, as consecutive slices.
pub struct Slices<'a> {
    chunks: &'a [&'a [u8]],
    next: usize,
    current: &'a [u8],
    total: u64,
}

impl<'a> Slices<'a> {
    pub fn new(chunks: &'a [&'a [u8]]) -> Slices<'a> {
        Slices {
            chunks,
            next: 0,
            current: &[],
            total: chunks.iter().map(|c| c.len() as u64).sum(),
        }
    }
}

impl ChunkSource for Slices<'_> {
    fn total_bytes(&self) -> u64 {
        self.total
    }

    fn chunk(&self) -> &[u8] {
        self.current
    }

    fn next_chunk(&mut self) -> Result<bool, Error> {
        match self.chunks.get(self.next) {
            Some(c) => {
                self.current = c;
                self.next += 1;
                Ok(true)
            }
            None => {
                self.current = &[];
                Ok(false)
            }
        }
    }
}
