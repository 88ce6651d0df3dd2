// SPDX-License-Identifier: MPL-2.0
//! The wire byte by byte: every message round-trips, garbage and abuse are refused, no
//! descriptor leaks.

use super::*;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

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
        Message::FrameMetas {
            seq: u64::MAX,
            payload: "c my-meta my-meta, n=(int)1;".into(),
        },
        Message::Upstream {
            payload: "custom-upstream\nGstForceKeyUnit, all-headers=(boolean)true;".into(),
        },
        Message::Event {
            seq: u32::MAX,
            payload: "tag stream\ntaglist, title=(string)\"é\";".into(),
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

/// Strings go to C (caps, structures, tags, names): one with a NUL would be read as a
/// shorter one there, so the decoder refuses it, in every message that has strings.
#[test]
fn a_string_with_a_nul_byte_is_refused() {
    for m in [
        Message::Caps {
            caps_gen: 1,
            caps: "video/x-raw\0, width=(int)1".into(),
        },
        Message::FrameMetas {
            seq: 1,
            payload: "c gpushm-ok\0x a;".into(),
        },
        Message::Upstream {
            payload: "\0".into(),
        },
        Message::Error {
            message: "a\0b".into(),
        },
    ] {
        let e = Message::decode(&m.encode()).unwrap_err().to_string();
        assert!(e.contains("NUL"), "{m:?}: {e}");
    }
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
