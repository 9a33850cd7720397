"""The user's data: the validation split's clean images (held-out train images), as .npz.

calib.npz: the first 2500 (x only, for `calibrate`); labelled.npz: the other 2500 (x, y, for
`tune`). Never the test split."""
import sys
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.datasets import corrupted_fmnist

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
x, y = corrupted_fmnist("val", "clean", 5, 7)
print(x.shape, x.dtype, y.shape)
np.savez(out / "calib.npz", x=x[:2500])
np.savez(out / "labelled.npz", x=x[2500:], y=y[2500:])
