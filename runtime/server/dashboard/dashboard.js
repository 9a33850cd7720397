// eva0-edge's live page: polls the adaptation series of the served model (its own origin only)
// and charts it with uPlot. Every chart's caption shows its series' latest values, with the
// exact number in data-value (what the integration test compares with the statistics route).
// Behind a load balancer (a fleet's proxy) each answer comes from one replica and names it
// ("replica"): the page keeps each replica's points apart and draws one line per replica.
"use strict";

(function () {
  const POLL_MS = 1000;
  // a replica whose newest point is this much older than the newest replica's (s) no longer
  // holds back ?since= (a replica gone, or one the balancer no longer picks)
  const STALE_S = 120;
  // with several replicas: a colour per replica, a dash per series after a chart's first
  const REPLICA_COLOURS = ["#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00897b",
                           "#5d4037", "#ad1457"];
  const FIELD_DASHES = [[6, 3], [2, 3], [10, 3, 2, 3]];
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

  // replicas: by name (null: a lone server), each {name, columns, events, lastT}; keys: their
  // names as the charts draw them (sorted); answered: the name of the last answer's replica
  const state = { replicas: new Map(), keys: [null], answered: null, bounds: {}, states: [],
                  capacity: 0, polls: 0, fields: [] };
  const charts = [];

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function byName(a, b) {
    if (a === b) return 0;
    if (a === null) return -1;
    if (b === null) return 1;
    return a < b ? -1 : 1;
  }

  function replicaLabel(name) {
    return name === null ? "unnamed" : name;
  }

  function allEvents() {
    const events = [];
    for (const replica of state.replicas.values()) {
      for (const e of replica.events) events.push([replica.name, e]);
    }
    return events.sort((a, b) => a[1].t - b[1].t);
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
          for (const [, e] of allEvents()) {
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
    const bounds = {};
    for (const [key, label] of spec.bounds || []) {
      bounds[key] = el("span", { class: "bound", "data-bound": key }, label + ": \u2013");
      caption.append(bounds[key]);
    }
    figure.append(caption);
    const plot = el("div", { class: "plot" });
    figure.append(plot);
    document.getElementById("charts").append(figure);
    const anchor = caption.querySelector(".bound");
    const chart = { spec, u: null, latest: [], bounds, figure, plot, caption, anchor };
    buildPlot(chart);
    charts.push(chart);
  }

  // the chart's lines, one per series and replica (state.keys), and their captions: with one
  // replica each series keeps its colour; with several, a replica's lines share its colour
  function buildPlot(chart) {
    const spec = chart.spec;
    const many = state.keys.length > 1;
    for (const entry of chart.latest) entry.span.remove();
    chart.latest = [];
    const series = [{}];
    state.keys.forEach((name, r) => {
      spec.series.forEach(([field, label, colour], f) => {
        const stroke = many ? REPLICA_COLOURS[r % REPLICA_COLOURS.length] : colour;
        const dash = many && f > 0 ? FIELD_DASHES[(f - 1) % FIELD_DASHES.length] : null;
        const text = (many ? replicaLabel(name) + " " : "") + label;
        const s = { label: text, stroke, width: 1.5, spanGaps: false };
        if (dash) s.dash = dash;
        if (spec.states) s.paths = uPlot.paths.stepped({ align: 1 });
        series.push(s);
        const span = el("span", { class: "latest", "data-field": field, "data-value": "null" },
                        text + ": \u2013");
        if (name !== null) span.dataset.replica = name;
        span.style.borderBottomColor = stroke;
        if (dash) span.style.borderBottomStyle = "dashed";
        chart.caption.insertBefore(span, chart.anchor);
        chart.latest.push({ field, text, name, span });
      });
    });
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
    if (chart.u) chart.u.destroy();
    const width = Math.max(chart.plot.clientWidth || chart.figure.clientWidth - 10, 300);
    chart.u = new uPlot({ width, height: 180, series, axes, scales, plugins: [marksPlugin()],
                          legend: { show: false } },
                        [[]].concat(series.slice(1).map(() => [])), chart.plot);
  }

  // a state's code on the chart's axis; of a list of states, the highest (the most severe)
  function stateCode(value) {
    if (value === null) return null;
    if (Array.isArray(value)) {
      return value.length ? Math.max(...value.map((name) => state.states.indexOf(name))) : null;
    }
    return state.states.indexOf(value);
  }

  // one table per replica, aligned on a shared x by uPlot.join (undefined where a replica has
  // no point: its line runs on; null stays a gap)
  function chartData(spec) {
    const tables = state.keys.map((name) => {
      const c = state.replicas.get(name).columns;
      return [c.t].concat(spec.series.map(([field]) => (
        spec.states ? c[field].map(stateCode) : c[field])));
    });
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const n = data[0].length;
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
      chart.latest.forEach(({ field, text, name, span }, i) => {
        // the points the line holds (a replica's own; undefined: another's x)
        const line = chart.u.data[i + 1];
        span.dataset.points = String(line.reduce((n, v) => n + (v !== undefined), 0));
        // what the chart shows: the replica's own last point
        const column = state.replicas.get(name).columns[field];
        let value = column.length ? column[column.length - 1] : null;
        if (chart.spec.states && value !== null) {
          const code = stateCode(value);
          value = code === null ? null : state.states[code];
        }
        span.dataset.value = value === null || value === undefined ? "null" : String(value);
        span.textContent = text + ": " + format(value);
      });
    }
    for (const chart of charts) {
      for (const [key, label] of chart.spec.bounds || []) {
        const bound = state.bounds[key];
        chart.bounds[key].textContent = label + ": " + (bound === null ? "off" : format(bound));
      }
    }
    renderLatest();
    renderReplicas();
    renderEvents();
  }

  // the latest point of the replica that answered last
  function renderLatest() {
    const c = state.replicas.get(state.answered).columns;
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

  function newestT() {
    const lasts = [...state.replicas.values()].map((r) => r.lastT).filter((t) => t !== null);
    return lasts.length ? Math.max(...lasts) : null;
  }

  // every replica seen, its guard state and newest point; hidden for one unnamed server
  function renderReplicas() {
    const list = document.getElementById("replicas");
    list.replaceChildren();
    list.hidden = state.keys.length === 1 && state.keys[0] === null;
    const newest = newestT();
    for (const name of state.keys) {
      const replica = state.replicas.get(name);
      const c = replica.columns;
      const now = c.t.length ? c.guard_state[c.t.length - 1] : null;
      const stale = replica.lastT !== null && replica.lastT < newest - STALE_S;
      const item = el("li", { "data-replica": replicaLabel(name), "data-state": now || "",
                              "data-points": String(c.t.length),
                              "data-first-t": c.t.length ? String(c.t[0]) : "",
                              "data-last-t": replica.lastT === null ? "" : String(replica.lastT),
                              "data-answered": String(name === state.answered),
                              "data-stale": String(stale) },
                      replicaLabel(name) + ": " + (now || "\u2013") + (stale ? " (stale)" : ""));
      if (state.keys.length > 1) {
        item.style.borderLeftColor = REPLICA_COLOURS[
          state.keys.indexOf(name) % REPLICA_COLOURS.length];
      }
      list.append(item);
    }
  }

  function renderEvents() {
    const list = document.getElementById("events");
    list.replaceChildren();
    const many = state.keys.length > 1;
    for (const [name, e] of allEvents().reverse()) {
      const when = new Date(e.t * 1000).toLocaleTimeString();
      const item = el("li", { "data-kind": e.kind, "data-t": String(e.t) },
                      when + (many ? " " + replicaLabel(name) : "") + " " +
                      e.kind.replace("_", " ") + (e.detail ? ": " + e.detail : ""));
      if (name !== null) item.dataset.replica = name;
      list.append(item);
    }
  }

  // the answer's points and events into its replica's, past those it holds; true when the
  // answer came from a replica not seen before
  function merge(answer) {
    state.bounds = answer.bounds;
    state.states = answer.guard_states;
    state.capacity = answer.capacity;
    state.fields = answer.fields;
    const name = answer.replica === undefined ? null : answer.replica;
    let replica = state.replicas.get(name);
    const added = replica === undefined;
    if (added) {
      replica = { name, columns: {}, events: [], lastT: null };
      for (const field of state.fields) replica.columns[field] = [];
      state.replicas.set(name, replica);
    }
    const points = answer.points;
    const after = replica.lastT;
    let start = after === null ? 0 : points.t.findIndex((t) => t > after);
    if (start < 0) start = points.t.length;
    const columns = replica.columns;
    for (const field of state.fields) columns[field].push(...points[field].slice(start));
    const extra = columns.t.length - state.capacity;
    if (extra > 0) for (const field of state.fields) columns[field].splice(0, extra);
    replica.events.push(...answer.events.filter((e) => after === null || e.t > after));
    if (replica.events.length > 1024) replica.events.splice(0, replica.events.length - 1024);
    const n = columns.t.length;
    if (n) replica.lastT = columns.t[n - 1];
    state.answered = name;
    return added;
  }

  // ?since= the oldest of the replicas' newest points (stale ones left out), so whichever
  // replica answers, each one's newer points arrive
  function since() {
    const newest = newestT();
    if (newest === null) return null;
    const lasts = [...state.replicas.values()].map((r) => r.lastT)
      .filter((t) => t !== null && t >= newest - STALE_S);
    return Math.min(...lasts);
  }

  function pointCount() {
    let n = 0;
    for (const replica of state.replicas.values()) n += replica.columns.t.length;
    return n;
  }

  function setStatus(error) {
    const status = document.getElementById("status");
    const newest = newestT();
    const replicas = state.replicas.size;
    status.dataset.points = String(pointCount());
    status.dataset.polls = String(state.polls);
    status.dataset.lastT = newest === null ? "" : String(newest);
    status.dataset.replicas = String(replicas);
    status.dataset.answered = state.answered === null ? "" : state.answered;
    status.dataset.error = error || "";
    status.textContent = error ? "no answer: " + error
      : (pointCount() + " points" + (replicas > 1 ? " of " + replicas + " replicas" : "") +
         ", updated " + new Date().toLocaleTimeString());
  }

  async function poll() {
    try {
      const after = since();
      const url = after === null ? seriesUrl : seriesUrl + "?since=" + after;
      const response = await fetch(url, { cache: "no-store" });
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error || response.statusText);
      if (merge(answer)) {
        state.keys = [...state.replicas.keys()].sort(byName);
        for (const chart of charts) buildPlot(chart);
      }
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
