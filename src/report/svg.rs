//! SVG heat map of error over layer × check (metric ÷ tolerance, log scale), one panel per mode.
//! Text needs a font: DejaVu Sans ships in assets/fonts so that no system font library is linked.

use super::Report;
use crate::error::{Error, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
        // Metrics of the bold label come from the regular face; the viewer draws it bold.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, FONT);
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

/// The colour bar's range (log10 of error ÷ tolerance): 1e-4 (green) to 1e3 (dark red).
const BAR_LO: f64 = -4.0;
const BAR_HI: f64 = 3.0;

/// Geometry, in pixels.
const CELL_W: i32 = 58;
const CELL_H: i32 = 24;
const TITLE_H: i32 = 52;
const BAR_W: i32 = 18;

fn font(size: f64) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK)
}

fn cell_label(ratio: f64) -> String {
    if !ratio.is_finite() {
        "NaN".into()
    } else if ratio >= 100.0 {
        format!("{ratio:.0e}")
    } else if ratio >= 10.0 {
        format!("{ratio:.0}")
    } else {
        format!("{ratio:.2}")
    }
}

/// The heat map: per mode, layers down the rows and checks across the columns in dataflow order, each
/// cell the worst metric ÷ its tolerance (≥ 1 fails: red, outlined); a log colour bar with 1 (the
/// tolerance) marked. The title names the file by its base name only.
pub fn render(r: &Report) -> Result<String> {
    register();
    let modes: Vec<_> = r.modes.iter().filter(|m| !m.layers.is_empty()).collect();
    let names: Vec<String> = modes
        .first()
        .map(|m| m.layers[0].checks.iter().map(|c| c.check.clone()).collect())
        .unwrap_or_default();
    let err = |e: &dyn std::fmt::Display| Error::Environment(format!("drawing the heat map: {e}"));
    let lay = Layout::new(&modes, &names);
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (lay.width as u32, lay.height as u32))
            .into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut y0 = 0;
        for (m, &ph) in modes.iter().zip(&lay.panel_h) {
            panel(&root, r, m, &names, &lay, y0, ph).map_err(|e| err(&e))?;
            y0 += ph;
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(buf)
}

/// The picture's geometry, from the text extents of the shipped font so that no label is cut off.
struct Layout {
    /// Left of the grid: axis title, layer numbers, gap.
    left: i32,
    grid_w: i32,
    width: i32,
    height: i32,
    /// Each mode panel's height: title, a row per layer, the rotated check labels and axis title.
    panel_h: Vec<i32>,
}

impl Layout {
    fn new(modes: &[&super::ModeResult], names: &[String]) -> Layout {
        let label_font = font(13.0);
        let longest_check = names
            .iter()
            .map(|n| text_w(n, &label_font))
            .max()
            .unwrap_or(0);
        let max_layer = modes
            .iter()
            .flat_map(|m| m.layers.iter().map(|l| l.layer))
            .max()
            .unwrap_or(0);
        let layer_w = text_w(&max_layer.to_string(), &label_font);
        let left = 30 + layer_w + 12; // axis title, numbers, gap
        let bottom = 10 + longest_check + 34; // gap, rotated labels, axis title
        let n_cols = names.len() as i32;
        let grid_w = CELL_W * n_cols.max(1);
        let bar_area = 150;
        let width = (left + grid_w + bar_area).max(560);
        let panel_h: Vec<i32> = modes
            .iter()
            .map(|m| TITLE_H + CELL_H * m.layers.len() as i32 + bottom)
            .collect();
        let height = panel_h.iter().sum::<i32>().max(200);
        Layout {
            left,
            grid_w,
            width,
            height,
            panel_h,
        }
    }
}

fn text_w(t: &str, f: &TextStyle) -> i32 {
    plotters::style::FontDesc::box_size(&f.font, t)
        .map(|(w, _)| w as i32)
        .unwrap_or(8 * t.len() as i32)
}

type Drawn = std::result::Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// One mode's panel from `y0`: title and verdict, the layer × check grid, the check labels below it,
/// the axis titles and the colour bar.
fn panel(
    root: &Area,
    r: &Report,
    m: &super::ModeResult,
    names: &[String],
    lay: &Layout,
    y0: i32,
    ph: i32,
) -> Drawn {
    let (left, grid_w) = (lay.left, lay.grid_w);
    let label_font = font(13.0);
    let decides = r.decisive_mode() == Some(m.mode.as_str());
    let title = format!(
        "{}: {} mode{}, {} backend, {}",
        r.file.base_name(),
        m.mode,
        if decides {
            ""
        } else {
            " (drift, informational)"
        },
        r.run.backend,
        r.run.dtype
    );
    root.draw(&Text::new(title, (left, y0 + 10), font(17.0)))?;
    let verdict = if m.verdict.pass {
        "within tolerance".to_string()
    } else {
        format!(
            "first divergence: layer {}, {}",
            m.verdict
                .first_layer
                .map(|l| l.to_string())
                .unwrap_or_default(),
            m.verdict.first_check.as_deref().unwrap_or("?")
        )
    };
    root.draw(&Text::new(
        format!("cell = worst metric ÷ tolerance (≥ 1 fails); {verdict}"),
        (left, y0 + 31),
        font(13.0).color(&RGBColor(80, 80, 80)),
    ))?;
    let gy = y0 + TITLE_H;
    let rows = m.layers.len() as i32;
    // Rows: layers, top to bottom.
    for (yi, l) in m.layers.iter().enumerate() {
        let y = gy + CELL_H * yi as i32;
        root.draw(&Text::new(
            l.layer.to_string(),
            (left - 8, y + CELL_H / 2),
            label_font.pos(Pos::new(HPos::Right, VPos::Center)),
        ))?;
        for (xi, c) in l.checks.iter().enumerate() {
            grid_cell(root, left + CELL_W * xi as i32, y, c)?;
        }
    }
    // Columns: checks, labels read upwards below the grid.
    let gb = gy + CELL_H * rows;
    for (xi, n) in names.iter().enumerate() {
        let x = left + CELL_W * xi as i32 + CELL_W / 2;
        root.draw(&Text::new(
            n.clone(),
            (x, gb + 8),
            label_font
                .transform(FontTransform::Rotate270)
                .pos(Pos::new(HPos::Right, VPos::Center)),
        ))?;
    }
    root.draw(&Text::new(
        "stage (check), in dataflow order",
        (left + grid_w / 2, y0 + ph - 14),
        font(14.0).pos(Pos::new(HPos::Center, VPos::Center)),
    ))?;
    root.draw(&Text::new(
        "layer",
        (12, gy + CELL_H * rows / 2),
        font(14.0)
            .transform(FontTransform::Rotate270)
            .pos(Pos::new(HPos::Center, VPos::Center)),
    ))?;
    colour_bar(root, left + grid_w + 24, gy, (CELL_H * rows).max(180))
}

/// One check's cell at (x, y): its colour, a frame when it fails, its ratio.
fn grid_cell(root: &Area, x: i32, y: i32, c: &crate::compare::CheckResult) -> Drawn {
    let ratio = c.ratio();
    let fill = color(ratio);
    root.draw(&Rectangle::new(
        [(x + 1, y + 1), (x + CELL_W - 1, y + CELL_H - 1)],
        fill.filled(),
    ))?;
    if !c.pass {
        root.draw(&Rectangle::new(
            [(x + 1, y + 1), (x + CELL_W - 2, y + CELL_H - 2)],
            BLACK.stroke_width(2),
        ))?;
    }
    let dark = !ratio.is_finite() || ratio >= 1.0;
    root.draw(&Text::new(
        cell_label(ratio),
        (x + CELL_W / 2, y + CELL_H / 2),
        font(12.0)
            .color(if dark { &WHITE } else { &BLACK })
            .pos(Pos::new(HPos::Center, VPos::Center)),
    ))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A vertical log colour bar from 1e-4 (bottom) to 1e3 (top), 1 (the tolerance) marked by a line
/// across, and a swatch for non-finite values below it.
fn colour_bar(root: &Area, x: i32, top: i32, h: i32) -> Drawn {
    let bar_h = h - 40;
    let to_y = |lg: f64| top + ((BAR_HI - lg) / (BAR_HI - BAR_LO) * bar_h as f64).round() as i32;
    let steps = 70;
    for i in 0..steps {
        let lg0 = BAR_LO + (BAR_HI - BAR_LO) * i as f64 / steps as f64;
        let lg1 = BAR_LO + (BAR_HI - BAR_LO) * (i + 1) as f64 / steps as f64;
        root.draw(&Rectangle::new(
            [(x, to_y(lg1)), (x + BAR_W, to_y(lg0))],
            color(10f64.powf((lg0 + lg1) / 2.0)).filled(),
        ))?;
    }
    root.draw(&Rectangle::new(
        [(x, top), (x + BAR_W, top + bar_h)],
        BLACK.stroke_width(1),
    ))?;
    for lg in (BAR_LO as i32)..=(BAR_HI as i32) {
        let y = to_y(lg as f64);
        let one = lg == 0;
        root.draw(&PathElement::new(
            vec![(if one { x - 6 } else { x + BAR_W }, y), (x + BAR_W + 5, y)],
            BLACK.stroke_width(if one { 2 } else { 1 }),
        ))?;
        let label = match lg {
            0 => "1 = tolerance".to_string(),
            -1 => "0.1".into(),
            1 => "10".into(),
            2 => "100".into(),
            _ => format!("1e{lg}"),
        };
        let f = if one {
            ("sans-serif", 13.0, FontStyle::Bold)
                .into_font()
                .color(&BLACK)
        } else {
            font(12.0)
        };
        root.draw(&Text::new(
            label,
            (x + BAR_W + 8, y),
            f.pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    root.draw(&Text::new(
        "error ÷ tolerance",
        (x - 4, top - 12),
        font(12.0).pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    let sy = top + bar_h + 14;
    root.draw(&Rectangle::new(
        [(x, sy), (x + BAR_W, sy + 14)],
        color(f64::NAN).filled(),
    ))?;
    root.draw(&Text::new(
        "NaN / Inf",
        (x + BAR_W + 8, sy + 7),
        font(12.0).pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    Ok(())
}
