"""Warnings attributed to the user's code: `warn_user` reports a warning at the first frame outside ``hf_structkv``
(the user's call of `compact`, not the package function three calls down that noticed), so the warning's file and
line are the caller's and ``warnings.filterwarnings(module=...)`` filters by the caller's module."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` with the ``stacklevel`` of the first calling frame outside the package
    (the outermost frame when every frame is inside it)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is the frame that called warn_user
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
