/* cockpit's HTML dashboard: draws the data of cockpit/plotting/html.py with uPlot.
 *
 * Gauges drawn against the iteration share one step range: a drag zooms, the wheel
 * zooms around the pointer, shift + wheel pans, a double click shows every step.
 * Hovering shows the values of every run at the nearest step (#cockpit-tip). The
 * run boxes switch runs on and off on every gauge. window.cockpit exposes the
 * plots for tests (pointAt gives the page position of a point).
 */
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("cockpit-data").textContent);
  let RUNS = DATA.runs;
  let SEVERAL = DATA.several;
  // What the reader chose; kept when the page is drawn again (live updates).
  const ui = { zoom: null, smoothing: "fit", weight: 0.6, charts: {}, histStep: null,
               full: null, filter: "" };
  const RED = "#c4393b";
  const GRAY = "#8c8c8c";
  const DARK = "#333333";
  const DASHES = [[], [6, 4], [2, 3]];
  const SEVERITY = { error: RED, warning: "#e07b26", info: GRAY, ok: "#3a9a4a" };
  let stepPlots = [];
  let allPlots = [];
  const shown = RUNS.map(() => true);
  let syncing = false;
  let stepRange = null;

  // --- small helpers ---------------------------------------------------------
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text != null) node.textContent = text;
    return node;
  }
  function fmt(v) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
    return String(Number(v.toPrecision(6)));
  }
  function short(v) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2).replace(/\.?0+e/, "e");
    return String(Number(v.toPrecision(3)));
  }
  // Ticks of a log axis: powers of ten in range, at most about six of them (every
  // k-th power on a wide range), the ends where there is less than two.
  function logSplits(u, axis, min, max) {
    if (!(min > 0) || !(max > min)) return [min, max];
    const lo = Math.ceil(Math.log10(min) - 1e-9), hi = Math.floor(Math.log10(max) + 1e-9);
    const every = Math.max(1, Math.ceil((hi - lo + 1) / 6));
    const out = [];
    for (let e = lo; e <= hi; e += every) out.push(Math.pow(10, e));
    if (out.length >= 2) return out;
    // less than two powers: 1, 2 and 5 times the powers, evenly spread on the axis
    const ticks = [];
    for (let e = lo - 1; e <= hi + 1; e++) {
      for (const m of [1, 2, 5]) {
        const v = m * Math.pow(10, e);
        if (v >= min * 0.999 && v <= max * 1.001) ticks.push(v);
      }
    }
    return ticks.length >= 2 ? ticks : [min, max];
  }
  // Tick labels (uPlot leaves out some labels of a log axis: those stay blank).
  function keepAll(u, splits) {
    return splits;
  }
  function tickLabels(u, v) {
    return v.map((x) => (x == null ? "" : short(x)));
  }
  // Width of a y axis: its widest tick label plus room for the title.
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    if (cycleNum > 1) return axis._size;
    let widest = 0;
    for (const v of values || []) widest = Math.max(widest, String(v).length);
    return Math.ceil(widest * 6.8) + (axis.label ? 24 : 10);
  }
  function finiteOf(values, log) {
    return values.filter((v) => v != null && isFinite(v) && (!log || v > 0));
  }
  function quantile(sorted, p) {
    if (!sorted.length) return null;
    const i = Math.min(sorted.length - 1, Math.max(0, Math.round(p * (sorted.length - 1))));
    return sorted[i];
  }
  // The y range of a chart: what every run spends most of its steps in, so a run
  // that diverged does not squash the others (its values beyond are clipped and
  // marked at the edge). Per run: Tukey's far-out fences (3 interquartile ranges
  // beyond the quartiles), ignoring outliers his inner fences (1.5); never beyond
  // its values; the union over the runs, on a log axis in decades.
  function runBounds(values, log, ignore) {
    const v = finiteOf(values, log).map((x) => (log ? Math.log10(x) : x)).sort((a, b) => a - b);
    if (!v.length) return null;
    const q1 = quantile(v, 0.25), q3 = quantile(v, 0.75), iqr = q3 - q1;
    const k = ignore ? 1.5 : 3;
    return [Math.max(v[0], q1 - k * iqr), Math.min(v[v.length - 1], q3 + k * iqr)];
  }
  function robustRange(groups, log, ignore) {
    let lo = Infinity, hi = -Infinity;
    for (const values of groups) {
      const b = runBounds(values, log, ignore);
      if (!b) continue;
      lo = Math.min(lo, b[0]); hi = Math.max(hi, b[1]);
    }
    if (!isFinite(lo)) return null;
    if (hi <= lo) { const w = Math.abs(hi) * 0.1 || 1; lo -= w; hi += w; }
    const pad = 0.05 * (hi - lo);
    lo -= pad; hi += pad;
    return log ? [Math.pow(10, lo), Math.pow(10, hi)] : [lo, hi];
  }
  // Whether values spread over more than two decades (within their fences).
  function wide(groups) {
    let lo = Infinity, hi = -Infinity;
    for (const values of groups) {
      if (values.some((v) => v != null && isFinite(v) && v <= 0)) return false;
      const b = runBounds(values, false, false);
      if (b) { lo = Math.min(lo, b[0]); hi = Math.max(hi, b[1]); }
    }
    return lo > 0 && hi / lo > 100;
  }
  // TensorBoard's smoothing: an exponential moving average, debiased at the start.
  function ema(ys, weight) {
    const out = new Array(ys.length);
    let last = 0, count = 0;
    for (let i = 0; i < ys.length; i++) {
      const v = ys[i];
      if (v == null || !isFinite(v)) { out[i] = null; continue; }
      count++;
      last = last * weight + (1 - weight) * v;
      out[i] = weight > 0 ? last / (1 - Math.pow(weight, count)) : v;
    }
    return out;
  }
  function download(name, blob) {
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
  }
  function seriesOf(run, key, reduce) {
    return (run.series || {})[key + "|" + (reduce || "scalar")] || null;
  }
  function ratesOf(run) {
    return Object.keys(run.series || {}).filter((k) => k.startsWith("learning_rates#"))
      .sort((a, b) => Number(a.split("#")[1]) - Number(b.split("#")[1]))
      .map((k) => run.series[k]);
  }
  function alphaOf(run) {
    const s = seriesOf(run, "Alpha", "sample");
    return s ? s.values.filter((v) => v != null) : (run.alpha || []);
  }
  function histsOf(run, key) {
    const h = run.hists && run.hists[key];
    const items = h ? (h.items || h) : [];
    const last = run.latest && run.latest[key];
    const latest = last && (key === "GradHist2d" ? last.all : last);
    if (latest && (!items.length || items[items.length - 1].step < latest.step)) return items.concat([latest]);
    return items;
  }
  // The histogram of a run shown at the chosen step: the last one at or before it.
  function histAt(run, key, step) {
    const items = histsOf(run, key);
    if (!items.length) return null;
    if (step == null) return items[items.length - 1];
    let found = null;
    for (const h of items) { if (h.step <= step) found = h; else break; }
    return found || items[0];
  }
  function histSteps(key) {
    const set = new Set();
    RUNS.forEach((run, r) => { if (shown[r]) for (const h of histsOf(run, key)) set.add(h.step); });
    return Array.from(set).sort((a, b) => a - b);
  }
  // The step the histograms show: the reader's (slider), else the last step in
  // the zoomed range.
  function histStep() {
    if (ui.histStep != null) return ui.histStep;
    return ui.zoom ? ui.zoom[1] : null;
  }
  function runName(run) {
    return run.label;
  }
  function colorOf(run, fallback) {
    return SEVERAL ? run.color : fallback || run.color;
  }
  // The trend line of the PNG: at each point the least-squares line through
  // the 9 points centred on it (moved inwards at the ends), at its step.
  function trend(xs, ys) {
    const n = xs.length;
    const width = Math.min(9, n);
    if (width < 3) return ys.slice();
    const out = new Array(n);
    for (let i = 0; i < n; i++) {
      const start = Math.min(Math.max(i - Math.floor(width / 2), 0), n - width);
      let mx = 0, my = 0;
      for (let j = start; j < start + width; j++) { mx += xs[j]; my += ys[j]; }
      mx /= width; my /= width;
      let sxx = 0, sxy = 0;
      for (let j = start; j < start + width; j++) {
        sxx += (xs[j] - mx) * (xs[j] - mx);
        sxy += (xs[j] - mx) * (ys[j] - my);
      }
      out[i] = my + (sxx > 0 ? sxy / sxx : 0) * (xs[i] - mx);
    }
    return out;
  }
  // Several series on their own steps, aligned on the union of the steps.
  function align(parts) {
    const set = new Set();
    for (const p of parts) for (const s of p.steps) set.add(s);
    const xs = Array.from(set).sort((a, b) => a - b);
    const where = new Map(xs.map((s, i) => [s, i]));
    const columns = parts.map((p) => {
      const col = new Array(xs.length).fill(null);
      p.steps.forEach((s, i) => { col[where.get(s)] = p.values[i]; });
      return col;
    });
    return [xs, columns];
  }

  // --- tooltip ---------------------------------------------------------------
  const tip = el("div");
  tip.id = "cockpit-tip";
  function showTip(u, lines) {
    if (!lines.length || u.cursor.left == null || u.cursor.left < 0) {
      tip.style.display = "none";
      return;
    }
    tip.textContent = "";
    for (const line of lines) {
      const row = el("div");
      if (line.color) {
        const sw = el("span", "swatch");
        sw.style.background = line.color;
        row.appendChild(sw);
      }
      row.appendChild(document.createTextNode(line.text));
      tip.appendChild(row);
    }
    const box = u.over.getBoundingClientRect();
    tip.style.display = "block";
    const x = box.left + u.cursor.left + 14;
    const y = box.top + u.cursor.top + 14;
    tip.style.left = Math.min(x, window.innerWidth - tip.offsetWidth - 4) + "px";
    tip.style.top = Math.min(y, window.innerHeight - tip.offsetHeight - 4) + "px";
  }
  function nearest(col, idx) {
    if (col[idx] != null) return idx;
    for (let d = 1; d < 64; d++) {
      if (idx - d >= 0 && col[idx - d] != null) return idx - d;
      if (idx + d < col.length && col[idx + d] != null) return idx + d;
    }
    return null;
  }

  // --- zoom and pan on steps ---------------------------------------------------
  function setSteps(min, max, origin) {
    syncing = true;
    for (const p of stepPlots) {
      if (p.u !== origin) p.u.setScale("x", { min: min, max: max });
    }
    syncing = false;
  }
  function allSteps() {
    if (stepRange) setSteps(stepRange[0], stepRange[1], null);
  }
  function wheel(u) {
    u.over.addEventListener("wheel", (e) => {
      e.preventDefault();
      const min = u.scales.x.min, max = u.scales.x.max;
      const span = max - min;
      let lo, hi;
      if (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY)) {
        const delta = Math.sign(e.deltaX || e.deltaY) * 0.1 * span;
        lo = min + delta; hi = max + delta;
      } else {
        const at = u.posToVal(e.offsetX, "x");
        const factor = e.deltaY < 0 ? 0.8 : 1.25;
        lo = at - (at - min) * factor; hi = at + (max - at) * factor;
      }
      setSteps(lo, hi, null);
    }, { passive: false });
  }

  // --- shading of non-finite steps ---------------------------------------------
  function shadeNonfinite(u) {
    const ctx = u.ctx;
    ctx.save();
    RUNS.forEach((run, r) => {
      if (!shown[r]) return;
      for (const [first, last] of run.nonfinite) {
        const x0 = u.valToPos(first, "x", true);
        const x1 = u.valToPos(last, "x", true);
        ctx.fillStyle = "rgba(196,57,59,0.13)";
        if (x1 > x0) ctx.fillRect(x0, u.bbox.top, x1 - x0, u.bbox.height);
        ctx.fillStyle = "rgba(196,57,59,0.8)";
        ctx.fillRect(x0 - 1, u.bbox.top, 2, u.bbox.height);
      }
    });
    ctx.restore();
  }

  // --- a plot against the iteration ------------------------------------------------
  // parts: [{run, label, values, steps, color, dash, scale, kind: points|line|steps,
  //          hover}]; scales: {y: {log}, y2: {...}}.
  let drawing = null;  // the gauge being drawn (its reader's settings)
  let hovered = null;  // the plot under the pointer (the one with the tooltip)
  function chartOpt(name) {
    if (!ui.charts[name]) ui.charts[name] = {};
    return ui.charts[name];
  }
  function smoothedLine(tx, ty) {
    if (ui.smoothing === "none") return ty.map(() => null);
    if (ui.smoothing === "ema") return ema(ty, ui.weight);
    return trend(tx, ty);
  }
  function stepPlot(target, parts, scales, axes, extra) {
    const name = drawing;
    const opt = chartOpt(name);
    if (opt.log != null && scales.y) scales.y.log = opt.log;
    if (scales.y && scales.y.log) {  // a log axis draws positive values only
      parts = parts.map((p) => (p.scale === "y" || !p.scale
        ? Object.assign({}, p, { values: p.values.map((v) => (v > 0 ? v : null)) }) : p));
    }
    const [xs, columns] = align(parts);
    const series = [{}];
    const data = [xs];
    const owners = [];
    const hovers = [];
    parts.forEach((p, i) => {
      const color = p.color;
      const base = { label: p.label, scale: p.scale || "y", stroke: color, spanGaps: true };
      if (p.kind === "points") {
        series.push(Object.assign(base, {
          paths: () => null,
          points: { show: true, size: 4, stroke: color, fill: color, width: 0 },
        }));
        data.push(columns[i]);
        owners.push([series.length - 1, p.run]);
        hovers.push({ index: series.length - 1, part: p });
        const tx = [], ty = [];
        p.steps.forEach((s, j) => { if (p.values[j] != null) { tx.push(s); ty.push(p.values[j]); } });
        const smooth = smoothedLine(tx, ty);
        const where = new Map(xs.map((s, j) => [s, j]));
        const col = new Array(xs.length).fill(null);
        tx.forEach((s, j) => { col[where.get(s)] = smooth[j]; });
        series.push({ label: p.label + " trend", scale: p.scale || "y", spanGaps: true,
                      stroke: p.trendColor || color, width: 1.6, dash: p.dash || [],
                      points: { show: false } });
        data.push(col);
        owners.push([series.length - 1, p.run]);
      } else {
        series.push(Object.assign(base, {
          width: 1.4, dash: p.dash || [], points: { show: false },
          paths: p.kind === "steps" ? uPlot.paths.stepped({ align: 1 }) : undefined,
        }));
        data.push(columns[i]);
        owners.push([series.length - 1, p.run]);
        hovers.push({ index: series.length - 1, part: p });
      }
    });
    const scaleSpec = {
      x: { time: false, range: (u, min, max) => (min === max ? [min - 1, max + 1] : [min, max]) },
    };
    for (const [key, spec] of Object.entries(scales)) {
      scaleSpec[key] = { distr: spec.log ? 3 : 1, range: spec.range };
    }
    if (scales.y && !scales.y.range) {
      // robust: over the runs shown, within the steps in view
      scaleSpec.y.range = (u, min, max) => {
        const lo = u.scales.x.min, hi = u.scales.x.max;
        const groups = parts.filter((p) => (p.scale || "y") === "y" && shown[p.run]).map((p) =>
          p.values.filter((v, j) => lo == null || (p.steps[j] >= lo && p.steps[j] <= hi)));
        const found = robustRange(groups, scales.y.log, !!opt.outliers);
        if (found) return found;
        if (min == null || !isFinite(min)) return scales.y.log ? [0.1, 10] : [0, 1];
        return min === max ? [min - 1, max + 1] : [min, max];
      };
    }
    const readout = target.closest(".gauge") && target.closest(".gauge").querySelector(".readout");
    const plot = { u: null, owners, parts, xs, kind: "steps", name, clipped: 0, readout };
    function markClipped(u) {
      const ymin = u.scales.y ? u.scales.y.min : null, ymax = u.scales.y ? u.scales.y.max : null;
      if (ymin == null) return;
      let count = 0;
      const ctx = u.ctx;
      ctx.save();
      for (const h of hovers) {
        if ((h.part.scale || "y") !== "y" || !shown[h.part.run] || !u.series[h.index].show) continue;
        const col = u.data[h.index];
        ctx.fillStyle = h.part.color;
        for (let j = 0; j < col.length; j++) {
          const v = col[j];
          if (v == null || (v <= ymax && v >= ymin)) continue;
          const x = u.valToPos(u.data[0][j], "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          count++;
          const up = v > ymax;
          const y = up ? u.bbox.top + 1 : u.bbox.top + u.bbox.height - 1;
          ctx.beginPath();
          ctx.moveTo(x, y); ctx.lineTo(x - 4, y + (up ? 7 : -7)); ctx.lineTo(x + 4, y + (up ? 7 : -7));
          ctx.closePath(); ctx.fill();
        }
      }
      ctx.restore();
      plot.clipped = count;
    }
    const opts = {
      width: 400, height: 200,
      legend: { show: false },
      cursor: {
        drag: { x: true, y: false, setScale: true },
        sync: { key: "cockpit-steps" },
        points: { size: 6 },
        bind: { dblclick: () => () => { ui.zoom = null; allSteps(); return null; } },
      },
      scales: scaleSpec,
      series: series,
      axes: axes,
      hooks: {
        drawClear: [shadeNonfinite],
        draw: [markClipped].concat(extra && extra.draw ? [extra.draw] : []),
        setScale: [(u, key) => {
          if (key === "x" && !syncing) {
            if (u.scales.x.min != null && stepRange &&
                (u.scales.x.min > stepRange[0] || u.scales.x.max < stepRange[1])) {
              ui.zoom = [u.scales.x.min, u.scales.x.max];
            }
            setSteps(u.scales.x.min, u.scales.x.max, u);
          }
        }],
        setCursor: [(u) => {
          const idx = u.cursor.idx;
          if (idx == null || u.cursor.left == null || u.cursor.left < 0) {
            if (u === hovered) showTip(u, []);
            return;  // the readouts are cleared when the pointer leaves (not on a resize)
          }
          const lines = [];
          for (const h of hovers) {
            if (!shown[h.part.run] || !u.series[h.index].show) continue;
            const col = u.data[h.index];
            const j = nearest(col, idx);
            if (j == null) continue;
            const who = SEVERAL ? runName(RUNS[h.part.run]) + " · " : "";
            lines.push({ color: h.part.color, step: u.data[0][j], label: h.part.label, value: col[j],
                         text: `${who}step ${u.data[0][j]}: ${h.part.label} ${fmt(col[j])}` });
          }
          if (u === hovered) showTip(u, lines);
          if (readout) {
            readout.textContent = "";
            if (lines.length) readout.appendChild(el("b", null, `step ${u.data[0][idx]}: `));
            lines.forEach((line) => {
              const span = el("span");
              const sw = el("span", "swatch"); sw.style.background = line.color;
              span.appendChild(sw);
              span.appendChild(document.createTextNode(`${line.label} ${fmt(line.value)}`));
              readout.appendChild(span);
            });
          }
        }],
      },
    };
    const u = new uPlot(opts, data, target);
    plot.u = u;
    wheel(u);
    u.over.addEventListener("mouseenter", () => { hovered = u; });
    u.over.addEventListener("mouseleave", () => {
      tip.style.display = "none"; hovered = null;
      document.querySelectorAll(".readout").forEach((node) => { node.textContent = ""; });
    });
    stepPlots.push(plot);
    allPlots.push(plot);
    return plot;
  }

  function stepAxes(ylabel, log, twin) {
    const opt = chartOpt(drawing);
    if (opt.log != null) log = opt.log;
    const axes = [
      { label: "iteration", labelSize: 16, size: 30, values: tickLabels },
      { label: ylabel, labelSize: 16, size: axisSize, gap: 3, values: tickLabels,
        splits: log ? logSplits : undefined, filter: log ? keepAll : undefined },
    ];
    if (twin) {
      axes.push({ side: 1, scale: "y2", label: twin.label, labelSize: 16, size: axisSize, gap: 3,
                  grid: { show: false }, values: twin.values || ((u, v) => v.map(short)),
                  splits: twin.log ? logSplits : undefined, filter: twin.log ? keepAll : undefined });
    }
    return axes;
  }

  // --- the gauges ----------------------------------------------------------------
  function legend(box, items, missing) {
    const line = box.querySelector(".legend");
    line.textContent = "";
    for (const item of items) {
      const span = el("span");
      if (item.run != null) span.dataset.run = item.run;
      const sw = el("span", "swatch");
      sw.style.background = item.color;
      if (item.dash) sw.style.background = `repeating-linear-gradient(90deg, ${item.color} 0 4px, transparent 4px 7px)`;
      span.appendChild(sw);
      span.appendChild(document.createTextNode(item.text));
      line.appendChild(span);
    }
    if (missing.length) {
      line.appendChild(el("span", "missing", `no ${missing.key}: ${missing.join(", ")}`));
    }
  }
  function missingRuns(keys, test) {
    const found = RUNS.filter((run) => !test(run)).map(runName);
    found.key = keys;
    return SEVERAL ? found : [];
  }

  function drawSeries(box, gauge) {
    const parts = [];
    const items = [];
    let twin = null;
    const scales = {};
    RUNS.forEach((run, r) => {
      gauge.lines.forEach((line, li) => {
        const s = seriesOf(run, line.key, line.reduce);
        if (!s || !s.steps.length) return;
        const color = SEVERAL ? run.color : (line.color || run.color);
        const scale = line.twin ? "y2" : "y";
        if (line.twin) twin = { label: gauge.twin_ylabel };
        const log = line.log == null ? s.values.length > 1 && wide([s.values]) : line.log;
        scales[scale] = { log: (scales[scale] && scales[scale].log) || log };
        parts.push({ run: r, label: line.label, steps: s.steps, values: s.values, color,
                     trendColor: SEVERAL ? run.color : (gauge.lines.length > 1 ? color : DARK),
                     dash: SEVERAL ? DASHES[li % 3] : [], scale,
                     kind: line.steps ? "steps" : "points" });
        const last = s.values[s.values.length - 1];
        const who = SEVERAL ? run.label + ": " : "";
        items.push({ run: r, color, dash: SEVERAL && li > 0,
                     text: `${who}${line.label} ${short(last)}` });
      });
    });
    const missing = missingRuns(gauge.lines.map((l) => l.key).join("/"),
      (run) => gauge.lines.some((l) => { const s = seriesOf(run, l.key, l.reduce); return s && s.steps.length; }));
    legend(box, items, missing);
    if (!parts.length) return note(box, "no finite value");
    if (!scales.y) scales.y = { log: false };
    if (twin) twin.log = !!(scales.y2 && scales.y2.log);
    const reference = gauge.reference;
    const extra = reference == null ? null : {
      draw: (u) => {
        const y = u.valToPos(reference, "y", true);
        u.ctx.save();
        u.ctx.strokeStyle = RED; u.ctx.setLineDash([5, 4]); u.ctx.lineWidth = 1;
        u.ctx.beginPath(); u.ctx.moveTo(u.bbox.left, y); u.ctx.lineTo(u.bbox.left + u.bbox.width, y);
        u.ctx.stroke(); u.ctx.restore();
      },
    };
    const target = plotCell(box);
    return stepPlot(target, parts, scales, stepAxes(gauge.ylabel, scales.y.log, twin), extra);
  }

  function drawPerformance(box, gauge) {
    const parts = [];
    const items = [];
    const logged = gauge.options.log_losses || [];
    const accs = gauge.options.accuracies || [];
    let anyAcc = false;
    RUNS.forEach((run, r) => {
      const loss = seriesOf(run, gauge.keys.loss_key);
      const who = SEVERAL ? run.label + ": " : "";
      if (loss && loss.steps.length) {
        parts.push({ run: r, label: "mini-batch loss", steps: loss.steps, values: loss.values,
                     color: SEVERAL ? run.color : "#5b8fd0", trendColor: SEVERAL ? run.color : DARK,
                     scale: "y", kind: "points" });
        items.push({ run: r, color: SEVERAL ? run.color : DARK,
                     text: `${who}loss ${short(loss.values[loss.values.length - 1])}` });
      }
      logged.forEach((key, i) => {
        const s = seriesOf(run, key);
        if (!s || !s.steps.length) return;
        const color = SEVERAL ? run.color : ["#2f6db3", RED, "#7b5ab6"][i % 3];
        parts.push({ run: r, label: key.replace("_", " "), steps: s.steps, values: s.values,
                     color, dash: SEVERAL ? [6, 3] : [], scale: "y", kind: "line" });
        if (!SEVERAL) items.push({ run: r, color, text: `${key.replace("_", " ")} ${short(s.values[s.values.length - 1])}` });
      });
      accs.forEach((key, i) => {
        const s = seriesOf(run, key);
        if (!s || !s.steps.length) return;
        anyAcc = true;
        const color = SEVERAL ? run.color : ["#3a9a4a", "#e07b26", GRAY][i % 3];
        parts.push({ run: r, label: key.replace("_", " "), steps: s.steps, values: s.values,
                     color, dash: SEVERAL ? [2, 3] : [5, 3], scale: "y2", kind: "line" });
        if (!SEVERAL) items.push({ run: r, color, dash: true, text: `${key.replace("_", " ")} ${(100 * s.values[s.values.length - 1]).toFixed(1)}%` });
      });
    });
    const missing = missingRuns(gauge.keys.loss_key, (run) => [gauge.keys.loss_key, ...logged, ...accs].some((k) => seriesOf(run, k)));
    legend(box, items, missing);
    if (!parts.length) return note(box, "no finite value");
    const groups = parts.filter((p) => p.scale === "y").map((p) => p.values);
    const scales = { y: { log: groups.flat().length > 1 && wide(groups) } };
    let twin = null;
    if (anyAcc) {
      scales.y2 = { log: false, range: () => [0, 1.02] };
      twin = { label: "accuracy", values: (u, v) => v.map((x) => Math.round(100 * x) + "%") };
    }
    return stepPlot(plotCell(box), parts, scales, stepAxes("loss", scales.y.log, twin));
  }

  function drawRates(box, gauge) {
    const parts = [];
    const items = [];
    RUNS.forEach((run, r) => {
      let groups = (run.rates || ratesOf(run)).filter((g) => g.steps.length);
      if (!groups.length) {
        const s = seriesOf(run, gauge.keys.key);
        if (s && s.steps.length) groups = [s];
      }
      groups.forEach((g, i) => {
        const color = SEVERAL ? run.color : ["#2f6db3", "#e07b26", "#3a9a4a", "#7b5ab6"][i % 4];
        const name = groups.length > 1 ? `group ${i}` : "learning rate";
        parts.push({ run: r, label: name, steps: g.steps, values: g.values, color,
                     dash: SEVERAL ? DASHES[i % 3] : [], scale: "y", kind: "steps" });
        const who = SEVERAL ? run.label + ": " : "";
        items.push({ run: r, color, text: `${who}${name} ${short(g.values[g.values.length - 1])}` });
      });
    });
    legend(box, items, missingRuns("learning rate", (run) => (run.rates || ratesOf(run)).length || seriesOf(run, gauge.keys.key)));
    if (!parts.length) return note(box, "no finite value");
    const all = finiteOf(parts.flatMap((p) => p.values), false);
    const top = all.reduce((a, b) => Math.max(a, b), -Infinity);
    const bottom = all.reduce((a, b) => Math.min(a, b), 0);
    const scales = { y: { log: false, range: () => [bottom, top > 0 ? top * 1.05 : 1] } };
    return stepPlot(plotCell(box), parts, scales, stepAxes(gauge.ylabel));
  }

  function drawTests(box, gauge) {
    const names = [["norm", gauge.keys.norm_key, "#2f6db3"], ["inner", gauge.keys.inner_key, "#e07b26"],
                   ["ortho", gauge.keys.ortho_key, "#3a9a4a"]];
    const parts = [];
    const latest = [];
    RUNS.forEach((run, r) => {
      const last = {};
      names.forEach(([name, key, color], i) => {
        const s = seriesOf(run, key);
        if (!s || !s.steps.length) return;
        last[name] = s.values[s.values.length - 1];
        parts.push({ run: r, label: name, steps: s.steps, values: s.values,
                     color: SEVERAL ? run.color : color, dash: SEVERAL ? DASHES[i] : [],
                     scale: "y", kind: "line" });
      });
      latest.push(last);
    });
    const items = SEVERAL
      ? RUNS.map((run, r) => ({ run: r, color: run.color, text: run.label })).concat(
        names.map(([name], i) => ({ color: DARK, dash: i > 0, text: name })))
      : parts.map((p) => ({ run: p.run, color: p.color, text: `${p.label} ${short(p.values[p.values.length - 1])}` }));
    legend(box, items, missingRuns("tests", (run) => names.some(([, key]) => seriesOf(run, key))));
    if (!parts.length) return note(box, "no finite value");
    const cells = plotCells(box, 2);
    const values = latest.flatMap((l) => Object.values(l));
    const limit = Math.max(1.5, 1.15 * Math.max(...values));
    const shape = new uPlot({
      width: 200, height: 200, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: false, range: (u) => { const r = Math.max((u.bbox.width || 1) / (u.bbox.height || 1), 1); return [-limit * r, limit * r]; } },
                y: { range: () => [-limit, limit] } },
      axes: [{ label: "latest, unit circle = 1", labelSize: 14, size: 30, values: tickLabels },
             { size: 36, values: tickLabels }],
      series: [{}, { paths: () => null, points: { show: false } }],
      hooks: { draw: [(u) => drawShapes(u, latest)] },
    }, [[-limit, limit], [null, null]], cells[0]);
    allPlots.push({ u: shape, owners: [], kind: "shape" });
    const scales = { y: { log: false } };
    return stepPlot(cells[1], parts, scales, stepAxes(""), {
      draw: (u) => {
        const y = u.valToPos(1, "y", true);
        u.ctx.save(); u.ctx.strokeStyle = GRAY; u.ctx.setLineDash([5, 4]);
        u.ctx.beginPath(); u.ctx.moveTo(u.bbox.left, y); u.ctx.lineTo(u.bbox.left + u.bbox.width, y);
        u.ctx.stroke(); u.ctx.restore();
      },
    });
  }

  function drawShapes(u, latest) {
    const ctx = u.ctx;
    const cx = u.valToPos(0, "x", true), cy = u.valToPos(0, "y", true);
    const unit = u.valToPos(1, "x", true) - cx;
    const left = u.bbox.left, top = u.bbox.top, w = u.bbox.width, h = u.bbox.height;
    ctx.save();
    ctx.beginPath(); ctx.rect(left, top, w, h); ctx.clip();
    latest.forEach((last, r) => {
      if (!shown[r]) return;
      const run = RUNS[r];
      if (last.inner != null) {
        const y0 = u.valToPos(last.inner, "y", true), y1 = u.valToPos(-last.inner, "y", true);
        if (SEVERAL) { ctx.strokeStyle = run.color; ctx.setLineDash([5, 3]); ctx.strokeRect(left - 2, y0, w + 4, y1 - y0); }
        else { ctx.fillStyle = "rgba(224,123,38,0.3)"; ctx.fillRect(left, y0, w, y1 - y0); }
      }
      if (last.ortho != null) {
        const x0 = u.valToPos(-last.ortho, "x", true), x1 = u.valToPos(last.ortho, "x", true);
        if (SEVERAL) { ctx.strokeStyle = run.color; ctx.setLineDash([2, 3]); ctx.strokeRect(x0, top - 2, x1 - x0, h + 4); }
        else { ctx.fillStyle = "rgba(58,154,74,0.3)"; ctx.fillRect(x0, top, x1 - x0, h); }
      }
      if (last.norm != null) {
        ctx.beginPath(); ctx.setLineDash([]);
        ctx.arc(cx, cy, Math.abs(unit * last.norm), 0, 2 * Math.PI);
        if (SEVERAL) { ctx.strokeStyle = run.color; ctx.lineWidth = 1.5; ctx.stroke(); }
        else { ctx.fillStyle = "rgba(47,109,179,0.3)"; ctx.fill(); }
      }
    });
    ctx.setLineDash([4, 3]); ctx.strokeStyle = GRAY; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.arc(cx, cy, Math.abs(unit), 0, 2 * Math.PI); ctx.stroke();
    ctx.setLineDash([]); ctx.strokeStyle = DARK;
    ctx.beginPath(); ctx.moveTo(left, cy); ctx.lineTo(left + w, cy); ctx.moveTo(cx, top); ctx.lineTo(cx, top + h); ctx.stroke();
    ctx.restore();
  }

  function drawAlpha(box, gauge) {
    const bins = gauge.options.bins || 40;
    const lo = -1.5, hi = 1.5, width = (hi - lo) / bins;
    const xs = [];
    for (let i = 0; i <= bins; i++) xs.push(lo + i * width);
    const mids = xs.map((x) => x + width / 2);
    function density(values) {
      const counts = new Array(bins + 1).fill(0);
      for (const v of values) {
        const c = Math.min(Math.max(v, lo), hi - 1e-12);
        counts[Math.floor((c - lo) / width)] += 1;
      }
      return counts.map((c) => c / (values.length * width));
    }
    const series = [{}, { label: "parabola", scale: "p", stroke: "#e07b26", width: 1.5, points: { show: false } }];
    const data = [xs, xs.map((x) => (x + width / 2) ** 2)];
    const owners = [];
    const items = [];
    const hovers = [];
    RUNS.forEach((run, r) => {
      const values = alphaOf(run);
      if (values.length < 2) return;
      const sets = SEVERAL ? [[values, run.color, run.label, false]]
        : [[values, GRAY, "all", true],
           [values.slice(-Math.max(1, Math.ceil(gauge.options.recent * values.length))), "#2f6db3",
            `last ${Math.round(100 * gauge.options.recent)}%`, true]];
      for (const [subset, color, name, fill] of sets) {
        const mean = subset.reduce((a, b) => a + b, 0) / subset.length;
        series.push({ label: name, scale: "h", stroke: color, width: fill ? 0 : 1.5,
                      fill: fill ? color + "73" : undefined, points: { show: false },
                      paths: uPlot.paths.stepped({ align: 1 }) });
        data.push(density(subset));
        owners.push([series.length - 1, r]);
        hovers.push({ index: series.length - 1, name, color, run: r });
        items.push({ run: r, color, text: `${name}: mean ${mean >= 0 ? "+" : ""}${mean.toFixed(2)}` });
      }
    });
    legend(box, items, missingRuns("Alpha", (run) => alphaOf(run).length >= 2));
    if (owners.length === 0) return note(box, "needs 2 values");
    let peak = 0;
    for (let i = 2; i < data.length; i++) peak = Math.max(peak, ...data[i]);
    const u = new uPlot({
      width: 400, height: 200, legend: { show: false },
      cursor: { drag: { x: false, y: false }, points: { show: false } },
      scales: { x: { time: false, range: () => [lo, hi] }, p: { range: () => [0, 1.75] },
                h: { range: () => [0, 1.15 * (peak || 1)] } },
      axes: [{ label: "normalized step length α", labelSize: 16, size: 30 },
             { scale: "p", show: false }],
      series, hooks: {
        setCursor: [(u) => {
          const idx = u.cursor.idx;
          if (idx == null || idx >= bins) { showTip(u, []); return; }
          const lines = [{ text: `α in [${xs[idx].toFixed(3)}, ${(xs[idx] + width).toFixed(3)})` }];
          for (const h of hovers) {
            if (shown[h.run]) lines.push({ color: h.color, text: `${SEVERAL ? "" : ""}${h.name}: density ${fmt(u.data[h.index][idx])}` });
          }
          showTip(u, lines);
        }],
        draw: [(u) => {
          u.ctx.save(); u.ctx.strokeStyle = GRAY; u.ctx.setLineDash([2, 3]);
          for (const p of [-1, 0, 1]) {
            const x = u.valToPos(p, "x", true);
            u.ctx.beginPath(); u.ctx.moveTo(x, u.bbox.top); u.ctx.lineTo(x, u.bbox.top + u.bbox.height); u.ctx.stroke();
          }
          u.ctx.restore();
        }],
      },
    }, data, plotCell(box));
    u.over.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    const plot = { u, owners, kind: "alpha" };
    allPlots.push(plot);
    return plot;
  }

  // A histogram with counts: its total, or 0 when no gradient element was finite
  // (a diverged step records all-zero counts).
  function histTotal(h) {
    let total = 0;
    for (const c of h.hist) total += Array.isArray(c) ? c.reduce((a, b) => a + (b > 0 ? b : 0), 0) : (c > 0 ? c : 0);
    return total;
  }
  function drawHist1d(box, gauge) {
    const at = histStep();
    const found = RUNS.map((run, r) => [r, histAt(run, "GradHist1d", at)]).filter(([, h]) => h);
    const empty = found.filter(([, h]) => histTotal(h) <= 0);
    const drawn = found.filter(([, h]) => histTotal(h) > 0);
    legend(box, found.map(([r, h]) => ({ run: r, color: SEVERAL ? RUNS[r].color : "#e07b26",
                                          text: `${SEVERAL ? RUNS[r].label + ": " : ""}step ${h.step}` +
                                                (histTotal(h) <= 0 ? " (no finite value)" : "") })),
           missingRuns("GradHist1d", (run) => histsOf(run, "GradHist1d").length));
    slider(box, "GradHist1d");
    if (!found.length) return note(box, "no histogram");
    if (!drawn.length) {
      const steps = empty.map(([, h]) => h.step).join(", ");
      return note(box, `no finite value at step ${steps}: every gradient element was NaN or infinite`);
    }
    const parts = drawn.map(([r, h]) => {
      const total = histTotal(h) || 1;
      const values = h.hist.map((c) => (SEVERAL ? c / total : c));
      return { r, edges: h.edges, values, step: h.step };
    });
    const positive = parts.flatMap((p) => p.values.filter((v) => v > 0));
    const floor = 0.8 * (positive.length ? Math.min(...positive) : 1);
    const xsSet = new Set();
    parts.forEach((p) => p.edges.forEach((e) => xsSet.add(e)));
    const xs = Array.from(xsSet).sort((a, b) => a - b);
    const series = [{}];
    const data = [xs];
    const owners = [];
    parts.forEach((p) => {
      const col = xs.map((x) => {
        const i = p.edges.findIndex((e, j) => j < p.edges.length - 1 && x >= e && x < p.edges[j + 1]);
        return i < 0 ? null : (p.values[i] > 0 ? p.values[i] : floor);
      });
      const color = SEVERAL ? RUNS[p.r].color : "#e07b26";
      series.push({ label: RUNS[p.r].label, stroke: color, width: SEVERAL ? 1.4 : 0,
                    fill: SEVERAL ? undefined : color + "d9", points: { show: false },
                    paths: uPlot.paths.stepped({ align: 1 }) });
      data.push(col);
      owners.push([series.length - 1, p.r]);
    });
    const u = new uPlot({
      width: 400, height: 200, legend: { show: false },
      cursor: { drag: { x: true, y: false, setScale: true }, points: { show: false } },
      scales: { x: { time: false, range: () => [xs[0], xs[xs.length - 1]] },
                y: { distr: 3, range: (u, min, max) => [floor, Math.max(max || 1, floor * 10)] } },
      axes: [{ label: "gradient element value", labelSize: 16, size: 30, values: tickLabels },
             { label: SEVERAL ? "fraction of elements" : "count", labelSize: 16, size: axisSize, gap: 3,
               values: tickLabels, splits: logSplits, filter: keepAll }],
      series, hooks: { setCursor: [(u) => {
        const idx = u.cursor.idx;
        const readout = box.querySelector(".readout");
        if (idx == null) { showTip(u, []); if (readout) readout.textContent = ""; return; }
        const lines = [];
        owners.forEach(([s, r], k) => {
          const v = u.data[s][idx];
          if (shown[r] && v != null) lines.push({ color: u.series[s].stroke(), text: `${SEVERAL ? RUNS[r].label + " · " : ""}step ${parts[k].step} [${short(xs[idx])}, ${short(xs[idx + 1])}): ${fmt(v <= floor ? 0 : v)}` });
        });
        showTip(u, lines);
        if (readout) readout.textContent = lines.map((l) => l.text).join("  ");
      }] },
    }, data, plotCell(box));
    u.over.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    const plot = { u, owners, kind: "hist", name: "hist_1d", parts, xs };
    allPlots.push(plot);
    return plot;
  }

  // The step slider of the histograms: the steps they were kept at; the chosen
  // one is shared by every histogram gauge and follows the zoom until moved.
  function slider(box, key) {
    const steps = histSteps(key);
    const line = el("div", "slider");
    box.querySelector(".plot").before(line);
    if (steps.length < 2) return;
    const at = histStep();
    let index = steps.length - 1;
    if (at != null) { index = 0; steps.forEach((s, i) => { if (s <= at) index = i; }); }
    const input = el("input");
    input.type = "range"; input.min = 0; input.max = steps.length - 1; input.value = index;
    input.dataset.key = key;
    const label = el("span", null, `step ${steps[index]}`);
    input.addEventListener("input", () => {
      label.textContent = `step ${steps[Number(input.value)]}`;
    });
    input.addEventListener("change", () => {
      ui.histStep = steps[Number(input.value)];
      redrawHists();
    });
    const latest = el("button", null, "latest");
    latest.title = "follow the zoom (the last step in view)";
    latest.addEventListener("click", () => { ui.histStep = null; redrawHists(); });
    line.appendChild(el("span", null, "histogram at "));
    line.appendChild(input);
    line.appendChild(label);
    line.appendChild(latest);
  }

  // magma_r, sampled: empty bins stay blank.
  const MAGMA = [[252, 253, 191], [254, 176, 120], [241, 96, 93], [183, 55, 121],
                 [114, 31, 129], [44, 17, 95], [0, 0, 4]];
  function magma(t) {
    const x = Math.min(Math.max(t, 0), 1) * (MAGMA.length - 1);
    const i = Math.min(Math.floor(x), MAGMA.length - 2), f = x - i;
    const c = MAGMA[i].map((v, k) => Math.round(v + f * (MAGMA[i + 1][k] - v)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  function drawHist2d(box, gauge, param) {
    const name = param == null ? "all" : "param_" + param;
    const at = histStep();
    const pick = (run) => (param == null ? histAt(run, "GradHist2d", at)
      : run.latest && run.latest.GradHist2d && run.latest.GradHist2d[name]);
    const found = RUNS.map((run, r) => [r, pick(run)]).filter(([, h]) => h);
    legend(box, found.map(([r, h]) => ({ run: r, color: SEVERAL ? RUNS[r].color : DARK,
                                          text: `${SEVERAL ? RUNS[r].label + ": " : ""}step ${h.step}` +
                                                (histTotal(h) <= 0 ? " (no finite value)" : "") })),
           missingRuns("GradHist2d", (run) => pick(run)));
    if (param == null) slider(box, "GradHist2d");
    if (!found.length) return note(box, "no histogram");
    if (found.every(([, h]) => histTotal(h) <= 0)) {
      return note(box, `no finite value at step ${found.map(([, h]) => h.step).join(", ")}`);
    }
    const cells = plotCells(box, found.length);
    found.forEach(([r, h], i) => {
      if (SEVERAL) {
        const title = el("div", "subtitle", RUNS[r].label);
        title.style.color = RUNS[r].color;
        title.dataset.run = r;
        cells[i].parentNode.appendChild(title);
      }
      const gradEdges = h.edges[0], paramEdges = h.edges[1];
      let top = 0;
      for (const row of h.hist) for (const c of row) top = Math.max(top, c);
      const u = new uPlot({
        width: 200, height: 200, legend: { show: false },
        cursor: { drag: { x: false, y: false }, points: { show: false } },
        scales: { x: { time: false, range: () => [paramEdges[0], paramEdges[paramEdges.length - 1]] },
                  y: { range: () => [gradEdges[0], gradEdges[gradEdges.length - 1]] } },
        axes: [{ label: "parameter value", labelSize: 16, size: 30, values: tickLabels },
               { label: i === 0 ? "gradient element" : "", labelSize: 16, size: 46, values: tickLabels }],
        series: [{}, { paths: () => null, points: { show: false } }],
        hooks: {
          draw: [(u) => {
            if (!shown[r]) return;
            const ctx = u.ctx;
            const scale = Math.log10(top + 1) || 1;
            h.hist.forEach((row, gi) => row.forEach((c, pi) => {
              if (c <= 0) return;
              const x0 = u.valToPos(paramEdges[pi], "x", true), x1 = u.valToPos(paramEdges[pi + 1], "x", true);
              const y0 = u.valToPos(gradEdges[gi + 1], "y", true), y1 = u.valToPos(gradEdges[gi], "y", true);
              ctx.fillStyle = magma(Math.log10(c + 1) / scale);
              ctx.fillRect(x0, y0, Math.max(x1 - x0, 1), Math.max(y1 - y0, 1));
            }));
          }],
          setCursor: [(u) => {
            if (u.cursor.left == null || u.cursor.left < 0) { showTip(u, []); return; }
            const pv = u.posToVal(u.cursor.left, "x"), gv = u.posToVal(u.cursor.top, "y");
            const pi = paramEdges.findIndex((e, j) => j < paramEdges.length - 1 && pv >= e && pv < paramEdges[j + 1]);
            const gi = gradEdges.findIndex((e, j) => j < gradEdges.length - 1 && gv >= e && gv < gradEdges[j + 1]);
            if (pi < 0 || gi < 0) { showTip(u, []); return; }
            showTip(u, [{ text: `${SEVERAL ? RUNS[r].label + " · " : ""}step ${h.step}: count ${h.hist[gi][pi]}` }]);
          }],
        },
      }, [[paramEdges[0], paramEdges[paramEdges.length - 1]], [null, null]], cells[i]);
      u.over.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      allPlots.push({ u, owners: [], kind: "heat", run: r, name: param == null ? "hist_2d" : "hist_2d_" + param, hist: h });
    });
    return null;
  }

  function drawFindings(box) {
    const target = el("div", "findings");
    box.querySelector(".plot").replaceWith(target);
    RUNS.forEach((run, r) => {
      const block = el("div");
      block.dataset.run = r;
      if (SEVERAL) {
        const head = el("div", "run", run.label);
        head.style.color = run.color;
        block.appendChild(head);
      }
      const findings = run.findings || [];
      const found = findings.filter((f) => f.id !== "not_checked");
      const skipped = findings.find((f) => f.id === "not_checked");
      const checks = skipped ? skipped.evidence.checks || {} : {};
      if (run.diagnosis === "live") {
        const upto = run.diagnosed == null ? "no step read yet" : `read up to step ${run.diagnosed}`;
        block.appendChild(el("div", "notchecked", run.status === "live"
          ? `live diagnosis (${upto}): settled evidence only; the whole-run checks run when the run ends`
          : "diagnosis of the whole run: being read"));
        if (!found.length) {
          block.appendChild(el("div", "finding", `nothing settled so far (step ${run.last_step})`));
        }
      } else if (!found.some((f) => f.severity !== "info")) {
        const ran = DATA.checks.filter((c) => !(c in checks));
        found.unshift({ severity: "ok", id: "no problems found", steps: [run.first_step, run.last_step],
                        message: `${ran.length} of ${DATA.checks.length} checks ran: ${ran.join(", ")}`,
                        evidence: null, advice: null });
      }
      for (const f of found) {
        const item = el("div", "finding");
        const badge = el("span", "badge", f.severity === "warning" ? "WARN" : f.severity.toUpperCase());
        badge.style.background = SEVERITY[f.severity] || GRAY;
        item.appendChild(badge);
        const range = f.steps[0] === f.steps[1] ? `step ${f.steps[0]}` : `steps ${f.steps[0]}–${f.steps[1]}`;
        item.appendChild(el("span", "head", `${f.id} · ${range}`));
        item.appendChild(el("div", null, f.message));
        if (f.evidence || f.advice) {
          const details = el("details");
          details.appendChild(el("summary", null, "evidence and advice"));
          const table = el("table");
          for (const [k, v] of Object.entries(f.evidence || {})) {
            const tr = el("tr");
            tr.appendChild(el("td", null, k));
            tr.appendChild(el("td", null, typeof v === "number" ? fmt(v) : JSON.stringify(v)));
            table.appendChild(tr);
          }
          details.appendChild(table);
          if (f.advice) details.appendChild(el("div", null, "Advice: " + f.advice));
          item.appendChild(details);
        }
        block.appendChild(item);
      }
      const needs = Object.entries(checks);
      if (needs.length) {
        block.appendChild(el("div", "notchecked", "not checked: " + needs.map(([c, n]) => `${c} (needs ${n})`).join("; ")));
      }
      target.appendChild(block);
    });
    return null;
  }

  // --- layout ----------------------------------------------------------------------
  function note(box, text) {
    box.querySelector(".plot").appendChild(el("div", "note", text));
    return null;
  }
  function plotCell(box) {
    return plotCells(box, 1)[0];
  }
  function plotCells(box, n) {
    const plot = box.querySelector(".plot");
    const cells = [];
    for (let i = 0; i < n; i++) {
      const cell = el("div", "cell");
      const sub = el("div", "sub");
      cell.appendChild(sub);
      plot.appendChild(cell);
      cells.push(sub);
    }
    return cells;
  }
  const STEP_KINDS = new Set(["series", "performance", "learning_rates", "tests"]);
  function tool(bar, text, title, action, on) {
    const b = el("button", on ? "on" : null, text);
    b.title = title;
    b.addEventListener("click", action);
    bar.appendChild(b);
    return b;
  }
  function gaugeBox(parent, name, title, key) {
    const gauge = DATA.gauges[name];
    const box = el("div", "gauge");
    box.dataset.gauge = key || name;
    const head = el("div", "head");
    head.appendChild(el("h3", null, title || gauge.title));
    if (gauge.kind !== "findings") {
      const bar = el("span", "tools");
      const opt = chartOpt(key || name);
      if (STEP_KINDS.has(gauge.kind)) {
        tool(bar, "log", "logarithmic / linear y axis", () => {
          const plot = gaugePlots[key || name];
          const now = plot && plot.u.scales.y ? plot.u.scales.y.distr === 3 : false;
          opt.log = !now; render();
        }, gaugePlots[key || name] && opt.log);
        tool(bar, "outliers", "ignore outliers in the y range (2nd to 98th percentile)",
             () => { opt.outliers = !opt.outliers; render(); }, opt.outliers);
      }
      tool(bar, "⤢", "full screen (Esc: back)", () => {
        ui.full = ui.full === (key || name) ? null : key || name; render();
      }, ui.full === (key || name));
      tool(bar, "CSV", "download the values drawn as CSV", () => downloadCsv(key || name));
      tool(bar, "PNG", "download the chart as PNG", () => downloadPng(key || name));
      head.appendChild(bar);
    }
    box.appendChild(head);
    if (gauge.caption) box.appendChild(el("div", "caption", gauge.caption));
    box.appendChild(el("div", "legend"));
    box.appendChild(el("div", "readout"));
    box.appendChild(el("div", "plot"));
    if (ui.full === (key || name)) box.classList.add("full");
    parent.appendChild(box);
    return box;
  }
  const DRAW = {
    series: drawSeries, performance: drawPerformance, learning_rates: drawRates,
    tests: drawTests, alpha: drawAlpha, hist_1d: drawHist1d,
    hist_2d: (box, g) => drawHist2d(box, g, null), findings: drawFindings,
  };
  let gaugePlots = {};
  function drawGauge(parent, name, title, param) {
    const key = param == null ? name : `${name}_${param}`;
    drawing = key;
    const box = gaugeBox(parent, name, title, key);
    const gauge = DATA.gauges[name];
    const plot = param == null ? DRAW[gauge.kind](box, gauge) : drawHist2d(box, gauge, param);
    if (plot) gaugePlots[key] = plot;
    drawing = null;
    return box;
  }
  const PANELS = { "STEP SIZE": "#e6eef8", GRADIENTS: "#fbeee2", CURVATURE: "#e6f3e8" };

  // --- downloads ------------------------------------------------------------------------
  function csvCell(v) {
    const text = v == null ? "" : String(v);
    return /[",\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }
  function downloadCsv(name) {
    download(`${name}.csv`, new Blob([chartCsv(name)], { type: "text/csv" }));
  }
  // The values a chart draws, as CSV: steps and one column per run and line (a
  // histogram: its bins at the step shown).
  function chartCsv(name) {
    const plot = gaugePlots[name];
    if (!plot) return "";
    const rows = [];
    if (plot.kind === "steps") {
      const parts = plot.parts.filter((p) => shown[p.run]);
      const [xs, columns] = align(parts);
      rows.push(["step"].concat(parts.map((p) => (SEVERAL ? RUNS[p.run].label + " · " : "") + p.label)));
      xs.forEach((x, i) => rows.push([x].concat(columns.map((c) => c[i]))));
    } else if (plot.kind === "hist") {
      rows.push(["run", "step", "bin start", "bin end", "value"]);
      plot.parts.forEach((p) => p.values.forEach((v, i) =>
        rows.push([RUNS[p.r].label, p.step, p.edges[i], p.edges[i + 1], v])));
    } else if (plot.kind === "heat" && plot.hist) {
      const h = plot.hist;
      rows.push(["run", "step", "gradient from", "gradient to", "parameter from", "parameter to", "count"]);
      h.hist.forEach((row, gi) => row.forEach((c, pi) => rows.push([RUNS[plot.run].label, h.step,
        h.edges[0][gi], h.edges[0][gi + 1], h.edges[1][pi], h.edges[1][pi + 1], c])));
    } else {
      const u = plot.u;
      rows.push(["x"].concat(u.series.slice(1).map((s) => s.label)));
      u.data[0].forEach((x, i) => rows.push([x].concat(u.data.slice(1).map((c) => c[i]))));
    }
    return rows.map((r) => r.map(csvCell).join(",")).join("\n") + "\n";
  }
  function downloadPng(name) {
    const plot = gaugePlots[name];
    if (!plot) return;
    const canvas = plot.u.ctx.canvas;
    const out = document.createElement("canvas");
    out.width = canvas.width; out.height = canvas.height + 24;
    const ctx = out.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, out.width, out.height);
    ctx.fillStyle = "#333"; ctx.font = "bold 14px sans-serif"; ctx.textAlign = "center";
    ctx.fillText(DATA.gauges[name.replace(/_\d+$/, "")] ? DATA.gauges[name.replace(/_\d+$/, "")].title : name, out.width / 2, 17);
    ctx.drawImage(canvas, 0, 24);
    out.toBlob((blob) => download(`${name}.png`, blob), "image/png");
  }

  // --- the run table: every run, its set-up side by side, a filter --------------------
  function configKeys() {
    const keys = new Set();
    for (const run of RUNS) for (const k of Object.keys(run.config || {})) if (k !== "quantities") keys.add(k);
    return Array.from(keys).sort();
  }
  function runText(run) {
    const parts = [run.label, run.path || "", run.status || ""];
    for (const [k, v] of Object.entries(run.config || {})) parts.push(`${k}=${Array.isArray(v) ? v.join(",") : v}`);
    return parts.join(" ").toLowerCase();
  }
  function matches(run) {
    const terms = ui.filter.toLowerCase().split(/\s+/).filter(Boolean);
    const text = runText(run);
    return terms.every((t) => text.includes(t));
  }
  function runTable() {
    const wrap = el("details", "runtable");
    wrap.open = ui.tableOpen != null ? ui.tableOpen : (RUNS.length > 1 || !!DATA.live);
    wrap.addEventListener("toggle", () => { ui.tableOpen = wrap.open; });
    const summary = el("summary", null, `Runs (${RUNS.length})`);
    wrap.appendChild(summary);
    const bar = el("div", "filter");
    const search = el("input");
    search.type = "search"; search.placeholder = "filter runs: words or key=value";
    search.value = ui.filter; search.id = "cockpit-filter";
    const all = el("button", null, "show matching");
    const none = el("button", null, "hide matching");
    bar.appendChild(search); bar.appendChild(all); bar.appendChild(none);
    wrap.appendChild(bar);
    const keys = configKeys();
    const table = el("table");
    const head = el("tr");
    for (const h of ["", "run", "status", "steps", "last step"].concat(keys, ["quantities"])) head.appendChild(el("th", null, h));
    table.appendChild(head);
    const rows = [];
    RUNS.forEach((run, r) => {
      const tr = el("tr");
      tr.dataset.row = r;
      const td = el("td");
      const box = el("input");
      box.type = "checkbox"; box.checked = shown[r]; box.dataset.run = r;
      box.disabled = run.status === "error";
      box.addEventListener("change", () => setRun(r, box.checked));
      td.appendChild(box);
      const sw = el("span", "swatch"); sw.style.background = run.color;
      td.appendChild(sw);
      tr.appendChild(td);
      tr.appendChild(el("td", "name", run.label));
      const status = el("td", "status " + (run.status || "finished"),
                        (run.status || "finished") + (run.coarse ? " (preview: every 20th step, reading the rest)" : ""));
      if (run.error) status.appendChild(el("div", "errorline", run.error));
      else if (run.warning) status.title = run.warning;
      tr.appendChild(status);
      tr.appendChild(el("td", "num", run.steps != null ? String(run.steps) : ""));
      tr.appendChild(el("td", "num", run.last_step != null ? String(run.last_step) : ""));
      for (const k of keys) {
        const v = (run.config || {})[k];
        tr.appendChild(el("td", "num", v == null ? "" : Array.isArray(v) ? v.map(short).join(", ") : typeof v === "number" ? short(v) : String(v)));
      }
      const q = (run.config || {}).quantities || [];
      const cell = el("td", "quantities", `${q.length}`);
      cell.title = q.join(", ");
      tr.appendChild(cell);
      table.appendChild(tr);
      rows.push([tr, run]);
    });
    function apply() {
      for (const [tr, run] of rows) tr.style.display = matches(run) ? "" : "none";
    }
    search.addEventListener("input", () => { ui.filter = search.value; apply(); });
    all.addEventListener("click", () => setRuns(RUNS.map((run, r) => (matches(run) && run.status !== "error" ? true : shown[r]))));
    none.addEventListener("click", () => setRuns(RUNS.map((run, r) => (matches(run) ? false : shown[r]))));
    apply();
    const scroll = el("div", "tablebox");
    scroll.appendChild(table);
    wrap.appendChild(scroll);
    return wrap;
  }

  function controls() {
    const bar = el("div", "controls");
    bar.appendChild(el("span", null, "trend line: "));
    const select = el("select");
    select.id = "cockpit-smoothing";
    for (const [value, text] of [["fit", "local fit (as the PNG)"], ["ema", "smoothing (EMA)"], ["none", "none"]]) {
      const o = el("option", null, text); o.value = value; o.selected = ui.smoothing === value;
      select.appendChild(o);
    }
    select.addEventListener("change", () => { ui.smoothing = select.value; render(); });
    bar.appendChild(select);
    const weight = el("input");
    weight.type = "range"; weight.min = 0; weight.max = 0.99; weight.step = 0.01; weight.value = ui.weight;
    weight.id = "cockpit-weight";
    weight.disabled = ui.smoothing !== "ema";
    const shownWeight = el("span", null, Number(ui.weight).toFixed(2));
    weight.addEventListener("input", () => { shownWeight.textContent = Number(weight.value).toFixed(2); });
    weight.addEventListener("change", () => { ui.weight = Number(weight.value); render(); });
    bar.appendChild(weight);
    bar.appendChild(shownWeight);
    return bar;
  }

  function render() {
    const scrollY = window.scrollY;
    for (const p of allPlots) p.u.destroy();
    stepPlots = []; allPlots = []; gaugePlots = {};
    hovered = null;
    document.body.textContent = "";
    document.body.classList.toggle("fullscreen", ui.full != null);
    const header = el("header");
    header.appendChild(el("h1", null, DATA.title));
    if (DATA.live) {
      const status = el("span", "livestatus", liveStatus);
      status.id = "cockpit-live";
      header.appendChild(status);
    }
    header.appendChild(controls());
    header.appendChild(el("div", "help", "drag: zoom into steps · wheel: zoom · shift+wheel: pan · double-click: all steps · hover: values"));
    if (DATA.left_out.length) {
      header.appendChild(el("div", "leftout", "not tracked, so not shown: " + DATA.left_out.map(([, hint]) => hint.replace(/^track /, "")).join(", ")));
    }
    document.body.appendChild(header);
    document.body.appendChild(runTable());
    document.body.appendChild(tip);
    const screen = el("main", "screen");
    screen.id = "primary";
    const top = el("div", "top");
    for (const [panel, names] of DATA.layout.primary) {
      const section = el("section", "panel");
      section.style.background = PANELS[panel] || "#eee";
      section.appendChild(el("h2", null, panel));
      for (const name of names) drawGauge(section, name);
      top.appendChild(section);
    }
    if (DATA.layout.primary.length) screen.appendChild(top);
    const bottom = el("div", "bottom");
    const ratios = { hyperparameters: 1.0, performance: 1.4, findings: 1.2 };
    for (const name of DATA.layout.bottom) {
      const cell = el("section", "cell");
      cell.style.flex = `${ratios[name]} 1 0`;
      drawGauge(cell, name);
      bottom.appendChild(cell);
    }
    screen.appendChild(bottom);
    document.body.appendChild(screen);
    if (DATA.layout.aux.length || DATA.layout.layers) {
      const second = el("main", "screen");
      second.id = "secondary";
      second.appendChild(el("h2", null, "Secondary screen"));
      if (DATA.layout.aux.length) {
        const aux = el("section", "aux");
        for (const name of DATA.layout.aux) drawGauge(aux, name);
        second.appendChild(aux);
      }
      if (DATA.layout.layers) {
        const layers = el("section", "layers");
        let count = 0;
        for (const run of RUNS) {
          const h = (run.latest && run.latest.GradHist2d) || {};
          while (("param_" + count) in h) count++;
        }
        layers.style.gridTemplateColumns = `repeat(${Math.min(Math.max(count, 1), 4)}, 1fr)`;
        for (let k = 0; k < count; k++) drawGauge(layers, "hist_2d", `Parameter ${k}`, k);
        second.appendChild(layers);
      }
      document.body.appendChild(second);
    }
    const firsts = RUNS.filter((r, i) => shown[i]).map((r) => r.first_step).filter((s) => s != null);
    const lasts = RUNS.filter((r, i) => shown[i]).map((r) => r.last_step).filter((s) => s != null);
    stepRange = firsts.length ? [Math.min(...firsts), Math.max(Math.max(...lasts), Math.min(...firsts) + 1)] : [0, 1];
    resize();
    if (ui.zoom) setSteps(ui.zoom[0], ui.zoom[1], null); else allSteps();
    RUNS.forEach((run, r) => { if (!shown[r]) hideRun(r); });
    window.scrollTo(0, scrollY);
  }
  function redrawHists() { render(); }

  function resize() {
    for (const p of allPlots) {
      const box = p.u.root.parentNode;
      const w = Math.max(box.clientWidth, 60), h = Math.max(box.clientHeight, 60);
      if (p.u.width !== w || p.u.height !== h) p.u.setSize({ width: w, height: h });
    }
  }

  function hideRun(r) {
    for (const p of allPlots) {
      for (const [index, run] of p.owners) if (run === r) p.u.setSeries(index, { show: false });
      p.u.redraw(false);
    }
    document.querySelectorAll(`[data-run="${r}"]:not(input)`).forEach((node) => node.classList.add("hidden-run"));
  }
  function setRun(r, on) {
    shown[r] = on;
    if (on && DATA.live && RUNS[r].epoch == null) { fetchRun(r).then(render); return; }
    for (const p of allPlots) {
      for (const [index, run] of p.owners) if (run === r) p.u.setSeries(index, { show: on });
      p.u.redraw(false);
    }
    document.querySelectorAll(`[data-run="${r}"]:not(input)`).forEach((node) => {
      node.classList.toggle("hidden-run", !on);
    });
    document.querySelectorAll(`input[data-run="${r}"]`).forEach((node) => { node.checked = on; });
    refreshCursor();
  }
  // The values shown on hover, again for the runs shown now.
  function refreshCursor() {
    document.querySelectorAll(".readout").forEach((node) => { node.textContent = ""; });
    tip.style.display = "none";
    const u = hovered || stepPlots.map((p) => p.u).find((x) => x.cursor.left != null && x.cursor.left >= 0);
    if (u && u.cursor.left != null && u.cursor.left >= 0) u.setCursor({ left: u.cursor.left, top: u.cursor.top });
  }
  function setRuns(on) {
    on.forEach((v, r) => { shown[r] = v; });
    if (DATA.live) { Promise.all(RUNS.map((run, r) => (shown[r] && run.epoch == null ? fetchRun(r) : null))).then(render); return; }
    render();
  }

  // --- live: the page of `cockpit serve` -------------------------------------------------
  let liveStatus = "";
  let frameKey = "";
  let dirty = false;
  let lastRender = 0;
  let mouseDown = false;
  const byId = new Map();
  document.addEventListener("mousedown", () => { mouseDown = true; });
  document.addEventListener("mouseup", () => { mouseDown = false; });
  function merge(run, answer) {
    if (answer.whole || run.epoch !== answer.epoch) {
      run.series = {}; run.hists = {}; run.have = {};
    }
    for (const [name, part] of Object.entries(answer.series)) {
      const s = run.series[name] || (run.series[name] = { steps: [], values: [] });
      s.steps.length = part.from; s.values.length = part.from;
      for (const v of part.steps) s.steps.push(v);
      for (const v of part.values) s.values.push(v);
      if (part.errors) {
        if (!s.errors) s.errors = new Array(part.from).fill(null);
        s.errors.length = part.from;
        for (const v of part.errors) s.errors.push(v);
      }
      run.have[name] = part.from + part.steps.length - part.tail;
    }
    for (const [key, part] of Object.entries(answer.hists)) {
      const h = run.hists[key] || (run.hists[key] = { items: [] });
      h.items.length = part.from;
      for (const item of part.items) h.items.push(item);
      run.have["hist:" + key] = h.items.length;
    }
    for (const k of ["epoch", "version", "latest", "nonfinite", "findings", "diagnosis", "diagnosed", "config",
                     "status", "error", "warning", "steps", "first_step", "last_step", "label", "color",
                     "coarse"]) {
      run[k] = answer[k];
    }
  }
  function fetchRun(r) {
    const run = RUNS[r];
    const query = run.epoch == null ? "" :
      `?epoch=${run.epoch}&have=${encodeURIComponent(JSON.stringify(run.have || {}))}`;
    return fetch(`api/run/${run.id}${query}`).then((reply) => reply.json().then((answer) => {
      if (!reply.ok) { run.error = answer.error; return; }
      merge(run, answer);
      dirty = true;
    }));
  }
  async function tick() {
    try {
      const reply = await fetch(`api/runs?frame=${encodeURIComponent(frameKey)}`);
      const list = await reply.json();
      if (list.frame) {
        for (const k of ["title", "layout", "gauges", "left_out", "checks"]) DATA[k] = list.frame[k];
        frameKey = list.frame_key;
        dirty = true;
      }
      const fetches = [];
      for (const item of list.runs) {
        let r = byId.get(item.id);
        if (r == null) {
          r = RUNS.length;
          byId.set(item.id, r);
          RUNS.push({ id: item.id, series: {}, hists: {}, have: {}, findings: [], nonfinite: [],
                      latest: {}, epoch: null, version: null });
          shown.push(RUNS.filter((x, i) => shown[i]).length < 10);
          dirty = true;
        }
        const run = RUNS[r];
        const changed = run.version !== item.version || run.status !== item.status;
        for (const k of ["label", "color", "status", "error", "warning", "steps", "first_step",
                         "last_step", "config", "path", "coarse"]) run[k] = item[k];
        if (changed) dirty = true;
        if (shown[r] && item.status !== "error" && item.status !== "reading" && run.version !== item.version) {
          fetches.push(fetchRun(r));
        }
      }
      await Promise.all(fetches);
      const live = RUNS.filter((x) => x.status === "live").length;
      liveStatus = `live · ${RUNS.length} run${RUNS.length === 1 ? "" : "s"}, ${live} writing · updated ${new Date().toLocaleTimeString()}`;
      const status = document.getElementById("cockpit-live");
      if (status) status.textContent = liveStatus;
      const now = Date.now();
      if (dirty && !mouseDown && now - lastRender > 1500) {
        dirty = false; lastRender = now;
        render();
      }
      window.cockpit.ticks += 1;
    } catch (error) {
      liveStatus = "server not reachable: " + error;
      const status = document.getElementById("cockpit-live");
      if (status) status.textContent = liveStatus;
    }
    setTimeout(tick, DATA.live.interval || 1000);
  }

  // For tests: the page position of a point of a gauge, and what is shown.
  function pointAt(name, run, step) {
    const p = gaugePlots[name];
    if (!p || !p.xs) return null;
    const part = p.parts.findIndex((q) => q.run === run && q.kind === "points");
    if (part < 0) return null;
    const seriesIndex = 1 + p.parts.slice(0, part).reduce((n, q) => n + (q.kind === "points" ? 2 : 1), 0);
    const i = p.xs.indexOf(step);
    if (i < 0) return null;
    const value = p.u.data[seriesIndex][i];
    const box = p.u.over.getBoundingClientRect();
    return { x: box.left + p.u.valToPos(step, "x"), y: box.top + p.u.valToPos(value, p.u.series[seriesIndex].scale),
             value };
  }
  window.cockpit = {
    data: DATA, shown, setRun, pointAt, ui, render, chartCsv, ticks: 0,
    get plots() { return allPlots; },
    get stepPlots() { return stepPlots; },
    get gauges() { return gaugePlots; },
    runs: () => RUNS,
    steps: () => [stepPlots.length ? stepPlots[0].u.scales.x.min : null,
                  stepPlots.length ? stepPlots[0].u.scales.x.max : null],
  };
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && ui.full) { ui.full = null; render(); } });
  window.addEventListener("resize", resize);
  render();
  if (DATA.live) tick();
})();
