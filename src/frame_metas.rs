// SPDX-License-Identifier: MPL-2.0
//! The metas of a buffer that the ring has no field for, as they travel from gpushmsink to
//! gpushmsrc with their frame (the core's FrameMetas message). The video meta and the time
//! code travel in the ring's own fields; gpushm's CUDA meta points into one process and
//! stays home. A payload is one line per meta:
//!
//! - `c NAME STRUCTURE`: a `GstCustomMeta` (GStreamer 1.20+), its registered name and its
//!   structure. A consumer registers a custom meta it does not know yet, so that downstream
//!   finds it by name, up to [`MAX_REGISTERED`] names per process.
//! - `r TIMESTAMP DURATION CAPS`: a `GstReferenceTimestampMeta` (NTP or UNIX times of a
//!   camera or an RTP source), nanoseconds, `-` for no duration. gpushmsrc's own publish
//!   time (`timestamp/x-gpushm-publish`) is not sent: each consumer adds its own.
//! - `s BASE64`: any other meta GStreamer 1.24+ can serialize ([`crate::serialized_metas`]),
//!   when both processes run 1.24 or newer.
//!
//! What a consumer reads comes from another process: a line that does not parse, or names a
//! meta this process will not take, is left out (and said why), never a crash.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A payload is at most this long: a whole message is at most [`gpushm::wire::MAX_PAYLOAD`].
pub const MAX_METAS_PAYLOAD: usize = gpushm::wire::MAX_PAYLOAD as usize - 64;

/// Custom meta names a consumer process registers at most (a producer names them; the
/// registry keeps them for the life of the process).
pub const MAX_REGISTERED: usize = 64;

static REGISTERED: AtomicUsize = AtomicUsize::new(0);

/// The payload for `buffer`'s metas, `None` if it has none that travel. Metas that would
/// make it longer than [`MAX_METAS_PAYLOAD`] are left out, and named in the second value.
pub fn encode(buffer: &gst::BufferRef) -> (Option<String>, Vec<String>) {
    let mut out = String::new();
    let mut left_out = Vec::new();
    for m in buffer.iter_meta::<gst::Meta>() {
        let line = if let Some(c) = m.try_as_custom_meta() {
            // GpuShmCudaMeta: device pointers of this process, meaningless in another.
            if api_describes_memory(m.api()) {
                continue;
            }
            format!("c {} {}\n", m.type_().name(), c.structure())
        } else if let Some(r) = m.downcast_ref::<gst::ReferenceTimestampMeta>() {
            if is_publish_time(r.reference()) {
                continue;
            }
            let caps = r.reference().to_string();
            let duration = r
                .duration()
                .map_or("-".to_string(), |d| d.nseconds().to_string());
            format!("r {} {duration} {caps}\n", r.timestamp().nseconds())
        } else {
            match crate::serialized_metas::serialize(&m) {
                Ok(Some(bytes)) => format!("s {}\n", gst::glib::base64_encode(&bytes)),
                Ok(None) => continue,
                Err(name) => {
                    left_out.push(name);
                    continue;
                }
            }
        };
        if out.len() + line.len() > MAX_METAS_PAYLOAD {
            // A custom meta by its own name; the others by their API's (GstFooMetaAPI).
            let custom = m.try_as_custom_meta().is_some();
            left_out.push(
                if custom {
                    m.type_().name()
                } else {
                    m.api().name()
                }
                .to_string(),
            );
            continue;
        }
        out.push_str(&line);
    }
    ((!out.is_empty()).then_some(out), left_out)
}

/// Metas one frame takes at most, valid or not: a payload of tiny lines would otherwise be
/// thousands of parses per frame, and thousands of metas for downstream to search.
pub const MAX_METAS_PER_FRAME: usize = 64;

/// Adds the metas of `payload` to `buffer`. Returns why each one left out was.
pub fn apply(payload: &str, buffer: &mut gst::BufferRef) -> Vec<String> {
    let mut why = Vec::new();
    let mut lines = payload.lines().filter(|l| !l.is_empty());
    for line in lines.by_ref().take(MAX_METAS_PER_FRAME) {
        // GLib's C strings end at a NUL: a name cut there would be another name (and
        // gstreamer-rs asserts there is none).
        let checked = match line.contains('\0') {
            true => Err("a meta line with a NUL byte".to_string()),
            false => apply_line(line, buffer),
        };
        if let Err(e) = checked {
            why.push(e);
        }
    }
    let more = lines.count();
    if more > 0 {
        why.push(format!(
            "{more} metas beyond {MAX_METAS_PER_FRAME} for one frame"
        ));
    }
    why
}

fn cut(s: &str) -> String {
    gpushm::wire::cut_str(s, 60).to_string()
}

fn apply_line(line: &str, buffer: &mut gst::BufferRef) -> Result<(), String> {
    match line.split_at_checked(2) {
        Some(("c ", rest)) => apply_custom(rest, buffer),
        Some(("r ", rest)) => apply_reference_timestamp(rest, buffer),
        Some(("s ", rest)) => {
            let bytes = gst::glib::base64_decode(rest);
            crate::serialized_metas::deserialize(&bytes, buffer)
        }
        _ => Err(format!("a meta of an unknown kind: {}", cut(line))),
    }
}

fn apply_reference_timestamp(rest: &str, buffer: &mut gst::BufferRef) -> Result<(), String> {
    let bad = || format!("a reference timestamp that does not parse: {}", cut(rest));
    let mut parts = rest.splitn(3, ' ');
    let (Some(ts), Some(duration), Some(caps)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    let ts = ts.parse::<u64>().map_err(|_| bad())?;
    let duration = match duration {
        "-" => None,
        d => Some(d.parse::<u64>().map_err(|_| bad())?),
    };
    let caps = gst::Caps::from_str(caps).map_err(|_| bad())?;
    // The publish time is the consumer's own to add (looked up by a subset match, so any
    // caps of that name would pass for it); ClockTime::NONE's value is no time.
    if is_publish_time(&caps) || ts == u64::MAX || duration == Some(u64::MAX) {
        return Err(bad());
    }
    gst::ReferenceTimestampMeta::add(
        buffer,
        &caps,
        gst::ClockTime::from_nseconds(ts),
        duration.map(gst::ClockTime::from_nseconds),
    );
    Ok(())
}

/// Whether `caps` are those of gpushmsrc's publish-time reference timestamp.
fn is_publish_time(caps: &gst::CapsRef) -> bool {
    caps.iter()
        .any(|s| s.name() == crate::PUBLISH_TIMESTAMP_CAPS)
}

/// Registered custom meta names are only checked, never registered twice: two consumers
/// meeting a new name at once would both try.
static REGISTERING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn apply_custom(rest: &str, buffer: &mut gst::BufferRef) -> Result<(), String> {
    let (name, body) = rest
        .split_once(' ')
        .ok_or_else(|| format!("a custom meta without its structure: {}", cut(rest)))?;
    if !type_name_chars(name) {
        return Err(format!("custom meta {}: not a meta name", cut(name)));
    }
    let s = gst::Structure::from_str(body)
        .map_err(|_| format!("custom meta {} whose structure does not parse", cut(name)))?;
    let registering = REGISTERING.lock().unwrap_or_else(|e| e.into_inner());
    if !gst::meta::CustomMeta::is_registered(name) {
        // GStreamer's own names are left to GStreamer: registered here as a custom meta
        // first, a library's meta of that name (GstVideoMeta) could not register after.
        if !valid_type_name(name) || name.to_ascii_lowercase().starts_with("gst") {
            return Err(format!(
                "custom meta {}: not a name a producer may register",
                cut(name)
            ));
        }
        if REGISTERED.load(Ordering::Relaxed) >= MAX_REGISTERED {
            return Err(format!(
                "custom meta {}: this process registered {MAX_REGISTERED} custom metas from producers already",
                cut(name)
            ));
        }
        gst::meta::CustomMeta::register_simple(name);
        REGISTERED.fetch_add(1, Ordering::Relaxed);
    }
    drop(registering);
    // A name registered here as another kind of meta is not a custom one.
    if !is_custom(name) {
        return Err(format!(
            "{} is not a custom meta in this process",
            cut(name)
        ));
    }
    if describes_memory(name) {
        return Err(format!(
            "custom meta {} describes memory of the producer's process",
            cut(name)
        ));
    }
    let mut meta = gst::meta::CustomMeta::add(buffer, name)
        .map_err(|_| format!("custom meta {} could not be added", cut(name)))?;
    let st = meta.mut_structure();
    for (field, value) in s.iter() {
        st.set_value(field, value.clone());
    }
    Ok(())
}

/// Whether `name` is made as a GType name is (what a meta's registration makes): letters,
/// digits and `-_+`, starting with a letter or `_`, 3 to 128 long.
fn type_name_chars(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() >= 3
        && name.len() <= 128
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || "-_+".contains(c))
}

/// Whether `name` can name a new GType: made as one, and not one already.
fn valid_type_name(name: &str) -> bool {
    type_name_chars(name) && gst::glib::Type::from_name(name).is_none()
}

/// Whether metas of `api` describe a buffer's memory (the `memory` tag): video and audio
/// layouts, gpushm's CUDA pointers. They never travel: the ring's fields say where a frame is.
pub(crate) fn api_describes_memory(api: gst::glib::Type) -> bool {
    // SAFETY: a registered meta API type and a static tag.
    unsafe {
        gst::ffi::gst_meta_api_type_has_tag(
            gst::glib::translate::IntoGlib::into_glib(api),
            gst::glib::ffi::g_quark_from_static_string(c"memory".as_ptr()),
        ) != 0
    }
}

/// Whether the meta registered as `name` describes memory (GpuShmCudaMeta's device pointers):
/// taken from a producer, downstream CUDA elements would read where it says.
fn describes_memory(name: &str) -> bool {
    use gst::glib::translate::{from_glib, ToGlibPtr};
    // SAFETY: a NUL-terminated name; the info returned is static or NULL.
    unsafe {
        let info = gst::ffi::gst_meta_get_info(name.to_glib_none().0);
        !info.is_null() && api_describes_memory(from_glib((*info).api))
    }
}

/// Whether the meta registered as `name` is a custom meta.
fn is_custom(name: &str) -> bool {
    use gst::glib::translate::ToGlibPtr;
    // SAFETY: a NUL-terminated name; the info returned is static or NULL.
    unsafe {
        let info = gst::ffi::gst_meta_get_info(name.to_glib_none().0);
        !info.is_null() && gst::ffi::gst_meta_info_is_custom(info) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_meta(name: &str, n: i32) -> gst::Buffer {
        gst::meta::CustomMeta::register_simple(name);
        let mut b = gst::Buffer::with_size(16).unwrap();
        {
            let bm = b.get_mut().unwrap();
            let mut m = gst::meta::CustomMeta::add(bm, name).unwrap();
            m.mut_structure().set("n", n);
            m.mut_structure().set("label", "a b; c");
        }
        b
    }

    #[test]
    fn custom_metas_round_trip() {
        gst::init().unwrap();
        let b = with_meta("gpushm-test-meta", 7);
        let (p, left) = encode(&b);
        assert!(left.is_empty());
        let mut out = gst::Buffer::with_size(16).unwrap();
        let why = apply(&p.unwrap(), out.get_mut().unwrap());
        assert!(why.is_empty(), "{why:?}");
        let m = gst::meta::CustomMeta::from_buffer(&out, "gpushm-test-meta").unwrap();
        assert_eq!(m.structure().get::<i32>("n").unwrap(), 7);
        assert_eq!(m.structure().get::<&str>("label").unwrap(), "a b; c");
    }

    #[test]
    fn a_buffer_with_only_what_the_ring_carries_sends_nothing() {
        gst::init().unwrap();
        let mut b = gst::Buffer::with_size(16).unwrap();
        {
            let bm = b.get_mut().unwrap();
            // The consumer adds its own publish time; the video meta is the ring's planes; the
            // CUDA meta points into this process.
            gst::ReferenceTimestampMeta::add(
                bm,
                &gst::Caps::new_empty_simple(crate::PUBLISH_TIMESTAMP_CAPS),
                gst::ClockTime::SECOND,
                None,
            );
            crate::cudameta::add(
                bm,
                crate::cudameta::CudaPtr {
                    device: 0,
                    device_ptr: 4096,
                    size: 16,
                    read_only: true,
                },
            );
            gst_video::VideoMeta::add(
                bm,
                gst_video::VideoFrameFlags::empty(),
                gst_video::VideoFormat::Gray8,
                4,
                4,
            )
            .unwrap();
        }
        assert!(encode(&b).0.is_none());
    }

    #[test]
    fn reference_timestamps_round_trip() {
        gst::init().unwrap();
        let mut b = gst::Buffer::with_size(16).unwrap();
        let ntp = gst::Caps::builder("timestamp/x-ntp")
            .field("host", "ntp.example.org")
            .build();
        let unix = gst::Caps::new_empty_simple("timestamp/x-unix");
        {
            let bm = b.get_mut().unwrap();
            gst::ReferenceTimestampMeta::add(
                bm,
                &ntp,
                gst::ClockTime::from_nseconds(123),
                Some(gst::ClockTime::from_nseconds(45)),
            );
            gst::ReferenceTimestampMeta::add(
                bm,
                &unix,
                gst::ClockTime::from_seconds(1_700_000_000),
                None,
            );
        }
        let (p, left) = encode(&b);
        assert!(left.is_empty());
        let mut out = gst::Buffer::with_size(16).unwrap();
        let why = apply(&p.unwrap(), out.get_mut().unwrap());
        assert!(why.is_empty(), "{why:?}");
        let got: Vec<_> = out
            .iter_meta::<gst::ReferenceTimestampMeta>()
            .map(|m| (m.reference().to_owned(), m.timestamp(), m.duration()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    ntp,
                    gst::ClockTime::from_nseconds(123),
                    Some(gst::ClockTime::from_nseconds(45))
                ),
                (unix, gst::ClockTime::from_seconds(1_700_000_000), None),
            ]
        );
    }

    /// Serialized metas are checked before GStreamer reads them: its own check of the name
    /// length overflows (a length near 4 GiB passes it).
    #[test]
    fn serialized_metas_with_bad_headers_are_left_out() {
        gst::init().unwrap();
        let mut b = gst::Buffer::with_size(16).unwrap();
        let header = |total: u32, name_len: u32, name: &[u8]| {
            let mut v = total.to_le_bytes().to_vec();
            v.extend_from_slice(&name_len.to_le_bytes());
            v.extend_from_slice(name);
            gst::glib::base64_encode(&v).to_string()
        };
        let bad = [
            "s ".to_string(),
            "s !!!not base64!!!".to_string(),
            format!("s {}", header(8, 0, b"")),
            // The overflow: 8 + 0xFFFFFFFF + 2 wraps to 9 in 32 bits.
            format!("s {}", header(12, u32::MAX, b"abcd")),
            // A total beyond the data, and a name without its NUL.
            format!("s {}", header(4000, 4, b"abcd\0\0")),
            format!("s {}", header(14, 4, b"abcdef")),
            // Well formed, but unknown here, then metas that never travel this way.
            format!("s {}", header(15, 4, b"Nope\0\x01x")),
            format!("s {}", header(23, 12, b"GstVideoMeta\0\x01x")),
            format!("s {}", header(36, 25, b"GstReferenceTimestampMeta\0\x01x")),
        ];
        // Their implementations registered, as a consumer pipeline using them has.
        let mut scratch = gst::Buffer::with_size(16).unwrap();
        gst_video::VideoMeta::add(
            scratch.get_mut().unwrap(),
            gst_video::VideoFrameFlags::empty(),
            gst_video::VideoFormat::Gray8,
            4,
            4,
        )
        .unwrap();
        gst::ReferenceTimestampMeta::add(
            scratch.get_mut().unwrap(),
            &gst::Caps::new_empty_simple("timestamp/x-test"),
            gst::ClockTime::ZERO,
            None,
        );
        for (i, line) in bad.iter().enumerate() {
            let why = apply(line, b.get_mut().unwrap());
            assert_eq!(why.len(), 1, "{line:?} was taken");
            // The malformed ones are caught by the header check, whatever the runtime, and
            // the metas carried otherwise by their kind.
            if i < 6 {
                assert!(!why[0].contains("1.24"), "{line:?}: {why:?}");
            } else if i > 6 {
                assert!(why[0].contains("does not travel"), "{line:?}: {why:?}");
            }
        }
        assert_eq!(b.iter_meta::<gst::Meta>().count(), 0);
    }

    #[test]
    fn what_a_producer_may_send_is_left_out_not_a_crash() {
        gst::init().unwrap();
        crate::cudameta::register();
        // Registered, so that a name cut at a NUL would be a known one.
        gst::meta::CustomMeta::register_simple("gpushm-nul");
        let mut b = gst::Buffer::with_size(16).unwrap();
        let bad = [
            "x something",
            "c",
            "c lonely-name",
            "c some-meta not a structure ((",
            // GStreamer's names, registered here or not.
            "c GstVideoMeta GstVideoMeta, n=(int)1;",
            "c GstReferenceTimestampMeta x, n=(int)1;",
            // A type that is not a meta.
            "c GObject x, n=(int)1;",
            // Another process's device pointers.
            "c GpuShmCudaMeta x, cuda-device=(int)0, device-ptr=(guint64)4096, size=(guint64)64, read-only=(boolean)true;",
            "r",
            "r 1 2",
            "r x - timestamp/x-ntp",
            "r 1 y timestamp/x-ntp",
            "r 1 - not caps ((",
            "r 1 - timestamp/x-gpushm-publish",
            "r 1 - timestamp/x-gpushm-publish, a=(int)1",
            // NULs: GLib would read another name (gstreamer-rs asserts there is none).
            "s \0",
            "c gpushm-nul\0x a, n=(int)1;",
            "c gpushm-nul x, s=(string)\"a\0b\";",
            "r 18446744073709551615 - timestamp/x-ntp",
            "c 9bad-name x, n=(int)1;",
        ];
        for line in bad {
            let why = apply(line, b.get_mut().unwrap());
            assert_eq!(why.len(), 1, "{line:?} was taken");
        }
        assert_eq!(b.iter_meta::<gst::Meta>().count(), 0);
    }

    #[test]
    fn a_frame_takes_64_metas_at_most() {
        gst::init().unwrap();
        gst::meta::CustomMeta::register_simple("gpushm-test-many");
        let payload = "c gpushm-test-many x, n=(int)1;\n".repeat(100);
        let mut b = gst::Buffer::with_size(16).unwrap();
        let why = apply(&payload, b.get_mut().unwrap());
        assert_eq!(why, ["36 metas beyond 64 for one frame"]);
        assert_eq!(b.iter_meta::<gst::Meta>().count(), MAX_METAS_PER_FRAME);
    }

    #[test]
    fn metas_beyond_the_payload_limit_are_left_out_by_name() {
        gst::init().unwrap();
        gst::meta::CustomMeta::register_simple("gpushm-test-big");
        let mut b = gst::Buffer::with_size(16).unwrap();
        {
            let bm = b.get_mut().unwrap();
            let mut m = gst::meta::CustomMeta::add(bm, "gpushm-test-big").unwrap();
            m.mut_structure().set("blob", "x".repeat(MAX_METAS_PAYLOAD));
        }
        let (p, left) = encode(&b);
        assert!(p.is_none());
        assert_eq!(left, ["gpushm-test-big"]);
    }
}
