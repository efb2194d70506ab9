// aici-batch report --html: the table of lines. Rows are drawn as they scroll into view
// (a run of 100,000 lines keeps a few dozen row elements), sorted, filtered and searched
// over an index of row positions.

AB.COLUMNS = [
  { key: "index", label: "#", width: "56px", num: true },
  { key: "id", label: "id", width: "minmax(90px, 1.3fr)" },
  { key: "finish", label: "finish", width: "84px" },
  { key: "status", label: "status", width: "78px" },
  { key: "valid", label: "valid", width: "58px" },
  { key: "closed", label: "closed", width: "96px" },
  { key: "tokens", label: "tokens", width: "64px", num: true },
  { key: "ttft_ms", label: "TTFT ms", width: "78px", num: true },
  { key: "total_ms", label: "total ms", width: "80px", num: true },
  { key: "changed", label: "since baseline", width: "110px", baseline: true },
];

// Each filter: what it keeps, and (for outputs counted per sample) how many outputs.
AB.FILTERS = [
  { key: "all", label: "all", keep: () => true },
  { key: "errors", label: "errors", keep: (r, c) => r[c.finish] === "error" },
  { key: "invalid", label: "invalid", keep: (r, c) => r[c.invalid_outputs] > 0, outputs: "invalid_outputs" },
  { key: "closed", label: "closed early", keep: (r, c) => r[c.closed_outputs] > 0, outputs: "closed_outputs" },
  { key: "wrong", label: "wrong answer", keep: (r, c) => r[c.correct] === false },
  { key: "changed", label: "changed since baseline", keep: (r, c) => r[c.changed] !== null, baseline: true },
];

AB.Table = class {
  constructor(data, onOpen) {
    this.data = data;
    this.rows = data.rows;
    this.col = Object.fromEntries(data.columns.map((name, i) => [name, i]));
    this.onOpen = onOpen;
    this.baseline = !!data.summary.baseline;
    this.columns = AB.COLUMNS.filter((c) => !c.baseline || this.baseline);
    this.filter = "all"; this.query = ""; this.sortKey = null; this.sortDir = 1; this.selected = -1;
    this.rowHeight = 28;
    this.viewport = document.getElementById("viewport");
    this.spacer = document.getElementById("spacer");
    this.body = document.getElementById("rows");
    document.getElementById("lines").style.setProperty("--cols", this.columns.map((c) => c.width).join(" "));
    this.header();
    this.filters();
    this.bind();
    this.update();
  }

  header() {
    this.sortButtons = this.columns.map((c) => AB.el("button", { class: c.num ? "num" : "", role: "columnheader",
      "data-sort": c.key, title: "sort by " + c.label, text: c.label, onclick: () => this.sortBy(c.key) }));
    document.getElementById("thead").replaceChildren(...this.sortButtons);
  }

  // Counted once from the rows: the buttons say how many lines (and outputs) each keeps.
  filters() {
    this.counts = {};
    const box = document.getElementById("filters");
    this.buttons = AB.FILTERS.filter((f) => !f.baseline || this.baseline).map((f) => {
      let lines = 0, outputs = 0;
      for (const r of this.rows) if (f.keep(r, this.col)) { lines++; outputs += f.outputs ? r[this.col[f.outputs]] : 1; }
      this.counts[f.key] = { lines, outputs };
      const text = outputs !== lines ? `${f.label} ${outputs} outputs in ${lines} lines` : `${f.label} ${lines}`;
      return AB.el("button", { "data-filter": f.key, "data-lines": lines, "data-outputs": outputs,
        "aria-pressed": f.key === this.filter ? "true" : "false", disabled: lines === 0 && f.key !== "all",
        text, onclick: () => this.setFilter(f.key) });
    });
    box.replaceChildren(...this.buttons);
  }

  bind() {
    let pending = false;
    this.viewport.addEventListener("scroll", () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; this.draw(); });
    });
    let timer = null;
    document.getElementById("search").addEventListener("input", (e) => {
      clearTimeout(timer);
      timer = setTimeout(() => { this.query = e.target.value.trim().toLowerCase(); this.update(); }, 120);
    });
    this.viewport.addEventListener("keydown", (e) => this.key(e));
    window.addEventListener("resize", () => this.draw());
  }

  key(e) {
    const at = this.order.indexOf(this.selected);
    const next = e.key === "ArrowDown" ? at + 1 : e.key === "ArrowUp" ? at - 1 : null;
    if (next === null || next < 0 || next >= this.order.length) return;
    e.preventDefault();
    this.open(this.order[next]);
  }

  // What search reads of a line: its id, output, expected answer and error, lower-cased.
  haystack(position) {
    if (!this.hay) this.hay = new Array(this.rows.length);
    if (this.hay[position] === undefined) {
      const d = this.data.details[position] || {};
      const r = this.rows[position];
      this.hay[position] = [r[this.col.id], d.text, d.answer, d.error && d.error.message, r[this.col.error]]
        .filter((x) => x !== undefined && x !== null).join("\n").toLowerCase();
    }
    return this.hay[position];
  }

  setFilter(key) {
    this.filter = key;
    for (const b of this.buttons) b.setAttribute("aria-pressed", b.dataset.filter === key ? "true" : "false");
    this.update();
  }

  sortBy(key) {
    this.sortDir = this.sortKey === key ? -this.sortDir : 1;
    this.sortKey = key;
    for (const b of this.sortButtons) {
      b.setAttribute("aria-sort", b.dataset.sort !== key ? "none" : this.sortDir > 0 ? "ascending" : "descending");
    }
    this.update();
  }

  // The positions shown, in order: filtered, searched, sorted (empty values last).
  update() {
    const f = AB.FILTERS.find((x) => x.key === this.filter);
    const order = [];
    for (let i = 0; i < this.rows.length; i++) {
      if (f.keep(this.rows[i], this.col) && (!this.query || this.haystack(i).includes(this.query))) order.push(i);
    }
    if (this.sortKey) {
      const c = this.col[this.sortKey], dir = this.sortDir;
      const value = (i) => { const v = this.rows[i][c]; return typeof v === "boolean" ? Number(v) : v; };
      order.sort((a, b) => {
        const x = value(a), y = value(b);
        if (x === y) return a - b;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * dir;
      });
    }
    this.order = order;
    this.spacer.style.height = order.length * this.rowHeight + "px";
    const shown = document.getElementById("shown");
    shown.dataset.count = order.length;
    shown.textContent = `showing ${order.length.toLocaleString("en-US")} of ${this.rows.length.toLocaleString("en-US")} lines`;
    this.viewport.scrollTop = 0;
    this.draw();
  }

  cell(c, r) {
    const v = r[this.col[c.key]];
    if (c.key === "status") return AB.statusPill(v);
    if (c.key === "valid") return v === null ? "–" : v ? "✓" : "✗";
    if (c.num) return c.key.endsWith("_ms") ? AB.ms(v) : AB.int(v);
    return v === null || v === undefined ? "–" : String(v);
  }

  // Only the rows in view (and a few around them) exist as elements.
  draw() {
    const h = this.rowHeight;
    const first = Math.max(0, Math.floor(this.viewport.scrollTop / h) - 8);
    const last = Math.min(this.order.length, first + Math.ceil(this.viewport.clientHeight / h) + 16);
    const nodes = [];
    for (let k = first; k < last; k++) {
      const position = this.order[k];
      const r = this.rows[position];
      nodes.push(AB.el("div", { class: "row" + (position === this.selected ? " selected" : ""), role: "row",
        "data-position": position, "data-index": r[this.col.index], onclick: () => this.open(position) },
      this.columns.map((c) => AB.el("span", { class: c.num ? "num" : "", role: "gridcell", title: c.key === "id" ? r[this.col.id] : null }, this.cell(c, r)))));
    }
    this.body.style.transform = `translateY(${first * h}px)`;
    if (!this.order.length) nodes.push(AB.el("div", { class: "empty", text: "No line matches." }));
    this.body.replaceChildren(...nodes);
  }

  open(position) {
    this.selected = position;
    const k = this.order.indexOf(position);
    if (k >= 0) {
      const top = k * this.rowHeight, view = this.viewport;
      if (top < view.scrollTop || top + this.rowHeight > view.scrollTop + view.clientHeight) view.scrollTop = top - view.clientHeight / 3;
    }
    this.draw();
    history.replaceState(null, "", "#line=" + this.rows[position][this.col.index]);
    this.onOpen(position);
  }

  openById(id) {
    this.openAt(this.rows.findIndex((r) => r[this.col.id] === id));
  }

  // A line named elsewhere on the page: shown in the table even if a filter or search hid it.
  openAt(position) {
    if (position < 0) return;
    if (!this.order.includes(position)) { this.query = ""; document.getElementById("search").value = ""; this.setFilter("all"); }
    document.getElementById("lines").scrollIntoView();
    this.open(position);
  }

  openFromHash() {
    const m = /^#line=(\d+)$/.exec(location.hash);
    if (!m) return;
    const position = this.rows.findIndex((r) => r[this.col.index] === Number(m[1]));
    if (position >= 0) this.open(position);
  }
};
