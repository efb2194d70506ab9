// The guest SDK for aici-batch controllers written in JavaScript (built into WebAssembly
// components with componentize-js). A controller module's default export is a generator
// function of segments:
//
//   import { fixed, gen, setOutput } from "aici-controller";
//
//   export default function* yesNo(ctx) {
//     yield fixed(" Answer: ");
//     const answer = yield gen({ choices: ["yes", "no"] }); // the host enforces the segment
//     setOutput("answer", answer);
//   }
//
// or a class that extends `TokenController` to decide every token. Build with
// `aici-batch build FILE.js`; test in plain node with `aici-controller/testing`'s StubHost.

export {
  ALL,
  AllTokens,
  Allow,
  Bitmask,
  Deny,
  Fork,
  Generate,
  Grammar,
  Matching,
  Sample,
  Splice,
  Stop,
  TokenSet,
  allow,
  backtrack,
  deny,
  fixed,
  fork,
  gen,
  genJson,
  notMatching,
  sample,
  spliceTokens,
  stop,
  tokensMatching,
} from "./actions.js";
export { Context, TokenController } from "./context.js";
export { ToolError, log, setLineOutput, setOutput, storage, tools } from "./host.js";
export { ControllerFailed, checkController, findController } from "./session.js";
