"""What the commands share: the spec their arguments describe, the versions a result was produced
with, NVLink multicast off in the measuring tools, and the output (text, or with --json only the
JSON document on stdout)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from fusion_bridge.cli.args import (
    DEFAULT_FP8_SCALE,
    DEFAULT_GROUP_SIZE,
    DEFAULT_NVFP4_GLOBAL_SCALE,
    SCHEMA_VERSION,
)


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
    """The EpilogueSpec the command's flags describe, one flag per field: --hidden, --top-k,
    --dtype, --eps, --weight-bias, --routed-scaling-factor, --no-shared,
    --shared-output-replicated, --quant (--quant-scale, --sf-layout, --group-size,
    --scale-layout), --max-tokens."""
    from fusion_bridge.spec import DTYPE_BY_NAME, EpilogueSpec, QuantSpec

    scale, layout = args.quant_scale, args.sf_layout or "swizzled_128x4"
    quant = {
        "none": lambda: QuantSpec.none(),
        "fp8": lambda: QuantSpec.fp8(DEFAULT_FP8_SCALE if scale is None else scale),
        "nvfp4": lambda: QuantSpec.nvfp4(
            DEFAULT_NVFP4_GLOBAL_SCALE if scale is None else scale, layout
        ),
        "fp8_per_token_group": lambda: QuantSpec.fp8_per_token_group(
            getattr(args, "group_size", None) or DEFAULT_GROUP_SIZE,
            getattr(args, "scale_layout", None) or "row_major",
        ),
        "fp8_per_token": lambda: QuantSpec.fp8_per_token(),
    }[args.quant]()
    return EpilogueSpec(
        hidden_size=args.hidden,
        top_k=args.top_k,
        dtype=DTYPE_BY_NAME[args.dtype],
        eps=args.eps,
        weight_bias=args.weight_bias,
        routed_scaling_factor=args.routed_scaling_factor,
        has_shared_output=not args.no_shared,
        shared_output_replicated=args.shared_output_replicated,
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
    "eps": "--eps",
    "weight_bias": "--weight-bias",
    "routed_scaling_factor": "--routed-scaling-factor",
    "shared_output_replicated": "--shared-output-replicated",
    "quant.scale": "--quant-scale",
    "quant.global_scale": "--quant-scale",
    "quant.sf_layout": "--sf-layout",
    "quant.group_size": "--group-size",
    "quant.scale_layout": "--scale-layout",
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


#: bytes per (token, hidden) element one parity rank holds at its peak, per expert slot and for the
#: other [T, H] tensors: the inputs in the activation dtype, the outputs, and the float64 oracle's
#: copies of every rank's partials (a coarse upper estimate, to refuse sizes that cannot fit)
PARITY_BYTES_PER_ELEMENT = 8


def parity_bytes(tokens: int, hidden: int, top_k: int, world_size: int) -> int:
    """Roughly the most memory `parity` needs on this machine: every rank's inputs and outputs and
    the float64 oracle over every rank's partials."""
    per_rank = tokens * hidden * (top_k + 8) * PARITY_BYTES_PER_ELEMENT
    return per_rank * world_size * (world_size + 1)


def available_bytes() -> int | None:
    """The memory this machine can still give (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(parser: argparse.ArgumentParser, args) -> None:
    """Refuse, naming the flags, a parity size that cannot fit this machine's available memory,
    before anything is allocated (a rank killed by the kernel's OOM killer says nothing useful)."""
    need = parity_bytes(args.tokens, args.hidden, args.top_k, args.world_size)
    have = available_bytes()
    if have is not None and need > have:
        parser.error(
            f"argument --hidden: T={args.tokens} x H={args.hidden} x K={args.top_k} on "
            f"{args.world_size} rank(s) needs about {need / 2**30:.1f} GiB, and this machine has "
            f"{have / 2**30:.1f} GiB available: use a smaller --hidden, --tokens or --world-size"
        )
