//! `--plot FILE.svg`: bus bandwidth against message size on a log scale, one line per series:
//! this run's, any earlier run's JSON (`--plot-with`, one line per operation and dtype in it),
//! and reference series such as an OpenMPI run of `../shared/bench/baselines`.
//!
//! A reference file is `{"label": "...", "points": [{"bytes": 4096, "busbw_gbps": 0.2}, ...]}`
//! or an array of such objects; `bench/reference/` holds some.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

/// Largest JSON file `--plot-with` reads (a bench result is a few KiB).
const MAX_INPUT_BYTES: u64 = 16 << 20;

/// One line of the plot: `(bytes, busbw in GB/s)` points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// The series in a nexar-bench JSON result (one per operation and dtype) or a reference file.
pub fn read_series(path: &Path) -> Result<Vec<Series>, String> {
    let name = path.display();
    let len = std::fs::metadata(path).map_err(|e| format!("{name}: {e}"))?.len();
    if len > MAX_INPUT_BYTES {
        return Err(format!("{name}: {len} bytes, more than the {MAX_INPUT_BYTES} a result file can be"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{name}: not JSON: {e}"))?;
    series_of(&value).map_err(|e| format!("{name}: {e}"))
}

fn series_of(value: &serde_json::Value) -> Result<Vec<Series>, String> {
    let items = match value {
        serde_json::Value::Array(items) => items.as_slice(),
        one => std::slice::from_ref(one),
    };
    let mut references = Vec::new();
    let mut runs: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        let point = |p: &serde_json::Value| -> Result<(f64, f64), String> {
            let num = |k: &str| p.get(k).and_then(serde_json::Value::as_f64);
            match (num("bytes"), num("busbw_gbps")) {
                (Some(b), Some(bw)) if b > 0.0 && bw.is_finite() && bw >= 0.0 => Ok((b, bw)),
                _ => Err(format!("entry {i}: needs a positive \"bytes\" and a \"busbw_gbps\" of at least 0")),
            }
        };
        if let Some(points) = item.get("points") {
            let label = item.get("label").and_then(|l| l.as_str()).ok_or(format!("entry {i}: no \"label\""))?;
            let points = points.as_array().ok_or(format!("entry {i}: \"points\" is not a list"))?;
            let points = points.iter().map(point).collect::<Result<Vec<_>, _>>()?;
            references.push(Series { label: label.to_string(), points });
        } else {
            let text = |k: &str| item.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_lowercase();
            let np = item.get("np").and_then(|v| v.as_u64()).unwrap_or(0);
            let label = format!("nexar {} {} np{np}", text("op"), text("dtype"));
            runs.entry(label).or_default().push(point(item)?);
        }
    }
    let mut all: Vec<Series> = runs.into_iter().map(|(label, points)| Series { label, points }).collect();
    all.extend(references);
    if all.iter().all(|s| s.points.is_empty()) {
        return Err("no points".into());
    }
    Ok(all)
}

/// `4096` as `4K`, for the size axis.
fn size_label(bytes: f64) -> String {
    let b = bytes.round() as u64;
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// Draws `series` into the SVG file `path`.
pub fn draw(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let points = series.iter().flat_map(|s| s.points.iter());
    let (lo, hi, top) =
        points.fold((f64::MAX, 0.0f64, 0.0f64), |(lo, hi, top), &(b, bw)| (lo.min(b), hi.max(b), top.max(bw)));
    if hi <= 0.0 {
        return Err("nothing to plot".into());
    }
    let (lo, hi) = (lo / 1.5, hi * 1.5);
    let top = if top > 0.0 { top * 1.15 } else { 1.0 };
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((lo..hi).log_scale().base(4.0), 0.0..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("bus bandwidth (GB/s)")
        .x_label_formatter(&|b| size_label(*b))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut points = s.points.clone();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_references_become_series_and_bad_files_say_why() {
        let run = serde_json::json!([
            {"op": "Allreduce", "dtype": "F32", "np": 2, "bytes": 4096, "busbw_gbps": 0.4},
            {"op": "Allreduce", "dtype": "F32", "np": 2, "bytes": 65536, "busbw_gbps": 1.2},
        ]);
        let s = series_of(&run).unwrap();
        assert_eq!(
            s,
            vec![Series { label: "nexar allreduce f32 np2".into(), points: vec![(4096.0, 0.4), (65536.0, 1.2)] }]
        );
        let reference = serde_json::json!({"label": "OpenMPI", "points": [{"bytes": 4096, "busbw_gbps": 0.2}]});
        assert_eq!(series_of(&reference).unwrap()[0].label, "OpenMPI");
        let bad = serde_json::json!([{"op": "Allreduce", "bytes": -1, "busbw_gbps": 1.0}]);
        assert!(series_of(&bad).unwrap_err().contains("entry 0"));
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(64.0 * 1048576.0), "64M");
    }
}
