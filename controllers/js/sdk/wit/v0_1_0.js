// The component's imports for aici:controller@0.1.0. `aici-batch build` picks this file
// by the version of the contract in the WIT directory it builds against.

import { log, setOutput } from "aici:controller/host@0.1.0";
import {
  decode,
  eosToken,
  tokenBytes,
  tokenize,
  tokensMatching,
  vocabSize,
} from "aici:controller/tokenizer@0.1.0";

import { controllerExport } from "./bindings.js";

export function exportController(module, filename) {
  return controllerExport(module, filename, {
    contract: "aici:controller@0.1.0",
    canFork: false,
    tokenizer: { vocabSize, eosToken, tokenize, decode, tokenBytes, tokensMatching },
    host: { log, setOutput },
    storage: null,
    tools: null,
  });
}
