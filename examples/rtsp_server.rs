// SPDX-License-Identifier: MPL-2.0
//! Re-exports gpushm streams over RTSP with GStreamer's own RTSP server (gst-rtsp-server):
//! each encoded H.264 stream shared through gpushm becomes rtsp://ADDRESS:PORT/NAME, read by
//! any RTSP client (VLC, ffplay, `rtspsrc`). Clients of one stream share one gpushmsrc.
//!
//!     cargo run --release --example rtsp_server -- --port 8554 enc
//!     gst-launch-1.0 rtspsrc location=rtsp://127.0.0.1:8554/enc ! rtph264depay ! h264parse ! avdec_h264 ! autovideosink
//!
//! Options: --port N (8554), --address A (0.0.0.0), then the stream names (gpushmsink
//! stream=NAME, carrying video/x-h264). Prints `READY rtsp://...` for each once it serves.
//! Needs libgstrtspserver-1.0 (Debian: libgstrtspserver-1.0-dev to build).

use gst::glib;
use gst_rtsp_server::prelude::*;

fn main() {
    let mut port = 8554u16;
    let mut address = "0.0.0.0".to_string();
    let mut streams = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--port" => {
                port = args
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--address" => address = args.next().unwrap_or_else(|| usage()),
            s if !s.starts_with('-') => streams.push(s.to_string()),
            _ => usage(),
        }
    }
    if streams.is_empty() {
        usage();
    }
    gst::init().expect("gst::init");
    let main_loop = glib::MainLoop::new(None, false);
    let server = gst_rtsp_server::RTSPServer::new();
    server.set_address(&address);
    server.set_service(&port.to_string());
    let mounts = server.mount_points().expect("mount points");
    for name in &streams {
        if let Err(e) = gpushm::names::check_name(name) {
            eprintln!("rtsp_server: {e}");
            std::process::exit(2);
        }
        let factory = gst_rtsp_server::RTSPMediaFactory::new();
        // reconnect: a producer restarted keeps its RTSP clients; config-interval: a client
        // joining late gets SPS/PPS with the next keyframe.
        factory.set_launch(&format!(
            "( gpushmsrc stream={name} reconnect=true ! h264parse config-interval=-1 ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
        ));
        factory.set_shared(true);
        mounts.add_factory(&format!("/{name}"), factory);
    }
    let _id = server.attach(None).unwrap_or_else(|e| {
        eprintln!("rtsp_server: cannot serve {address}:{port}: {e}");
        std::process::exit(1);
    });
    for name in &streams {
        println!("READY rtsp://{address}:{}/{name}", server.bound_port());
    }
    main_loop.run();
}

fn usage() -> ! {
    eprintln!("usage: rtsp_server [--port 8554] [--address 0.0.0.0] STREAM...");
    std::process::exit(2);
}
