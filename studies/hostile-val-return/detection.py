"""How many clean images the input change detector needs to call the return from a sensor
fault, and how far the fault moves its descriptors (test images; a description of the
detector, not a tuning run). Run from the repository root:

    python studies/hostile-val-return/detection.py
"""

import numpy as np

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.runtime.inputwatch import InputChangeDetector, describe
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

FAULTS = ("gauss-0.1", "gauss-0.2", "gauss-0.3", "blur-1", "jpeg-5", "jpeg-20")


def main() -> None:
    pre = read_metadata("models/vit_fmnist.onnx").preprocessing
    images, labels = load_fashion_mnist("test")
    for fault in FAULTS:
        called = []
        for seed in range(10):
            order = np.random.default_rng(seed).permutation(len(images))[:1000]
            faulty, _ = hostile_images(fault, images[order[:500]], labels[order[:500]], seed)
            detector = InputChangeDetector()
            for x in preprocess_uint8(faulty, pre):
                detector.observe(x[None])
            clean = preprocess_uint8(images[order[500:600]], pre)
            called.append(next((i + 1 for i, x in enumerate(clean) if detector.observe(x[None])),
                               None))
        clean_d = describe(preprocess_uint8(images[order[500:]], pre))
        faulty_d = describe(preprocess_uint8(faulty, pre))
        gap = (clean_d.mean(0) - faulty_d.mean(0)) / faulty_d.std(0)
        print(f"{fault}: called at clean image {called} (None: not in 100); "
              f"descriptor gap / fault sd (mean, log variance, log roughness) {np.round(gap, 2)}")


if __name__ == "__main__":
    main()
