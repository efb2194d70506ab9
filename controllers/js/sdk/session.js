// The guest half of the step protocol, shared by the component and the stub host.
//
// One `Session` per sequence (per WIT `runner`). The host calls `step` once at the start
// with no tokens, then after each action it applied:
// - after `sample`: the sampled token (the generator receives its id);
// - after `generate`: the segment's tokens and `segmentText` (the generator receives the
//   text; without `segmentText` it decodes the tokens);
// - after `splice`: `backtrack` = the splice's count, `tokens` = its tokens (the generator
//   receives undefined);
// - after `fork` (aici:controller@0.2.0): `branch` = this branch's index (the generator
//   receives it).
// `step` resolves symbolic actions with host calls (`fixed` text -> token ids, a
// `tokensMatching` pattern -> a host handle, cached per pattern), so what it returns maps
// one-to-one onto the WIT `action`. Any exception from controller code becomes
// `ControllerFailed` (the component turns it into `err`), after which the session only
// reports that failure again: one failing controller ends only its own sequence.

import { Fork, Generate, Matching, Sample, Splice, Stop, describeValue, isAction, listOf } from "./actions.js";
import { Context, TokenController } from "./context.js";
import { activate } from "./host.js";

const MAX_FRAMES = 6;

/** Controller code threw; `message` ("TypeError: ...") is the sequence's error. */
export class ControllerFailed extends Error {
  constructor(message) {
    super(message);
    this.name = "ControllerFailed";
  }
}

const GeneratorFunction = Object.getPrototypeOf(function* () {}).constructor;
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
const AsyncGeneratorFunction = Object.getPrototypeOf(async function* () {}).constructor;

const USAGE =
  "write `export default function* (ctx) { ... yield gen(...) ... }` " +
  "or `export default class extends TokenController { step(ctx, newTokens) { ... } }`";

/**
 * The controller a module defines: its default export, checked. Throws TypeError naming
 * the problem (in a build, at build time: the module is evaluated while it is snapshotted).
 * Returns `{ kind: "generator" | "token", target, name }`.
 */
export function findController(module, where = "the controller module") {
  if (!("default" in module) || module.default === undefined) {
    throw new TypeError(`${where} has no default export: ${USAGE}`);
  }
  return checkController(module.default, where);
}

export function checkController(target, where = "the controller") {
  if (typeof target !== "function") {
    throw new TypeError(`${where}: the default export is ${describeValue(target)}: ${USAGE}`);
  }
  const name = target.name || "(anonymous)";
  if (target instanceof AsyncFunction || target instanceof AsyncGeneratorFunction) {
    throw new TypeError(
      `${where}: controller ${name} is async: controllers are plain generator functions (function*)`,
    );
  }
  if (target instanceof GeneratorFunction) return { kind: "generator", target, name };
  if (isClass(target)) {
    if (!(target.prototype instanceof TokenController)) {
      throw new TypeError(
        `${where}: controller class ${name} must extend TokenController and define step(ctx, newTokens)`,
      );
    }
    if (target.prototype.step === TokenController.prototype.step) {
      throw new TypeError(`${where}: controller class ${name} does not define step(ctx, newTokens)`);
    }
    if (target.length > 0) {
      throw new TypeError(
        `${where}: controller class ${name} must be constructible without arguments: ` +
          "read the controller arg in start(ctx)",
      );
    }
    return { kind: "token", target, name };
  }
  throw new TypeError(
    `${where}: controller ${name} is not a generator function: declare it \`function*\` and ` +
      "`yield` actions (fixed(...), gen(...), sample(...)); for a controller that decides " +
      "every token, extend TokenController",
  );
}

function isClass(fn) {
  return /^class[\s{]/.test(Function.prototype.toString.call(fn));
}

/** Drives one controller for one sequence. */
export class Session {
  constructor(spec, host, arg, prompt) {
    // Nothing here runs controller code: a constructor cannot return an error over the
    // WIT, so `start` and the generator's first lines run in the first step.
    this.spec = spec;
    this.host = host;
    this.ctx = new Context(host, arg, prompt);
    this._started = false;
    this._finished = false;
    this._failure = null;
    this._last = null;
    this._gen = null;
    this._instance = null;
    this._handles = new Map();
  }

  get finished() {
    return this._finished;
  }

  /**
   * Apply what the host reports, run the controller, return its resolved action.
   * Throws `ControllerFailed`; after `stop` it keeps answering `stop`.
   */
  step(backtrack = 0, tokens = [], segmentText = null, branch = null) {
    if (this._failure !== null) {
      throw new ControllerFailed(`the controller already failed: ${this._failure}`);
    }
    if (this._finished) return new Stop();
    let action;
    const previous = activate(this.host);
    try {
      action = this._resolve(this._advance(backtrack, listOf(tokens), segmentText ?? null, branch ?? null));
    } catch (e) {
      this._fail(e);
      throw new ControllerFailed(this._failure);
    } finally {
      activate(previous);
    }
    this._last = action;
    if (action instanceof Stop) this._finish();
    return action;
  }

  _advance(backtrack, tokens, segmentText, branch) {
    const first = !this._started;
    this._started = true;
    this.ctx._apply(backtrack, tokens, segmentText, branch);
    const { kind, target, name } = this.spec;
    if (kind === "token") {
      if (first) {
        this._instance = new target();
        this._instance.start(this.ctx);
      }
      const action = this._instance.step(this.ctx, this.ctx.lastTokens);
      return checkAction(action, `${name}.step() returned`);
    }
    let value;
    if (first) {
      const gen = target(this.ctx);
      if (!isGenerator(gen)) throw new TypeError(`controller ${name} did not return a generator`);
      this._gen = gen;
      value = undefined;
    } else {
      value = this._resumeValue();
    }
    const next = this._gen.next(value);
    if (next.done) return new Stop();
    return checkAction(next.value, `controller ${name} yielded`);
  }

  /** What the generator's pending `yield` evaluates to, given the last action. */
  _resumeValue() {
    const last = this._last;
    const ctx = this.ctx;
    if (last instanceof Sample) {
      if (ctx.lastTokens.length === 0) throw new Error("the host answered sample(...) without a token");
      return ctx.lastTokens[ctx.lastTokens.length - 1];
    }
    if (last instanceof Generate) {
      return ctx.segmentText !== null ? ctx.segmentText : this.host.decode(ctx.lastTokens);
    }
    if (last instanceof Fork) return ctx.branch;
    return undefined;
  }

  _resolve(action) {
    if (action instanceof Splice) {
      if (action.backtrack > this.ctx.tokens.length) {
        throw new RangeError(
          `backtrack(${action.backtrack}) removes more than the ` +
            `${this.ctx.tokens.length} tokens generated so far`,
        );
      }
      if (action.tokens === null) {
        return action.withTokens(action.text ? this.host.tokenize(action.text) : []);
      }
    } else if (action instanceof Sample && action.tokens instanceof Matching) {
      const { pattern, negated } = action.tokens;
      let handle = this._handles.get(pattern);
      if (handle === undefined) {
        handle = this.host.tokensMatching(pattern);
        this._handles.set(pattern, handle);
      }
      return new Sample(new Matching(pattern, negated, handle));
    } else if (action instanceof Fork && !this.host.canFork) {
      throw new Error(
        `fork(${action.n}) needs the aici:controller@0.2.0 contract; this controller was built ` +
          `against ${this.host.contract ?? "an older one"}`,
      );
    }
    return action;
  }

  _fail(error) {
    this._failure = describeError(error);
    this._finish();
    const where = userFrames(error);
    const suffix = where ? ` (at ${where})` : "";
    try {
      this.host.log(`controller error: ${this._failure}${suffix}`);
    } catch {
      // the error matters more than its log line
    }
  }

  _finish() {
    this._finished = true;
    const gen = this._gen;
    this._gen = null;
    if (gen !== null) {
      try {
        gen.return(undefined); // runs the controller's `finally` blocks now
      } catch {
        // a `finally` that throws changes nothing: the sequence is over
      }
    }
  }
}

function isGenerator(value) {
  return (
    value !== null &&
    typeof value === "object" &&
    typeof value.next === "function" &&
    typeof value[Symbol.iterator] === "function"
  );
}

function checkAction(value, what) {
  if (isAction(value)) return value;
  if (isGenerator(value)) {
    throw new TypeError(`${what} a generator: use \`x = yield* genJson(...)\`, not \`yield genJson(...)\``);
  }
  throw new TypeError(
    `${what} ${describeValue(value)}: expected an action ` +
      "(fixed(...), gen(...), sample(...), backtrack(...) or stop())",
  );
}

/** "Name: message", the form a failed sequence reports ("Error: ...", "TypeError: ..."). */
export function describeError(error) {
  if (error !== null && typeof error === "object" && typeof error.message === "string") {
    const name = typeof error.name === "string" && error.name ? error.name : "Error";
    return error.message ? `${name}: ${error.message}` : name;
  }
  let shown;
  try {
    shown = typeof error === "string" ? JSON.stringify(error) : String(error);
  } catch {
    shown = typeof error;
  }
  return `Uncaught ${shown}`;
}

// A stack frame in SpiderMonkey's form ("fn@file:line:col") or V8's ("at fn (file:line:col)").
const SPIDERMONKEY_FRAME = /^(.*?)@(.+):(\d+):\d+$/;
const V8_FRAME = /^\s*at (?:(.+?) \()?(.+?):(\d+):\d+\)?$/;

function frameOf(line) {
  let m = SPIDERMONKEY_FRAME.exec(line);
  if (m) return { func: m[1], file: m[2], line: m[3] };
  m = V8_FRAME.exec(line);
  if (m) return { func: m[1] ?? "", file: m[2], line: m[3] };
  return null;
}

function dirOf(file) {
  const i = file.lastIndexOf("/");
  return i < 0 ? "" : file.slice(0, i);
}

function baseName(file) {
  return file.slice(file.lastIndexOf("/") + 1);
}

// This file's directory, as stack traces spell it (a file: URL in node, a path in a build).
const SDK_DIR = (() => {
  for (const line of String(new Error().stack).split("\n")) {
    const frame = frameOf(line);
    if (frame) return dirOf(frame.file);
  }
  return null;
})();

function isSdkFrame(file) {
  const dir = dirOf(file);
  return (
    (SDK_DIR !== null && (dir === SDK_DIR || dir.startsWith(SDK_DIR + "/"))) ||
    baseName(file).startsWith("__aici") ||
    file.startsWith("node:") ||
    file === "self-hosted" ||
    // componentize-js's generated bindings (an absolute path from the build machine)
    baseName(file) === "initializer.js"
  );
}

/**
 * The innermost controller-code frames, "file:line in func", innermost first; SDK and
 * engine frames left out. Reads no source: a component has no filesystem at run time.
 */
export function userFrames(error) {
  const stack = error !== null && typeof error === "object" ? error.stack : undefined;
  if (typeof stack !== "string") return "";
  const frames = [];
  for (const line of stack.split("\n")) {
    const frame = frameOf(line.trimEnd());
    if (frame === null || isSdkFrame(frame.file)) continue;
    const name = frame.func.replace(/^async\s+/, "").replace(/^new\s+/, "").replace(/\*$/, "");
    const where = `${baseName(frame.file)}:${frame.line}`;
    frames.push(name && !name.includes("<") ? `${where} in ${name}` : where);
    if (frames.length === MAX_FRAMES) break;
  }
  return frames.join(" <- ");
}
