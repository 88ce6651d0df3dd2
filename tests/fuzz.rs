// SPDX-License-Identifier: MPL-2.0
//! Fuzzing the socket protocol: the committed corpus (tests/corpus/wire/, valid messages and
//! known attacks) is decoded whole and cut at every byte, then proptest mutates it and throws
//! random bytes and random chunkings at a real socket. Nothing may panic; whatever decodes
//! must round-trip. Bounded case counts keep this to seconds in CI.
//!
//! The corpus is built into the test binary, so it runs wherever the binary does (the GPU
//! machine too). `corpus_matches_the_protocol` fails when the protocol changed and the corpus
//! did not; rewrite it with `GPUSHM_WRITE_CORPUS=1 cargo test --test fuzz corpus_matches`.

use gpushm::wire::{ClientReport, Conn, Message, StreamReport, FLAG_LOSSLESS, MAX_PAYLOAD};
use proptest::prelude::*;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

macro_rules! corpus_files {
    ($($name:literal,)*) => {
        &[$(($name, include_bytes!(concat!("corpus/wire/", $name, ".bin")) as &[u8]),)*]
    };
}

/// The committed corpus, embedded.
const CORPUS: &[(&str, &[u8])] = corpus_files!(
    "bad-announced-fds",
    "bad-fd-count",
    "bad-http",
    "bad-huge-length",
    "bad-kind",
    "bad-magic",
    "bad-not-utf8",
    "bad-oversized-length",
    "bad-string-past-end",
    "bad-trailing-bytes",
    "bad-version",
    "bad-report-bucket",
    "bad-report-clients",
    "bad-zeros",
    "ok-caps",
    "ok-close",
    "ok-device-memory",
    "ok-eos",
    "ok-error",
    "ok-event",
    "ok-hello",
    "ok-query",
    "ok-report",
    "ok-ring",
    "ok-upstream",
    "ok-welcome",
);

fn corpus() -> Vec<(String, Vec<u8>)> {
    CORPUS
        .iter()
        .map(|(n, b)| (n.to_string(), b.to_vec()))
        .collect()
}

/// Whatever decodes re-encodes to an equal message.
fn check(bytes: &[u8]) {
    if let Ok(Some((m, used, nfds))) = Message::decode(bytes) {
        assert!(used <= bytes.len());
        assert_eq!(nfds, m.expected_fds());
        let again = m.encode();
        assert_eq!(Message::decode(&again).unwrap().unwrap().0, m);
    }
}

#[test]
fn corpus_decodes_without_panicking_at_every_cut() {
    for (name, bytes) in corpus() {
        let whole = Message::decode(&bytes);
        if name.starts_with("ok-") {
            assert!(matches!(whole, Ok(Some(_))), "{name} is a valid message");
        } else {
            assert!(
                whole.is_err() || matches!(whole, Ok(None)),
                "{name} must not decode"
            );
        }
        for cut in 0..=bytes.len() {
            check(&bytes[..cut]);
        }
    }
}

fn mutations() -> impl Strategy<Value = (usize, Vec<(usize, u8)>, usize)> {
    (
        any::<usize>(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        any::<usize>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes);
    }

    #[test]
    fn mutated_corpus_never_panics((pick, muts, cut) in mutations()) {
        let corpus = corpus();
        let mut bytes = corpus[pick % corpus.len()].1.clone();
        for (at, b) in muts {
            if !bytes.is_empty() {
                let i = at % bytes.len();
                bytes[i] = b;
            }
        }
        bytes.truncate(cut % (bytes.len() + 1));
        check(&bytes);
    }

    #[test]
    /// Any string without a NUL (one with a NUL is refused: strings go to C).
    fn valid_strings_round_trip(name in "[^\\x00]{0,64}", caps in "[^\\x00]{0,200}", flags in any::<u32>(), pid in any::<u32>()) {
        for m in [Message::Hello { flags, pid, name: name.clone() }, Message::Caps { caps_gen: pid, caps: caps.clone() }] {
            let b = m.encode();
            prop_assert_eq!(Message::decode(&b).unwrap().unwrap().0, m);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random bytes in random chunks through a real socket: the reader yields messages or an
    /// error, never a panic or an endless loop.
    #[test]
    fn socket_stream_of_garbage(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..16), valid_first in any::<bool>()) {
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut conn = Conn::new(b);
        if valid_first {
            a.write_all(&Message::Hello { flags: FLAG_LOSSLESS, pid: 1, name: "x".into() }.encode()).unwrap();
        }
        for c in &chunks {
            a.write_all(c).unwrap();
        }
        drop(a);
        let mut got = 0;
        loop {
            match conn.try_recv() {
                Ok(Some(_)) => got += 1,
                Ok(None) => break,
                Err(_) => break,
            }
            prop_assert!(got < 1000);
        }
        if valid_first {
            prop_assert!(got >= 1);
        }
    }
}

/// The corpus as the protocol makes it now: valid messages of every kind, and known attacks.
fn generate_corpus() -> Vec<(String, Vec<u8>)> {
    let valid = [
        ("ok-hello", Message::Hello { flags: FLAG_LOSSLESS, pid: 4242, name: "gpushmsrc0".into() }),
        ("ok-welcome", Message::Welcome { client_id: 3, queue_capacity: 128 }),
        ("ok-ring", Message::Ring { ring_gen: 2, flags: 0, slot_count: 8, slot_size: 12443648, total_size: 99553280 }),
        (
            "ok-caps",
            Message::Caps {
                caps_gen: 1,
                caps: "video/x-raw, format=(string)NV12, width=(int)3840, height=(int)2160, framerate=(fraction)60/1".into(),
            },
        ),
        ("ok-eos", Message::Eos),
        ("ok-close", Message::Close),
        ("ok-error", Message::Error { message: "protocol version 9 is not supported".into() }),
        ("ok-device-memory", Message::DeviceMemory { ring_gen: 2, gpu_uuid: [0xab; 16], size: 99614720 }),
        (
            "ok-event",
            Message::Event { seq: 3, payload: "tag stream\ntaglist, title=(string)hello;".into() },
        ),
        (
            "ok-upstream",
            Message::Upstream { payload: "custom-upstream\nGstForceKeyUnit, all-headers=(boolean)true;".into() },
        ),
    ];
    let mut files: Vec<(String, Vec<u8>)> = valid
        .iter()
        .map(|(n, m)| (n.to_string(), m.encode()))
        .collect();
    // The stats request and its answer (two clients, one with a latency histogram).
    files.push(("ok-query".into(), Message::Query { flags: 0 }.encode()));
    let mut latency = vec![0u32; gpushm::ring::layout::LATENCY_BUCKETS];
    latency[20] = 98;
    latency[40] = 2;
    let client = ClientReport {
        id: 1,
        pid: 4242,
        uid: 1000,
        name: "gpushmsrc0".into(),
        mode: "auto".into(),
        sent: 300,
        taken: 299,
        held: 1,
        latency,
        ..Default::default()
    };
    let report = StreamReport {
        pid: 77,
        frames_sent: 300,
        fps: 30.0,
        caps: "video/x-raw, format=(string)NV12, width=(int)1920, height=(int)1080".into(),
        slot_count: 8,
        slot_size: 3112960,
        ring_size: 24907776,
        max_clients: 64,
        clients: vec![
            client.clone(),
            ClientReport {
                id: 2,
                latency: vec![0; 96],
                ..client
            },
        ],
        ..Default::default()
    };
    files.push((
        "ok-report".into(),
        Message::Report(Box::new(report.clone())).encode(),
    ));
    // A report that claims more clients than fit, and a histogram bucket out of range.
    let mut claims = Message::Report(Box::new(StreamReport {
        clients: vec![],
        ..report.clone()
    }))
    .encode();
    let n = claims.len();
    claims[n - 4..].copy_from_slice(&100_000u32.to_le_bytes());
    files.push(("bad-report-clients".into(), claims));
    let mut one = vec![0u32; 96];
    one[5] = 1;
    let mut bucket = Message::Report(Box::new(StreamReport {
        clients: vec![ClientReport {
            latency: one,
            ..Default::default()
        }],
        ..report
    }))
    .encode();
    let n = bucket.len();
    bucket[n - 5] = 200;
    files.push(("bad-report-bucket".into(), bucket));
    let hello = Message::Hello {
        flags: 0,
        pid: 1,
        name: "abc".into(),
    }
    .encode();
    let mut bad = |name: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = hello.clone();
        f(&mut b);
        files.push((format!("bad-{name}"), b));
    };
    bad("magic", &|b| b[0] = b'X');
    bad("version", &|b| b[4] = 99);
    bad("kind", &|b| b[6] = 200);
    bad("oversized-length", &|b| {
        b[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes())
    });
    bad("huge-length", &|b| {
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes())
    });
    bad("fd-count", &|b| {
        b[12..16].copy_from_slice(&1000u32.to_le_bytes())
    });
    bad("announced-fds", &|b| {
        b[12..16].copy_from_slice(&1u32.to_le_bytes())
    });
    bad("string-past-end", &|b| {
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes())
    });
    bad("not-utf8", &|b| b[28] = 0xff);
    bad("trailing-bytes", &|b| {
        b.push(0);
        let len = u32::from_le_bytes(b[8..12].try_into().unwrap()) + 1;
        b[8..12].copy_from_slice(&len.to_le_bytes());
    });
    files.push((
        "bad-http".into(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
    ));
    files.push(("bad-zeros".into(), vec![0; 64]));
    files.sort();
    files
}

/// The committed corpus is what the protocol makes today (or is rewritten on request).
#[test]
fn corpus_matches_the_protocol() {
    let fresh = generate_corpus();
    if std::env::var_os("GPUSHM_WRITE_CORPUS").is_some() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/wire");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in &fresh {
            std::fs::write(dir.join(format!("{name}.bin")), bytes).unwrap();
        }
        return;
    }
    let mut committed = corpus();
    committed.sort();
    assert_eq!(
        fresh.iter().map(|f| &f.0).collect::<Vec<_>>(),
        committed.iter().map(|f| &f.0).collect::<Vec<_>>(),
        "corpus file names (update CORPUS in tests/fuzz.rs)"
    );
    for ((name, a), (_, b)) in fresh.iter().zip(&committed) {
        assert_eq!(
            a, b,
            "{name}.bin is out of date: GPUSHM_WRITE_CORPUS=1 cargo test --test fuzz corpus_matches"
        );
    }
}
