// eva0-edge's live page: polls the adaptation series of the served model (its own origin only)
// and charts it with uPlot. Every chart's caption shows its series' latest values, with the
// exact number in data-value (what the integration test compares with the statistics route).
"use strict";

(function () {
  const POLL_MS = 1000;
  const model = document.body.dataset.model;
  const seriesUrl = "/v2/models/" + encodeURIComponent(model) + "/adaptation/series";

  // [field, label, colour]; bounds: [bound's key in the answer's "bounds", label]
  const CHARTS = [
    { id: "throughput", title: "Images per second", unit: "images/s",
      series: [["images_per_s", "images/s", "#1565c0"]] },
    { id: "latency", title: "Request latency", unit: "ms",
      series: [["latency_p50_ms", "p50", "#2e7d32"], ["latency_p99_ms", "p99", "#c62828"]] },
    { id: "forwards", title: "Forwards per sample", unit: "forwards / sample",
      series: [["forwards_per_sample", "since start", "#1565c0"],
               ["forwards_per_sample_interval", "this interval", "#90a4ae"]],
      bounds: [["budget", "budget"]] },
    { id: "credit", title: "Budget credit", unit: "share of the bucket",
      series: [["budget_fill", "credit", "#00897b"]] },
    { id: "drift", title: "Drift from \u03b80", unit: "\u2016\u03b8 \u2212 \u03b80\u2016",
      series: [["drift", "drift", "#6a1b9a"]], bounds: [["drift_max", "bound"]] },
    { id: "entropy", title: "Prediction entropy (guard window)", unit: "entropy / ln K",
      series: [["entropy", "entropy", "#ef6c00"]],
      bounds: [["entropy_min", "min"], ["entropy_max", "max"]] },
    { id: "alignment", title: "Alignment distance", unit: "to the source statistics",
      series: [["alignment", "alignment", "#5d4037"]], bounds: [["alignment_max", "bound"]] },
    { id: "guard", title: "Guard state", unit: "", states: true,
      series: [["guard_state", "at the end", "#c62828"],
               ["guard_states_seen", "most severe in the interval", "#f48fb1"]] },
    { id: "changes", title: "Stream changes and bank hits", unit: "since the state began",
      series: [["input_changes", "input changes", "#1565c0"],
               ["shift_changes", "shift changes", "#90a4ae"],
               ["bank_hits", "bank hits", "#00897b"]] },
  ];
  const MARKS = {
    trip: ["#c62828", 2, []], verdict: ["#6a1b9a", 1.5, []], audit: ["#ef6c00", 1, [4, 3]],
    stream_change: ["#1565c0", 1, [2, 3]], bank_hit: ["#00897b", 1.5, [6, 2]],
    state_replaced: ["#212121", 2, [1, 2]],
  };

  const state = { columns: null, events: [], bounds: {}, states: [], capacity: 0, lastT: null,
                  polls: 0, fields: [] };
  const charts = [];

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function format(v) {
    if (v === null || v === undefined) return "\u2013";
    if (typeof v === "string") return v;
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 1000 ? v.toFixed(0) : v.toPrecision(4);
  }

  // vertical marks at the events (trips, verdicts, changes, ...) on every chart
  function marksPlugin() {
    return {
      hooks: {
        draw: [(u) => {
          const [lo, hi] = [u.scales.x.min, u.scales.x.max];
          const ctx = u.ctx;
          let drawn = 0;
          ctx.save();
          for (const e of state.events) {
            if (e.t < lo || e.t > hi) continue;
            drawn += 1;
            const [colour, width, dash] = MARKS[e.kind] || ["#000", 1, []];
            const x = Math.round(u.valToPos(e.t, "x", true));
            ctx.strokeStyle = colour;
            ctx.lineWidth = width * devicePixelRatio;
            ctx.setLineDash(dash.map((d) => d * devicePixelRatio));
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
          }
          ctx.restore();
          u.root.dataset.marks = String(drawn);
        }],
      },
    };
  }

  function makeChart(spec) {
    const figure = el("figure", { class: "chart", id: "chart-" + spec.id, "data-chart": spec.id });
    const caption = el("figcaption");
    caption.append(el("span", { class: "title" }, spec.title));
    if (spec.unit) caption.append(el("span", { class: "unit" }, spec.unit));
    const latest = {};
    for (const [field, label, colour] of spec.series) {
      const span = el("span", { class: "latest", "data-field": field, "data-value": "null" },
                      label + ": \u2013");
      span.style.borderBottomColor = colour;
      latest[field] = span;
      caption.append(span);
    }
    const bounds = {};
    for (const [key, label] of spec.bounds || []) {
      bounds[key] = el("span", { class: "bound", "data-bound": key }, label + ": \u2013");
      caption.append(bounds[key]);
    }
    figure.append(caption);
    const plot = el("div", { class: "plot" });
    figure.append(plot);
    document.getElementById("charts").append(figure);

    const series = [{}];
    for (const [, label, colour] of spec.series) {
      const s = { label, stroke: colour, width: 1.5, spanGaps: false };
      if (spec.states) s.paths = uPlot.paths.stepped({ align: 1 });
      series.push(s);
    }
    for (const [, label] of spec.bounds || []) {
      series.push({ label, stroke: "#9e9e9e", width: 1, dash: [6, 4], points: { show: false } });
    }
    const axes = [{}, {}];
    const scales = { x: { time: true } };
    if (spec.states) {
      axes[1] = { size: 70, splits: () => state.states.map((_, i) => i),
                  values: (u, ticks) => ticks.map((v) => state.states[v] || "") };
      scales.y = { range: () => [-0.5, Math.max(state.states.length - 0.5, 0.5)] };
    }
    const width = Math.max(plot.clientWidth || figure.clientWidth - 10, 300);
    const u = new uPlot({ width, height: 180, series, axes, scales, plugins: [marksPlugin()],
                          legend: { show: false } }, [[]].concat(series.slice(1).map(() => [])),
                        plot);
    charts.push({ spec, u, latest, bounds, plot });
  }

  // a state's code on the chart's axis; of a list of states, the highest (the most severe)
  function stateCode(value) {
    if (value === null) return null;
    if (Array.isArray(value)) {
      return value.length ? Math.max(...value.map((name) => state.states.indexOf(name))) : null;
    }
    return state.states.indexOf(value);
  }

  function chartData(spec) {
    const c = state.columns;
    const n = c.t.length;
    const data = [c.t];
    for (const [field] of spec.series) {
      if (spec.states) data.push(c[field].map(stateCode));
      else data.push(c[field]);
    }
    for (const [key] of spec.bounds || []) {
      const bound = state.bounds[key];
      data.push(new Array(n).fill(bound === undefined ? null : bound));
    }
    return data;
  }

  function render() {
    for (const chart of charts) {
      const data = chartData(chart.spec);
      chart.u.setData(data);
      const last = data[0].length - 1;
      chart.spec.series.forEach(([field, label], i) => {
        // what the chart shows: its own data's last point
        let value = last >= 0 ? chart.u.data[i + 1][last] : null;
        if (chart.spec.states && value !== null) value = state.states[value];
        const span = chart.latest[field];
        span.dataset.value = value === null || value === undefined ? "null" : String(value);
        span.textContent = label + ": " + format(value);
      });
    }
    for (const chart of charts) {
      for (const [key, label] of chart.spec.bounds || []) {
        const bound = state.bounds[key];
        chart.bounds[key].textContent = label + ": " + (bound === null ? "off" : format(bound));
      }
    }
    renderLatest();
    renderEvents();
  }

  function renderLatest() {
    const c = state.columns;
    const last = c.t.length - 1;
    const body = document.querySelector("#latest tbody");
    body.replaceChildren();
    for (const field of state.fields) {
      const value = last >= 0 ? c[field][last] : null;
      const row = el("tr", { "data-field": field });
      row.append(el("th", {}, field));
      const text = Array.isArray(value) ? value.join(",") : value;
      row.append(el("td", { "data-value": value === null ? "null" : String(text) },
                    field === "t" && value !== null ? new Date(value * 1000).toLocaleTimeString()
                      : format(text)));
      body.append(row);
    }
    const images = c.images.reduce((sum, v) => sum + (v || 0), 0);
    const total = el("tr", { "data-field": "images_total" });
    total.append(el("th", {}, "images (charted)"));
    total.append(el("td", { "data-value": String(images) }, format(images)));
    body.append(total);
    const guard = document.getElementById("guard-state");
    const now = last >= 0 ? c.guard_state[last] : null;
    guard.dataset.state = now || "";
    guard.textContent = "guard: " + (now || "\u2013");
  }

  function renderEvents() {
    const list = document.getElementById("events");
    list.replaceChildren();
    for (const e of state.events.slice().reverse()) {
      const when = new Date(e.t * 1000).toLocaleTimeString();
      list.append(el("li", { "data-kind": e.kind, "data-t": String(e.t) },
                     when + " " + e.kind.replace("_", " ") + (e.detail ? ": " + e.detail : "")));
    }
  }

  function merge(answer) {
    state.bounds = answer.bounds;
    state.states = answer.guard_states;
    state.capacity = answer.capacity;
    state.fields = answer.fields;
    const points = answer.points;
    if (state.columns === null) {
      state.columns = points;
    } else {
      for (const field of state.fields) state.columns[field].push(...points[field]);
    }
    const extra = state.columns.t.length - state.capacity;
    if (extra > 0) for (const field of state.fields) state.columns[field].splice(0, extra);
    state.events.push(...answer.events);
    if (state.events.length > 1024) state.events.splice(0, state.events.length - 1024);
    const n = state.columns.t.length;
    if (n) state.lastT = state.columns.t[n - 1];
  }

  function setStatus(error) {
    const status = document.getElementById("status");
    status.dataset.points = String(state.columns ? state.columns.t.length : 0);
    status.dataset.polls = String(state.polls);
    status.dataset.lastT = state.lastT === null ? "" : String(state.lastT);
    status.dataset.error = error || "";
    status.textContent = error ? "no answer: " + error
      : (state.columns.t.length + " points, updated " + new Date().toLocaleTimeString());
  }

  async function poll() {
    try {
      const url = state.lastT === null ? seriesUrl : seriesUrl + "?since=" + state.lastT;
      const response = await fetch(url, { cache: "no-store" });
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error || response.statusText);
      merge(answer);
      state.polls += 1;
      render();
      setStatus(null);
    } catch (err) {
      setStatus(String(err.message || err));
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  for (const spec of CHARTS) makeChart(spec);
  window.addEventListener("resize", () => {
    for (const chart of charts) {
      chart.u.setSize({ width: Math.max(chart.plot.clientWidth, 300), height: 180 });
    }
  });
  poll();
})();
