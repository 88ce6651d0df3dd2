// SPDX-License-Identifier: MPL-2.0
//! The figures a Report carries, and their encoding: what `gpushm list/top/inspect` read.

use super::*;

/// What a producer says about its stream and each of its clients in a Report: the figures of
/// [`crate::server::Server::stats`], plus the stream's caps, ring and rates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamReport {
    /// The producer's process id (as its own PID namespace sees it).
    pub pid: u32,
    /// Nanoseconds since the producer started serving the socket.
    pub uptime_ns: u64,
    /// CPU time (user + system) the producer's whole process has spent, in ns.
    pub cpu_ns: u64,
    /// Frames published (`frames-sent` of gpushmsink's stats).
    pub frames_sent: u64,
    pub frames_copied: u64,
    pub frames_dropped: u64,
    pub times_lagged: u64,
    /// Frames published per second over the last second or so.
    pub fps: f64,
    /// The stream's caps (cut to [`REPORT_MAX_CAPS`] bytes); empty before the first caps.
    pub caps: String,
    /// The current ring: slots, bytes a slot, bytes in all, in GPU memory; zero before the
    /// first ring.
    pub slot_count: u32,
    pub slot_size: u64,
    pub ring_size: u64,
    pub device_ring: bool,
    pub eos: bool,
    pub max_clients: u32,
    pub clients: Vec<ClientReport>,
    /// Clients left out because the report was full.
    pub clients_left_out: u32,
}

/// One client of a [`StreamReport`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientReport {
    pub id: u32,
    pub pid: i32,
    pub uid: u32,
    /// The name it gave in Hello (cut to [`REPORT_MAX_NAME`] bytes).
    pub name: String,
    /// Its delivery mode: "leaky", "lossless" or "auto".
    pub mode: String,
    pub lossless: bool,
    pub lagging: bool,
    pub closed: bool,
    /// Frames handed to it.
    pub sent: u64,
    /// Frames it took.
    pub taken: u64,
    /// Frames it did not get (taken back because it fell behind, or skipped).
    pub dropped: u64,
    /// Of `dropped`, those never handed over because it held its whole budget.
    pub skipped: u64,
    pub copied: u64,
    pub times_lagged: u64,
    /// Slots it references now.
    pub held: u32,
    /// Nanoseconds since it connected.
    pub connected_ns: u64,
    /// Its latency histogram, publish to take (see [`crate::ring::layout::latency_bucket`]):
    /// [`crate::ring::layout::LATENCY_BUCKETS`] counts.
    pub latency: Vec<u32>,
}

impl ClientReport {
    pub fn latency_p50_ns(&self) -> Option<u64> {
        crate::ring::layout::latency_percentile(&self.latency, 50.0)
    }
    pub fn latency_p99_ns(&self) -> Option<u64> {
        crate::ring::layout::latency_percentile(&self.latency, 99.0)
    }
}

/// Cuts `s` to at most `max` bytes at a character boundary, marking the cut with "...".
pub fn cut_str(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

impl StreamReport {
    /// The Report payload. Clients that do not fit in [`MAX_PAYLOAD`] are left out (and
    /// counted); a latency histogram goes as its nonzero buckets (index u8, count u32).
    pub(super) fn encode(&self, p: &mut Vec<u8>) {
        p.extend_from_slice(&self.pid.to_le_bytes());
        for v in [
            self.uptime_ns,
            self.cpu_ns,
            self.frames_sent,
            self.frames_copied,
            self.frames_dropped,
            self.times_lagged,
            self.fps.to_bits(),
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        put_str(p, &cut_str(&self.caps, REPORT_MAX_CAPS));
        p.extend_from_slice(&self.slot_count.to_le_bytes());
        p.extend_from_slice(&self.slot_size.to_le_bytes());
        p.extend_from_slice(&self.ring_size.to_le_bytes());
        let flags = self.device_ring as u32 | (self.eos as u32) << 1;
        p.extend_from_slice(&flags.to_le_bytes());
        p.extend_from_slice(&self.max_clients.to_le_bytes());
        let mut encoded = Vec::new();
        let mut left_out = self.clients_left_out;
        let mut n = 0u32;
        for c in &self.clients {
            let mut e = Vec::new();
            c.encode(&mut e);
            // Room kept for the counts that follow.
            if p.len() + 8 + encoded.len() + e.len() > MAX_PAYLOAD as usize {
                left_out += 1;
                continue;
            }
            encoded.extend_from_slice(&e);
            n += 1;
        }
        p.extend_from_slice(&left_out.to_le_bytes());
        p.extend_from_slice(&n.to_le_bytes());
        p.extend_from_slice(&encoded);
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self> {
        let pid = r.u32()?;
        let mut v = [0u64; 7];
        for x in &mut v {
            *x = r.u64()?;
        }
        let caps = r.str()?;
        let slot_count = r.u32()?;
        let slot_size = r.u64()?;
        let ring_size = r.u64()?;
        let flags = r.u32()?;
        let max_clients = r.u32()?;
        let clients_left_out = r.u32()?;
        let n = r.u32()?;
        // Each client takes well over 64 bytes: a count beyond what the payload holds is a lie.
        if n as usize > MAX_PAYLOAD as usize / 64 {
            return Err(Error::protocol(format!("a report of {n} clients")));
        }
        let clients = (0..n)
            .map(|_| ClientReport::decode(r))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            pid,
            uptime_ns: v[0],
            cpu_ns: v[1],
            frames_sent: v[2],
            frames_copied: v[3],
            frames_dropped: v[4],
            times_lagged: v[5],
            fps: f64::from_bits(v[6]),
            caps,
            slot_count,
            slot_size,
            ring_size,
            device_ring: flags & 1 != 0,
            eos: flags & 2 != 0,
            max_clients,
            clients,
            clients_left_out,
        })
    }
}

impl ClientReport {
    pub(super) fn encode(&self, p: &mut Vec<u8>) {
        p.extend_from_slice(&self.id.to_le_bytes());
        p.extend_from_slice(&self.pid.to_le_bytes());
        p.extend_from_slice(&self.uid.to_le_bytes());
        put_str(p, &cut_str(&self.name, REPORT_MAX_NAME));
        put_str(p, &self.mode);
        let flags = self.lossless as u32 | (self.lagging as u32) << 1 | (self.closed as u32) << 2;
        p.extend_from_slice(&flags.to_le_bytes());
        for v in [
            self.sent,
            self.taken,
            self.dropped,
            self.skipped,
            self.copied,
            self.times_lagged,
            self.connected_ns,
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&self.held.to_le_bytes());
        let buckets: Vec<(usize, u32)> = self
            .latency
            .iter()
            .take(crate::ring::layout::LATENCY_BUCKETS)
            .copied()
            .enumerate()
            .filter(|&(_, c)| c != 0)
            .collect();
        p.extend_from_slice(&(buckets.len() as u32).to_le_bytes());
        for (i, c) in buckets {
            p.push(i as u8);
            p.extend_from_slice(&c.to_le_bytes());
        }
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self> {
        let id = r.u32()?;
        let pid = r.u32()? as i32;
        let uid = r.u32()?;
        let name = r.str()?;
        let mode = r.str()?;
        let flags = r.u32()?;
        let mut v = [0u64; 7];
        for x in &mut v {
            *x = r.u64()?;
        }
        let held = r.u32()?;
        let n = r.u32()? as usize;
        if n > crate::ring::layout::LATENCY_BUCKETS {
            return Err(Error::protocol(format!(
                "a latency histogram of {n} buckets"
            )));
        }
        let mut latency = vec![0u32; crate::ring::layout::LATENCY_BUCKETS];
        for _ in 0..n {
            let i = r.take(1)?[0] as usize;
            let c = r.u32()?;
            *latency
                .get_mut(i)
                .ok_or_else(|| Error::protocol(format!("latency bucket {i}")))? = c;
        }
        Ok(Self {
            id,
            pid,
            uid,
            name,
            mode,
            lossless: flags & 1 != 0,
            lagging: flags & 2 != 0,
            closed: flags & 4 != 0,
            sent: v[0],
            taken: v[1],
            dropped: v[2],
            skipped: v[3],
            copied: v[4],
            times_lagged: v[5],
            connected_ns: v[6],
            held,
            latency,
        })
    }
}
