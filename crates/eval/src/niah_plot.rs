//! The needle test's heat maps (plotters, SVG): one panel per cache form,
//! prompt length down, needle depth across, a found cell green and a missed
//! one red.

use std::path::Path;

use plotters::prelude::*;

use crate::niah::NiahReport;

/// Draws the report's grids side by side into `path`.
pub(crate) fn heat_maps(
    report: &NiahReport,
    path: &Path,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let panels = report.grids.len().max(1);
    let (nd, nl) = (report.depths.len(), report.lengths.len());
    let root = SVGBackend::new(path, (340 * panels as u32, 320)).into_drawing_area();
    root.fill(&WHITE)?;
    let found = RGBColor(46, 160, 67);
    let missed = RGBColor(214, 69, 65);
    for (area, grid) in root.split_evenly((1, panels)).iter().zip(&report.grids) {
        let title = format!("{}: {} of {}", grid.form, grid.found, grid.cells.len());
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..nd as f64, 0.0..nl as f64)?;
        let depths = report.depths.clone();
        let lengths = report.lengths.clone();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("needle depth")
            .y_desc("prompt tokens")
            .x_labels(nd)
            .y_labels(nl)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                depths.get(i).map_or(String::new(), |d| format!("{d}"))
            })
            .y_label_formatter(&|y| {
                let i = y.floor() as usize;
                lengths.get(i).map_or(String::new(), |l| l.to_string())
            })
            .draw()?;
        chart.draw_series(grid.cells.iter().enumerate().map(|(i, c)| {
            let (row, col) = (i / nd, i % nd);
            let color = if c.found { found } else { missed };
            Rectangle::new(
                [
                    (col as f64 + 0.03, row as f64 + 0.03),
                    (col as f64 + 0.97, row as f64 + 0.97),
                ],
                color.filled(),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}
