"""`advisor catalog models|gpus|clusters`."""
from __future__ import annotations

import json
import sys

import typer
from advisor.options import one_of

WHAT = ("models", "gpus", "clusters")


def _doc_name(source: str) -> str:
    """The short form of a source for a table cell: the document it names, i.e. the text before
    the first ': ' ("NVIDIA H100 datasheet (SXM5): 3.35 TB/s" -> "NVIDIA H100 datasheet (SXM5)")."""
    return source.split(": ", 1)[0].strip()


def _cell(text: str):
    """A table cell that rich cuts with an ellipsis instead of wrapping when the column narrows."""
    from rich.text import Text

    return Text(text, no_wrap=True, overflow="ellipsis")


def _gpu_source(gpu) -> str:
    """A GPU's sources are per field; the table shows the one of its headline number (dense bf16
    peak), the rest are in --json."""
    return _doc_name(gpu.sources.get("bf16_tflops") or next(iter(gpu.sources.values()), ""))


def _cluster_sources() -> dict[str, str]:
    """name -> `source` of each catalog cluster file (ClusterSpec itself keeps no source)."""
    from advisor.catalog.loaders import data_dir, read_yaml

    out = {}
    for f in sorted(data_dir("clusters").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            what = f"catalog clusters/{f.name}"
            data = read_yaml(f, what)
            out[str(data.get("name") or what)] = str(data.get("source") or "")
    return out


def register(app: typer.Typer) -> None:
    app.command("catalog")(catalog_cmd)


def catalog_cmd(
    what: str = typer.Argument(..., help="models, gpus or clusters", callback=one_of(WHAT)),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
) -> None:
    """List the built-in models, GPUs or clusters with their key numbers."""
    from rich.table import Table  # tables only when printed (--json needs no rich)

    from advisor.catalog import list_clusters, list_gpus, list_models
    from advisor.models.flops import active_params, total_params
    from advisor.report import make_console

    if what == "models":
        items = list_models()
        if as_json:
            json.dump([dict(m.to_dict(), total_params=total_params(m), active_params=active_params(m)) for m in items],
                      sys.stdout, indent=1)
            print()
            return
        t = Table(title="models")
        for col in ("name", "params", "active", "layers", "hidden", "heads/kv", "ffn", "experts", "vocab", "source"):
            t.add_column(col)
        for m in items:
            experts = f"{m.moe.num_experts} top-{m.moe.top_k}" if m.is_moe else "-"
            t.add_row(m.name, f"{total_params(m) / 1e9:.1f}B", f"{active_params(m) / 1e9:.1f}B", str(m.num_layers),
                      str(m.hidden_size), f"{m.num_attention_heads}/{m.kv_heads}", str(m.ffn_hidden_size), experts,
                      str(m.vocab_size), m.source)
    elif what == "gpus":
        items = list_gpus()
        if as_json:
            json.dump([g.to_dict() for g in items], sys.stdout, indent=1)
            print()
            return
        t = Table(title="GPUs", caption="source: of the peak TFLOPS; every number's source: --json")
        for col in ("name", "memory GiB", "HBM GB/s", "bf16 TF", "fp8 TF", "TDP W", "idle W", "slowdown °C",
                    "link GB/s", "GPUs/node", "net Gb/s"):
            t.add_column(col, no_wrap=True)
        t.add_column("source")  # the only column that narrows on a narrow terminal
        for g in items:
            t.add_row(g.name, f"{g.memory_gib:.1f}", f"{g.hbm_bandwidth_gbs:,.0f}", f"{g.bf16_tflops:,.0f}",
                      f"{g.fp8_tflops:,.0f}", f"{g.tdp_w:.0f}", f"{g.idle_w:.0f}", f"{g.slowdown_temp_c:.0f}",
                      f"{g.intra_node_bw_gbs:.0f}", str(g.gpus_per_node), f"{g.network_bw_gbps:.0f}",
                      _cell(_gpu_source(g)))
    else:
        items = list_clusters()
        sources = _cluster_sources()
        if as_json:
            json.dump([dict(c.to_dict(), source=sources.get(c.name, "")) for c in items], sys.stdout, indent=1)
            print()
            return
        t = Table(title="clusters (any <gpu>x<count> also works, e.g. h100x64)")
        for col in ("name", "gpu", "nodes", "GPUs/node", "intra GB/s", "inter GB/s", "cap W"):
            t.add_column(col, no_wrap=True)
        t.add_column("source")
        for c in items:
            t.add_row(c.name, c.gpu.name, str(c.num_nodes), str(c.gpus_per_node), f"{c.intra_node_bw_gbs:.0f}",
                      f"{c.inter_node_bw_gbs:.0f}", f"{c.power_cap_w:.0f}",
                      _cell(_doc_name(sources.get(c.name, ""))))
    make_console().print(t)
