"""What benchmarks/eager_cost.py makes of the ranks' rows: the maximum over ranks, the issues'
target ratios, the CSV in the harness schema (benchmarks/harness.py) and the printed table, with
the routes and issue 50's target lines (benchmarks/eager_breakdown.py's target_check). Nothing
runs at import."""

from __future__ import annotations

from benchmarks.eager_cost_items import H, ITEMS, K


def max_over_ranks(per_rank: list[list[dict]]) -> list[dict]:
    merged: dict[tuple, dict] = {}
    for rows in per_rank:
        for r in rows:
            key = (r["world_size"], r["quant"], r["tokens"], r["item"])
            if key not in merged:
                merged[key] = dict(r)
            else:
                for col in ("us_wall", "us_host"):
                    if r[col] == r[col]:  # not NaN
                        merged[key][col] = max(merged[key][col], r[col])
    return list(merged.values())


def ratios(rows: list[dict]) -> list[dict]:
    """Per (world size, quant, T): the issue's target ratios."""
    by = {}
    for r in rows:
        by.setdefault((r["world_size"], r["quant"], r["tokens"]), {})[r["item"]] = r["us_wall"]
    out = []
    for (ws, quant, tokens), v in sorted(by.items()):
        line = {"world_size": ws, "quant": quant, "tokens": tokens}
        fe, anchor, graph = (
            v.get("finalize_epilogue"),
            v.get("fi_moe_finalize_public"),
            v.get("graph_selected"),
        )
        if fe is not None and anchor:
            line["eager_vs_flashinfer_direct"] = round(fe / anchor, 3)
        if fe is not None and graph:
            line["eager_vs_graph_gpu"] = round(fe / graph, 3)
        if fe is not None and v.get("strategy_run") is not None:
            line["bridge_overhead_us"] = round(fe - v["strategy_run"], 2)
        if fe is not None and v.get("fused_tp1_kernel_cached"):
            line["eager_vs_tp1_kernel"] = round(fe / v["fused_tp1_kernel_cached"], 3)
        fe_out = v.get("finalize_epilogue_out")
        if fe_out is not None and v.get("fused_tp1_kernel_cached"):
            line["eager_out_vs_tp1_kernel"] = round(fe_out / v["fused_tp1_kernel_cached"], 3)
        out.append(line)
    return out


def write_csv(path: str, rows: list[dict]) -> None:
    """The rows in the harness schema: us_median the wall time per call, extra the rest."""
    from benchmarks.harness import Rows

    out = Rows()
    for r in sorted(rows, key=lambda r: (r["world_size"], r["quant"], r["tokens"], r["item"])):
        provider = "flashinfer" if "fi_" in r["item"] else "fusion_bridge"
        shape = f"TP{r['world_size']} H={H} K={K} {r['quant']}"
        extra = {k: r[k] for k in ("route_graph", "route_eager", "notes")}
        if r["us_host"] == r["us_host"]:  # not NaN: an eager item
            extra["us_host"] = round(r["us_host"], 2)
        out.add(r["item"], provider, shape, r["tokens"], r["us_wall"], **extra)
    out.write(path)


def print_table(rows: list[dict]) -> None:
    from benchmarks.eager_breakdown import target_check

    configs = sorted({(r["world_size"], r["quant"], r["tokens"]) for r in rows})
    items = list(ITEMS) + ["graph_selected", "graph_fi_moe_finalize"]
    value = {(r["world_size"], r["quant"], r["tokens"], r["item"]): r["us_wall"] for r in rows}
    head = ["item (us per call, wall)"] + [f"TP{w} {q} T={t}" for w, q, t in configs]
    width = [max(len(h), 26) for h in head]
    print("  ".join(h.ljust(w) for h, w in zip(head, width)))
    for item in items:
        cells = [item] + [
            f"{value[(w, q, t, item)]:.2f}" if (w, q, t, item) in value else "n/a"
            for w, q, t in configs
        ]
        print("  ".join(c.ljust(w) for c, w in zip(cells, width)))
    print()
    for line in ratios(rows):
        print(line)
    routes = {
        (r["world_size"], r["quant"], r["tokens"]): (r["route_graph"], r["route_eager"], r["notes"])
        for r in rows
    }
    for cfg, (graph, eager, notes) in sorted(routes.items()):
        print(f"TP{cfg[0]} {cfg[1]} T={cfg[2]}: graph route {graph}, eager route {eager}; {notes}")
    print()
    for line in target_check(ratios(rows)):
        print(line)
