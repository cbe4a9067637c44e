"""Processes that must not outlive their parent (runners/parent_watch.py): a torchrun worker left
behind keeps its GPU memory, and the next job on that GPU runs out of memory."""
import os
import signal
import subprocess
import sys

import pytest

from advisor.runners import parent_watch
from support import assert_dies_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

RUNNERS = os.path.dirname(parent_watch.__file__)
# A stand-in for torchrun's agent: starts a worker that arms die_with_parent the way
# megatron_worker.py does (imported as a sibling module), prints its pid, then waits.
AGENT = f"""
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", '''
import sys, time
sys.path.insert(0, {RUNNERS!r})
from parent_watch import die_with_parent
assert die_with_parent()
print("armed", flush=True)
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline().strip() == "armed"
print(worker.pid, flush=True)
time.sleep(120)
"""


def test_worker_dies_when_its_agent_is_sigkilled():
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    # no handler, no cleanup in the agent: as when Ray or the OOM killer takes torchrun down
    assert_dies_with_parent(agent, lambda: int(agent.stdout.readline()), "the worker died while its agent lived",
                            "the worker outlived its agent", settle_s=0.5)


def test_a_parent_already_gone_means_the_signal_comes_at_once():
    # The pid the caller believed to be its parent is not its parent now: it was reparented
    # before it could arm the signal.
    code = (f"import sys, os; sys.path.insert(0, {RUNNERS!r}); from parent_watch import die_with_parent; "
            "die_with_parent(parent=os.getppid() + 1); import time; time.sleep(30)")
    p = subprocess.run([sys.executable, "-c", code], timeout=20)
    assert p.returncode == -signal.SIGKILL

