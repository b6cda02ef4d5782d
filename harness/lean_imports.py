"""Three optional imports of transformers that a `harness run` never uses, kept out of its process.

Where torchvision, scikit-learn and SciPy are installed, transformers imports them for text models too: torchvision
through its image and video utilities (processors' type checks), scikit-learn for assisted decoding's confidence
threshold, SciPy for the object-detection losses' matching (`transformers.loss`, imported with every model class).
On the GPU machines (transformers 5.17) that was 2.1 s of every run's start for the first two (`python -X
importtime`, one H200, session 37: torchvision 1.09 s with the torch._dynamo it pulls in, sklearn 1.04 s with
scipy), and SciPy through the losses 1.8 of the 30.7 s a fresh machine's first run spent importing (session 39).
transformers 5.24 imports neither torchvision nor scikit-learn there. The harness loads tokenizers and causal LMs
only, never decodes with an assistant model and computes no loss.

`hide_unused` tells transformers that all three are absent. It runs in the `harness run` process only, before
transformers' first import of any; the pytest plugin runs inside a user's process and never calls it.
HARNESS_LEAN_IMPORTS=0 turns it off.
"""

from __future__ import annotations

import os
import sys

# transformers' availability checks for the three (`transformers.utils.import_utils`)
HIDDEN = ("is_torchvision_available", "is_torchvision_v2_available", "is_sklearn_available", "is_scipy_available")
# the modules of transformers that read those checks when they are imported
READERS = ("transformers.image_utils", "transformers.video_utils", "transformers.generation.candidate_generator",
           "transformers.loss.loss_utils")
# the libraries hidden: nothing is changed where one is imported already
LIBRARIES = ("torchvision", "sklearn", "scipy")


def _absent() -> bool:
    return False


def hide_unused() -> tuple[str, ...]:
    """Make transformers' checks for torchvision, scikit-learn and SciPy answer False; the checks changed. Nothing
    is changed where it is turned off, where one of the libraries is imported already, or where transformers has
    already imported a module that reads the checks (too late to keep the import out)."""
    if os.environ.get("HARNESS_LEAN_IMPORTS") == "0" or any(name in sys.modules for name in LIBRARIES):
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
