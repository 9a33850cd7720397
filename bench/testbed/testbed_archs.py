"""The small source architectures of the Fashion-MNIST testbed (timm models, 32x32 RGB).

* ``vit_fmnist``: timm VisionTransformer, effective patch 4 (64 tokens + CLS), width 96, depth 8,
  3 heads, MLP ratio 2. Its patch embedding is a small convolutional stem (3x3/1 -> 3x3/2 ->
  3x3/2, GELU) in place of the single 4x4/4 projection: "early convolutions help transformers
  see better" (Xiao et al. 2021). Recipe trials (12 epochs, GPU, seed 0): plain projection 88.7%
  (even at 20 epochs); stem 3x3/2 -> 3x3/2 -> 1x1 at depth 6, MLP 4: 89.4% (88.55% on the CPU at
  10 epochs); this stem 89.7%; this stem at depth 8 / MLP 2 without flips 90.5%.
* ``resnet_gn_fmnist``: timm ResNet with BasicBlocks [1, 1, 1, 1], channels 32-64-128-256,
  GroupNorm (8 groups) everywhere, a 3x3 stride-1 stem conv (64 channels) before the max-pool,
  so layer1 sees 16x16 maps instead of the 8x8 a 7x7/2 stem would leave.
* ``mobilenet_bn_fmnist``: a BatchNorm edge model, timm ``MobileNetV3`` (``isinstance`` holds)
  built from mobilenetv3_small_100's block definition: depthwise-separable inverted-residual
  blocks, squeeze-excite (hard-sigmoid gate) and hard-swish (ReLU in the first three blocks),
  BatchNorm everywhere. For 32 px the 3x3/2 stem (16x16) is followed by the first block at
  stride 1 and by the last stage (96 channels) at stride 1, so the blocks end at 4x4 (576 channels)
  instead of 1x1; conv head 512 (not 1024). 1.23 M parameters, 8.95 M MACs at 32 px. Recipe
  trials (train.py --channels-last --no-export, CPU, one core, ``taskset -c 1 --threads 1``, a
  second job on the other core, seed 0): 2 epochs at the default lr 2e-3: 84.67% (5.5 min);
  1-epoch probes: lr 2e-3 80.3%, 5e-3 83.7%, 1e-2 84.9%; 3x3 depthwise everywhere (lr 5e-3)
  82.5%; a stride-1 stem with the first block at stride 2 (lr 5e-3) 83.9%, 8% slower; 2 epochs
  at lr 1e-2: 88.22% (4.2 min); the shipped run, 6 epochs at lr 1e-2: 91.16% (12.6 min).
  Channels-last training is ~2x faster than contiguous here; torch.compile did not help.
"""

from __future__ import annotations

from functools import partial

import timm
from timm.layers import GroupNorm, PatchEmbed, get_act_layer
from timm.models._efficientnet_blocks import SqueezeExcite
from timm.models._efficientnet_builder import decode_arch_def, round_channels
from timm.models.mobilenetv3 import MobileNetV3
from torch import nn

NUM_CLASSES = 10


class ConvStemPatchEmbed(PatchEmbed):
    """timm's PatchEmbed (patch 4) whose projection is a stride-4 convolutional stem."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        in_chans, dim = self.proj.in_channels, self.proj.out_channels
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, 32, 3, stride=1, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(64, dim, 3, stride=2, padding=1),
        )


def vit_fmnist() -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32, patch_size=4, embed_dim=96, depth=8, num_heads=3, mlp_ratio=2.0,
        num_classes=NUM_CLASSES, embed_layer=ConvStemPatchEmbed,
    )


def resnet_gn_fmnist() -> nn.Module:
    model = timm.create_model(
        "resnet18",
        layers=[1, 1, 1, 1],
        channels=(32, 64, 128, 256),
        norm_layer=partial(GroupNorm, 8),
        num_classes=NUM_CLASSES,
    )
    model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, stride=1, padding=1, bias=False)
    return model


# mobilenetv3_small_100's blocks (timm's _gen_mobilenet_v3), first block and last stage at stride 1
MOBILENET_BN_ARCH_DEF = [
    ["ds_r1_k3_s1_e1_c16_se0.25_nre"],  # 16x16, ReLU
    ["ir_r1_k3_s2_e4.5_c24_nre", "ir_r1_k3_s1_e3.67_c24_nre"],  # 8x8, ReLU
    ["ir_r1_k5_s2_e4_c40_se0.25", "ir_r2_k5_s1_e6_c40_se0.25"],  # 4x4, hard-swish from here
    ["ir_r2_k5_s1_e3_c48_se0.25"],  # 4x4
    ["ir_r3_k5_s1_e6_c96_se0.25"],  # 4x4 (stride 2 in mobilenetv3_small_100)
    ["cn_r1_k1_s1_c576"],  # 4x4
]


def mobilenet_bn_fmnist() -> MobileNetV3:
    return MobileNetV3(
        decode_arch_def(MOBILENET_BN_ARCH_DEF),
        num_classes=NUM_CLASSES,
        stem_size=16,
        num_features=512,
        round_chs_fn=round_channels,
        norm_layer=nn.BatchNorm2d,
        act_layer=get_act_layer("hard_swish"),
        se_layer=partial(
            SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU,
            rd_round_fn=round_channels,
        ),
    )


ARCHS = {
    "vit_fmnist": vit_fmnist,
    "resnet_gn_fmnist": resnet_gn_fmnist,
    "mobilenet_bn_fmnist": mobilenet_bn_fmnist,
}
