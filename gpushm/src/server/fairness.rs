// SPDX-License-Identifier: MPL-2.0
//! Who gives way when clients hold the ring: the one place that decides which client is cut.
//!
//! A client is cut (marked revoked in its control block, told why, its slots taken back) in
//! three situations, each decided here by a pure function over what the clients hold:
//!
//! - **The producer waits for a slot and every slot is held by a crowded ring's clients**
//!   ([`Pressure::Waiting`]): as many open clients as the ring's slots less one, or more, so
//!   that clients that each keep one frame (each within its share) would stop the stream for
//!   everybody. A closed client still holding frames goes first, else the one most over its
//!   share, else the clients holding the oldest frame (a consumer that keeps up holds the
//!   newest ones).
//! - **Every slot has been held for [`STARVATION_TIMEOUT`] with none given back**
//!   ([`Pressure::Starved`]): a closed client holding frames first, else the one holding most
//!   if that is more than its fair share (the ring's slots over the open clients, one at
//!   least). A client within its share is never cut: slots held by clients that all keep
//!   within theirs come back as they release them.
//! - **A new consumer comes at max-clients**: the client stalled longest (frames waiting,
//!   none taken for at least [`STALLED_EVICT`]) makes room ([`stalled_longest`]).

use std::time::Instant;

use crate::policy::{CROWDED_BUDGET, STALLED_EVICT, STARVATION_TIMEOUT};

/// What the choice reads of one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holding {
    pub id: u32,
    /// It sent Close: it takes no more frames, so it has no share.
    pub closed: bool,
    /// What counts against its share: the frames it took and keeps (an open client), or
    /// everything it references (a closed one). See [`super::client::Client::share_count`].
    pub kept: usize,
    /// Every frame it references, taken or not.
    pub refs: usize,
    /// The oldest frame (its seq) of the current ring it references.
    pub oldest: Option<u64>,
}

/// Why the ring has to give a slot back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pressure {
    /// The producer waits for a slot now and every slot of the current ring is held.
    Waiting,
    /// Every slot of the current ring has been held for [`STARVATION_TIMEOUT`], none given
    /// back.
    Starved,
}

/// A client to cut, and the reason it is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Cut {
    pub id: u32,
    pub why: String,
}

/// Too many open clients for each to keep frames of its own: as many as the ring's slots
/// less one, or more (two at least: one client holding a small ring whole is waited for, as
/// its budget says). While crowded, every client's budget is [`CROWDED_BUDGET`].
pub(super) fn crowded(open: usize, slots: usize) -> bool {
    open >= 2 && open + 1 >= slots
}

/// The clients to cut so that the producer can go on, with every slot of a ring of `slots`
/// held by `clients` under `pressure`. Empty: nobody is over their share, wait.
pub(super) fn choose(slots: usize, clients: &[Holding], pressure: Pressure) -> Vec<Cut> {
    let open = clients.iter().filter(|c| !c.closed).count();
    // The most over its share by `count`: a closed client (share 0) first, then the most.
    let over = |count: fn(&Holding) -> usize, share: usize| {
        clients
            .iter()
            .map(|c| (c.id, count(c), if c.closed { 0 } else { share }))
            .filter(|&(_, n, share)| n > share)
            .max_by_key(|&(_, n, share)| (share == 0, n))
    };
    match pressure {
        Pressure::Waiting => {
            if !crowded(open, slots) {
                return Vec::new();
            }
            // While crowded, a client that follows its budget may hold CROWDED_BUDGET frames
            // a moment (one kept zero-copy, the next taken before it is copied), even when
            // that is more than the ring's slots over the clients: only more is over.
            let share = (slots / open.max(1)).max(CROWDED_BUDGET);
            if let Some((id, n, share)) = over(|c| c.kept, share) {
                return vec![Cut {
                    id,
                    why: format!(
                        "{open} consumers share a ring of {slots} slots, all held; this one held {n}, more than its share of {share}: cut so that the producer can go on (frames it still holds may be overwritten)"
                    ),
                }];
            }
            let Some(oldest) = clients.iter().filter_map(|c| c.oldest).min() else {
                return Vec::new();
            };
            clients
                .iter()
                .filter(|c| c.oldest == Some(oldest))
                .map(|c| Cut {
                    id: c.id,
                    why: format!(
                        "{open} consumers share a ring of {slots} slots, all held, and this one held the oldest frame: cut so that the producer can go on (frames it still holds may be overwritten)"
                    ),
                })
                .collect()
        }
        Pressure::Starved => {
            let share = (slots / open.max(1)).max(1);
            // What a client took and keeps counts first; past the timeout, frames handed
            // over and never taken count too (a client that keeps up would have taken them).
            let Some((id, n, share)) = over(|c| c.kept, share).or_else(|| over(|c| c.refs, share))
            else {
                return Vec::new();
            };
            vec![Cut {
                id,
                why: format!(
                    "clients held every slot of the ring for {STARVATION_TIMEOUT:?}; this one held {n}, more than its share of {share}: cut so that the producer can go on (frames it still holds may be overwritten)"
                ),
            }]
        }
    }
}

/// How long every slot has been held with none given back.
#[derive(Debug, Default)]
pub(super) struct Starvation {
    since: Option<Instant>,
}

impl Starvation {
    /// A client gave a slot back: whoever holds the others now is slow, not hoarding.
    pub fn slot_came_back(&mut self) {
        self.since = None;
    }

    /// Looks at the ring at `now` (`all_held`: every slot referenced). True once it has been
    /// held whole for [`STARVATION_TIMEOUT`]; the clock then starts again.
    pub fn starved(&mut self, all_held: bool, now: Instant) -> bool {
        if !all_held {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) < STARVATION_TIMEOUT {
            return false;
        }
        self.since = None;
        true
    }
}

/// Of `stalled` (each client's id and since when it has had frames waiting and taken none),
/// the one stalled longest, if for [`STALLED_EVICT`] at least, and since when: at
/// max-clients, it makes room for a new consumer. One that keeps up is never pushed out.
pub(super) fn stalled_longest(
    stalled: impl Iterator<Item = (u32, Option<Instant>)>,
    now: Instant,
) -> Option<(u32, Instant)> {
    stalled
        .filter_map(|(id, t)| t.map(|t| (id, t)))
        .filter(|&(_, t)| now.saturating_duration_since(t) >= STALLED_EVICT)
        .min_by_key(|&(_, t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn open(id: u32, kept: usize, refs: usize, oldest: Option<u64>) -> Holding {
        Holding {
            id,
            closed: false,
            kept,
            refs,
            oldest,
        }
    }

    fn closed(id: u32, refs: usize, oldest: Option<u64>) -> Holding {
        Holding {
            id,
            closed: true,
            kept: refs,
            refs,
            oldest,
        }
    }

    fn ids(cuts: Vec<Cut>) -> Vec<u32> {
        cuts.into_iter().map(|c| c.id).collect()
    }

    /// One case of [`choose`]: what happens, the ring's slots, the clients, the pressure and
    /// who is cut.
    type Case = (&'static str, usize, Vec<Holding>, Pressure, Vec<u32>);

    /// Who is cut, case by case.
    #[test]
    fn who_gives_way_when_clients_hold_the_ring() {
        use Pressure::*;
        let cases: Vec<Case> = vec![
            (
                "one hoarder keeps 6 of 8, an honest consumer holds its last two frames",
                8,
                vec![open(1, 6, 6, Some(10)), open(2, 2, 2, Some(15))],
                Starved,
                vec![1],
            ),
            (
                "honest consumers each within their share: nobody is cut, they release",
                8,
                vec![
                    open(1, 2, 2, Some(10)),
                    open(2, 2, 2, Some(11)),
                    open(3, 2, 2, Some(12)),
                    open(4, 2, 2, Some(13)),
                ],
                Starved,
                vec![],
            ),
            (
                "a closed client still holding frames goes before one over its share",
                8,
                vec![closed(1, 2, Some(3)), open(2, 6, 6, Some(10))],
                Starved,
                vec![1],
            ),
            (
                "frames handed over and never taken count once nothing kept is over",
                4,
                vec![open(1, 0, 3, Some(5)), open(2, 1, 1, Some(8))],
                Starved,
                vec![1],
            ),
            (
                "a single consumer holding the whole ring is within its share",
                4,
                vec![open(1, 4, 4, Some(1))],
                Starved,
                vec![],
            ),
            (
                "crowded, every client at one frame: the holder of the oldest is cut",
                4,
                vec![
                    open(1, 1, 1, Some(7)),
                    open(2, 1, 1, Some(5)),
                    open(3, 1, 1, Some(6)),
                    open(4, 1, 1, Some(8)),
                ],
                Waiting,
                vec![2],
            ),
            (
                "crowded, two clients share the oldest frame: both are cut",
                3,
                vec![
                    open(1, 1, 2, Some(5)),
                    open(2, 1, 1, Some(5)),
                    open(3, 0, 1, Some(6)),
                ],
                Waiting,
                vec![1, 2],
            ),
            (
                "crowded, one over the crowded budget goes first",
                4,
                vec![
                    open(1, 3, 3, Some(9)),
                    open(2, 1, 1, Some(5)),
                    open(3, 0, 0, None),
                ],
                Waiting,
                vec![1],
            ),
            (
                "not crowded: the producer waits as the budgets say",
                8,
                vec![open(1, 4, 4, Some(1)), open(2, 4, 4, Some(2))],
                Waiting,
                vec![],
            ),
        ];
        for (what, slots, clients, pressure, want) in cases {
            assert_eq!(ids(choose(slots, &clients, pressure)), want, "{what}");
        }
    }

    #[test]
    fn the_reason_names_the_counts() {
        let cuts = choose(
            8,
            &[open(1, 6, 6, Some(1)), open(2, 1, 1, Some(7))],
            Pressure::Starved,
        );
        assert!(
            cuts[0].why.contains("held 6, more than its share of 4"),
            "{}",
            cuts[0].why
        );
    }

    #[test]
    fn starvation_counts_from_the_first_look_at_a_full_ring() {
        let t0 = Instant::now();
        let mut s = Starvation::default();
        assert!(!s.starved(true, t0));
        assert!(!s.starved(true, t0 + STARVATION_TIMEOUT / 2));
        assert!(s.starved(true, t0 + STARVATION_TIMEOUT));
        // The clock starts again.
        assert!(!s.starved(true, t0 + STARVATION_TIMEOUT));
        // A slot coming back, or a free slot, resets it.
        s.slot_came_back();
        assert!(!s.starved(true, t0 + 3 * STARVATION_TIMEOUT));
        assert!(!s.starved(false, t0 + 4 * STARVATION_TIMEOUT));
        assert!(!s.starved(true, t0 + 4 * STARVATION_TIMEOUT + Duration::from_millis(1)));
    }

    #[test]
    fn only_a_client_stalled_long_enough_makes_room() {
        let now = Instant::now() + 10 * STALLED_EVICT;
        let long = now - 3 * STALLED_EVICT;
        let longer = now - 5 * STALLED_EVICT;
        let short = now - STALLED_EVICT / 2;
        let list = [
            (1, Some(long)),
            (2, None),
            (3, Some(longer)),
            (4, Some(short)),
        ];
        assert_eq!(
            stalled_longest(list.into_iter(), now),
            Some((3, longer)),
            "the longest stalled"
        );
        assert_eq!(
            stalled_longest([(2, None), (4, Some(short))].into_iter(), now),
            None,
            "none stalled for long enough"
        );
    }
}
