// SPDX-License-Identifier: MPL-2.0
//! Metas beyond the video meta, the time code and the reference timestamps travel with their
//! frame to consumer processes: `GstCustomMeta`s (GStreamer 1.20+), as unixfdsink carries the
//! metas it can serialize (gst-plugins-bad `tests/check/elements/unixfd.c` checks a
//! GstReferenceTimestampMeta and a custom meta on each buffer).

mod common;
use common::*;

use std::time::Duration;

use gst::prelude::*;

/// A producer in this process (appsrc) puts a custom meta `gpushm-roi` (x, y, a label) on
/// frames 0, 2 and 5 of 10 (frame 0's were lost before: sent before the wait for the first
/// consumer), a 70 KiB one on frame 7 and one named like GStreamer's own
/// (`GstEvilMeta`) on frame 5; a consumer process prints the custom metas of each frame:
/// frames 0, 2 and 5 carry `gpushm-roi`, with every field, no other frame has one, frame 7 arrives
/// without its oversized meta, the Gst-named one is not registered in the consumer (a producer
/// must not take GStreamer's names there), and every frame arrives. Frame 3 carries two
/// GstReferenceTimestampMetas (UNIX and NTP times), which arrive on frame 3 with their times
/// and caps. Before, neither kind reached a consumer.
#[test]
fn custom_metas_and_reference_timestamps_reach_the_consumer_with_their_frame() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("metas.sock");
    let p = gst::parse::launch(&format!(
        "appsrc name=src format=time caps=video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
         ! gpushmsink socket-path={} wait-for-connection=true sync=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let src = p
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--print",
        "--lossless",
        "--frames",
        "10",
    ]);
    let consumer = Proc::spawn(c, "consumer");
    gst::meta::CustomMeta::register_simple("gpushm-roi");
    gst::meta::CustomMeta::register_simple("gpushm-huge");
    gst::meta::CustomMeta::register_simple("GstEvilMeta");
    for i in 0..10u64 {
        let mut b = gst::Buffer::from_mut_slice(vec![i as u8; 64 * 48]);
        {
            let bm = b.get_mut().unwrap();
            bm.set_pts(gst::ClockTime::from_mseconds(i * 33));
            bm.set_duration(gst::ClockTime::from_mseconds(33));
            bm.set_offset(i);
            if i == 0 || i == 2 || i == 5 {
                let mut m = gst::meta::CustomMeta::add(bm, "gpushm-roi").unwrap();
                m.mut_structure().set("x", i as i32 * 10);
                m.mut_structure().set("y", 7i32);
                m.mut_structure().set("label", format!("face {i}"));
            }
            if i == 5 {
                let mut m = gst::meta::CustomMeta::add(bm, "GstEvilMeta").unwrap();
                m.mut_structure().set("n", 1i32);
            }
            if i == 3 {
                // A camera's wall-clock time and an RTP source's NTP time.
                let unix = gst::Caps::new_empty_simple("timestamp/x-unix");
                let ntp = gst::Caps::builder("timestamp/x-ntp")
                    .field("host", "cam.local")
                    .build();
                gst::ReferenceTimestampMeta::add(
                    bm,
                    &unix,
                    gst::ClockTime::from_seconds(1_790_000_000),
                    None,
                );
                gst::ReferenceTimestampMeta::add(
                    bm,
                    &ntp,
                    gst::ClockTime::from_nseconds(3_999_999_999),
                    Some(gst::ClockTime::from_mseconds(33)),
                );
            }
            if i == 7 {
                let mut m = gst::meta::CustomMeta::add(bm, "gpushm-huge").unwrap();
                m.mut_structure().set("blob", "x".repeat(70 * 1024));
            }
        }
        src.push_buffer(b).unwrap();
    }
    src.end_of_stream().unwrap();
    let msg = p.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    p.set_state(gst::State::Null).unwrap();
    assert!(matches!(
        msg.map(|m| m.type_()),
        Some(gst::MessageType::Eos)
    ));
    let (st, out) = consumer.finish(Duration::from_secs(30));
    assert!(st.success(), "{out:?}");
    let metas: Vec<&String> = out.iter().filter(|l| l.starts_with("META ")).collect();
    assert_eq!(metas.len(), 3, "{out:#?}");
    for (line, i) in metas.iter().zip([0, 2, 5]) {
        assert!(
            line.starts_with(&format!("META n={i} gpushm-roi ")),
            "{line}"
        );
        assert!(line.contains(&format!("x=(int){}", i * 10)), "{line}");
        assert!(line.contains("y=(int)7"), "{line}");
        assert!(
            line.contains(&format!("label=(string)\"face\\ {i}\"")),
            "{line}"
        );
    }
    // Reference timestamps on frame 3 only, both, in order; the consumer's own publish time
    // is not printed (it is on every frame).
    let refts: Vec<&String> = out.iter().filter(|l| l.starts_with("REFTS ")).collect();
    assert_eq!(
        refts,
        [
            "REFTS n=3 1790000000000000000 - timestamp/x-unix",
            "REFTS n=3 3999999999 33000000 timestamp/x-ntp, host=(string)cam.local",
        ],
        "{out:#?}"
    );
    let s = fields(&out, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 10.0, "{out:?}");
}
