// The host primitives a controller may call, and the active host.
//
// Two hosts implement them: the in-component one (`wit/bindings.js`, which calls the
// component's imports) and `testing.js`'s `StubHost` (plain node). Controller code never
// picks one: the session activates its host around every step, and the module-level
// helpers (`log`, `setOutput`, `setLineOutput`, `storage`, `tools`) go to whichever host is
// active.
//
// A host has: vocabSize(), eosToken(), tokenize(text) -> number[], decode(tokens) -> string,
// tokenBytes(token) -> Uint8Array, tokensMatching(pattern) -> handle (throws on a bad
// pattern), log(message), setOutput(key, jsonText); and for aici:controller@0.2.0:
// setLineOutput(key, jsonText), storageGet(key) -> Uint8Array | null,
// storageSet(key, bytes), storageAppend(key, bytes) -> number, and `canFork`; and for
// aici:tools@0.1.0: listTools() -> [{ name, description, inputSchema (JSON text) }],
// callTool(name, argumentsJson) -> [ok, text] (text: the answer, or "TYPE: message").

let active = null;

/** Make `host` (or null) the target of the module-level helpers; returns the previous
 * one, which the caller restores when its step ends. */
export function activate(host) {
  const previous = active;
  active = host;
  return previous;
}

export function currentHost() {
  if (active === null) {
    throw new Error(
      "no running controller: log(), setOutput(), storage and tools work only while the host " +
        "runs the controller (inside its generator or step method)",
    );
  }
  return active;
}

/** Append a line to the sequence's `logs` per line of text (what console.log does too). */
export function log(...args) {
  const host = currentHost();
  for (const line of formatLog(args).split("\n")) host.log(line);
}

/** Set `outputs[key]` in the sequence's result line; `value` must be JSON-serializable. */
export function setOutput(key, value) {
  currentHost().setOutput(keyArg(key, "setOutput"), toJson(value, key, "setOutput"));
}

/**
 * Set the line's own `outputs[key]`, shared by all its branches (the last write wins):
 * what a controller reports across branches. Needs aici:controller@0.2.0.
 */
export function setLineOutput(key, value) {
  currentHost().setLineOutput(keyArg(key, "setLineOutput"), toJson(value, key, "setLineOutput"));
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/**
 * Variables the host keeps for the branches of one input line (aici:controller@0.2.0,
 * aici:storage@0.1.0). Values are bytes: a string is stored as its UTF-8.
 */
export const storage = Object.freeze({
  /** The value under `key` (a Uint8Array), or undefined. */
  get(key) {
    const value = currentHost().storageGet(keyArg(key, "storage.get"));
    return value === null || value === undefined ? undefined : value;
  },
  /** The value under `key` decoded as UTF-8, or undefined. */
  getText(key) {
    const value = storage.get(key);
    return value === undefined ? undefined : decoder.decode(value);
  },
  /** Set `key` to `value` (a Uint8Array or a string). */
  set(key, value) {
    currentHost().storageSet(keyArg(key, "storage.set"), bytesArg(value, "storage.set"));
  },
  /** Append `value` to `key`'s value (empty if unset); returns the new length in bytes. */
  append(key, value) {
    return currentHost().storageAppend(
      keyArg(key, "storage.append"),
      bytesArg(value, "storage.append"),
    );
  },
});

/** A tool call the host answered with `err`: `type` ("tool_not_allowed", "tool_error",
 * "tool_timeout", ...) and `message`. */
export class ToolError extends Error {
  constructor(type, message) {
    super(`${type}: ${message}`);
    this.name = "ToolError";
    this.type = type;
    this.detail = message;
  }

  /** The host's "TYPE: message". */
  static parse(text) {
    const at = text.indexOf(": ");
    const type = at < 0 ? "" : text.slice(0, at);
    if (at < 0 || type.includes(" ")) return new ToolError("tool_failed", text);
    return new ToolError(type, text.slice(at + 2));
  }
}

/**
 * The tools the run allows this controller (aici:tools@0.1.0; `aici-batch run --mcp
 * NAME=COMMAND --allow-tool TOOL`). `callTool` waits for the answer (the host bounds it
 * with --tool-timeout, and the engine's step waits with it); the answer is the server's
 * text, untrusted. A call the host cannot answer throws `ToolError`.
 */
export const tools = Object.freeze({
  /** The tools this controller may call: [{ name, description, inputSchema (an object) }]. */
  listTools() {
    return currentHost()
      .listTools()
      .map((t) => ({ name: t.name, description: t.description, inputSchema: parseSchema(t.inputSchema) }));
  },
  /** Call tool `name` with `args` (an object, or its JSON text; default {}); its answer's text. */
  callTool(name, args = {}) {
    if (typeof name !== "string") throw new TypeError(`tools.callTool() takes the tool's name as a string, got ${typeof name}`);
    const text = typeof args === "string" ? args : JSON.stringify(args);
    const [ok, answer] = currentHost().callTool(name, text);
    if (!ok) throw ToolError.parse(answer);
    return answer;
  },
});

function parseSchema(text) {
  try {
    const value = JSON.parse(text);
    return value !== null && typeof value === "object" && !Array.isArray(value) ? value : {};
  } catch {
    return {};
  }
}

export function toJson(value, key, where = "setOutput") {
  let text;
  try {
    text = JSON.stringify(value);
  } catch (e) {
    throw new TypeError(
      `${where}(${JSON.stringify(key)}, ...): the value must be JSON-serializable: ${e.message}`,
    );
  }
  if (text === undefined) {
    throw new TypeError(
      `${where}(${JSON.stringify(key)}, ...): the value must be JSON-serializable ` +
        `(string, number, boolean, null, array, object), got ${typeof value}`,
    );
  }
  return text;
}

/** console.log's rendering: strings as they are, errors as "Name: message", the rest JSON. */
export function formatLog(args) {
  return args.map(formatOne).join(" ");
}

function formatOne(value) {
  if (typeof value === "string") return value;
  if (value instanceof Error) return value.message ? `${value.name}: ${value.message}` : value.name;
  if (value === undefined || typeof value === "function" || typeof value === "symbol") {
    return String(value);
  }
  if (typeof value === "bigint") return `${value}n`;
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

function keyArg(key, where) {
  if (typeof key !== "string") {
    throw new TypeError(`${where}() takes a string key, got ${typeof key}`);
  }
  return key;
}

function bytesArg(value, where) {
  if (typeof value === "string") return encoder.encode(value);
  if (value instanceof Uint8Array) return value;
  throw new TypeError(
    `${where}() takes a Uint8Array or a string value, got ${value === null ? "null" : typeof value}`,
  );
}
