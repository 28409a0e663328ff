"""What the commands share: the spec their arguments describe, the versions a result was produced
with, NVLink multicast off in the measuring tools, and the output (text, or with --json only the
JSON document on stdout)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from fusion_bridge.cli.args import DEFAULT_FP8_SCALE, DEFAULT_NVFP4_GLOBAL_SCALE, SCHEMA_VERSION


# the real stdout while --json sends everything else (C++ logs too) to stderr
_JSON_FD: list[int] = []


def emit(args, doc: dict, text: str) -> None:
    """The command's result: `text` on stdout, or with --json the JSON document `doc`."""
    if args.json:
        doc = {"schema_version": SCHEMA_VERSION, "command": args.command, **doc}
        sys.stdout.flush()
        os.write(_JSON_FD[0] if _JSON_FD else 1, (json.dumps(doc, indent=2) + "\n").encode())
    else:
        try:
            print(text, flush=True)
        except BrokenPipeError:  # `| head`: the reader left; nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def stdout_to_stderr() -> None:
    """Keep stdout for the JSON document alone: FlashInfer's kernels print warnings to fd 1."""
    sys.stdout.flush()
    _JSON_FD.append(os.dup(1))
    os.dup2(2, 1)


def spec_from_args(args):
    """The EpilogueSpec the command's --hidden, --top-k, --dtype, --quant... describe."""
    from fusion_bridge.spec import DTYPE_BY_NAME, EpilogueSpec, QuantSpec

    quant = {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(DEFAULT_FP8_SCALE),
        "nvfp4": QuantSpec.nvfp4(DEFAULT_NVFP4_GLOBAL_SCALE),
    }[args.quant]
    return EpilogueSpec(
        hidden_size=args.hidden,
        top_k=args.top_k,
        dtype=DTYPE_BY_NAME[args.dtype],
        has_shared_output=not args.no_shared,
        quant=quant,
        max_tokens=args.max_tokens,
    )


def versions() -> dict:
    """The versions a result was produced with (torch, triton, flashinfer, this package)."""
    import importlib.metadata

    import torch

    from fusion_bridge import __version__

    found = {"fusion_bridge": __version__, "torch": torch.__version__}
    for dist_name, key in (("triton", "triton"), ("flashinfer-python", "flashinfer")):
        try:
            found[key] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            found[key] = None
    found["cuda"] = torch.version.cuda
    return found


def set_multicast_off(command: str) -> None:
    """Our measuring tools run with NCCL NVLS and NVLink multicast off in every process they start
    (this one, and each spawned rank before it initialises NCCL): multicast can take a shared
    host's GPUs out of service. The library itself neither needs nor sets these variables."""
    from fusion_bridge.environment import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)
    print(
        f"{command}: every process it starts runs with "
        + " ".join(f"{k}={v}" for k, v in NO_MULTICAST_ENV.items())
        + " (NVLink multicast and NCCL NVLS off; results are measured that way)",
        file=sys.stderr,
    )


SPEC_FIELD_FLAGS = {  # EpilogueSpec's field -> the flag that sets it, for the parser's errors
    "hidden_size": "--hidden",
    "top_k": "--top-k",
    "max_tokens": "--max-tokens",
    "dtype": "--dtype",
}


def check_spec(parser: argparse.ArgumentParser, args) -> None:
    """The spec's own limits (e.g. H a multiple of 16 for NVFP4, T up to what int32 offsets allow),
    reported like the parser's errors, naming the flag. Not for tune/bench: they refuse a machine
    without GPUs before importing torch, which the spec needs."""
    try:
        spec_from_args(args)
    except ValueError as exc:
        message = str(exc).removeprefix("EpilogueSpec: ")
        flags = [flag for field, flag in SPEC_FIELD_FLAGS.items() if message.startswith(field)]
        parser.error(f"argument {flags[0]}: {message}" if flags else message)
