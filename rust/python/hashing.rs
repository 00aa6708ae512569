//! Hashing many Python objects: acquisition (which needs the GIL) overlapped
//! with hashing (which does not).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::acquire::{acquire, Held, Names, Source};
use crate::scheduler::{BatchQueue, Batches, RunSummary, Scheduler};
use crate::sha256::Digest;

/// Above this many bytes, the GIL is released while hashing (as hashlib does
/// above 2 KiB): other Python threads run while we compute.
const RELEASE_GIL_BYTES: usize = 2048;

/// Hashes every held input: contiguous ones together through the scheduler,
/// strided ones gathered in bounded pieces, all with the GIL released.
/// Returns the digests, in input order, and how the two parts ran.
fn digest_held(py: Python<'_>, held: &[Held<'_>]) -> (Vec<Digest>, RunSummary) {
    digest_held_refs(py, &held.iter().collect::<Vec<_>>())
}

fn digest_held_refs(py: Python<'_>, held: &[&Held<'_>]) -> (Vec<Digest>, RunSummary) {
    let sources: Vec<Source<'_>> = held.iter().map(|h| h.source()).collect();
    let total: usize = sources.iter().map(Source::len).sum();
    // With the GIL released other Python threads run while the bytes are
    // read: what keeps them unchanged until hashed is the caller's contract
    // (the model is not updated during a checksum; see `Held::source`).
    let work = move || {
        let scheduler = Scheduler::default();
        let slices: Vec<&[u8]> = sources
            .iter()
            .filter_map(|s| match s {
                Source::Slice(b) => Some(*b),
                Source::Strided(_) => None,
            })
            .collect();
        let (contiguous, streamed) = scheduler.hash_many_shaped(&slices);
        let views: Vec<_> = sources
            .iter()
            .filter_map(|s| match s {
                Source::Strided(v) => Some(*v),
                Source::Slice(_) => None,
            })
            .collect();
        let strided = scheduler.hash_strided(&views);
        let summary = RunSummary {
            batched: None,
            streamed,
            gathered: (!strided.is_empty()).then_some((scheduler.kernel, strided.len())),
        };
        let (mut contiguous, mut strided) = (contiguous.into_iter(), strided.into_iter());
        let digests = sources
            .iter()
            .map(|s| match s {
                Source::Slice(_) => contiguous.next(),
                Source::Strided(_) => strided.next(),
            })
            .map(|d| d.expect("one digest per input"))
            .collect();
        (digests, summary)
    };
    if total > RELEASE_GIL_BYTES {
        py.detach(work)
    } else {
        work()
    }
}

fn check_names(names: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<()> {
    if let Some(names) = names {
        let len = names.len()?;
        if len != n {
            return Err(PyValueError::new_err(format!("{len} names for {n} buffers")));
        }
    }
    Ok(())
}

/// Below this many inputs, acquire everything first, then hash.
const OVERLAP_MIN_ITEMS: usize = 128;
/// Inputs larger than this are not hashed as they are acquired: they wait for the final
/// all-threads pass, which schedules them largest first.
const OVERLAP_MAX_ITEM_BYTES: usize = 1 << 20;

/// Digests of many Python objects, and how they were hashed.
pub(super) fn digest_objects<'py>(
    py: Python<'py>,
    objs: Vec<Bound<'py, PyAny>>,
    names: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Vec<Digest>, RunSummary)> {
    check_names(names, objs.len())?;
    let mut digests: Vec<Option<Digest>> = vec![None; objs.len()];
    let (_, summary) = digest_as_acquired(py, objs.into_iter(), Names(names), &mut |i, d| {
        digests[i] = Some(d);
        Ok(())
    })?;
    let digests = digests.into_iter().map(|d| d.expect("every input digested")).collect();
    Ok((digests, summary))
}

/// Hashes the objects an iterator yields, handing each `(index, digest)` to
/// `sink` (with the GIL held, in no particular order, each index once), and
/// returns the bytes hashed and how the hashing ran (batches of small
/// inputs, a streamed run of the rest, strided inputs gathered).
///
/// Reading each tensor's address takes a C call into torch, a fifth of the
/// cost of hashing a 4 KiB tensor. With many inputs, batches of small ones
/// are therefore hashed by `threads - 1` pool helpers ([`Batches`]) while
/// this thread, holding the GIL, goes on acquiring the next ones; then it
/// hashes what is left alongside them, a batch at a time. Between batches it
/// hands finished digests to `sink`, so the caller's own per-digest work
/// (building Python strings) overlaps the hashing instead of following it.
/// Large and strided inputs are hashed at the end by all threads. The
/// digests do not depend on the path taken.
pub(super) fn digest_as_acquired<'py>(
    py: Python<'py>,
    objs: impl Iterator<Item = Bound<'py, PyAny>>,
    names: Names<'_, 'py>,
    sink: &mut dyn FnMut(usize, Digest) -> PyResult<()>,
) -> PyResult<(u64, RunSummary)> {
    let mut objs = objs.enumerate();
    let mut held: Vec<Held<'_>> = Vec::new();
    for (i, obj) in objs.by_ref() {
        held.push(acquire(&obj, names, i)?);
        if held.len() == OVERLAP_MIN_ITEMS {
            break;
        }
    }
    let mut total: u64 = held.iter().map(|h| h.source().len() as u64).sum();
    if held.len() < OVERLAP_MIN_ITEMS {
        let (digests, summary) = digest_held(py, &held);
        for (i, d) in digests.into_iter().enumerate() {
            sink(i, d)?;
        }
        return Ok((total, summary));
    }
    // Each input's hold on its Python object, until its digest is out.
    // Declared before the scope so that it outlives every spawned batch, even
    // when an acquisition fails part-way (the scope joins its tasks first).
    let mut held: Vec<Option<Held<'_>>> = held.into_iter().map(Some).collect();
    let queue = BatchQueue::new();
    // Digests out, releasing what they were read from (as the walk goes on:
    // not all at the end, on one thread).
    let mut drain = |held: &mut [Option<Held<'_>>]| -> PyResult<()> {
        for (i, d) in queue.take_done() {
            held[i] = None;
            sink(i, d)?;
        }
        Ok(())
    };
    rayon::in_place_scope(|scope| -> PyResult<()> {
        let mut batches = Batches::new(scope, Scheduler::default(), &queue);
        let mut queue_small = |i: usize, h: &Held<'_>| -> bool {
            if let Source::Slice(s) = h.source() {
                if s.len() <= OVERLAP_MAX_ITEM_BYTES {
                    // SAFETY: the bytes belong to the Python object `h` keeps
                    // alive (not to `h` itself, which may move). `h` goes into
                    // `held`, which outlives this scope, and leaves it only
                    // when `drain` has the digest of these bytes: after every
                    // read of the slice. Nobody writes them while the helpers
                    // read them (with the GIL released, other Python threads
                    // run): the caller's contract, as for `Held::source`, is
                    // that the model is not updated during a checksum.
                    let s: &[u8] = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) };
                    return batches.push(i, s);
                }
            }
            false
        };
        for (i, h) in held.iter().flatten().enumerate() {
            queue_small(i, h);
        }
        for (i, obj) in objs {
            let h = acquire(&obj, names, i)?;
            total += h.source().len() as u64;
            let queued = queue_small(i, &h);
            held.push(Some(h));
            if queued {
                drain(&mut held)?;
            }
        }
        let one_thread = batches.close();
        loop {
            drain(&mut held)?;
            if !py.detach(|| queue.work_one(one_thread)) {
                return Ok(());
            }
        }
    })?;
    // The helpers' last batches.
    drain(&mut held)?;
    let mut summary = RunSummary {
        batched: Some(queue.tally()),
        ..RunSummary::default()
    };
    // What was not hashed as acquired (large or strided) goes through the full scheduler.
    let (indices, rest): (Vec<usize>, Vec<&Held<'_>>) = held
        .iter()
        .enumerate()
        .filter_map(|(i, h)| Some((i, h.as_ref()?)))
        .unzip();
    if !rest.is_empty() {
        let (digests, rest_ran) = digest_held_refs(py, &rest);
        (summary.streamed, summary.gathered) = (rest_ran.streamed, rest_ran.gathered);
        for (i, d) in indices.into_iter().zip(digests) {
            sink(i, d)?;
        }
    }
    Ok((total, summary))
}
