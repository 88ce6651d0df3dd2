// SPDX-License-Identifier: MPL-2.0
//! The shared-memory ring and the per-client queues, both ends of them. Nothing here knows
//! about sockets, clients or policy: the server ([`crate::server`]) and the subscriber
//! ([`crate::subscriber`]) drive these ends.
//!
//! - [`layout`]: where frames and control words live in shared memory (the only file that
//!   knows offsets).
//! - [`shm`]: memfds, seals, read-only descriptors, mappings, doorbells.
//! - [`frame`]: what both ends say about one frame (its metadata, the queue entry).
//! - [`producer_end`]: creates the ring and each client's control block, publishes frames,
//!   hands them to a client and takes them back, checking everything the client wrote.
//! - [`consumer_end`]: maps the ring read-only, takes frames from the delivery queue and
//!   gives them back, checking everything the producer wrote.

pub mod consumer_end;
pub mod frame;
pub mod layout;
pub mod producer_end;
pub mod shm;

#[cfg(test)]
mod tests;
