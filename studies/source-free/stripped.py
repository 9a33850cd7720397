"""The never-calibrated copy of a shipped model the source-free mode is measured on: the file
without its source statistics (``source_mean``, ``source_std``, ``head_input_mean``), its fitted
guard bounds and eva0's fitted shift, then set up source-free as ``calibrate`` without
``--data`` does (``eva0_edge.runtime.sourcefree.setup_source_free``).

    python studies/source-free/stripped.py models/vit_fmnist.onnx OUT.onnx
"""

from __future__ import annotations

import sys

from eva0_edge.runtime.sourcefree import setup_source_free, strip_source_statistics

if __name__ == "__main__":
    strip_source_statistics(sys.argv[1], sys.argv[2])
    print(setup_source_free(sys.argv[2]))
