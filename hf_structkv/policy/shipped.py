"""The calibrated decode table + prefill policy pairs shipped for the embedded model, by name.

A pair is two folders of ``hf_structkv/data/policies`` (`shipped_policy` loads them). ``"calibrated"`` names the
default pair (`DEFAULT_CALIBRATED`); every earlier default stays loadable under its own name, so a result measured
with it can be reproduced and compared.
"""

from __future__ import annotations

__all__ = ["CALIBRATED", "DEFAULT_CALIBRATED", "SHIPPED_PAIRS", "pair_name", "shipped_pair_folders"]

CALIBRATED = "calibrated"
"""The name of whichever pair is the default."""

SHIPPED_PAIRS: dict[str, tuple[str, str]] = {
    "calibrated-verdict-24": (
        "qwen2.5-coder-0.5b-instruct-calibrated",
        "qwen2.5-coder-0.5b-instruct-calibrated-prefill",
    ),
    "calibrated-likelihood-384": (
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-384",
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-384-prefill",
    ),
    "calibrated-likelihood-int4": (
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-int4",
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-int4-prefill",
    ),
    "calibrated-likelihood-int4-centred": (
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-int4-centred",
        "qwen2.5-coder-0.5b-instruct-calibrated-likelihood-int4-centred-prefill",
    ),
}
"""``{name: (decode table folder, prefill policy folder)}``. ``calibrated-verdict-24``: PASK Algorithm 1 with
verdict sensitivity on 12 calibration + 12 development BFCL cases (docs/RESULTS.md measures it on the 224-case test
split). ``calibrated-likelihood-384``: Algorithm 1 with likelihood sensitivity (issue 32) on 256 calibration + 128
development BFCL cases (64 + 32 per category of ``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``,
disjoint from the 224-case test split), both stages in one run, development selection by likelihood confirmed by
verdicts (nominal ``B_D`` 0.163, ``B_P`` 0.474; its ``calibration_report.json`` beside both policies).
``calibrated-likelihood-int4``: the same likelihood calibration with floors from ``τ_low`` 0.001 (a bucket is
released only where releasing it alone leaves the reply's likelihood unchanged, else floored at INT4): decode
``α_D`` 0.02 (nominal ``B_D`` 0.265, development accuracy 0.492 against all-high 0.500); prefill ``τ`` (0.001, 1)
candidate 0 written with ``α_P`` 0.05 (nominal ``B_P`` 0.274, development accuracy 0.453), chosen over the
verdict-24 prefill on the development split at B = 0.33 (54 against 49 of 128). Until commit 4426d68 this name paired
the decode table with the verdict-24 prefill (its rows in docs/NOTES.md say how to rerun them).
``calibrated-likelihood-int4-centred``: that pair's two policies served with centred INT4 keys (``int4_keys``
``"centred"``, `hf_structkv.quant.int4_centred`; saved as their ``quantizer`` convention), which the development
split chose over the row keys they were calibrated with at B = 0.33 (60 against 54 of 128); not recalibrated."""

DEFAULT_CALIBRATED = "calibrated-likelihood-int4-centred"
"""The pair ``"calibrated"`` loads: chosen on the development split at B = 0.33 over the previous default,
``calibrated-verdict-24`` (60 against 51 of 128, 16 gained / 7 lost, p = 0.093; docs/NOTES.md, "The default pair on
the development split"), which stays loadable by that name."""


def pair_name(name: str) -> str:
    """``name`` with ``"calibrated"`` resolved to the pair it loads now (`DEFAULT_CALIBRATED`); any other name as
    given. A result records this name, which keeps naming the same pair when the default moves."""
    return DEFAULT_CALIBRATED if name == CALIBRATED else name


def shipped_pair_folders(name: str = CALIBRATED) -> tuple[str, str]:
    """The ``(decode table, prefill policy)`` folders of the shipped pair ``name`` (``"calibrated"``: the default).

    Raises:
        ValueError: ``name`` names no shipped pair.
    """
    key = pair_name(name)
    if key not in SHIPPED_PAIRS:
        raise ValueError(f"no shipped calibrated pair {name!r}: choose one of {[CALIBRATED, *SHIPPED_PAIRS]}")
    return SHIPPED_PAIRS[key]
