"""Imported once by the fork server of `fusion_bridge.cli.launch.run_distributed` in a CPU test run
(tests/conftest.py adds this module to the server's preload list), so the suite's spawned gloo
ranks, forked from that server, start with the heavy third-party modules they all import already
loaded, instead of each importing them again: `flashinfer.comm` (every bridge build probes it;
it pulls in triton, numpy and cutlass) and `transformers.modeling_utils` (every Hugging Face rank
builds a model). Measured here, per rank: about 2 s and 3 s of CPU.

Only third-party modules: fusion_bridge and the tests are still imported fresh in every rank,
with the rank's own environment. The server starts from the test process's environment, which
tests/conftest.py has fixed (TRITON_INTERPRET=1, the no-multicast variables) before any test
runs; this module preloads nothing unless that setup is the one in force. An import that fails
here is left to fail in the rank that needs it, with the rank's own error, as before."""

from __future__ import annotations

import os

# (module, why a spawned rank imports it)
PRELOADED = (
    ("torch.distributed", "every rank joins a gloo group"),
    ("flashinfer.comm", "fusion_bridge.environment's probe, at every bridge build"),
    ("transformers.modeling_utils", "the Hugging Face ranks build tiny models"),
)


def _preload() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":  # not the CPU suite's setup: preload nothing
        return
    import importlib

    for name, _ in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank that needs it reports it, as before
            pass


_preload()
