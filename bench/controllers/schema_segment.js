// The built-in JSON-schema controller's job as a wasm controller: one host segment.
//
// Arg: the JSON schema (the line's `controller_arg`). Used by bench/controller_costs.py
// beside schema_segment.py.

import { gen } from "aici-controller";

export default function* schemaSegment(ctx) {
  yield gen({ jsonSchema: ctx.arg, maxTokens: 100000 });
}
