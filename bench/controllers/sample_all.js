// The most trivial per-token controller: every step samples from all tokens.
//
// Used by bench/controller_costs.py to time one guest call (beside sample_all.py).

import { ALL, TokenController, sample } from "aici-controller";

export default class SampleAll extends TokenController {
  step() {
    return sample(ALL);
  }
}
