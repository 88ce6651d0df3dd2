// SPDX-License-Identifier: MPL-2.0
//! The smallest app that receives frames with the GStreamer elements: the plugin linked
//! statically, `gpushmsrc ! appsink`, no caps given (they come from the producer). Prints one
//! line per frame. With any producer running, e.g.
//!
//!     gst-launch-1.0 videotestsrc is-live=true ! video/x-raw,width=640,height=480 ! gpushmsink socket-path=/tmp/cam
//!     cargo run --release --example app_consumer -- /tmp/cam 100
//!
//! Each sample's buffer points into the producer's ring: it stays valid, and the producer does
//! not reuse its slot, until the sample is dropped.

use gst::prelude::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().ok_or("usage: app_consumer SOCKET [FRAMES]")?;
    let frames: u64 = args.next().map_or(Ok(100), |n| n.parse())?;

    gst::init()?;
    gstgpushm::plugin_register_static()?;
    let src = gst::ElementFactory::make("gpushmsrc")
        .property("socket-path", &socket)
        .build()?;
    let sink = gst_app::AppSink::builder().sync(false).build();
    let pipeline = gst::Pipeline::new();
    pipeline.add_many([&src, sink.upcast_ref()])?;
    src.link(&sink)?;
    pipeline.set_state(gst::State::Playing)?;

    let mut result = Ok(());
    for n in 0..frames {
        let sample = match sink.pull_sample() {
            Ok(s) => s,
            Err(_) => {
                // EOS or an error: the bus says which.
                let bus = pipeline.bus().expect("a pipeline has a bus");
                if let Some(m) = bus.pop_filtered(&[gst::MessageType::Error]) {
                    if let gst::MessageView::Error(e) = m.view() {
                        result = Err(format!("{} ({:?})", e.error(), e.debug()).into());
                    }
                }
                break;
            }
        };
        let (Some(buffer), Some(caps)) = (sample.buffer(), sample.caps()) else {
            continue;
        };
        let info = gst_video::VideoInfo::from_caps(caps)?;
        let map = buffer.map_readable()?;
        let mean = map.iter().map(|&b| b as u64).sum::<u64>() / map.len().max(1) as u64;
        println!(
            "frame {n}: {:?} {}x{} pts {} bytes {} mean byte {mean}",
            info.format(),
            info.width(),
            info.height(),
            buffer.pts().display(),
            map.len()
        );
    }
    pipeline.set_state(gst::State::Null)?;
    result
}
