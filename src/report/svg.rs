//! SVG heat map of error over layer × check (metric ÷ tolerance, log scale), one panel per mode.
//! Text needs a font: DejaVu Sans ships in assets/fonts so that no system font library is linked.

use super::Report;
use crate::error::{Error, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Colour of a ratio: green (≪ tolerance) → yellow (at 1/10) → red (≥ tolerance); purple for non-finite.
fn color(ratio: f64) -> RGBColor {
    if !ratio.is_finite() {
        return RGBColor(110, 0, 140);
    }
    if ratio >= 1.0 {
        let t = (ratio.log10() / 3.0).clamp(0.0, 1.0);
        return RGBColor(
            (220.0 - 80.0 * t) as u8,
            (40.0 - 40.0 * t) as u8,
            (40.0 - 40.0 * t) as u8,
        );
    }
    // log10 ratio in [-4, 0) → 0..1
    let t = ((ratio.max(1e-4).log10() + 4.0) / 4.0).clamp(0.0, 1.0);
    RGBColor(
        (40.0 + 215.0 * t) as u8,
        (170.0 + 50.0 * (1.0 - (t - 0.75).abs() * 4.0).max(0.0)) as u8,
        (90.0 - 60.0 * t) as u8,
    )
}

pub fn render(r: &Report) -> Result<String> {
    register();
    let modes: Vec<_> = r.modes.iter().filter(|m| !m.layers.is_empty()).collect();
    let n_checks = modes.first().map(|m| m.layers[0].checks.len()).unwrap_or(0);
    let n_layers = modes.first().map(|m| m.layers.len()).unwrap_or(0);
    let (w, panel_h) = (
        160 + 70 * n_checks as u32,
        150 + 22 * n_layers.max(1) as u32,
    );
    let mut buf = String::new();
    {
        let root =
            SVGBackend::with_string(&mut buf, (w.max(600), panel_h * modes.len().max(1) as u32))
                .into_drawing_area();
        let err =
            |e: &dyn std::fmt::Display| Error::Environment(format!("drawing the heat map: {e}"));
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let panels = root.split_evenly((modes.len().max(1), 1));
        for (m, area) in modes.iter().zip(panels.iter()) {
            let names: Vec<String> = m.layers[0].checks.iter().map(|c| c.check.clone()).collect();
            let layers: Vec<usize> = m.layers.iter().map(|l| l.layer).collect();
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{} — {} mode, {} ({}): error ÷ tolerance",
                        r.file.path, m.mode, r.run.backend, r.run.dtype
                    ),
                    ("sans-serif", 15),
                )
                .margin(8)
                .x_label_area_size(70)
                .y_label_area_size(60)
                .build_cartesian_2d(0f64..names.len() as f64, 0f64..layers.len() as f64)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_labels(names.len() * 2 + 1)
                .y_labels(layers.len() * 2 + 1)
                .x_label_formatter(&|x| {
                    let i = x.floor() as usize;
                    if (x - i as f64 - 0.5).abs() < 1e-6 {
                        names.get(i).cloned().unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .y_label_formatter(&|y| {
                    let i = y.floor() as usize;
                    if (y - i as f64 - 0.5).abs() < 1e-6 {
                        layers
                            .get(i)
                            .map(|l| format!("layer {l}"))
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .x_label_style(
                    ("sans-serif", 10)
                        .into_font()
                        .transform(FontTransform::Rotate90),
                )
                .y_label_style(("sans-serif", 11))
                .draw()
                .map_err(|e| err(&e))?;
            for (yi, l) in m.layers.iter().enumerate() {
                for (xi, c) in l.checks.iter().enumerate() {
                    let ratio = c.ratio();
                    let (x, y) = (xi as f64, yi as f64);
                    chart
                        .draw_series(std::iter::once(Rectangle::new(
                            [(x + 0.03, y + 0.05), (x + 0.97, y + 0.95)],
                            color(ratio).filled(),
                        )))
                        .map_err(|e| err(&e))?;
                    let label = if ratio.is_finite() {
                        format!("{ratio:.2}")
                    } else {
                        "NaN".into()
                    };
                    chart
                        .draw_series(std::iter::once(Text::new(
                            label,
                            (x + 0.3, y + 0.65),
                            ("sans-serif", 10).into_font().color(&BLACK),
                        )))
                        .map_err(|e| err(&e))?;
                }
            }
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(buf)
}
