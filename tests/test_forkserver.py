"""The test launcher's fork server: a forked rank sees what ``python <script> <args>`` would, and ends as it would."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import forkserver
import pytest
from helpers import ROOT, child_env

pytestmark = pytest.mark.multiproc

SCRIPT = """
import json, os, signal, sys
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
        "rank": os.environ.get("RANK"), "only_job": os.environ.get("ONLY_JOB"), "rank_zero": rank_zero_only.rank,
        "seed": torch.initial_seed(), "hash": hash("a string"), "pgid": os.getpgid(0), "pid": os.getpid(),
    }))
elif mode == "exit":
    sys.exit(7)
elif mode == "raise":
    raise RuntimeError("raised by the script")
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "sleep":
    import time
    time.sleep(120)
"""


def test_a_forked_rank_is_the_script_run_by_a_fresh_interpreter_and_ends_as_one(tmp_path):
    script = tmp_path / "scripts" / "job.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    servers = [forkserver.Server(child_env(), ROOT, tmp_path / f"server{i}.log") for i in range(2)]
    try:

        def run(server, mode, log, pgid=0, **env):
            proc = server.spawn([str(script), mode], env=child_env(**env), cwd=str(tmp_path), log=str(log), pgid=pgid)
            return proc, proc.wait()

        leader = servers[0].spawn(
            [str(script), "sleep"], env=child_env(), cwd=str(tmp_path), log=str(tmp_path / "l"), pgid=0
        )
        assert run(servers[0], "report", tmp_path / "r0.log", RANK="1", ONLY_JOB="x")[1] == 0
        assert run(servers[0], "report", tmp_path / "r1.log", pgid=leader.pid, RANK="0")[1] == 0
        assert run(servers[1], "report", tmp_path / "r2.log", RANK="0")[1] == 0
        leader.kill()
        assert leader.wait() == -signal.SIGKILL  # as Popen.returncode
        r0, r1, r2 = (json.loads((tmp_path / f"r{i}.log").read_text().splitlines()[-1]) for i in range(3))

        assert r0["argv"] == [str(script), "report"] and r0["path0"] == str(script.parent) and r0["main"] == "__main__"
        assert r0["cwd"] == str(tmp_path) and r0["rank"] == "1" and r0["only_job"] == "x"
        assert r0["rank_zero"] == 1 and r1["rank_zero"] == 0  # Lightning's, read again from each rank's environment
        assert r1["only_job"] is None  # the environment is the job's, not the previous one's
        assert r0["pgid"] == r0["pid"]  # a group of its own...
        assert r1["pgid"] == leader.pid  # ...or the one asked for (the first rank's)
        assert len({r0["seed"], r1["seed"], r2["seed"]}) == 3  # torch's initial seed drawn in each
        assert r0["hash"] != r2["hash"]  # ranks from different slots: separately started interpreters

        _, code = run(servers[1], "exit", tmp_path / "e.log")
        assert code == 7
        _, code = run(servers[1], "raise", tmp_path / "x.log")
        assert code == 1 and "RuntimeError: raised by the script" in (tmp_path / "x.log").read_text()
        _, code = run(servers[1], "kill", tmp_path / "k.log")
        assert code == -signal.SIGKILL

        with pytest.raises(RuntimeError, match="unknown request"):
            servers[0].request({"op": "nonsense"})
        assert servers[0].alive()  # a bad request answers an error; the server goes on
        assert run(servers[0], "exit", tmp_path / "e2.log")[1] == 7

        orphan = servers[1].spawn(
            [str(script), "sleep"], env=child_env(), cwd=str(tmp_path), log=str(tmp_path / "s"), pgid=0
        )
        servers[1].proc.kill()  # a server gone: its ranks go with it, none is left running
        deadline = time.monotonic() + 20
        while _running(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(orphan.pid)
    finally:
        for server in servers:
            server.close()
    assert all(not server.alive() for server in servers)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
