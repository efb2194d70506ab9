// A multi-step program: fixed text, a JSON object by schema, then a free-text field.
//
// Arg (JSON, optional): {"max_bio_tokens": 40}.
// Outputs: "profile" (the object), "name" (from it), "bio" (one line of free text).

import { fixed, gen, genJson, setOutput } from "aici-controller";

const PROFILE_SCHEMA = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 40 },
    age: { type: "integer", minimum: 0, maximum: 150 },
    languages: { type: "array", items: { type: "string" }, maxItems: 5 },
  },
  required: ["name", "age", "languages"],
  additionalProperties: false,
};

export default function* profile(ctx) {
  const maxBio = Math.trunc(Number(ctx.argJson().max_bio_tokens ?? 40));
  yield fixed("\nProfile (JSON): ");
  const person = yield* genJson(PROFILE_SCHEMA, { maxTokens: 120 });
  setOutput("profile", person);
  setOutput("name", person.name);
  yield fixed("\nBio: ");
  const bio = yield gen({ stop: "\n", maxTokens: maxBio });
  setOutput("bio", bio.trim());
}
