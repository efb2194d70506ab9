// Splicing: generate a word, and if it is not capitalized take it back and rewrite it.
//
// `backtrack(n, text)` removes the segment's n tokens and forces the corrected text in one
// host step, so the rest of the sequence continues from the rewritten word.
// Outputs: "word" (as generated), "final" (as kept), "rewrote" (boolean).

import { backtrack, fixed, gen, setOutput } from "aici-controller";

export default function* rewrite(ctx) {
  yield fixed("Name: ");
  const word = yield gen({ regex: "[A-Za-z]{1,12}", maxTokens: 8 });
  setOutput("word", word);
  const final = word.slice(0, 1).toUpperCase() + word.slice(1);
  const rewrote = final !== word;
  if (rewrote) {
    // ctx.lastTokens: the tokens the segment appended (all of the word).
    yield backtrack(ctx.lastTokens.length, final);
  }
  setOutput("final", final);
  setOutput("rewrote", rewrote);
  yield fixed(".\n");
}
