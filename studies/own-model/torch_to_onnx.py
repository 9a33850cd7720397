"""The BN model as a user's plain ONNX file: torch.onnx.export of the torch model built from its
checkpoint (batch 1, opset 17, no eva0-edge involved), plus the sidecar JSON the rewriter reads
(labels, mean, std)."""
import json
import sys

import torch

from eva0_edge.bench.testbed.fashion_mnist import CLASS_NAMES
from eva0_edge.bench.testbed.testbed_archs import ARCHS

MEAN, STD = 0.21910754282252673, 0.3318746582784273
arch, ckpt, out = sys.argv[1:4]
model = ARCHS[arch]()
model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
model.eval()
torch.onnx.export(model, (torch.randn(1, 3, 32, 32),), out, input_names=["input"],
                  output_names=["output"], opset_version=17, dynamo=False)
json.dump({"labels": CLASS_NAMES, "mean": [MEAN] * 3, "std": [STD] * 3},
          open(out + ".json", "w"))
print("wrote", out)
