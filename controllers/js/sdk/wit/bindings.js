// Inside a built component: the WIT bindings on one side, the SDK on the other.
//
// Version-neutral: a contract file (`v0_1_0.js`, `v0_2_0.js`) imports the component's WIT
// functions and passes them here as `wit`:
//   { contract, canFork, tokenizer: { vocabSize, eosToken, tokenize, decode, tokenBytes,
//     tokensMatching }, host: { log, setOutput, setLineOutput? },
//     storage: { get, set, append } | null, tools: { listTools, callTool } | null }
// This module imports nothing from the WIT, so node can load it too. Values follow
// componentize-js's conventions: a variant is `{ tag, val }` with the WIT case name as the
// tag, an `option` is a value or undefined, a `list<u32>` arrives as a Uint32Array, an
// exported function returns `result`'s ok value and throws its err value, and an
// imported function that returns `err` throws.

import { AllTokens, Allow, Bitmask, Deny, Fork, Generate, Matching, Sample, Splice, Stop, listOf } from "../actions.js";
import { formatLog } from "../host.js";
import { ControllerFailed, Session, describeError, findController } from "../session.js";

/** The `runner` export for the controller `module` (its default export, checked now). */
export function controllerExport(module, filename, wit) {
  const spec = findController(module, filename);
  const host = new WitHost(wit);
  installConsole(wit.host.log);

  class Runner {
    constructor(arg, prompt) {
      this.session = new Session(spec, host, arg, prompt);
    }

    // Never throws anything but the err string: an uncaught exception would trap (a
    // component built without WASI cannot report it), which the host reports less exactly.
    midProcess(input) {
      try {
        const action = this.session.step(
          input.backtrack,
          input.tokens, // a Uint32Array: the session copies it
          input.segmentText ?? null,
          input.branch ?? null,
        );
        return toWit(action);
      } catch (e) {
        throw e instanceof ControllerFailed ? e.message : describeError(e);
      }
    }
  }
  return { Runner };
}

/** The host (see `host.js`) over the component's imports; each call crosses the boundary. */
export class WitHost {
  constructor(wit) {
    this.wit = wit;
    this.contract = wit.contract;
    this.canFork = wit.canFork;
  }

  vocabSize() {
    return this.wit.tokenizer.vocabSize();
  }

  eosToken() {
    return this.wit.tokenizer.eosToken();
  }

  tokenize(text) {
    return listOf(this.wit.tokenizer.tokenize(text));
  }

  decode(tokens) {
    return this.wit.tokenizer.decode(tokens);
  }

  tokenBytes(token) {
    return this.wit.tokenizer.tokenBytes(token);
  }

  tokensMatching(pattern) {
    try {
      return this.wit.tokenizer.tokensMatching(pattern);
    } catch (e) {
      const reason = e?.payload ?? e?.message ?? String(e);
      throw new SyntaxError(`tokensMatching(${JSON.stringify(pattern)}): ${reason}`);
    }
  }

  log(message) {
    this.wit.host.log(message);
  }

  setOutput(key, value) {
    this.wit.host.setOutput(key, value);
  }

  setLineOutput(key, value) {
    this._needs("setLineOutput()", this.wit.host.setLineOutput)(key, value);
  }

  storageGet(key) {
    return this._needs("storage.get()", this.wit.storage?.get)(key) ?? null;
  }

  storageSet(key, value) {
    this._needs("storage.set()", this.wit.storage?.set)(key, value);
  }

  storageAppend(key, value) {
    return this._needs("storage.append()", this.wit.storage?.append)(key, value);
  }

  listTools() {
    const tools = this._needsTools("tools.listTools()");
    return Array.from(tools.listTools(), (t) => ({
      name: t.name,
      description: t.description,
      inputSchema: t.inputSchema,
    }));
  }

  callTool(name, args) {
    const tools = this._needsTools("tools.callTool()");
    try {
      return [true, tools.callTool(name, args)];
    } catch (e) {
      return [false, String(e?.payload ?? e?.message ?? e)];
    }
  }

  _needsTools(what) {
    if (!this.wit.tools) {
      throw new Error(`${what} needs the aici:tools@0.1.0 import; this controller was built against ` + this.contract);
    }
    return this.wit.tools;
  }

  _needs(what, fn) {
    if (typeof fn !== "function") {
      throw new Error(
        `${what} needs the aici:controller@0.2.0 contract; this controller was built against ` +
          this.contract,
      );
    }
    return fn;
  }
}

/** console.* goes to the sequence's logs, one entry per line (warn and error marked). */
function installConsole(log) {
  const to = (prefix) => (...args) => {
    for (const line of formatLog(args).split("\n")) log(prefix + line);
  };
  const methods = { log: to(""), info: to(""), debug: to(""), warn: to("stderr: "), error: to("stderr: ") };
  try {
    Object.assign(globalThis.console, methods);
  } catch {
    globalThis.console = methods;
  }
}

// Frozen arrays pass as they are: componentize-js only reads a list it lowers.
const SAMPLE_ALL = Object.freeze({ tag: "sample", val: Object.freeze({ tag: "all" }) });

export function toWit(action) {
  if (action instanceof Sample) {
    return action.tokens instanceof AllTokens ? SAMPLE_ALL : { tag: "sample", val: tokenSetToWit(action.tokens) };
  }
  if (action instanceof Generate) {
    const grammar = action.grammar === null ? undefined : grammarToWit(action.grammar);
    return {
      tag: "generate",
      val: { grammar, maxTokens: action.maxTokens, stop: action.stop },
    };
  }
  if (action instanceof Splice) {
    return { tag: "splice", val: { backtrack: action.backtrack, ffTokens: action.tokens } };
  }
  if (action instanceof Stop) return { tag: "stop" };
  if (action instanceof Fork) return { tag: "fork", val: action.n };
  throw new TypeError(`not an action: ${action}`);
}

export function tokenSetToWit(tokens) {
  if (tokens instanceof AllTokens) return { tag: "all" };
  if (tokens instanceof Allow) return { tag: "allow", val: tokens.tokens };
  if (tokens instanceof Deny) return { tag: "deny", val: tokens.tokens };
  if (tokens instanceof Bitmask) return { tag: "bitmask", val: tokens.words };
  if (tokens instanceof Matching) {
    return { tag: tokens.negated ? "not-host-set" : "host-set", val: tokens.handle };
  }
  throw new TypeError(`not a token set: ${tokens}`);
}

export function grammarToWit(grammar) {
  if (grammar.kind === "choice") return { tag: "choice", val: grammar.value };
  return { tag: grammar.kind, val: grammar.value };
}
