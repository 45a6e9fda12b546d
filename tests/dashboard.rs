//! The Grafana dashboard (`dashboards/tollgate.json`) stays honest: every
//! metric it names is one tollgate emits (a renamed metric fails here, not
//! on a blank panel), every panel queries something, and every metric and
//! label tollgate emits is documented in `crates/tollgate/src/observe.rs`.
//!
//! The metrics are found by reading the sources as text at test time: the
//! name literal of each `counter!`, `gauge!` and `histogram!` of the
//! `metrics` facade (and of observe.rs's `count` helper, a counter), and
//! the `"key" =>` labels of those macros. Needs no feature, no recorder.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// The dashboard, from the workspace root.
const DASHBOARD: &str = "dashboards/tollgate.json";

/// Where every metric and label is documented, from the workspace root.
const OBSERVE: &str = "crates/tollgate/src/observe.rs";

/// The sources that may emit metrics, from the workspace root.
const SOURCES: [&str; 3] = [
    "crates/tollgate/src",
    "crates/tollgate-redis/src",
    "crates/tollgate-budget/src",
];

/// The series `metrics-exporter-prometheus` renders for a histogram besides
/// its name (a summary's quantiles carry the bare name).
const HISTOGRAM_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The text just before a metric's name literal, for each way the sources
/// emit one: the facade's macros, and observe.rs's `count(name, policy, by)`.
const EMITTERS: [(&str, Kind); 4] = [
    ("counter!(", Kind::Counter),
    ("gauge!(", Kind::Gauge),
    ("histogram!(", Kind::Histogram),
    ("count(", Kind::Counter),
];

/// The facade's macros, whose `"key" => value` arguments are labels.
const MACROS: [&str; 3] = ["counter!(", "gauge!(", "histogram!("];

/// A metric the sources emit.
struct Emitted {
    kind: Kind,
    /// Where it is first emitted (`path:line`), for messages.
    at: String,
    /// Its label keys, wherever it is emitted.
    labels: BTreeSet<String>,
}

/// What the sources emit.
struct Scan {
    /// Every metric, by name.
    metrics: BTreeMap<String, Emitted>,
    /// Every label key passed to the facade's macros.
    labels: BTreeSet<String>,
}

/// The workspace root: the nearest directory, from this package's manifest
/// up, that holds both the dashboard and observe.rs.
fn root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|dir| dir.join(DASHBOARD).is_file() && dir.join(OBSERVE).is_file())
        .unwrap_or_else(|| {
            panic!(
                "no {DASHBOARD} and {OBSERVE} in {} or above",
                manifest.display()
            )
        })
        .to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The `.rs` files under `dir`, in a stable order.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| {
            entry
                .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
                .path()
        })
        .collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// `text` with its comment lines blanked (doc comments name metrics too;
/// the line numbers stay).
fn without_comments(text: &str) -> String {
    text.lines()
        .map(|line| {
            if line.trim_start().starts_with("//") {
                ""
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
}

/// Every `tollgate_[a-z0-9_]+` identifier in `text`, in order.
fn metric_names(text: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("tollgate_") {
        let start = from + at;
        let len = text[start..]
            .find(|c: char| !is_name_char(c))
            .unwrap_or(text.len() - start);
        // Not the tail of a longer identifier (`my_tollgate_x`).
        let joined = text[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if len > "tollgate_".len() && !joined {
            found.push(&text[start..start + len]);
        }
        from = start + len;
    }
    found
}

/// The length of a macro call's arguments: up to the `)` that closes it
/// (brackets within string literals left out).
fn closing(args: &str) -> usize {
    let mut depth = 1;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in args.char_indices() {
        if escaped {
            escaped = false;
        } else if in_string {
            match c {
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else {
            match c {
                '"' => in_string = true,
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return i;
                    }
                }
                _ => {}
            }
        }
    }
    args.len()
}

/// The label keys among a macro call's arguments: each `"key" => value`.
fn label_keys(args: &str) -> Vec<String> {
    args.match_indices("=>")
        .filter_map(|(at, _)| {
            let before = args[..at].trim_end().strip_suffix('"')?;
            let open = before.rfind('"')?;
            Some(before[open + 1..].to_owned())
        })
        .collect()
}

/// Every metric and label the sources emit. Fails on a `"tollgate_..."`
/// literal that is not an emitted metric's name: the scan would be out of
/// date with how metrics are emitted.
fn scan(root: &Path) -> Scan {
    let mut files = Vec::new();
    for dir in SOURCES {
        rust_files(&root.join(dir), &mut files);
    }
    let mut metrics: BTreeMap<String, Emitted> = BTreeMap::new();
    let mut labels = BTreeSet::new();
    let mut problems = Vec::new();
    let mut unexplained = Vec::new();
    for path in &files {
        let shown = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        let code = without_comments(&read(path));
        for (start, _) in code.match_indices("\"tollgate_") {
            let rest = &code[start + 1..];
            let name = &rest[..rest.find(|c: char| !is_name_char(c)).unwrap_or(rest.len())];
            let at = format!("{shown}:{}", code[..start].matches('\n').count() + 1);
            let before = code[..start].trim_end();
            let Some(kind) = EMITTERS
                .iter()
                .find(|(emitter, _)| before.ends_with(*emitter))
                .map(|&(_, kind)| kind)
            else {
                unexplained.push((name.to_owned(), at));
                continue;
            };
            let seen = metrics.entry(name.to_owned()).or_insert_with(|| Emitted {
                kind,
                at: at.clone(),
                labels: BTreeSet::new(),
            });
            if before.ends_with("count(") {
                // observe.rs's count(name, policy, by): the policy label.
                seen.labels.insert("policy".to_owned());
            } else {
                let args = &code[start..];
                seen.labels.extend(label_keys(&args[..closing(args)]));
            }
            if seen.kind != kind {
                problems.push(format!(
                    "metric `{name}` is emitted as a {:?} at {} and as a {kind:?} at {at}",
                    seen.kind, seen.at
                ));
            }
        }
        for opener in MACROS {
            for (start, _) in code.match_indices(opener) {
                let args = &code[start + opener.len()..];
                labels.extend(label_keys(&args[..closing(args)]));
            }
        }
    }
    for (name, at) in unexplained {
        if !metrics.contains_key(&name) {
            problems.push(format!(
                "`\"{name}\"` at {at} is not the name passed to counter!, gauge!, histogram! \
                 or observe.rs's count(): if it names a metric, teach tests/dashboard.rs how \
                 it is emitted"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "scanning {SOURCES:?} for metrics:\n{}",
        problems.join("\n")
    );
    assert!(
        !metrics.is_empty(),
        "no metric found in {SOURCES:?}: is the scan out of date?"
    );
    Scan { metrics, labels }
}

/// The emitted metric a name in the dashboard stands for: the name itself,
/// or the histogram whose `_bucket`, `_sum` or `_count` series it is.
fn emitted_name<'a>(used: &'a str, metrics: &BTreeMap<String, Emitted>) -> Option<&'a str> {
    if metrics.contains_key(used) {
        return Some(used);
    }
    HISTOGRAM_SUFFIXES.into_iter().find_map(|suffix| {
        used.strip_suffix(suffix).filter(|base| {
            metrics
                .get(*base)
                .is_some_and(|m| m.kind == Kind::Histogram)
        })
    })
}

/// The doc comments (`//!`, `///`) of observe.rs.
fn observe_docs(root: &Path) -> String {
    read(&root.join(OBSERVE))
        .lines()
        .map(str::trim_start)
        .filter(|line| line.starts_with("//!") || line.starts_with("///"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn parse(text: &str) -> Json {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// The items of a JSON array, none for anything else.
fn items(value: &Json) -> &[Json] {
    value.as_array().map(Vec::as_slice).unwrap_or_default()
}

/// Labels every series has once Prometheus scrapes it, and those the
/// exporter adds to a histogram's series.
const SCRAPE_LABELS: [&str; 4] = ["job", "instance", "le", "quantile"];

/// The label names `expr` uses with a metric that does not have them:
/// in a selector (`metric{label="..."}`) the metric's own labels, in a
/// `by (...)` / `without (...)` the labels of any metric of the query.
fn unknown_labels(expr: &str, metrics: &BTreeMap<String, Emitted>) -> Vec<String> {
    let known = |labels: &BTreeSet<String>, label: &str| {
        labels.contains(label) || SCRAPE_LABELS.contains(&label)
    };
    let mut all = BTreeSet::new();
    let mut unknown = Vec::new();
    for name in metric_names(expr) {
        let Some(emitted) = emitted_name(name, metrics).and_then(|base| metrics.get(base)) else {
            continue;
        };
        all.extend(emitted.labels.iter().cloned());
        for (at, _) in expr.match_indices(name) {
            let after = &expr[at + name.len()..];
            if after.starts_with(|c: char| is_name_char(c)) {
                continue;
            }
            let Some(selector) = after.strip_prefix('{') else {
                continue;
            };
            let selector = &selector[..selector.find('}').unwrap_or(selector.len())];
            for matcher in selector.split(',') {
                let label = matcher.split(['=', '!', '~']).next().unwrap_or("").trim();
                if !label.is_empty() && !known(&emitted.labels, label) {
                    unknown.push(format!("{name}{{{label}}}"));
                }
            }
        }
    }
    for keyword in ["by", "without"] {
        for (at, _) in expr.match_indices(keyword) {
            let before_ok = expr[..at].ends_with(|c: char| !is_name_char(c));
            let rest = expr[at + keyword.len()..].trim_start();
            let (true, Some(list)) = (before_ok, rest.strip_prefix('(')) else {
                continue;
            };
            let list = &list[..list.find(')').unwrap_or(list.len())];
            for label in list.split(',').map(str::trim).filter(|l| !l.is_empty()) {
                if !known(&all, label) {
                    unknown.push(format!("{keyword} ({label})"));
                }
            }
        }
    }
    unknown
}

/// The panels of `list`, those of rows included, the rows left out.
fn collect_panels<'a>(list: &'a [Json], out: &mut Vec<&'a Json>) {
    for panel in list {
        if panel.get("type").and_then(Json::as_str) == Some("row") {
            collect_panels(panel.get("panels").map(items).unwrap_or_default(), out);
        } else {
            out.push(panel);
        }
    }
}

fn title(panel: &Json) -> &str {
    panel
        .get("title")
        .and_then(Json::as_str)
        .unwrap_or("(untitled)")
}

#[test]
fn dashboard_names_only_metrics_tollgate_emits() {
    let root = root();
    let Scan { metrics, .. } = scan(&root);
    let text = read(&root.join(DASHBOARD));
    let dashboard = parse(&text);
    let mut panels = Vec::new();
    collect_panels(
        dashboard.get("panels").map(items).unwrap_or_default(),
        &mut panels,
    );
    assert!(!panels.is_empty(), "{DASHBOARD} has no panels");

    let mut errors = Vec::new();
    let mut unknown = BTreeSet::new();
    let mut used = BTreeSet::new();
    for panel in &panels {
        let title = title(panel);
        let exprs: Vec<&str> = panel
            .get("targets")
            .map(items)
            .unwrap_or_default()
            .iter()
            .filter_map(|target| target.get("expr").and_then(Json::as_str))
            .filter(|expr| !expr.trim().is_empty())
            .collect();
        if exprs.is_empty() {
            errors.push(format!(
                "panel {title:?} has no query (no `expr` in its targets)"
            ));
        }
        for expr in exprs {
            for label in unknown_labels(expr, &metrics) {
                errors.push(format!(
                    "panel {title:?} uses the label {label}, which no metric it queries \
                     has (query: {expr})"
                ));
            }
            let names = metric_names(expr);
            if names.is_empty() {
                errors.push(format!(
                    "panel {title:?} has a query that uses no tollgate metric: {expr}"
                ));
            }
            for name in names {
                match emitted_name(name, &metrics) {
                    Some(base) => {
                        used.insert(base.to_owned());
                    }
                    None => {
                        unknown.insert(name.to_owned());
                        errors.push(format!(
                            "panel {title:?} queries metric `{name}`, which tollgate does not \
                             emit (query: {expr})"
                        ));
                    }
                }
            }
        }
    }
    // Names outside the panels' queries too: variables, descriptions.
    for name in metric_names(&text) {
        if emitted_name(name, &metrics).is_none() && unknown.insert(name.to_owned()) {
            errors.push(format!(
                "{DASHBOARD} names metric `{name}` (outside the panels' queries), which \
                 tollgate does not emit"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "{DASHBOARD} is out of date with the metrics tollgate emits ({:?}):\n{}",
        metrics.keys().collect::<Vec<_>>(),
        errors.join("\n")
    );
    assert!(
        used.len() >= 8,
        "{DASHBOARD} queries only {} distinct tollgate metrics ({used:?}); expected at least 8",
        used.len()
    );
}

#[test]
fn dashboard_panels_use_the_prometheus_datasource_variable() {
    let text = read(&root().join(DASHBOARD));
    let dashboard = parse(&text);
    let variables = dashboard
        .get("templating")
        .and_then(|templating| templating.get("list"))
        .map(items)
        .unwrap_or_default();
    assert!(
        variables.iter().any(|v| {
            v.get("name").and_then(Json::as_str) == Some("DS_PROMETHEUS")
                && v.get("type").and_then(Json::as_str) == Some("datasource")
                && v.get("query").and_then(Json::as_str) == Some("prometheus")
        }),
        "{DASHBOARD} has no Prometheus datasource variable named DS_PROMETHEUS"
    );
    let mut panels = Vec::new();
    collect_panels(
        dashboard.get("panels").map(items).unwrap_or_default(),
        &mut panels,
    );
    for panel in panels {
        let uid = panel
            .get("datasource")
            .and_then(|datasource| datasource.get("uid"))
            .and_then(Json::as_str);
        assert_eq!(
            uid,
            Some("${DS_PROMETHEUS}"),
            "the datasource of panel {:?}",
            title(panel)
        );
    }
}

#[test]
fn every_emitted_metric_and_label_is_documented_in_observe_rs() {
    let root = root();
    let Scan { metrics, labels } = scan(&root);
    let docs = observe_docs(&root);
    let documented: BTreeSet<&str> = metric_names(&docs).into_iter().collect();
    let mut missing: Vec<String> = metrics
        .iter()
        .filter(|(name, _)| !documented.contains(name.as_str()))
        .map(|(name, emitted)| {
            format!(
                "metric `{name}` (a {:?}, emitted at {}) is not in {OBSERVE}'s docs",
                emitted.kind, emitted.at
            )
        })
        .collect();
    missing.extend(
        labels
            .iter()
            .filter(|key| !docs.contains(&format!("`{key}`")))
            .map(|key| format!("label `{key}` is not in {OBSERVE}'s docs (in backticks)")),
    );
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
