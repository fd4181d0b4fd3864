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
  const RUNS = DATA.runs;
  const SEVERAL = DATA.several;
  const RED = "#c4393b";
  const GRAY = "#8c8c8c";
  const DARK = "#333333";
  const DASHES = [[], [6, 4], [2, 3]];
  const SEVERITY = { error: RED, warning: "#e07b26", info: GRAY, ok: "#3a9a4a" };
  const stepPlots = [];
  const allPlots = [];
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
  // Ticks of a log axis: the powers of ten in range (the ends where there are none).
  function logSplits(u, axis, min, max) {
    const out = [];
    for (let e = Math.floor(Math.log10(min)); e <= Math.ceil(Math.log10(max)); e++) {
      const v = Math.pow(10, e);
      if (v >= min * 0.999 && v <= max * 1.001) out.push(v);
    }
    return out.length >= 2 ? out : [min, max];
  }
  function seriesOf(run, key, reduce) {
    return run.series[key + "|" + (reduce || "scalar")] || null;
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
  function stepPlot(target, parts, scales, axes, extra) {
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
        p.steps.forEach((s, j) => { tx.push(s); ty.push(p.values[j]); });
        const smooth = trend(tx, ty);
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
    const opts = {
      width: 400, height: 200,
      legend: { show: false },
      cursor: {
        drag: { x: true, y: false, setScale: true },
        sync: { key: "cockpit-steps" },
        points: { size: 6 },
        bind: { dblclick: () => () => { allSteps(); return null; } },
      },
      scales: scaleSpec,
      series: series,
      axes: axes,
      hooks: {
        drawClear: [shadeNonfinite],
        draw: extra && extra.draw ? [extra.draw] : [],
        setScale: [(u, key) => {
          if (key === "x" && !syncing) setSteps(u.scales.x.min, u.scales.x.max, u);
        }],
        setCursor: [(u) => {
          const idx = u.cursor.idx;
          if (idx == null) { showTip(u, []); return; }
          const lines = [];
          for (const h of hovers) {
            if (!shown[h.part.run] || !u.series[h.index].show) continue;
            const col = u.data[h.index];
            const j = nearest(col, idx);
            if (j == null) continue;
            const who = SEVERAL ? runName(RUNS[h.part.run]) + " · " : "";
            lines.push({ color: h.part.color,
                         text: `${who}step ${u.data[0][j]}: ${h.part.label} ${fmt(col[j])}` });
          }
          showTip(u, lines);
        }],
      },
    };
    const u = new uPlot(opts, data, target);
    wheel(u);
    u.over.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    const plot = { u, owners, parts, xs, kind: "steps" };
    stepPlots.push(plot);
    allPlots.push(plot);
    return plot;
  }

  function stepAxes(ylabel, log, twin) {
    const axes = [
      { label: "iteration", labelSize: 16, size: 30, values: (u, v) => v.map(short) },
      { label: ylabel, labelSize: 16, size: 50, values: (u, v) => v.map(short),
        splits: log ? logSplits : undefined },
    ];
    if (twin) {
      axes.push({ side: 1, scale: "y2", label: twin.label, labelSize: 16, size: 50,
                  grid: { show: false }, values: twin.values || ((u, v) => v.map(short)) });
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
        const positive = s.values.every((v) => v > 0);
        const span = positive ? Math.max(...s.values) / Math.min(...s.values) : 0;
        const log = line.log == null ? positive && s.values.length > 1 && span > 100 : line.log;
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
    const all = parts.filter((p) => p.scale === "y").flatMap((p) => p.values);
    const positive = all.length > 1 && all.every((v) => v > 0);
    const scales = { y: { log: positive && Math.max(...all) / Math.min(...all) > 100 } };
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
      let groups = run.rates.filter((g) => g.steps.length);
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
    legend(box, items, missingRuns("learning rate", (run) => run.rates.length || seriesOf(run, gauge.keys.key)));
    if (!parts.length) return note(box, "no finite value");
    const all = parts.flatMap((p) => p.values);
    const top = Math.max(...all);
    const scales = { y: { log: false, range: () => [Math.min(0, ...all), top > 0 ? top * 1.05 : 1] } };
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
      axes: [{ label: "latest, unit circle = 1", labelSize: 14, size: 30, values: (u, v) => v.map(short) },
             { size: 36, values: (u, v) => v.map(short) }],
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
      const values = run.alpha;
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
    legend(box, items, missingRuns("Alpha", (run) => run.alpha.length >= 2));
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

  function drawHist1d(box, gauge) {
    const found = RUNS.map((run, r) => [r, run.latest.GradHist1d]).filter(([, h]) => h);
    legend(box, found.map(([r, h]) => ({ run: r, color: SEVERAL ? RUNS[r].color : "#e07b26",
                                          text: `${SEVERAL ? RUNS[r].label + ": " : ""}step ${h.step}` })),
           missingRuns("GradHist1d", (run) => run.latest.GradHist1d));
    if (!found.length) return note(box, "no histogram");
    const parts = found.map(([r, h]) => {
      const total = h.hist.reduce((a, b) => a + b, 0) || 1;
      const values = h.hist.map((c) => (SEVERAL ? c / total : c));
      return { r, edges: h.edges, values };
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
        return i < 0 ? null : Math.max(p.values[i], floor);
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
      scales: { x: { time: false, range: () => [xs[0], xs[xs.length - 1]] }, y: { distr: 3 } },
      axes: [{ label: "gradient element value", labelSize: 16, size: 30, values: (u, v) => v.map(short) },
             { label: SEVERAL ? "fraction of elements" : "count", labelSize: 16, size: 50,
               values: (u, v) => v.map(short), splits: logSplits }],
      series, hooks: { setCursor: [(u) => {
        const idx = u.cursor.idx;
        if (idx == null) { showTip(u, []); return; }
        const lines = [];
        owners.forEach(([s, r]) => {
          const v = u.data[s][idx];
          if (shown[r] && v != null) lines.push({ color: u.series[s].stroke(), text: `${SEVERAL ? RUNS[r].label + " · " : ""}[${short(xs[idx])}, ${short(xs[idx + 1])}): ${fmt(v <= floor ? 0 : v)}` });
        });
        showTip(u, lines);
      }] },
    }, data, plotCell(box));
    u.over.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    const plot = { u, owners, kind: "hist" };
    allPlots.push(plot);
    return plot;
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
    const found = RUNS.map((run, r) => [r, run.latest.GradHist2d && run.latest.GradHist2d[name]]).filter(([, h]) => h);
    legend(box, [], missingRuns("GradHist2d", (run) => run.latest.GradHist2d && run.latest.GradHist2d[name]));
    if (!found.length) return note(box, "no histogram");
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
        axes: [{ label: "parameter value", labelSize: 16, size: 30, values: (u, v) => v.map(short) },
               { label: i === 0 ? "gradient element" : "", labelSize: 16, size: 46, values: (u, v) => v.map(short) }],
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
      allPlots.push({ u, owners: [], kind: "heat", run: r });
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
      const found = run.findings.filter((f) => f.id !== "not_checked");
      const skipped = run.findings.find((f) => f.id === "not_checked");
      const checks = skipped ? skipped.evidence.checks || {} : {};
      if (!found.some((f) => f.severity !== "info")) {
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
  function gaugeBox(parent, name, title) {
    const gauge = DATA.gauges[name];
    const box = el("div", "gauge");
    box.dataset.gauge = name;
    box.appendChild(el("h3", null, title || gauge.title));
    if (gauge.caption) box.appendChild(el("div", "caption", gauge.caption));
    box.appendChild(el("div", "legend"));
    box.appendChild(el("div", "plot"));
    parent.appendChild(box);
    return box;
  }
  const DRAW = {
    series: drawSeries, performance: drawPerformance, learning_rates: drawRates,
    tests: drawTests, alpha: drawAlpha, hist_1d: drawHist1d,
    hist_2d: (box, g) => drawHist2d(box, g, null), findings: drawFindings,
  };
  const gaugePlots = {};
  function drawGauge(parent, name, title, param) {
    const box = gaugeBox(parent, name, title);
    const gauge = DATA.gauges[name];
    const plot = param == null ? DRAW[gauge.kind](box, gauge) : drawHist2d(box, gauge, param);
    if (plot) gaugePlots[name] = plot;
    return box;
  }
  const PANELS = { "STEP SIZE": "#e6eef8", GRADIENTS: "#fbeee2", CURVATURE: "#e6f3e8" };

  function build() {
    const header = el("header");
    header.appendChild(el("h1", null, DATA.title));
    const toggles = el("div", "runs");
    RUNS.forEach((run, r) => {
      const label = el("label");
      const box = el("input");
      box.type = "checkbox"; box.checked = true; box.dataset.run = r;
      box.addEventListener("change", () => setRun(r, box.checked));
      label.appendChild(box);
      const sw = el("span", "swatch"); sw.style.background = run.color;
      label.appendChild(sw);
      label.appendChild(document.createTextNode(run.label));
      toggles.appendChild(label);
    });
    header.appendChild(toggles);
    header.appendChild(el("div", "help", "drag: zoom into steps · wheel: zoom · shift+wheel: pan · double-click: all steps · hover: values"));
    if (DATA.left_out.length) {
      header.appendChild(el("div", "leftout", "not tracked, so not shown: " + DATA.left_out.map(([, hint]) => hint.replace(/^track /, "")).join(", ")));
    }
    document.body.appendChild(header);
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
          const h = run.latest.GradHist2d || {};
          while (("param_" + count) in h) count++;
        }
        layers.style.gridTemplateColumns = `repeat(${Math.min(Math.max(count, 1), 4)}, 1fr)`;
        for (let k = 0; k < count; k++) drawGauge(layers, "hist_2d", `Parameter ${k}`, k);
        second.appendChild(layers);
      }
      document.body.appendChild(second);
    }
    const firsts = RUNS.map((r) => r.first_step).filter((s) => s != null);
    const lasts = RUNS.map((r) => r.last_step).filter((s) => s != null);
    stepRange = [Math.min(...firsts), Math.max(Math.max(...lasts), Math.min(...firsts) + 1)];
    resize();
    allSteps();
    window.addEventListener("resize", resize);
  }

  function resize() {
    for (const p of allPlots) {
      const box = p.u.root.parentNode;
      const w = Math.max(box.clientWidth, 60), h = Math.max(box.clientHeight, 60);
      if (p.u.width !== w || p.u.height !== h) p.u.setSize({ width: w, height: h });
    }
  }

  function setRun(r, on) {
    shown[r] = on;
    for (const p of allPlots) {
      for (const [index, run] of p.owners) if (run === r) p.u.setSeries(index, { show: on });
      p.u.redraw(false);
    }
    document.querySelectorAll(`[data-run="${r}"]:not(input)`).forEach((node) => {
      node.classList.toggle("hidden-run", !on);
    });
  }

  // For tests: the page position of a point of a gauge, and what is shown.
  function pointAt(name, run, step) {
    const p = gaugePlots[name];
    if (!p || !p.xs) return null;
    const part = p.parts.findIndex((q) => q.run === run && q.kind === "points");
    if (part < 0) return null;
    const index = p.owners.findIndex(() => true);
    const seriesIndex = 1 + p.parts.slice(0, part).reduce((n, q) => n + (q.kind === "points" ? 2 : 1), 0);
    const i = p.xs.indexOf(step);
    if (i < 0 || index < 0) return null;
    const value = p.u.data[seriesIndex][i];
    const box = p.u.over.getBoundingClientRect();
    return { x: box.left + p.u.valToPos(step, "x"), y: box.top + p.u.valToPos(value, p.u.series[seriesIndex].scale),
             value };
  }
  window.cockpit = { data: DATA, plots: allPlots, stepPlots, shown, setRun, pointAt,
                     steps: () => [stepPlots.length ? stepPlots[0].u.scales.x.min : null,
                                   stepPlots.length ? stepPlots[0].u.scales.x.max : null] };
  build();
})();
