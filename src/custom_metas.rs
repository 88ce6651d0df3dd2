// SPDX-License-Identifier: MPL-2.0
//! The metas of a buffer that the ring has no field for, as they travel from gpushmsink to
//! gpushmsrc with their frame (the core's FrameMetas message): `GstCustomMeta`s (GStreamer
//! 1.20+), each a registered name and a structure. The video meta, the time code and the
//! reference timestamps travel in the ring's own fields; GpuShmCudaMeta points into this
//! process and stays home.
//!
//! A payload is one line per meta: `c NAME STRUCTURE`. What a consumer reads comes from
//! another process: a line that does not parse, or a name that is not a custom meta here, is
//! left out (and said why), never a crash. A consumer registers a custom meta it does not know
//! yet, so that downstream finds it by name, up to [`MAX_REGISTERED`] names per process.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A payload is at most this long: a whole message is at most [`gpushm::wire::MAX_PAYLOAD`].
pub const MAX_METAS_PAYLOAD: usize = gpushm::wire::MAX_PAYLOAD as usize - 64;

/// Custom meta names a consumer process registers at most (a producer names them; the
/// registry keeps them for the life of the process).
pub const MAX_REGISTERED: usize = 64;

static REGISTERED: AtomicUsize = AtomicUsize::new(0);

/// The payload for `buffer`'s custom metas, `None` if it has none. Metas that would make it
/// longer than [`MAX_METAS_PAYLOAD`] are left out, and named in the second value.
pub fn encode(buffer: &gst::BufferRef) -> (Option<String>, Vec<String>) {
    let mut out = String::new();
    let mut left_out = Vec::new();
    for m in buffer.iter_meta::<gst::Meta>() {
        let Some(c) = m.try_as_custom_meta() else {
            continue;
        };
        let name = m.type_().name();
        let line = format!("c {name} {}\n", c.structure());
        if out.len() + line.len() > MAX_METAS_PAYLOAD {
            left_out.push(name.to_string());
            continue;
        }
        out.push_str(&line);
    }
    ((!out.is_empty()).then_some(out), left_out)
}

/// Adds the metas of `payload` to `buffer`. Returns why each one left out was.
pub fn apply(payload: &str, buffer: &mut gst::BufferRef) -> Vec<String> {
    let mut why = Vec::new();
    for line in payload.lines().filter(|l| !l.is_empty()) {
        if let Err(e) = apply_line(line, buffer) {
            why.push(e);
        }
    }
    why
}

fn apply_line(line: &str, buffer: &mut gst::BufferRef) -> Result<(), String> {
    let cut = |s: &str| gpushm::wire::cut_str(s, 60).to_string();
    let rest = line
        .strip_prefix("c ")
        .ok_or_else(|| format!("a meta of an unknown kind: {}", cut(line)))?;
    let (name, body) = rest
        .split_once(' ')
        .ok_or_else(|| format!("a custom meta without its structure: {}", cut(rest)))?;
    let s = gst::Structure::from_str(body)
        .map_err(|_| format!("custom meta {} whose structure does not parse", cut(name)))?;
    if !gst::meta::CustomMeta::is_registered(name) {
        // GStreamer's own names are left to GStreamer: registered here as a custom meta
        // first, a library's meta of that name (GstVideoMeta) could not register after.
        if !valid_type_name(name) || name.to_ascii_lowercase().starts_with("gst") {
            return Err(format!(
                "custom meta {}: not a name a producer may register",
                cut(name)
            ));
        }
        if REGISTERED.fetch_add(1, Ordering::Relaxed) >= MAX_REGISTERED {
            return Err(format!(
                "custom meta {}: this process registered {MAX_REGISTERED} custom metas from producers already",
                cut(name)
            ));
        }
        gst::meta::CustomMeta::register_simple(name);
    }
    // A name registered here as another kind of meta is not a custom one.
    if !is_custom(name) {
        return Err(format!(
            "{} is not a custom meta in this process",
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

/// Whether `name` can name a GType (what a meta's registration makes) that is not one
/// already: letters, digits and `-_+`, starting with a letter or `_`, 3 to 128 long.
fn valid_type_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() >= 3
        && name.len() <= 128
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || "-_+".contains(c))
        && gst::glib::Type::from_name(name).is_none()
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
    fn a_buffer_without_custom_metas_sends_nothing() {
        gst::init().unwrap();
        let mut b = gst::Buffer::with_size(16).unwrap();
        gst::ReferenceTimestampMeta::add(
            b.get_mut().unwrap(),
            &gst::Caps::new_empty_simple("timestamp/x-test"),
            gst::ClockTime::SECOND,
            None,
        );
        assert!(encode(&b).0.is_none());
    }

    #[test]
    fn what_a_producer_may_send_is_left_out_not_a_crash() {
        gst::init().unwrap();
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
            "c 9bad-name x, n=(int)1;",
        ];
        for line in bad {
            let why = apply(line, b.get_mut().unwrap());
            assert_eq!(why.len(), 1, "{line:?} was taken");
        }
        assert_eq!(b.iter_meta::<gst::Meta>().count(), 0);
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
