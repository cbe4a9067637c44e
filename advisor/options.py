"""Command-line options shared by several commands (one definition, one help text)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from advisor.catalog.specs import FP8_RECIPES, PRECISIONS, RECOMPUTE_MODES


def one_of(choices: tuple[str, ...]):
    """Option callback: the value must be one of `choices` (click's own wording for a choice)."""

    def check(value: Optional[str]) -> Optional[str]:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(map(repr, choices))}.")
        return value

    return check


def calibration_default(value: Optional[str]) -> str:
    """Option callback of --calibration: unset means advisor.api.DEFAULT_CALIBRATION (one default
    for the API and the CLI; read when a command runs, so the CLI starts without the models)."""
    if value is not None:
        return value
    from advisor.api import DEFAULT_CALIBRATION

    return DEFAULT_CALIBRATION


_MODEL_HELP = "catalog name (see 'advisor catalog models') or a HF config.json"
_CLUSTER_HELP = "<gpu>x<count> (h100x64), <gpu>x<per-node>x<nodes>, a catalog cluster, or a YAML file"
Model = Annotated[str, typer.Option("--model", "-m", help=_MODEL_HELP)]
Cluster = Annotated[str, typer.Option("--cluster", "-c", help=_CLUSTER_HELP)]
OptModel = Annotated[Optional[str], typer.Option("--model", "-m", help=_MODEL_HELP)]
OptCluster = Annotated[Optional[str], typer.Option("--cluster", "-c", help=_CLUSTER_HELP)]
Seq = Annotated[Optional[int], typer.Option("--seq", help="sequence length (default: the model's context, at most 8192)")]
Gbs = Annotated[Optional[int], typer.Option("--gbs", help="global batch in sequences (default 128, more on big clusters)")]
Precision = Annotated[str, typer.Option(
    "--precision", help="the linear layers' format: bf16, fp8, mxfp8 or nvfp4 (the last two on Blackwell only)",
    callback=one_of(PRECISIONS))]
Fp8Recipe = Annotated[str, typer.Option(
    "--fp8-recipe", help="FP8 scaling with --precision fp8 (Megatron's --fp8-recipe): delayed, tensorwise "
    "(current per-tensor scaling) or blockwise", callback=one_of(FP8_RECIPES))]
PowerCap = Annotated[Optional[float], typer.Option("--power-cap", help="per-GPU power cap in W (default: the GPU's TDP)")]
PowerCaps = Annotated[Optional[str], typer.Option(
    "--power-caps", help="caps to choose from, LO:HI:STEP in W, e.g. 300:700:25 (default: the GPU's settable range, 25 W steps)")]
TP = Annotated[int, typer.Option("--tp", help="tensor parallel size")]
PP = Annotated[int, typer.Option("--pp", help="pipeline parallel size")]
PPFirstLayers = Annotated[Optional[int], typer.Option(
    "--pp-first-layers", help="layers on the first pipeline stage, for an uneven split (default: an even split)")]
PPLastLayers = Annotated[Optional[int], typer.Option(
    "--pp-last-layers", help="layers on the last pipeline stage, for an uneven split (default: an even split)")]
CpuOffloadLayers = Annotated[Optional[int], typer.Option(
    "--cpu-offload-layers", help="offload the activations of the first N transformer layers to host memory "
    "(megatron-core cpu_offloading_num_layers, Transformer Engine; pp 1, no recompute; default 0)")]
AccountForEmbedding = Annotated[bool, typer.Option(
    "--account-for-embedding/--no-account-for-embedding",
    help="count the embedding as a layer when splitting the pipeline (Megatron's --account-for-embedding-in-pipeline-split)")]
AccountForLoss = Annotated[bool, typer.Option(
    "--account-for-loss/--no-account-for-loss",
    help="count the output layer and loss as a layer when splitting the pipeline (--account-for-loss-in-pipeline-split)")]
PipelineLayout = Annotated[Optional[str], typer.Option(
    "--pipeline-layout",
    help="explicit pipeline layout in megatron-core's string form, pp·vp chunks split by '|': E embedding, "
         "t transformer layer, L loss, (..)*n and t*n repeat, e.g. 'Et|(tt|)*30L' (sets vp; "
         "Megatron's --pipeline-model-parallel-layout)")]
CP = Annotated[int, typer.Option("--cp", help="context parallel size")]
EP = Annotated[int, typer.Option("--ep", help="expert parallel size")]
ETP = Annotated[int, typer.Option("--etp", help="expert tensor parallel size")]
VP = Annotated[int, typer.Option("--vp", help="virtual pipeline chunks per rank")]
OptVP = Annotated[Optional[int], typer.Option("--vp", help="virtual pipeline chunks per rank (default 1, or what --pipeline-layout implies)")]
MBS = Annotated[int, typer.Option("--mbs", help="micro-batch size")]
Recompute = Annotated[str, typer.Option("--recompute", help="none, selective or full",
                                        callback=one_of(RECOMPUTE_MODES))]
SequenceParallel = Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="default: on when tp > 1")]
AsJson = Annotated[bool, typer.Option("--json", help="JSON on stdout")]
# help texts are rich markup: '\\[' keeps a literal '[report]' (unescaped, rich takes it for a style tag)
Html = Annotated[Optional[str], typer.Option(
    "--html", metavar="FILE", help="also write a self-contained HTML report with plots to FILE (pip install 'advisor\\[report]')")]
Stack = Annotated[Optional[str], typer.Option(
    "--stack", help="software stack the prediction is for: te (Megatron-Core + Transformer Engine, "
                    "the default: fitted on published runs) or local (this project's runner)")]

# `--runner command` (advisor measure, advisor tune): the user's own training command
Command = Annotated[Optional[str], typer.Option(
    "--command", help="--runner command: the training command, run with bash for each trial; placeholders "
                      "{megatron_args}, {megatron_model_args}, {nemo_overrides}, {bridge_overrides}, {env}, "
                      "{iters}, {tp} ... {node_rank} {master_addr} {master_port} (docs/tune.md)")]
LogParser = Annotated[str, typer.Option(
    "--parser", help="--runner command: how to read the job's log: auto (Megatron-LM / Megatron-Bridge and "
                     "NeMo lines, and $ADVISOR_STEP_FILE), megatron, nemo, regex (--step-regex), json (the step file only)")]
StepRegex = Annotated[Optional[str], typer.Option(
    "--step-regex", help="--runner command: a regex matching one line per iteration, with a named group "
                         "(?P<s>...) or (?P<ms>...) for its time and optionally (?P<iter>...)")]
CommandEnv = Annotated[Optional[list[str]], typer.Option(
    "--env", help="--runner command: NAME=VALUE set for every trial (placeholders allowed; repeatable)")]
ExitGrace = Annotated[float, typer.Option(
    "--exit-grace", help="--runner command: seconds the job may take to exit by itself after its measured "
                         "iterations before the runner stops it")]
