"""The HTML report: built from a real demo run, checked as data, as parsed HTML and in headless
Chromium (DOM, console, network, screenshot)."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtap as gt
import gradtap.report as report
from gradtap import Monitor
from gradtap.demo import run_demo
from gradtap.errors import SelectionError, StoreError
from gradtap.report import svg
from gradtap.store import open_run

STEPS = 30
NAN_STEP = 17
EVIL = '<script>alert("x")</script>'


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A real demo run: digits, Monitor with every kind, a transform rule, a planted NaN."""
    out = tmp_path_factory.mktemp("demo") / "run"
    result = run_demo(out, steps=STEPS, seed=1, inject_nan=NAN_STEP, hist_bins=24)
    return result


@pytest.fixture(scope="module")
def evil_run(tmp_path_factory):
    """A run whose module names and metadata contain markup."""
    out = tmp_path_factory.mktemp("evil") / "run"
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module(EVIL, nn.Linear(3, 4))
    net.add_module("<b>bold</b>&amp;", nn.Linear(4, 1))
    with Monitor(net, kinds=("param_grad", "grad_output", "update"), hist_bins=8, ewma=0.9,
                 store=out, meta={"note": "<img src=x onerror=alert(1)>"}) as mon:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(4):
            net(torch.randn(8, 3)).pow(2).mean().backward()
            mon.step()
            opt.step()
            opt.zero_grad()
    report.write_anomalies(out, [{"step": 2, "module_name": EVIL, "kind": "nan",
                                  "where": "forward", "message": "</td><script>bad()</script>"}],
                           source="<test>")
    return out


# -- data model ----------------------------------------------------------------------------------


def test_report_data_is_read_from_the_store(demo_run):
    run = open_run(demo_run.run_dir)
    data = report.build_report_data(demo_run.run_dir)
    assert data.steps == list(range(STEPS))
    assert set(data.norms) == {"param_grad", "grad_output"}  # update: its ratios
    for name, (steps, values) in data.norms["param_grad"].items():
        s, v = run.series(name, "norm", "param_grad")
        np.testing.assert_array_equal(steps, s)
        np.testing.assert_array_equal(values, v)
    # the planted NaN: every gradient is non-finite at that step and only there
    for name, (_, values) in data.norms["param_grad"].items():
        assert not np.isfinite(values[NAN_STEP]), name
        assert np.isfinite(np.delete(values, NAN_STEP)).all(), name
    assert data.derived_anomalies[0]["step"] == NAN_STEP
    assert data.derived_anomalies[0]["kind"] == "grad_output"  # backward reaches outputs first
    assert [a["step"] for a in data.anomalies] == [NAN_STEP]
    # gt.detect traces the NaN to the module that made it
    assert (data.anomalies[0]["module_name"], data.anomalies[0]["where"]) == ("block2", "forward")
    assert data.anomaly_source == "gradtap.detect"
    assert data.ratios and data.histograms and data.ewma
    assert "loss" in data.metrics and math.isnan(data.metrics["loss"][1][NAN_STEP])
    assert data.summary["skipped steps"] == 1
    assert demo_run.skipped_steps == [NAN_STEP]
    # training went on after the NaN: finite loss and parameters afterwards
    assert all(math.isfinite(v) for v in demo_run.losses[NAN_STEP + 1:])
    # the summary table the CLI prints
    layers = {ly.name: ly for ly in report.layer_summary(demo_run.run_dir)}
    assert layers["block2.conv.weight"].nonfinite_steps == 1
    assert layers["fc2.weight"].steps == STEPS


def test_report_data_without_the_series_table_is_the_same(demo_run, monkeypatch):
    """Where the run cannot list its series up front, missing ones are Run.series' KeyErrors."""
    listed = report.build_report_data(demo_run.run_dir)
    def no_table(*args, **kwargs): raise TypeError("no series table")
    monkeypatch.setattr(type(open_run(demo_run.run_dir)), "arrays", no_table)
    without = report.build_report_data(demo_run.run_dir)
    for kind in ("param_grad", "grad_output"):
        assert list(without.norms[kind]) == list(listed.norms[kind])
        for name, (steps, values) in without.norms[kind].items():
            np.testing.assert_array_equal(steps, listed.norms[kind][name][0])
            np.testing.assert_array_equal(values, listed.norms[kind][name][1])
    assert list(without.ratios) == list(listed.ratios)
    assert without.derived_anomalies == listed.derived_anomalies
    assert [ly.name for ly in without.layers] == [ly.name for ly in listed.layers]


def test_histogram_choice_by_glob(demo_run):
    data = report.build_report_data(demo_run.run_dir, hist_names=["fc*.weight"])
    assert list(data.histograms) == ["fc1.weight", "fc2.weight"]
    with pytest.raises(SelectionError, match="matches no tensor with histograms"):
        report.build_report_data(demo_run.run_dir, hist_names=["nothing*"])


def test_side_files_round_trip_and_corruption(tmp_path):
    report.write_anomalies(tmp_path, [{"step": 3, "module_name": "a", "kind": "inf",
                                       "where": "param_grad", "message": "m", "extra": [1, 2]}])
    items, source = report.read_anomalies(tmp_path)
    assert items[0]["step"] == 3 and items[0]["extra"] == [1, 2] and source == "gradtap.detect"
    report.write_metrics(tmp_path, {"loss": ([0, 1], [1.0, math.nan])}, {"acc": 0.5})
    series, summary = report.read_metrics(tmp_path)
    assert math.isnan(series["loss"][1][1]) and summary == {"acc": 0.5}
    (tmp_path / report.ANOMALIES_FILE).write_text("{not json")
    with pytest.raises(StoreError, match="cannot read"):
        report.read_anomalies(tmp_path)
    (tmp_path / report.ANOMALIES_FILE).write_text('{"anomalies": 3}')
    with pytest.raises(StoreError, match="not an anomalies file"):
        report.read_anomalies(tmp_path)
    (tmp_path / report.METRICS_FILE).write_text('{"series": {"loss": {"steps": [0]}}}')
    with pytest.raises(StoreError, match="not a metrics file"):
        report.read_metrics(tmp_path)


def test_list_runs(demo_run, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.db").write_bytes(b"not a database at all" * 100)
    (tmp_path / "empty").mkdir()
    os.symlink(demo_run.run_dir, tmp_path / "demo")
    runs = report.list_runs(tmp_path)
    assert [r.path.name for r in runs] == ["broken", "demo"]
    assert runs[0].status == "unreadable" and "not a readable SQLite database" in runs[0].error
    assert (runs[1].steps, runs[1].last_step, runs[1].status) == (STEPS, STEPS - 1, "finished")
    assert runs[1].start_time
    with pytest.raises(StoreError, match="no such directory"):
        report.list_runs(tmp_path / "missing")


@pytest.mark.parametrize("case", ["no_steps", "one_nan_step", "defaults_only", "running"])
def test_unusual_runs_still_render(case, tmp_path):
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    kwargs = {} if case == "defaults_only" else {
        "kinds": ("param_grad", "grad_output", "update"), "hist_bins": 4, "ewma": 0.5}
    mon = Monitor(net, store=tmp_path / "run", **kwargs)
    if case != "no_steps":
        x = torch.randn(4, 2)
        if case == "one_nan_step":
            x[0, 0] = math.nan
        net(x).sum().backward()
        mon.step()
    if case != "running":
        mon.close()
    page = report.render_html(tmp_path / "run")
    parser = _Collect()
    parser.feed(page)
    assert "</html>" in page and len([t for t, _ in parser.tags if t == "script"]) == 1
    if case == "no_steps":
        assert "the run has no stored steps yet" in page
    if case == "one_nan_step":
        assert 'id="nonfinite-table"' in page and "gt-cell-nonfinite" in page
    if case == "defaults_only":
        assert "No histograms" in page and "No update ratios" in page
    if case == "running":
        assert "status is &#x27;running&#x27;" in page
        mon.close()


# -- SVG helpers ---------------------------------------------------------------------------------


def test_line_chart_gaps_and_nonfinite_markers():
    x = np.arange(6)
    y = np.array([1.0, 0.1, math.nan, 0.0, 10.0, math.inf])
    out = svg.line_chart([svg.Line("a<b", x, y)], plot_id="p", log_y=True)
    d = re.search(r'class="gt-line" data-series="a&lt;b" data-n="(\d+)" d="([^"]*)"', out)
    assert d and d.group(1) == "3"
    assert d.group(2).count("M") == 2  # the NaN and the zero split the line
    assert out.count('class="gt-nonfinite"') == 2  # NaN and +Inf steps
    assert "a<b" not in out


def test_heatmap_cells_and_log_ticks():
    vals = np.array([[1e-3, math.nan, 1.0], [0.0, 2.0, 3.0]])
    out = svg.heatmap(["r0", "r&1"], [0, 1, 2], vals, plot_id="h")
    assert out.count("<rect") - out.count('class="gt-colorbar"') >= 6
    assert out.count('class="gt-cell-nonfinite"') == 1
    assert "r&amp;1" in out and "r&1" not in out
    scale = svg._Scale(1e-4, 10.0, 0, 100, log=True)
    assert scale.ticks() == [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]


def test_ewma_bands_follow_the_formula_and_skip_non_finite_values():
    """Oracle: the EWMA formula (m = g, v = 0 at the first value; then d = g - m,
    m += (1 - beta) d, v = beta (v + (1 - beta) d^2)) as a float64 loop over the finite values."""
    from gradtap.report.reduce import ewma_band as _ewma_band

    rng = np.random.default_rng(0)
    values = np.abs(rng.standard_normal(40)) * 10.0 ** rng.uniform(-3, 3, 40)
    values[[0, 1, 7, 8, 30]] = [math.nan, math.inf, math.nan, -math.inf, math.nan]
    beta = 0.8
    mean, std = _ewma_band(values, beta)
    m = v = None
    for i, g in enumerate(values):
        if math.isfinite(g):
            if m is None:
                m, v = g, 0.0
            else:
                d = g - m
                m, v = m + (1 - beta) * d, beta * (v + (1 - beta) * d * d)
        if m is None:
            assert math.isnan(mean[i]) and math.isnan(std[i])
        else:
            assert mean[i] == pytest.approx(m, rel=1e-12) and std[i] == pytest.approx(math.sqrt(v), rel=1e-12)
    assert np.isnan(mean[:2]).all() and np.isfinite(mean[2:]).all()


# -- HTML ----------------------------------------------------------------------------------------


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)
        self.text.append(data)


def test_html_is_self_contained_with_every_section(demo_run, tmp_path):
    path = report.write_report(demo_run.run_dir, tmp_path / "r.html")
    page = path.read_text()
    parser = _Collect()
    parser.feed(page)
    ids = {a.get("id") for t, a in parser.tags if t == "section"}
    assert {"overview", "metrics", "norms", "heatmap", "histograms", "ewma", "ratios",
            "anomalies", "layers", "meta"} <= ids
    # nothing is loaded from anywhere: no src/href to other documents, no url(), no @import
    for tag, attrs in parser.tags:
        assert "src" not in attrs, (tag, attrs)
        if "href" in attrs:
            assert attrs["href"].startswith("#"), attrs
    assert "url(" not in page and "@import" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    plots = [a["data-plot"] for t, a in parser.tags if t == "svg"]
    assert {"norms-param_grad", "norms-grad_output", "heatmap-param_grad", "ratios"} <= set(plots)
    assert sum(p.startswith("hist-") for p in plots) == len(report.build_report_data(
        demo_run.run_dir).histograms)
    # default output location
    assert report.write_report(demo_run.run_dir) == demo_run.run_dir / "report.html"


def test_names_from_user_code_are_escaped(evil_run):
    page = report.render_html(evil_run)
    parser = _Collect()
    parser.feed(page)
    assert len([t for t, _ in parser.tags if t == "script"]) == 1  # only the report's own
    assert not any(t == "img" for t, _ in parser.tags)
    text = "".join(parser.text)
    assert "<b>bold</b>&amp;.weight" in text  # shown as text, so never parsed as markup:
    assert "<b>bold</b>" not in page and "<img" not in page and "<script>alert" not in page
    assert EVIL + ".weight" in text  # shown as text
    assert "<img src=x onerror=alert(1)>" in text
    assert "</td><script>bad()</script>" in text
    assert "&lt;script&gt;" in page


# -- in a real browser ---------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in (os.environ.get("GRADTAP_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome", "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4)."""

    def __init__(self, exe: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="gradtap-chromium-")
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-extensions",
                f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"]
        self.log = open(os.path.join(self.profile, "chromium.log"), "wb")  # noqa: SIM115
        # The shell moves our pipes to the fds 3 (commands in) and 4 (replies out) Chromium reads.
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", 'exec "$@" 3<&0 4>&1 0</dev/null 1>&2', "sh", *args],
            stdin=to_r, stdout=from_w, stderr=self.log)
        os.close(to_r)
        os.close(from_w)
        self.w, self.r = to_w, from_r
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, timeout: float = 30.0,
             session: bool = True) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict:
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        deadline = time.monotonic() + timeout
        while True:
            ev = self._read(deadline)
            self.events.append(ev)
            if ev.get("method") == method:
                return ev

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise EOFError("Chromium closed the pipe; see " + self.log.name)
                self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str, width: int = 1200, height: int = 900) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": target["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def eval(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        height = self.eval("document.documentElement.scrollHeight")
        shot = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": 1200, "height": height, "scale": 1}})
        path.write_bytes(base64.b64decode(shot["data"]))

    def problems(self) -> list[str]:
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails']}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')}")
            elif m == "Page.javascriptDialogOpening":
                out.append(f"dialog: {p.get('message')}")
        return out

    def requests(self) -> list[str]:
        return [ev["params"]["request"]["url"] for ev in self.events
                if ev.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=10)
        except (EOFError, TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.w)
        os.close(self.r)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium); the report's browser "
                    "check needs a headless Chromium")
    b = Chromium(exe)
    try:
        yield b
    finally:
        b.close()


# Everything the DOM check needs, measured in the page itself.
_DOM_PROBE = r"""
(() => {
  const plots = [...document.querySelectorAll("svg.gt-plot")].map(s => {
    const box = s.getBoundingClientRect();
    const lines = [...s.querySelectorAll("path.gt-line")].map(p => ({
      series: p.getAttribute("data-series"), n: +p.getAttribute("data-n"),
      points: (p.getAttribute("d").match(/[ML]/g) || []).length,
      coords: (p.getAttribute("d").match(/-?[\d.]+,-?[\d.]+/g) || []).map(c => c.split(",").map(Number)),
      length: p.getTotalLength ? p.getTotalLength() : 0}));
    return {id: s.getAttribute("data-plot"), kind: s.getAttribute("data-kind"),
            width: box.width, height: box.height, lines,
            rows: +s.getAttribute("data-rows"), cols: +s.getAttribute("data-cols"),
            cells: s.querySelectorAll("g.gt-row rect").length,
            nonfiniteCells: s.querySelectorAll("rect.gt-cell-nonfinite").length,
            ridges: s.querySelectorAll("path.gt-ridge").length,
            slices: +s.getAttribute("data-slices"),
            nonfiniteMarks: [...s.querySelectorAll("path.gt-nonfinite")].map(m => m.textContent),
            y0: +s.getAttribute("data-y0"), y1: +s.getAttribute("data-y1"),
            log: s.getAttribute("data-log"), top: +s.getAttribute("data-top"),
            bottom: +s.getAttribute("data-bottom"), left: +s.getAttribute("data-left"),
            right: +s.getAttribute("data-right")};
  });
  const rows = sel => [...document.querySelectorAll(sel + " tbody tr")].map(
      r => [...r.cells].map(c => c.textContent.trim()));
  return {plots, ready: document.documentElement.getAttribute("data-gt-ready"),
          anomalies: rows("#anomaly-table"), layers: rows("#layer-table"),
          scripts: document.scripts.length, text: document.body.innerText,
          title: document.title};
})()
"""


def test_report_in_headless_chromium(demo_run, browser, tmp_path):
    page = report.write_report(demo_run.run_dir, tmp_path / "report.html")
    browser.open(page.resolve().as_uri())
    dom = browser.eval(_DOM_PROBE)
    shot = tmp_path / "report.png"
    browser.screenshot(shot)
    if os.environ.get("GRADTAP_ARTIFACTS"):  # CI: keep the screenshot where it is collected
        Path(os.environ["GRADTAP_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["GRADTAP_ARTIFACTS"]) / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000

    assert browser.problems() == []
    assert [u for u in browser.requests() if not u.startswith("file:")] == []
    assert dom["ready"] == "1"  # the inline script ran to the end
    assert dom["scripts"] == 1

    run = open_run(demo_run.run_dir)
    plots = {p["id"]: p for p in dom["plots"]}
    assert {"norms-param_grad", "norms-grad_output", "heatmap-param_grad",
            "heatmap-grad_output", "ratios", "metric-0"} <= set(plots)
    assert sum(k.startswith("hist-") for k in plots) >= 3
    param_names = list(report.build_report_data(demo_run.run_dir).norms["param_grad"])
    assert sum(k.startswith("ewma-") for k in plots) == len(param_names) == 10
    for p in dom["plots"]:
        assert p["width"] > 200 and p["height"] > 100, p["id"]  # laid out, visible
        if p["kind"] == "line":
            assert p["lines"], p["id"]
            for ln in p["lines"]:
                assert ln["n"] > 0 and ln["points"] == ln["n"] and ln["length"] > 0, (p["id"], ln)
        elif p["kind"] == "heatmap":
            assert p["cells"] == p["rows"] * p["cols"] > 0, p["id"]
            assert p["nonfiniteCells"] == p["rows"], p["id"]  # the NaN step, in every row
        elif p["kind"] == "ridgelines":
            assert p["ridges"] == p["slices"] > 0, p["id"]

    # Lines carry the run's own numbers: map pixels back to values and compare.
    norms = plots["norms-param_grad"]
    assert {ln["series"] for ln in norms["lines"]} == set(param_names)
    line = next(ln for ln in norms["lines"] if ln["series"] == "block2.conv.weight")
    steps, values = run.series("block2.conv.weight", "norm", "param_grad")
    ok = np.isfinite(values) & (values > 0)
    assert line["n"] == int(ok.sum()) == STEPS - 1
    lo, hi = math.log10(norms["y0"]), math.log10(norms["y1"])
    px = np.array(line["coords"])
    got_steps = (px[:, 0] - norms["left"]) / (norms["right"] - norms["left"]) * (STEPS - 1)
    got = 10 ** (lo + (norms["bottom"] - px[:, 1]) / (norms["bottom"] - norms["top"]) * (hi - lo))
    np.testing.assert_allclose(got_steps, steps[ok], atol=0.01)
    np.testing.assert_allclose(got, values[ok], rtol=0.01)
    assert [m.split(":")[0] for m in norms["nonfiniteMarks"]] == [f"step {NAN_STEP}"]

    # the anomaly and the layer table are in the page
    assert [row[0] for row in dom["anomalies"]] == [str(NAN_STEP)]
    assert {row[0] for row in dom["layers"]} >= {"block1.conv.weight", "fc2.bias"}
    assert "First anomaly" in dom["text"]

    # legend interaction works (and raises nothing)
    browser.eval("""document.querySelector('ul.legend li').dispatchEvent(new MouseEvent('mouseenter'));""")
    assert browser.eval("document.querySelector('svg.gt-plot.dim') !== null")
    assert browser.problems() == []


def test_escaped_names_in_headless_chromium(evil_run, browser, tmp_path):
    page = report.write_report(evil_run, tmp_path / "evil.html")
    browser.open(page.resolve().as_uri())
    dom = browser.eval(_DOM_PROBE)
    assert browser.problems() == []  # no alert dialog, no error from injected markup
    assert dom["scripts"] == 1
    assert EVIL + ".weight" in dom["text"]
    assert "<img src=x onerror=alert(1)>" in dom["text"]
    assert "<b>bold</b>&amp;.weight" in dom["text"]
    assert browser.eval("document.querySelectorAll('img').length") == 0
    assert browser.eval("[...document.querySelectorAll('b')].every(b => b.textContent !== 'bold')")
    series = {ln["series"] for p in dom["plots"] for ln in p["lines"]}
    assert EVIL + ".weight" in series


def test_spikes_the_detector_reported_are_marked_on_the_norm_charts(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    run_dir = tmp_path / "run"
    with gt.Monitor(net, store=run_dir) as mon, \
            gt.detect(net, spike=5.0, warmup=3, action="record") as det:
        for step in range(6):
            if step == 5:
                with torch.no_grad():
                    net[2].weight.mul_(1000.0)
            net(torch.randn(8, 4)).pow(2).mean().backward()
            mon.step()
            det.step()
            net.zero_grad()
    report.write_anomalies(run_dir, det.anomalies)
    assert [(a.kind, a.step) for a in det.anomalies] == [("spike", 5)]
    page = report.write_report(run_dir).read_text()
    assert page.count('class="gt-event"') == 1
    assert "<title>spike at step 5 in &#x27;2&#x27; (param_grad)</title>" in page
    assert "dashed orange lines the spikes the detector reported" in page


def test_the_non_finite_table_starts_at_the_detected_origin(tmp_path):
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential()
    net.add_module("block1", nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    net.add_module("block2", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    run_dir = tmp_path / "run"
    with gt.Monitor(net, store=run_dir) as mon, gt.detect(net, action="record") as det:
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    net.block2[0].weight[0, 0] = float("nan")  # the origin, in block2
            net(torch.randn(3, 4)).sum().backward()
            mon.step()
            det.step()
            net.zero_grad()
    report.write_anomalies(run_dir, det.anomalies)
    assert det.anomalies[0].module_name == "block2.0"
    rows = report.build_report_data(run_dir).derived_anomalies
    # The NaN reached both blocks' gradients in that step (block1's through block2.0's
    # weight, block2.2's through its input); block1 comes first in model order.
    assert {r["name"] for r in rows} >= {"block1.0.weight", "block2.2.weight"}
    assert rows[0]["name"].startswith("block2.") and rows[0]["step"] == 1
