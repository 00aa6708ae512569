//! What a run used, in words: the shape of one scheduler run, the tally of
//! a [`super::BatchQueue`], and both together for one call of an entry
//! point (the Python binding's `_core.last_run()`).
//!
//! All are `Copy` and allocate nothing until they are formatted: a run
//! records its shape whatever its size, and the batch path counts per batch,
//! never per message.

use std::cell::Cell;
use std::fmt;

use super::assignment::Assignment;
use crate::sha256::{Kernel, Wide, WIDE_LANES};

/// The assignment one run of the scheduler had: how many worker threads,
/// and which of them ran the narrow kernel on how many lanes each, the
/// others the 16-lane wide kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunShape {
    /// The narrow kernel.
    pub kernel: Kernel,
    /// Messages in the run.
    pub messages: usize,
    pub workers: usize,
    /// Workers on the narrow kernel (the first ones); the others run the
    /// wide kernel (narrow lanes still take the messages that end a run,
    /// and in a mixed split a narrow worker turns wide once the largest
    /// messages dealt to it have ended).
    pub narrow_workers: usize,
    /// Messages each narrow worker holds open (1-4: narrow lanes).
    pub narrow_lanes: usize,
}

impl RunShape {
    pub(super) fn of(kernel: Kernel, assignment: &Assignment, messages: usize) -> RunShape {
        let (narrow_workers, narrow_lanes) = match (assignment.wide, assignment.narrow) {
            (None, _) => (assignment.workers, assignment.lanes),
            (Some(_), (n, lanes)) => (n, lanes),
        };
        RunShape {
            kernel,
            messages,
            workers: assignment.workers,
            narrow_workers,
            narrow_lanes,
        }
    }

    /// Whether some worker was assigned the wide kernel.
    pub fn wide(&self) -> bool {
        self.narrow_workers < self.workers
    }
}

/// `"4 narrow lanes (sha-ni)"`.
fn narrow(f: &mut fmt::Formatter<'_>, lanes: usize, kernel: Kernel) -> fmt::Result {
    write!(f, "{lanes} narrow lane{} ({kernel})", plural(lanes))
}

/// `"the 16-lane wide kernel (avx512)"`.
fn wide(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    write!(f, "the {WIDE_LANES}-lane wide kernel ({})", Wide::NAME)
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl fmt::Display for RunShape {
    /// `"1 thread on 4 narrow lanes (sha-ni)"`, `"2 threads on the 16-lane
    /// wide kernel (avx512)"`, or a mixed split: `"2 threads: 1 on 4 narrow
    /// lanes (sha-ni), 1 on the 16-lane wide kernel (avx512)"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (w, n) = (self.workers, self.narrow_workers);
        if n == w {
            write!(f, "{w} thread{} on ", plural(w))?;
            narrow(f, self.narrow_lanes, self.kernel)
        } else if n == 0 {
            write!(f, "{w} thread{} on ", plural(w))?;
            wide(f)
        } else {
            write!(f, "{w} threads: {n} on ")?;
            narrow(f, self.narrow_lanes, self.kernel)?;
            write!(f, ", {} on ", w - n)?;
            wide(f)
        }
    }
}

/// What a [`super::BatchQueue`] hashed: small messages in batches, one
/// thread a batch, on `threads` threads at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchTally {
    /// The narrow kernel (`None`: no batch was hashed).
    pub kernel: Option<Kernel>,
    /// Threads hashing batches (the producer and its helpers).
    pub threads: usize,
    /// Messages hashed through the 16-lane wide kernel.
    pub wide: usize,
    /// Messages hashed on narrow lanes, and the most lanes a batch used.
    pub narrow: usize,
    pub narrow_lanes: usize,
}

impl BatchTally {
    pub fn messages(&self) -> usize {
        self.wide + self.narrow
    }
}

impl fmt::Display for BatchTally {
    /// `"2 threads in batches on 4 narrow lanes (sha-ni)"`, `"... in
    /// batches on the 16-lane wide kernel (avx512)"`, or both: `"2 threads
    /// in batches, 9984 on the 16-lane wide kernel (avx512) and 16 on 4
    /// narrow lanes (sha-ni)"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let threads = self.threads.max(1);
        let kernel = self.kernel.unwrap_or(Kernel::Portable);
        write!(f, "{threads} thread{} in batches", plural(threads))?;
        match (self.wide, self.narrow) {
            (_, 0) => {
                f.write_str(" on ")?;
                wide(f)
            }
            (0, _) => {
                f.write_str(" on ")?;
                narrow(f, self.narrow_lanes, kernel)
            }
            (w, n) => {
                write!(f, ", {w} on ")?;
                wide(f)?;
                write!(f, " and {n} on ")?;
                narrow(f, self.narrow_lanes, kernel)
            }
        }
    }
}

/// Everything one call hashed: small messages in batches, a streamed run of
/// the rest, and strided views (read by row or gathered), each part where
/// it ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub batched: Option<BatchTally>,
    pub streamed: Option<RunShape>,
    /// Strided views, read by row or gathered, hashed through the lanes: (kernel, count).
    pub gathered: Option<(Kernel, usize)>,
}

impl RunSummary {
    /// Messages hashed, all parts together.
    pub fn messages(&self) -> usize {
        self.batched.map_or(0, |b| b.messages())
            + self.streamed.map_or(0, |s| s.messages)
            + self.gathered.map_or(0, |g| g.1)
    }
}

impl fmt::Display for RunSummary {
    /// One line. A single part: `"1 thread on 4 narrow lanes (sha-ni); 15
    /// tensors"`. Several, each with its count: `"9984 small by 2 threads
    /// in batches on 4 narrow lanes (sha-ni); 16 large by 2 threads: 1 on 4
    /// narrow lanes (sha-ni), 1 on the 16-lane wide kernel (avx512); 3
    /// strided, read by row or gathered, through the lanes (sha-ni); 10003 tensors"`.
    /// Nothing hashed: `"no tensors"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let batched = self.batched.filter(|b| b.messages() > 0);
        let streamed = self.streamed.filter(|s| s.messages > 0);
        let gathered = self.gathered.filter(|g| g.1 > 0);
        let parts = usize::from(batched.is_some()) + usize::from(streamed.is_some()) + usize::from(gathered.is_some());
        if parts == 0 {
            return f.write_str("no tensors");
        }
        let labelled = parts > 1;
        let mut sep = "";
        if let Some(b) = batched {
            if labelled {
                write!(f, "{} small by ", b.messages())?;
            }
            write!(f, "{b}")?;
            sep = "; ";
        }
        if let Some(s) = streamed {
            f.write_str(sep)?;
            if labelled {
                let what = if batched.is_some() { "large" } else { "contiguous" };
                write!(f, "{} {what} by ", s.messages)?;
            }
            write!(f, "{s}")?;
            sep = "; ";
        }
        if let Some((kernel, count)) = gathered {
            f.write_str(sep)?;
            if labelled {
                write!(f, "{count} strided")?;
            } else {
                f.write_str("strided")?;
            }
            write!(f, ", read by row or gathered, through the lanes ({kernel})")?;
        }
        let n = self.messages();
        write!(f, "; {n} tensor{}", plural(n))
    }
}

thread_local! {
    /// The shape of the latest run started on this thread (see [`last_run`]).
    static LAST_RUN: Cell<Option<RunShape>> = const { Cell::new(None) };
}

/// Records the shape of a run that the calling thread started (`None`: an
/// empty run).
pub(super) fn record(shape: Option<RunShape>) {
    LAST_RUN.with(|last| last.set(shape));
}

/// The shape of the latest run started on this thread by
/// [`super::Scheduler::hash_many`], [`super::Scheduler::hash_sources`] or
/// [`super::MultiHasher::update`] (`None` before any, or when the latest had
/// no messages). Batches hashed through [`super::Batches`] are not runs of
/// their own: their [`super::BatchQueue::tally`] says how they ran.
pub fn last_run() -> Option<RunShape> {
    LAST_RUN.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(workers: usize, narrow_workers: usize, narrow_lanes: usize, messages: usize) -> RunShape {
        RunShape {
            kernel: Kernel::Portable,
            messages,
            workers,
            narrow_workers,
            narrow_lanes,
        }
    }

    #[test]
    fn shapes_in_words() {
        assert_eq!(shape(1, 1, 4, 15).to_string(), "1 thread on 4 narrow lanes (portable)");
        assert_eq!(shape(2, 2, 1, 2).to_string(), "2 threads on 1 narrow lane (portable)");
        assert_eq!(
            shape(2, 0, 0, 64).to_string(),
            "2 threads on the 16-lane wide kernel (avx512)"
        );
        assert_eq!(
            shape(2, 1, 4, 51).to_string(),
            "2 threads: 1 on 4 narrow lanes (portable), 1 on the 16-lane wide kernel (avx512)"
        );
    }

    #[test]
    fn summaries_in_words() {
        let one = RunSummary {
            streamed: Some(shape(1, 1, 4, 15)),
            ..RunSummary::default()
        };
        assert_eq!(one.to_string(), "1 thread on 4 narrow lanes (portable); 15 tensors");
        let mixed = RunSummary {
            streamed: Some(shape(2, 1, 4, 51)),
            ..RunSummary::default()
        };
        assert_eq!(
            mixed.to_string(),
            "2 threads: 1 on 4 narrow lanes (portable), 1 on the 16-lane wide kernel (avx512); 51 tensors"
        );
        assert_eq!(RunSummary::default().to_string(), "no tensors");
        let batches = BatchTally {
            kernel: Some(Kernel::Portable),
            threads: 2,
            wide: 9984,
            narrow: 16,
            narrow_lanes: 4,
        };
        let all = RunSummary {
            batched: Some(batches),
            streamed: Some(shape(2, 2, 2, 3)),
            gathered: Some((Kernel::Portable, 1)),
        };
        assert_eq!(
            all.to_string(),
            "10000 small by 2 threads in batches, 9984 on the 16-lane wide kernel (avx512) and 16 on 4 narrow \
             lanes (portable); 3 large by 2 threads on 2 narrow lanes (portable); 1 strided, read by row or \
             gathered, through the lanes (portable); 10004 tensors"
        );
        let only_batches = RunSummary {
            batched: Some(BatchTally {
                wide: 0,
                narrow: 200,
                ..batches
            }),
            ..RunSummary::default()
        };
        assert_eq!(
            only_batches.to_string(),
            "2 threads in batches on 4 narrow lanes (portable); 200 tensors"
        );
        let gathered = RunSummary {
            gathered: Some((Kernel::Portable, 1)),
            ..RunSummary::default()
        };
        assert_eq!(
            gathered.to_string(),
            "strided, read by row or gathered, through the lanes (portable); 1 tensor"
        );
    }
}
