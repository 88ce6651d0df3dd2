// SPDX-License-Identifier: MPL-2.0
//! Who may hold what, and who gives way when clients hold the ring: the one place that decides
//! each client's share of the ring and which client is cut.
//!
//! **What a client may hold.** Every open client's budget (frames it may reference at once) is
//! the producer's budget, but never more than its share of the ring: the ring's slots over the
//! open clients, [`CROWDED_BUDGET`] at least ([`budget`]). A leaky client at its budget loses
//! the frame (its oldest untaken ones go first); a lossless one is waited for, up to max-wait.
//! Consumers that follow their budget (gpushmsrc, Python, C) copy what their downstream keeps
//! past it, so they keep within their share whatever the others do.
//!
//! **Who is cut.** A client is cut (marked revoked in its control block, told why, its slots
//! taken back) in three situations, each decided by a pure function over what the clients
//! hold:
//!
//! - **The producer waits for a slot and every slot is held by a crowded ring's clients**
//!   ([`Pressure::Waiting`]): as many open clients as the ring's slots less one, or more, so
//!   that clients that each keep one frame (each within its share) would stop the stream for
//!   everybody. A closed client still holding frames goes first, else the one most over its
//!   share, else the clients holding the oldest frame (a consumer that keeps up holds the
//!   newest ones).
//! - **The producer has waited [`STARVATION_TIMEOUT`] for a slot, every slot held**
//!   ([`Pressure::Starved`], timed by [`Starvation`]): a closed client holding frames first,
//!   else the one holding most if that is more than its fair share (the ring's slots over the
//!   open clients, one at least). The wait is the producer's, not the clients': clients that
//!   take turns giving one frame back and taking the next (a relay) keep the producer waiting
//!   as surely as one that never gives back. A client within its share is never cut: slots
//!   held by clients that all keep within theirs come back as they release them.
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

/// A client's budget with `open` open clients on a ring of `slots`: the producer's `budget`,
/// but no more than the client's share of the ring, [`CROWDED_BUDGET`] at least (one kept
/// zero-copy, one in flight).
pub(super) fn budget(budget: usize, slots: usize, open: usize) -> usize {
    budget.min((slots / open.max(1)).max(CROWDED_BUDGET))
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

/// How long the producer has been waiting for a free slot (a pool with none free): the clock
/// of [`Pressure::Starved`]. It runs from the first thread that starts waiting until the last
/// one got its slot, whatever the clients release meanwhile that the producer does not get.
#[derive(Debug, Default)]
pub(super) struct Starvation {
    waiters: usize,
    since: Option<Instant>,
}

impl Starvation {
    /// A thread starts (`true`) or stops waiting for a slot, at `now`.
    pub fn producer_waits(&mut self, start: bool, now: Instant) {
        if start {
            self.waiters += 1;
            self.since.get_or_insert(now);
        } else {
            self.waiters = self.waiters.saturating_sub(1);
            if self.waiters == 0 {
                self.since = None;
            }
        }
    }

    /// When the wait reaches [`STARVATION_TIMEOUT`] (the connection thread looks then), if the
    /// producer waits.
    pub fn deadline(&self) -> Option<Instant> {
        self.since.map(|t| t + STARVATION_TIMEOUT)
    }

    /// Looks at `now`, with `all_held` (every slot of the current ring referenced). True once
    /// the producer has waited [`STARVATION_TIMEOUT`] with every slot held; its clock then
    /// starts again, so that it waits that long again before the next cut.
    pub fn starved(&mut self, all_held: bool, now: Instant) -> bool {
        match self.since {
            Some(t) if all_held && now.saturating_duration_since(t) >= STARVATION_TIMEOUT => {
                self.since = Some(now);
                true
            }
            _ => false,
        }
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
                "a relay: three clients keep 3, 3 and 2 of 8, giving one back now and then; the \
                 consumer that keeps up holds none: one of the relay is cut",
                8,
                vec![
                    open(1, 3, 3, Some(20)),
                    open(2, 3, 3, Some(21)),
                    open(3, 2, 2, Some(22)),
                    open(4, 0, 0, None),
                ],
                Starved,
                vec![2],
            ),
            (
                "the relay after one was cut: two keep 3 of 8 each, over their share of 2",
                8,
                vec![
                    open(1, 3, 3, Some(20)),
                    open(3, 3, 3, Some(22)),
                    open(4, 1, 1, Some(30)),
                ],
                Starved,
                vec![3],
            ),
            (
                "honest consumers at their budget of 2 and one holding its last frame",
                8,
                vec![
                    open(1, 2, 2, Some(20)),
                    open(2, 2, 2, Some(21)),
                    open(3, 2, 2, Some(22)),
                    open(4, 1, 2, Some(23)),
                ],
                Starved,
                vec![],
            ),
            (
                "eight one-slot hoarders and the consumer that keeps up, crowded: the holder \
                 of the oldest frame goes at once",
                8,
                (1..=8)
                    .map(|id| open(id, 1, 1, Some(10 + id as u64)))
                    .chain([open(9, 0, 0, None)])
                    .collect(),
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

    /// The producer's wait is the clock: releases it does not get (a relay of clients giving
    /// one frame back and taking the next) do not reset it; the wait ending does.
    #[test]
    fn starvation_is_the_producers_wait_for_a_slot() {
        let t0 = Instant::now();
        let mut s = Starvation::default();
        assert!(
            !s.starved(true, t0 + 3 * STARVATION_TIMEOUT),
            "nobody waits"
        );
        s.producer_waits(true, t0);
        assert_eq!(s.deadline(), Some(t0 + STARVATION_TIMEOUT));
        assert!(!s.starved(true, t0 + STARVATION_TIMEOUT / 2));
        assert!(
            !s.starved(false, t0 + STARVATION_TIMEOUT),
            "a slot is free: the wait ends in a moment"
        );
        assert!(s.starved(true, t0 + STARVATION_TIMEOUT));
        // The clock starts again.
        assert!(!s.starved(true, t0 + STARVATION_TIMEOUT));
        assert!(s.starved(true, t0 + 2 * STARVATION_TIMEOUT));
        // A second waiter, then the first gets its slot: still waiting.
        s.producer_waits(true, t0 + 2 * STARVATION_TIMEOUT);
        s.producer_waits(false, t0 + 2 * STARVATION_TIMEOUT);
        assert!(s.starved(true, t0 + 3 * STARVATION_TIMEOUT));
        // The last one gets its slot: the clock stops.
        s.producer_waits(false, t0 + 3 * STARVATION_TIMEOUT);
        assert_eq!(s.deadline(), None);
        assert!(!s.starved(true, t0 + 9 * STARVATION_TIMEOUT));
    }

    /// Budgets follow the share of the ring: the producer's when few clients share it, down to
    /// the crowded budget.
    #[test]
    fn a_budget_is_never_more_than_the_share_of_the_ring() {
        // (producer's budget, slots, open clients, budget)
        for (b, slots, open, want) in [
            (4, 8, 1, 4),
            (4, 8, 2, 4),
            (4, 8, 3, 2),
            (4, 8, 4, 2),
            (4, 8, 9, CROWDED_BUDGET),
            (6, 16, 2, 6),
            (6, 16, 4, 4),
            (1, 8, 4, 1),
            (4, 8, 0, 4),
        ] {
            assert_eq!(budget(b, slots, open), want, "{b} {slots} {open}");
        }
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
