"""`explain --world-size N` alone (no --gpu, no --sm) describes a machine: a TP group this process
is not in, so the report must say that it took the machine's facts for granted, and which."""

import json

from tests.helpers import run_cli


def test_a_world_size_alone_describes_a_machine_and_lists_the_assumptions():
    text = run_cli("explain", "--world-size", "2")
    assert text.returncode in (0, 1), text.stderr
    assert "(a described machine: static checks only, no self-test, no workspace)" in text.stdout
    assumed = [line for line in text.stdout.split("assumed for it:\n")[1].splitlines() if line]
    assert "  world size 2, every rank on one node" in assumed, text.stdout
    doc = json.loads(run_cli("explain", "--world-size", "2", "--json").stdout)
    assert doc["assumed"] and doc["environment"]["world_size"] == 2, doc["assumed"]
