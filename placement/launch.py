"""Launcher hooks: the environment that puts each local rank on its planned GPU.

torchrun (default mode) gives local rank r ``cuda:r``, which is ``CUDA_VISIBLE_DEVICES[r]``; with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` the integers there are positions in PCI bus order, which is how
plans number GPUs. ``--virtual-local-rank`` (torch >= 2.10) hands rank r the r-th entry too.
Slurm: ``srun --gpu-bind=map_gpu:<plan.slurm_gpu_bind>``.

The hook never blocks a job: ``exec_placed`` runs the command whatever happens, with one warning
line on stderr when the placement could not be applied. (``advisor launch`` refuses, before this,
a ``--profile`` path that does not exist: a typo, see advisor.validate._check_launch.)
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Callable, Mapping, NoReturn, Sequence

from advisor.catalog.specs import SpecError
from advisor.placement.planner import Plan
from advisor.placement.profile import NodeProfile, normalize_pci

NODE_RANK_ENV = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")


class PlacementSkipped(SpecError):
    """The plan cannot be applied on this node; the message says why (one line)."""


def node_rank(environ: Mapping[str, str] | None = None) -> int:
    """This node's rank from NODE_RANK / GROUP_RANK (torchrun) / SLURM_NODEID, else 0."""
    env = os.environ if environ is None else environ
    for k in NODE_RANK_ENV:
        v = env.get(k)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise PlacementSkipped(f"{k}={v!r} is not a node rank") from None
    return 0


def _node_index(plan: Plan, node: int | str | None, environ: Mapping[str, str] | None) -> int:
    if node is None:
        node = node_rank(environ)
    if isinstance(node, str) and not node.isdigit():
        if node not in plan.node_names:
            raise PlacementSkipped(f"no node {node!r} in the plan (nodes: {', '.join(plan.node_names)})")
        return plan.node_names.index(node)
    n = int(node)
    if not 0 <= n < len(plan.gpus):
        raise PlacementSkipped(f"node rank {n} is outside the plan's {len(plan.gpus)} nodes")
    return n


def env_for_node(plan: Plan, node: int | str | None = None,
                 environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to set before starting the ranks of one node (by rank or name; default: from
    NODE_RANK / GROUP_RANK / SLURM_NODEID). Empty when the plan keeps the identity placement."""
    n = _node_index(plan, node, environ)
    if not plan.applied:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": plan.cuda_visible_devices(n)}


def local_gpus() -> list[tuple[str, str]]:
    """(UUID, PCI bus id) of every NVIDIA GPU of this machine, through NVML."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pynvml
    except ImportError:
        raise PlacementSkipped("NVML is not available (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:
        raise PlacementSkipped(f"NVML is not available ({e})") from None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            out.append((uuid.decode() if isinstance(uuid, bytes) else str(uuid), normalize_pci(bus)))
        return out
    finally:
        pynvml.nvmlShutdown()


def check_node(profile: NodeProfile, gpus: Sequence[tuple[str, str]]) -> str:
    """The profile must describe this machine's slots: the same PCI bus ids (the UUIDs may differ
    when one profile stands for every node of the same chassis). Returns how it matched."""
    if not all(g.pci_bus_id for g in profile.gpus):
        raise PlacementSkipped(f"profile {profile.node!r} has no PCI bus ids (a recording?); cannot match it to this node")
    local = {pci for _, pci in gpus}
    want = {g.pci_bus_id for g in profile.gpus}
    if local != want:
        raise PlacementSkipped(f"profile {profile.node!r} describes GPUs at {', '.join(sorted(want))} but this "
                               f"node has {', '.join(sorted(local)) or 'none'}")
    same = {u.lower() for u, _ in gpus} == {g.uuid.lower() for g in profile.gpus}
    return "matched by UUID" if same else "matched by PCI bus id (same chassis, other GPUs)"


def check_visible(environ: Mapping[str, str], n_gpus: int) -> None:
    """Refuse to permute when CUDA_VISIBLE_DEVICES already restricts the node to some GPUs."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    if len(items) == n_gpus and (sorted(items) == [str(i) for i in range(n_gpus)]
                                 or all(x.upper().startswith(("GPU-", "MIG-")) for x in items)):
        return
    raise PlacementSkipped(f"CUDA_VISIBLE_DEVICES is already set to {cvd!r}; not permuting a restricted set of GPUs")


def placement_env(plan: Plan, profiles: Sequence[NodeProfile], node: int | str | None = None,
                  environ: Mapping[str, str] | None = None, verify: bool = True) -> tuple[dict[str, str], str]:
    """(variables to set, one-line note) for this node; raises PlacementSkipped when it cannot apply."""
    env = os.environ if environ is None else environ
    n = _node_index(plan, node, env)
    if not plan.applied:
        return {}, f"identity placement kept: {plan.reason}"
    how = "profile trusted without checking the GPUs"
    if verify:
        prof = profiles[n]
        if not all(g.pci_bus_id for g in prof.gpus):  # before asking NVML: say the real reason
            raise PlacementSkipped(f"profile {prof.node!r} has no PCI bus ids (a recording?); cannot match it to this node")
        how = check_node(prof, local_gpus())
    check_visible(env, len(plan.gpus[n]))
    out = env_for_node(plan, n, env)
    return out, (f"node {plan.node_names[n]}: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="
                 f"{out['CUDA_VISIBLE_DEVICES']} (predicted {plan.predicted_gain_pct:+.2f}%; {how})")


def power_cap_commands(plan: Plan, profiles: Sequence[NodeProfile], node: int | str | None = None,
                       environ: Mapping[str, str] | None = None) -> list[list[str]]:
    """`nvidia-smi -i <GPU> -pl <W>` for every GPU of this node whose stage has a cap in
    plan.stage_caps (GPU by PCI bus id from the node's profile, else its index in PCI order)."""
    n = _node_index(plan, node, os.environ if environ is None else environ)
    by_index = {g.index: g.pci_bus_id for g in profiles[n].gpus} if n < len(profiles) else {}
    return [["nvidia-smi", "-i", by_index.get(g) or str(g), "-pl", f"{cap:g}"]
            for g, cap in plan.power_caps_of_node(n)]


def apply_power_caps(cmds: Sequence[Sequence[str]], dry_run: bool = True, run: Callable | None = None) -> str:
    """Run (or with dry_run, only list) the nvidia-smi commands; one line saying what was done.
    A failure is reported in that line, never raised: it must not block the launch."""
    if not cmds:
        return "no per-stage power caps for this node (one stage, or every stage on the critical path)"
    shown = "; ".join(" ".join(c) for c in cmds)
    if dry_run:
        return f"dry run, would run: {shown} (add --no-dry-run to apply)"
    import subprocess

    run = run or subprocess.run
    failed = []
    for c in cmds:
        try:
            r = run(list(c), capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                failed.append(f"{' '.join(c)}: {' '.join((r.stderr or r.stdout or '').split())[:200] or f'exit {r.returncode}'}")
        except (OSError, subprocess.SubprocessError) as e:
            failed.append(f"{' '.join(c)}: {e}")
    if failed:
        return f"power caps: {len(cmds) - len(failed)} of {len(cmds)} applied; failed: {'; '.join(failed)}"
    return f"power caps applied: {shown}"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, SpecError) else f"{type(e).__name__}: {text}"


def exec_placed(cmd: Sequence[str], compute: Callable[[], tuple[dict[str, str], str]]) -> NoReturn:
    """Run `cmd` (os.execvpe) with the variables `compute` returns. Whatever goes wrong in
    `compute` (bad profile, no NVML, any exception), the command still runs, unchanged, after one
    warning line on stderr."""
    env = dict(os.environ)
    try:
        logging.disable(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            updates, note = compute()
        env.update(updates)
        print(f"advisor launch: {note}", file=sys.stderr, flush=True)
    except Exception as e:  # never block the launch
        print(f"warning: advisor launch: placement skipped ({_one_line(e)}); launching unchanged",
              file=sys.stderr, flush=True)
    finally:
        logging.disable(logging.NOTSET)
    try:
        os.execvpe(cmd[0], list(cmd), env)
    except OSError as e:
        print(f"error: cannot run {cmd[0]!r}: {e.strerror or e}", file=sys.stderr, flush=True)
        sys.exit(127)
