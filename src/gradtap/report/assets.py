"""The report page's inline assets: its style sheet and a few lines of script.

Both are written into the page itself (no network access, no external assets); the script
only adds interaction (legend highlighting, showing every row of a long table, filtering
the layer table by name, drawing a layer's norm when its row is clicked), and the page is
complete without it.
"""

__all__ = ["CSS", "JS"]

CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d8dee4;--bg:#f6f8fa;--accent:#4e79a7;--bad:#d7191c}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:#fff}
header{padding:20px 32px 0;border-bottom:1px solid var(--line);background:var(--bg);position:sticky;top:0;z-index:2}
header h1{display:inline-block;margin:0 12px 0 0;font-size:22px}
.brand{font-weight:700;color:var(--accent);letter-spacing:.04em;font-size:12px;text-transform:uppercase}
.path{color:var(--muted);font-size:12px;margin-top:2px;word-break:break-all}
nav{display:flex;flex-wrap:wrap;gap:2px 18px;margin-top:10px}
nav a{color:var(--fg);text-decoration:none;padding:6px 0;border-bottom:2px solid transparent;font-size:13px}
nav a:hover{border-color:var(--accent)}
main{max-width:1040px;margin:0 auto;padding:8px 32px 32px}
section{padding-top:12px;scroll-margin-top:120px}
h2{font-size:18px;border-bottom:1px solid var(--line);padding-bottom:4px;margin:20px 0 10px}
h3{font-size:14px;margin:16px 0 6px;color:#333}
.status{display:inline-block;padding:1px 10px;border-radius:10px;font-size:12px;vertical-align:4px;background:#ddd}
.status-finished{background:#dafbe1;color:#116329}.status-failed{background:#ffebe9;color:#a40e26}
.status-running{background:#fff8c5;color:#7d4e00}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid var(--line);border-radius:8px;padding:8px 14px;min-width:120px;background:#fff}
.card .k{color:var(--muted);font-size:12px}.card .v{font-size:18px;font-weight:600}
.callout{margin:12px 0;padding:10px 14px;border-radius:6px;border-left:4px solid}
.callout.bad{background:#fff0f0;border-color:var(--bad)}.callout.warn{background:#fff8e1;border-color:#d4a72c}
.muted{color:var(--muted)}.ok{color:#116329}.empty{color:var(--muted);font-style:italic}
figure{margin:8px 0 18px}
figure.chart svg.gt-plot{width:100%;height:auto;display:block}
figcaption{color:var(--muted);font-size:12px;margin-top:4px}
figcaption.title{color:var(--fg);font-size:13px;margin:0 0 2px}
.grid2{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:8px 24px}
.legend{list-style:none;padding:0;margin:6px 0 0;display:flex;flex-wrap:wrap;gap:2px 14px;font-size:12px}
.legend li{cursor:pointer;user-select:none;white-space:nowrap}
.legend li.off{opacity:.35}
.legend .sw{display:inline-block;width:18px;height:4px;border-radius:2px;margin-right:6px;vertical-align:middle}
svg.gt-plot text{font:11px system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;fill:#57606a}
svg.gt-plot .gt-axlabel{fill:#24292f;font-size:12px}
svg.gt-plot .gt-grid{stroke:#eaeef2}
svg.gt-plot .gt-tick{stroke:#8c959f}
svg.gt-plot .gt-box{fill:none;stroke:#d0d7de}
svg.gt-plot .gt-rowlabel{fill:#24292f;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:11px}
svg.gt-plot .gt-reflabel{fill:#6e7781}
svg.gt-plot.dim .gt-line{stroke-opacity:.15}
svg.gt-plot.dim .gt-line.hl{stroke-opacity:1;stroke-width:2.6}
svg.gt-plot .gt-line.off{display:none}
table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
table.data{width:100%}
table.data th,table.data td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
table.data td{font-variant-numeric:tabular-nums}
table.data thead th{background:var(--bg);font-weight:600}
table.data tr.bad td{background:#fff0f0}
#nonfinite-table tr.more{display:none}#nonfinite-table.all tr.more{display:table-row}
p.search input{font:inherit;padding:3px 8px;border:1px solid var(--line);border-radius:6px;min-width:280px}
#layer-count{color:var(--muted);font-size:12px}
#layer-table tr.has-spark{cursor:pointer}#layer-table tr.spark td{background:var(--bg)}
svg.gt-spark{width:100%;height:90px;display:block;background:#fff}
svg.gt-spark .gt-spark-nonfinite{fill:#d7191c;fill-opacity:.6}
button.more-toggle{font:inherit;font-size:12px;padding:2px 10px;border:1px solid var(--line);border-radius:6px;background:#fff;cursor:pointer}
table.kv th{text-align:left;font-weight:500;color:var(--muted);padding:2px 16px 2px 0;vertical-align:top;white-space:nowrap}
table.kv td{padding:2px 0;word-break:break-word}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;background:var(--bg);padding:1px 4px;border-radius:4px}
pre{background:var(--bg);padding:12px;overflow:auto;font-size:12px;border-radius:6px}
details{margin:8px 0}
table.data details{margin:4px 0 0}table.data details pre{margin:4px 0;font-size:11px;white-space:pre}
summary{cursor:pointer;color:var(--muted);font-size:12px}
footer{color:var(--muted);font-size:12px;text-align:center;padding:16px;border-top:1px solid var(--line)}
"""

# Legend interaction only; the page is complete without it.
JS = """
(function () {
  "use strict";
  document.querySelectorAll("ul.legend").forEach(function (legend) {
    var svgEl = legend.parentNode.querySelector("svg.gt-plot");
    if (!svgEl) { return; }
    var lines = Array.prototype.slice.call(svgEl.querySelectorAll(".gt-line"));
    function matching(name) {
      return lines.filter(function (p) { return p.getAttribute("data-series") === name; });
    }
    legend.querySelectorAll("li").forEach(function (item) {
      var name = item.getAttribute("data-series");
      item.addEventListener("mouseenter", function () {
        svgEl.classList.add("dim");
        matching(name).forEach(function (p) { p.classList.add("hl"); });
      });
      item.addEventListener("mouseleave", function () {
        svgEl.classList.remove("dim");
        matching(name).forEach(function (p) { p.classList.remove("hl"); });
      });
      item.addEventListener("click", function () {
        var off = item.classList.toggle("off");
        matching(name).forEach(function (p) { p.classList.toggle("off", off); });
      });
    });
  });
  document.querySelectorAll("button.more-toggle").forEach(function (button) {
    button.addEventListener("click", function () {
      var table = document.getElementById("nonfinite-table");
      var all = table.classList.toggle("all");
      button.textContent = all ? "show fewer rows" : button.getAttribute("data-label");
    });
    button.setAttribute("data-label", button.textContent);
  });
  var search = document.getElementById("layer-search");
  var layerRows = Array.prototype.slice.call(document.querySelectorAll("#layer-table tbody tr"));
  if (search) {
    search.addEventListener("input", function () {
      var q = search.value.trim().toLowerCase();
      document.querySelectorAll("#layer-table tr.spark").forEach(function (r) { r.remove(); });
      var shown = 0;
      layerRows.forEach(function (row) {
        var hit = !q || row.cells[0].textContent.toLowerCase().indexOf(q) >= 0;
        row.style.display = hit ? "" : "none";
        if (hit) { shown += 1; }
      });
      document.getElementById("layer-count").textContent =
          shown + " of " + layerRows.length + " tensors";
    });
  }
  function spark(row) {
    var bytes = atob(row.getAttribute("data-heat"));
    var lo = +row.getAttribute("data-lo"), hi = +row.getAttribute("data-hi");
    var w = 900, h = 90, n = bytes.length, d = "", marks = "", up = true;
    for (var i = 0; i < n; i++) {
      var b = bytes.charCodeAt(i), x = (i + 0.5) / n * w;
      if (b === 254) {
        marks += '<rect class="gt-spark-nonfinite" x="' + (x - 1.5).toFixed(1) +
            '" y="0" width="3" height="' + h + '"/>';
      }
      if (b >= 1 && b <= 253) {
        d += (up ? "M" : "L") + x.toFixed(1) + "," + (h - 4 - (b - 1) / 252 * (h - 8)).toFixed(1) + " ";
        up = false;
      } else { up = true; }
    }
    var tr = document.createElement("tr");
    tr.className = "spark";
    var cell = document.createElement("td");
    cell.colSpan = row.cells.length;
    // parsed as HTML: the svg element lands in the SVG namespace
    cell.innerHTML = '<svg class="gt-spark" viewBox="0 0 ' + w + " " + h + '">' + marks +
        '<path d="' + d + '" fill="none" stroke="#4e79a7" stroke-width="1.4"></path></svg>' +
        '<div class="muted"></div>';
    cell.lastChild.textContent = "steps " + row.getAttribute("data-steps") +
        "; log10 of the norm from " + lo.toFixed(2) + " (bottom) to " + hi.toFixed(2) + " (top)";
    tr.appendChild(cell);
    return tr;
  }
  layerRows.forEach(function (row) {
    if (!row.hasAttribute("data-heat")) { return; }
    row.classList.add("has-spark");
    row.addEventListener("click", function () {
      var next = row.nextElementSibling;
      if (next && next.classList.contains("spark")) { next.remove(); return; }
      row.parentNode.insertBefore(spark(row), row.nextSibling);
    });
  });
  document.documentElement.setAttribute("data-gt-ready", "1");
})();
"""
