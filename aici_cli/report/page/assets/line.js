// aici-batch report --html: one line opened: its prompt, output, validator errors, tool
// calls, steps and the rest of its result.

AB.section = (title, ...body) => [AB.el("h3", { text: title }), ...body];

AB.messages = function (messages) {
  return messages.map((m) => {
    const calls = (m.tool_calls || []).map((c) => AB.toolCall(c));
    const content = typeof m.content === "string" ? m.content : m.content === null || m.content === undefined ? "" : JSON.stringify(m.content, null, 2);
    const role = m.role === "tool" ? `tool result${m.tool_call_id ? " for " + m.tool_call_id : ""}` : m.role;
    return AB.el("div", { class: "msg" }, AB.el("div", { class: "role", text: role }),
      content ? (AB.prettyJson(content) ? AB.pre(AB.prettyJson(content)) : AB.promptText(content)) : null, calls);
  });
};

// A long prompt (a few-shot prefix) shows its end, where the line's own question is.
AB.PROMPT_TAIL = 700;
AB.promptText = function (text) {
  if (text.length <= AB.PROMPT_TAIL * 1.5) return AB.pre(text, "prompt");
  const pre = AB.pre("", "prompt");
  const more = AB.el("a", { href: "#", class: "more", text: `… ${(text.length - AB.PROMPT_TAIL).toLocaleString("en-US")} characters before; show all` });
  more.addEventListener("click", (e) => { e.preventDefault(); pre.textContent = text; });
  pre.append(more, "\n" + text.slice(-AB.PROMPT_TAIL));
  return pre;
};

AB.prompt = function (d) {
  if (!d.input) return AB.section("Prompt", AB.el("p", { class: "muted", text: d.input_note }));
  const input = d.input;
  const out = AB.section(input.messages ? "Messages" : "Prompt",
    input.messages ? AB.messages(input.messages) : AB.promptText(input.prompt === undefined ? "" : String(input.prompt)));
  const constraint = ["json_schema", "regex", "choices", "grammar", "tools"].filter((k) => k in input);
  for (const key of constraint) {
    out.push(AB.el("details", {}, AB.el("summary", { text: key.replace("_", " ") }),
      AB.pre(typeof input[key] === "string" ? input[key] : JSON.stringify(input[key], null, 2))));
  }
  return out;
};

AB.toolCall = function (call) {
  const f = call.function || {};
  return AB.el("div", { class: "tool-call" }, AB.el("code", { text: `${f.name}(…)` }),
    call.id ? AB.el("span", { class: "muted", text: "  " + call.id }) : null,
    AB.pre(AB.prettyJson(f.arguments || "") || f.arguments || ""));
};

AB.schemaErrors = function (sample) {
  if (sample.schema_errors) {
    return AB.section(`Validator errors (${sample.schema_errors.length})`, sample.schema_errors.map((e) =>
      AB.el("div", { class: "schema-error" }, AB.el("code", { text: e.path }), " ", e.message,
        AB.el("div", { class: "muted", text: `${e.keyword}${e.schema_path ? " at schema " + e.schema_path : ""}` }))));
  }
  if (sample.schema_errors_note) return AB.section("Validator errors", AB.el("p", { class: "muted", text: sample.schema_errors_note }));
  return [];
};

AB.output = function (sample) {
  const out = [];
  const shown = "json" in sample ? JSON.stringify(sample.json, null, 2) : AB.prettyJson(sample.text);
  out.push(...AB.section(shown !== null ? "Output (JSON)" : "Output", AB.pre(shown !== null ? shown : sample.text || "", "output")));
  if (shown !== null && "json" in sample && sample.text !== undefined) {
    out.push(AB.el("details", {}, AB.el("summary", { text: "as written" }), AB.pre(sample.text)));
  }
  if (sample.error) out.push(...AB.section("Error", AB.el("p", {}, AB.el("span", { class: "pill st-error", text: sample.error.type }), " " + sample.error.message)));
  out.push(...AB.schemaErrors(sample));
  if (sample.tool_calls) out.push(...AB.section(`Tool calls (${sample.tool_calls.length})`, sample.tool_calls.map(AB.toolCall)));
  if (sample.dropped_call) out.push(...AB.section("Call cut off at max_tokens", AB.pre(sample.dropped_call)));
  return out;
};

AB.scores = (scores) => AB.section("Scores", AB.el("table", { class: "plain" },
  AB.el("tr", {}, AB.el("th", { text: "choice" }), AB.el("th", { class: "num", text: "logprob" }), AB.el("th", { class: "num", text: "tokens" })),
  scores.map((s) => AB.el("tr", {}, AB.el("td", {}, AB.el("code", { text: JSON.stringify(s.choice) }), s.greedy ? " (greedy)" : ""),
    AB.el("td", { class: "num", text: Number(s.logprob).toFixed(3) }), AB.el("td", { class: "num", text: s.tokens })))));

AB.STEP_PARTS = [["forward_ms", "#4c72b0"], ["mask_ms", "#dd8452"], ["controller_ms", "#55a868"], ["sample_ms", "#c44e52"]];

// Per-step timings: a row per step, its time split drawn to one scale.
AB.steps = function (steps) {
  const shown = steps.slice(0, 400);
  const longest = Math.max(...shown.map((s) => AB.STEP_PARTS.reduce((a, [k]) => a + s[k], 0)), 1e-9);
  const legend = AB.el("div", { class: "legend muted" }, AB.STEP_PARTS.map(([k, color]) => [AB.el("i", { style: `background:${color}` }), k.replace("_ms", "")]));
  const rows = shown.map((s) => {
    const total = AB.STEP_PARTS.reduce((a, [k]) => a + s[k], 0);
    const bar = AB.el("div", { class: "bar", style: `width:${(100 * total) / longest}%` },
      AB.STEP_PARTS.map(([k, color]) => AB.el("i", { style: `width:${total ? (100 * s[k]) / total : 0}%;background:${color}`, title: `${k} ${s[k]} ms` })));
    return AB.el("tr", {}, AB.el("td", { class: "num", text: s.step }), AB.el("td", { text: s.kind }),
      AB.el("td", { class: "num", text: AB.ms(total) }), AB.el("td", { style: "width:100%" }, bar));
  });
  const more = steps.length > shown.length ? AB.el("p", { class: "muted", text: `… and ${steps.length - shown.length} more steps` }) : null;
  return AB.section(`Steps (${steps.length})`, legend, AB.el("table", { class: "plain steps" },
    AB.el("tr", {}, ["step", "kind", "ms", "split"].map((h) => AB.el("th", { text: h }))), rows), more);
};

AB.stats = function (stats) {
  const entries = Object.entries(stats || {});
  return AB.section("Stats", AB.el("dl", { class: "kv" }, entries.map(([k, v]) => [AB.el("dt", { text: k }), AB.el("dd", { text: typeof v === "number" && k.endsWith("_ms") ? `${v} ms` : String(v) })])));
};

AB.SHOWN = new Set(["text", "json", "valid", "error", "tool_calls", "dropped_call", "scores", "stats", "steps",
  "choices", "input", "input_note", "schema_errors", "schema_errors_note", "finish_reason", "answer", "correct"]);

AB.showLine = function (data, position) {
  const d = data.details[position];
  const r = data.rows[position];
  const col = AB.table.col;
  const head = AB.el("div", { class: "line-head" }, AB.el("h3", { text: `${r[col.id]} (line ${r[col.index]})` }),
    AB.statusPill(r[col.status]), " ", AB.el("span", { class: "muted", text: `finish ${d.finish_reason}` }),
    r[col.closed] ? AB.el("span", { class: "muted", text: ` · closed early (${r[col.closed]})` }) : null,
    r[col.changed] ? AB.el("span", { class: "muted", text: ` · ${r[col.changed]} since the baseline` }) : null);
  // With samples, each shows its own output; the top level repeats sample 0's.
  const error = d.error ? AB.section("Error", AB.el("p", {}, AB.el("span", { class: "pill st-error", text: d.error.type }), " " + d.error.message)) : [];
  const body = [head, ...AB.prompt(d), ...(d.choices ? error : AB.output(d))];
  if ("answer" in d) body.push(...AB.section("Expected answer", AB.pre(d.answer), AB.el("p", { class: d.correct ? "pass" : "fail", text: d.correct ? "✓ correct" : "✗ wrong" })));
  if (d.scores) body.push(...AB.scores(d.scores));
  (d.choices || []).forEach((c, i) => body.push(AB.el("details", { open: i < 4 }, AB.el("summary", { text: `sample ${c.sample ?? c.index}${c.branch && c.branch.length ? " branch " + c.branch.join(".") : ""}: ${c.finish_reason}${c.valid === false ? ", invalid" : ""}` }), ...AB.output(c), ...(c.steps ? AB.steps(c.steps) : []))));
  if (d.steps) body.push(...AB.steps(d.steps));
  body.push(...AB.stats(d.stats));
  const rest = Object.fromEntries(Object.entries(d).filter(([k]) => !AB.SHOWN.has(k)));
  if (Object.keys(rest).length) body.push(...AB.section("More of the result", AB.pre(JSON.stringify(rest, null, 2))));
  const panel = document.getElementById("detail");
  panel.replaceChildren(...AB.flat(body));
  panel.dataset.position = position;
  panel.scrollTop = 0;
};
