// What a controller can ask of the host: token sets, grammars and the actions.
//
// Values here are plain frozen objects, built without a host: text to splice and regex
// token sets stay symbolic (`Splice.text`, `Matching.pattern`) until the session resolves
// them with host calls at the boundary, so they can be module-level constants and traces
// stay readable. Mirrors the WIT types `token-set`, `grammar`, `segment`, `splice`,
// `action` (and, from aici:controller@0.2.0 on, `fork`).

export const U32_MAX = 2 ** 32 - 1;

/**
 * A plain array copy of an array, typed array or other iterable. An index loop: in a
 * component SpiderMonkey interprets (no JIT), and `Array.from`/spread go through the
 * iterator protocol, which costs several times more per call on the step's hot path.
 */
export function listOf(values) {
  if (Array.isArray(values) || ArrayBuffer.isView(values)) {
    const n = values.length;
    const out = new Array(n);
    for (let i = 0; i < n; i++) out[i] = values[i];
    return out;
  }
  return Array.from(values);
}

/** Which tokens may be sampled next. `set.invert()` is the complement where it is cheap. */
export class TokenSet {
  invert() {
    throw new TypeError(`${this.constructor.name} has no cheap complement`);
  }
}

export class AllTokens extends TokenSet {
  invert() {
    throw new RangeError("the complement of ALL is empty: nothing could be sampled");
  }

  toString() {
    return "ALL";
  }
}

export class Allow extends TokenSet {
  constructor(tokens) {
    super();
    this.tokens = Object.freeze(listOf(tokens));
    Object.freeze(this);
  }

  invert() {
    return new Deny(this.tokens);
  }

  toString() {
    return `allow(${JSON.stringify(this.tokens)})`;
  }
}

export class Deny extends TokenSet {
  constructor(tokens) {
    super();
    this.tokens = Object.freeze(listOf(tokens));
    Object.freeze(this);
  }

  invert() {
    return new Allow(this.tokens);
  }

  toString() {
    return `deny(${JSON.stringify(this.tokens)})`;
  }
}

/**
 * Bit i of word i >>> 5 set = token i allowed. Costly on the boundary (one u32 per 32
 * tokens, about 4.5 ms for a 256k vocabulary): prefer `tokensMatching` for vocabulary-wide
 * sets.
 */
export class Bitmask extends TokenSet {
  constructor(words) {
    super();
    this.words = Object.freeze(Array.from(words, (w) => w >>> 0));
    Object.freeze(this);
  }

  static fromTokens(tokens, vocabSize) {
    const words = new Array(Math.ceil(vocabSize / 32)).fill(0);
    for (const t of tokens) {
      if (!Number.isInteger(t) || t < 0 || t >= vocabSize) {
        throw new RangeError(`token ${t} is outside the vocabulary (size ${vocabSize})`);
      }
      words[t >>> 5] = (words[t >>> 5] | (1 << (t & 31))) >>> 0;
    }
    return new Bitmask(words);
  }

  toString() {
    let n = 0;
    for (let w of this.words) {
      for (; w; w >>>= 1) n += w & 1;
    }
    return `bitmask(${n} tokens)`;
  }
}

/**
 * Tokens whose text fully matches `pattern` (Python `re` syntax), computed on the host.
 * `handle` is filled in by the session (one host call per pattern per sequence).
 */
export class Matching extends TokenSet {
  constructor(pattern, negated = false, handle = null) {
    super();
    this.pattern = pattern;
    this.negated = negated;
    this.handle = handle;
    Object.freeze(this);
  }

  invert() {
    return new Matching(this.pattern, !this.negated, this.handle);
  }

  toString() {
    const name = this.negated ? "notMatching" : "tokensMatching";
    return `${name}(${JSON.stringify(this.pattern)})`;
  }
}

export const ALL = Object.freeze(new AllTokens());

/** Only these token ids. */
export function allow(tokens) {
  const ids = tokenIds(tokens, "allow");
  if (ids.length === 0) {
    throw new RangeError("allow() needs at least one token: an empty set cannot be sampled");
  }
  return new Allow(ids);
}

/** Any token but these ids. */
export function deny(tokens) {
  return new Deny(tokenIds(tokens, "deny"));
}

/**
 * The tokens whose decoded text fully matches `pattern`, a regular expression in Python
 * `re` syntax (the host scans the vocabulary once per pattern; the guest only holds a
 * handle). `.` does not match a newline: start with `(?s)` when tokens may contain one.
 * The host checks the pattern: a bad one fails the step that samples with it.
 */
export function tokensMatching(pattern) {
  return new Matching(textArg(pattern, "tokensMatching"));
}

/** The complement of `tokensMatching(pattern)`. */
export function notMatching(pattern) {
  return new Matching(textArg(pattern, "notMatching"), true);
}

export class Grammar {
  /** `kind`: "json-schema", "regex", "lark" or "choice"; `value`: text, or the options. */
  constructor(kind, value) {
    this.kind = kind;
    this.value = Array.isArray(value) ? Object.freeze(listOf(value)) : value;
    Object.freeze(this);
  }
}

/** Sample one token from `tokens`; the controller then receives its id. */
export class Sample {
  constructor(tokens) {
    this.tokens = tokens;
    Object.freeze(this);
  }

  toString() {
    return `sample(${this.tokens})`;
  }
}

const GRAMMAR_OPTION = {
  "json-schema": "jsonSchema",
  regex: "regex",
  lark: "lark",
  choice: "choices",
};

/** A segment the host runs natively; the controller then receives its text. */
export class Generate {
  constructor(grammar, maxTokens, stop = []) {
    this.grammar = grammar;
    this.maxTokens = maxTokens;
    this.stop = Object.freeze(listOf(stop));
    Object.freeze(this);
  }

  toString() {
    const parts = [];
    if (this.grammar !== null) {
      parts.push(`${GRAMMAR_OPTION[this.grammar.kind]}: ${JSON.stringify(this.grammar.value)}`);
    }
    parts.push(`maxTokens: ${this.maxTokens}`);
    if (this.stop.length) parts.push(`stop: ${JSON.stringify(this.stop)}`);
    return `gen({${parts.join(", ")}})`;
  }
}

/**
 * Remove the last `backtrack` tokens, then append `text` (or `tokens`) unsampled.
 * Invariant: `tokens === null` until the session tokenizes `text` on the host; a splice
 * made from token ids (`spliceTokens`) carries them from the start.
 */
export class Splice {
  constructor(backtrack = 0, text = "", tokens = null) {
    this.backtrack = backtrack;
    this.text = text;
    this.tokens = tokens === null ? null : Object.freeze(listOf(tokens));
    Object.freeze(this);
  }

  withTokens(tokens) {
    return new Splice(this.backtrack, this.text, tokens);
  }

  toString() {
    if (this.backtrack === 0 && this.text) return `fixed(${JSON.stringify(this.text)})`;
    if (this.text || this.tokens === null) {
      return `backtrack(${this.backtrack}, ${JSON.stringify(this.text)})`;
    }
    return `spliceTokens(${this.backtrack}, ${JSON.stringify(this.tokens)})`;
  }
}

/** The sequence is complete. */
export class Stop {
  toString() {
    return "stop()";
  }
}

/** Split the sequence into `n` branches (aici:controller@0.2.0); each receives its index. */
export class Fork {
  constructor(n) {
    this.n = n;
    Object.freeze(this);
  }

  toString() {
    return `fork(${this.n})`;
  }
}

export const ACTION_TYPES = Object.freeze([Sample, Generate, Splice, Stop, Fork]);

export function isAction(value) {
  return (
    value instanceof Sample ||
    value instanceof Generate ||
    value instanceof Splice ||
    value instanceof Stop ||
    value instanceof Fork
  );
}

/** Sample one token from `tokens`; `yield` it to receive the sampled token id. */
export function sample(tokens = ALL) {
  if (!(tokens instanceof TokenSet)) {
    throw new TypeError(
      "sample() takes a token set (ALL, allow(...), deny(...), tokensMatching(...)), " +
        `got ${describeValue(tokens)}`,
    );
  }
  return new Sample(tokens);
}

const GEN_OPTIONS = ["jsonSchema", "regex", "lark", "choices", "maxTokens", "stop"];

/**
 * A host-enforced segment; `yield` it to receive the segment's text.
 *
 * Options: at most one grammar of `jsonSchema` (an object or JSON text), `regex`, `lark`,
 * `choices` (none = free text); `maxTokens` (default 256); `stop` (a string or a list).
 * The segment ends when the grammar completes, after `maxTokens`, at a stop string or at
 * end-of-sequence; the controller is not called in between, which makes segments fast.
 */
export function gen(options = {}) {
  if (options === null || typeof options !== "object" || Array.isArray(options)) {
    throw new TypeError(
      `gen() takes an options object, e.g. gen({ choices: ["yes", "no"] }), got ${describeValue(options)}`,
    );
  }
  const unknown = Object.keys(options).filter((k) => !GEN_OPTIONS.includes(k));
  if (unknown.length) {
    throw new TypeError(
      `gen() got the unknown option ${JSON.stringify(unknown[0])} (it takes ${GEN_OPTIONS.join(", ")})`,
    );
  }
  const { jsonSchema, regex, lark, choices, maxTokens = 256, stop = [] } = options;
  const given = ["jsonSchema", "regex", "lark", "choices"].filter(
    (k) => options[k] !== undefined && options[k] !== null,
  );
  if (given.length > 1) {
    throw new TypeError(`gen() takes at most one grammar, got ${given.join(", ")}`);
  }
  let grammar = null;
  if (given[0] === "jsonSchema") {
    grammar = new Grammar("json-schema", schemaText(jsonSchema));
  } else if (given[0] === "regex") {
    grammar = new Grammar("regex", textArg(regex, "gen({ regex })"));
  } else if (given[0] === "lark") {
    grammar = new Grammar("lark", textArg(lark, "gen({ lark })"));
  } else if (given[0] === "choices") {
    if (!Array.isArray(choices) || !choices.every((c) => typeof c === "string")) {
      throw new TypeError("gen({ choices }) takes an array of strings");
    }
    if (choices.length === 0) throw new RangeError("gen({ choices: [] }) has nothing to choose from");
    grammar = new Grammar("choice", choices);
  }
  if (typeof maxTokens !== "number" || !Number.isInteger(maxTokens)) {
    throw new TypeError(`gen({ maxTokens }) takes an integer, got ${describeValue(maxTokens)}`);
  }
  if (maxTokens < 1 || maxTokens > U32_MAX) {
    throw new RangeError(`gen({ maxTokens: ${maxTokens} }) must be at least 1`);
  }
  const stops = typeof stop === "string" ? [stop] : stop;
  if (!Array.isArray(stops) || !stops.every((s) => typeof s === "string" && s.length > 0)) {
    throw new TypeError("gen({ stop }) takes a non-empty string or an array of them");
  }
  return new Generate(grammar, maxTokens, stops);
}

/**
 * A JSON value that follows `schema`: `const value = yield* genJson(schema)`.
 * Options: `maxTokens`, `stop`, as for `gen`.
 */
export function* genJson(schema, options = {}) {
  const { maxTokens = 256, stop = [] } = options;
  const text = yield gen({ jsonSchema: schema, maxTokens, stop });
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new SyntaxError(
      `genJson: the segment is not complete JSON (${e.message}); it may have hit ` +
        `maxTokens=${maxTokens} or end-of-sequence: ${JSON.stringify(text.slice(0, 80))}`,
    );
  }
}

/** Append `text` without sampling (tokenized by the host); resumes with undefined. */
export function fixed(text) {
  return new Splice(0, textArg(text, "fixed"));
}

/** Remove the last `n` generated tokens, then append `text`; resumes with undefined. */
export function backtrack(n, text = "") {
  return new Splice(count(n, "backtrack"), textArg(text, "backtrack"));
}

/** Remove the last `n` generated tokens, then append these token ids. */
export function spliceTokens(n, tokens) {
  return new Splice(count(n, "spliceTokens"), "", tokenIds(tokens, "spliceTokens"));
}

/** End the sequence (returning from a generator controller does the same). */
export function stop() {
  return new Stop();
}

/**
 * Split the sequence into `n` branches (2 <= n) that share every token so far:
 * `const branch = yield fork(3)` gives each branch its index, 0..n-1. Needs a host with
 * the aici:controller@0.2.0 contract.
 */
export function fork(n) {
  if (typeof n !== "number" || !Number.isInteger(n) || n < 2 || n > U32_MAX) {
    throw new RangeError(`fork(${describeValue(n)}): the branch count must be an integer >= 2`);
  }
  return new Fork(n);
}

function schemaText(schema) {
  if (typeof schema === "string") {
    try {
      JSON.parse(schema);
    } catch (e) {
      throw new SyntaxError(`gen({ jsonSchema }): the schema is not JSON: ${e.message}`);
    }
    return schema;
  }
  if (typeof schema === "object" && !Array.isArray(schema)) {
    return JSON.stringify(schema);
  }
  throw new TypeError(
    `gen({ jsonSchema }) takes an object or JSON text, got ${describeValue(schema)}`,
  );
}

function textArg(value, where) {
  if (typeof value !== "string") {
    throw new TypeError(`${where} takes a string, got ${describeValue(value)}`);
  }
  return value;
}

function count(n, where) {
  if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > U32_MAX) {
    throw new RangeError(`${where}(${describeValue(n)}, ...): the token count must be an integer >= 0`);
  }
  return n;
}

function tokenIds(tokens, where) {
  if (tokens === null || typeof tokens !== "object" || !(Symbol.iterator in tokens)) {
    throw new TypeError(`${where}() takes an array of token ids, got ${describeValue(tokens)}`);
  }
  const ids = Array.from(tokens);
  for (const t of ids) {
    if (typeof t !== "number" || !Number.isInteger(t) || t < 0 || t > U32_MAX) {
      throw new RangeError(`${where}(): ${describeValue(t)} is not a token id`);
    }
  }
  return ids;
}

/** A value as an error message shows it: its type and a short rendering. */
export function describeValue(value) {
  if (value === null) return "null";
  if (value === undefined) return "undefined";
  if (typeof value === "string") return `string ${JSON.stringify(value.slice(0, 60))}`;
  if (typeof value === "function") return `function ${value.name || "(anonymous)"}`;
  if (typeof value === "object") {
    const name = value.constructor?.name ?? "Object";
    let shown = "";
    try {
      shown = JSON.stringify(value) ?? "";
    } catch {
      shown = "";
    }
    return shown ? `${name} ${shown.slice(0, 60)}` : name;
  }
  return `${typeof value} ${String(value)}`;
}
