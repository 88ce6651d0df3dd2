// SPDX-License-Identifier: MPL-2.0
//! The events of a producer's stream that travel to its consumers, in order with its frames:
//! tags (stream and global scope) and serialized custom events. gpushmsink encodes each into
//! the payload of an Event message ([`gpushm::wire`]) and gpushmsrc decodes it back; the core
//! carries the payload without looking into it.
//!
//! A payload is one line naming the kind, a newline, and the event's tag list or structure in
//! GStreamer's string form: `tag stream\ntaglist, title=(string)hello;`. What a consumer reads
//! comes from another process: a payload that does not parse is an error for that event
//! (gpushmsrc warns and goes on without it), never a crash.

use std::str::FromStr;

use gst::glib::translate::{from_glib_full, ToGlibPtr};

/// Payloads longer than this are not sent: a whole Event message is at most
/// [`gpushm::wire::MAX_PAYLOAD`] bytes.
pub const MAX_EVENT_PAYLOAD: usize = gpushm::wire::MAX_PAYLOAD as usize - 64;

/// An event ready to send: its payload, and the key under which the producer keeps it for
/// consumers that join later (the latest event of each key), if it is sticky.
pub struct Encoded {
    pub payload: String,
    pub sticky_key: Option<String>,
}

/// What goes to consumers of `event`: `None` for events that do not travel (stream-start,
/// caps, segment, EOS and flushes are each consumer's own; out-of-band events have no place
/// in the frames' order). `Err` when it should but cannot (too large).
pub fn encode(event: &gst::EventRef) -> Option<Result<Encoded, String>> {
    let (head, body, sticky_key) = match event.view() {
        gst::EventView::Tag(t) => {
            let tags = t.tag();
            let scope = match tags.scope() {
                gst::TagScope::Global => "global",
                _ => "stream",
            };
            (
                format!("tag {scope}"),
                tags.to_string(),
                Some(format!("tag-{scope}")),
            )
        }
        gst::EventView::CustomDownstream(_)
        | gst::EventView::CustomBoth(_)
        | gst::EventView::CustomDownstreamSticky(_) => {
            let s = event.structure()?;
            let kind = match event.type_() {
                gst::EventType::CustomDownstream => "custom-downstream",
                gst::EventType::CustomBoth => "custom-both",
                _ => "custom-downstream-sticky",
            };
            let key = (event.type_() == gst::EventType::CustomDownstreamSticky)
                .then(|| format!("sticky {}", s.name()));
            (kind.to_string(), s.to_string(), key)
        }
        _ => return None,
    };
    let payload = format!("{head}\n{body}");
    if payload.len() > MAX_EVENT_PAYLOAD {
        return Some(Err(format!(
            "a {} event of {} bytes, over the {MAX_EVENT_PAYLOAD}-byte limit",
            event.type_().name(),
            payload.len()
        )));
    }
    Some(Ok(Encoded {
        payload,
        sticky_key,
    }))
}

/// What goes to the producer of a consumer's upstream `event`: custom upstream events
/// (force-key-unit is one) and custom-both ones; `None` for the rest (seeks, QoS, latency,
/// navigation and reconfigure are this pipeline's own).
pub fn encode_upstream(event: &gst::EventRef) -> Option<Result<String, String>> {
    let kind = match event.type_() {
        gst::EventType::CustomUpstream => "custom-upstream",
        gst::EventType::CustomBoth => "custom-both",
        _ => return None,
    };
    let body = event.structure()?.to_string();
    let payload = format!("{kind}\n{body}");
    if payload.len() > MAX_EVENT_PAYLOAD {
        return Some(Err(format!(
            "a {kind} event of {} bytes, over the {MAX_EVENT_PAYLOAD}-byte limit",
            payload.len()
        )));
    }
    Some(Ok(payload))
}

/// The upstream event a consumer's payload encodes: only those [`encode_upstream`] makes are
/// taken (a consumer may send anything).
pub fn decode_upstream(payload: &str) -> Result<gst::Event, String> {
    let e = decode(payload)?;
    match e.type_() {
        gst::EventType::CustomUpstream | gst::EventType::CustomBoth => Ok(e),
        t => Err(format!(
            "a {} event is not one a consumer may send upstream",
            t.name()
        )),
    }
}

/// The request for a keyframe (with its headers) a consumer sends upstream when it joins an
/// encoded stream between keyframes.
pub fn force_key_unit() -> String {
    let e = gst_video::UpstreamForceKeyUnitEvent::builder()
        .all_headers(true)
        .build();
    encode_upstream(&e)
        .and_then(Result::ok)
        .expect("force-key-unit is a small custom upstream event")
}

/// The event a payload encodes.
pub fn decode(payload: &str) -> Result<gst::Event, String> {
    let (head, body) = payload
        .split_once('\n')
        .ok_or_else(|| "an event payload without its kind line".to_string())?;
    let structure = || {
        gst::Structure::from_str(body)
            .map_err(|_| format!("a {head} event whose structure does not parse"))
    };
    Ok(match head {
        "tag stream" | "tag global" => {
            let mut tags = tag_list_from_str(body)
                .ok_or_else(|| "a tag event whose tag list does not parse".to_string())?;
            let scope = match head {
                "tag global" => gst::TagScope::Global,
                _ => gst::TagScope::Stream,
            };
            tags.make_mut().set_scope(scope);
            gst::event::Tag::new(tags)
        }
        "custom-downstream" => gst::event::CustomDownstream::new(structure()?),
        "custom-upstream" => gst::event::CustomUpstream::new(structure()?),
        "custom-both" => gst::event::CustomBoth::new(structure()?),
        "custom-downstream-sticky" => gst::event::CustomDownstreamSticky::new(structure()?),
        other => {
            return Err(format!(
                "an event of unknown kind '{}'",
                gpushm::wire::cut_str(other, 40)
            ))
        }
    })
}

/// The tag list `s` (as `gst::TagList`'s Display writes it) describes, if it parses.
fn tag_list_from_str(s: &str) -> Option<gst::TagList> {
    // GStreamer asserts the prefix (a g_critical, fatal under G_DEBUG=fatal-criticals): a
    // peer's text without it is refused here instead.
    if !s.starts_with("taglist") {
        return None;
    }
    // SAFETY: a NUL-terminated copy of `s`; the function returns a new tag list (full
    // transfer) or NULL.
    unsafe {
        let l = gst::ffi::gst_tag_list_new_from_string(s.to_glib_none().0);
        (!l.is_null()).then(|| from_glib_full(l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(e: gst::Event) -> gst::Event {
        let enc = encode(&e).expect("travels").expect("encodes");
        decode(&enc.payload).expect("decodes")
    }

    #[test]
    fn tags_keep_their_scope_and_values() {
        gst::init().unwrap();
        for scope in [gst::TagScope::Stream, gst::TagScope::Global] {
            let mut tags = gst::TagList::new();
            {
                let t = tags.get_mut().unwrap();
                t.add::<gst::tags::Title>(&"hello, \"world\"", gst::TagMergeMode::Append);
                t.add::<gst::tags::LanguageCode>(&"fr", gst::TagMergeMode::Append);
                t.add::<gst::tags::Bitrate>(&128000, gst::TagMergeMode::Append);
                t.set_scope(scope);
            }
            let e = round_trip(gst::event::Tag::new(tags.clone()));
            let gst::EventView::Tag(t) = e.view() else {
                panic!("not a tag event: {e:?}");
            };
            assert_eq!(t.tag().scope(), scope);
            assert_eq!(t.tag().to_string(), tags.to_string());
        }
    }

    #[test]
    fn custom_events_keep_their_kind_and_structure() {
        gst::init().unwrap();
        let s = gst::Structure::builder("my-marker")
            .field("n", 7i32)
            .field("label", "a b;c")
            .build();
        for e in [
            gst::event::CustomDownstream::new(s.clone()),
            gst::event::CustomBoth::new(s.clone()),
            gst::event::CustomDownstreamSticky::new(s.clone()),
        ] {
            let back = round_trip(e.clone());
            assert_eq!(back.type_(), e.type_());
            assert_eq!(back.structure().unwrap().to_string(), s.to_string());
        }
    }

    #[test]
    fn upstream_events_round_trip_and_nothing_else_goes_up() {
        gst::init().unwrap();
        let fku = decode_upstream(&force_key_unit()).unwrap();
        assert!(gst_video::UpstreamForceKeyUnitEvent::parse(&fku).is_ok_and(|f| f.all_headers));
        let s = gst::Structure::builder("ask").field("n", 1i32).build();
        let back = decode_upstream(
            &encode_upstream(&gst::event::CustomBoth::new(s.clone()))
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(back.type_(), gst::EventType::CustomBoth);
        assert!(encode_upstream(&gst::event::Reconfigure::new()).is_none());
        // Downstream kinds sent by a consumer are refused.
        let down = encode(&gst::event::CustomDownstream::new(s))
            .unwrap()
            .unwrap();
        assert!(decode_upstream(&down.payload).is_err());
        assert!(decode_upstream("tag stream\ntaglist, title=(string)x;").is_err());
    }

    #[test]
    fn stream_events_and_out_of_band_ones_stay_home() {
        gst::init().unwrap();
        let s = gst::Structure::new_empty("x");
        assert!(encode(&gst::event::Eos::new()).is_none());
        assert!(encode(&gst::event::StreamStart::new("s")).is_none());
        assert!(encode(&gst::event::CustomDownstreamOob::new(s)).is_none());
    }

    #[test]
    fn what_a_peer_may_send_is_an_error_not_a_crash() {
        gst::init().unwrap();
        for bad in [
            "",
            "tag stream",
            "tag stream\nnot a taglist ((",
            "custom-both\n,,,",
            "flush-start\nx;",
            "custom-downstream\n\u{0}\u{1}",
        ] {
            assert!(decode(bad).is_err(), "{bad:?} decoded");
        }
    }

    #[test]
    fn an_event_too_large_is_refused_with_its_size() {
        gst::init().unwrap();
        let s = gst::Structure::builder("big")
            .field("blob", "x".repeat(MAX_EVENT_PAYLOAD))
            .build();
        let err = encode(&gst::event::CustomDownstream::new(s))
            .unwrap()
            .err()
            .unwrap();
        assert!(err.contains("limit"), "{err}");
    }
}
