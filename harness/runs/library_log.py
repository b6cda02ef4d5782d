"""Keep library noise off the terminal: transformers' loading bars and warnings, Python warnings.

`harness run` shows one progress bar and one summary. What the libraries say while models load (weight
loading bars, "falling back to the torch implementation" warnings, deprecation notes) goes to
`<run dir>/library.log` instead, so it is kept for whoever needs it and never breaks the bar.
Messages logged before the run directory exists wait in memory and are written once it does.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

LOG_NAME = "library.log"
LIBRARY_LOGGERS = ("transformers", "torch", "accelerate", "huggingface_hub", "py.warnings", "httpx")


class RunDirHandler(logging.Handler):
    """Appends records to `run_dir/library.log`; holds them in memory until `run_dir` exists."""

    def __init__(self, run_dir: Path):
        super().__init__(logging.DEBUG)
        self.path = Path(run_dir) / LOG_NAME
        self.pending: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pending.append(self.format(record))
            if self.path.parent.is_dir():
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write("\n".join(self.pending) + "\n")
                self.pending.clear()
        except Exception:  # noqa: BLE001 - logging must never break a run
            self.handleError(record)


def quiet_libraries(run_dir: Path) -> RunDirHandler:
    """Route library logging and Python warnings to `run_dir/library.log`; turn off transformers' bars."""
    handler = RunDirHandler(run_dir)
    logging.captureWarnings(True)
    warnings.simplefilter("default")  # each distinct warning once, into the log
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
        root = hf_logging.get_logger()  # transformers' own library root logger, with its stderr handler
        root.handlers = [handler]
        root.propagate = False
    except ImportError:
        pass
    return handler
