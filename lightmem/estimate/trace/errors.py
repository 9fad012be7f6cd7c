"""What the dry run says when a step cannot run on fake tensors."""

from __future__ import annotations


class EstimateError(RuntimeError):
    """The step could not be run on fake tensors; the message says why and what to change."""
