"""The pieces the fitting reads images through: the testbed's corruptions at any size and the
inverse of the normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_any, corrupt_images
from eva0_edge.bench.testbed.userdata import class_index
from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.preprocess import pixels_uint8, preprocess_uint8

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("shape", [(2, 48, 40, 3), (2, 36, 36, 1)])
def test_every_corruption_works_at_other_sizes_and_is_seeded(shape):
    images = RNG.integers(0, 256, shape, dtype=np.uint8)
    for name in CORRUPTIONS:
        out = corrupt_any(images, name, 5, 3)
        assert out.shape == images.shape and out.dtype == np.uint8
        assert not np.array_equal(out, images) or name == "jpeg_compression"
    again = corrupt_any(images, "gaussian_noise", 5, 3)
    np.testing.assert_array_equal(again, corrupt_any(images, "gaussian_noise", 5, 3))
    assert not np.array_equal(again, corrupt_any(images, "gaussian_noise", 5, 4))


def test_32_pixel_images_use_the_testbeds_table():
    images = RNG.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(corrupt_any(images, "fog", 3, 9),
                                  corrupt_images(images, "fog", 3, 9))


def test_the_normalisation_inverts_exactly():
    pre = Preprocessing((3, 32, 32), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    images = RNG.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(pixels_uint8(preprocess_uint8(images, pre), pre), images)


def test_a_class_is_named_by_label_folded_label_or_index():
    labels = ["t-shirt/top", "trouser", "ankle boot"]
    assert class_index("trouser", labels) == 1
    assert class_index("Ankle_Boot", labels) == 2
    assert class_index("t-shirt-top", labels) == 0
    assert class_index("2", labels) == 2
    with pytest.raises(ValueError, match="not one of the model's 3 classes"):
        class_index("jumper", labels)
