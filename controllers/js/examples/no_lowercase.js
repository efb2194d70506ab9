// A per-token controller: every sampled token is free of lowercase letters.
//
// The token set is computed once on the host (a regex over the vocabulary; the guest holds
// only a handle), so each step costs one small wasm call. Stops after `max_tokens` output
// tokens (arg JSON, default 16) or when EOS is sampled. Whether EOS itself is allowed
// depends on its text on the host (a special token that decodes to "" has no lowercase).

import { TokenController, notMatching, sample, setOutput, stop } from "aici-controller";

// (?s): a token's text may contain a newline, which `.` would not match. The pattern is
// Python `re` syntax: the host compiles it.
const NO_LOWERCASE = notMatching(String.raw`(?s).*[a-z].*`);

export default class NoLowercase extends TokenController {
  start(ctx) {
    this.limit = Math.trunc(Number(ctx.argJson().max_tokens ?? 16));
    if (!(this.limit >= 1)) {
      throw new Error(`max_tokens must be at least 1, got ${ctx.argJson().max_tokens}`);
    }
  }

  step(ctx) {
    if (ctx.atEos || ctx.tokens.length >= this.limit) {
      setOutput("tokens", ctx.tokens.length);
      return stop();
    }
    return sample(NO_LOWERCASE);
  }
}
