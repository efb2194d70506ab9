// Run controllers in plain node, without a build: `StubHost` plays the host.
//
// The stub runs the same `Session` code the component runs, against a tiny tokenizer, so
// a controller's logic is unit-tested in milliseconds:
//
//   import { StubHost } from "aici-controller/testing";
//   import yesNo from "./yes_no.js";
//
//   const run = new StubHost({ respond: ["yes", "Because.\n"] }).run(yesNo, { arg: '{"question": "?"}' });
//   assert.deepEqual(run.outputs, { answer: "yes", reason: "Because." });
//
// What it simulates, and how it differs from the real host:
// - tokens: greedy longest match over a vocabulary of strings (by default EOS plus one
//   token per printable ASCII character); the EOS token decodes to "";
// - `tokensMatching`: a full match of every token's text, with the pattern compiled as a
//   JS RegExp (leading inline flags such as `(?s)` become RegExp flags); the real host
//   uses Python `re` syntax;
// - `sample`: `sampler(allowedIds)` (default: a seeded pseudo-random choice);
// - segments: `respond` answers each one (a function or an array used in order; by default
//   the first option of a `choices` segment). The answer must satisfy the segment's grammar
//   where the stub can check it (choice, regex, JSON); the stub then cuts it after the
//   first stop string and at `maxTokens`, as the host would. There is no model;
// - `fork(n)`: the stub cannot copy a running controller, so it continues one branch,
//   `forkBranch` (default 0); run once per branch to test each. `storage` is a Map that
//   runs may share (pass the same `storage` option) to play branches that run in turn;
// - tools: `tools: { name: fake }` serves fake tools to `tools.listTools()` /
//   `tools.callTool()`. A fake is a function of the arguments (an object) or
//   `{ call, description, inputSchema }`; its return value is the answer (a string as it
//   is, anything else as JSON); throwing a `ToolError` answers with that host error (a
//   `new ToolError("tool_timeout", "...")` plays a hung server), throwing anything else is
//   the tool's own error (`tool_error`). As on the host, a tool not on `allowTools`
//   (default: every fake) is `tool_not_allowed`, arguments that are not a JSON object are
//   `tool_bad_arguments`, the 33rd call is `tool_quota`, and the answer's control
//   characters (but tab and newline) are dropped; `run.toolCalls` lists the calls made.

import { AllTokens, Allow, Bitmask, Deny, Fork, Generate, Matching, Sample, Splice, Stop } from "./actions.js";
import { ToolError } from "./host.js";
import { ControllerFailed, Session, checkController, findController } from "./session.js";

// The host's calls per sequence (`GuestLimits.max_tool_calls`).
const MAX_TOOL_CALLS = 32;

// EOS, then Python's `string.printable` without "\r\x0b\x0c", in its order (the Python
// SDK's stub vocabulary, so both stubs give the same token ids).
export const DEFAULT_VOCAB = Object.freeze([
  "<eos>",
  ..."0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
  ..."!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
  " ",
  "\t",
  "\n",
]);

/** The test set-up is wrong (no answer for a segment, an answer the grammar rejects, a
 * controller that never stops), as opposed to a controller error (`Run.error`). */
export class StubHostError extends Error {
  constructor(message) {
    super(message);
    this.name = "StubHostError";
  }
}

/** What one sequence produced under the stub host. */
export class Run {
  constructor(outputs, lineOutputs, logs) {
    this.actions = []; // resolved, in order
    this.outputs = outputs; // values parsed from JSON
    this.lineOutputs = lineOutputs;
    this.logs = logs;
    this.tokens = []; // the output tokens
    this.text = "";
    this.error = null; // the err message, when the controller failed
    this.toolCalls = []; // { name, arguments (JSON text), ok, text } per call, in order
  }

  /** The actions in their SDK spelling: ['fixed(" A: ")', 'gen({choices: [...], ...})', ...]. */
  get trace() {
    return this.actions.map(String);
  }
}

export class StubHost {
  /**
   * Options: `vocab` (token strings), `eos` (its text or id), `respond`, `sampler`,
   * `seed`, `forkBranch`, `storage` (a Map of key -> Uint8Array), `tools` (fake tools by
   * name), `allowTools` (the names controllers may call; default: every fake).
   */
  constructor(options = {}) {
    const {
      vocab = DEFAULT_VOCAB,
      eos = "<eos>",
      respond,
      sampler,
      seed = 0,
      forkBranch = 0,
      storage = new Map(),
      tools = {},
      allowTools,
    } = options;
    if (!Array.isArray(vocab)) throw new TypeError("vocab is an array of token strings");
    this._texts = [...vocab];
    this._ids = new Map(this._texts.map((t, i) => [t, i]));
    this._longest = Math.max(...this._texts.map((t) => t.length));
    this._eos = typeof eos === "number" ? eos : this._texts.indexOf(eos);
    if (this._eos < 0) throw new RangeError(`the EOS token ${JSON.stringify(eos)} is not in the vocabulary`);
    if (respond === undefined || typeof respond === "function") {
      this._respond = respond ?? defaultAnswer;
    } else {
      this._respond = answersInOrder([...respond]);
    }
    this._sampler = sampler ?? seededChoice(seed);
    this.forkBranch = forkBranch;
    this.storage = storage;
    this.tools = Object.fromEntries(
      Object.entries(tools).map(([name, fake]) => [name, typeof fake === "function" ? { call: fake } : fake]),
    );
    this.allowTools = new Set(allowTools ?? Object.keys(this.tools));
    this.toolCalls = [];
    this.contract = "the stub host";
    this.canFork = true;
    this._sets = [];
    this._setOf = new Map();
    this.logs = [];
    this.outputs = {};
    this.lineOutputs = {};
  }

  // Host primitives.

  vocabSize() {
    return this._texts.length;
  }

  eosToken() {
    return this._eos;
  }

  tokenize(text) {
    const ids = [];
    let i = 0;
    outer: while (i < text.length) {
      for (let n = Math.min(this._longest, text.length - i); n > 0; n--) {
        const token = this._ids.get(text.slice(i, i + n));
        if (token !== undefined && token !== this._eos) {
          ids.push(token);
          i += n;
          continue outer;
        }
      }
      throw new StubHostError(
        `the stub vocabulary cannot tokenize ${JSON.stringify(text[i])}: pass new StubHost({ vocab })`,
      );
    }
    return ids;
  }

  decode(tokens) {
    return Array.from(tokens)
      .filter((t) => t !== this._eos)
      .map((t) => this._texts[t])
      .join("");
  }

  tokenBytes(token) {
    return new TextEncoder().encode(this.decode([token]));
  }

  tokensMatching(pattern) {
    if (!this._setOf.has(pattern)) {
      const regex = fullMatch(pattern);
      const ids = new Set();
      this._texts.forEach((_, i) => {
        if (regex.test(this.decode([i]))) ids.add(i);
      });
      this._setOf.set(pattern, this._sets.length);
      this._sets.push(ids);
    }
    return this._setOf.get(pattern);
  }

  log(message) {
    this.logs.push(message);
  }

  setOutput(key, value) {
    this.outputs[key] = parseOr(value);
  }

  setLineOutput(key, value) {
    this.lineOutputs[key] = parseOr(value);
  }

  storageGet(key) {
    return this.storage.has(key) ? this.storage.get(key).slice() : null;
  }

  storageSet(key, value) {
    this.storage.set(key, Uint8Array.from(value));
  }

  storageAppend(key, value) {
    const old = this.storage.get(key) ?? new Uint8Array();
    const joined = new Uint8Array(old.length + value.length);
    joined.set(old);
    joined.set(value, old.length);
    this.storage.set(key, joined);
    return joined.length;
  }

  listTools() {
    return Object.keys(this.tools)
      .filter((name) => this.allowTools.has(name))
      .sort()
      .map((name) => ({
        name,
        description: this.tools[name].description ?? "",
        inputSchema: JSON.stringify(this.tools[name].inputSchema ?? { type: "object" }),
      }));
  }

  callTool(name, args) {
    const [ok, text] = this.toolCalls.length >= MAX_TOOL_CALLS
      ? [false, `tool_quota: more than ${MAX_TOOL_CALLS} tool calls per sequence`]
      : this._toolAnswer(name, args);
    this.toolCalls.push({ name, arguments: args, ok, text });
    return [ok, text];
  }

  _toolAnswer(name, args) {
    const fake = this.tools[name];
    if (fake === undefined || !this.allowTools.has(name)) {
      return [false, `tool_not_allowed: tool '${name}' is not on --allow-tool`];
    }
    let value;
    try {
      value = JSON.parse(args);
    } catch (e) {
      return [false, `tool_bad_arguments: the arguments of ${name} are not JSON (${e.message})`];
    }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return [false, `tool_bad_arguments: the arguments of ${name} are not a JSON object`];
    }
    let answer;
    try {
      answer = fake.call(value);
    } catch (e) {
      if (e instanceof ToolError) return [false, e.message];
      return [false, `tool_error: ${e instanceof Error ? e.message : String(e)}`];
    }
    const text = typeof answer === "string" ? answer : JSON.stringify(answer);
    // eslint-disable-next-line no-control-regex
    return [true, text.replace(/\r\n?/g, "\n").replace(/[\x00-\x08\x0b-\x1f\x7f]/g, "")];
  }

  // Driving a controller.

  /** A session to step by hand: `session.step(backtrack, tokens, segmentText, branch)`. */
  start(controller, { arg = "", prompt = "" } = {}) {
    const spec = toSpec(controller);
    this.logs = [];
    this.outputs = {};
    this.lineOutputs = {};
    this.toolCalls = [];
    const promptIds = typeof prompt === "string" ? this.tokenize(prompt) : Array.from(prompt);
    return new Session(spec, this, arg, promptIds);
  }

  /** Run one sequence to `stop` or to the controller's error. */
  run(controller, { arg = "", prompt = "", maxSteps = 10000 } = {}) {
    const session = this.start(controller, { arg, prompt });
    const run = new Run(this.outputs, this.lineOutputs, this.logs);
    run.toolCalls = this.toolCalls;
    const out = run.tokens;
    let tokens = [];
    let backtrack = 0;
    let segmentText = null;
    let branch = null;
    let steps = 0;
    for (; steps < maxSteps; steps++) {
      let action;
      try {
        action = session.step(backtrack, tokens, segmentText, branch);
      } catch (e) {
        if (!(e instanceof ControllerFailed)) throw e;
        run.error = e.message;
        break;
      }
      run.actions.push(action);
      segmentText = null;
      backtrack = 0;
      branch = null;
      tokens = [];
      if (action instanceof Stop) break;
      if (action instanceof Sample) {
        tokens = [this._sample(action.tokens)];
      } else if (action instanceof Generate) {
        [segmentText, tokens] = this._segment(action);
      } else if (action instanceof Splice) {
        backtrack = action.backtrack;
        tokens = Array.from(action.tokens);
        out.length -= backtrack;
      } else if (action instanceof Fork) {
        if (!(Number.isInteger(this.forkBranch) && this.forkBranch >= 0 && this.forkBranch < action.n)) {
          throw new StubHostError(`forkBranch ${this.forkBranch} is not a branch of fork(${action.n})`);
        }
        branch = this.forkBranch;
      }
      out.push(...tokens);
    }
    if (steps === maxSteps) throw new StubHostError(`the controller did not stop within ${maxSteps} steps`);
    run.text = this.decode(out);
    return run;
  }

  /** The ids in a resolved token set, ascending. */
  allowed(tokens) {
    const every = this._texts.map((_, i) => i);
    if (tokens instanceof AllTokens) return every;
    if (tokens instanceof Allow) return [...new Set(tokens.tokens)].sort((a, b) => a - b);
    if (tokens instanceof Deny) {
      const denied = new Set(tokens.tokens);
      return every.filter((t) => !denied.has(t));
    }
    if (tokens instanceof Bitmask) {
      const words = tokens.words;
      return every.filter((t) => (t >>> 5) < words.length && (words[t >>> 5] >>> (t & 31)) & 1);
    }
    if (tokens instanceof Matching) {
      const members = this._sets[tokens.handle];
      return every.filter((t) => members.has(t) !== tokens.negated);
    }
    throw new TypeError(`not a token set: ${tokens}`);
  }

  _sample(tokens) {
    const allowed = this.allowed(tokens);
    if (allowed.length === 0) throw new StubHostError(`sample(${tokens}) allows no token of the stub vocabulary`);
    const token = this._sampler(allowed);
    if (!allowed.includes(token)) throw new StubHostError(`the sampler chose ${token}, which ${tokens} does not allow`);
    return token;
  }

  _segment(segment) {
    const answer = this._respond(segment);
    checkAnswer(segment, answer);
    let cut = answer.length;
    for (const s of segment.stop) {
      const at = answer.indexOf(s);
      if (at >= 0) cut = Math.min(cut, at + s.length);
    }
    const tokens = this.tokenize(answer.slice(0, cut)).slice(0, segment.maxTokens);
    return [this.decode(tokens), tokens];
  }
}

function toSpec(controller) {
  if (typeof controller === "function") return checkController(controller);
  if (controller !== null && typeof controller === "object") return findController(controller);
  throw new TypeError("expected a controller (function* or TokenController class) or a module namespace");
}

/** A RegExp that fully matches `pattern`; leading Python inline flags become RegExp flags. */
function fullMatch(pattern) {
  let flags = "u";
  let body = pattern;
  const inline = /^\(\?([aiLmsux]+)\)/.exec(pattern);
  if (inline) {
    body = pattern.slice(inline[0].length);
    for (const f of inline[1]) if ("ims".includes(f)) flags += f;
  }
  try {
    return new RegExp(`^(?:${body})$`, flags);
  } catch (e) {
    throw new SyntaxError(`tokensMatching(${JSON.stringify(pattern)}): ${e.message}`);
  }
}

function parseOr(value) {
  try {
    return JSON.parse(value);
  } catch {
    return value; // the WIT contract: kept as a string
  }
}

function seededChoice(seed) {
  let state = seed >>> 0;
  return (allowed) => {
    // mulberry32
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    const r = ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    return allowed[Math.floor(r * allowed.length)];
  };
}

function defaultAnswer(segment) {
  if (segment.grammar !== null && segment.grammar.kind === "choice") return segment.grammar.value[0];
  throw new StubHostError(`no answer for ${segment}: pass new StubHost({ respond })`);
}

function answersInOrder(answers) {
  const pending = [...answers];
  return (segment) => {
    if (pending.length === 0) throw new StubHostError(`no answer left for ${segment} (${answers.length} given)`);
    return pending.shift();
  };
}

function checkAnswer(segment, answer) {
  const grammar = segment.grammar;
  if (typeof answer !== "string") throw new StubHostError(`respond() returned ${typeof answer}, not a string`);
  if (grammar === null) return;
  if (grammar.kind === "choice" && !grammar.value.includes(answer)) {
    throw new StubHostError(`${JSON.stringify(answer)} is not one of ${JSON.stringify(grammar.value)}`);
  }
  if (grammar.kind === "regex") {
    let regex;
    try {
      regex = new RegExp(`^(?:${grammar.value})$`, "u");
    } catch {
      return; // llguidance syntax that JS RegExp does not know: no check
    }
    if (!regex.test(answer)) {
      throw new StubHostError(`${JSON.stringify(answer)} does not match the segment's regex ${JSON.stringify(grammar.value)}`);
    }
  }
  if (grammar.kind === "json-schema") {
    try {
      JSON.parse(answer);
    } catch (e) {
      throw new StubHostError(`${JSON.stringify(answer)} is not JSON (${e.message})`);
    }
  }
}
