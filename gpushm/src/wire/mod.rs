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
//! | 10 Report | sink → tool | a [`StreamReport`] (encoded in `report.rs`) | – |
//! | 12 Upstream | src → sink | payload str (opaque to the core: a consumer's custom upstream event, force-key-unit included, see `src/events.rs`) | – |
//! | 13 FrameMetas | sink → src | seq u64, payload str (opaque to the core: gpushmsink's encoding of a frame's metas, see `src/frame_metas.rs`) | – |
//! | 11 Event  | sink → src | seq u32, payload str (opaque to the core: gpushmsink's encoding of a tag or custom event, see `src/events.rs`) | – |
//!
//! Event carries a serialized event of the producer's stream, in order with the frames: each
//! frame's [`crate::ring::layout::SlotDesc::events_seq`] is the `seq` of the last Event sent
//! before it, and a consumer hands out the events up to that `seq` before the frame (those
//! left at the end before EOS). A consumer that connects gets the events the producer keeps
//! for late joiners (the current tags) after Caps.
//!
//! FrameMetas carries the metas of frame `seq` that the ring has no field for; it is sent
//! before the frame, whose [`crate::ring::layout::STREAM_HAS_METAS`] flag says to look for it
//! (the latest for that seq counts).
//!
//! Upstream is the one message a consumer sends after Hello besides Close: the producer takes
//! [`crate::server::Server::set_upstream_rate`] of them a second per consumer at most (the rest
//! are dropped) and hands them to its pipeline, or refuses all.
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
//! DeviceMemory. Version 6 added Query and Report. Version 7 added Event, Upstream and FrameMetas.
//!
//! - this file: the header, the constants and [`Message`] with its encoding;
//! - `report.rs`: the figures a Report carries ([`StreamReport`], [`ClientReport`]);
//! - `conn.rs`: one end of the socket ([`Conn`]): framing, descriptor passing, timeouts.

mod conn;
mod report;

use std::time::Duration;

use crate::{Error, Result};

pub use self::conn::Conn;
pub use self::report::{cut_str, ClientReport, StreamReport};

pub const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"GSHW");
pub const PROTOCOL_VERSION: u16 = 7;
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
    /// An event of the stream, handed out before the frames published after it.
    Event {
        seq: u32,
        payload: String,
    },
    /// A consumer's event for the producer's pipeline.
    Upstream {
        payload: String,
    },
    /// The metas of frame `seq`, sent before it.
    FrameMetas {
        seq: u64,
        payload: String,
    },
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
            Message::Event { .. } => 11,
            Message::Upstream { .. } => 12,
            Message::FrameMetas { .. } => 13,
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
            Message::Event { seq, payload } => {
                p.extend_from_slice(&seq.to_le_bytes());
                put_str(&mut p, payload);
            }
            Message::Upstream { payload } => put_str(&mut p, payload),
            Message::FrameMetas { seq, payload } => {
                p.extend_from_slice(&seq.to_le_bytes());
                put_str(&mut p, payload);
            }
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
            11 => Message::Event {
                seq: r.u32()?,
                payload: r.str()?,
            },
            12 => Message::Upstream { payload: r.str()? },
            13 => Message::FrameMetas {
                seq: r.u64()?,
                payload: r.str()?,
            },
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
        // Every string ends up in C (caps, structures, tags, names): a NUL would end it there,
        // and GLib would read another string than the one checked here.
        if bytes.contains(&0) {
            return Err(Error::protocol("a string holds a NUL byte"));
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::protocol("string is not UTF-8"))
    }
}

#[cfg(test)]
mod tests;
