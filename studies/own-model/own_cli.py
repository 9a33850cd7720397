"""`eva0-edge` with the user's own architectures registered in timm's model registry.

This is what a user with a model of their own does so that `eva0-edge export --arch NAME
--checkpoint FILE` can build it: register the constructor with timm (`register_model`) and set
the normalisation the model was trained with as its pretrained_cfg (timm's data config is
where the exporter reads mean/std). The constructors are the testbed's definitions
(bench/testbed/testbed_archs.py); the mean/std are the training run's
(models/<arch>.train.json: Fashion-MNIST's pixel mean 0.2191 / std 0.3319 on all channels).
Nothing of the recipes' export (models/recipes/train.py) is used.

    python studies/own-model/own_cli.py export --arch own_resnet_gn_fmnist --checkpoint ... -o ...
"""
import sys

from timm.models import register_model

from eva0_edge.bench.testbed import testbed_archs
from eva0_edge.cli import main

MEAN, STD = 0.21910754282252673, 0.3318746582784273
CFG = {"input_size": (3, 32, 32), "mean": (MEAN,) * 3, "std": (STD,) * 3,
       "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center",
       "num_classes": 10}


def _own(build):
    def fn(pretrained=False, **kwargs):
        model = build()
        model.pretrained_cfg = dict(CFG)
        model.default_cfg = model.pretrained_cfg
        return model
    return fn


for _name, _build in testbed_archs.ARCHS.items():
    _fn = _own(_build)
    _fn.__name__ = f"own_{_name}"
    _fn.__module__ = __name__
    globals()[_fn.__name__] = register_model(_fn)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
