"""Two optional imports of transformers that a `harness run` never uses, kept out of its process.

Where torchvision and scikit-learn are installed, transformers 5.17 imports both for text models too: torchvision
through its image and video utilities (processors' type checks), scikit-learn for assisted decoding's confidence
threshold. On the GPU machines that is 2.1 s of every run's start (`python -X importtime`, one H200, session 37:
torchvision 1.09 s with the torch._dynamo it pulls in, sklearn 1.04 s with scipy). transformers 5.24 imports
neither there. The harness loads tokenizers and causal LMs only and never decodes with an assistant model.

`hide_unused` tells transformers that both are absent. It runs in the `harness run` process only, before
transformers' first import of either; the pytest plugin runs inside a user's process and never calls it.
HARNESS_LEAN_IMPORTS=0 turns it off.
"""

from __future__ import annotations

import os
import sys

# transformers' availability checks for the two (`transformers.utils.import_utils`)
HIDDEN = ("is_torchvision_available", "is_torchvision_v2_available", "is_sklearn_available")
# the modules of transformers that read those checks when they are imported
READERS = ("transformers.image_utils", "transformers.video_utils", "transformers.generation.candidate_generator")


def _absent() -> bool:
    return False


def hide_unused() -> tuple[str, ...]:
    """Make transformers' checks for torchvision and scikit-learn answer False; the checks changed. Nothing is
    changed where it is turned off, where either library is imported already, or where transformers has already
    imported a module that reads the checks (too late to keep the import out)."""
    if os.environ.get("HARNESS_LEAN_IMPORTS") == "0" or any(name in sys.modules for name in ("torchvision", "sklearn")):
        return ()
    try:
        import transformers.utils as utils
        from transformers.utils import import_utils
    except ImportError:
        return ()
    if any(name in sys.modules for name in READERS):
        return ()
    hidden = []
    for name in HIDDEN:
        if hasattr(import_utils, name):
            setattr(import_utils, name, _absent)
            if hasattr(utils, name):
                setattr(utils, name, _absent)
            hidden.append(name)
    return tuple(hidden)
