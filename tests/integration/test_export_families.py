"""The timm families that export through the graph rewriter (issue 47 item 2): each one's
default set and ``--adapt`` in its own units; the file's logits at theta0 equal the torch
model's, and its theta names are the source model's state-dict keys."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from eva0_edge.exporter import export_model
from eva0_edge.exporter.graph_families import graph_family_for
from eva0_edge.runtime.metadata import Preprocessing
from tests.onnx_sources import ARCHS, timm_model

FAMILY_OF = {
    "resnet18": "resnet_bn", "mobilenetv3_small_100": "mobilenetv3",
    "efficientnet_lite0": "efficientnet", "regnetx_002": "regnet", "convnext_atto": "convnext",
    "swin_tiny_patch4_window7_224": "swin",
}


def _export(tmp_path, arch: str, adapt: str | None = None):
    model = timm_model(arch)
    size = ARCHS[arch][1]
    out = tmp_path / f"{arch}.onnx"
    pre = Preprocessing((3, size, size), (0.5,) * 3, (0.5,) * 3)
    metadata = export_model(arch, out, model=model, adapt=adapt, preprocessing=pre)
    return model, out, metadata, size


@pytest.mark.parametrize("arch", sorted(FAMILY_OF))
def test_family_exports_the_torch_logits_with_state_dict_names(tmp_path, arch):
    model, out, metadata, size = _export(tmp_path, arch)
    assert metadata.family == FAMILY_OF[arch]
    state = model.state_dict()
    theta0 = np.concatenate([state[s.name].numpy().reshape(-1) for s in metadata.theta_layout])
    np.testing.assert_array_equal(theta0, metadata.theta0)
    x = torch.randn(64, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x).numpy()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"pixel_values": x.numpy(),
                                   "theta": np.tile(metadata.theta0, (64, 1))})[0]
    assert np.abs(got - want).max() <= 1e-4


def test_adapt_names_the_family_units(tmp_path):
    _, _, metadata, _ = _export(tmp_path, "resnet18", adapt="4")
    assert {s.name.split(".")[0] for s in metadata.theta_layout} == {"layer4"}
    assert metadata.adapt == "layer4.*"
    _, _, metadata, _ = _export(tmp_path, "efficientnet_lite0", adapt="7")
    assert [s.name for s in metadata.theta_layout] == ["bn2.weight", "bn2.bias"]
    with pytest.raises(ValueError, match="outside the model's stages"):
        _export(tmp_path, "resnet18", adapt="5")


def test_the_paper_families_keep_their_own_exporter():
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2)
    resnet_gn = timm.create_model("resnet18", norm_layer="groupnorm", layers=[1, 1, 1, 1])
    assert graph_family_for(resnet_gn) is None
    assert graph_family_for(vit) is None
