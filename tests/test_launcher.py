"""The server launcher that the tests, the demo and the benches share."""

from __future__ import annotations

import pytest

from teacher_server.launcher import ServerProcess, ServerStartError


def test_the_server_runs_this_tree_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    # A working directory with a teacher_server package of its own (another checkout, say)
    # must not shadow the one the launcher belongs to: `-m` would put it first on sys.path.
    impostor = tmp_path / "teacher_server"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("")
    (impostor / "__main__.py").write_text("print('the working directory\\'s teacher_server'); raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    with ServerProcess("--model", "builtin:tiny", "--device", "cpu", startup_timeout_s=120) as server:
        assert server.grpc_port and server.http_port
    assert "the working directory's teacher_server" not in server.log, server.log


def test_a_server_that_exits_at_start_reports_its_exit_code_and_output(tmp_path):
    with pytest.raises(ServerStartError, match="exited with code [1-9]") as e:
        ServerProcess("--model", str(tmp_path / "missing-model"), startup_timeout_s=120)
    assert e.value.exit_code not in (None, 0)
    assert "missing-model" in e.value.log, e.value.log


def test_a_server_that_is_not_ready_in_time_says_so():
    with pytest.raises(ServerStartError, match="did not print READY within 0.01 s") as e:
        ServerProcess("--model", "builtin:tiny", startup_timeout_s=0.01)
    assert e.value.exit_code is None
