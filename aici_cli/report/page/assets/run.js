// aici-batch report --html: the run's figures and gates, the lines the constraint bent
// most, the baseline, the plots. Every figure comes from `data.summary`, the object
// `report --json` prints.

AB.card = (label, value, sub, test) =>
  AB.el("div", { class: "card", "data-card": test }, AB.el("div", { class: "label", text: label }),
    AB.el("div", { class: "value", text: value }), sub ? AB.el("div", { class: "sub", text: sub }) : null);

AB.byCount = (counts) => Object.entries(counts || {}).map(([k, n]) => `${k} ${n}`).join(" · ");

AB.madeWith = function (data) {
  const box = document.getElementById("made-with");
  const parts = (data.made_with || []).map(({ made_with, lines }) => {
    const options = Object.entries(made_with).map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`);
    return options.join(" · ") + (data.made_with.length > 1 ? ` (${lines} lines)` : "");
  });
  box.textContent = parts.length ? "made with " + parts.join("; ") : "";
};

AB.cards = function (s) {
  const schemaAll = (s.schema_lines || 0) + (s.schema_errors || 0);
  const closed = Object.values(s.closed_early || {}).reduce((a, b) => a + b, 0);
  return AB.el("div", { class: "cards" },
    AB.card("lines", AB.int(s.lines), AB.byCount(s.finish_reasons), "lines"),
    AB.card("errors", AB.int(s.errors), s.errors ? AB.byCount(s.error_types) : "none", "errors"),
    AB.card("accuracy", s.answered ? AB.pct(s.accuracy) : "–",
      s.answered ? `${s.answered} lines with an expected answer` : "no expected answers", "accuracy"),
    AB.card("compliance", schemaAll ? AB.pct(s.compliance) : "–",
      schemaAll ? `valid ${s.valid} of ${schemaAll} schema outputs; ${AB.pct(s.compliance_ran)} of those that ran`
        : "no schema lines", "compliance"),
    AB.card("closed early", AB.int(closed), closed ? AB.byCount(s.closed_early) : "none", "closed"),
    AB.card("tokens/s", s.tokens_per_s === null ? "–" : s.tokens_per_s.toFixed(1),
      s.wall_s === null ? "needs the run summary (--stats)" : `wall time ${s.wall_s.toFixed(2)} s`, "speed"),
    AB.card("output tokens", AB.int(s.output_tokens),
      `prompt ${AB.int(s.prompt_tokens)}, from the prefix cache ${AB.int(s.cached_tokens || 0)}`, "tokens"),
    s.model ? AB.card("model", s.model, [s.device, s.dtype, s.batch_size && `batch ${s.batch_size}`]
      .filter(Boolean).join(" · "), "model") : null);
};

AB.gates = function (gates) {
  if (!gates || !gates.length) return null;
  const rows = gates.map((g) => AB.el("tr", { "data-gate": g.metric },
    AB.el("td", {}, AB.el("code", { text: `${g.metric} ${g.upper ? "<=" : ">="} ${g.bound}` })),
    AB.el("td", { class: "num", text: g.value === null ? "n/a" : Number(g.value).toPrecision(4) }),
    AB.el("td", { class: g.passed ? "pass" : "fail", text: g.passed ? "✓ pass" : "✗ fail" })));
  return [AB.el("h3", { text: "Gates" }), AB.el("table", { class: "plain" },
    AB.el("tr", {}, AB.el("th", { text: "gate" }), AB.el("th", { class: "num", text: "value" }),
      AB.el("th", { text: "verdict" })), rows)];
};

AB.renderRun = function (data) {
  const s = data.summary;
  AB.madeWith(data);
  const notes = (s.notes || []).map((n) => AB.el("li", { text: n }));
  document.getElementById("run").replaceChildren(...AB.flat(AB.el("h2", { text: "Run" }), AB.cards(s),
    AB.gates(s.gates), notes.length ? AB.el("ul", { class: "muted" }, notes) : null));
};

// An allowed mass, to 3 significant digits: the masses worth a look are often tiny.
AB.mass = (x) => (x === null || x === undefined ? "–" : x === 0 ? "0" : Number(x).toPrecision(3));

// Enough of a line's text to know it by, on one row; the whole is a click away.
AB.EXCERPT = 80;
AB.excerpt = function (text) {
  const flat = String(text || "").replace(/\s+/g, " ").trim();
  return flat.length > AB.EXCERPT ? flat.slice(0, AB.EXCERPT - 1) + "…" : flat;
};

// The lines whose constraint left the model the least probability on the tokens it
// allowed: `summary.bent_most` as `report --json` prints it (lowest first), each joined to
// its row for what the line did. A run without allowed masses (nothing constrained) has
// none, and the section stays hidden, as the baseline's does without a baseline.
AB.renderBent = function (data) {
  const bent = data.summary.bent_most || [];
  if (!bent.length) return;
  const col = Object.fromEntries(data.columns.map((name, i) => [name, i]));
  // By index, and by id where the result had one: a row holds it as text (an integer id
  // too), and names "line N" a line without one (a falsy id, as aici_cli/report/lines.py
  // reads it).
  const positionOf = (b) => data.rows.findIndex((r) => r[col.index] === b.index &&
    (!b.id || r[col.id] === String(b.id)));
  const rows = bent.map((b) => {
    const position = positionOf(b);
    const r = position < 0 ? null : data.rows[position];
    const d = position < 0 ? {} : data.details[position] || {};
    const name = r ? r[col.id] : String(b.id || `line ${b.index}`);
    const valid = r ? r[col.valid] : null;
    const excerpt = AB.excerpt(d.text);
    return AB.el("tr", { class: "bent-line", "data-index": b.index, "data-id": name },
      AB.el("td", { class: "num", text: b.index }),
      AB.el("td", {}, r ? AB.el("a", { href: "#", text: name, onclick: (e) => { e.preventDefault(); AB.table.openAt(position); } }) : name),
      AB.el("td", { class: "num", "data-mass": "min", text: AB.mass(b.allowed_mass_min) }),
      AB.el("td", { class: "num", "data-mass": "mean", text: AB.mass(b.allowed_mass_mean) }),
      AB.el("td", { text: r && r[col.finish] !== null ? r[col.finish] : "–" }),
      AB.el("td", { text: valid === null ? "–" : valid ? "✓" : "✗" }),
      AB.el("td", { class: "excerpt" }, excerpt ? AB.el("code", { text: excerpt }) : AB.el("span", { class: "muted", text: "–" })));
  });
  const section = document.getElementById("bent");
  section.hidden = false;
  document.getElementById("nav-bent").hidden = false;
  section.replaceChildren(AB.el("h2", { text: "Where the constraint bent the model" }),
    AB.el("p", { class: "muted", text: (bent.length === 1 ? "The line" : `The ${bent.length} lines`) + " whose constraint left the model the least probability " +
      "on the tokens it allowed, at some step (allowed mass min), lowest first; the mean is over the line's " +
      "constrained steps. A low mass: the model wanted what the constraint forbade." }),
    AB.el("table", { class: "plain bent", "data-count": bent.length },
      AB.el("tr", {}, [["#", "num"], ["id"], ["allowed mass min", "num"], ["mean", "num"], ["finish"], ["valid"], ["text"]]
        .map(([h, cls]) => AB.el("th", { class: cls, text: h }))), rows));
};

// The accuracy delta and its 95% interval on an axis through zero.
AB.intervalSvg = function (delta, low, high) {
  const span = Math.max(0.05, Math.abs(low), Math.abs(high), Math.abs(delta)) * 1.15;
  const x = (v) => 10 + ((v + span) / (2 * span)) * 300;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 320 40"); svg.setAttribute("width", "320"); svg.setAttribute("height", "40");
  const add = (tag, attrs) => { const n = document.createElementNS(ns, tag); for (const k in attrs) n.setAttribute(k, attrs[k]); svg.append(n); return n; };
  add("line", { x1: 10, x2: 310, y1: 20, y2: 20, stroke: "currentColor", "stroke-width": 0.5 });
  add("line", { x1: x(0), x2: x(0), y1: 6, y2: 34, stroke: "currentColor", "stroke-dasharray": "2 2" });
  add("line", { x1: x(low), x2: x(high), y1: 20, y2: 20, stroke: "#2f6fdb", "stroke-width": 4 });
  add("circle", { cx: x(delta), cy: 20, r: 5, fill: delta < 0 ? "#c8333a" : "#2e8b57" });
  add("text", { x: x(0), y: 38, "font-size": 9, "text-anchor": "middle", fill: "currentColor" }).textContent = "0";
  return svg;
};

AB.CHANGES_SHOWN = 100; // per way: the table's "changed since baseline" filter has them all

AB.changeTable = function (changes, way) {
  const all = changes.filter((c) => c.way === way);
  if (!all.length) return null;
  const rows = all.slice(0, AB.CHANGES_SHOWN).map((c) => AB.el("tr", { class: "change", "data-id": c.id },
    AB.el("td", {}, AB.el("a", { href: "#", text: c.id, onclick: (e) => { e.preventDefault(); AB.table.openById(c.id); } })),
    AB.el("td", {}, AB.pre(c.before)), AB.el("td", {}, AB.pre(c.now)),
    AB.el("td", {}, c.expected === null ? AB.el("span", { class: "muted", text: "–" }) : AB.pre(c.expected))));
  const more = all.length > rows.length ? AB.el("p", { class: "muted" }, `… and ${all.length - rows.length} more: `,
    AB.el("a", { href: "#lines", text: "filter the lines by “changed since baseline”", onclick: () => AB.table.setFilter("changed") })) : null;
  return [AB.el("h3", { text: `${way} (${all.length})` }), AB.el("table", { class: "plain changes", "data-way": way, "data-count": all.length },
    AB.el("tr", {}, ["line", "before", "now", "expected"].map((h) => AB.el("th", { text: h }))), rows), more];
};

AB.renderBaseline = function (data) {
  const b = data.summary.baseline;
  if (!b) return;
  const section = document.getElementById("baseline");
  section.hidden = false;
  document.getElementById("nav-baseline").hidden = false;
  const facts = AB.el("p", { text: `${b.matched} lines matched ${b.baseline} by id and input digest; ` +
    `${b.only_now} only here, ${b.only_baseline} only in the baseline, ${b.input_changed} with a changed input (not compared). ` +
    `${b.changed.length} answers changed: ${b.right_to_wrong} right→wrong, ${b.wrong_to_right} wrong→right; ` +
    `${b.newly_failing} lines newly failing (error or invalid).` });
  let accuracy = AB.el("p", { class: "muted", text: "No matched line has an expected answer in both runs: no accuracy comparison." });
  if (b.paired) {
    const [low, high] = b.delta_95ci;
    accuracy = AB.el("div", { class: "accuracy-delta" },
      AB.el("p", {}, AB.el("strong", { text: `accuracy ${AB.pct(b.accuracy_before, 2)} → ${AB.pct(b.accuracy_now, 2)}` }),
        ` on ${b.paired} paired lines: delta ${AB.signed(b.delta)}, 95% interval [${AB.signed(low)}, ${AB.signed(high)}] ` +
        `(paired bootstrap), McNemar p = ${Number(b.mcnemar_p).toPrecision(4)}`),
      AB.intervalSvg(b.delta, low, high));
  }
  section.replaceChildren(...AB.flat(AB.el("h2", { text: "Against the baseline " + b.baseline }), facts, accuracy,
    AB.changeTable(b.changed, "right->wrong"), AB.changeTable(b.changed, "wrong->right"),
    AB.changeTable(b.changed, "changed")));
};

AB.renderPlots = function (data) {
  const plots = data.plots || {};
  const box = (svg) => { const div = AB.el("div", { class: "plot" }); div.innerHTML = svg; return div; };
  document.getElementById("plots").replaceChildren(...AB.flat(AB.el("h2", { text: "Plots" }),
    plots.steps ? box(plots.steps) : null,
    plots.timeline ? box(plots.timeline) : AB.el("p", { class: "muted", text: "Timeline: " + plots.timeline_note })));
};
