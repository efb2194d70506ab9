// A yes/no answer with a one-line reason, as two host-enforced segments.
//
// Arg (JSON, optional): {"question": "..."}; the question is logged, the prompt carries it.
// Outputs: "answer" ("yes" or "no") and "reason" (one line, at most 120 characters).

import { fixed, gen, log, setOutput } from "aici-controller";

export default function* yesNo(ctx) {
  const question = ctx.argJson().question ?? "";
  if (question) log(`question: ${question}`);
  yield fixed(" Answer: ");
  const answer = yield gen({ choices: ["yes", "no"] });
  setOutput("answer", answer);
  yield fixed("\nReason: ");
  const reason = yield gen({ regex: String.raw`[^\n]{1,120}\n`, maxTokens: 60 });
  setOutput("reason", reason.trim());
  // Returning ends the sequence (the host gets `stop`).
}
