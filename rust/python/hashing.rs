//! Hashing many Python objects: acquisition (which needs the GIL) overlapped
//! with hashing (which does not).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::acquire::{acquire, Held, Names, Source};
use crate::scheduler::{BatchQueue, Batches, Scheduler};
use crate::sha256::Digest;

/// Above this many bytes, the GIL is released while hashing (as hashlib does
/// above 2 KiB): other Python threads run while we compute.
const RELEASE_GIL_BYTES: usize = 2048;

/// Hashes every held input: contiguous ones together through the scheduler,
/// strided ones gathered in bounded pieces, all with the GIL released.
fn digest_held(py: Python<'_>, held: &[Held<'_>]) -> Vec<Digest> {
    digest_held_refs(py, &held.iter().collect::<Vec<_>>())
}

fn digest_held_refs(py: Python<'_>, held: &[&Held<'_>]) -> Vec<Digest> {
    let sources: Vec<Source<'_>> = held.iter().map(|h| h.source()).collect();
    let total: usize = sources.iter().map(Source::len).sum();
    let work = move || {
        let scheduler = Scheduler::default();
        let slices: Vec<&[u8]> = sources
            .iter()
            .map(|s| match s {
                Source::Slice(b) => *b,
                Source::Strided(_) => &[][..],
            })
            .collect();
        let mut digests = scheduler.hash_many(&slices);
        use rayon::prelude::*;
        let strided: Vec<(usize, Digest)> = sources
            .par_iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Source::Strided(v) => Some((i, v.digest(scheduler.kernel))),
                Source::Slice(_) => None,
            })
            .collect();
        for (i, d) in strided {
            digests[i] = d;
        }
        digests
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
const STREAM_MIN_ITEMS: usize = 512;
/// Inputs larger than this are not streamed: they wait for the final
/// all-threads pass, which schedules them largest first.
const STREAM_MAX_ITEM_BYTES: usize = 1 << 20;

/// Digests of many Python objects.
pub(super) fn digest_objects<'py>(
    py: Python<'py>,
    objs: Vec<Bound<'py, PyAny>>,
    names: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Digest>> {
    check_names(names, objs.len())?;
    Ok(digest_stream(py, objs.into_iter(), Names(names))?.0)
}

/// Digests of the objects an iterator yields, and the bytes hashed.
///
/// Reading each tensor's address takes a C call into torch, a tenth of the
/// cost of hashing a 4 KiB tensor. With many inputs, batches of small ones
/// are therefore hashed by `threads - 1` pool helpers ([`Batches`]) while
/// this thread, holding the GIL, goes on acquiring the next ones, then hashes
/// what is left alongside them (so no more threads than the budget run);
/// large and strided inputs are hashed at the end by all threads. The result
/// does not depend on the path taken.
pub(super) fn digest_stream<'py>(
    py: Python<'py>,
    objs: impl Iterator<Item = Bound<'py, PyAny>>,
    names: Names<'_, 'py>,
) -> PyResult<(Vec<Digest>, u64)> {
    let mut objs = objs.enumerate();
    // Declared before the scope so that it outlives every spawned batch, even
    // when an acquisition fails part-way (the scope joins its tasks first).
    let mut held: Vec<Held<'_>> = Vec::new();
    for (i, obj) in objs.by_ref() {
        held.push(acquire(&obj, names, i)?);
        if held.len() == STREAM_MIN_ITEMS {
            break;
        }
    }
    if held.len() < STREAM_MIN_ITEMS {
        let total = held.iter().map(|h| h.source().len() as u64).sum();
        return Ok((digest_held(py, &held), total));
    }
    let queue = BatchQueue::new();
    rayon::in_place_scope(|scope| -> PyResult<()> {
        let mut batches = Batches::new(scope, Scheduler::default(), &queue);
        let mut stream = |i: usize, h: &Held<'_>| {
            if let Source::Slice(s) = h.source() {
                if s.len() <= STREAM_MAX_ITEM_BYTES {
                    // SAFETY: the bytes belong to the Python object `h` keeps
                    // alive (not to `h` itself, which may move); `h` is in
                    // `held`, which outlives this scope and so every task
                    // reading the slice.
                    let s: &[u8] = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) };
                    batches.push(i, s);
                }
            }
        };
        for (i, h) in held.iter().enumerate() {
            stream(i, h);
        }
        for (i, obj) in objs {
            let h = acquire(&obj, names, i)?;
            stream(i, &h);
            held.push(h);
        }
        py.detach(|| batches.finish());
        Ok(())
    })?;
    let total = held.iter().map(|h| h.source().len() as u64).sum();
    let mut digests: Vec<Option<Digest>> = vec![None; held.len()];
    for (i, d) in queue.into_digests() {
        digests[i] = Some(d);
    }
    // What was not streamed (large or strided) goes through the full scheduler.
    let rest: Vec<usize> = (0..held.len()).filter(|&i| digests[i].is_none()).collect();
    if !rest.is_empty() {
        let rest_held: Vec<&Held<'_>> = rest.iter().map(|&i| &held[i]).collect();
        for (i, d) in rest.iter().zip(digest_held_refs(py, &rest_held)) {
            digests[*i] = Some(d);
        }
    }
    Ok((
        digests.into_iter().map(|d| d.expect("every input digested")).collect(),
        total,
    ))
}
