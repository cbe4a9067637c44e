"""Check on real GPUs that `advisor launch` puts every pipeline stage on its planned physical GPU.

    python bench/placement_gpu_check.py                    # all local GPUs (2, 4 or 8), both torchrun modes
    python bench/placement_gpu_check.py --profile P.json   # plan with a measured profile instead

1. Lists this node's GPUs through NVML (UUID, PCI bus id).
2. Without --profile, writes a check profile for exactly these GPUs (real UUIDs and PCI ids)
   where the first GPU in PCI order is much cooler than the others, so the plan must move the
   heaviest stage (the last: output layer + loss) away from the identity placement.
3. Plans llama3-8b TP1 PP<n> with `advisor place` and launches, with the same flags through `advisor launch`,
   a tiny torchrun job (`torch.distributed.run --standalone`) once per mode: default local ranks
   (cuda:LOCAL_RANK) and --virtual-local-rank (each worker sees only its own GPU).
4. Inside the job every rank records its stage (rank // (tp·cp·dp)), its GPU's UUID from torch and
   the PCI bus id NVML gives for that UUID, and joins an NCCL all-reduce.
5. Prints a PASS/FAIL table per mode: stage k must run on the planned physical GPU. Exit 0 iff all pass.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 32  # llama3-8b
CHECK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ensure_importable() -> dict[str, str]:
    """Import `advisor` from this checkout even when it is not pip-installed: a temp folder whose
    `advisor` package links the layer folders the way pyproject's package-dir maps them."""
    try:
        import advisor.placement  # noqa: F401
        return {}
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="advisor-shim-")) / "advisor"
    shim.mkdir()
    for f in (ROOT / "advisor").iterdir():
        if f.suffix == ".py":
            (shim / f.name).symlink_to(f)
    for sub in ("catalog", "search_spaces", "models", "runners", "placement"):
        (shim / sub).symlink_to(ROOT / sub)
    sys.path.insert(0, str(shim.parent))
    return {"PYTHONPATH": os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


# ------------------------------------------------------------------------------------- worker
def worker(out: Path) -> int:
    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    props = torch.cuda.get_device_properties(local_rank)
    uuid = str(props.uuid)
    uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    x = torch.full((1,), float(rank), device="cuda")
    dist.all_reduce(x)
    ok = float(x.item()) == world * (world - 1) / 2
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    pci = pynvml.nvmlDeviceGetPciInfo(h).busId
    pci = pci.decode() if isinstance(pci, bytes) else str(pci)
    row = {"rank": rank, "local_rank": local_rank, "stage": rank,  # tp = cp = dp = 1: stage = rank
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"), "torch_uuid": uuid,
           "nvml_pci_bus_id": pci, "nvml_index": pynvml.nvmlDeviceGetIndex(h), "all_reduce_ok": ok}
    pynvml.nvmlShutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------- parent
def local_gpus() -> list[dict]:
    import pynvml

    from advisor.placement.profile import normalize_pci

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name, bus = pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetPciInfo(h).busId
            dec = (lambda v: v.decode() if isinstance(v, bytes) else str(v))
            out.append({"index": i, "uuid": dec(uuid), "name": dec(name), "pci_bus_id": normalize_pci(dec(bus))})
        return sorted(out, key=lambda g: g["pci_bus_id"])
    finally:
        pynvml.nvmlShutdown()


def check_profile(gpus: list[dict]) -> dict:
    slots = []
    for k, g in enumerate(gpus):  # first in PCI order cool, the rest hot (exaggerated on purpose)
        amb, c = (25.0, 0.03) if k == 0 else (45.0, 0.06)
        slots.append({"index": g["index"], "uuid": g["uuid"], "pci_bus_id": g["pci_bus_id"], "ambient_c": amb, "c_per_w": c})
    return {"node": "gpu-check", "gpus": slots, "note": "synthetic thermals on this node's real GPUs"}


def layout_flags(cluster: str, n: int) -> list[str]:
    return ["-m", "llama3-8b", "-c", cluster, "--tp", "1", "--pp", str(n), "--gbs", "64", "--seq", "4096"]


def run_mode(mode: str, n: int, prof_path: Path, cluster: str, margin: float, env: dict, tmp: Path) -> tuple[list[dict], str]:
    out = tmp / mode
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    if mode == "virtual":
        torchrun.append("--virtual-local-rank")
    cmd = [sys.executable, "-m", "advisor", "launch", "-p", str(prof_path), *layout_flags(cluster, n),
           "--margin", str(margin), "--",
           *torchrun, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    launch_lines = [l for l in r.stderr.splitlines() if l.startswith(("advisor launch:", "warning: advisor launch:"))]
    if r.returncode:
        print(r.stdout[-4000:], r.stderr[-4000:], sep="\n", file=sys.stderr)
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return rows, (launch_lines[0] if launch_lines else f"(no launch line; rc={r.returncode})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=Path, help="a measured profile of this node (default: a check profile)")
    ap.add_argument("--margin", type=float, default=0.0, help="margin passed to the plan (default 0: apply any gain)")
    ap.add_argument("--modes", default="default,virtual", help="torchrun modes: default, virtual")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.out)
    extra_env = ensure_importable()
    gpus = local_gpus()
    n = len(gpus)
    if n < 2 or LAYERS % n:
        print(f"FAIL: need 2, 4 or 8 GPUs on this node, found {n}")
        return 1
    kind = "h200" if "H200" in gpus[0]["name"] else "h100"
    cluster = f"{kind}x{n}"
    tmp = Path(tempfile.mkdtemp(prefix="placement-check-"))
    prof_path = a.profile or tmp / "check-profile.json"
    if a.profile is None:
        prof_path.write_text(json.dumps(check_profile(gpus)))
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update(CHECK_ENV, **extra_env)
    # the plan exactly as `advisor launch` will make it: `advisor place` with the same flags
    r = subprocess.run([sys.executable, "-m", "advisor", "place", "-p", str(prof_path), *layout_flags(cluster, n),
                        "--margin", str(a.margin), "--json"], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode:
        print(f"FAIL: advisor place: {r.stderr.strip()}")
        return 1
    p = json.loads(r.stdout)
    expected = [g for s in sorted(p["stages"], key=lambda s: s["stage"]) for g in s["gpus"]]  # stage k -> CUDA index
    applied = p["applied"]
    print(f"{n} × {gpus[0]['name']}; plan applied={applied}: {p['reason']}")
    print(f"expected CUDA_VISIBLE_DEVICES={','.join(map(str, expected))}")
    all_ok = True
    for mode in a.modes.split(","):
        rows, line = run_mode(mode, n, prof_path, cluster, a.margin, env, tmp)
        print(f"\n[{mode}] {line}")
        print(f"{'stage':>5}  {'planned GPU (PCI)':<30}  {'observed GPU (PCI, by UUID)':<30}  {'CVD':<16}  result")
        by_stage = {r["stage"]: r for r in rows}
        for k in range(n):
            want = gpus[expected[k]]
            got = by_stage.get(k)
            ok = (got is not None and got["torch_uuid"].lower() == want["uuid"].lower()
                  and got["nvml_pci_bus_id"].upper().endswith(want["pci_bus_id"][-7:]) and got["all_reduce_ok"]
                  and (not applied or got["cuda_device_order"] == "PCI_BUS_ID"))
            all_ok &= ok
            seen = f"{got['nvml_pci_bus_id']}" if got else "(rank missing)"
            cvd = got["cuda_visible_devices"] if got else "-"
            print(f"{k:>5}  {want['pci_bus_id']:<30}  {seen:<30}  {str(cvd):<16}  {'PASS' if ok else 'FAIL'}")
        if applied and "warning" in line:
            all_ok = False
    print("\nPASS" if all_ok else "\nFAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
