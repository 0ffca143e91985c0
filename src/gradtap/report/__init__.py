"""Reports of a run: a plain data model read from the run store, rendered to one HTML file.

``write_report(run_dir)`` writes ``run_dir/report.html``: the loss, gradient norms per layer
over steps (log scale), the noise scale, gain and RMS (:mod:`gradtap.report.health`), a
layers-by-steps heatmap and one per split parameter's slices, histograms over time, EWMA
bands, update-to-weight ratios, anomalies and the run's metadata, as inline SVG in a
self-contained page. Every line keeps each pixel column's minimum and maximum (a one-step
spike stays visible); with many tensors the charts show the layers that matter
(:mod:`gradtap.report.layers`) and a searchable table lists every tensor.
``list_runs(root)`` finds run directories. The report only reads and renders a run; the
training loop of ``gradtap demo`` lives in :mod:`gradtap.demo`.
"""

from gradtap.report.data import (
    ANOMALIES_FILE,
    METRICS_FILE,
    LayerSummary,
    ReportData,
    RunInfo,
    build_report_data,
    layer_summary,
    list_runs,
    read_anomalies,
    read_metrics,
    write_anomalies,
    write_metrics,
)
from gradtap.report.html import REPORT_NAME, render_html, write_report

__all__ = [
    "ANOMALIES_FILE",
    "METRICS_FILE",
    "REPORT_NAME",
    "LayerSummary",
    "ReportData",
    "RunInfo",
    "build_report_data",
    "layer_summary",
    "list_runs",
    "read_anomalies",
    "read_metrics",
    "render_html",
    "write_anomalies",
    "write_metrics",
    "write_report",
]
