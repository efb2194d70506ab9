// A majority vote across branches: fork, let each branch answer, report the winner
// (vote.py in JavaScript).
//
// The sequence forks into `branches` branches that share the prompt's keys; each writes a
// short answer (a host-enforced regex segment), appends it to the line's storage, and the
// branch that finds every answer there sets the line's outputs. Sample with a temperature
// above 0 (`--temperature 0.8`): greedy branches would all write the same answer.
//
// Arg (JSON, optional): {"branches": 5, "pattern": "<regex of an answer>", "max_tokens": 16}.
// Outputs: each branch's "answer"; the line's "answer" (the most common one; a tie goes to
// the answer stored first) and "votes" ({answer: count}).

import { fork, gen, setLineOutput, setOutput, storage } from "aici-controller";

const PATTERN = String.raw`[A-Za-z0-9][A-Za-z0-9 .,'-]{0,39}`;

export default function* vote(ctx) {
  const args = ctx.argJson();
  const branches = Number(args.branches ?? 5);
  yield fork(branches); // resumes once in each branch, with its index
  let answer = yield gen({ regex: args.pattern ?? PATTERN, maxTokens: Number(args.max_tokens ?? 16) });
  answer = answer.split(/\s+/).filter(Boolean).join(" "); // one line: answers are newline-separated
  setOutput("answer", answer);
  storage.append("answers", answer + "\n");
  const answers = (storage.getText("answers") ?? "").split("\n").filter((a) => a !== "");
  if (answers.length === branches) { // the last branch to answer: count
    const votes = {};
    for (const a of answers) votes[a] = (votes[a] ?? 0) + 1;
    // The first of equals wins: the answer stored first (object keys keep insertion order).
    let best = answers[0];
    for (const a of Object.keys(votes)) if (votes[a] > votes[best]) best = a;
    setLineOutput("answer", best);
    setLineOutput("votes", votes);
  }
}
