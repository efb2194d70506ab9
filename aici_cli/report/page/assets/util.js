// aici-batch report --html: shared helpers. Every script of the page adds to `AB`.
"use strict";
const AB = {};

// An element with attributes and children; text goes in as text, never as HTML.
AB.el = function (tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
};

// Children for replaceChildren: nested lists flattened, the absent left out.
AB.flat = (...items) => items.flat(Infinity).filter((x) => x !== null && x !== undefined && x !== false);

AB.int = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
AB.ms = (n) => (n === null || n === undefined ? "–" : Number(n).toFixed(n >= 100 ? 0 : 1));
AB.pct = (x, digits = 1) => (x === null || x === undefined ? "–" : (100 * x).toFixed(digits) + "%");
AB.signed = (x) => (x >= 0 ? "+" : "") + x.toFixed(4);

// Pretty JSON of a value, or of a text when it parses as JSON; null otherwise.
AB.prettyJson = function (text) {
  if (typeof text !== "string") return JSON.stringify(text, null, 2);
  const trimmed = text.trim();
  if (!trimmed || !"{[".includes(trimmed[0])) return null;
  try { return JSON.stringify(JSON.parse(trimmed), null, 2); } catch (e) { return null; }
};

AB.pre = (text, cls) => AB.el("pre", { class: cls, text });

// A status as the CI outputs name it, coloured.
AB.statusPill = (status) => AB.el("span", { class: "pill st-" + status, text: status });

// The page's data, unpacked: JSON as it is, or gzip+base64 through DecompressionStream.
AB.loadData = async function () {
  const node = document.getElementById("aici-data");
  if (!node) throw new Error("this page holds no report data");
  const text = node.textContent;
  if (node.dataset.encoding === "json") return JSON.parse(text);
  if (typeof DecompressionStream === "undefined") {
    throw new Error("this browser cannot unpack the page's data (it needs DecompressionStream: " +
      "Chrome 80, Firefox 113, Safari 16.4 or later)");
  }
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
};

AB.fail = function (error) {
  const box = document.getElementById("failure");
  box.hidden = false;
  box.textContent = "The report could not be shown: " + (error && error.message ? error.message : error);
};
