// SPDX-License-Identifier: MPL-2.0
//! The full run's plot (`bench --plot bench.png`).

/// One line of the table, kept for the plot.
pub struct Row {
    pub size: usize,
    pub copy: bool,
    pub transport: &'static str,
    pub percent: f64,
    pub p50: f64,
    pub p99: f64,
}

/// Latency (p50 solid, p99 dashed) and delivered fps per transport, per size.
pub fn plot(rows: &[Row], path: &str, title: &str) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let sizes = ["720p", "1080p", "4K"];
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let (left, right) = root.split_horizontally(700);
    let colour = |t: &str| match t {
        "gpushm" => RGBColor(0, 114, 178),
        "shm" => RGBColor(213, 94, 0),
        _ => RGBColor(0, 158, 115),
    };
    let ymax = rows
        .iter()
        .filter(|r| !r.copy)
        .map(|r| r.p99)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.15;
    let mut c = ChartBuilder::on(&left)
        .caption("latency at 30 fps live, pool mode (µs)", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(-0.3f64..2.3f64, 0f64..ymax)?;
    c.configure_mesh()
        .x_labels(3)
        .x_label_formatter(&|x| {
            sizes
                .get(x.round() as usize)
                .map_or(String::new(), |s| s.to_string())
        })
        .y_desc("µs")
        .draw()?;
    let mut transports: Vec<&str> = rows.iter().map(|r| r.transport).collect();
    transports.dedup();
    transports.sort();
    transports.dedup();
    for t in &transports {
        let pts = |f: &dyn Fn(&Row) -> f64| -> Vec<(f64, f64)> {
            rows.iter()
                .filter(|r| r.transport == *t && !r.copy)
                .map(|r| (r.size as f64, f(r)))
                .collect()
        };
        let col = colour(t);
        c.draw_series(LineSeries::new(pts(&|r| r.p50), col.stroke_width(3)))?
            .label(format!("{t} p50"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(3)));
        c.draw_series(LineSeries::new(pts(&|r| r.p99), col.stroke_width(1)))?
            .label(format!("{t} p99"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(1)));
        c.draw_series(
            pts(&|r| r.p50)
                .into_iter()
                .map(|p| Circle::new(p, 4, col.filled())),
        )?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    let mut c = ChartBuilder::on(&right)
        .caption(
            "delivered fps, % of the producer alone (flat out)",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(-0.3f64..2.3f64, 0f64..125f64)?;
    c.configure_mesh()
        .x_labels(3)
        .x_label_formatter(&|x| {
            sizes
                .get(x.round() as usize)
                .map_or(String::new(), |s| s.to_string())
        })
        .y_desc("%")
        .draw()?;
    for t in &transports {
        for copy in [false, true] {
            let col = colour(t);
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.transport == *t && r.copy == copy)
                .map(|r| (r.size as f64, r.percent))
                .collect();
            let w = if copy { 1 } else { 3 };
            c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(w)))?
                .label(format!("{t} {}", if copy { "copy" } else { "pool" }))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(w))
                });
            c.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, col.filled())))?;
        }
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}
