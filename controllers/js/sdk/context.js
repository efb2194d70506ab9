// The `Context` a controller sees, and the per-token `TokenController` base class.

import { listOf } from "./actions.js";
import { toJson } from "./host.js";

/**
 * What one sequence's controller knows, plus the host's tokenizer.
 *
 * Invariant: `tokens` mirrors the host's output tokens (after the prompt) as reported in
 * each step; the session applies every step's backtrack and tokens before the controller
 * runs. Tokenizer methods are host calls (cheap, but not free: tens of microseconds).
 */
export class Context {
  constructor(host, arg, prompt) {
    this._host = host;
    /** The controller argument (the line's `controller_arg` or the CLI's), as text. */
    this.arg = arg;
    this.prompt = Object.freeze(listOf(prompt));
    this._tokens = [];
    /** Appended by the latest step. */
    this.lastTokens = Object.freeze([]);
    /** Removed by the latest step. */
    this.lastBacktrack = 0;
    /** The text of the segment the latest step ended, else null. */
    this.segmentText = null;
    /** This branch's index (0 until a `fork`; aici:controller@0.2.0). */
    this.branch = 0;
    this._argJson = undefined;
    this._argParsed = false;
    this._eos = null;
    this._vocabSize = null;
  }

  /** The output tokens so far (the SDK's own array: read it, do not modify it). */
  get tokens() {
    return this._tokens;
  }

  /** `arg` parsed as JSON (parsed once); an empty arg is `{}`. */
  argJson() {
    if (!this._argParsed) {
      const text = this.arg.trim();
      try {
        this._argJson = text ? JSON.parse(text) : {};
      } catch (e) {
        throw new SyntaxError(
          `the controller arg is not JSON (${e.message}): ${JSON.stringify(this.arg.slice(0, 80))}`,
        );
      }
      this._argParsed = true;
    }
    return this._argJson;
  }

  get eosToken() {
    if (this._eos === null) this._eos = this._host.eosToken();
    return this._eos;
  }

  get vocabSize() {
    if (this._vocabSize === null) this._vocabSize = this._host.vocabSize();
    return this._vocabSize;
  }

  /** The last output token is end-of-sequence (e.g. a segment ended early). */
  get atEos() {
    return this._tokens.length > 0 && this._tokens[this._tokens.length - 1] === this.eosToken;
  }

  tokenize(text) {
    return this._host.tokenize(text);
  }

  decode(tokens) {
    return this._host.decode(listOf(tokens));
  }

  tokenBytes(token) {
    return this._host.tokenBytes(token);
  }

  /** The output so far, decoded (one host call over all output tokens). */
  text() {
    return this._host.decode(this._tokens);
  }

  log(message) {
    this._host.log(String(message));
  }

  setOutput(key, value) {
    this._host.setOutput(key, toJson(value, key));
  }

  /** `tokens`: a fresh array, kept (frozen) as `lastTokens`. */
  _apply(backtrack, tokens, segmentText, branch) {
    if (backtrack > this._tokens.length) {
      throw new RangeError(
        `the host removed ${backtrack} tokens but only ${this._tokens.length} were generated`,
      );
    }
    if (backtrack) this._tokens.length -= backtrack;
    for (let i = 0; i < tokens.length; i++) this._tokens.push(tokens[i]);
    this.lastBacktrack = backtrack;
    this.lastTokens = Object.freeze(tokens);
    this.segmentText = segmentText;
    if (branch !== null) this.branch = branch;
  }
}

/**
 * Base class for controllers that decide after every host step.
 *
 * One instance per sequence, made with no arguments. `start` runs once, before the first
 * `step`; `step` runs on every host call (the first with no tokens) and returns an action.
 * Prefer segments (`gen`) where they fit: each `step` is a wasm round trip.
 */
export class TokenController {
  /** Set up per-sequence state (read `ctx.argJson()` here). */
  start(ctx) {} // eslint-disable-line no-unused-vars

  /**
   * `newTokens` were appended since the previous step (after `ctx.lastBacktrack` were
   * removed). Return `sample(...)`, `gen(...)`, `fixed(...)`, ... or `stop()`.
   */
  step(ctx, newTokens) { // eslint-disable-line no-unused-vars
    throw new Error(`${this.constructor.name} does not define step(ctx, newTokens)`);
  }
}
