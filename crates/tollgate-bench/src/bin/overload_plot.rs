//! Pictures of an overload benchmark run: for each scenario, the limit,
//! the requests in flight and the p99 latency over time, one line per
//! configuration, from the CSV files `overload` wrote.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin overload_plot -- CSV_DIR OUT_DIR
//! ```
//!
//! Writes `OUT_DIR/overload-<scenario>.svg`.

// Drawing coordinates are fractions.
#![allow(clippy::float_arithmetic)]

use std::path::Path;

use plotters::prelude::*;

const SCENARIOS: [&str; 3] = ["step", "noisy", "priority"];
const CONFIGS: [(&str, RGBColor); 6] = [
    ("tollgate-adaptive", RGBColor(200, 30, 30)),
    ("tollgate-fixed-32", RGBColor(120, 120, 120)),
    ("tollgate-fixed-8", RGBColor(60, 60, 60)),
    ("peer-aimd", RGBColor(30, 90, 200)),
    ("peer-vegas", RGBColor(30, 160, 80)),
    // Not a peer: told the capacity (see overload.rs).
    ("oracle", RGBColor(230, 150, 30)),
];

/// `(t, limit, in flight, p99 ms)` rows of one CSV file.
fn read(path: &Path) -> Result<Vec<[f64; 4]>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .skip(1)
        .map(|line| {
            let mut row = [0.0; 4];
            let mut fields = line.split(',');
            for cell in &mut row {
                *cell = fields
                    .next()
                    .and_then(|f| f.parse().ok())
                    .ok_or_else(|| format!("{}: bad line {line:?}", path.display()))?;
            }
            Ok(row)
        })
        .collect()
}

fn plot(csv: &Path, out: &Path, scenario: &str) -> Result<(), Box<dyn std::error::Error>> {
    let runs: Vec<(&str, RGBColor, Vec<[f64; 4]>)> = CONFIGS
        .iter()
        .map(|&(name, color)| {
            read(&csv.join(format!("{scenario}-{name}.csv"))).map(|rows| (name, color, rows))
        })
        .collect::<Result<_, _>>()?;
    let path = out.join(format!("overload-{scenario}.svg"));
    let root = SVGBackend::new(&path, (900, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((3, 1));
    let end = runs
        .iter()
        .flat_map(|(_, _, rows)| rows.iter().map(|r| r[0]))
        .fold(1.0f64, f64::max);
    for (i, (panel, title)) in panels
        .iter()
        .zip(["limit", "in flight", "p99 latency (ms, last 0.5 s)"])
        .enumerate()
    {
        let column = i + 1;
        let top = runs
            .iter()
            .flat_map(|(_, _, rows)| rows.iter().map(|r| r[column]))
            .fold(1.0f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{scenario}: {title}"), ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..end, 0.0..top)?;
        chart.configure_mesh().x_desc("seconds").draw()?;
        for (name, color, rows) in &runs {
            chart
                .draw_series(LineSeries::new(
                    rows.iter().map(|r| (r[0], r[column])),
                    color,
                ))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    println!("{}", path.display());
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [csv, out] = args.as_slice() else {
        eprintln!("usage: overload_plot CSV_DIR OUT_DIR");
        std::process::exit(2);
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("{out}: {e}");
        std::process::exit(1);
    }
    for scenario in SCENARIOS {
        if let Err(e) = plot(Path::new(csv), Path::new(out), scenario) {
            eprintln!("{scenario}: {e}");
            std::process::exit(1);
        }
    }
}
