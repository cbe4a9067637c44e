"""One validation layer for the inputs of every command (and of the API's batch lines).

Bad input is refused before any long work starts, with one line that names the flag (the CLI
prints it as ``error: ...`` and exits 2):
  * numbers: every float option must be finite; the options of ``NUMBERS`` must be in range;
  * paths (``PATHS``): an output file must not be a directory and its folder must exist (no
    command makes a folder the user named; a default's folder is made) and be writable
    (checked by creating a file there: permission bits lie to root), an input file must exist,
    be a file and be of the right kind (a measurement JSONL is not an Optuna journal and the
    other way round, so that a mistyped flag never appends to, or overwrites, what the user
    measured); a database URL must have its driver installed and answer;
  * conflicts (``check_command``): a flag and a ``--set`` of the same knob with different values,
    a ``--set`` given twice, options of another runner or mode, an output that is an input;
  * missing extras (``require``): one line naming the ``pip install 'advisor[...]'`` to run.

``install(group)`` wires this into the click group of the CLI (``advisor.cli.main``): each
command's callback is wrapped so that its parsed parameters are checked first. The checks are
plain functions too, used by the API (``layout_values``: the layout keys of ``predict``, ``place``
and every ``predict --batch`` line; ``study_paths``: the storage and dataset of a study).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from advisor.catalog.specs import (FP8_RECIPES, MOE_DISPATCHERS, MOE_ROUTERS, PRECISIONS, RECOMPUTE_MODES,
                                   RECOMPUTE_MODULES, SpecError)


class InputError(SpecError):
    """A command's input is refused (one line for the user)."""


# ------------------------------------------------------------------------------------- numbers
def number(flag: str, v: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           integer: bool = False) -> Any:
    """`v` if it is a finite number in [lo, hi] (lo excluded when lo_open; an integer when
    `integer`: bools and non-integral floats are refused, integral floats become ints)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        want = "an integer" if integer else "a number"
        raise InputError(f"{flag} must be {want}, got {v!r}")
    if not math.isfinite(v):
        raise InputError(f"{flag} must be a finite number, got {v!r}")
    if integer:
        if v != int(v):
            raise InputError(f"{flag} must be an integer, got {v!r}")
        v = int(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise InputError(f"{flag} must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
    if hi is not None and v > hi:
        raise InputError(f"{flag} must be <= {hi:g}, got {v!r}")
    return v


def _range(lo=None, hi=None, lo_open=False):
    return lambda flag, v: number(flag, v, lo, hi, lo_open)


GE0, GE1, GT0 = _range(0), _range(1), _range(0, lo_open=True)

# flag -> check of a numeric value (a flag whose value is a path is checked by PATHS instead)
NUMBERS: dict[str, Callable[[str, Any], Any]] = {
    **{f: GE1 for f in ("--tp", "--pp", "--cp", "--ep", "--etp", "--vp", "--dp", "--mbs", "--gbs", "--seq",
                        "--pp-first-layers", "--pp-last-layers", "--layers", "--trials", "--batch", "--top",
                        "--steps", "--gpus")},
    **{f: GE0 for f in ("--top-k", "--seed", "--warmup", "--margin", "--leak-per-c", "--idle", "--cool",
                        "--min-seconds", "--telemetry-hz", "--node-rank", "--cpu-offload-layers")},
    **{f: GT0 for f in ("--power-cap", "--timeout", "--trial-timeout", "--seconds", "--rate", "--max-seconds",
                        "--storage-bw")},
    **{f: GE0 for f in ("--gpu-hour-price", "--failures-per-gpu-hour", "--restart-min")},
    "--folds": _range(2),
    "--sim-sigma": _range(0, 1),
    "--memory-margin": _range(0, 0.5),  # a share of the GPU's memory left free (models.memory_band)  # log-normal sigma: 1 is already a factor e (2.7x) of spread
}


# --------------------------------------------------------------------------------------- paths
def _nearest_existing(p: Path) -> Path:
    q = p
    while not q.exists() and q != q.parent:
        q = q.parent
    return q


def _writable_dir(d: Path, flag: str, shown: Path) -> None:
    """`d` (existing) is a folder we can create files in: tried for real (root ignores the
    permission bits, a read-only file system does not)."""
    if not d.is_dir():
        raise InputError(f"{flag} {shown}: {d} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".advisor-write-check-", dir=d)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise InputError(f"{flag} {shown}: cannot write in {d} ({e.strerror or type(e).__name__})") from None


def _parent_exists(flag: str, shown: Any, parent: Path) -> None:
    """The folder an output goes in must exist: a command makes no folders the user named (a
    typo in a folder would silently grow a tree); the defaults' folders are made (parents=True)."""
    if not parent.exists():
        raise InputError(f"{flag} {shown}: directory {parent} does not exist")


def output_file(flag: str, path: str | Path, suffix: str | None = None, parents: bool = False) -> Path:
    """A file this command will write: not a folder, in a folder that exists and is writable; an
    existing file must be writable. `suffix`: the file's required ending. `parents`: the folder
    may be missing and is made (only for a default path, never for one the user gave)."""
    p = Path(path).expanduser()
    if str(path).strip() == "" or str(path).endswith(("/", os.sep)) or p.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file path")
    if suffix and not p.name.endswith(suffix):
        raise InputError(f"{flag} {path}: must end in {suffix}")
    if not parents:
        _parent_exists(flag, path, p.parent)
    _writable_dir(_nearest_existing(p.parent), flag, p)
    if p.exists():
        if not p.is_file():
            raise InputError(f"{flag} {path}: not a regular file")
        try:
            with open(p, "ab"):  # opens for writing, writes nothing
                pass
        except OSError as e:
            raise InputError(f"{flag} {path}: cannot write it ({e.strerror or type(e).__name__})") from None
    return p


def output_dir(flag: str, path: str | Path) -> Path:
    """A folder this command writes in: made if missing (like mkdir), in a folder that exists."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {path}: is a file; give a folder")
    if not p.exists():
        _parent_exists(flag, path, p.parent)
    _writable_dir(_nearest_existing(p), flag, p)
    return p


def input_file(flag: str, path: str | Path, what: str = "file") -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a {what}")
    if not p.exists():
        raise InputError(f"{p}: no such {what}")
    if not p.is_file():
        raise InputError(f"{flag} {path}: not a regular file")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    return p


def _head(p: Path, n: int = 65536) -> bytes:
    with open(p, "rb") as f:
        return f.read(n)


def _first_object(p: Path) -> dict | None | str:
    """The first non-blank line of a text file parsed as JSON: a dict, None (no line) or
    'binary' / 'not-json'."""
    head = _head(p)
    if head[:2] == b"\x1f\x8b" or b"\x00" in head:
        return "binary"
    for raw in head.splitlines():
        if raw.strip():
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                return "not-json"
            return obj if isinstance(obj, dict) else "not-json"
    return None


def _is_journal(obj: Any) -> bool:
    return isinstance(obj, dict) and "op_code" in obj


def text_file(flag: str, path: str | Path) -> Path:
    """An input that must be a text file (JSONL lines): not compressed, not binary."""
    p = input_file(flag, path)
    if _first_object(p) == "binary":
        raise InputError(f"{flag} {path}: not a text file (binary or compressed)")
    return p


def dataset_file(flag: str, path: str | Path, parents: bool = False) -> Path:
    """A measurement JSONL records are appended to: writable, and if it exists already, one of
    measurement records (not an Optuna journal, not binary). `parents` as for output_file."""
    p = output_file(flag, path, parents=parents)
    if p.exists() and p.stat().st_size:
        first = _first_object(p)
        if _is_journal(first):
            raise InputError(f"{flag} {path}: is an Optuna journal (give it to --storage), not a measurement JSONL")
        if first in ("binary", "not-json"):
            raise InputError(f"{flag} {path}: is not a JSONL of measurement records; give a new file or one "
                             f"'advisor measure' / 'advisor tune' wrote")
    return p


def database_url(flag: str, url: str, timeout_s: float = 5.0) -> str:
    """An RDB URL whose driver is installed and whose server answers within `timeout_s`."""
    from advisor.study_storage import rdb_url, redact

    shown = redact(url)
    require("sqlalchemy", f"{flag} {shown}")
    import sqlalchemy as sa

    try:
        u = sa.engine.make_url(rdb_url(url))
    except sa.exc.ArgumentError:
        raise InputError(f"{flag} {shown}: not a database URL (postgresql://user:pass@host/db, sqlite:///file.db)") from None
    try:
        dialect = u.get_dialect()
        dialect.import_dbapi()
    except sa.exc.NoSuchModuleError:
        raise InputError(f"{flag} {shown}: unknown database kind {u.drivername!r}") from None
    except ImportError as e:
        hint = {"postgresql": "psycopg2-binary", "mysql": "pymysql (and a mysql+pymysql:// URL)"}.get(u.get_backend_name(), "its DB-API driver")
        raise InputError(f"{flag} {shown}: the {u.get_backend_name()} driver is not installed "
                         f"({getattr(e, 'name', None) or e}); pip install {hint}") from None
    if u.get_backend_name() == "sqlite":
        db = u.database
        if db and db != ":memory:":
            output_file(flag, db)
        return url
    args = {"connect_timeout": max(1, int(timeout_s))} if u.get_backend_name() in ("postgresql", "mysql") else {}
    try:
        eng = sa.create_engine(u, connect_args=args, poolclass=sa.pool.NullPool)
        with eng.connect():
            pass
        eng.dispose()
    except Exception as e:  # noqa: BLE001 - network, auth or database missing: one line
        msg = " ".join(str(getattr(e, "orig", None) or e).split())[:200]
        raise InputError(f"{flag} {shown}: cannot connect ({type(getattr(e, 'orig', None) or e).__name__}: {msg})") from None
    return url


def storage(flag: str, spec: str, parents: bool = False) -> str:
    """A study storage to write: an RDB URL (driver, reachable) or an Optuna journal file
    (writable; an existing one must be a journal, not a measurement JSONL or anything else).
    `parents` as for output_file."""
    if "://" in str(spec):
        return database_url(flag, spec)
    p = output_file(flag, spec, parents=parents)
    if p.exists() and p.stat().st_size:
        first = _first_object(p)
        if not _is_journal(first):
            what = ("a measurement JSONL (give it to --dataset)" if isinstance(first, dict) and "schema" in first
                    else "not an Optuna journal file")
            raise InputError(f"{flag} {spec}: is {what}; give a new file or an 'advisor tune' journal")
    return str(spec)


def study_storage(flag: str, spec: str) -> str:
    """A study storage to read (fit --study): an existing journal file or a reachable URL."""
    if "://" in str(spec):
        return database_url(flag, spec)
    if not Path(spec).expanduser().exists():  # the words advisor.study uses for it too
        raise InputError(f"{Path(spec).expanduser()}: no such study journal file")
    p = input_file(flag, spec)
    if not _is_journal(_first_object(p)) and p.stat().st_size:
        raise InputError(f"{flag} {spec}: not an Optuna journal file (an 'advisor tune' --storage)")
    return str(spec)


def calibration(flag: str, spec: str) -> str:
    if str(spec).lower() in ("default", "none", "off", "analytical"):
        return spec
    if not Path(spec).expanduser().exists():  # the words models.calibrate uses for it too
        raise InputError(f"{spec}: no such calibration file")
    input_file(flag, spec)
    return spec


def study_paths(storage_spec: str, dataset: str | Path | None) -> None:
    """A study's storage and dataset (the defaults included) before the study opens: the journal
    (and its lock and spool beside it) or the database, and the measurement JSONL. Their folders
    may be missing here (the default data/measurements/ is made); the CLI's PATHS have already
    refused a missing folder in a path the user gave."""
    storage("--storage", storage_spec, parents=True)
    if dataset is not None:
        dataset_file("--dataset", dataset, parents=True)
        if "://" not in storage_spec and Path(storage_spec).expanduser().resolve() == Path(dataset).expanduser().resolve():
            raise _conflict("--storage", "--dataset", "the journal and the measurement JSONL must be two files")


# flag -> check of a path-valued option (a str / Path value; numbers go to NUMBERS)
PATHS: dict[str, Callable[[str, Any], Any]] = {
    "--storage": storage,
    "--dataset": dataset_file,
    "--out": output_file,
    "--html": output_file,
    "--output": lambda f, p: output_file(f, p, suffix=".joblib"),
    "--batch": lambda f, p: p if str(p) == "-" else text_file(f, p),
    "--profile": lambda f, p: input_file(f, p, "profile file"),
    "--from-trace": input_file,
    "--data": lambda f, p: p if any(ch in str(p) for ch in "*?[") else text_file(f, p),
    "MORE": lambda f, p: p if any(ch in str(p) for ch in "*?[") else text_file("--data", p),
    "--study": study_storage,
    "--calibration": calibration,
    "source": lambda f, p: p if "://" in str(p) else input_file("STUDY|DATASET", p),  # advisor report
    "--trace-dir": output_dir,
    "--run-dir": output_dir,
}


# ---------------------------------------------------------------- quantities with units (plan)
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_TOKEN_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DURATION_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_ENERGY_UNITS = {"wh": 3600.0, "kwh": 3.6e6, "mwh": 3.6e9, "gwh": 3.6e12, "j": 1.0, "mj": 1e6, "gj": 1e9,
                 "tj": 1e12}


def _quantity(flag: str, text: Any, units: Mapping[str, float], example: str) -> float:
    """A positive finite number with a unit of `units` (case-insensitive), in base units."""
    m = _QUANTITY.match(str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in units:
        raise InputError(f"{flag} {text!r}: expected a number and a unit ({', '.join(u or '(none)' for u in units)}), "
                         f"e.g. {example}")
    v = float(m.group(1)) * units[unit]
    if not math.isfinite(v) or v <= 0:
        raise InputError(f"{flag} {text!r}: must be a positive finite amount, e.g. {example}")
    return v


def tokens(flag: str, text: Any) -> int:
    """A token count: 15T, 15.6e12, 2.5e12, 900B, 16M (k/M/B or G/T = 1e3/1e6/1e9/1e12)."""
    return int(round(_quantity(flag, text, _TOKEN_UNITS, "15T or 2.5e12")))


def duration_s(flag: str, text: Any) -> float:
    """A duration in seconds: 60d, 1440h, 90min, 3600s, 8w (a bare number is refused: which unit?)."""
    return _quantity(flag, text, _DURATION_UNITS, "60d or 1440h")


def energy_j(flag: str, text: Any) -> float:
    """An energy in joules: 2.5GWh, 900MWh, 500kWh, 3.6e12J (a bare number is refused)."""
    return _quantity(flag, text, _ENERGY_UNITS, "2.5GWh or 900MWh")


def gpus_spec(flag: str, text: Any) -> tuple[str, int, bool]:
    """GPU:N (exactly N GPUs), GPU:<=N (any whole number of nodes up to N GPUs) or GPU (up to the
    plan's default limit, returned as 0): (catalog GPU name, N, exact)."""
    from advisor.catalog import load_gpu

    name, sep, rest = str(text).partition(":")
    gpu = load_gpu(name.strip())
    if not sep:
        return gpu.name, 0, False
    exact = not rest.strip().startswith("<=")
    count = rest.strip()[0 if exact else 2:].strip()
    if not count.isdigit() or int(count) < 1:
        raise InputError(f"{flag} {text!r}: expected GPU:N or GPU:<=N with N a positive integer, e.g. h100:<=4096")
    n = int(count)
    if exact and n % gpu.gpus_per_node and n > gpu.gpus_per_node:
        raise InputError(f"{flag} {text!r}: {n} GPUs is not a whole number of {gpu.gpus_per_node}-GPU "
                         f"{gpu.name} nodes")
    return gpu.name, n, exact


# flag -> check of a string option that carries a quantity
STRINGS: dict[str, Callable[[str, Any], Any]] = {
    "--tokens": tokens, "--max-gbs-tokens": tokens, "--deadline": duration_s, "--budget": energy_j,
    "--gpus": gpus_spec,
}


# --------------------------------------------------------------------------------- layouts
LAYOUT_INTS = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "gbs", "seq", "pp_first_layers", "pp_last_layers")
LAYOUT_BOOLS = ("sequence_parallel", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                "tp_comm_overlap", "gradient_accumulation_fusion", "account_for_embedding", "account_for_loss", "moe_pad_to_capacity", "moe_a2a_overlap",
                "moe_shared_expert_overlap", "moe_router_fusion", "moe_permute_fusion", "fsdp")


def as_flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def layout_values(values: Mapping[str, Any], where: str = "", name: Callable[[str], str] = str) -> dict[str, Any]:
    """The layout keys of `values` checked (None = unset): positive integers, bools, the
    precision and recompute names; an uneven pipeline split only with pp > 1. Returns them with
    integral floats made ints. `where` prefixes the messages ('line 3: '); `name` spells a key
    (as_flag for the CLI's flags)."""
    out = dict(values)
    for k in LAYOUT_INTS:
        if out.get(k) is not None:
            out[k] = number(f"{where}{name(k)}", out[k], lo=1, integer=True)
    for k in LAYOUT_BOOLS:
        v = out.get(k)
        if v is not None and not isinstance(v, bool):
            raise InputError(f"{where}{name(k)} must be true or false, got {v!r}")
    v = out.get("pipeline_layout")
    if v is not None and not isinstance(v, str):
        raise InputError(f"{where}{name('pipeline_layout')} must be a string, got {v!r}")
    for k, choices in (("precision", PRECISIONS), ("fp8_recipe", FP8_RECIPES), ("recompute", RECOMPUTE_MODES)):
        v = out.get(k)
        if v is not None and v not in choices:
            raise InputError(f"{where}{name(k)} must be one of {', '.join(choices)}, got {v!r}")
    if out.get("recompute_layers") is not None:
        out["recompute_layers"] = number(f"{where}{name('recompute_layers')}", out["recompute_layers"], lo=0, integer=True)
    mods = out.get("recompute_modules")
    if mods is not None:
        if isinstance(mods, str):  # the CLI's comma-separated form
            mods = [m.strip() for m in mods.split(",") if m.strip()]
        if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
            raise InputError(f"{where}{name('recompute_modules')} must be a list of module names, got {mods!r}")
        bad = [m for m in mods if m not in RECOMPUTE_MODULES]
        if bad:
            raise InputError(f"{where}{name('recompute_modules')}: unknown module {bad[0]!r}; "
                             f"choose from {', '.join(RECOMPUTE_MODULES)}")
        out["recompute_modules"] = tuple(mods)
    for k, choices in (("moe_dispatcher", MOE_DISPATCHERS), ("moe_router", MOE_ROUTERS)):
        v = out.get(k)
        if v is not None and v not in choices:
            raise InputError(f"{where}{name(k)} must be one of {', '.join(choices)}, got {v!r}")
    if out.get("moe_capacity_factor") is not None:
        out["moe_capacity_factor"] = number(f"{where}{name('moe_capacity_factor')}", out["moe_capacity_factor"],
                                            lo=0.01, hi=64.0)
    if out.get("cpu_offload_layers") is not None:  # activation offloading: 0 = none
        out["cpu_offload_layers"] = number(f"{where}{name('cpu_offload_layers')}", out["cpu_offload_layers"], lo=0,
                                           integer=True)
    split = [k for k in ("pp_first_layers", "pp_last_layers") if out.get(k) is not None]
    if split and (out.get("pp") or 1) < 2:
        raise InputError(f"{where}{name(split[0])} sets an uneven pipeline split, which needs "
                         f"{name('pp')} > 1 (it is {out.get('pp') or 1})")
    return out


# -------------------------------------------------------------------------------- conflicts
def parse_sets(sets: Iterable[str]) -> dict[str, str]:
    """--set KEY=VALUE strings -> {key: raw value}; a key given twice with different values is
    an error naming both (the typed parse and the known keys are models.overrides.parse_sets)."""
    seen: dict[str, str] = {}
    for s in sets or ():
        if "=" not in str(s):
            continue  # parse_sets says what is wrong with it
        k, v = (x.strip() for x in str(s).split("=", 1))
        k = k.replace("-", "_")
        k = {"power_cap_w": "power_cap", "num_nodes": "nodes", "world_size": "gpus"}.get(k, k)
        if k in seen and seen[k] != v:
            raise InputError(f"--set {k}={seen[k]} and --set {k}={v} conflict; give one")
        seen[k] = v
    return seen


def same_number(a: Any, b: str) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def set_conflicts(sets: Iterable[str], flags: Mapping[str, Any], given: set[str]) -> None:
    """A --set of a knob that also has its own flag on the command line, with another value."""
    s = parse_sets(sets)
    for name, value in flags.items():
        key = "power_cap" if name == "power_cap" else name
        if name in given and key in s and not same_number(value, s[key]):
            flag = as_flag(name)
            raise InputError(f"{flag} {value} and --set {key}={s[key]} conflict; give one")


def _conflict(a: str, b: str, why: str) -> InputError:
    return InputError(f"{a} and {b} conflict: {why}")


# ----------------------------------------------------------------------------------- extras
# import name -> (distribution to name, extra that installs it)
EXTRAS = {
    "optuna": ("Optuna", "tune"), "ray": ("Ray", "tune"), "sqlalchemy": ("SQLAlchemy (with Optuna)", "tune"),
    "sklearn": ("scikit-learn", "fit"), "torch": ("torch", "gpu"), "megatron": ("megatron-core", "gpu"),
    "amdsmi": ("amdsmi", "amd"), "matplotlib": ("matplotlib", "report"),
}


def install_hint(module: str) -> str | None:
    """'<dist>, which is not installed: pip install 'advisor[<extra>]'' for a module of an extra."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        return None
    dist, extra = EXTRAS[top]
    return f"{dist}, which is not installed: pip install 'advisor[{extra}]'"


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str) -> None:
    """One line naming the install command when `module` (of an extra) is missing."""
    if not installed(module):
        raise InputError(f"{what} needs {install_hint(module) or module + ', which is not installed'}")


# ------------------------------------------------------------------------------- per command
def _check_tune(p: dict, given: set[str]) -> None:
    require("optuna", "advisor tune")
    runner = p.get("runner")
    if runner == "simulate":
        for name in ("steps", "warmup"):
            if name in given:
                raise _conflict(f"--{name}", "--runner simulate", "it sets the megatron runner's steps")
    elif "sigma" in given:
        raise _conflict("--sim-sigma", f"--runner {runner}", "it sets the simulated runner's noise")
    if p.get("sampler") == "surrogate":
        require("sklearn", "--sampler surrogate")
    addr = p.get("ray_address")
    if addr not in ("inline", "none") and not p.get("dry_run"):
        require("ray", "advisor tune with Ray (or --ray-address inline)")
    st, ds = p.get("storage"), p.get("dataset")
    if st and ds and "://" not in st and Path(st).expanduser().resolve() == Path(ds).expanduser().resolve():
        raise _conflict("--storage", "--dataset", "the journal and the measurement JSONL must be two files")
    if runner == "megatron" and addr in (None, "inline", "none") and not p.get("dry_run"):
        where = "on this machine" if addr else "on this machine's local Ray"
        megatron_runner(f"--runner megatron measures {where} and", "--runner simulate tries a study without GPUs")


def megatron_runner(what: str, instead: str) -> None:
    """The built-in megatron-core runner's modules (the `gpu` extra) are installed, else one line:
    '<what> needs torch, which is not installed: pip install 'advisor[gpu]' (<instead>)'."""
    for mod in ("torch", "megatron.core"):
        if not installed(mod):
            raise InputError(f"{what} needs {install_hint(mod)} ({instead})")


def _check_fit(p: dict, given: set[str]) -> None:
    require("sklearn", "advisor fit")
    if p.get("study"):
        require("optuna", "advisor fit --study")
    out = p.get("output")
    if out:
        o = Path(out).expanduser().resolve()
        for f in list(p.get("data") or []) + list(p.get("more") or []):
            if Path(f).expanduser().resolve() in (o, o.with_suffix(".json")):
                raise _conflict("--output", f"--data {f}", "the calibration would overwrite the measurements")


def _check_thermal(p: dict, given: set[str]) -> None:
    trace = p.get("from_trace")
    if trace is not None:
        for name in ("seconds", "idle", "cool", "rate"):
            if name in given:
                raise _conflict(f"--{name}", "--from-trace", "a recorded trace is fitted, nothing is measured")
        out = p.get("out")
        if out and Path(out).expanduser().resolve() in (Path(trace).expanduser().resolve(),):
            raise _conflict("--out", "--from-trace", "the profile would overwrite the trace")


def _check_recommend(p: dict, given: set[str]) -> None:
    set_conflicts(p.get("sets") or (), {k: p.get(k) for k in ("seq", "gbs", "precision", "power_cap")}, given)


def _check_predict(p: dict, given: set[str]) -> None:
    names = LAYOUT_INTS + ("precision", "recompute", "sequence_parallel", "distributed_optimizer", "power_cap")
    set_conflicts(p.get("sets") or (), {k: p.get(k) for k in names if k in p}, given)
    if p.get("batch") is None:
        layout_values({k: p.get(k) for k in LAYOUT_INTS if k in p}, name=as_flag)
    elif "power_caps" in given:
        raise _conflict("--power-caps", "--batch", "the cap sweep is for one layout; a batch line is predicted "
                        "at its own power_cap_w (default --power-cap)")


def _check_launch(p: dict, given: set[str]) -> None:
    """launch runs the command whatever happens to the placement (a profile it cannot use, no
    NVML, a bad layout: one warning line), but a --profile path that does not exist is a typo, not
    a placement that failed: refused before anything runs."""
    for f in p.get("profile") or ():
        if not Path(f).expanduser().exists():
            raise InputError(f"--profile {f}: no such profile file (leave --profile out to launch unplaced)")


def _check_plan(p: dict, given: set[str]) -> None:
    """plan: the GPU of --gpus is the cluster's when both are given."""
    if p.get("cluster") and p.get("gpus"):
        from advisor.catalog import load_cluster

        gpu = gpus_spec("--gpus", p["gpus"])[0]
        c = load_cluster(p["cluster"])
        if c.gpu.name != gpu:
            raise _conflict(f"--gpus {p['gpus']}", f"--cluster {p['cluster']}",
                            f"the cluster's nodes hold {c.gpu.name}, not {gpu}")


COMMAND_CHECKS: dict[str, Callable[[dict, set], None]] = {
    "plan": _check_plan,
    "tune": _check_tune, "fit": _check_fit, "thermal-profile": _check_thermal,
    "recommend": _check_recommend, "predict": _check_predict, "launch": _check_launch,
}
# commands whose flags skip the generic checks (numbers, PATHS) and get only their COMMAND_CHECKS:
# launch runs the user's command whatever happens to the placement (its own rule)
EXEMPT = {"launch"}


def _flag_of(param) -> str:
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
    return opts[0] if opts else ("MORE" if param.name == "more" else param.name)


def check_params(command: str, params: Mapping[str, Any], flags: Mapping[str, str], given: set[str]) -> None:
    """Every check of one command's parsed parameters (flags: param name -> its --flag)."""
    check = COMMAND_CHECKS.get(command)
    if command in EXEMPT:
        if check is not None:
            check(dict(params), given)
        return
    for name, value in params.items():
        if value is None:
            continue
        flag = flags.get(name, name)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                if isinstance(v, float) and not math.isfinite(v):
                    raise InputError(f"{flag} must be a finite number, got {v!r}")
                if flag in NUMBERS:
                    NUMBERS[flag](flag, v)
            elif isinstance(v, (str, os.PathLike)) and flag in PATHS:
                PATHS[flag](flag, v)
            elif isinstance(v, str) and flag in STRINGS:
                STRINGS[flag](flag, v)
    if check is not None:
        check(dict(params), given)


# ------------------------------------------------------------------------------- CLI wiring
def _click():
    """The click in use: typer >= 0.2x vendors its own copy (typer._click), older typer uses click."""
    import typer

    return importlib.import_module(typer.BadParameter.__module__.rsplit(".", 1)[0])


def current_context():
    c = _click()
    getter = getattr(c, "get_current_context", None) or importlib.import_module(c.__name__ + ".globals").get_current_context
    return getter(silent=True)


def given_params(ctx=None) -> set[str]:
    """Names of the parameters given on the command line (or by environment), not defaulted."""
    ctx = ctx or current_context()
    if ctx is None:
        return set()
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            out.add(name)
    return out


def install(group) -> None:
    """Wrap the callback of every command of the click `group` with check_params."""
    for name, cmd in getattr(group, "commands", {}).items():
        cb = cmd.callback
        if cb is None or getattr(cb, "_validated", False):
            continue
        flags = {p.name: _flag_of(p) for p in cmd.params}

        def wrapped(*args, __cb=cb, __name=name, __flags=flags, **kwargs):
            check_params(__name, kwargs, __flags, given_params())
            return __cb(*args, **kwargs)

        functools.update_wrapper(wrapped, cb)
        wrapped._validated = True
        cmd.callback = wrapped


# ------------------------------------------------------------------------------------- JSON
def finite_json(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (strict JSON has no NaN / Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def dumps(obj: Any, **kw) -> str:
    try:  # all finite (the usual case): the same text without a copy of `obj`
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(finite_json(obj), allow_nan=False, **kw)


def _refuse_constant(name: str):
    raise ValueError(f"{name}: numbers must be finite")


def loads_strict(text: str) -> Any:
    """json.loads that refuses NaN / Infinity / -Infinity (Python's json accepts them)."""
    return json.loads(text, parse_constant=_refuse_constant)


# Megatron's long names of the layout keys, for the hint of an unknown key
LONG_NAMES = {"tensor_parallel": "tp", "tensor_model_parallel_size": "tp", "pipeline_parallel": "pp",
              "pipeline_model_parallel_size": "pp", "context_parallel": "cp", "context_parallel_size": "cp",
              "expert_parallel": "ep", "expert_model_parallel_size": "ep", "data_parallel": "dp",
              "virtual_pipeline": "vp", "micro_batch_size": "mbs", "global_batch_size": "gbs",
              "seq_length": "seq", "sequence_length": "seq", "power_cap": "power_cap_w"}


def unknown_key(key: str, known: Iterable[str], where: str = "") -> InputError:
    known = list(known)
    from advisor.catalog.errors import did_you_mean

    did = f"; did you mean {LONG_NAMES[key]!r}?" if LONG_NAMES.get(key) in known else did_you_mean(key, known)
    return InputError(f"{where}unknown key {key!r}{did} (known: {', '.join(sorted(known))})")
