//! The run model for mixed splits: how long a run of these sizes takes with
//! some workers on narrow lanes and the others on the wide kernel, by a
//! small simulation of the workers' own rules with this CPU's calibrated
//! rates.
//!
//! Why mixed: on a Llama-shaped set (two 131 MB embeddings among 48 layer
//! tensors of 8-46 MB) the soonest end (an LP over the calibrated rates,
//! `benches/schedule_bound.py`) has one core hash the two embeddings on
//! narrow lanes while the other runs the layer tensors sixteen at a time.
//! With every core on one kernel, the embeddings either crawl in wide lanes
//! (a sixteenth of a core each) or keep the other lanes waiting on narrow
//! lanes.
//! Once the embeddings have ended, their core joins the wide kernel.

use super::worker::{largest_runs_alone, narrow_run};

/// One core's GB/s in all: the narrow kernel with 1, 2 and 4 lanes busy,
/// and the wide kernel with 16.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rates {
    pub(super) one: f64,
    pub(super) two: f64,
    pub(super) four: f64,
    pub(super) wide: f64,
}

/// Which workers run which kernel: the first `narrow` hold up to
/// `narrow_lanes` messages each on narrow lanes, the rest sixteen on the wide
/// kernel. Mixed (some of each): the narrow workers are dealt the largest
/// messages first and the wide ones take the next in order; a narrow
/// worker whose dealt messages have all ended runs as a wide one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Split {
    pub(super) narrow: usize,
    pub(super) narrow_lanes: usize,
}

/// How much sooner (a fraction) the run model must say a mixed split ends
/// than the uniform one for a run to use it: the model is a model.
const MIXED_GAIN: f64 = 0.03;

/// Runs of more messages than this are not modelled (see
/// [`best_mixed`]): many messages keep every core's lanes full
/// whichever kernel it runs, and the model would cost more than it wins.
const MODEL_MAX_MESSAGES: usize = 4096;

/// The simulation's step per lane: coarse enough that a run of any size is
/// a few thousand steps (plus one a message), fine enough for the lane
/// choices to matter.
const MIN_STEP: u64 = 1 << 20;
const EVENTS: u64 = 4096;

/// Simulated seconds until the last of `workers` ends, hashing `sizes`
/// (largest first) with `split`. Where every worker runs one kernel, the
/// largest `lanes x workers` are dealt (as the scheduler deals them) when
/// `deal`. A wide worker runs the wide kernel while at least `min_open`
/// messages are open, and a narrow worker of a mixed split turns wide once
/// its dealt messages have ended, as the workers do.
pub(super) fn simulate(sizes: &[u64], rates: Rates, workers: usize, split: Split, deal: bool, min_open: usize) -> f64 {
    let workers = workers.max(1);
    let total: u64 = sizes.iter().sum();
    let step = (total / EVENTS).max(MIN_STEP);
    let narrow = split.narrow.min(workers);
    let mixed = narrow > 0 && narrow < workers;
    // Which workers still run as narrow ones (a mixed split's turn wide).
    let mut narrow_now: Vec<bool> = (0..workers).map(|w| w < narrow).collect();
    let lanes_of = |narrow_now: bool| if narrow_now { split.narrow_lanes } else { 16 };
    let (deal_to, rounds) = if mixed {
        (narrow, split.narrow_lanes)
    } else if deal {
        (workers, lanes_of(narrow_now[0]))
    } else {
        (0, 0)
    };
    let dealt = (deal_to * rounds).min(sizes.len());
    let mut dealt_to: Vec<Vec<usize>> = vec![Vec::new(); workers];
    for r in 0..rounds {
        for s in 0..deal_to {
            let seat = if r % 2 == 0 { s } else { deal_to - 1 - s };
            let i = r * deal_to + s;
            if i < dealt {
                dealt_to[seat].push(i);
            }
        }
    }
    for d in &mut dealt_to {
        d.reverse(); // popped from the back, in dealing order
    }
    let mut taken = vec![false; sizes.len()];
    let mut cursor = dealt;
    // Per worker: (bytes left, dealt) of each message it holds.
    let mut held: Vec<Vec<(u64, bool)>> = vec![Vec::new(); workers];
    let mut clock = vec![0.0f64; workers];
    let mut ended = vec![false; workers];
    let over_one_stream = rates.wide / rates.one;
    while let Some(w) = (0..workers)
        .filter(|&w| !ended[w])
        .min_by(|&a, &b| clock[a].total_cmp(&clock[b]))
    {
        while held[w].len() < lanes_of(narrow_now[w]) {
            let mut next = None;
            while let Some(i) = dealt_to[w].pop() {
                if !taken[i] {
                    next = Some(i);
                    break;
                }
            }
            while next.is_none() && cursor < sizes.len() {
                cursor += 1;
                next = (!taken[cursor - 1]).then_some(cursor - 1);
            }
            let Some(i) = next.or_else(|| (0..dealt).find(|&i| !taken[i])) else {
                break;
            };
            taken[i] = true;
            if sizes[i] > 0 {
                held[w].push((sizes[i], i < dealt));
            }
        }
        let h = &mut held[w];
        if h.is_empty() {
            ended[w] = true;
            continue;
        }
        h.sort_unstable_by_key(|&(left, _)| std::cmp::Reverse(left));
        let n = h.len();
        let (run, lane_rate) = if !narrow_now[w] && n >= min_open {
            if largest_runs_alone(h[0].0, h.get(1).map_or(0, |x| x.0), over_one_stream) {
                (1, rates.one)
            } else {
                (n, rates.wide / 16.0)
            }
        } else {
            match narrow_run(n) {
                1 => (1, rates.one),
                2 => (2, rates.two / 2.0),
                _ => (4, rates.four / 4.0),
            }
        };
        let advance = h[..run].iter().map(|x| x.0).min().unwrap_or(0).min(step);
        clock[w] += advance as f64 / 1e9 / lane_rate;
        for left in &mut h[..run] {
            left.0 -= advance;
        }
        h.retain(|&left| left.0 > 0);
        // As a narrow worker does: wide once none of its dealt messages is left.
        if mixed && narrow_now[w] && dealt_to[w].is_empty() && h.iter().all(|&(_, dealt)| !dealt) {
            narrow_now[w] = false;
        }
    }
    clock.into_iter().fold(0.0, f64::max)
}

/// A mixed split where the model says it ends at least [`MIXED_GAIN`]
/// sooner than `uniform` (the split the closed-form estimates chose, dealt
/// where `deal`): some workers on narrow lanes (1, 2 or 4 each) for the
/// largest messages, then wide, the rest on the wide kernel, each wide worker's share past the break-even count
/// `min_open`. Only for runs of at most [`MODEL_MAX_MESSAGES`] on more than
/// one worker.
pub(super) fn best_mixed(
    sizes: &[u64],
    rates: Rates,
    workers: usize,
    uniform: Split,
    deal: bool,
    min_open: usize,
) -> Option<Split> {
    if workers < 2 || sizes.len() > MODEL_MAX_MESSAGES {
        return None;
    }
    let now = simulate(sizes, rates, workers, uniform, deal, min_open);
    // Narrow counts 1, 2, 4, ... below `workers`, and as many as there are
    // messages that one stream alone takes longer to hash than the whole
    // run would last at the wide rate (each wants a core to itself: two
    // embeddings on 8 cores), each with 1, 2 or 4 lanes: a few simulations
    // (each ~20-400 us: 2-112 workers, 50-4096 messages) on any host.
    let ideal = sizes.iter().sum::<u64>() as f64 / (workers as f64 * rates.wide);
    let big = sizes.iter().take_while(|&&s| s as f64 / rates.one >= ideal).count();
    let counts = std::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n < workers)
        .chain((big < workers && !big.is_power_of_two()).then_some(big));
    let (best, split) = counts
        .flat_map(|narrow| [1, 2, 4].map(|narrow_lanes| Split { narrow, narrow_lanes }))
        .filter(|s| sizes.len().saturating_sub(s.narrow * s.narrow_lanes) >= (workers - s.narrow) * min_open)
        .map(|split| (simulate(sizes, rates, workers, split, true, min_open), split))
        .min_by(|a, b| a.0.total_cmp(&b.0))?;
    (best < now * (1.0 - MIXED_GAIN)).then_some(split)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn llama() -> Vec<u64> {
        let mut s = vec![131_072_000u64; 2];
        for _ in 0..8 {
            s.extend([46_137_344, 23_068_672, 12_582_912, 8_388_608, 4096, 4096]);
        }
        s.push(4096);
        s.sort_unstable_by(|a, b| b.cmp(a));
        s
    }

    /// The rates of a 2-vCPU AMD EPYC (Zen 5) and an Intel Xeon (Emerald
    /// Rapids) of this machine kind, measured there (GB/s a core).
    const AMD: Rates = Rates {
        one: 2.07,
        two: 3.10,
        four: 3.69,
        wide: 5.10,
    };
    const INTEL: Rates = Rates {
        one: 1.4,
        two: 1.8,
        four: 1.9,
        wide: 3.0,
    };

    const WIDE: Split = Split {
        narrow: 0,
        narrow_lanes: 4,
    };
    const MIXED: Split = Split {
        narrow: 1,
        narrow_lanes: 4,
    };

    /// The model runs before every modelled run, so it must stay cheap on
    /// the largest hosts: measured 20-400 us a simulation (2-112 workers,
    /// 51-4096 messages, 2-vCPU AMD EPYC); 25x that fails.
    #[test]
    fn a_simulation_stays_cheap_on_large_hosts() {
        for (workers, n) in [(2, 51), (16, 1024), (112, 4096)] {
            let sizes: Vec<u64> = (0..n as u64).map(|i| (i % 7 + 1) * 3 * MIB).collect();
            let start = std::time::Instant::now();
            let t = simulate(&sizes, AMD, workers, MIXED, true, 12);
            let took = start.elapsed();
            assert!(
                t > 0.0 && took < std::time::Duration::from_millis(10),
                "{workers} workers, {n} messages: {took:?}"
            );
        }
    }

    /// Where the model chooses a mixed split, with both vendors' rates: the
    /// Llama-shaped set, not equal tensors, not a 70B layer (9 tensors), not
    /// a run too small for the wide worker's lanes, not 10,000 messages.
    #[test]
    fn mixed_splits_only_where_they_win() {
        let layer_70b = [
            vec![448 * MIB; 3],
            vec![128 * MIB; 2],
            vec![16 * MIB; 2],
            vec![16384; 2],
        ]
        .concat();
        for (cpu, rates) in [("amd", AMD), ("intel", INTEL)] {
            let min_open = (16.0 * rates.four / rates.wide).ceil() as usize;
            let narrow = Split {
                narrow: 2,
                narrow_lanes: 4,
            };
            let chosen = best_mixed(&llama(), rates, 2, WIDE, true, min_open);
            assert_eq!(chosen.map(|s| s.narrow), Some(1), "{cpu}: llama, from all wide");
            assert!(
                best_mixed(&llama(), rates, 2, narrow, false, min_open).is_some(),
                "{cpu}: llama, from narrow lanes"
            );
            assert_eq!(
                best_mixed(&vec![16 * MIB; 64], rates, 2, WIDE, false, min_open),
                None,
                "{cpu}: 64 x 16 MiB"
            );
            assert_eq!(
                best_mixed(&layer_70b, rates, 2, narrow, true, min_open),
                None,
                "{cpu}: 70B layer"
            );
            assert_eq!(
                best_mixed(&[MIB; 5], rates, 2, narrow, true, min_open),
                None,
                "{cpu}: 5 x 1 MiB"
            );
            assert_eq!(
                best_mixed(&vec![4096; 10_000], rates, 2, WIDE, false, min_open),
                None,
                "{cpu}: 10,000"
            );
            assert_eq!(
                best_mixed(&llama(), rates, 1, WIDE, false, min_open),
                None,
                "{cpu}: one worker"
            );
        }
    }

    /// Llama-3-8B's tensors (hidden 4096, intermediate 14336, kv 1024,
    /// vocab 128256, 32 layers, bf16): 16 GB, two 1.05 GB embeddings
    /// among 8 KiB-112 MiB layer tensors, largest first.
    fn llama_8b() -> Vec<u64> {
        // q, o; k, v; gate, up, down; two norms.
        let layer = [
            32 * MIB,
            32 * MIB,
            8 * MIB,
            8 * MIB,
            112 * MIB,
            112 * MIB,
            112 * MIB,
            8192,
            8192,
        ];
        let mut s = vec![128_256 * 4096 * 2; 2];
        s.extend(layer.iter().cycle().take(32 * layer.len()));
        s.sort_unstable_by(|a, b| b.cmp(a));
        s
    }

    /// The run model's end of `sizes` with the best mixed split for
    /// `workers`, against the simple bound `max(bytes / (workers x wide),
    /// largest / one stream)`: (split, seconds, fraction of the bound).
    fn best_split_against_the_bound(sizes: &[u64], rates: Rates, workers: usize) -> (Option<Split>, f64, f64) {
        let min_open = (16.0 * rates.four / rates.wide).ceil() as usize;
        let Some(split) = best_mixed(sizes, rates, workers, WIDE, true, min_open) else {
            return (None, f64::NAN, 0.0);
        };
        let t = simulate(sizes, rates, workers, split, true, min_open);
        let total: u64 = sizes.iter().sum();
        let bound = (total as f64 / 1e9 / (workers as f64 * rates.wide)).max(sizes[0] as f64 / 1e9 / rates.one);
        (Some(split), t, bound / t)
    }

    /// The narrow core hashes the two embeddings on narrow lanes, then joins
    /// the wide kernel: within 0.9 of the simple bound on both vendors' rates.
    /// Left narrow for the rest of the run, the best split reaches 0.86
    /// (AMD) and 0.87 (Intel, where all wide is the best without it).
    #[test]
    fn the_narrow_core_joins_the_wide_kernel_once_its_embeddings_end() {
        for (cpu, rates) in [("amd", AMD), ("intel", INTEL)] {
            let (split, t, of_bound) = best_split_against_the_bound(&llama_8b(), rates, 2);
            assert!(of_bound >= 0.9, "{cpu}: {split:?} {t} s, {of_bound:.3} of the bound");
        }
    }

    /// On 8 cores each embedding of Llama-3-8B takes longer on one stream
    /// (0.51 s on AMD) than the whole run would at the wide rate (0.39 s):
    /// two workers hash one each on a single narrow lane, then turn wide,
    /// and the run ends with the embeddings. With 2 or 4 lanes a worker,
    /// the best split ends at 0.85 (AMD) and 0.76 (Intel) of that bound.
    #[test]
    fn on_many_cores_each_embedding_gets_a_core_to_itself() {
        let one_lane_each = Split {
            narrow: 2,
            narrow_lanes: 1,
        };
        for (cpu, rates) in [("amd", AMD), ("intel", INTEL)] {
            let (split, t, of_bound) = best_split_against_the_bound(&llama_8b(), rates, 8);
            assert_eq!(split, Some(one_lane_each), "{cpu}");
            assert!(of_bound >= 0.92, "{cpu}: {t} s, {of_bound:.3} of the bound");
        }
    }

    #[test]
    fn one_message_streams_at_one_lanes_rate() {
        let t = simulate(&[2_070_000_000], AMD, 2, WIDE, true, 12);
        assert!((t - 1.0).abs() < 1e-9, "{t}");
    }

    #[test]
    fn every_byte_is_counted_once() {
        // 64 equal messages on the wide kernel: all 16 lanes of both cores busy
        // until the end, so exactly bytes / (2 x wide).
        let sizes = vec![16 * MIB; 64];
        let t = simulate(&sizes, AMD, 2, WIDE, true, 12);
        let want = (64 * 16 * MIB) as f64 / 1e9 / (2.0 * AMD.wide);
        assert!((t - want).abs() < 1e-9 * want.max(1.0), "{t} vs {want}");
    }

    #[test]
    fn mixed_beats_one_kernel_for_all_on_a_llama_shaped_set() {
        let sizes = llama();
        for (cpu, rates) in [("amd", AMD), ("intel", INTEL)] {
            let min_open = (16.0 * rates.four / rates.wide).ceil() as usize;
            let wide = simulate(&sizes, rates, 2, WIDE, true, min_open);
            let t = simulate(&sizes, rates, 2, MIXED, true, min_open);
            assert!(t < 0.95 * wide, "{cpu}: mixed {t} vs wide {wide}");
        }
    }

    #[test]
    fn mixed_does_not_win_where_one_kernel_suits_every_tensor() {
        // Equal tensors: all wide is the sooner, or a mixed split's narrow
        // core holds them back.
        let sizes = vec![16 * MIB; 64];
        let wide = simulate(&sizes, AMD, 2, WIDE, true, 12);
        assert!(simulate(&sizes, AMD, 2, MIXED, true, 12) > wide);
    }
}
