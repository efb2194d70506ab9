// The component's imports for aici:controller@0.2.0: `fork`, line outputs,
// aici:storage@0.1.0 and aici:tools@0.1.0 besides 0.1.0's. `aici-batch build` picks this
// file by the version of the contract in the WIT directory it builds against.

import { log, setLineOutput, setOutput } from "aici:controller/host@0.2.0";
import {
  decode,
  eosToken,
  tokenBytes,
  tokenize,
  tokensMatching,
  vocabSize,
} from "aici:controller/tokenizer@0.2.0";
import { append, get, set } from "aici:storage/storage@0.1.0";
import { callTool, listTools } from "aici:tools/tools@0.1.0";

import { controllerExport } from "./bindings.js";

export function exportController(module, filename) {
  return controllerExport(module, filename, {
    contract: "aici:controller@0.2.0",
    canFork: true,
    tokenizer: { vocabSize, eosToken, tokenize, decode, tokenBytes, tokensMatching },
    host: { log, setOutput, setLineOutput },
    storage: { get, set, append },
    tools: { listTools, callTool },
  });
}
