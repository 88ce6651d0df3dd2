// SPDX-License-Identifier: MPL-2.0
//! What goes over the unix socket between gpushmsink and each gpushmsrc.
//!
//! Every message is a 16-byte header followed by `len` payload bytes, all little-endian:
//!
//! ```text
//! offset size field
//! 0      4    magic    "GSHW"
//! 4      2    version  PROTOCOL_VERSION
//! 6      2    kind     MsgKind
//! 8      4    len      payload bytes, at most MAX_PAYLOAD
//! 12     4    nfds     file descriptors sent with this message (SCM_RIGHTS), at most MAX_FDS
//! ```
//!
//! Payloads (`str` = u32 length + UTF-8 bytes):
//!
//! | kind | direction | payload | fds |
//! |------|-----------|---------|-----|
//! | 1 Hello   | src → sink | flags u32 (bit 0: lossless, bit 1: writable ring, bit 2: auto delivery, bit 3: can map GPU memory), pid u32, name str | – |
//! | 2 Welcome | sink → src | client_id u32, queue_capacity u32 | client memfd, frame-ready doorbell, slot-released doorbell (each one end of a unix stream socketpair, see [`crate::ring::shm::Doorbell`]) |
//! | 3 Ring    | sink → src | ring_gen u32, flags u32 (bit 0: writable, bit 1: device ring), slot_count u32, slot_size u64, total_size u64 | ring memfd: read-only, sealed against writes, unless the client asked for writable and the producer allows it |
//! | 4 Caps    | sink → src | caps_gen u32, caps str | – |
//! | 5 Eos     | sink → src | – | – |
//! | 6 Error   | either     | message str | – |
//! | 7 Close   | src → sink | – | – |
//! | 8 DeviceMemory | sink → src | ring_gen u32, gpu_uuid 16 bytes, size u64 | the GPU allocation holding the pixels of ring `ring_gen` (a CUDA virtual-memory POSIX descriptor, see [`crate::cuda::vmm`]) |
//! | 9 Query   | tool → sink | flags u32 (0) | – |
//! | 10 Report | sink → tool | a [`StreamReport`] (see [`StreamReport::encode`]) | – |
//!
//! Query is sent instead of Hello by a tool that only reads figures (`gpushm list`, `top`,
//! `inspect`): the producer answers one Report and closes the connection. The tool gets no
//! descriptor and no frame, it never becomes a client, and it passes the same checks as a
//! consumer (the socket's permissions, the handshake deadline, the admission rate). A report is
//! built at most every [`REPORT_INTERVAL`]; queries in between get the last one.
//!
//! A ring whose pixels are in GPU memory (a device ring) is announced by Ring (its memfd keeps
//! headers, metadata and queues) followed at once by DeviceMemory. Only consumers that said
//! they can map GPU memory (Hello bit 3) are served a device ring; the others are told why and
//! let go.
//!
//! The handshake: the src sends Hello; the sink answers Welcome, then Ring and Caps if it has
//! them (and Eos if the stream already ended). Ring and Caps are sent again whenever they change,
//! always before the first frame that uses them is delivered.
//!
//! Close: the consumer takes no more frames but still holds some (its app keeps views of
//! them). The producer delivers nothing more to it, never waits for it, takes back what it
//! delivered and the consumer had not taken, and leaves every frame the consumer holds alone
//! until the consumer releases it or closes the socket (see [`crate::subscriber`], "Held frames").
//! An Error from the producer after Welcome means it cut the consumer and took back all of its
//! slots. An Error instead of Welcome whose message starts with [`BUSY_PREFIX`] means the
//! producer is busy (handshakes or max-clients): the consumer tries again, with backoff.
//!
//! Version 3 added Close (version 2 peers refuse version 3 messages with a readable error:
//! "protocol version 3 is not supported (this side speaks 2)"). Version 4 replaced the two
//! eventfds of Welcome with doorbell sockets: an eventfd's O_NONBLOCK flag is shared with the
//! peer, which could clear it and make the other side block for good. Version 5 added
//! DeviceMemory. Version 6 added Query and Report.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

use super::{Error, Result};

pub const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"GSHW");
pub const PROTOCOL_VERSION: u16 = 6;
pub const HEADER_LEN: usize = 16;
pub const MAX_PAYLOAD: u32 = 64 * 1024;
pub const MAX_FDS: u32 = 4;
/// An Error message that starts with this, instead of Welcome: try again later.
pub const BUSY_PREFIX: &str = "busy: ";
pub const FLAG_LOSSLESS: u32 = 1;
/// The consumer's GPU cannot register read-only memory: it asks for a writable ring descriptor.
pub const FLAG_WRITABLE_RING: u32 = 2;
/// The consumer's delivery is `auto` ([`crate::policy::Delivery::Auto`]): lossless, except
/// for live raw video (bit 0 then unset).
pub const FLAG_AUTO: u32 = 4;
/// The consumer can map a ring whose pixels are in GPU memory (it was built with the `cuda`
/// feature and asked for it): it may be sent DeviceMemory.
pub const FLAG_DEVICE_MEMORY: u32 = 8;
/// `Ring.flags`: the descriptor is writable (granted to a client that asked, when the producer
/// allows it); otherwise it is read-only and the ring is sealed against writes.
pub const RING_WRITABLE: u32 = 1;
/// `Ring.flags`: a device ring: its pixels are in GPU memory, sent next in DeviceMemory.
pub const RING_DEVICE: u32 = 2;
/// How old a Report may be when it is sent again instead of a new one: queries cost the
/// producer at most one report built per interval, however many come.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(100);
/// Bytes of caps a Report carries at most (longer caps are cut, ending in "...").
pub const REPORT_MAX_CAPS: usize = 8192;
/// Bytes of a client's name a Report carries at most.
pub const REPORT_MAX_NAME: usize = 64;

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
    fn encode(&self, p: &mut Vec<u8>) {
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

    fn decode(r: &mut Reader<'_>) -> Result<Self> {
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
    fn encode(&self, p: &mut Vec<u8>) {
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

    fn decode(r: &mut Reader<'_>) -> Result<Self> {
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

/// Descriptors one recvmsg() takes in: one more than any message carries. The kernel closes
/// any beyond what fits (and flags the truncation, which is an error).
const RECV_FDS: usize = MAX_FDS as usize + 1;

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Hello {
        flags: u32,
        pid: u32,
        name: String,
    },
    Welcome {
        client_id: u32,
        queue_capacity: u32,
    },
    Ring {
        ring_gen: u32,
        flags: u32,
        slot_count: u32,
        slot_size: u64,
        total_size: u64,
    },
    Caps {
        caps_gen: u32,
        caps: String,
    },
    Eos,
    Error {
        message: String,
    },
    /// The consumer takes no more frames; it keeps those it holds until it releases them.
    Close,
    /// The pixels of ring `ring_gen` are in the GPU memory sent with this message, `size`
    /// bytes of GPU `gpu_uuid` (see [`crate::cuda::vmm`]).
    DeviceMemory {
        ring_gen: u32,
        gpu_uuid: [u8; 16],
        size: u64,
    },
    /// A tool asks for a [`StreamReport`] (instead of Hello).
    Query {
        flags: u32,
    },
    /// The producer's answer to Query.
    Report(Box<StreamReport>),
}

impl Message {
    fn kind(&self) -> u16 {
        match self {
            Message::Hello { .. } => 1,
            Message::Welcome { .. } => 2,
            Message::Ring { .. } => 3,
            Message::Caps { .. } => 4,
            Message::Eos => 5,
            Message::Error { .. } => 6,
            Message::Close => 7,
            Message::DeviceMemory { .. } => 8,
            Message::Query { .. } => 9,
            Message::Report(_) => 10,
        }
    }

    /// Descriptors that must travel with this message.
    pub fn expected_fds(&self) -> u32 {
        match self {
            Message::Welcome { .. } => 3,
            Message::Ring { .. } | Message::DeviceMemory { .. } => 1,
            _ => 0,
        }
    }

    /// Header + payload bytes for a message sent with `nfds` descriptors.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Message::Hello { flags, pid, name } => {
                p.extend_from_slice(&flags.to_le_bytes());
                p.extend_from_slice(&pid.to_le_bytes());
                put_str(&mut p, name);
            }
            Message::Welcome {
                client_id,
                queue_capacity,
            } => {
                p.extend_from_slice(&client_id.to_le_bytes());
                p.extend_from_slice(&queue_capacity.to_le_bytes());
            }
            Message::Ring {
                ring_gen,
                flags,
                slot_count,
                slot_size,
                total_size,
            } => {
                p.extend_from_slice(&ring_gen.to_le_bytes());
                p.extend_from_slice(&flags.to_le_bytes());
                p.extend_from_slice(&slot_count.to_le_bytes());
                p.extend_from_slice(&slot_size.to_le_bytes());
                p.extend_from_slice(&total_size.to_le_bytes());
            }
            Message::Caps { caps_gen, caps } => {
                p.extend_from_slice(&caps_gen.to_le_bytes());
                put_str(&mut p, caps);
            }
            Message::Eos | Message::Close => {}
            Message::Error { message } => put_str(&mut p, message),
            Message::DeviceMemory {
                ring_gen,
                gpu_uuid,
                size,
            } => {
                p.extend_from_slice(&ring_gen.to_le_bytes());
                p.extend_from_slice(gpu_uuid);
                p.extend_from_slice(&size.to_le_bytes());
            }
            Message::Query { flags } => p.extend_from_slice(&flags.to_le_bytes()),
            Message::Report(r) => r.encode(&mut p),
        }
        let mut out = Vec::with_capacity(HEADER_LEN + p.len());
        out.extend_from_slice(&WIRE_MAGIC.to_le_bytes());
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.extend_from_slice(&self.kind().to_le_bytes());
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.expected_fds().to_le_bytes());
        out.extend_from_slice(&p);
        out
    }

    /// Parses one message from the front of `buf`. Returns `Ok(None)` when more bytes are
    /// needed, otherwise the message, its byte length and the number of fds it announced.
    pub fn decode(buf: &[u8]) -> Result<Option<(Message, usize, u32)>> {
        if buf.len() < HEADER_LEN {
            // Reject garbage as soon as the magic is wrong, not only when 16 bytes arrived.
            let n = buf.len().min(4);
            if buf[..n] != WIRE_MAGIC.to_le_bytes()[..n] {
                return Err(Error::protocol(
                    "bad magic: the peer is not speaking the gpushm protocol",
                ));
            }
            return Ok(None);
        }
        let mut r = Reader {
            buf: &buf[..HEADER_LEN],
        };
        let magic = r.u32()?;
        let version = r.u16()?;
        let kind = r.u16()?;
        let len = r.u32()?;
        let nfds = r.u32()?;
        if magic != WIRE_MAGIC {
            return Err(Error::protocol(
                "bad magic: the peer is not speaking the gpushm protocol",
            ));
        }
        if version != PROTOCOL_VERSION {
            return Err(Error::protocol(format!(
                "protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); \
                 use the same gpushm version on both sides"
            )));
        }
        if len > MAX_PAYLOAD {
            return Err(Error::protocol(format!(
                "message of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
            )));
        }
        if nfds > MAX_FDS {
            return Err(Error::protocol(format!(
                "message announces {nfds} descriptors, at most {MAX_FDS} allowed"
            )));
        }
        let total = HEADER_LEN + len as usize;
        if buf.len() < total {
            return Ok(None);
        }
        let mut r = Reader {
            buf: &buf[HEADER_LEN..total],
        };
        let msg = match kind {
            1 => Message::Hello {
                flags: r.u32()?,
                pid: r.u32()?,
                name: r.str()?,
            },
            2 => Message::Welcome {
                client_id: r.u32()?,
                queue_capacity: r.u32()?,
            },
            3 => Message::Ring {
                ring_gen: r.u32()?,
                flags: r.u32()?,
                slot_count: r.u32()?,
                slot_size: r.u64()?,
                total_size: r.u64()?,
            },
            4 => Message::Caps {
                caps_gen: r.u32()?,
                caps: r.str()?,
            },
            5 => Message::Eos,
            6 => Message::Error { message: r.str()? },
            7 => Message::Close,
            8 => Message::DeviceMemory {
                ring_gen: r.u32()?,
                gpu_uuid: r.take(16)?.try_into().expect("16 bytes"),
                size: r.u64()?,
            },
            9 => Message::Query { flags: r.u32()? },
            10 => Message::Report(Box::new(StreamReport::decode(&mut r)?)),
            k => return Err(Error::protocol(format!("unknown message kind {k}"))),
        };
        if !r.buf.is_empty() {
            return Err(Error::protocol(format!(
                "{} trailing bytes after a {:?} message",
                r.buf.len(),
                kind
            )));
        }
        if nfds != msg.expected_fds() {
            return Err(Error::protocol(format!(
                "message kind {kind} announces {nfds} descriptors, {} expected",
                msg.expected_fds()
            )));
        }
        Ok(Some((msg, total, nfds)))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.buf.len() < n {
            return Err(Error::protocol("truncated message"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str(&mut self) -> Result<String> {
        let len = self.u32()? as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::protocol("string is not UTF-8"))
    }
}

/// One recvmsg() without blocking: the bytes read, every descriptor that arrived (owned, so
/// none can leak, whatever the peer sent), and whether control data was truncated. nix
/// refuses to walk truncated control data, but the descriptors the kernel did install are
/// in it and must be closed, so the walk is done here.
fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
) -> std::result::Result<(usize, Vec<OwnedFd>, bool), nix::errno::Errno> {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { nix::libc::CMSG_SPACE((RECV_FDS * std::mem::size_of::<RawFd>()) as u32) };
    // u64 elements: aligned for cmsghdr.
    let mut control = vec![0u64; (space as usize).div_ceil(8) + 1];
    let mut iov = nix::libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut mh: nix::libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control.as_mut_ptr().cast();
    mh.msg_controllen = (control.len() * 8) as _;
    // SAFETY: mh describes valid, writable buffers for the duration of the call.
    let n = unsafe {
        nix::libc::recvmsg(
            fd,
            &mut mh,
            nix::libc::MSG_DONTWAIT | nix::libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(nix::errno::Errno::last());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel set msg_controllen to the control bytes it wrote; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay within them, and each SCM_RIGHTS payload holds cmsg_len - CMSG_LEN(0)
    // bytes of descriptors it installed for us.
    unsafe {
        let mut c = nix::libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == nix::libc::SOL_SOCKET && (*c).cmsg_type == nix::libc::SCM_RIGHTS {
                let data = nix::libc::CMSG_DATA(c) as *const RawFd;
                let len = ((*c).cmsg_len as usize).saturating_sub(nix::libc::CMSG_LEN(0) as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    if raw >= 0 {
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
            }
            c = nix::libc::CMSG_NXTHDR(&mh, c);
        }
    }
    Ok((n as usize, fds, mh.msg_flags & nix::libc::MSG_CTRUNC != 0))
}

/// One end of the control socket: framing, descriptor passing, and a receive buffer so that
/// partial reads and several messages per read both work.
pub struct Conn {
    stream: UnixStream,
    rbuf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    eof: bool,
    /// The peer never sends descriptors (a producer's end): any it sends is an error.
    refuse_fds: bool,
}

impl Conn {
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            rbuf: Vec::new(),
            fds: VecDeque::new(),
            eof: false,
            refuse_fds: false,
        }
    }

    /// A connection whose peer must never send descriptors: the first one it sends is an
    /// error (the descriptors stay owned by this Conn until it is dropped, so whoever drops
    /// it decides on which thread they close).
    pub fn refusing_fds(mut self) -> Self {
        self.refuse_fds = true;
        self
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    pub fn raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sends `msg` with `fds`; never blocks: a peer whose socket buffer is full (it stopped
    /// reading) gets an error instead of stalling the sender.
    pub fn send(&self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        if fds.len() as u32 != msg.expected_fds() {
            return Err(Error::protocol(format!(
                "{msg:?} needs {} descriptors, {} given",
                msg.expected_fds(),
                fds.len()
            )));
        }
        let bytes = msg.encode();
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut sent = 0;
        while sent < bytes.len() {
            let iov = [IoSlice::new(&bytes[sent..])];
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() {
                &cmsg
            } else {
                &[]
            };
            match sendmsg::<UnixAddr>(
                self.stream.as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(n) => sent += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => {
                    // Messages are small and rare: a full socket buffer means the peer stopped
                    // reading. Never wait for it (the sender may hold a lock others need).
                    return Err(Error::Timeout("the peer does not read its socket".into()));
                }
                Err(nix::errno::Errno::EPIPE) | Err(nix::errno::Errno::ECONNRESET) => {
                    return Err(Error::Disconnected)
                }
                Err(e) => return Err(Error::os("sendmsg", e)),
            }
        }
        Ok(())
    }

    fn stream_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    /// Reads whatever is available without blocking. Returns Ok(false) if nothing was read.
    /// After the peer closed its end, returns `Error::Disconnected` once buffered messages are
    /// parsed.
    pub fn fill(&mut self) -> Result<bool> {
        if self.eof {
            return Ok(false);
        }
        let mut buf = [0u8; 4096];
        let (n, fds, truncated) = match recv_with_fds(self.stream.as_raw_fd(), &mut buf) {
            Ok(r) => r,
            Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => return Ok(false),
            Err(nix::errno::Errno::ECONNRESET) => {
                self.eof = true;
                return Ok(false);
            }
            Err(e) => return Err(Error::os("recvmsg", e)),
        };
        if self.refuse_fds && !fds.is_empty() {
            // Kept (owned) until this Conn is dropped: closing a descriptor can block, and
            // the caller chooses where that happens.
            self.fds.extend(fds);
            return Err(Error::protocol(
                "the peer sent file descriptors; clients never send any",
            ));
        }
        if truncated {
            self.fds.extend(fds);
            return Err(Error::protocol(
                "the peer sent more descriptors than any message carries (control data truncated)",
            ));
        }
        if n == 0 && fds.is_empty() {
            self.eof = true;
            return Ok(false);
        }
        self.rbuf.extend_from_slice(&buf[..n]);
        self.fds.extend(fds);
        if self.fds.len() > 4 * MAX_FDS as usize {
            return Err(Error::protocol(
                "the peer sent descriptors no message announced",
            ));
        }
        if self.rbuf.len() > 2 * (HEADER_LEN + MAX_PAYLOAD as usize) {
            return Err(Error::protocol(
                "the peer sent more data than any message holds",
            ));
        }
        Ok(true)
    }

    /// Descriptors received that no message claimed (yet).
    pub fn stray_fds(&self) -> usize {
        self.fds.len()
    }

    /// Bytes received that no message took yet.
    pub fn buffered(&self) -> usize {
        self.rbuf.len()
    }

    /// Takes one complete message from the receive buffer, if there is one.
    pub fn next_buffered(&mut self) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        match Message::decode(&self.rbuf)? {
            Some((msg, used, nfds)) => {
                if (self.fds.len() as u32) < nfds {
                    return Err(Error::protocol(format!(
                        "{msg:?} arrived without its {nfds} descriptors"
                    )));
                }
                self.rbuf.drain(..used);
                let fds = self.fds.drain(..nfds as usize).collect();
                Ok(Some((msg, fds)))
            }
            None if self.eof => Err(Error::Disconnected),
            None => Ok(None),
        }
    }

    /// Reads without blocking and returns the next complete message, if any.
    pub fn try_recv(&mut self) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        loop {
            if let Some(m) = self.next_buffered()? {
                return Ok(Some(m));
            }
            if !self.fill()? && !self.eof {
                return Ok(None);
            }
        }
    }

    /// Blocks up to `timeout` for the next message. `wake` (if any) aborts the wait when it
    /// becomes readable; then `Ok(None)` is returned.
    pub fn recv_timeout(
        &mut self,
        timeout: Duration,
        wake: Option<BorrowedFd<'_>>,
    ) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
        loop {
            if let Some(m) = self.try_recv()? {
                return Ok(Some(m));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout("no answer from the peer".into()));
            }
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfds = vec![PollFd::new(self.stream_fd(), PollFlags::POLLIN)];
            if let Some(w) = wake {
                pfds.push(PollFd::new(w, PollFlags::POLLIN));
            }
            match poll(
                &mut pfds,
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::os("poll", e)),
            }
            if pfds.len() > 1 && pfds[1].any().unwrap_or(false) {
                return Ok(None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_of_more_clients_than_fit_stays_within_the_payload_limit_and_says_so() {
        // 300 clients, each with a full histogram and a long name: far over 64 KiB.
        let client = |id| ClientReport {
            id,
            name: "x".repeat(200),
            mode: "lossless".into(),
            latency: vec![u32::MAX; crate::ring::layout::LATENCY_BUCKETS],
            ..Default::default()
        };
        let report = StreamReport {
            caps: "c".repeat(3 * REPORT_MAX_CAPS),
            clients: (0..300).map(client).collect(),
            ..Default::default()
        };
        let bytes = Message::Report(Box::new(report)).encode();
        assert!(
            bytes.len() <= HEADER_LEN + MAX_PAYLOAD as usize,
            "{} bytes",
            bytes.len()
        );
        let (m, used, _) = Message::decode(&bytes).unwrap().expect("whole");
        assert_eq!(used, bytes.len());
        let Message::Report(r) = m else {
            panic!("{m:?}")
        };
        assert!(r.clients.len() > 10, "{} clients fit", r.clients.len());
        assert_eq!(r.clients.len() + r.clients_left_out as usize, 300);
        assert!(r.caps.len() <= REPORT_MAX_CAPS && r.caps.ends_with("..."));
        assert!(r.clients.iter().all(|c| c.name.len() <= REPORT_MAX_NAME));
        assert_eq!(
            r.clients[0].latency,
            vec![u32::MAX; crate::ring::layout::LATENCY_BUCKETS]
        );
        assert_eq!(r.clients[3].id, 3);
    }
    use std::os::fd::AsFd;

    fn all() -> Vec<Message> {
        vec![
            Message::Hello {
                flags: FLAG_LOSSLESS,
                pid: 4242,
                name: "gpushmsrc0".into(),
            },
            Message::Welcome {
                client_id: 3,
                queue_capacity: 128,
            },
            Message::Ring {
                ring_gen: 2,
                flags: RING_WRITABLE,
                slot_count: 8,
                slot_size: 1 << 22,
                total_size: (8 << 22) + 4096,
            },
            Message::Caps {
                caps_gen: 5,
                caps: "video/x-raw, format=(string)NV12, width=(int)1920".into(),
            },
            Message::Eos,
            Message::Error {
                message: "über".into(),
            },
            Message::Close,
            Message::DeviceMemory {
                ring_gen: 2,
                gpu_uuid: *b"0123456789abcdef",
                size: 1 << 30,
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in all() {
            let bytes = m.encode();
            let (back, used, nfds) = Message::decode(&bytes).unwrap().unwrap();
            assert_eq!(back, m);
            assert_eq!(used, bytes.len());
            assert_eq!(nfds, m.expected_fds());
            // Every strict prefix asks for more bytes, never errors or panics.
            for cut in 0..bytes.len() {
                assert!(
                    Message::decode(&bytes[..cut]).unwrap().is_none(),
                    "{m:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn byte_layout_is_explicit() {
        let b = Message::Welcome {
            client_id: 0x01020304,
            queue_capacity: 9,
        }
        .encode();
        assert_eq!(&b[0..4], b"GSHW");
        assert_eq!(&b[4..6], &PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(&b[6..8], &2u16.to_le_bytes());
        assert_eq!(&b[8..12], &8u32.to_le_bytes());
        assert_eq!(&b[12..16], &3u32.to_le_bytes());
        assert_eq!(&b[16..20], &[4, 3, 2, 1]);
    }

    #[test]
    fn garbage_is_rejected() {
        assert!(Message::decode(b"GET / HTTP/1.1\r\n\r\n").is_err());
        assert!(Message::decode(b"X").is_err());
        let mut b = Message::Eos.encode();
        b[4] = 99; // version
        let e = Message::decode(&b).unwrap_err().to_string();
        assert!(e.contains("version 99"), "{e}");
        let mut b = Message::Eos.encode();
        b[6] = 77; // kind
        assert!(Message::decode(&b).is_err());
        let mut b = Message::Eos.encode();
        b[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(Message::decode(&b).is_err());
        let mut b = Message::Eos.encode();
        b[12..16].copy_from_slice(&2u32.to_le_bytes()); // fds Eos does not carry
        assert!(Message::decode(&b).is_err());
        // A string length pointing past the payload.
        let mut b = Message::Error {
            message: "abc".into(),
        }
        .encode();
        b[16..20].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Message::decode(&b).is_err());
        // Invalid UTF-8.
        let mut b = Message::Error {
            message: "abc".into(),
        }
        .encode();
        b[20] = 0xff;
        assert!(Message::decode(&b).is_err());
    }

    #[test]
    fn descriptors_travel_with_their_message() {
        let (a, b) = UnixStream::pair().unwrap();
        let a = Conn::new(a);
        let mut b = Conn::new(b);
        let efd = crate::ring::shm::new_eventfd().unwrap();
        let mem = crate::ring::shm::create_sealed_memfd("t", 4096).unwrap();
        let e2 = crate::ring::shm::new_eventfd().unwrap();
        a.send(
            &Message::Caps {
                caps_gen: 1,
                caps: "video/x-raw".into(),
            },
            &[],
        )
        .unwrap();
        a.send(
            &Message::Welcome {
                client_id: 1,
                queue_capacity: 4,
            },
            &[mem.as_fd(), efd.as_fd(), e2.as_fd()],
        )
        .unwrap();
        a.send(&Message::Eos, &[]).unwrap();
        let (m1, f1) = b
            .recv_timeout(Duration::from_secs(1), None)
            .unwrap()
            .unwrap();
        assert!(matches!(m1, Message::Caps { .. }) && f1.is_empty());
        let (m2, f2) = b
            .recv_timeout(Duration::from_secs(1), None)
            .unwrap()
            .unwrap();
        assert!(matches!(m2, Message::Welcome { client_id: 1, .. }));
        assert_eq!(f2.len(), 3);
        crate::ring::shm::check_sealed_memfd(f2[0].as_fd(), 4096, "client").unwrap();
        let (m3, _) = b
            .recv_timeout(Duration::from_secs(1), None)
            .unwrap()
            .unwrap();
        assert_eq!(m3, Message::Eos);
        drop(a);
        assert!(matches!(
            b.recv_timeout(Duration::from_secs(1), None),
            Err(Error::Disconnected)
        ));
    }

    /// Descriptors of /dev/null open in this process (other tests running at the same time
    /// open other things).
    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.as_os_str() == "/dev/null")
            .count()
    }

    /// Descriptors beyond what one receive takes are cut off by the kernel; those that did
    /// arrive are owned and closed with the connection, whatever the error.
    #[test]
    fn too_many_descriptors_leak_nothing() {
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..20)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        let before = open_fds();
        for _ in 0..10 {
            sendmsg::<UnixAddr>(
                a.as_raw_fd(),
                &[IoSlice::new(b"GSHW")],
                &[ControlMessage::ScmRights(&raw)],
                MsgFlags::empty(),
                None,
            )
            .unwrap();
            let mut conn = Conn::new(b.try_clone().unwrap());
            assert!(conn.fill().is_err(), "truncated control data is an error");
            drop(conn);
        }
        assert_eq!(open_fds(), before, "no descriptor leaked");
        // A refusing end errors on the first descriptor, and leaks none either.
        sendmsg::<UnixAddr>(
            a.as_raw_fd(),
            &[IoSlice::new(b"GSHW")],
            &[ControlMessage::ScmRights(&raw[..1])],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut conn = Conn::new(b.try_clone().unwrap()).refusing_fds();
        assert!(conn.fill().is_err());
        drop(conn);
        assert_eq!(open_fds(), before);
    }

    #[test]
    fn recv_times_out_and_wakes() {
        let (_a, b) = UnixStream::pair().unwrap();
        let mut b = Conn::new(b);
        assert!(matches!(
            b.recv_timeout(Duration::from_millis(20), None),
            Err(Error::Timeout(_))
        ));
        let wake = crate::ring::shm::new_eventfd().unwrap();
        crate::ring::shm::notify(&wake);
        assert!(b
            .recv_timeout(Duration::from_secs(10), Some(wake.as_fd()))
            .unwrap()
            .is_none());
    }
}
