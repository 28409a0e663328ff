"""The compatibility matrix, generated from the registry by evaluating every strategy's own
capability checks over described machines: `python -m fusion_bridge matrix`. The README embeds it
between markers and a test fails when the embedded copy is stale."""

from __future__ import annotations

from fusion_bridge.spec import EpilogueSpec, QuantSpec, Stage
from fusion_bridge.strategies import Environment, required_stages, strategy_classes

SMS = (80, 90, 100)
WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16)
FLASHINFER_VERSIONS = (
    "0.7.2.post1",
    "0.7.4",
    "0.8.0",
)  # tested, latest known-broken fused FP4, a later one
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
STAGE_ABBREV = {
    Stage.FINALIZE: "finalize",
    Stage.SHARED_ADD: "shared",
    Stage.ALL_REDUCE: "AR",
    Stage.RESIDUAL_NORM: "res+norm",
    Stage.QUANT: "quant",
}


def _gpu(sm: int, world: int, flashinfer: str = FLASHINFER_VERSIONS[0]) -> Environment:
    return Environment(
        device_type="cuda",
        sm=sm,
        gpu_name=f"SM{sm}",
        world_size=world,
        triton_version="3.6.0",
        flashinfer_version=flashinfer,
    )


def _cpu() -> Environment:
    return Environment(
        world_size=2, triton_version="3.6.0", flashinfer_version=FLASHINFER_VERSIONS[0]
    )


def _cpu_at(world: int) -> Environment:
    return _cpu().replace(world_size=world)


def _spec(quant: str) -> EpilogueSpec:
    q = {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(1.0),
        "nvfp4": QuantSpec.nvfp4(1.0),
        "fp8_per_token_group": QuantSpec.fp8_per_token_group(128),
        "fp8_per_token": QuantSpec.fp8_per_token(),
    }[quant]
    return EpilogueSpec(hidden_size=7168, top_k=8, quant=q)


def _ok(cls, spec, env) -> bool:
    return not cls.not_supported_reasons(spec, env)


def _runs(cls, quants, sms, worlds, versions) -> bool:
    return any(
        _ok(cls, _spec(q), _gpu(sm, w, fi))
        for q in quants
        for sm in sms
        for w in worlds
        for fi in versions
    )


def _probe_world(cls) -> int:
    """TP2, or the first world size the strategy runs at (a world-size-1 strategy: TP1)."""
    for w in (2,) + WORLD_SIZES:
        if _runs(cls, ("none", "fp8", "nvfp4"), SMS, [w], FLASHINFER_VERSIONS):
            return w
    return 2


# JSON key -> the README table's column title
TITLES = {
    "strategy": "strategy",
    "stages": "stages covered",
    "launches_sm90_tp2": "launches at SM90, TP2",
    "cpu": "CPU",
    "sm": "SM",
    "world_sizes": "world sizes",
    "quant": "quant",
    "flashinfer": "flashinfer",
}


def rows() -> list[dict]:
    """One row per strategy, keyed as `matrix --json` prints it (lists where there are several)."""
    out = []
    for cls in strategy_classes():
        pw = _probe_world(cls)
        quants = [
            q
            for q in ("none", "fp8", "nvfp4", "fp8_per_token_group", "fp8_per_token")
            if _runs(cls, [q], SMS, [pw], FLASHINFER_VERSIONS)
        ]
        probe = _spec(quants[0] if quants else "none")
        versions = [fi for fi in FLASHINFER_VERSIONS if _runs(cls, quants, SMS, [pw], [fi])]
        needs_fi = not _ok(cls, probe, _gpu(90, pw, None)) and bool(versions)
        with_fi = [st.name for st in cls.steps(probe, _gpu(90, pw))]
        if not needs_fi:
            fi = (
                "not needed"
                if with_fi == [st.name for st in cls.steps(probe, _gpu(90, pw, None))]
                else f"optional (>= {FLASHINFER_VERSIONS[0]} adds a faster sub-path)"
            )
        elif versions[0] == FLASHINFER_VERSIONS[0]:
            fi = f">= {versions[0]}"
        else:
            before = FLASHINFER_VERSIONS[FLASHINFER_VERSIONS.index(versions[0]) - 1]
            fi = f"> {before} (self-test gated)"
        if _ok(cls, probe, _cpu_at(pw)):
            cpu = "yes"
        elif _ok(cls, probe, _cpu_at(pw).replace(triton_interpret=True)):
            cpu = "interpreter only"
        else:
            cpu = "no"
        out.append(
            {
                "strategy": cls.name,
                "stages": [STAGE_ABBREV[s] for s in required_stages(probe, pw)],
                "launches_sm90_tp2": with_fi,
                "launches_at_world_size": pw,  # 2, or the first world size it runs at
                "cpu": cpu,
                "sm": [sm for sm in SMS if _runs(cls, quants, [sm], [pw], FLASHINFER_VERSIONS)],
                "world_sizes": [
                    w for w in WORLD_SIZES if _runs(cls, quants, SMS, [w], FLASHINFER_VERSIONS)
                ],
                "quant": quants,
                "flashinfer": fi,
            }
        )
    return out


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 4, 8] -> '1-4, 8'."""
    parts: list[list[int]] = []
    for v in values:
        if parts and v == parts[-1][-1] + 1:
            parts[-1].append(v)
        else:
            parts.append([v])
    return ", ".join(
        f"{p[0]}-{p[-1]}" if len(p) > 2 else ", ".join(str(v) for v in p) for p in parts
    )


def _cell(key: str, value, row: dict) -> str:
    if key == "world_sizes":
        return _ranges(value)
    if key == "launches_sm90_tp2":
        world = row["launches_at_world_size"]
        return " → ".join(value) + ("" if world == 2 else f" (TP{world})")
    if isinstance(value, list):
        sep = {"stages": " + ", "launches_sm90_tp2": " → "}.get(key, ", ")
        return sep.join(str(v) for v in value) or "none"
    return str(value)


def markdown() -> str:
    table = rows()
    lines = ["| " + " | ".join(TITLES.values()) + " |", "|" + "---|" * len(TITLES)]
    lines += ["| " + " | ".join(_cell(k, r[k], r) for k in TITLES) + " |" for r in table]
    return "\n".join(lines)


def embedded(readme_text: str) -> str:
    start, end = readme_text.index(START) + len(START), readme_text.index(END)
    return readme_text[start:end].strip()
