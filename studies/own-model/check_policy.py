"""Does the file serve with the guard and the activation shift on? Loads it as a Policy (eva0,
the file's own settings), steps it over 64 clean validation images at B=16 and prints
stats()["guard"] and stats()["activation_shift"] (both must not be None). Writes JSON to argv[2]."""
import json
import sys

import numpy as np

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy

path, out = sys.argv[1], sys.argv[2]
pre = read_metadata(path).preprocessing
x, _ = corrupted_fmnist("val", "clean", 5, 7)
x = x[:64].astype(np.float32) / 255.0
x = ((x - np.array(pre.mean, np.float32)) / np.array(pre.std, np.float32)).transpose(0, 3, 1, 2)
policy = Policy.load(path, "eva0", provider="cpu", threads=1)
for i in range(0, 64, 16):
    policy.step(np.ascontiguousarray(x[i:i + 16]))
s = policy.stats()
res = {"model": path, "guard_on": s.get("guard") is not None,
       "activation_shift_on": s.get("activation_shift") is not None,
       "guard": s.get("guard"), "activation_shift": s.get("activation_shift")}
print(f"{path}: guard {'on' if res['guard_on'] else 'OFF'}, activation shift "
      f"{'on' if res['activation_shift_on'] else 'OFF'}")
json.dump(res, open(out, "w"), indent=2, default=str)
